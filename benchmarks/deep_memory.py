"""Deep-memory presets (titans, omeganet, atlas) through the chunked form: forward+backward time,
tokens per second and peak memory (issue 24), with titans-pytorch's NeuralMemory beside them.

    python benchmarks/deep_memory.py                                  # B4 T4096 H8 D128, chunk 64
    python benchmarks/deep_memory.py --presets titans --shape 1,2048,8,128 --reference
    python benchmarks/deep_memory.py --compile-only                   # XLA's memory analysis only
    python benchmarks/deep_memory.py --tiny                           # CPU check of the script itself

Entries (``--presets``): titans, ttt_mlp, omeganet, dla, atlas (Newton–Schulz of the chunk-end
momentum, ``ns_every="chunk"``: the dual form), atlas_pp (the same on Atlas++'s gated MLP), atlas_ns_bf16 (the same with Newton–Schulz on bf16 operands,
``ns_dtype="bfloat16"``), atlas_ns_direct (NS iterated on the [d_φ, h] momentum itself, as before
the Gram route became the default for tall momenta: ``ns_method="direct"``), atlas_token (NS on every m_t as the paper: the materialising
form, O(chunk·|θ|) per sequence and head — it may run out of memory or take minutes), and
titans_pytorch (``NeuralMemory(dim=H·D, heads=H, dim_head=D, chunk_size=chunk)``, bf16 autocast on
GPU, projections included, forward+backward of its output's sum; needs torch and titans-pytorch,
e.g. from ../shared/bench's wheels) and titans_pytorch_every_chunk (the same with
``batch_size=chunk``), and our op on titans-pytorch's schedule: titans_chunk_steps and
titans_chunk_steps_every_chunk (`ops.deep_memory.chunk_step_memory` with ``segment`` None and =
chunk, its memory MLPMemory(2, 4·D, residual, LayerNorm) as titans-pytorch's ResidualNorm(MemoryMLP)
without the norm's gain); and our whole titans memory layer (`models.layers.MemoryLayer`, width H·D,
projections, short convolution, gates and output gate included, as titans-pytorch's NeuralMemory
includes its own), forward+backward with respect to its input and parameters: titans_layer (the
preset's per-token steps), titans_layer_chunk_steps and titans_layer_chunk_steps_every_chunk (its
``step_schedule`` "chunk_from_theta0" and "chunk": titans-pytorch's two schedules), and
titans_layer_packed / titans_layer_chunk_steps_packed (the same with 8 equal documents packed in
every row, segment ids as training passes them); omeganet_layer / atlas_layer (NS per chunk) and
their _packed: the same layer around those memories. With its default ``batch_size=None`` titans-pytorch takes every chunk's
gradients at the sequence's initial weights (one batched call, no chain from chunk to chunk) and
applies momentum and decay per chunk; ``batch_size=chunk`` takes each chunk's gradients at the
weights after the chunk before, the chunk-start point our titans preset uses (Titans §3.2 with
mini-batches of one chunk). Ours also reads θ_t and applies momentum and decay per token, where
titans-pytorch reads each chunk with the weights after the chunk before.

Ours: jax.vjp of the memory layer's outputs with respect to q, k, v, the per-token knobs and θ₀
(the memory alone, no model around it), float32. ``--reference`` adds the materialising chunked
form (the form before the dual form) for the same calls. Every entry runs in its own process, so
that the device's peak memory (peak_bytes_in_use, GPU) is that entry's own and an out-of-memory
failure ("OOM") or a time-out leaves the others alone; XLA's compiled temp + argument + output bytes
are reported as well. A call slower than 2 s is timed over 2 calls only.
TFLOP/s: the matmul FLOPs of the forward+backward program as traced, rematerialisation included
(`flops.dot_flops`), over its time, and the share of the device's dense peak for that mix of bf16
and TF32 products; not given where a Pallas kernel or a while loop hides some of the products.

Writes deep_memory.json and deep_memory.md (a markdown table) to --out or $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import import_tree, log, save_json, shape_arg, time_jax, trace_kernels  # noqa: E402
import flops  # noqa: E402

ENTRIES = {   # entry name -> (preset, preset options, what the table says)
    "titans": ("titans", {}, "titans"),
    "ttt_mlp": ("ttt_mlp", {}, "ttt_mlp"),
    "omeganet": ("omeganet", {}, "omeganet"),
    "dla": ("dla", {}, "dla"),
    "atlas": ("atlas", {"ns_every": "chunk"}, "atlas, NS per chunk"),
    "atlas_token": ("atlas", {"ns_every": "token"}, "atlas, NS per token"),
    "atlas_pp": ("atlas_pp", {"ns_every": "chunk"}, "atlas_pp (gated MLP), NS per chunk"),
    "atlas_ns_bf16": ("atlas", {"ns_every": "chunk", "ns_dtype": "bfloat16"}, "atlas, NS per chunk on bf16 operands"),
    "atlas_ns_bf16_gram": ("atlas", {"ns_every": "chunk", "ns_dtype": "bfloat16", "ns_method": "gram"},
                           "atlas, NS per chunk on bf16 operands through the Gram matrix"),
    "atlas_ns_direct": ("atlas", {"ns_every": "chunk", "ns_method": "direct"},
                        "atlas, NS per chunk iterated on the momentum itself (no Gram route)"),
}
TORCH_ENTRY = "titans_pytorch"
# titans-pytorch entry -> its NeuralMemory's batch_size (None: its default; "chunk": the chunk size)
TORCH_ENTRIES = {TORCH_ENTRY: None, "titans_pytorch_every_chunk": "chunk"}
# our titans-pytorch-schedule entries (`ops.deep_memory.chunk_step_memory`) -> its segment (None: the
# whole sequence, as titans-pytorch's default; "chunk": the chunk size, as its batch_size=chunk)
CHUNK_STEP_ENTRIES = {"titans_chunk_steps": None, "titans_chunk_steps_every_chunk": "chunk"}
# our whole memory layer (`models.layers.MemoryLayer`: projections, short convolution, gates, output
# norm and gate, as titans-pytorch's NeuralMemory has its own) -> (its memory, an ENTRIES name; its
# step_schedule; packed documents a row: 0 for none, M for M equal documents with segment ids, as
# training packs them)
LAYER_ENTRIES = {"titans_layer": ("titans", "token", 0), "titans_layer_chunk_steps": ("titans", "chunk_from_theta0", 0),
                 "titans_layer_chunk_steps_every_chunk": ("titans", "chunk", 0),
                 "titans_layer_packed": ("titans", "token", 8),
                 "titans_layer_chunk_steps_packed": ("titans", "chunk_from_theta0", 8),
                 "omeganet_layer": ("omeganet", "token", 0), "omeganet_layer_packed": ("omeganet", "token", 8),
                 "atlas_layer": ("atlas", "token", 0), "atlas_layer_packed": ("atlas", "token", 8)}
TINY_SHAPE, TINY_CHUNK = (1, 128, 2, 16), 16
SLOW_CALL_S = 2.0


def build(name):
    from atlas_jax import presets
    preset, options, _ = ENTRIES[name]
    return presets.get(preset, **options)


# β = STEP_SIZE_MAX · sigmoid(·), the scale a model's memory layer gives a deep memory's step size
# (`models.layers`, step_size_max's default). Until 2026-11-29 these inputs took 0.1, at which the
# chunk-start inner loop of omeganet diverges (chunk 64: NaN from the first super-chunk on at B1
# T1024 H1 D128; the per-token recurrence stays finite): its timings up to then are of that
# computation. Every entry's outputs are checked for finiteness (``finite`` in the results).
STEP_SIZE_MAX = 1e-3


def compiled_total_gib(compiled) -> float:
    """XLA's compiled memory of an executable: temporaries, arguments and outputs, GiB (nan where
    the backend gives no analysis)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return float("nan")
    return (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes + analysis.output_size_in_bytes) / 2 ** 30


