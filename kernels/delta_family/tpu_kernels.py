"""Pallas TPU (Mosaic) kernels of the chunked delta family and their `pallas_call`s.

Kernel layout (prepared by `tpu.py`): q, k [B, H, Tp, K]; v [B, H, Tp, V]; beta [B, H, Tp, 1];
g [B, H, Tp, Kg] raw per-token log-decays (Kg = 1 scalar gate, K channel gate); Tp = N * C.
Every block is (C, K), (C, V), (C, 1), (C, Kg), (K, V) or (K, Vb): the last two block dims are
the full array dims or (V tiles) multiples of 128, and C is a multiple of 8 (16 for bf16), so
the blocks satisfy Mosaic's (8, 128) rule. The per-chunk math is `tpu_math.chunk_forward` /
`chunk_backward`. With the chunk's start state S, per chunk:

    u = U0 - W S,   o = Qg S + P u,   S' = D S + Kd^T u
    (U0 = T beta V, W = T beta exp(G) K, T = (I + beta A)^{-1}, Qg = exp(G) Qs, Kd = exp(G_C - G) K,
     D = exp(G_C), A / P the decayed k.k / q.k products.)

Fused (default), two kernels:
  fused_fwd  grid (B, H, N), chunk axis last and "arbitrary"; the running state S [K, V] lives
             in a VMEM scratch; each step does the chunk's intra work and the state update.
             Optionally writes every chunk's start state h (the backward's only residual).
  fused_bwd  same grid, chunks visited in reverse by the index maps; the state cotangent dS
             [K, V] lives in VMEM scratch; each step recomputes the chunk and writes dq, dk,
             dv, dbeta, dg from (h, dS, dO), then dS <- Qg^T dO - W^T (P^T dO + Kd dS) + D dS.
Split (BlockSizes(fused=False)), four kernels:
  intra_fwd  grid (B, H, N), all parallel: W, Kd, Qe = Qg - P W, D, U0, O0 = P U0 to HBM.
  state_fwd  grid (B, H, V/Vb, N), chunk axis "arbitrary", S [K, Vb] in VMEM scratch:
             o = Qe S + O0; u = U0 - W S; S <- D S + Kd^T u.
  state_bwd  same grid, reversed: writes each chunk's end-state cotangent dS.
  intra_bwd  grid (B, H, N), parallel: dq, dk, dv, dbeta, dg from (h, dS, dO).

Sequence boundaries (packed variable-length batches and the start of every batch row) are
scalar-prefetched per chunk: `seq[n]` (which state slot chunk n belongs to), `first[n]`, `last[n]`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from atlas_jax.kernels.delta_family import tpu_math as tm

F32 = jnp.float32
_PARALLEL = getattr(pltpu, "PARALLEL", "parallel")
_ARBITRARY = getattr(pltpu, "ARBITRARY", "arbitrary")


def _params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _kg(mode, K):
    return K if mode == "channel" else 1


class _Layout(NamedTuple):
    """The token-major kernels' sizes: B, value heads H, padded length Tp, K, V, the value heads
    per q/k head (group), chunk C, chunks N, whether a gate is read and its width kg."""
    B: int
    H: int
    Tp: int
    K: int
    V: int
    group: int
    C: int
    N: int
    gated: bool
    kg: int


def _layout(cfg, q, v):
    B, H, Tp, K = v.shape[:3] + q.shape[3:]      # H: value heads (grouped: q/k shared)
    return _Layout(B, H, Tp, K, v.shape[-1], H // q.shape[1], cfg.chunk, Tp // cfg.chunk,
                   cfg.mode != "none", _kg(cfg.mode, K))


def _token_inputs(lay, tok):
    """BlockSpecs of q and k (shared by grouped value heads), v, beta and, when gated, g."""
    shared = _shared(tok(lay.K), lay.group)
    return [shared, shared, tok(lay.V), tok(1)] + ([tok(lay.kg)] if lay.gated else [])


def _token_grads(lay, tok):
    """BlockSpecs and float32 shapes of dq, dk, dv, dbeta and, when gated, dg."""
    widths = (lay.K, lay.K, lay.V, 1) + ((lay.kg,) if lay.gated else ())
    return [tok(d) for d in widths], [jax.ShapeDtypeStruct((lay.B, lay.H, lay.Tp, d), F32) for d in widths]


def _split_gate(refs, lead, gated):
    """(refs[:lead], the gate's ref or None, the refs after it): every kernel reads an optional
    gate right after its ``lead`` leading inputs."""
    if gated:
        return refs[:lead], refs[lead], refs[lead + 1:]
    return refs[:lead], None, refs[lead:]


def _start_state(first_ref, n, h0_ref, s_scr, h_ref):
    """The running state (VMEM scratch ``s_scr``) at chunk n's start, reset to the initial state at
    a sequence's first chunk, and stored in ``h_ref`` (every chunk's start state) unless None."""
    @pl.when(first_ref[n] == 1)
    def _():
        s_scr[...] = h0_ref[...]

    s = s_scr[...]
    if h_ref is not None:
        h_ref[...] = s
    return s


def _chunk_forward(cfg, q_ref, k_ref, v, beta, g_ref):
    return tm.chunk_forward(q_ref[...], k_ref[...], v, beta, None if g_ref is None else g_ref[...],
                            mode=cfg.mode, scale=cfg.scale, normalize=cfg.normalize, eps=cfg.eps, sub=cfg.sub)


def _store_chunk_grads(cfg, token_refs, g_ref, h, ds, do, grad_refs):
    """Recomputes the chunk from its token refs (q, k, v, beta), stores dq, dk, dv, dbeta (and dg
    when gated) in ``grad_refs`` and returns the cotangent of the chunk's start state."""
    q_ref, k_ref, v_ref, b_ref = token_refs
    v, beta = v_ref[...], b_ref[...]
    f = _chunk_forward(cfg, q_ref, k_ref, v, beta, g_ref)
    *grads, ds_prev = tm.chunk_backward(f, v, beta, h, ds, do, scale=cfg.scale, normalize=cfg.normalize)
    for ref, x in zip(grad_refs, grads[:len(grad_refs)]):
        ref[...] = x
    return ds_prev


