"""Newton–Schulz against the matmul roofline (issue 21 item 3): does XLA's batched Newton–Schulz
reach the speed of one batched matmul of the same size, or does it need a kernel?

    python3 benchmarks/newton_schulz.py                  # the atlas / titans sizes below, on the GPU
    python3 benchmarks/newton_schulz.py --tiny           # CPU check of the script itself

For each matrix shape [N, m, n] (N = batch·heads matrices; `atlas_jax.optimizers.newton_schulz`,
J = 5 iterations, the tall side transposed so the Gram matrix is the small one) and each precision:

  ns        the jitted Newton–Schulz forward; FLOPs 2·J·(2·s²·l + s³) for s = min(m, n), l = max
  ns_vjp    its forward + backward (the dual form differentiates through it): about 3× the FLOPs
  gram      one batched matmul X·Xᵀ of the same X ([N, s, l] × [N, l, s]), the roofline's
            achievable side: the matmul rate XLA reaches at this shape
  precision float32 at JAX's default matmul precision (what the dual form runs: TF32 on recent
            GPUs), float32 at HIGHEST, and bf16 operands (``muon(ns_dtype="bfloat16")``, Muon's
            practice; float32 iterate and accumulation)
  method    "direct" (the iteration on X) and "gram" (the same polynomial through the s × s Gram
            matrix, `newton_schulz(method="gram")`: fewer FLOPs on tall matrices). TFLOP/s always
            counts the direct iteration's FLOPs, so a faster route shows as a higher rate

and reports ms, TFLOP/s, TFLOP/s as a fraction of the gram matmul's at the same precision (1.0:
Newton–Schulz runs at the matmul roofline for its size) and of the device's dense peak, and the
result's largest difference from float32 at HIGHEST, relative to its largest entry.
Writes newton_schulz.json / .md to --out or $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import import_tree, log, save_json, time_jax  # noqa: E402

# [N, m, n]: atlas 340M (B4 × 16 heads; W0's momentum [d_φ = C(66, 2) = 2145, h = 256]; W1's
# [h, d_v = 64]), atlas in the deep-memory benchmark (B4 × 8 heads, d 128 → d_φ 8385, h 512),
# titans-sized MLP memory weights (d 128, h 512).
SHAPES = [(64, 2145, 256), (64, 256, 64), (32, 8385, 512), (32, 128, 512)]
TINY_SHAPES = [(2, 40, 8), (2, 8, 24)]
PEAK_TFLOPS = {"H100": {"bf16": 989.4, "f32": 494.7}, "H200": {"bf16": 989.4, "f32": 494.7}}  # f32: TF32


def ns_flops(m, n, steps):
    s, l = min(m, n), max(m, n)
    return 2 * steps * (2 * s * s * l + s ** 3)


def measure(shape, precision, steps, reps, method="direct"):
    import jax
    import jax.numpy as jnp
    from atlas_jax.optimizers import newton_schulz

    N, m, n = shape
    x = jax.random.normal(jax.random.PRNGKey(0), shape, jnp.float32)
    if precision == "bf16":     # Muon's practice: muon(ns_dtype="bfloat16")
        ns = lambda x: newton_schulz(x, steps, operand_dtype="bfloat16", method=method)
        ctx = jax.default_matmul_precision("default")
    else:
        ns = lambda x: newton_schulz(x, steps, method=method)
        ctx = jax.default_matmul_precision("highest" if precision == "f32_highest" else "default")
    with ctx:
        forward = jax.jit(ns)
        fwd_bwd = jax.jit(lambda x: jax.vjp(ns, x)[1](jnp.ones(shape, x.dtype))[0])
        tall = m > n
        xt = jnp.swapaxes(x, -1, -2) if tall else x           # [N, s, l]
        gram = jax.jit(lambda x: jnp.einsum("NSL,NTL->NST", x, x, preferred_element_type=jnp.float32))
        out = {"ns_ms": time_jax(forward, x, reps=reps), "ns_vjp_ms": time_jax(fwd_bwd, x, reps=reps),
               "gram_ms": time_jax(gram, xt.astype(jnp.bfloat16) if precision == "bf16" else xt, reps=reps)}
        result = forward(x).astype(jnp.float32)
    s, l = min(m, n), max(m, n)
    flops = N * ns_flops(m, n, steps)
    out["ns_tflops"] = flops / out["ns_ms"] / 1e9
    out["ns_vjp_tflops"] = 3 * flops / out["ns_vjp_ms"] / 1e9
    out["gram_tflops"] = N * 2 * s * s * l / out["gram_ms"] / 1e9
    out["ns_over_gram"] = out["ns_tflops"] / out["gram_tflops"]
    with jax.default_matmul_precision("highest"):
        exact = jax.jit(lambda x: newton_schulz(x, steps, method="direct"))(x.astype(jnp.float32))
    out["rel_error_vs_highest"] = float(jnp.max(jnp.abs(result - exact)) / jnp.max(jnp.abs(exact)))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="Newton–Schulz iterations J")
    parser.add_argument("--precisions", default="f32_default,f32_highest,bf16")
    parser.add_argument("--methods", default="direct,gram")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="N,m,n",
                        help="matrix shapes [N, m, n] instead of the built-in ones, e.g. 32,1225,192")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import_tree()
    import jax
    kind = jax.devices()[0].device_kind
    peaks = next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)
    rows = []
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(d) for d in text.split(",")) for text in args.shapes]
        except ValueError:
            parser.error(f"--shapes: each shape is N,m,n in integers (e.g. 32,1225,192); got {args.shapes}")
        if any(len(shape) != 3 or min(shape) < 1 for shape in shapes):
            parser.error(f"--shapes: each shape is three positive integers N,m,n; got {args.shapes}")
    for shape in shapes:
        for precision in args.precisions.split(","):
            for method in args.methods.split(","):
                try:
                    r = measure(shape, precision, args.steps, 2 if args.tiny else args.reps, method)
                except Exception as e:  # noqa: BLE001  (an out-of-memory shape must not hide the others)
                    r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                peak = None if peaks is None else peaks["bf16" if precision == "bf16" else "f32"]
                if peak and "ns_tflops" in r:
                    r["ns_of_peak"] = r["ns_tflops"] / peak
                rows.append({"shape": list(shape), "precision": precision, "method": method, **r})
                log(json.dumps(rows[-1]))
    lines = [f"{kind}; jax {jax.__version__}; J = {args.steps}", "",
             "| [N, m, n] | precision | method | NS ms | NS TFLOP/s | NS fwd+bwd ms | gram ms | gram TFLOP/s | NS / gram | NS / peak | max diff vs HIGHEST |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['precision']} | {r['method']} | {r['error']} | | | | | | | |")
            continue
        of_peak = f"{100 * r['ns_of_peak']:.0f}%" if r.get("ns_of_peak") else "—"
        lines.append(f"| {r['shape']} | {r['precision']} | {r['method']} | {r['ns_ms']:.3f} | {r['ns_tflops']:.1f} | "
                     f"{r['ns_vjp_ms']:.3f} | {r['gram_ms']:.3f} | {r['gram_tflops']:.1f} | "
                     f"{r['ns_over_gram']:.2f} | {of_peak} | {r['rel_error_vs_highest']:.1e} |")
    text = "\n".join(lines)
    log(text)
    out = args.out or os.environ.get("OUT")
    save_json(rows, out, "newton_schulz.json")
    if out:
        with open(os.path.join(out, "newton_schulz.md"), "w") as f:
            f.write(text + "\n")
    return rows


if __name__ == "__main__":
    main()