def non_finite_leaves(tree) -> list[str]:
    """The tree paths of ``tree``'s leaves that hold a NaN or an infinity."""
    import jax
    return [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(tree)
            if not bool(jax.numpy.isfinite(x).all())]


def all_finite(tree) -> bool:
    """Whether every leaf of ``tree`` (a call's outputs and gradients) is finite."""
    return not non_finite_leaves(tree)


def _unit_qk_and_v(keys, shape):
    """Unit-norm q, k and standard-normal v of ``shape`` from three PRNG keys."""
    import jax
    import jax.numpy as jnp
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return unit(jax.random.normal(keys[0], shape)), unit(jax.random.normal(keys[1], shape)), jax.random.normal(keys[2], shape)


def inputs(spec, B, T, H, D, seed=0, dtype="float32"):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q, k, v = _unit_qk_and_v(ks[:3], (B, T, H, D))
    knobs = {"beta": STEP_SIZE_MAX * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))}
    if spec.retention.needs_gate:
        knobs["g"] = jax.nn.log_sigmoid(4.0 + jax.random.normal(ks[4], (B, T, H)))
    if spec.opt_kind in ("momentum", "muon"):
        knobs["nu"] = jax.nn.sigmoid(2.0 + jax.random.normal(ks[5], (B, T, H)))
    if spec.window > 1:
        knobs["gamma"] = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    state = spec.init_state(ks[7], batch=B, heads=H, d_k=D, d_v=D)
    cotangent = jax.random.normal(ks[7], (B, T, H, D))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return q, k, v, knobs, state, cotangent.astype(dtype)


