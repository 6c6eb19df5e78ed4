"""Deep-memory presets (titans, omeganet, atlas) through the chunked form: forward+backward time,
tokens per second and peak memory (issue 24).

    python benchmarks/deep_memory.py                                  # B4 T4096 H8 D128, chunk 64
    python benchmarks/deep_memory.py --presets titans --shape 1,2048,8,128 --reference
    python benchmarks/deep_memory.py --compile-only                   # XLA's memory analysis only

Times jax.vjp of the memory layer's outputs with respect to q, k, v, the per-token knobs and θ₀
(the memory alone, no model around it). ATLAS runs with Newton–Schulz per chunk
(``muon(ns_every="chunk")``), the variant the dual form covers; ``--atlas-ns token`` runs ATLAS as
written, through the materialising form. ``--reference`` adds the materialising chunked form (the
form before the dual form) for the same calls. Peak memory is the device's peak_bytes_in_use after
the timed calls (GPU), and always XLA's compiled temp + argument + output bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import import_tree, log, save_json, shape_arg, time_jax  # noqa: E402


def build(name, atlas_ns):
    from atlas_jax import optimizers as opt
    from atlas_jax import presets
    spec = presets.get(name)
    if name == "atlas":
        spec = dataclasses.replace(spec, optimizer=opt.muon(ns_every=atlas_ns))
    return spec


def inputs(spec, B, T, H, D, seed=0):
    import jax
    import jax.numpy as jnp
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = unit(jax.random.normal(ks[0], (B, T, H, D))), unit(jax.random.normal(ks[1], (B, T, H, D)))
    v = jax.random.normal(ks[2], (B, T, H, D))
    knobs = {"beta": 0.1 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H))),
             "g": jax.nn.log_sigmoid(4.0 + jax.random.normal(ks[4], (B, T, H)))}
    if spec.opt_kind in ("momentum", "muon"):
        knobs["nu"] = jax.nn.sigmoid(2.0 + jax.random.normal(ks[5], (B, T, H)))
    if spec.window > 1:
        knobs["gamma"] = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    state = spec.init_state(ks[7], batch=B, heads=H, d_k=D, d_v=D)
    cotangent = jax.random.normal(ks[7], (B, T, H, D))
    return q, k, v, knobs, state, cotangent


def fwdbwd_fn(spec, chunk):
    import jax

    def forward(q, k, v, knobs, params, state):
        return spec(q, k, v, **knobs, initial_state=state._replace(params=params), impl="chunk",
                    chunk_size=chunk)[0]

    def fwdbwd(q, k, v, knobs, state, cotangent):
        out, pullback = jax.vjp(lambda *a: forward(*a, state), q, k, v, knobs, state.params)
        return out, pullback(cotangent)

    return jax.jit(fwdbwd)


def measure(name, spec, args, chunk, B, T, compile_only, reference):
    import jax
    from atlas_jax.forms import dual

    f = fwdbwd_fn(spec, chunk)
    compiled = f.lower(*args).compile()
    analysis = compiled.memory_analysis()
    row = {"preset": name, "form": "materialising" if reference else "auto (dual where covered)",
           "dual_form": (not reference) and dual.covers(spec, jax.tree.map(lambda x: x[0, 0], args[4]), _steps(spec, args)),
           "compiled_temp_GiB": analysis.temp_size_in_bytes / 2 ** 30,
           "compiled_total_GiB": (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
                                  + analysis.output_size_in_bytes) / 2 ** 30}
    if not compile_only:
        device = jax.devices()[0]
        ms = time_jax(compiled, *args, reps=10)
        row.update({"fwd_bwd_ms": ms, "tokens_per_s": B * T / (ms / 1e3)})
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            row["peak_GiB"] = stats["peak_bytes_in_use"] / 2 ** 30
    return row


def _steps(spec, args):
    """One (sequence, head)'s steps, only for asking whether the dual form covers the call."""
    import jax.numpy as jnp
    from atlas_jax.forms.common import Steps
    q, k, v, knobs, state, _ = args
    T, d = q.shape[1], spec.feature_dim(q.shape[-1])
    ones = jnp.ones((T,))
    return Steps(jnp.ones((T, d)), v[0, :, 0], jnp.ones((T, d)), ones, ones if "g" in knobs else None,
                 ones if "nu" in knobs else None, ones, None, ones)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["titans", "omeganet", "atlas"])
    parser.add_argument("--shape", type=shape_arg, default=(4, 4096, 8, 128), help="B,T,H,D (default 4,4096,8,128)")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--atlas-ns", choices=("chunk", "token"), default="chunk",
                        help="ATLAS's Newton–Schulz per chunk (dual form) or per token (materialising form)")
    parser.add_argument("--reference", action="store_true", help="also run the materialising chunked form")
    parser.add_argument("--compile-only", action="store_true", help="XLA's memory analysis, no run")
    parser.add_argument("--root", default=None, help="checkout to import atlas_jax from (default: this one)")
    parser.add_argument("--out", default=None, help="folder for deep_memory.json (default $OUT)")
    a = parser.parse_args(argv)

    import_tree(a.root) if a.root else import_tree()
    import jax
    from atlas_jax.forms import chunked

    B, T, H, D = a.shape
    log(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, B{B} T{T} H{H} D{D} chunk {a.chunk}")
    rows = []
    for name in a.presets:
        spec = build(name, a.atlas_ns)
        args = inputs(spec, B, T, H, D)
        for reference in ((False, True) if a.reference else (False,)):
            try:
                if reference:
                    with chunked.materialising():
                        row = measure(name, spec, args, a.chunk, B, T, a.compile_only, True)
                else:
                    row = measure(name, spec, args, a.chunk, B, T, a.compile_only, False)
            except Exception as error:   # out of memory on the device: report it and go on
                row = {"preset": name, "form": "materialising" if reference else "auto", "error": repr(error)[:300]}
            row.update({"B": B, "T": T, "H": H, "D": D, "chunk": a.chunk})
            rows.append(row)
            log(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    save_json(rows, a.out, "deep_memory.json")


if __name__ == "__main__":
    main()
