"""How long the sequential chunk loop of a persistent kernel takes per chunk: Pallas' Triton
lowering (what `kernels/deep_memory/gpu.py` is built on) against its Mosaic GPU lowering
(operands in shared memory, TMA, wgmma), side by side in one process on one GPU.

The deep memories' state-pass kernels (titans: 64 chunks of 64 steps, d 128, hidden tiles of 64)
walk a chunk as a chain of dependent products over the chunk's rows and the program's state
tiles. Two probes of that loop, for C programs walking N chunks of x [n, d]:

* chain: with two bf16 tiles S0 [d, h], S1 [h, d] held by the program, ``steps`` times
  Z = x S0, H = bf16(Z / 2), Y = H S1, x = bf16(Y) (float32 accumulation); the last Y is written.
  Every product needs the one before it, as in the state pass; no state changes: the chain alone.
* stream: the chain, then four float32 state tiles T_k [d, h] read, used and rewritten every chunk
  (P_k = x bf16(T_k), T_k' = 0.9 T_k + xᵀ bf16(P_k / 100); every chunk's tiles kept, as the
  state pass keeps its cotangents): the chain plus the state's traffic. ``--live N`` adds Triton
  variants that keep N more [n, h] float32 values live across the tiles.

    python benchmarks/mosaic_chain_probe.py [--programs 256] [--chunks 64] [--steps 4 8] [--live 4 8]

Every variant's relative error against the same computation in XLA is reported next to its time
(median of --reps calls), in µs per chunk and per product. On a CPU, ``--lower-only`` lowers the
Mosaic kernels for CUDA (their MLIR is built here; only compiling them needs a GPU) and
``--interpret`` runs all four kernels in interpret mode on tiny shapes against XLA (Mosaic GPU's
interpret mode simulates the threads, shared memory and barriers; it lacks transposed wgmma
operands and `pl.run_state`, which these kernels therefore avoid).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BF16, F32 = jnp.bfloat16, jnp.float32


def chain_reference(x, s0, s1, steps):
    """The chain in XLA, [C, N, n, d] -> last Y [C, N, n, d] float32."""
    def one(x, s0, s1):
        y = None
        for _ in range(steps):
            z = jnp.einsum("ND,DH->NH", x, s0, preferred_element_type=F32)
            y = jnp.einsum("NH,HD->ND", (z * 0.5).astype(BF16), s1, preferred_element_type=F32)
            x = y.astype(BF16)
        return y
    return jax.vmap(lambda xc, a, b: jax.vmap(lambda xi: one(xi, a, b))(xc))(x, s0, s1)


def _triton_chain(x, s0, s1, steps):
    """The chain on values inside a Triton kernel: (the last Z, the last Y)."""
    z = y = None
    for _ in range(steps):
        z = jnp.dot(x if y is None else y.astype(BF16), s0, preferred_element_type=F32)
        y = jnp.dot((z * 0.5).astype(BF16), s1, preferred_element_type=F32)
    return z, y


def chain_triton(x, s0, s1, steps, num_warps=4, interpret=False):
    from jax.experimental.pallas import triton as pltriton
    C, N, n, d = x.shape

    def kernel(x_ref, s0_ref, s1_ref, o_ref):
        c = pl.program_id(0)

        def chunk(i, carry):
            o_ref[c, i, :, :] = _triton_chain(x_ref[c, i, :, :], s0_ref[c, :, :], s1_ref[c, :, :], steps)[1]
            return carry

        lax.fori_loop(0, N, chunk, 0)

    return pl.pallas_call(
        kernel, grid=(C,), out_shape=jax.ShapeDtypeStruct((C, N, n, d), F32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="chain_triton")(x, s0, s1)


def _smem(shape, dtype):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    swizzle = plgpu.find_swizzle(shape[-1] * jnp.dtype(dtype).itemsize * 8)
    tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def _mosaic_copy_in(src, dst, bar):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
    plgpu.barrier_wait(bar.at[0])


def _mosaic_product(a_ref, b_ref, shape):
    """a_ref @ b_ref (shared memory, bf16) by one wgmma into a float32 accumulator, read back."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def run(acc):
        plgpu.wgmma(acc, a_ref, b_ref)
        plgpu.wgmma_wait(0)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, F32))


