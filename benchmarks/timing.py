"""What the benchmark scripts share: the import of this checkout, fla's input recipe, the timer.

Not a script. `bench_ops.py`, `tune.py`, `compare_trees.py` and `profile_delta_family.py` import
it from the same folder.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX and torch share the GPU
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")        # fla times its own Triton

ROOT = pathlib.Path(__file__).resolve().parents[1]
GATE_OF = {"gdn": "scalar", "deltanet": "none", "kda": "channel"}


def import_tree(root=ROOT):
    """Imports atlas_jax from the checkout `root` (not pip-installed on the GPU machine): the
    package from root/atlas_jax, and atlas_jax.kernels / .train / .configs from root/kernels,
    root/train and root/configs, as pyproject maps them. The mapping is in place before
    `import atlas_jax` runs, whose own imports need atlas_jax.kernels."""
    import importlib.abc
    import importlib.machinery

    root = pathlib.Path(root).resolve()
    mapped = {"atlas_jax.kernels": root / "kernels", "atlas_jax.train": root / "train",
              "atlas_jax.configs": root / "configs"}

    class _CheckoutFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            for name, folder in mapped.items():
                if fullname == name or fullname.startswith(name + "."):
                    rest = fullname[len(name):].lstrip(".").split(".") if fullname != name else []
                    location = folder.joinpath(*rest)
                    init = location / "__init__.py"
                    if init.is_file():
                        return importlib.util.spec_from_file_location(
                            fullname, init, submodule_search_locations=[str(location)])
                    module = location.with_suffix(".py")
                    if module.is_file():
                        return importlib.util.spec_from_file_location(fullname, module)
            return None

    sys.path.insert(0, str(root))
    sys.meta_path.insert(0, _CheckoutFinder())
    import atlas_jax  # noqa: F401
    import atlas_jax.ops
    return atlas_jax.ops


def shape_arg(text):
    """"B,T,H,D" -> (B, T, H, D), for argparse."""
    shape = tuple(int(x) for x in text.split(","))
    if len(shape) != 4:
        raise ValueError(f"a shape is B,T,H,D; got {text!r}")
    return shape


def log(*a):
    print(*a, flush=True)


def save_json(results, out_dir, name):
    """Writes results to out_dir/name (out_dir: --out, else $OUT; nothing if neither is set)."""
    out_dir = out_dir or os.environ.get("OUT")
    if out_dir:
        pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(results, f, indent=1, default=str)


def make_inputs(B, T, H, K, V, gate, dtype, seed=0, value_heads=None):
    """fla's benchmark recipe: q, k L2-normalised, v ~ N(0, 1), beta = sigmoid(randn) in dtype;
    g = logsigmoid(randn) float32 ([B, T, HV] scalar, [B, T, HV, K] channel); and a cotangent.
    value_heads: HV (grouped value heads, a multiple of H; default H) for v, beta, g, do."""
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)

    def l2(x):
        return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)

    q = l2(jax.random.normal(ks[0], (B, T, H, K))).astype(dtype)
    k = l2(jax.random.normal(ks[1], (B, T, H, K))).astype(dtype)
    HV = value_heads or H
    v = jax.random.normal(ks[2], (B, T, HV, V)).astype(dtype)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, HV))).astype(dtype)
    g = None
    if gate == "scalar":
        g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    elif gate == "channel":
        g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, HV, K)))
    do = jax.random.normal(ks[5], (B, T, HV, V)).astype(dtype)
    return q, k, v, beta, g, do


def op_fns(ops, name, impl, chunk_size=64):
    """Jitted fwd(q, k, v, beta, g) and fwdbwd(q, k, v, beta, g, do) of one public op."""
    import jax
    op = {"gdn": ops.gated_delta_rule, "deltanet": ops.delta_rule, "kda": ops.kda}[name]

    def fwd(q, k, v, beta, g):
        args = (q, k, v, beta) if g is None else (q, k, v, g, beta)
        return op(*args, impl=impl, chunk_size=chunk_size)[0]

    def fwdbwd(q, k, v, beta, g, do):
        return jax.vjp(fwd, q, k, v, beta, g)[1](do)

    return jax.jit(fwd), jax.jit(fwdbwd)


def inner_calls(one_call_s, target_s=0.02):
    """Back-to-back calls per timed repetition: enough for ~20 ms, so that the first call's
    dispatch and the final synchronisation are a small share (H100, ours KDA fwd: 1.110 ms per
    call at 5 calls, 1.049 at 20, 1.030 at 50)."""
    return max(5, min(200, math.ceil(target_s / max(one_call_s, 1e-6))))


def wall_ms(call, sync, reps=30):
    """Median over `reps` of (time of `inner_calls` back-to-back calls) / inner, after warmup;
    the method for ours, and for fla next to triton's do_bench."""
    for _ in range(3):
        sync(call())
    t = time.perf_counter()
    sync(call())
    inner = inner_calls(time.perf_counter() - t)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = call()
        sync(out)
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts) * 1e3


