"""How far a deep memory's gradients with respect to early tokens drift from float32's over a long
sequence: per block of tokens, max |dk| and dk's relative (Frobenius) error against a float32
evaluation at HIGHEST precision on the same inputs (q, k, v rounded to bf16 for both).

    python benchmarks/backward_growth.py --entry atlas --shape 1,16384,8,128          # GPU: impl auto
    python benchmarks/backward_growth.py --entry atlas_token --shape 1,16384,1,32 --emulate-tf32   # CPU
    python benchmarks/backward_growth.py --root build/other --reference $OUT/ref.npy   # a second tree, one reference

Why: Newton–Schulz's derivative is up to a⁵ ≈ 480 on the momentum's near-null directions, so a
rounded cotangent where a product annihilates that part leaks, and the backward can grow chunk
after chunk while the forward stays fine (benchmarks/results/atlas_backward_growth_h200_2026-11-29.md).
An error that grows toward the start but saturates below ~1 is the layer's own conditioning (float32
on bf16-rounded inputs moves early gradients as much); max |dk| far above the reference's is a leak.

``--emulate-tf32``: every float32 matmul not asked for at HIGHEST (or a multi-pass algorithm) rounds its operands (forward and
the backward's transposes) to TF32's 10 mantissa bits, straight through for derivatives: a GPU's
default float32 product, on the CPU. It patches jax's internal `lax.dot_general`, for this tool only.
Entries and inputs are `deep_memory.py`'s (β = 1e-3·sigmoid). Writes backward_growth.json to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def emulate_tf32():
    """Inside: float32 operands of every dot_general without HIGHEST precision rounded to TF32."""
    import jax
    import jax.numpy as jnp
    from jax._src.lax import lax as lax_internal

    plain = lax_internal.dot_general

    def rounded(x):   # the rounded value, with the identity's derivative
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
        return x + jax.lax.stop_gradient(jax.lax.bitcast_convert_type(bits, jnp.float32) - x)

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        # HIGHEST and the multi-pass algorithms (DotAlgorithmPreset, e.g. BF16_BF16_F32_X3) keep
        # float32 accuracy, or near it (three bf16 passes: ~2⁻¹⁶ relative, 2⁵ finer than TF32): not rounded
        if "HIGHEST" not in str(precision) and not isinstance(precision, jax.lax.DotAlgorithmPreset):
            lhs, rhs = (rounded(x) if x.dtype == jnp.float32 else x for x in (lhs, rhs))
        return plain(lhs, rhs, dimension_numbers, precision=precision,
                     preferred_element_type=preferred_element_type, **kwargs)

    lax_internal.dot_general = jax.lax.dot_general = dot_general
    try:
        yield
    finally:
        lax_internal.dot_general = jax.lax.dot_general = plain


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entry", default="atlas", help="a deep_memory.py entry (atlas: NS per chunk; atlas_token)")
    parser.add_argument("--shape", default="1,16384,8,128", help="B,T,H,D")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="q, k, v of the call measured")
    parser.add_argument("--impl", default="auto", choices=["auto", "chunk", "pallas"])
    parser.add_argument("--block", type=int, default=None, help="tokens a block (default T/8)")
    parser.add_argument("--emulate-tf32", action="store_true")
    parser.add_argument("--root", default=None, help="checkout to import atlas_jax from (default: this one)")
    parser.add_argument("--reference", default=None, metavar="FILE.npy",
                        help="the float32 HIGHEST dk: loaded if the file exists, else computed and saved there "
                             "(one reference for several trees' runs on the same entry and shape)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    a = parser.parse_args(argv)
    import deep_memory as dm
    from timing import import_tree, shape_arg
    B, T, H, D = shape_arg(a.shape)
    block = a.block or T // 8
    if T % block:
        parser.error(f"--block {block} must divide T = {T}")

    import_tree(a.root) if a.root else import_tree()
    import jax
    import jax.numpy as jnp
    import numpy as np
    spec = dm.build(a.entry)
    q, k, v, knobs, state, cotangent = dm.inputs(spec, B, T, H, D, dtype="float32")
    q, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v))

    def dk(dtype, impl):
        fwdbwd = dm.fwdbwd_fn(spec, a.chunk, impl)
        xs = [x.astype(dtype) for x in (q, k, v)]
        _, grads = fwdbwd(*xs, knobs, state, cotangent.astype(dtype))
        return np.asarray(grads[1], np.float32)   # [B, T, H, D]

    t = time.perf_counter()
    with emulate_tf32() if a.emulate_tf32 else contextlib.nullcontext():
        measured = dk(a.dtype, a.impl)
    if a.reference and os.path.exists(a.reference):
        reference = np.load(a.reference)
        if reference.shape != measured.shape:
            parser.error(f"--reference {a.reference} holds dk of shape {reference.shape}, not {measured.shape}")
    else:
        jax.clear_caches()   # the reference traces the products afresh, without the emulation
        with jax.default_matmul_precision("highest"):
            reference = dk("float32", "chunk")
        if a.reference:
            np.save(a.reference, reference)
    by_block = lambda x: np.moveaxis(x, 1, 0).reshape(T // block, -1)
    norms = np.linalg.norm(by_block(reference), axis=1)
    row = {"entry": a.entry, "shape": [B, T, H, D], "chunk": a.chunk, "dtype": a.dtype, "impl": a.impl,
           "emulate_tf32": a.emulate_tf32, "device": jax.devices()[0].device_kind, "block": block,
           "finite": bool(np.isfinite(measured).all()),
           "max_abs_dk": np.abs(by_block(measured)).max(axis=1).tolist(),
           "reference_max_abs_dk": np.abs(by_block(reference)).max(axis=1).tolist(),
           "relative_error": (np.linalg.norm(by_block(measured - reference), axis=1) / norms).tolist(),
           "seconds": time.perf_counter() - t}
    fmt = lambda xs: " ".join(f"{x:.2g}" for x in xs)
    print(f"{a.entry} {a.dtype} {a.impl}{' (TF32 emulated)' if a.emulate_tf32 else ''}, per {block} tokens:\n"
          f"  max |dk|            {fmt(row['max_abs_dk'])}\n  reference max |dk|  {fmt(row['reference_max_abs_dk'])}\n"
          f"  relative error      {fmt(row['relative_error'])}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "backward_growth.json"), "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