def _mosaic_chain(x_smem, work_smem, s0_smem, s1_smem, h_smem, steps):
    """The chain from x_smem; each step's x goes to work_smem (which may be x_smem). Returns Y."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    n, h = h_smem.shape
    d = s1_smem.shape[-1]
    y = None
    for step in range(steps):
        z = _mosaic_product(x_smem if step == 0 else work_smem, s0_smem, (n, h))
        h_smem[...] = (z * 0.5).astype(BF16)
        plgpu.commit_smem()
        y = _mosaic_product(h_smem, s1_smem, (n, d))
        if step + 1 < steps:
            work_smem[...] = y.astype(BF16)
            plgpu.commit_smem()
    return y


def _mosaic_interpret(interpret):
    """plgpu.kernel's `interpret`: GPU interpret mode (threads, shared memory and barriers
    simulated on the CPU) when asked."""
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def chain_mosaic(x, s0, s1, steps, interpret=False):
    """One warpgroup a program; x, S0, S1 and H in shared memory (TMA loads), each product one
    wgmma into a float32 accumulator, read back into registers, cast and stored for the next."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    C, N, n, d = x.shape
    h = s0.shape[-1]

    def body(x_gmem, s0_gmem, s1_gmem, o_gmem, x_smem, s0_smem, s1_smem, h_smem, o_smem, bar):
        c = lax.axis_index("programs")
        _mosaic_copy_in(s0_gmem.at[c], s0_smem, bar)
        _mosaic_copy_in(s1_gmem.at[c], s1_smem, bar)

        def chunk(i, carry):
            _mosaic_copy_in(x_gmem.at[c, i], x_smem, bar)
            y = _mosaic_chain(x_smem, x_smem, s0_smem, s1_smem, h_smem, steps)
            plgpu.wait_smem_to_gmem(0)   # the previous chunk's output left o_smem
            o_smem[...] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[c, i])
            return carry

        lax.fori_loop(0, N, chunk, 0)
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((C, N, n, d), F32),
        scratch_types=[_smem((n, d), BF16), _smem((d, h), BF16), _smem((h, d), BF16), _smem((n, h), BF16),
                        _smem((n, d), F32), plgpu.Barrier(num_barriers=1)],
        grid=(C,), grid_names=("programs",), interpret=_mosaic_interpret(interpret),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return f(x, s0, s1)


# --- with state traffic: four float32 state tiles T_k [d, h] a program, read, used and rewritten
# every chunk (as the state pass's cotangent tiles are): per tile P_k = x bf16(T_k),
# T_k' = 0.9 T_k + xᵀ bf16(P_k / 100), after the chain above; every chunk's tiles are kept.

TILES = 4


def stream_reference(x, s0, s1, init, steps):
    """[C, N, n, d], init [C, TILES, d, h] -> (last Y [C, N, n, d], states [C, N, TILES, d, h])."""
    def one(x, s0, s1, t0):
        def chunk(t, xi):
            y = chain_reference(xi[None, None], s0[None], s1[None], steps)[0, 0]
            p = jnp.einsum("ND,KDH->KNH", xi, t.astype(BF16), preferred_element_type=F32)
            t = 0.9 * t + jnp.einsum("ND,KNH->KDH", xi, (p / 100).astype(BF16), preferred_element_type=F32)
            return t, (y, t)
        return lax.scan(chunk, t0, x)[1]
    return jax.vmap(one)(x, s0, s1, init)


