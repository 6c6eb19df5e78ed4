"""φ's rows on the GPU: how fast `polynomial2_features_gpu` writes the degree-2 polynomial map's
rows, and `symmetric_square_backward_gpu` reads their cotangent, against the bandwidth XLA reaches
moving an array of their size, per tile size.

    python3 benchmarks/feature_rows.py                           # the current tree, on the GPU
    python3 benchmarks/feature_rows.py --root build/before       # another tree's kernel (its defaults)
    python3 benchmarks/feature_rows.py --tiny                    # CPU check of the script (interpret mode)

Rows: n = heads · 1048 (omeganet's super-chunk: 8 chunks' 67 sources and 64 queries a head; 8 heads
at B1, 32 at B4), d 128, width 8448, bf16 out. For each tile (block_rows × block_cols, warps) it
checks the rows equal the default tiles' bit for bit and reports µs and the TB/s written; the
anchor is XLA reading and writing an array of the same size (y · 1.5), the bandwidth an
elementwise pass gets. The backward (as `features.polynomial2_features`' VJP calls it: sym_2's
columns read in place from the bf16 row, c₂'s gradient formed too) per block_rows × block_i and
warps, with the XLA sum of its block_i partials, and its ∂L/∂x's relative difference from the
default blocks' (the partials summed in another order: ~1e-7). Writes feature_rows.json to --out or $OUT.
"""

from __future__ import annotations

import argparse
import os

from timing import import_tree, log, save_json, time_jax

TILES = [(32, 256, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (16, 256, 4), (32, 512, 4), (32, 512, 8),
         (64, 256, 4)]
BACKWARD = [(32, 8, 4), (32, 16, 4), (32, 32, 4), (32, 128, 4), (16, 16, 4), (16, 32, 4), (64, 16, 4), (64, 32, 8),
            (16, 8, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="tree to import atlas_jax from (default: this one)")
    ap.add_argument("--heads", type=int, nargs="+", default=[8, 32], help="heads · 1048 rows each")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a few rows, interpret mode: checks the script on a CPU")
    ap.add_argument("--out", default=None, help="folder for feature_rows.json (default $OUT)")
    args = ap.parse_args()
    import_tree(args.root) if args.root else import_tree()
    import jax
    import jax.numpy as jnp
    from atlas_jax.kernels.features import gpu

    tiles = getattr(gpu, "Phi2GpuBlockSizes", None)   # None: a tree from before the tiles (defaults only)
    interpret = args.tiny or jax.default_backend() != "gpu"
    width = 8448
    coeffs = jnp.asarray([0.9, 1.1, 0.6])
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "root": args.root or ".", "rows": []}
    for heads in [1] if args.tiny else args.heads:
        n = (40 if args.tiny else heads * 1048)
        x = jax.random.normal(jax.random.PRNGKey(heads), (n, 128), jnp.bfloat16)
        gbytes = n * width * 2 / 1e9
        rows = lambda x, bs=None: gpu.polynomial2_features_gpu(x, coeffs, width, jnp.bfloat16, block_sizes=bs,
                                                                 interpret=interpret)
        want = jax.jit(rows)(x)
        configs = [None] + ([tiles(*t) for t in TILES] if tiles is not None else [])
        for bs in configs[:2] if args.tiny else configs:
            run = jax.jit(lambda x, bs=bs: rows(x, bs))
            exact = bool(jnp.all(run(x) == want))
            ms = time_jax(run, x, reps=1 if args.tiny else args.reps)
            name = "default" if bs is None else f"{bs.block_rows}x{bs.block_cols} w{bs.num_warps}"
            row = {"rows": n, "tiles": name, "us": ms * 1e3, "written_TB_s": gbytes / ms, "equal_to_default": exact}
            results["rows"].append(row)
            log(f"rows {n:6d} {name:14s} {ms * 1e3:8.1f} us  {gbytes / ms:5.2f} TB/s written  equal {exact}")
        g = jax.random.normal(jax.random.PRNGKey(n), (n, width), jnp.bfloat16)
        x32 = x.astype(jnp.float32)
        back = lambda x, g, bs=None: gpu.symmetric_square_backward_gpu(x, g, coeffs[2], with_scale_grad=True,
                                                                        column_offset=129, block_sizes=bs,
                                                                        interpret=interpret)
        want_dx, _ = jax.jit(back)(x32, g)
        configs = [None] + [gpu.Sym2GpuBlockSizes(*t) for t in BACKWARD]
        for bs in configs[:2] if args.tiny else configs:
            run = jax.jit(lambda x, g, bs=bs: back(x, g, bs))
            dx, _ = run(x32, g)
            err = float(jnp.linalg.norm(dx - want_dx) / jnp.linalg.norm(want_dx))
            ms = time_jax(run, x32, g, reps=1 if args.tiny else args.reps)
            name = "default" if bs is None else f"{bs.block_rows}x{bs.block_i} w{bs.num_warps}"
            results["rows"].append({"rows": n, "backward": name, "us": ms * 1e3, "read_TB_s": gbytes / ms,
                                    "rel_to_default": err})
            log(f"rows {n:6d} backward {name:10s} {ms * 1e3:8.1f} us  {gbytes / ms:5.2f} TB/s read  "
                f"rel {err:.1e}")
        y = jnp.zeros((n, width), jnp.bfloat16)
        ms = time_jax(jax.jit(lambda y: y * jnp.bfloat16(1.5)), y, reps=1 if args.tiny else args.reps)
        results["rows"].append({"rows": n, "tiles": "XLA y*1.5", "us": ms * 1e3, "moved_TB_s": 2 * gbytes / ms})
        log(f"rows {n:6d} {'XLA y*1.5':14s} {ms * 1e3:8.1f} us  {2 * gbytes / ms:5.2f} TB/s read+written")
    save_json(results, args.out or os.environ.get("OUT"), "feature_rows.json")


if __name__ == "__main__":
    main()
