#!/usr/bin/env python3
"""Which GpuBlockSizes to keep? Whole-op and per-kernel times of named block-size variants.

Two questions, one flag each (run on the GPU machine, from the repository root):

  whole op      fwd and fwd+bwd of one op per named variant, compiled once and timed in
                interleaved rounds (each round times every variant once; the best round is
                kept), so that drifting clocks or a neighbour's load favour no variant:
                    python3 benchmarks/tune.py --ops gdn --variants default kkt0 merge_tf32
  --per-kernel  every Pallas kernel of one fwd+bwd launched alone (the calls are recorded while
                the op is traced, then re-run on fresh inputs of the recorded shapes), for each
                variant; --only keeps kernel names containing any of the given parts:
                    python3 benchmarks/tune.py --per-kernel --ops kda --variants default \\
                        diag_h2_w1 --only diag

VARIANTS lists the alternatives to today's defaults that a sweep still compares (the reasons
and earlier numbers: benchmarks/results/gpu_block_sizes_notes.md; the retired variants are in
git history); --set FIELD=VALUE ... times one ad-hoc variant too. JSON to --out (default $OUT).
"""

from __future__ import annotations

import argparse
import ast
import math

import timing

# Today's defaults and, per knob, the alternative a sweep compares them with.
VARIANTS = {
    "default": {},
    # K1 (intra-chunk forward)
    "one_k1": dict(split_intra=False),                    # K1 as one kernel
    "narrow_intra": dict(wide_intra=False),               # 16-row dots instead of [C, C] ones
    "kkt0": dict(block_k_kkt=0),                          # K1a: A through the wide scratch
    "kkt32": dict(block_k_kkt=32),
    "merge_tf32": dict(merge_dots=1),                     # fla's solve precision
    "merge6": dict(merge_dots=6),
    "subst": dict(diag_inverse="substitution"),
    "solve_w2": dict(num_warps_solve=2),
    "wu_s3": dict(num_stages_intra=3),
    "wu32_s3": dict(block_wu=32, num_stages_intra=3),
    # KDA's K1d / K1p / K4b
    "diag_h2_w1": dict(diag_heads=2, num_warps_diag=1),
    "diag_h4_w4": dict(diag_heads=4, num_warps_diag=4),
    "pairs_w2": dict(num_warps_pairs=2),
    "pairs_bk128_s1": dict(block_k_pairs=128, num_stages_pairs=1),
    "pairs_split_solve": dict(fuse_pairs_solve=False),      # bf16 KDA: K1a forms T
    "pairs_s3": dict(num_stages_pairs=3),
    "pairs_bk16": dict(block_k_pairs=16),
    "pairs_s1": dict(num_stages_pairs=1),
    "pairs_bk64": dict(block_k_pairs=64),                   # K1p's default before 2026-11-26
    "state_bv64": dict(block_v=64),                         # KDA's K2 default before 2026-11-26
    "wu_s2": dict(num_stages_intra=2),
    "pairs_bwd_bk128": dict(block_k_pairs_bwd=128),
    "wuc32_s3": dict(block_wu_channel=32, num_stages_intra=3),
    # K2 / K2o (state pass, output)
    "fused_out": dict(fuse_output=True),                  # K2 computes O itself, no K2o
    "two_launches": dict(overlap_output=False),           # K2 then K2o (no flags)
    "overlap_out": dict(overlap_output=True),             # K2 and K2o in one launch
    "overlap_bv32": dict(overlap_output=True, block_v_overlap=32),
    "overlap_bv128": dict(overlap_output=True, block_v_overlap=128),
    "state_bv16": dict(block_v=16),
    "state_bv32": dict(block_v=32),
    "state_s2": dict(num_stages_state=2),
    "out_bv64": dict(block_v_out=64),
    "out_bv256": dict(block_v_out=256),
    "out_w4": dict(num_warps_out=4),
    "out_s2": dict(num_stages_out=2),
    "state_w4": dict(num_warps_state=4),
    "state_w16": dict(num_warps_state=16),
    "out_whole": dict(block_k_out=128, num_stages_out=1),
    # K3 / K4 (backward)
    "split_bwd": dict(split_state_bwd=True),
    "nosplit_bwd": dict(split_state_bwd=False),
    "bwd_w4": dict(num_warps_bwd=4),
    "bwd_w8": dict(num_warps_bwd=8),
    "bwd_w16": dict(num_warps_bwd=16),
    "bwd_bv16": dict(block_v_bwd=16),
    "bwd_bv64": dict(block_v_bwd=64),
    "bwd_s1": dict(num_stages_bwd=1),                     # K4q without pipelined V loads
    "bwd_s3": dict(num_stages_bwd=3),
    "bwd_w2": dict(num_warps_bwd=2),
    "one_k4": dict(split_intra_bwd=False),                # K4 as one kernel (before 2026-11-26)
    "bwd_bk32": dict(block_k_bwd=32),                     # K4q: K pieces
    "bwd_bk128": dict(block_k_bwd=128),
    "wy_w2": dict(num_warps_wy=2),                        # K4w
    "wy_w8": dict(num_warps_wy=8),
    "wy_s2": dict(num_stages_wy=2),
    "bwd_bv16_w4": dict(block_v_bwd=16, num_warps_bwd=4),
    "bwd_bv32": dict(block_v_bwd=32),
    "bwd_bv128": dict(block_v_bwd=128),
    # storage between kernels
    "f32_states": dict(state_dtype="float32"),
    "f32_inter": dict(inter_dtype="float32"),
}