# ------------------------------------------------------------------------------------------------
# intra-chunk forward
# ------------------------------------------------------------------------------------------------
def _intra_fwd_kernel(*refs, cfg, full):
    gated = cfg.mode != "none"
    (q_ref, k_ref, v_ref, b_ref), g_ref, outs = _split_gate(refs, 4, gated)
    f = _chunk_forward(cfg, q_ref, k_ref, v_ref[...], b_ref[...], g_ref)
    qe = f["qg"] - tm.mm(f["p"], f["w"])
    w_ref, kd_ref, qe_ref = outs[:3]
    w_ref[...] = f["w"]
    kd_ref[...] = f["kd"]
    qe_ref[...] = qe
    rest = outs[3:]
    if gated:
        rest[0][...] = f["gate"].d_col()
        rest = rest[1:]
    if full:
        u0_ref, o0_ref = rest
        u0_ref[...] = f["u0"]
        o0_ref[...] = tm.mm(f["p"], f["u0"])


def _shared(spec, group):
    """The BlockSpec of q or k ([B, H, Tp, K]) on a grid over value heads: grouped value heads
    (HV = group * H) read q/k head h // group, as fla's GVA."""
    if group == 1:
        return spec
    index_map = spec.index_map

    def shared(*idx):
        out = tuple(index_map(*idx))
        return (out[0], out[1] // group) + out[2:]

    return pl.BlockSpec(spec.block_shape, shared)


def intra_fwd(cfg, q, k, v, beta, g, *, full=True):
    """Returns (W, Kd, Qe [B,H,Tp,K], D [B,H,N,Kd,1] or None, U0, O0 [B,H,Tp,V] if full)."""
    lay = _layout(cfg, q, v)
    B, H, Tp, K, V, C, N, gated, kg = lay.B, lay.H, lay.Tp, lay.K, lay.V, lay.C, lay.N, lay.gated, lay.kg

    def tok(d):
        return pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, n, 0))

    in_specs = _token_inputs(lay, tok)
    out_specs = [tok(K), tok(K), tok(K)]
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, K), F32)] * 3
    if gated:
        out_specs.append(pl.BlockSpec((None, None, None, kg, 1), lambda b, h, n: (b, h, n, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, N, kg, 1), F32))
    if full:
        out_specs += [tok(V), tok(V)]
        out_shape += [jax.ShapeDtypeStruct((B, H, Tp, V), F32)] * 2
    args = (q, k, v, beta) + ((g,) if gated else ())
    outs = pl.pallas_call(
        functools.partial(_intra_fwd_kernel, cfg=cfg, full=full),
        grid=(B, H, N), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params((_PARALLEL,) * 3), interpret=cfg.interpret,
        name="delta_intra_fwd",
    )(*args)
    w, kd, qe = outs[:3]
    rest = list(outs[3:])
    d = rest.pop(0) if gated else None
    u0, o0 = (rest if full else (None, None))
    return w, kd, qe, d, u0, o0


