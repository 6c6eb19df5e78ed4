"""The exact Omega rule's sequential pass as Pallas TPU (Mosaic) kernels, with its backward.

Same computation as `gpu.py` (the math: `support.py`): the sequential part of
`atlas_jax.ops.omega.chunk`, per chunk X = X0 − W S, o = qg S + P X, S ← last·S + kdᵀ X, with
the chunk-parallel operands built in XLA. The TPU way of writing the chunk loop is the grid:

  omega_state_fwd_tpu  grid (B·H, V/BV, N), the chunk axis last and "arbitrary"; the running
                       state block S [K, BV] lives in a VMEM scratch; each grid step loads one
                       chunk's operands (BlockSpecs, pipelined by Mosaic), writes its o block,
                       its start state (for the backward, or when asked) and the state.
  omega_state_bwd_tpu  same grid, chunks visited in reverse by the index maps; the state
                       cotangent dS [K, BV] in VMEM scratch; per chunk d X0 (its V block), the V
                       block's partial sums of d W, d kd, d qg, d P (reduced over V blocks in
                       XLA) and the column sums of S ⊙ dS (d last); d S_0 after the first chunk.

Tied with `jax.custom_vjp` (support.state_pass_vjp); the forward saves the per-chunk start
states (float32 [N, B·H, K, V]) as the backward's residual and the backward recomputes X from
them. Blocks: [M, K], [M, BV], [C, K], [C, M], [C, BV], [K, BV] and [1, 1] / [1, BV]: the last
two dims are full array dims, or BV a multiple of 128 (Mosaic's (8, 128) rule); the entry pads
C and M to multiples of 8 (16 for bf16 operands; padding changes no number). float32 dots ask
for Precision.HIGHEST (the delta family's `tpu_math` helpers); bf16 operands meet the float32
state as float32.

Verification status, honestly: there was no TPU available for this work. The kernels have only
been run in Pallas' TPU interpret mode on CPU (`pltpu.InterpretParams`), where they match the
float32 recurrence (tests/test_omega_kernels.py), and lowered to Mosaic for platform "tpu" by
`jax.export` (JAX's Pallas->Mosaic rules: block shapes and every op in the bodies). Mosaic's own
compiler passes in libtpu, VMEM limits and all performance are unchecked.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from atlas_jax.kernels.delta_family.tpu import resolve_interpret
from atlas_jax.kernels.delta_family.tpu_math import mm, mm_nt, mm_tn
from atlas_jax.kernels.omega import support
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["OmegaTpuBlockSizes", "omega_state_pass_tpu"]

F32 = jnp.float32
_FN = "omega_state_pass_tpu"
_PARALLEL = getattr(pltpu, "PARALLEL", "parallel")
_ARBITRARY = getattr(pltpu, "ARBITRARY", "arbitrary")


@dataclasses.dataclass(frozen=True)
class OmegaTpuBlockSizes:
    """block_v: V columns per program (V itself, or a multiple of 128 dividing V); None: V."""
    block_v: int | None = None

    def check(self, V):
        b = self.block_v
        ok = isinstance(b, (numbers.Integral, np.integer)) and not isinstance(b, bool) \
            and b > 0 and V % b == 0 and (b == V or b % 128 == 0)
        if not ok:
            raise ValueError(f"{_FN}: argument `block_sizes.block_v` must be V = {V} or a multiple "
                             f"of 128 dividing it; got {b!r}.")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static description of one call (hashable: the custom_vjp's nondiff argument)."""
    n_chunks: int
    has_w: bool
    block_v: int
    output_starts: bool
    interpret: object      # False or a pltpu.InterpretParams


# ---------------------------------------------------------------------------------------------
# Kernel bodies: one grid step = one chunk of one (batch·head, V block)


def _chunk_x(x0_ref, w_ref, s):
    x = x0_ref[...].astype(F32)
    return x if w_ref is None else x - mm(w_ref[...], s)


def _fwd_kernel(*refs, cfg: _Cfg, save: bool):
    refs = list(refs)
    x0_ref = refs.pop(0)
    w_ref = refs.pop(0) if cfg.has_w else None
    kd_ref, qg_ref, p_ref, last_ref, s0_ref, o_ref, sT_ref = refs[:7]
    starts_ref = refs[7] if save else None
    s_scr = refs[-1]

    @pl.when(pl.program_id(2) == 0)
    def _():
        s_scr[...] = s0_ref[...]

    s = s_scr[...]
    if save:
        starts_ref[...] = s
    x = _chunk_x(x0_ref, w_ref, s)
    o_ref[...] = (mm(qg_ref[...], s) + mm(p_ref[...], x)).astype(o_ref.dtype)
    s_new = last_ref[...] * s + mm_tn(kd_ref[...], x)
    s_scr[...] = s_new
    sT_ref[...] = s_new          # same block for every chunk: written back after the last