def forward_fn(spec, chunk, impl="chunk"):
    def forward(q, k, v, knobs, params, state):
        return spec(q, k, v, **knobs, initial_state=state._replace(params=params), impl=impl,
                    chunk_size=chunk)[0]
    return forward


def fwdbwd_fn(spec, chunk, impl="chunk"):
    import jax

    forward = forward_fn(spec, chunk, impl)

    def fwdbwd(q, k, v, knobs, state, cotangent):
        out, pullback = jax.vjp(lambda *a: forward(*a, state), q, k, v, knobs, state.params)
        return out, pullback(cotangent)

    return jax.jit(fwdbwd)


def _is_oom(error) -> bool:
    text = repr(error)
    return any(word in text for word in ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OutOfMemory"))


def _rates(row, count, ms, tokens):
    """A forward+backward's time into ``row``: ms, tokens/s, and the matmul TFLOP/s with its share
    of the device's peak where every product was counted."""
    import jax
    row.update({"fwd_bwd_ms": ms, "tokens_per_s": tokens / (ms / 1e3)})
    if count.complete:
        row["tflops"] = count.flops / (ms / 1e3) / 1e12
        peak = flops.peak_tflops(jax.devices()[0].device_kind, count)
        if peak:
            row["peak_tflops"], row["of_peak"] = peak, row["tflops"] / peak


def measure_ours(name, B, T, H, D, chunk, compile_only, reps, impl="chunk", dtype="float32", trace_dir=None):
    """Compiles (and unless ``compile_only`` times) one entry's forward+backward, and its forward."""
    import jax
    from atlas_jax.forms import chunked

    spec = build(name)
    args = inputs(spec, B, T, H, D, dtype=dtype)
    one = jax.tree.map(lambda x: x[0, 0], args[4])
    row = {"dual_form": chunked.runs_dual_form(spec, one, _steps(spec, args), chunk_size=chunk)}
    if not compile_only:
        forward = jax.jit(forward_fn(spec, chunk, impl))
        fwd_args = args[:4] + (args[4].params, args[4])
        try:
            row["fwd_ms"] = time_jax(forward, *fwd_args, reps=reps)
        except Exception as error:   # the forward alone is extra information: keep going
            row["fwd_error"] = repr(error)[:200]
    f = fwdbwd_fn(spec, chunk, impl)
    t = time.perf_counter()
    compiled = f.lower(*args).compile()
    row["compile_s"] = time.perf_counter() - t
    count = flops.dot_flops(f, *args)   # matmul FLOPs as executed, rematerialisation included
    row["dot_tflop"] = count.flops / 1e12
    row["dot_bf16_share"] = count.bf16_flops / count.flops if count.flops else None
    if not count.complete:
        row["flops_left_out"] = list(count.left_out)
    analysis = compiled.memory_analysis()
    if analysis is not None:
        row["compiled_temp_GiB"] = analysis.temp_size_in_bytes / 2 ** 30
        row["compiled_total_GiB"] = compiled_total_gib(compiled)
    if not compile_only:
        call = lambda: compiled(*args)
        t = time.perf_counter()
        result = jax.block_until_ready(call())
        first = time.perf_counter() - t
        non_finite = non_finite_leaves(result)
        row["finite"] = not non_finite
        if non_finite:   # which of the outputs and gradients (tree paths)
            row["non_finite"] = non_finite
        if first > SLOW_CALL_S:
            t = time.perf_counter()
            for _ in range(2):
                jax.block_until_ready(call())
            ms = (time.perf_counter() - t) / 2 * 1e3
        else:
            ms = time_jax(compiled, *args, reps=reps)
        _rates(row, count, ms, B * T)
        if trace_dir:   # where the time goes: device kernels summed by name and by the dual form's part
            from atlas_jax.forms.dual import SCOPES
            os.makedirs(trace_dir, exist_ok=True)   # the optimized HLO: what the trace's fusion names are
            with open(os.path.join(trace_dir, "fwdbwd_hlo.txt"), "w") as f:
                f.write(compiled.as_text())
            kernels, total, parts = trace_kernels(lambda: jax.block_until_ready(call()), trace_dir,
                                                  hlo_text=compiled.as_text(), scopes=tuple(SCOPES.values()))
            row["trace_total_ms"] = total
            row["trace_top"] = [(name[:90], round(ms, 3), count) for name, ms, count in kernels]
            row["trace_parts_ms"] = {part: round(ms, 3) for part, ms in sorted(parts.items(), key=lambda p: -p[1])}
        stats = jax.devices()[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            row["peak_GiB"] = stats["peak_bytes_in_use"] / 2 ** 30
    return row


def measure_titans_pytorch(B, T, H, D, chunk, compile_only, reps, batch_size=None):
    """titans-pytorch's NeuralMemory, forward+backward of its output's sum."""
    import torch
    from timing import wall_ms
    from titans_pytorch_schedule import neural_memory_class
    NeuralMemory = neural_memory_class()

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    # TorchScript's GPU fuser fails to compile its kernel for assoc-scan's scripted operator on the
    # H200 image (NVRTC: 'attribute "__global__" does not apply here') once that operator is called
    # often enough to be fused (batch_size=chunk: a scan per chunk), so it runs unfused in both
    # anchor entries (an elementwise multiply-add a scan step).
    torch._C._jit_override_can_fuse_on_gpu(False)
    torch._C._jit_set_texpr_fuser_enabled(False)
    row = {"dual_form": None, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    mem = NeuralMemory(dim=H * D, chunk_size=chunk, heads=H, dim_head=D, batch_size=batch_size).to(device)
    row["batch_size"] = batch_size
    x = torch.randn(B, T, H * D, device=device)

    def fwdbwd():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            out = mem(x)[0]
        out.float().sum().backward()
        return out

    sync = (lambda out: torch.cuda.synchronize()) if cuda else (lambda out: None)
    if compile_only:
        return row
    t = time.perf_counter()
    sync(fwdbwd())
    if time.perf_counter() - t > SLOW_CALL_S:
        t = time.perf_counter()
        for _ in range(2):
            sync(fwdbwd())
        ms = (time.perf_counter() - t) / 2 * 1e3
    else:
        ms = wall_ms(fwdbwd, sync, reps)
    row.update({"fwd_bwd_ms": ms, "tokens_per_s": B * T / (ms / 1e3)})
    if cuda:
        row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return row


def chunk_step_inputs(B, T, H, D, chunk, seed=0, dtype="float32"):
    """titans-pytorch's memory as our op takes it: the memory model's ResidualNorm(MemoryMLP) as
    MLPMemory(2, residual, LN) (its LN gain left out), step sizes at titans-pytorch's scale."""
    import jax
    import jax.numpy as jnp
    from atlas_jax.memory import MLPMemory
    memory = MLPMemory(2, 4 * D, activation="gelu", residual=True, layernorm=True)
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q, k, v = _unit_qk_and_v(ks[:3], (B, T, H, D))
    N = T // chunk
    # titans-pytorch: lr = sigmoid(·) on the channel-mean loss, i.e. β = 2 lr / D on ½‖·‖²
    beta = 2.0 / D * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    nu = jax.nn.sigmoid(jax.random.normal(ks[4], (B, N, H)))
    g = jax.nn.log_sigmoid(2.0 + jax.random.normal(ks[5], (B, N, H)))
    params = jax.vmap(lambda kk: memory.init(kk, D, D))(jax.random.split(ks[6], H))
    cotangent = jax.random.normal(ks[7], (B, T, H, D))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return memory, (q, k, v, beta, nu, g, params), cotangent.astype(dtype)


def measure_chunk_steps(B, T, H, D, chunk, compile_only, reps, segment=None, dtype="float32", trace_dir=None):
    """Our op on titans-pytorch's schedule: jax.vjp with respect to every input and θ_0."""
    import jax
    from atlas_jax.ops.deep_memory import chunk_step_memory

    memory, args, cotangent = chunk_step_inputs(B, T, H, D, chunk, dtype=dtype)
    forward = lambda *a: chunk_step_memory(*a, memory=memory, chunk_size=chunk, segment=segment)[0]

    @jax.jit
    def fwdbwd(args, cotangent):
        out, pullback = jax.vjp(forward, *args)
        return out, pullback(cotangent)

    row = {"dual_form": None, "segment": segment}
    return _time_vjp(row, fwdbwd, (args, cotangent), forward, args, B * T, compile_only, reps, trace_dir)


def _time_vjp(row, fwdbwd, fwdbwd_args, forward, forward_args, tokens, compile_only, reps, trace_dir):
    """Fills ``row`` for a jitted forward+backward ``fwdbwd(*fwdbwd_args)`` and its ``forward``:
    compile time, matmul FLOPs, XLA's compiled memory, and unless ``compile_only`` the times,
    rates, finiteness, the device's peak memory and (``trace_dir``) the trace's kernels."""
    import jax
    t = time.perf_counter()
    compiled = fwdbwd.lower(*fwdbwd_args).compile()
    row["compile_s"] = time.perf_counter() - t
    count = flops.dot_flops(fwdbwd, *fwdbwd_args)
    row["dot_tflop"] = count.flops / 1e12
    row["compiled_total_GiB"] = compiled_total_gib(compiled)
    if compile_only:
        return row
    row["fwd_ms"] = time_jax(jax.jit(forward), *forward_args, reps=reps)
    result = jax.block_until_ready(compiled(*fwdbwd_args))
    row["finite"] = all_finite(result)
    ms = time_jax(compiled, *fwdbwd_args, reps=reps)
    _rates(row, count, ms, tokens)
    if trace_dir:   # device kernels by name, and by the chunk-step op's, the packed layout's and the dual form's parts
        from atlas_jax.forms.dual import SCOPES as DUAL_SCOPES
        from atlas_jax.models.layers import LAYOUT_SCOPE
        from atlas_jax.ops.deep_memory.chunk_steps import SCOPES as CHUNK_STEP_SCOPES
        os.makedirs(trace_dir, exist_ok=True)   # the optimized HLO: what the trace's fusion names are
        with open(os.path.join(trace_dir, "fwdbwd_hlo.txt"), "w") as f:
            f.write(compiled.as_text())
        scopes = (LAYOUT_SCOPE, CHUNK_STEP_SCOPES["restart_reads"]) + tuple(
            name for name in CHUNK_STEP_SCOPES.values() if name != CHUNK_STEP_SCOPES["restart_reads"]) + tuple(
            DUAL_SCOPES.values())
        kernels, total, parts = trace_kernels(lambda: jax.block_until_ready(compiled(*fwdbwd_args)), trace_dir,
                                              hlo_text=compiled.as_text(), scopes=scopes)
        row["trace_total_ms"] = total
        row["trace_top"] = [(name[:90], round(ms, 3), count) for name, ms, count in kernels]
        row["trace_parts_ms"] = {part: round(ms, 3) for part, ms in sorted(parts.items(), key=lambda p: -p[1])}
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        row["peak_GiB"] = stats["peak_bytes_in_use"] / 2 ** 30
    return row


def measure_layer(B, T, H, D, chunk, compile_only, reps, schedule, documents=0, impl="auto", dtype="float32",
                  trace_dir=None, entry="titans"):
    """Our memory layer around ``entry``'s memory (an ENTRIES name; width H·D, H heads, float32
    parameters, ``dtype`` compute), as a model holds it: jax.vjp of its output with respect to its input and every parameter; with
    ``documents`` M > 0, each row packs M equal documents (segment ids, max_documents M)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from atlas_jax.models.layers import DTYPES, MemoryLayer

    compute = DTYPES[dtype]
    layer = MemoryLayer(build(entry), width=H * D, heads=H, impl=impl, chunk_size=chunk,
                        step_schedule=schedule, max_documents=max(documents, 1), rngs=nnx.Rngs(0), dtype=compute)
    graphdef, params = nnx.split(layer)
    kx, kc = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (B, T, H * D)).astype(compute)
    cotangent = jax.random.normal(kc, (B, T, H * D)).astype(compute)
    segment_ids = None if not documents else jnp.broadcast_to(
        jnp.arange(T, dtype=jnp.int32) * documents // T, (B, T))
    forward = lambda params, x: nnx.merge(graphdef, params)(x, segment_ids)

    @jax.jit
    def fwdbwd(params, x, cotangent):
        out, pullback = jax.vjp(forward, params, x)
        return out, pullback(cotangent)

    row = {"dual_form": None, "step_schedule": schedule, "documents": documents}
    return _time_vjp(row, fwdbwd, (params, x, cotangent), forward, (params, x), B * T, compile_only, reps, trace_dir)


def _steps(spec, args):
    """One (sequence, head)'s steps, only for asking whether the dual form covers the call."""
    import jax.numpy as jnp
    from atlas_jax.forms.common import Steps
    q, _, v, knobs, _, _ = args
    T, d = q.shape[1], spec.feature_dim(q.shape[-1])
    ones = jnp.ones((T,))
    return Steps(jnp.ones((T, d)), v[0, :, 0], jnp.ones((T, d)), ones, ones if "g" in knobs else None,
                 ones if "nu" in knobs else None, ones, None, ones)


def worker(a):
    """One entry in this process: prints ``ROW {json}``."""
    B, T, H, D = a.shape
    row = {"entry": a.worker, "form": "materialising" if a.reference else "auto (dual where covered)",
           "B": B, "T": T, "H": H, "D": D, "chunk": a.chunk, "impl": a.impl, "dtype": a.dtype}
    try:
        if a.worker in TORCH_ENTRIES:
            row["form"] = "titans-pytorch"
            batch_size = a.chunk if TORCH_ENTRIES[a.worker] == "chunk" else None
            row.update(measure_titans_pytorch(B, T, H, D, a.chunk, a.compile_only, a.reps, batch_size))
        elif a.worker in LAYER_ENTRIES:
            import_tree(a.root) if a.root else import_tree()
            import jax
            memory_entry, schedule, documents = LAYER_ENTRIES[a.worker]
            row["device"] = jax.devices()[0].device_kind
            row["form"] = f"memory layer, {schedule} steps" + (f", {documents} documents a row" if documents else "")
            trace_dir = None if not a.trace else os.path.join(a.trace, f"{a.worker}_{a.dtype}")
            row["memory"] = memory_entry
            row.update(measure_layer(B, T, H, D, a.chunk, a.compile_only, a.reps, schedule, documents, a.impl,
                                     a.dtype, trace_dir, entry=memory_entry))
        elif a.worker in CHUNK_STEP_ENTRIES:
            import_tree(a.root) if a.root else import_tree()
            import jax
            row["device"], row["form"] = jax.devices()[0].device_kind, "chunk steps (titans-pytorch's schedule)"
            segment = a.chunk if CHUNK_STEP_ENTRIES[a.worker] == "chunk" else None
            trace_dir = None if not a.trace else os.path.join(a.trace, f"{a.worker}_{a.dtype}")
            row.update(measure_chunk_steps(B, T, H, D, a.chunk, a.compile_only, a.reps, segment, a.dtype, trace_dir))
        else:
            import_tree(a.root) if a.root else import_tree()
            import jax
            row["device"] = jax.devices()[0].device_kind
            if a.reference:
                from atlas_jax.forms import chunked
                with chunked.materialising():
                    row.update(measure_ours(a.worker, B, T, H, D, a.chunk, a.compile_only, a.reps))
            else:
                trace_dir = None if not a.trace else os.path.join(a.trace, f"{a.worker}_{a.impl}_{a.dtype}")
                row.update(measure_ours(a.worker, B, T, H, D, a.chunk, a.compile_only, a.reps, a.impl, a.dtype,
                                        trace_dir))
    except ImportError as error:
        row["error"] = f"not installed: {error}"[:200]
    except Exception as error:   # out of memory on the device: report it and go on
        row["error"] = "OOM" if _is_oom(error) else repr(error)[:300]
    print("ROW " + json.dumps(row, default=str), flush=True)


def _run_entry(a, name, reference, impl="chunk", dtype="float32"):
    command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--shape", ",".join(map(str, a.shape)),
               "--chunk", str(a.chunk), "--reps", str(a.reps), "--impls", impl, "--dtypes", dtype]
    command += ["--reference"] * reference + ["--compile-only"] * a.compile_only
    command += ["--root", a.root] if a.root else []
    command += ["--trace", a.trace] if a.trace else []
    B, T, H, D = a.shape
    fallback = {"entry": name, "form": "materialising" if reference else "auto (dual where covered)",
                "B": B, "T": T, "H": H, "D": D, "chunk": a.chunk, "impl": impl, "dtype": dtype}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=a.timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**fallback, "error": f"timeout ({a.timeout} s)"}
    rows = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if rows:
        return rows[-1]
    tail = (done.stderr or done.stdout)[-300:]
    oom = any(word in tail for word in ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory"))
    return {**fallback, "error": "OOM" if oom else f"exit {done.returncode}: {tail}"}


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def _tflops(row) -> str:
    """Matmul TFLOP/s as executed (`flops.dot_flops`) and its share of the device's peak for that
    mix of bf16 and TF32 products; "—" where a kernel or a while loop hides some."""
    if row.get("tflops") is None:
        return "—"
    share = row.get("of_peak")
    return f"{row['tflops']:.1f}" + ("" if share is None else f" ({share:.0%})")


def markdown(rows, header) -> str:
    lines = [f"# Deep memories, forward+backward ({header})", "",
             "| entry | form | impl | dtype | B, T, H, D | chunk | fwd ms | fwd+bwd ms | tokens/s | TFLOP/s (of peak) | "
             "peak GiB | compiled total GiB | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        label = ENTRIES[r["entry"]][2] if r["entry"] in ENTRIES else r["entry"]
        form = r["form"]
        if r.get("dual_form") and form.startswith("auto"):
            form = "dual"
        elif r.get("dual_form") is False and form.startswith("auto"):
            form = "materialising"
        note = r.get("error", "") or ("non-finite outputs or gradients" if r.get("finite") is False else "")
        impl, dtype = ("—", "bf16 autocast") if r["entry"] in TORCH_ENTRIES else (r.get("impl", "chunk"),
                                                                                 r.get("dtype", "float32"))
        lines.append(f"| {label} | {form} | {impl} | {dtype} | {r['B']}, {r['T']}, {r['H']}, {r['D']} | {r['chunk']} | "
                     f"{_fmt(r.get('fwd_ms'), '.1f')} | {_fmt(r.get('fwd_bwd_ms'), '.1f')} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_tflops(r)} | {_fmt(r.get('peak_GiB'), '.3g')} | {_fmt(r.get('compiled_total_GiB'), '.3g')} | {note} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["titans", "omeganet", "atlas", "atlas_token", TORCH_ENTRY],
                        choices=list(ENTRIES) + list(TORCH_ENTRIES) + list(CHUNK_STEP_ENTRIES) + list(LAYER_ENTRIES))
    parser.add_argument("--shape", type=shape_arg, default=None, help="B,T,H,D (default 4,4096,8,128)")
    parser.add_argument("--chunk", type=int, default=None, help="chunk size (default 64)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"B,T,H,D {','.join(map(str, TINY_SHAPE))}, chunk {TINY_CHUNK}, 2 reps: checks the script on CPU")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--reference", action="store_true", help="also run the materialising chunked form")
    parser.add_argument("--impls", nargs="+", default=["chunk"], choices=["chunk", "pallas", "auto"],
                        help="MemorySpec impl of our entries, one row each (pallas: the deep-memory kernel)")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                        help="dtype of q, k, v (bfloat16: the kernel's dots take bf16 operands)")
    parser.add_argument("--compile-only", action="store_true", help="XLA's memory analysis, no run")
    parser.add_argument("--timeout", type=int, default=240,
                        help="seconds per entry (default 240: the device tool allows 600 s per command)")
    parser.add_argument("--root", default=None, help="checkout to import atlas_jax from (default: this one)")
    parser.add_argument("--trace", default=None,
                        help="folder for a jax.profiler trace of each entry's forward+backward; the row gets "
                             "the device kernels' times summed by name (trace_top); the optimized HLO of the forward+backward "
                             "goes there too (fwdbwd_hlo.txt)")
    parser.add_argument("--out", default=None, help="folder for deep_memory.json / .md (default $OUT)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.tiny:
        a.shape, a.chunk, a.reps = a.shape or TINY_SHAPE, a.chunk or TINY_CHUNK, min(a.reps, 2)
    a.shape, a.chunk = a.shape or (4, 4096, 8, 128), a.chunk or 64
    if a.worker:
        a.impl, a.dtype = a.impls[0], a.dtypes[0]
        return worker(a)

    B, T, H, D = a.shape
    log(f"B{B} T{T} H{H} D{D} chunk {a.chunk}: {', '.join(a.presets)}")
    rows = []
    for name in a.presets:
        variants = [(False, "chunk", "float32")] if name in TORCH_ENTRIES else [
            (False, "chunk", dtype) for dtype in a.dtypes] if name in CHUNK_STEP_ENTRIES else [
            (False, impl, dtype) for impl in a.impls for dtype in a.dtypes]
        if a.reference and name in ENTRIES:
            variants.append((True, "chunk", "float32"))
        for reference, impl, dtype in variants:
            row = _run_entry(a, name, reference, impl, dtype)
            rows.append(row)
            log(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    devices = sorted({r["device"] for r in rows if r.get("device")})
    header = f"{', '.join(devices) or 'device unknown'}"
    table = markdown(rows, header)
    log(table)
    save_json(rows, a.out, "deep_memory.json")
    out_dir = a.out or os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "deep_memory.md"), "w") as f:
            f.write(table)
    return rows


if __name__ == "__main__":
    main()