# ------------------------------------------------------------------------------------------------
# sequential state pass, forward
# ------------------------------------------------------------------------------------------------
def _state_fwd_kernel(seq_ref, first_ref, *refs, gated, save_h):
    del seq_ref
    (w_ref, kd_ref, qe_ref, u0_ref, o0_ref), d_ref, rest = _split_gate(refs, 5, gated)
    h0_ref, o_ref, fin_ref = rest[:3]
    h_ref = rest[3] if save_h else None
    s_scr = refs[-1]
    s = _start_state(first_ref, pl.program_id(3), h0_ref, s_scr, h_ref)
    o_ref[...] = (tm.mm(qe_ref[...], s) + o0_ref[...]).astype(o_ref.dtype)
    u = u0_ref[...] - tm.mm(w_ref[...], s)
    decayed = d_ref[...] * s if gated else s
    s_new = decayed + tm.mm_tn(kd_ref[...], u)
    s_scr[...] = s_new
    fin_ref[...] = s_new


def state_fwd(cfg, w, kd, qe, d, u0, o0, h0, seq, first, *, out_dtype, save_h):
    """Returns (o [B,H,Tp,V] out_dtype, final [S,H,K,V] f32, h [B,H,N,K,V] f32 or None)."""
    B, H, Tp, K = w.shape
    V = u0.shape[-1]
    C = cfg.chunk
    N = Tp // C
    vb = cfg.block_v(V)
    gated = d is not None
    kg = d.shape[-2] if gated else 1

    def ck(b, h, iv, n, sq, fr):
        return (b, h, n, 0)

    def cv(b, h, iv, n, sq, fr):
        return (b, h, n, iv)

    def st(b, h, iv, n, sq, fr):
        return (b + sq[n], h, 0, iv)

    in_specs = ([pl.BlockSpec((None, None, C, K), ck)] * 3
                + [pl.BlockSpec((None, None, C, vb), cv)] * 2)
    if gated:
        in_specs.append(pl.BlockSpec((None, None, None, kg, 1),
                                     lambda b, h, iv, n, sq, fr: (b, h, n, 0, 0)))
    in_specs.append(pl.BlockSpec((None, None, K, vb), st))
    out_specs = [pl.BlockSpec((None, None, C, vb), cv), pl.BlockSpec((None, None, K, vb), st)]
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, V), out_dtype),
                 jax.ShapeDtypeStruct(h0.shape, F32)]
    if save_h:
        out_specs.append(pl.BlockSpec((None, None, None, K, vb),
                                      lambda b, h, iv, n, sq, fr: (b, h, n, 0, iv)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, N, K, V), F32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, H, V // vb, N), in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=[pltpu.VMEM((K, vb), F32)])
    args = (w, kd, qe, u0, o0) + ((d,) if gated else ()) + (h0,)
    outs = pl.pallas_call(
        functools.partial(_state_fwd_kernel, gated=gated, save_h=save_h),
        grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=_params((_PARALLEL,) * 3 + (_ARBITRARY,)), interpret=cfg.interpret,
        name="delta_state_fwd",
    )(seq, first, *args)
    return outs[0], outs[1], (outs[2] if save_h else None)


# ------------------------------------------------------------------------------------------------
# sequential state pass, backward (reverse chunk order)
# ------------------------------------------------------------------------------------------------
def _state_bwd_kernel(seq_ref, last_ref, *refs, gated, n_chunks):
    del seq_ref
    (w_ref, kd_ref, qe_ref, do_ref), d_ref, rest = _split_gate(refs, 4, gated)
    dfin_ref, dh_ref, dh0_ref = rest[:3]
    ds_scr = refs[-1]
    c = n_chunks - 1 - pl.program_id(3)

    @pl.when(last_ref[c] == 1)
    def _():
        ds_scr[...] = dfin_ref[...]

    ds = ds_scr[...]
    dh_ref[...] = ds                                   # cotangent of this chunk's end state
    do = do_ref[...].astype(F32)
    du = tm.mm(kd_ref[...], ds)
    carried = d_ref[...] * ds if gated else ds
    ds_prev = tm.mm_tn(qe_ref[...], do) + carried - tm.mm_tn(w_ref[...], du)
    ds_scr[...] = ds_prev
    dh0_ref[...] = ds_prev


def state_bwd(cfg, w, kd, qe, d, do, dfin, seq, last):
    """Returns (dH [B,H,N,K,V]: cotangent of each chunk's end state, dh0 [S,H,K,V])."""
    B, H, Tp, K = w.shape
    V = do.shape[-1]
    C = cfg.chunk
    N = Tp // C
    vb = cfg.block_v(V)
    gated = d is not None
    kg = d.shape[-2] if gated else 1

    def ck(b, h, iv, n, sq, ls):
        return (b, h, N - 1 - n, 0)

    def cv(b, h, iv, n, sq, ls):
        return (b, h, N - 1 - n, iv)

    def st(b, h, iv, n, sq, ls):
        return (b + sq[N - 1 - n], h, 0, iv)

    in_specs = ([pl.BlockSpec((None, None, C, K), ck)] * 3
                + [pl.BlockSpec((None, None, C, vb), cv)])
    if gated:
        in_specs.append(pl.BlockSpec((None, None, None, kg, 1),
                                     lambda b, h, iv, n, sq, ls: (b, h, N - 1 - n, 0, 0)))
    in_specs.append(pl.BlockSpec((None, None, K, vb), st))
    out_specs = [pl.BlockSpec((None, None, None, K, vb),
                              lambda b, h, iv, n, sq, ls: (b, h, N - 1 - n, 0, iv)),
                 pl.BlockSpec((None, None, K, vb), st)]
    out_shape = [jax.ShapeDtypeStruct((B, H, N, K, V), F32),
                 jax.ShapeDtypeStruct(dfin.shape, F32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, H, V // vb, N), in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=[pltpu.VMEM((K, vb), F32)])
    args = (w, kd, qe, do) + ((d,) if gated else ()) + (dfin,)
    dh, dh0 = pl.pallas_call(
        functools.partial(_state_bwd_kernel, gated=gated, n_chunks=N),
        grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=_params((_PARALLEL,) * 3 + (_ARBITRARY,)), interpret=cfg.interpret,
        name="delta_state_bwd",
    )(seq, last, *args)
    return dh, dh0


# ------------------------------------------------------------------------------------------------
# intra-chunk backward
# ------------------------------------------------------------------------------------------------
def _intra_bwd_kernel(*refs, cfg):
    token_refs, g_ref, rest = _split_gate(refs, 4, cfg.mode != "none")
    h_ref, dh_ref, do_ref = rest[:3]
    _store_chunk_grads(cfg, token_refs, g_ref, h_ref[...], dh_ref[...], do_ref[...], rest[3:])


def intra_bwd(cfg, q, k, v, beta, g, h, dh, do):
    """Returns (dq, dk [B,H,Tp,K], dv [B,H,Tp,V], dbeta [B,H,Tp,1], dg [B,H,Tp,Kg] or None), f32."""
    lay = _layout(cfg, q, v)
    B, H, K, V, C, N, gated = lay.B, lay.H, lay.K, lay.V, lay.C, lay.N, lay.gated

    def tok(d):
        return pl.BlockSpec((None, None, C, d), lambda b, h, n: (b, h, n, 0))

    state = pl.BlockSpec((None, None, None, K, V), lambda b, h, n: (b, h, n, 0, 0))
    in_specs = _token_inputs(lay, tok) + [state, state, tok(V)]
    out_specs, out_shape = _token_grads(lay, tok)
    args = (q, k, v, beta) + ((g,) if gated else ()) + (h, dh, do)
    outs = pl.pallas_call(
        functools.partial(_intra_bwd_kernel, cfg=cfg),
        grid=(B, H, N), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_params((_PARALLEL,) * 3), interpret=cfg.interpret,
        name="delta_intra_bwd",
    )(*args)
    return tuple(outs) + ((None,) if not gated else ())


# ------------------------------------------------------------------------------------------------
# fused kernels: intra-chunk work and the state recurrence in one sequential pass
# ------------------------------------------------------------------------------------------------
def _fused_fwd_kernel(seq_ref, first_ref, *refs, cfg, save_h):
    del seq_ref
    gated = cfg.mode != "none"
    (q_ref, k_ref, v_ref, b_ref), g_ref, rest = _split_gate(refs, 4, gated)
    h0_ref, o_ref, fin_ref = rest[:3]
    h_ref = rest[3] if save_h else None
    s_scr = refs[-1]
    s = _start_state(first_ref, pl.program_id(2), h0_ref, s_scr, h_ref)
    f = _chunk_forward(cfg, q_ref, k_ref, v_ref[...], b_ref[...], g_ref)
    u = f["u0"] - tm.mm(f["w"], s)
    o_ref[...] = (tm.mm(f["qg"], s) + tm.mm(f["p"], u)).astype(o_ref.dtype)
    decayed = f["gate"].d_col() * s if gated else s
    s_new = decayed + tm.mm_tn(f["kd"], u)
    s_scr[...] = s_new
    fin_ref[...] = s_new


def fused_fwd(cfg, q, k, v, beta, g, h0, seq, first, *, save_h):
    """One sequential kernel, grid (B, H, N).

    Returns (o [B,H,Tp,V] in v.dtype, final [S,H,K,V] f32, h [B,H,N,K,V] f32 or None).
    """
    lay = _layout(cfg, q, v)
    B, H, Tp, K, V, C, N, gated = lay.B, lay.H, lay.Tp, lay.K, lay.V, lay.C, lay.N, lay.gated

    def tok(d):
        return pl.BlockSpec((None, None, C, d), lambda b, h, n, sq, fr: (b, h, n, 0))

    state = pl.BlockSpec((None, None, K, V), lambda b, h, n, sq, fr: (b + sq[n], h, 0, 0))
    in_specs = _token_inputs(lay, tok) + [state]
    out_specs = [tok(V), state]
    out_shape = [jax.ShapeDtypeStruct((B, H, Tp, V), v.dtype),
                 jax.ShapeDtypeStruct(h0.shape, F32)]
    if save_h:
        out_specs.append(pl.BlockSpec((None, None, None, K, V),
                                      lambda b, h, n, sq, fr: (b, h, n, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, N, K, V), F32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, H, N), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), F32)])
    args = (q, k, v, beta) + ((g,) if gated else ()) + (h0,)
    outs = pl.pallas_call(
        functools.partial(_fused_fwd_kernel, cfg=cfg, save_h=save_h),
        grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=_params((_PARALLEL, _PARALLEL, _ARBITRARY)), interpret=cfg.interpret,
        name="delta_fused_fwd",
    )(seq, first, *args)
    return outs[0], outs[1], (outs[2] if save_h else None)