def _bwd_kernel(*refs, cfg: _Cfg, has_dstarts: bool):
    refs = list(refs)
    x0_ref = refs.pop(0)
    w_ref = refs.pop(0) if cfg.has_w else None
    kd_ref, qg_ref, p_ref, last_ref, starts_ref, do_ref, dsT_ref = refs[:7]
    dstarts_ref = refs[7] if has_dstarts else None
    outs = refs[8 if has_dstarts else 7:-1]
    dx0_ref, dkd_ref, dqg_ref, dp_ref, dlast_ref, ds0_ref = outs[:6]
    dw_ref = outs[6] if cfg.has_w else None
    ds_scr = refs[-1]

    @pl.when(pl.program_id(2) == 0)          # the last chunk comes first
    def _():
        ds_scr[...] = dsT_ref[...]

    ds = ds_scr[...]                          # cotangent of this chunk's end state
    s = starts_ref[...]
    do = do_ref[...].astype(F32)
    x = _chunk_x(x0_ref, w_ref, s)
    kd, qg = kd_ref[...], qg_ref[...]
    dx = mm_tn(p_ref[...], do) + mm(kd, ds)
    dx0_ref[...] = dx.astype(dx0_ref.dtype)
    dqg_ref[...] = mm_nt(do, s)
    dp_ref[...] = mm_nt(do, x)
    dkd_ref[...] = mm_nt(x, ds)
    dlast_ref[...] = jnp.sum(s * ds, axis=0, keepdims=True)
    ds_prev = last_ref[...] * ds + mm_tn(qg, do)
    if w_ref is not None:
        dw_ref[...] = -mm_nt(dx, s)
        ds_prev = ds_prev - mm_tn(w_ref[...], dx)
    if dstarts_ref is not None:
        ds_prev = ds_prev + dstarts_ref[...]
    ds_scr[...] = ds_prev
    ds0_ref[...] = ds_prev       # same block for every chunk: the first chunk's is kept


# ---------------------------------------------------------------------------------------------
# Launchers on the kernel layout: per-chunk operands [N, BH, R, D], states [BH, K, V]


def _specs(N, bv, reverse):
    """BlockSpecs of grid (BH, V/BV, N); `reverse` visits the chunks last to first."""
    def chunk(n):
        return N - 1 - n if reverse else n

    def rows(R, D):
        return pl.BlockSpec((None, None, R, D), lambda b, j, n: (chunk(n), b, 0, 0))

    def vrows(R):
        return pl.BlockSpec((None, None, R, bv), lambda b, j, n: (chunk(n), b, 0, j))

    def partial(R, D):
        return pl.BlockSpec((None, None, None, R, D), lambda b, j, n: (j, chunk(n), b, 0, 0))

    def state(K):
        return pl.BlockSpec((None, K, bv), lambda b, j, n: (b, 0, j))

    return rows, vrows, partial, state


def _operand_ins(cfg, x0, w, kd, qg, p, last, rows, vrows):
    M, K = kd.shape[-2:]
    C = qg.shape[-2]
    ins = [(x0, vrows(M))] + ([(w, rows(M, K))] if cfg.has_w else [])
    return ins + [(kd, rows(M, K)), (qg, rows(C, K)), (p, rows(C, M)), (last, rows(1, 1))]


def _pallas(kernel, grid, ins, outs, scratch, name, interpret):
    grid_spec = pl.GridSpec(grid=grid, in_specs=[s for _, s in ins],
                            out_specs=[s for _, s in outs], scratch_shapes=scratch)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=[sd for sd, _ in outs],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(_PARALLEL, _PARALLEL, _ARBITRARY)),
        interpret=interpret, name=name,
    )(*[a for a, _ in ins])


