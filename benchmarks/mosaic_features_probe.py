"""Which Mosaic GPU features a state-pass kernel would need lower for CUDA and run in interpret mode
with the installed jax: the check to repeat before writing one (the deep memories' state pass on
Mosaic GPU, `benchmarks/results/titans_backward_order_h200_2026-11-29.md`).

The state pass contracts over the chunk's rows as well as over hidden units, so some of its products
take a transposed operand, and it sums shares across the CTAs of a head. The probes here are tiny
kernels ([64, 64] bf16 operands, one warpgroup), each checked two ways on this machine:

* ``cuda``: lowered for CUDA (`jit(...).trace(...).lower(lowering_platforms=("cuda",))`); this
  builds the kernel's MLIR, which needs no GPU;
* ``interpret``: run in Mosaic GPU's interpret mode (``InterpretGPUParams``), or in Pallas'
  generic interpreter with ``--generic``, and compared with the same product in XLA.

The probes:
* plain: wgmma(a, b);
* b_transposed / a_transposed: an operand through `plgpu.transpose_ref`;
* a_in_registers: the A operand as a register value;
* store_transposed: a result stored into a transposed view of shared memory;
* value_transposed: a result transposed in registers (`.T`), then stored;
* semaphore_barrier: two CTAs meeting at a global semaphore (`pl.get_global`, signal, wait), the
  cross-CTA barrier a head's tiles would need.

    python benchmarks/mosaic_features_probe.py [--generic]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BF16, F32 = jnp.bfloat16, jnp.float32
N = 64


def _smem(shape, dtype):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    swizzle = plgpu.find_swizzle(shape[-1] * jnp.dtype(dtype).itemsize * 8)
    tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def _product(a, b):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def run(acc):
        plgpu.wgmma(acc, a, b)
        plgpu.wgmma_wait(0)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC((N, N), F32))


def _product_probe(kind):
    """(kernel body, its XLA reference) for one of the product probes."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(a_g, b_g, o_g, a_s, b_s, o_s, bar):
        for src, dst in ((a_g, a_s), (b_g, b_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
        a, b = a_s, b_s
        if kind == "b_transposed":
            b = plgpu.transpose_ref(b_s, (1, 0))
        elif kind == "a_transposed":
            a = plgpu.transpose_ref(a_s, (1, 0))
        elif kind == "a_in_registers":
            a = a_s[...]
        y = _product(a, b)
        if kind == "store_transposed":
            plgpu.transpose_ref(o_s, (1, 0))[...] = y
        elif kind == "value_transposed":
            o_s[...] = y.T
        else:
            o_s[...] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g)
        plgpu.wait_smem_to_gmem(0)

    want = {"b_transposed": lambda a, b: a @ b.T, "a_transposed": lambda a, b: a.T @ b,
            "store_transposed": lambda a, b: (a @ b).T, "value_transposed": lambda a, b: (a @ b).T}
    return body, want.get(kind, lambda a, b: a @ b)


def _semaphore_body(x_g, o_g, o_s):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    c = lax.axis_index("programs")
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    pl.semaphore_signal(sem, 1)
    pl.semaphore_wait(sem, value=2, decrement=False)
    o_s[...] = jnp.full((N, N), c.astype(F32) + 1.0, F32) + x_g[0, 0]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_g.at[c])
    plgpu.wait_smem_to_gmem(0)


def _kernel(body, out, scratch, interpret, grid=(1,)):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.kernel(body, out_type=out, scratch_types=scratch, grid=grid, grid_names=("programs",),
                        interpret=interpret,
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def _outcome(run):
    try:
        return run()
    except Exception as e:   # a probe that fails is the finding, reported rather than raised
        lines = [line for line in str(e).splitlines() if "Error" in line or "error" in line]
        return f"fails: {type(e).__name__}: {(lines[-1] if lines else str(e).splitlines()[0])[:160]}"


def main():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generic", action="store_true", help="Pallas' generic interpreter instead of Mosaic GPU's")
    args = p.parse_args()
    if args.generic:
        interpret = True
    else:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret = InterpretGPUParams()

    a = jax.random.normal(jax.random.PRNGKey(0), (N, N)).astype(BF16)
    b = jax.random.normal(jax.random.PRNGKey(1), (N, N)).astype(BF16)
    rel = lambda got, want: f"runs, relative error {float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)):.1e}"
    rows = []
    for kind in ("plain", "b_transposed", "a_transposed", "a_in_registers", "store_transposed", "value_transposed"):
        body, want = _product_probe(kind)
        scratch = [_smem((N, N), BF16), _smem((N, N), BF16), _smem((N, N), F32), plgpu.Barrier(num_barriers=1)]
        out = jax.ShapeDtypeStruct((N, N), F32)
        cuda = _outcome(lambda: jax.jit(_kernel(body, out, scratch, None)).trace(a, b).lower(
            lowering_platforms=("cuda",)) and "lowers")
        interp = _outcome(lambda: rel(_kernel(body, out, scratch, interpret)(a, b),
                                      want(a.astype(F32), b.astype(F32))))
        rows.append((kind, cuda, interp))
    x = jnp.zeros((1, 1), F32)
    out = jax.ShapeDtypeStruct((2, N, N), F32)
    cuda = _outcome(lambda: jax.jit(_kernel(_semaphore_body, out, [_smem((N, N), F32)], None, grid=(2,))).trace(
        x).lower(lowering_platforms=("cuda",)) and "lowers")
    interp = _outcome(lambda: "runs, CTA values " + ", ".join(
        str(float(v)) for v in _kernel(_semaphore_body, out, [_smem((N, N), F32)], interpret, grid=(2,))(x)[:, 0, 0]))
    rows.append(("semaphore_barrier", cuda, interp))
    mode = "generic interpreter" if args.generic else "Mosaic GPU interpret mode"
    print(f"\n# Mosaic GPU features, jax {jax.__version__} on {jax.default_backend()} ({mode})\n")
    print("| probe | CUDA lowering | interpret |\n| --- | --- | --- |")
    for kind, cuda, interp in rows:
        print(f"| {kind} | {cuda} | {interp} |")


if __name__ == "__main__":
    main()