def _parse_set(items):
    kw = {}
    for item in items or ():
        field, _, value = item.partition("=")
        try:
            kw[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kw[field] = value
    return kw


def kernel_fn(gpu, block_sizes, scale):
    def fwd(q, k, v, beta, g):
        return gpu.chunk_delta_family_gpu(q, k, v, beta, g, scale=scale, chunk_size=64,
                                          block_sizes=block_sizes)[0]
    return fwd


def whole_op(gpu, shape, op, variants, modes, rounds, reps, res, value_dim=None, value_heads=None):
    import jax
    import jax.numpy as jnp
    B, T, H, D = shape
    q, k, v, beta, g, do = timing.make_inputs(B, T, H, D, value_dim or D, timing.GATE_OF[op],
                                              jnp.bfloat16, value_heads=value_heads)
    runs = []
    for name, kw in variants.items():
        fwd = kernel_fn(gpu, gpu.GpuBlockSizes(**kw), 1.0 / math.sqrt(D))

        def fwdbwd(q, k, v, beta, g, do, fwd=fwd):
            return jax.vjp(fwd, q, k, v, beta, g)[1](do)

        for mode, fn, args in (("fwd", jax.jit(fwd), (q, k, v, beta, g)),
                               ("fwdbwd", jax.jit(fwdbwd), (q, k, v, beta, g, do))):
            if mode in modes:
                runs.append((f"{op}/{name}/{mode}", fn, args))
    for rnd in range(rounds):
        for label, fn, args in runs:
            try:
                ms = timing.time_jax(fn, *args, reps=reps)
                res.setdefault(label, []).append(ms)
                timing.log(f"[tune] {label:34s} {ms:8.3f} ms  (round {rnd})")
            except Exception as e:  # noqa: BLE001
                res[label] = f"error: {type(e).__name__}: {str(e)[:300]}"
                timing.log(f"[tune] {label} ERROR {type(e).__name__}: {str(e)[:1000]}")
    for label, times in res.items():
        if isinstance(times, list):
            timing.log(f"[tune] {label:34s} best {min(times):8.3f} ms")


def per_kernel(gpu, launch, shape, op, variants, only, reps, res, value_dim=None,
               value_heads=None):
    """Each Pallas call of one fwd+bwd, recorded while tracing, then timed alone on fresh inputs
    (small negative floats, so that gates decay; no kernel has data-dependent control flow)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    B, T, H, D = shape
    real = launch._call
    for variant, kw in variants.items():
        recorded = []

        def record(body, grid, ins, outs, **kwargs):
            recorded.append((body, grid, [(n, jax.ShapeDtypeStruct(a.shape, a.dtype), s)
                                          for n, a, s in ins], outs, kwargs))
            return real(body, grid, ins, outs, **kwargs)

        q, k, v, beta, g, do = timing.make_inputs(B, T, H, D, value_dim or D, timing.GATE_OF[op],
                                                  jnp.bfloat16, value_heads=value_heads)
        fwd = kernel_fn(gpu, gpu.GpuBlockSizes(**kw), 1.0 / math.sqrt(D))
        launch._call = record
        try:
            jax.jit(lambda *a: jax.vjp(fwd, *a[:5])[1](a[5])).lower(q, k, v, beta, g, do)
        finally:
            launch._call = real
        times, seen = res.setdefault(variant, {}), set()
        for i, (body, grid, ins, outs, kwargs) in enumerate(recorded):
            # the forward is traced twice (primal and custom_vjp fwd): time each kernel once
            sig = (kwargs["name"], grid, tuple((n, sd.shape) for n, sd, _ in ins))
            if sig in seen:
                continue
            seen.add(sig)
            if only and not any(part in kwargs["name"] for part in only):
                continue
            name = f"{len(seen)}:{kwargs['name']}"
            rng = np.random.default_rng(i)
            arrays = [jnp.asarray(-0.1 * rng.random(sd.shape), sd.dtype)
                      if jnp.issubdtype(sd.dtype, jnp.floating) else jnp.zeros(sd.shape, sd.dtype)
                      for _, sd, _ in ins]
            f = jax.jit(lambda *xs, body=body, grid=grid, ins=ins, outs=outs, kwargs=kwargs: real(
                body, grid, [(n, x, s) for (n, _, s), x in zip(ins, xs)], outs, **kwargs))
            times[name] = timing.time_jax(f, *arrays, reps=reps)
        total = sum(times.values())
        timing.log(f"[kernels] {op} {variant}: sum {total:.3f} ms")
        for name, t in times.items():
            timing.log(f"    {name:34s} {t:8.3f} ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", type=timing.shape_arg, default=(4, 4096, 16, 128), help="B,T,H,D")
    ap.add_argument("--value-dim", type=int, default=None, help="V per head (default D; fla's LM: 2D)")
    ap.add_argument("--value-heads", type=int, default=None,
                    help="HV value heads (grouped: a multiple of H; default H)")
    ap.add_argument("--ops", nargs="+", default=["gdn"], choices=sorted(timing.GATE_OF))
    ap.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    ap.add_argument("--set", nargs="+", metavar="FIELD=VALUE",
                    help="one more variant, 'custom', from GpuBlockSizes fields")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (whole op)")
    ap.add_argument("--per-kernel", action="store_true", help="time every kernel alone")
    ap.add_argument("--only", nargs="+", help="--per-kernel: kernel names containing these")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions")
    ap.add_argument("--out", default=None, help="folder for tune.json (default $OUT)")
    args = ap.parse_args()

    timing.import_tree()
    import jax
    from atlas_jax.kernels.delta_family import gpu, gpu_launch
    variants = {name: VARIANTS[name] for name in args.variants}
    if args.set:
        variants["custom"] = _parse_set(args.set)
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "shape": args.shape,
               "value_dim": args.value_dim or args.shape[3],
               "value_heads": args.value_heads or args.shape[2],
               "variants": variants, "whole_op_ms": {}, "kernels_ms": {}}
    for op in args.ops:
        if args.per_kernel:
            per_kernel(gpu, gpu_launch, args.shape, op, variants, args.only, args.reps,
                       results["kernels_ms"].setdefault(op, {}), args.value_dim,
                       args.value_heads)
        else:
            whole_op(gpu, args.shape, op, variants, args.modes, args.rounds, args.reps,
                     results["whole_op_ms"].setdefault(op, {}), args.value_dim,
                     args.value_heads)
        timing.save_json(results, args.out, "tune.json")


if __name__ == "__main__":
    main()