def _fused_bwd_kernel(seq_ref, last_ref, *refs, cfg, n_chunks):
    del seq_ref
    token_refs, g_ref, rest = _split_gate(refs, 4, cfg.mode != "none")
    h_ref, do_ref, dfin_ref = rest[:3]
    grad_refs, dh0_ref, ds_scr = rest[3:-2], rest[-2], rest[-1]
    c = n_chunks - 1 - pl.program_id(2)

    @pl.when(last_ref[c] == 1)
    def _():
        ds_scr[...] = dfin_ref[...]

    ds_prev = _store_chunk_grads(cfg, token_refs, g_ref, h_ref[...], ds_scr[...], do_ref[...], grad_refs)
    ds_scr[...] = ds_prev
    dh0_ref[...] = ds_prev


def fused_bwd(cfg, q, k, v, beta, g, h, do, dfin, seq, last):
    """One reverse sequential kernel, grid (B, H, N): returns (dq, dk, dv, dbeta, dg or None,
    dh0 [S,H,K,V]), float32."""
    lay = _layout(cfg, q, v)
    B, H, K, V, C, N, gated = lay.B, lay.H, lay.K, lay.V, lay.C, lay.N, lay.gated

    def tok(d):
        return pl.BlockSpec((None, None, C, d), lambda b, h, n, sq, ls: (b, h, N - 1 - n, 0))

    state = pl.BlockSpec((None, None, K, V),
                         lambda b, h, n, sq, ls: (b + sq[N - 1 - n], h, 0, 0))
    hspec = pl.BlockSpec((None, None, None, K, V),
                         lambda b, h, n, sq, ls: (b, h, N - 1 - n, 0, 0))
    in_specs = _token_inputs(lay, tok) + [hspec, tok(V), state]
    out_specs, out_shape = _token_grads(lay, tok)
    out_specs.append(state)
    out_shape.append(jax.ShapeDtypeStruct(dfin.shape, F32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, H, N), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((K, V), F32)])
    args = (q, k, v, beta) + ((g,) if gated else ()) + (h, do, dfin)
    outs = pl.pallas_call(
        functools.partial(_fused_bwd_kernel, cfg=cfg, n_chunks=N),
        grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=_params((_PARALLEL, _PARALLEL, _ARBITRARY)), interpret=cfg.interpret,
        name="delta_fused_bwd",
    )(seq, last, *args)
    outs = list(outs)
    dh0 = outs.pop()
    dg = outs.pop() if gated else None
    return (*outs, dg, dh0)
