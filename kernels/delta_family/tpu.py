"""Chunked delta family (DeltaNet, Gated DeltaNet, KDA) as Pallas TPU (Mosaic) kernels.

Per token t, with a float32 state S in R^{K x V} (flash-linear-attention's semantics):

    S <- exp(g_t) * S                 (g None: no decay; [B,T,H]: scalar; [B,T,H,K]: per key row)
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

`chunk_delta_family_tpu` computes the exact chunkwise (WY / UT transform) form of
`atlas_jax.ops.delta_family.chunk_delta_family` with Pallas kernels (see `tpu_kernels.py`): by
default one sequential kernel per direction whose chunk axis is the last, "arbitrary" grid
dimension, with the running state (forward) or its cotangent (backward) in a VMEM scratch and
batch/head "parallel"; tied together by `jax.custom_vjp`. The forward saves only its inputs and
the per-chunk start states; the backward recomputes each chunk's intra-chunk quantities.
`BlockSizes(fused=False)` splits each direction into an all-parallel intra-chunk kernel and a
thin sequential state kernel tiled over V.

Files: this entry (validation through `support.py`, layout glue, the `jax.custom_vjp`);
`tpu_kernels.py` (kernel bodies and their launchers); `tpu_math.py` (per-chunk math). Kernels,
N = chunks, Vb = BlockSizes.block_v; the chunk axis is the last, "arbitrary" grid axis of the
sequential ones:

  label kernel body (tpu_kernels)  launcher   grid             runs when
  TF    _fused_fwd_kernel          fused_fwd  (B, H, N)        default (fused=True): forward
  TB    _fused_bwd_kernel          fused_bwd  (B, H, N)        default: backward, chunks reversed
  T1    _intra_fwd_kernel          intra_fwd  (B, H, N)        fused=False: forward, and again in
                                                               the backward (full=False)
  T2    _state_fwd_kernel          state_fwd  (B, H, V/Vb, N)  fused=False: forward
  T3    _state_bwd_kernel          state_bwd  (B, H, V/Vb, N)  fused=False: backward, reversed
  T4    _intra_bwd_kernel          intra_bwd  (B, H, N)        fused=False: backward

Numerics: gates, decay exponents, the (I + diag(beta) A)^{-1} solve (blocked forward
substitution), states and all accumulations are float32; float32 matmuls ask for
Precision.HIGHEST; bf16 inputs enter the q.k / k.k products of the none/scalar gates as bf16
(products of bf16 numbers are exact in float32), everything else is float32. Every
decay exponent is a direct segment sum of g (<= 0 for g <= 0) masked before exp, so gates of any
strength stay finite, and KDA's per-channel decay is never factored as exp(G_i) * exp(-G_j).

Verification status, honestly: there is no TPU in this project's reach. These kernels have only
been *run* in Pallas' TPU interpret mode on CPU (`pltpu.InterpretParams`), where they match the
XLA chunked form and the float32 scan to ~3e-7 relative, gradients included
(tests/test_kernels_tpu.py). Beyond that, the tests export forward + backward for platform
"tpu" with interpret=False, which runs JAX's Pallas->Mosaic lowering (block-shape rules and a
lowering rule for every op in the kernel bodies). What stays unchecked without a TPU: Mosaic's
own compiler passes in libtpu (vector layouts, relayouts of the reshapes/slices/transposed
matmuls used here), VMEM limits, and all performance: nothing here has been timed.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from atlas_jax.kernels.delta_family import support
from atlas_jax.kernels.delta_family import tpu_kernels as tk

__all__ = ["BlockSizes", "chunk_delta_family_tpu"]

F32 = jnp.float32
_FN = "chunk_delta_family_tpu"


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the TPU kernels.

    chunk_size: tokens per chunk (C). A multiple of 8 (16 for bfloat16 inputs): the sublane
      tile. 64 is the usual choice; the intra-chunk work grows as C^2 (K + V), the sequential
      state pass as T / C.
    sub_chunk: sub-block size s (divides C, multiple of 8, or C itself) of the blocked inverse
      and of KDA's exact pairwise decays (C * s * K exps per chunk). None: min(16, C).
    fused: True (default): one sequential kernel per direction, grid (B, H, N), which does the
      intra-chunk work and the state update chunk by chunk, so only the inputs, outputs and the
      per-chunk states (saved for the backward) touch HBM. False: four kernels, an all-parallel
      intra-chunk kernel (grid (B, H, N)) feeding a thin sequential state kernel tiled over V
      (grid (B, H, V / block_v, N)): more parallel grid points and a smaller VMEM state when
      B * H is small, at the price of float32 [T, K] / [T, V] intermediates in HBM.
    block_v: V tile of the unfused state kernels (a multiple of 128 that divides V, or V).
      None: 128 when V is a multiple of 128, else V. Ignored when fused.
    """

    chunk_size: int = 64
    sub_chunk: int | None = None
    fused: bool = True
    block_v: int | None = None


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static configuration of one kernel launch (hashable: custom_vjp nondiff argument)."""

    mode: str            # "none" | "scalar" | "channel"
    chunk: int
    sub: int
    bv: int | None
    fused: bool
    scale: float
    normalize: bool
    eps: float
    interpret: object    # False or a pltpu.InterpretParams

    def block_v(self, V):
        if self.bv is not None:
            return self.bv
        return 128 if V % 128 == 0 else V


# ------------------------------------------------------------------------------------------------
# custom_vjp core on the kernel layout
# ------------------------------------------------------------------------------------------------
def _forward(cfg, q, k, v, beta, g, h0, seq, first, has, *, save_h):
    if cfg.fused:
        o, fin, h = tk.fused_fwd(cfg, q, k, v, beta, g, h0, seq, first, save_h=save_h)
    else:
        w, kd, qe, d, u0, o0 = tk.intra_fwd(cfg, q, k, v, beta, g, full=True)
        o, fin, h = tk.state_fwd(cfg, w, kd, qe, d, u0, o0, h0, seq, first, out_dtype=v.dtype,
                                 save_h=save_h)
    # A state slot no chunk belongs to (an empty packed sequence) keeps its initial state.
    fin = jnp.where(has[:, None, None, None] == 1, fin, h0)
    return o, fin, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, beta, g, h0, seq, first, last, has):
    o, fin, _ = _forward(cfg, q, k, v, beta, g, h0, seq, first, has, save_h=False)
    return o, fin


def _core_fwd(cfg, q, k, v, beta, g, h0, seq, first, last, has):
    o, fin, h = _forward(cfg, q, k, v, beta, g, h0, seq, first, has, save_h=True)
    h = support.name_residuals(h)
    return (o, fin), (q, k, v, beta, g, h, seq, first, last, has)


def _core_bwd(cfg, res, cts):
    q, k, v, beta, g, h, seq, first, last, has = res
    do, dfin = cts
    dfin = dfin.astype(F32)
    if cfg.fused:
        dq, dk, dv, db, dg, dh0 = tk.fused_bwd(cfg, q, k, v, beta, g, h, do, dfin, seq, last)
    else:
        w, kd, qe, d, _, _ = tk.intra_fwd(cfg, q, k, v, beta, g, full=False)
        dh, dh0 = tk.state_bwd(cfg, w, kd, qe, d, do, dfin, seq, last)
        dq, dk, dv, db, dg = tk.intra_bwd(cfg, q, k, v, beta, g, h, dh, do)
    dh0 = jnp.where(has[:, None, None, None] == 1, dh0, dfin)
    B, H, Tp, K = q.shape
    group = v.shape[1] // H
    if group > 1:       # grouped value heads: each q/k head sums its group's gradients
        dq = dq.reshape(B, H, group, Tp, K).sum(axis=2)
        dk = dk.reshape(B, H, group, Tp, K).sum(axis=2)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db,
            None if g is None else dg, dh0, None, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


# ------------------------------------------------------------------------------------------------
# layout glue (plain XLA)
# ------------------------------------------------------------------------------------------------
def _to_kernel(x, Tp):
    """[B, T, H, ...] -> [B, H, Tp, D] (D = 1 for per-token scalars), zero-padded in time."""
    if x.ndim == 3:
        x = x[..., None]
    T = x.shape[1]
    if Tp != T:
        x = jnp.pad(x, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])
    return jnp.swapaxes(x, 1, 2)


def _packed_layout(cu, T, C):
    """Chunk-aligned layout of a packed batch: every sequence starts on a chunk boundary.

    Returns (src [NC*C] token index, valid [NC*C], seq/first/last [NC] int32, has [S] int32,
    pos [T] position of every token in the layout). NC is a static bound on the chunk count.
    """
    S = cu.shape[0] - 1
    NC = max(1, (T + S * (C - 1)) // C)
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    cend = jnp.cumsum(nch)
    cstart = cend - nch
    cidx = jnp.arange(NC, dtype=jnp.int32)
    seq = jnp.minimum(jnp.sum(cend[None, :] <= cidx[:, None], axis=1), S - 1).astype(jnp.int32)
    change = (seq[1:] != seq[:-1]).astype(jnp.int32)
    first = jnp.concatenate([jnp.ones((1,), jnp.int32), change])
    last = jnp.concatenate([change, jnp.ones((1,), jnp.int32)])
    has = jnp.zeros((S,), jnp.int32).at[seq].set(1)
    p = jnp.arange(NC * C, dtype=jnp.int32)
    c, j = p // C, p % C
    s = seq[c]
    off = (c - cstart[s]) * C + j
    valid = (c < cend[s]) & (off < lens[s])
    src = jnp.clip(cu[s] + off, 0, T - 1)
    t = jnp.arange(T, dtype=jnp.int32)
    st = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, S - 1)
    pos = cstart[st] * C + (t - cu[st])
    return src, valid, seq, first, last, has, pos


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(cfg, output_final_state, q, k, v, beta, g, h0, cu):
    B, T, _, K = q.shape
    H, V = v.shape[2:]              # value heads (HV = G * H with grouped value heads)
    C = cfg.chunk
    beta = jnp.ones((B, T, H), F32) if beta is None else beta.astype(F32)
    g = None if g is None else g.astype(F32)
    if cu is None:
        N = -(-T // C)
        Tp = N * C
        arrs = [_to_kernel(x, Tp) for x in (q, k, v, beta)]
        gk = None if g is None else _to_kernel(g, Tp)
        n = jnp.arange(N)
        seq = jnp.zeros((N,), jnp.int32)
        first = (n == 0).astype(jnp.int32)
        last = (n == N - 1).astype(jnp.int32)
        has = jnp.ones((B,), jnp.int32)
        S = B
    else:
        S = cu.shape[0] - 1
        src, valid, seq, first, last, has, pos = _packed_layout(cu.astype(jnp.int32), T, C)
        Tp = valid.shape[0]

        def pack(x):
            y = jnp.take(x[0], src, axis=0)                                # [Tp, H, ...]
            y = jnp.where(valid.reshape((-1,) + (1,) * (y.ndim - 1)), y, jnp.zeros((), y.dtype))
            return _to_kernel(y[None], Tp)

        arrs = [pack(x) for x in (q, k, v, beta)]
        gk = None if g is None else pack(g)
    h0 = jnp.zeros((S, H, K, V), F32) if h0 is None else h0.astype(F32)
    o, fin = _core(cfg, *arrs, gk, h0, seq, first, last, has)
    o = jnp.swapaxes(o, 1, 2)                                              # [B, Tp, H, V]
    o = o[:, :T] if cu is None else jnp.take(o, pos, axis=1)
    return o, (fin if output_final_state else None)


# ------------------------------------------------------------------------------------------------
# public entry point
# ------------------------------------------------------------------------------------------------
def _positive_int(name, x):
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, np.integer)) or int(x) <= 0:
        raise ValueError(f"{_FN}: argument `{name}` must be a positive int; got {x!r}.")
    return int(x)


def resolve_interpret(interpret, fn=_FN):
    """The TPU kernels' `interpret` argument (also the Omega kernels'): None picks interpret mode
    off a TPU, True an InterpretParams(); `fn` names the entry in the error."""
    if interpret is None:
        return pltpu.InterpretParams() if jax.default_backend() != "tpu" else False
    if interpret is True:
        return pltpu.InterpretParams()
    if interpret is False or isinstance(interpret, pltpu.InterpretParams):
        return interpret
    raise TypeError(f"{fn}: argument `interpret` must be None, a bool or a "
                    f"pltpu.InterpretParams; got {interpret!r}.")


def chunk_delta_family_tpu(q, k, v, beta, g=None, *, scale=1.0, initial_state=None,
                           output_final_state=False, chunk_size=64, cu_seqlens=None,
                           normalize_qk=False, interpret=None, block_sizes=None):
    """Exact chunked delta rule / gated delta rule / KDA with Pallas TPU kernels (custom VJP).

    Args:
      q, k: [B, T, H, K] queries and keys, float32 or bfloat16 (same dtype as v).
      v: [B, T, HV, V] values; HV = G * H: grouped value heads (fla's GVA), value head i reads
        q/k head i // G through the kernels' BlockSpecs (dq, dk summed over each group).
      beta: [B, T, HV] write strengths, or None for 1.0.
      g: None (DeltaNet), [B, T, HV] scalar log-decay (Gated DeltaNet) or [B, T, HV, K]
        per-key-channel log-decay (KDA); alpha = exp(g), normally g <= 0.
      scale: multiplier on q (a Python float; the ops layer passes 1/sqrt(K)).
      initial_state: [B, H, K, V] (or [N, H, K, V] with cu_seqlens) start states, or None.
      output_final_state: also return the final state(s).
      chunk_size: tokens per chunk, one of support.CHUNK_SIZES. Any T is accepted;
        the tail is zero-padded internally (k = v = beta = g = 0 leaves the state unchanged).
      cu_seqlens: None, or int32 [N + 1] cumulative sequence lengths of N sequences packed
        along T of a B = 1 batch (flash-linear-attention convention: cu[0] = 0, cu[N] = T).
        Every sequence starts from its own initial state (zeros without initial_state) and
        no state crosses a boundary; the final state is [N, H, K, V].
      normalize_qk: L2-normalise q and k per head inside the kernels,
        x / sqrt(sum(x^2) + support.L2NORM_EPS), before `scale`.
      interpret: None: TPU interpret mode unless the default backend is a TPU. True /
        a pltpu.InterpretParams: interpret mode. False: compile with Mosaic (TPU only).
      block_sizes: optional BlockSizes; its chunk_size then replaces `chunk_size`.

    Returns:
      (o [B, T, H, V] in v.dtype, final state float32 [B or N, H, K, V] or None).

    Only TPU interpret mode on CPU has been run; see the module docstring.
    """
    q, k, v, beta, g, initial_state, cu, call = support.check_delta_call(
        _FN, q, k, v, beta, g, initial_state, cu_seqlens, kernel=True,
        allow_traced_cu_seqlens=True)
    V = call.V
    support.check_scale(_FN, scale, static=True)

    # block sizes
    if block_sizes is None:
        block_sizes = BlockSizes(chunk_size=chunk_size)
    elif not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be a BlockSizes; got "
                        f"{type(block_sizes).__name__}.")
    # The sublane tile (8 rows, 16 for bf16) divides every supported chunk size.
    C = support.check_chunk_size(_FN, block_sizes.chunk_size, kernel=True)
    sub = min(16, C) if block_sizes.sub_chunk is None else _positive_int(
        "block_sizes.sub_chunk", block_sizes.sub_chunk)
    if C % sub or (sub % 8 and sub != C):
        raise ValueError(f"{_FN}: argument `block_sizes.sub_chunk` must divide chunk_size = {C} "
                         f"and be a multiple of 8; got {sub}.")
    bv = block_sizes.block_v
    if bv is not None:
        bv = _positive_int("block_sizes.block_v", bv)
        if V % bv or (bv != V and bv % 128):
            raise ValueError(f"{_FN}: argument `block_sizes.block_v` must divide V = {V} and be "
                             f"V or a multiple of 128; got {bv}.")

    if cu is not None:
        cu = jnp.asarray(cu, jnp.int32)
    cfg = _Config(mode=call.gate, chunk=C, sub=sub, bv=bv, fused=bool(block_sizes.fused),
                  scale=float(scale),
                  normalize=bool(normalize_qk), eps=support.L2NORM_EPS,
                  interpret=resolve_interpret(interpret))
    return _run(cfg, bool(output_final_state), q, k, v, beta, g, initial_state, cu)