def time_jax(f, *args, reps=30):
    import jax
    return wall_ms(lambda: f(*args), jax.block_until_ready, reps)


def fla_ops():
    """fla's chunk ops by our op names, or None when fla does not import. Its Triton < 3.7.1
    Hopper guard (fla issue 640) is lifted: for timing only."""
    try:
        import fla.ops.common.chunk_o as chunk_o
        chunk_o.TRITON_ABOVE_3_7_1 = True
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        log(f"[fla] not available: {type(e).__name__}: {e}")
        return None
    return {"gdn": lambda q, k, v, g, gk, beta: chunk_gated_delta_rule(q, k, v, g, beta)[0],
            "deltanet": lambda q, k, v, g, gk, beta: chunk_delta_rule(q, k, v, beta)[0],
            "kda": lambda q, k, v, g, gk, beta: chunk_kda(q, k, v, gk, beta)[0]}


def fla_inputs(B, T, H, D, device="cuda", V=None):
    """The same recipe in torch: (q, k, v, g [B,T,H], gk [B,T,H,D], beta, do); V defaults to D."""
    import torch
    bf = torch.bfloat16
    normal = lambda *s: torch.randn(*s, device=device, dtype=bf)   # noqa: E731
    unit = lambda: torch.nn.functional.normalize(normal(B, T, H, D).float(), dim=-1).to(bf)  # noqa: E731
    q, k = unit().requires_grad_(), unit().requires_grad_()
    V = V or D
    v = normal(B, T, H, V).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device)).requires_grad_()
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device=device)).requires_grad_()
    beta = torch.sigmoid(torch.randn(B, T, H, device=device)).to(bf).requires_grad_()
    return q, k, v, g, gk, beta, normal(B, T, H, V)


def trace_kernels(call, trace_dir, *, calls=3, top=25, hlo_text=None, scopes=()):
    """Runs ``call()`` (it blocks until its results are ready) ``calls`` times under
    jax.profiler.trace and sums the device-side events by name, per call: returns ([(name, ms,
    count)] largest first, the total, {part: ms}). Reads the Perfetto trace JAX writes next to the
    xplane.

    The parts: with ``hlo_text`` (the compiled program's ``as_text()``) and ``scopes``
    (jax.named_scope names in the traced code), {"<scope> fwd" | "<scope> bwd" | "other": ms per
    call}; else empty: an event's kernel is found by name among the HLO instructions (fusions keep their
    names as kernel names, "." written "_") and its op_name metadata says the scope; "bwd" when
    the op is in the transposed (backward) part. Custom kernels without HLO names count under
    their own name. Every kernel's row (with its op_name and, where the trace has it, its launch:
    "regs:… dynamic_shared:… grid:… block:… occ_pct:…") is written to ``trace_dir``/kernels.json."""
    import gzip
    import jax

    call()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(calls):
            call()
    paths = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not paths:
        return [], 0.0, {}
    events = json.load(gzip.open(paths[-1]))["traceEvents"]
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and "/device:" in str(e.get("args", {}).get("name", ""))}
    device_events = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]
    sums, details = {}, {}
    for e in device_events:
        ms, count = sums.get(e["name"], (0.0, 0))
        sums[e["name"]] = (ms + e["dur"] / 1e3 / calls, count + 1)
        # CUPTI's launch record: registers a thread, shared memory, grid, block, occupancy
        details.setdefault(e["name"], e.get("args", {}).get("kernel_details"))
    rows = sorted(((name, ms, count // calls) for name, (ms, count) in sums.items()), key=lambda r: -r[1])
    total = sum(ms for _, ms, _ in rows)
    op_names = dict(re.findall(r'%?([\w.\-]+) = [^\n]*?metadata=\{[^}\n]*?op_name="([^"]*)"', hlo_text or ""))
    op_of = lambda name: op_names.get(name) or op_names.get(re.sub(r"_(\d+)$", r".\1", name))
    # every kernel, not only the top ones, with its op_name where the HLO has it
    with open(pathlib.Path(trace_dir) / "kernels.json", "w") as f:
        json.dump([dict(name=name, ms=round(ms, 4), count=count, op=op_of(name), launch=details.get(name))
                   for name, ms, count in rows], f, indent=0)
    if not scopes:
        return rows[:top], total, {}
    by_scope = {}
    for name, ms, _ in rows:
        op = op_of(name)
        part = "other" if op else name
        for scope in scopes if op else ():
            if scope in op:
                part = f"{scope} {'bwd' if '/transpose(' in op.split(scope)[0] else 'fwd'}"
                break
        by_scope[part] = by_scope.get(part, 0.0) + ms
    return rows[:top], total, by_scope