def stream_triton(x, s0, s1, init, steps, num_warps=4, live=0, interpret=False):
    """``live``: that many [n, h] float32 values formed before the tiles and used (times 0) by
    the last one, so that they stay live across the tiles' loads and products (as the state
    pass's row values do)."""
    from jax.experimental.pallas import triton as pltriton
    C, N, n, d = x.shape
    h = s0.shape[-1]

    def kernel(x_ref, s0_ref, s1_ref, init_ref, o_ref, st_ref):
        c = pl.program_id(0)

        def chunk(i, carry):
            xi = x_ref[c, i, :, :]
            z, y = _triton_chain(xi, s0_ref[c, :, :], s1_ref[c, :, :], steps)
            o_ref[c, i, :, :] = y
            extras = [z * (1.0 + e) for e in range(live)]
            for k in range(TILES):
                t = jnp.where(i == 0, init_ref[c, k, :, :], st_ref[c, jnp.maximum(i - 1, 0), k, :, :])
                p = jnp.dot(xi, t.astype(BF16), preferred_element_type=F32)
                if k == TILES - 1:
                    for extra in extras:
                        p = p + 0.0 * extra
                upd = lax.dot_general(xi, (p / 100).astype(BF16), (((0,), (0,)), ((), ())),
                                      preferred_element_type=F32)
                st_ref[c, i, k, :, :] = 0.9 * t + upd
            return carry

        lax.fori_loop(0, N, chunk, 0)

    return pl.pallas_call(
        kernel, grid=(C,), out_shape=(jax.ShapeDtypeStruct((C, N, n, d), F32),
                                      jax.ShapeDtypeStruct((C, N, TILES, d, h), F32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="stream_triton")(x, s0, s1, init)


def stream_mosaic(x, s0, s1, init, steps, interpret=False):
    """As chain_mosaic, plus each tile TMA-loaded into shared memory (float32), cast to a bf16
    copy there for the products, updated in a float32 accumulator and TMA-stored; nothing
    overlapped (a first cut). xᵀ comes from a transposed copy of x in memory, not a transposed
    view of x's shared-memory tile (GPU interpret mode lacks transposed wgmma operands; measured
    2026-11-27 with the view)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    C, N, n, d = x.shape
    h = s0.shape[-1]

    def body(x_gmem, xt_gmem, s0_gmem, s1_gmem, init_gmem, o_gmem, st_gmem,
             x_smem, s0_smem, s1_smem, h_smem, o_smem, t_smem, tb_smem, p_smem, xb_smem, xt_smem, bar):
        c = lax.axis_index("programs")
        _mosaic_copy_in(s0_gmem.at[c], s0_smem, bar)
        _mosaic_copy_in(s1_gmem.at[c], s1_smem, bar)

        def chunk(i, carry):
            _mosaic_copy_in(x_gmem.at[c, i], x_smem, bar)
            _mosaic_copy_in(xt_gmem.at[c, i], xt_smem, bar)
            y = _mosaic_chain(x_smem, xb_smem, s0_smem, s1_smem, h_smem, steps)   # x stays for the tiles
            plgpu.wait_smem_to_gmem(0)
            o_smem[...] = y
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[c, i])
            for k in range(TILES):
                @pl.when(i == 0)
                def _():
                    plgpu.copy_gmem_to_smem(init_gmem.at[c, k], t_smem, bar.at[0])

                @pl.when(i > 0)
                def _():
                    plgpu.copy_gmem_to_smem(st_gmem.at[c, jnp.maximum(i - 1, 0), k], t_smem, bar.at[0])

                plgpu.barrier_wait(bar.at[0])
                t = t_smem[...]
                tb_smem[...] = t.astype(BF16)
                plgpu.commit_smem()
                p = _mosaic_product(x_smem, tb_smem, (n, h))
                p_smem[...] = (p / 100).astype(BF16)
                plgpu.commit_smem()
                # (an accumulator started at 0.9 T, `pl.run_state(...)(plgpu.ACC.init(...))`, would
                # save the add, but GPU interpret mode lacks run_state)
                new = 0.9 * t + _mosaic_product(xt_smem, p_smem, (d, h))
                plgpu.wait_smem_to_gmem(0)
                t_smem[...] = new
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(t_smem, st_gmem.at[c, i, k])
                plgpu.wait_smem_to_gmem(0)   # t_smem is loaded again for the next tile
            return carry

        lax.fori_loop(0, N, chunk, 0)
        plgpu.wait_smem_to_gmem(0)

    f = plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct((C, N, n, d), F32), jax.ShapeDtypeStruct((C, N, TILES, d, h), F32)),
        scratch_types=[_smem((n, d), BF16), _smem((d, h), BF16), _smem((h, d), BF16), _smem((n, h), BF16),
                       _smem((n, d), F32), _smem((d, h), F32), _smem((d, h), BF16), _smem((n, h), BF16),
                       _smem((n, d), BF16), _smem((d, n), BF16), plgpu.Barrier(num_barriers=1)],
        grid=(C,), grid_names=("programs",), interpret=_mosaic_interpret(interpret),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return f(x, jnp.swapaxes(x, -1, -2), s0, s1, init)


def operands(programs, chunks, n=64, d=128, h=64, seed=0):
    k0, k1, k2 = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k0, (programs, chunks, n, d)).astype(BF16)
    # scaled so that the chain neither grows nor vanishes over its steps
    s0 = (jax.random.normal(k1, (programs, d, h)) * (2.0 / d) ** 0.5).astype(BF16)
    s1 = (jax.random.normal(k2, (programs, h, d)) * (4.0 / h) ** 0.5).astype(BF16)
    return x, s0, s1


def state0(x, s0):
    C, d, h = x.shape[0], s0.shape[1], s0.shape[2]
    return jax.random.normal(jax.random.PRNGKey(7), (C, TILES, d, h), F32) * 0.1


def timed(f, args, reps):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, default=256)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--steps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--live", type=int, nargs="*", default=[], help="triton stream variants with this many extra live values")
    p.add_argument("--lower-only", action="store_true", help="lower the Mosaic kernels for CUDA and stop")
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU: every kernel in interpret mode on tiny shapes, errors only (no timing)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()

    if args.lower_only:
        x, s0, s1 = operands(2, 3)
        lowered = jax.jit(functools.partial(chain_mosaic, steps=2)).trace(x, s0, s1).lower(
            lowering_platforms=("cuda",))
        print("mosaic kernel lowered:", len(lowered.as_text()), "characters of StableHLO")
        lowered = jax.jit(functools.partial(stream_mosaic, steps=2)).trace(x, s0, s1, state0(x, s0)).lower(
            lowering_platforms=("cuda",))
        print("mosaic stream kernel lowered:", len(lowered.as_text()), "characters of StableHLO")
        return

    if args.interpret:
        x, s0, s1 = operands(2, 3)
        init = state0(x, s0)
        chain_want, stream_want = chain_reference(x, s0, s1, 2), stream_reference(x, s0, s1, init, 2)
        for name, fn, ins, want in (("triton", chain_triton, (x, s0, s1), chain_want),
                                    ("mosaic", chain_mosaic, (x, s0, s1), chain_want),
                                    ("triton stream", stream_triton, (x, s0, s1, init), stream_want),
                                    ("mosaic stream", stream_mosaic, (x, s0, s1, init), stream_want)):
            got = fn(*ins, steps=2, interpret=True)
            err = max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
                      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            print(f"{name} (interpret mode): relative error {err:.1e}")
        return

    rows = []

    def measure(name, fn, operands_, want, steps, products):
        """One variant: its relative error against ``want`` (the largest over its outputs) and its
        time; a variant that does not compile here is reported, not fatal."""
        f = jax.jit(functools.partial(fn, steps=steps))
        try:
            got = f(*operands_)
            err = max(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
                      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
            ms = timed(f, operands_, args.reps)
        except Exception as e:
            rows.append(dict(variant=name, steps=steps, error=f"{type(e).__name__}: {str(e)[:300]}"))
        else:
            per_chunk = ms * 1e3 / args.chunks
            rows.append(dict(variant=name, steps=steps, ms=round(ms, 3), rel_err=err,
                             us_per_chunk=round(per_chunk, 2), us_per_product=round(per_chunk / products, 3)))
        print(rows[-1], flush=True)

    x, s0, s1 = operands(args.programs, args.chunks)
    init = state0(x, s0)
    for steps in args.steps:
        want = jax.jit(functools.partial(chain_reference, steps=steps))(x, s0, s1)
        for name, fn in (("xla", chain_reference), ("triton", chain_triton), ("mosaic", chain_mosaic)):
            measure(name, fn, (x, s0, s1), want, steps, 2 * steps)
    for steps in args.steps:
        want = jax.jit(functools.partial(stream_reference, steps=steps))(x, s0, s1, init)
        variants = [("xla stream", stream_reference), ("triton stream", stream_triton),
                    ("mosaic stream", stream_mosaic)]
        variants += [(f"triton stream, {n} live [n, h]", functools.partial(stream_triton, live=n))
                     for n in args.live if n]
        for name, fn in variants:
            measure(name, fn, (x, s0, s1, init), want, steps, 2 * steps + 2 * TILES)
    device = jax.devices()[0].device_kind
    print(f"\n# dependent-product chain, {args.programs} programs x {args.chunks} chunks, x [64, 128], "
          f"S0 [128, 64], S1 [64, 128] bf16 ({device}, jax {jax.__version__})\n")
    print("| variant | steps | ms | µs / chunk | µs / product | rel. error |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['steps']} | failed: {r['error'][:80]} | | | |")
        else:
            print(f"| {r['variant']} | {r['steps']} | {r['ms']} | {r['us_per_chunk']} | {r['us_per_product']} | "
                  f"{r['rel_err']:.1e} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mosaic_chain_probe.json"), "w") as fh:
        json.dump(dict(device=device, jax=jax.__version__, programs=args.programs, chunks=args.chunks, rows=rows),
                  fh, indent=1)


if __name__ == "__main__":
    main()