def _forward(cfg: _Cfg, x0, w, kd, qg, p, last, s0, save):
    N, BH, _, V = x0.shape
    K, C = kd.shape[-1], qg.shape[-2]
    bv = cfg.block_v
    rows, vrows, _, state = _specs(N, bv, reverse=False)
    ins = _operand_ins(cfg, x0, w, kd, qg, p, last, rows, vrows) + [(s0, state(K))]
    outs = [(jax.ShapeDtypeStruct((N, BH, C, V), x0.dtype), vrows(C)),
            (jax.ShapeDtypeStruct((BH, K, V), F32), state(K))]
    if save:
        outs.append((jax.ShapeDtypeStruct((N, BH, K, V), F32), vrows(K)))
    res = _pallas(functools.partial(_fwd_kernel, cfg=cfg, save=save), (BH, V // bv, N), ins,
                  outs, [pltpu.VMEM((K, bv), F32)], "omega_state_fwd_tpu", cfg.interpret)
    return res[0], res[1], (res[2] if save else None)


def _backward(cfg: _Cfg, x0, w, kd, qg, p, last, starts, do, dsT, dstarts):
    N, BH, M, V = x0.shape
    K, C = kd.shape[-1], qg.shape[-2]
    bv = cfg.block_v
    nv = V // bv
    rows, vrows, partial, state = _specs(N, bv, reverse=True)
    ins = _operand_ins(cfg, x0, w, kd, qg, p, last, rows, vrows)
    ins += [(starts, vrows(K)), (do, vrows(C)), (dsT, state(K))]
    if dstarts is not None:
        ins.append((dstarts, vrows(K)))
    sds = jax.ShapeDtypeStruct
    outs = [(sds(x0.shape, x0.dtype), vrows(M)),
            (sds((nv, N, BH, M, K), F32), partial(M, K)),
            (sds((nv, N, BH, C, K), F32), partial(C, K)),
            (sds((nv, N, BH, C, M), F32), partial(C, M)),
            (sds((N, BH, 1, V), F32), vrows(1)),
            (sds((BH, K, V), F32), state(K))]
    if cfg.has_w:
        outs.append((sds((nv, N, BH, M, K), F32), partial(M, K)))
    res = _pallas(functools.partial(_bwd_kernel, cfg=cfg, has_dstarts=dstarts is not None),
                  (BH, nv, N), ins, outs, [pltpu.VMEM((K, bv), F32)], "omega_state_bwd_tpu",
                  cfg.interpret)
    dx0, dkd, dqg, dp, dlast, ds0 = res[:6]
    dw = res[6].sum(axis=0) if cfg.has_w else None
    # The V blocks' partial sums, reduced here (one program per V block wrote each slot).
    return (dx0, dw, dkd.sum(axis=0), dqg.sum(axis=0), dp.sum(axis=0),
            dlast.sum(axis=(-2, -1))[..., None, None], ds0)


_core = support.state_pass_vjp(_forward, _backward)


# ---------------------------------------------------------------------------------------------
# Entry


@functools.partial(jax.jit, static_argnames=("cfg", "sizes"))
def _run(x0, w, kd, qg, p, last, s0, *, cfg, sizes):
    N, B, H, C, M, K, V = sizes
    dtype = support.operand_dtype(x0)
    sublanes = 16 if dtype == support.BF16 else 8
    Cp, Mp = support.round_up(C, sublanes), support.round_up(M, sublanes)
    x0, w, kd, qg, p, s0 = support.kernel_operands(x0, w, kd, qg, p, s0, C=Cp, M=Mp, K=K, V=V)

    def flat(a):      # [N, B, H, ...] -> [N, B·H, ...] (free: B and H are adjacent)
        return None if a is None else a.reshape((N, B * H) + a.shape[3:])

    last = last.astype(F32).reshape(N, B * H, 1, 1)       # a [1, 1] block per chunk
    o, sT, starts = _core(cfg, flat(x0), flat(w), flat(kd), flat(qg), flat(p), last,
                          s0.reshape(B * H, K, V))
    o = o.reshape(N, B, H, Cp, V)[..., :C, :]
    sT = sT.reshape(B, H, K, V)
    if starts is not None:
        starts = starts.reshape(N, B, H, K, V)
    return o, sT, starts


def omega_state_pass_tpu(x0, w, kd, qg, p, last, initial_state=None, *,
                         output_chunk_states=False, interpret=None, block_sizes=None):
    """The Omega chunk form's sequential pass with its read-out, as Pallas TPU kernels (custom VJP).

    Arguments and returns as `atlas_jax.kernels.omega.gpu.omega_state_pass_gpu`, except:
      interpret: None: TPU interpret mode unless the default backend is a TPU; True or a
        pltpu.InterpretParams: interpret mode; False: compile with Mosaic (TPU only).
      block_sizes: OmegaTpuBlockSizes or None (block_v = V).

    Only TPU interpret mode on CPU has been run (no TPU was available); see the module docstring.
    """
    sizes = support.check_state_pass(_FN, x0, w, kd, qg, p, last, initial_state)
    V = sizes[-1]
    bs = OmegaTpuBlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, OmegaTpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be an OmegaTpuBlockSizes; got "
                        f"{type(bs).__name__}.")
    if bs.block_v is None:
        bs = dataclasses.replace(bs, block_v=V)
    bs.check(V)
    cfg = _Cfg(n_chunks=sizes[0], has_w=w is not None, block_v=bs.block_v,
               output_starts=bool(output_chunk_states), interpret=resolve_interpret(interpret, _FN))
    return _run(x0, w, kd, qg, p, last, initial_state, cfg=cfg, sizes=sizes)
