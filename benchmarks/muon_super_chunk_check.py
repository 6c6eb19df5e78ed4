"""How far atlas' layer moves when its Muon chunk ends run in super-chunks (`forms.dual._muon_super_chunk`).

The dual form runs Muon with Newton–Schulz per chunk in super-chunks of `dual.SUPER_CHUNK` chunks,
θ formed once per super-chunk and NS taken from the momentum's carried Gram matrix; with
`SUPER_CHUNK = 1` it forms the momentum and NS's iterate every chunk (`_one_chunk`). Both run here
in one process on the same inputs (deep_memory.py's), and both against a reference: the per-chunk
route with float32 q, k, v and every matmul at HIGHEST precision (no TF32, no bf16 operands). The
table gives each route's relative difference to that reference — max |x − ref| / max |ref| — for
the outputs and the gradients of q, k, v and θ₀, so the super-chunk route's difference can be read
against the rounding the per-chunk route already has.

    python benchmarks/muon_super_chunk_check.py --shape 1,1024,8,128 --entries atlas atlas_ns_bf16
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deep_memory import ENTRIES, build, fwdbwd_fn, inputs  # noqa: E402
from timing import ROOT, import_tree, log, save_json, shape_arg  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=shape_arg, default=(1, 1024, 8, 128), help="B,T,H,D")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--entries", nargs="+", default=["atlas"], choices=[k for k in ENTRIES if "token" not in k])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--groups", action="store_true",
                        help="group chunks whatever θ's size (a CPU check at small shapes: super-chunks of 4)")
    parser.add_argument("--root", default=str(ROOT), help="the source tree to import atlas_jax from")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    import_tree(args.root)

    import jax
    import jax.numpy as jnp

    from atlas_jax.forms import dual

    if args.groups:   # (and the dual form at any size: `chunked.DUAL_FORM_MIN_BYTES`)
        from atlas_jax.forms import chunked
        dual.BOUNDARY_BYTES_PER_TOKEN, dual.GROUP_TOKENS, dual.SUPER_CHUNK = 1, 8 * args.chunk, 4
        chunked.DUAL_FORM_MIN_BYTES = 0

    def run(spec, dtype, super_chunk, precision=None):
        q, k, v, knobs, state, cotangent = inputs(spec, *args.shape, dtype=dtype)
        saved = dual.SUPER_CHUNK
        dual.SUPER_CHUNK = super_chunk
        jax.clear_caches()   # the layer is jitted with the spec static: trace it again under this setting
        try:
            with jax.default_matmul_precision(precision or "default"):
                out, grads = fwdbwd_fn(spec, args.chunk, "auto")(q, k, v, knobs, state, cotangent)
                return jax.tree.map(lambda x: x.astype(jnp.float32), (out, grads[:3], grads[4]))
        finally:
            dual.SUPER_CHUNK = saved

    def difference(a, b):
        return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))

    rows = []
    for name in args.entries:
        spec = build(name)
        reference = run(spec, "float32", 1, "highest")
        for dtype in args.dtypes:
            for route, super_chunk in (("per chunk", 1), ("super-chunks", dual.SUPER_CHUNK)):
                got = run(spec, dtype, super_chunk)
                labels = ["outputs", "dq", "dk", "dv"] + [f"dθ₀[{key}]" for key in sorted(got[2])]
                values = [got[0], *got[1], *(got[2][key] for key in sorted(got[2]))]
                refs = [reference[0], *reference[1], *(reference[2][key] for key in sorted(reference[2]))]
                row = {"entry": name, "dtype": dtype, "route": route, "shape": list(args.shape),
                       **{label: difference(a, r) for label, a, r in zip(labels, values, refs)}}
                rows.append(row)
                log(" ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    save_json(rows, args.out, "muon_super_chunk_check.json")


if __name__ == "__main__":
    main()
