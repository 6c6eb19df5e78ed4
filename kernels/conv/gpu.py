"""Causal depthwise short convolution + SiLU as Pallas GPU kernels (Triton lowering).

The math (reference: `atlas_jax.models.layers.causal_conv_silu`, `_conv_pre` and
`_causal_conv_silu_bwd`). x [B, T, C], w [S, C] (w[S−1] multiplies the current token), and
same(t, l) = [t − l ≥ 0 and seg[t − l] = seg[t]] (the second condition only with segment ids):

    pre_t        = Σ_{l<S} w[S−1−l] ⊙ x_{t−l} · same(t, l)
    y_t          = silu(pre_t) = pre_t σ(pre_t)                                  (in x.dtype)
    dpre_t       = dy_t σ(pre_t) (1 + pre_t (1 − σ(pre_t)))
    dx_t         = Σ_{l<S} w[S−1−l] ⊙ dpre_{t+l} · same(t + l, l)             (t + l < T)
    dw[S−1−l]    = Σ_{b,t} dpre_t ⊙ x_{t−l} · same(t, l)

Two kernels, float32 inside, input dtype in and out:

  conv_silu_fwd  grid (C / BC, ⌈T / BT⌉, B): one [BT, BC] tile of y per program, from S loads
                 of x at rows t − l. The S − 1 rows before the tile (its halo) are the last
                 rows of the previous T tile, whose program ran C / BC launches earlier (channel
                 blocks vary fastest), so they are expected in L2; the shifted loads' overlap
                 with the tile itself hits L1.
  conv_silu_bwd  grid (C / BCb, ⌈T / (BTb·steps)⌉, B): a loop over `steps` tiles of BTb rows;
                 per tile it recomputes pre at rows t + lag for lag < S (from the 2S − 1 x tiles
                 at rows t − S + 1 … t + S − 1), forms dpre there, writes dx of the tile, and
                 accumulates the tile's dw terms in registers; one [S, BCb] float32 partial sum
                 of dw per program, summed over (B, T programs) in XLA.

Intended traffic: every activation [B, T, C] read once from DRAM (the shifted re-reads from
L1 / L2, not yet measured), y and dx written once; nothing is materialised between the kernels (the XLA version keeps pre in
float32 between three fusions).

Layout: x, dy, y and dx are blocked as (one sequence, every row, BC channels), so a program can
address rows outside its own tile; rows are read through an integer row index clipped into
[0, T) with a mask that zeroes rows before the sequence start, past T or across a document
boundary. Clipping keeps every address inside the array (the Triton load only skips masked
lanes) and makes Pallas interpret mode (CPU) compute exactly what the GPU kernel computes:
interpret mode's sliced loads would shift a window that starts before row 0. Tiles are powers
of two (Triton); T and C need not be multiples of them (masked rows and channels).

Verification status: Pallas interpret mode on CPU against the XLA reference and its autodiff
(tests/test_conv_kernel.py), and lowered to Triton for CUDA by `jax.export` on CPU. Not
compiled or timed on a GPU when written (none was available): the `gpu`-marked tests do that.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["ConvGpuBlockSizes", "causal_conv_silu_gpu"]

F32 = jnp.float32
_FN = "causal_conv_silu_gpu"


def _is_int(x):
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def _pow2_at_least(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def _given(value, default):
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class ConvGpuBlockSizes:
    """Tiling and launch parameters of the two kernels (None: a default from the shapes).

    block_t / block_c:         rows / channels of the forward's tile (powers of two). Defaults
                               min(64, T) and min(128, C), rounded up to powers of two.
    block_t_bwd / block_c_bwd: rows / channels of the backward's tile (defaults min(32, T),
                               min(128, C)): it holds 2S − 1 x tiles, S dy tiles and pre, dpre,
                               dx in registers, so it takes fewer rows than the forward.
    steps_bwd:                 backward tiles per program (default min(4, ⌈T / block_t_bwd⌉)):
                               each program writes one dw partial sum [S, block_c_bwd], so more
                               steps mean fewer partial sums to reduce in XLA.
    num_warps / num_warps_bwd: warps per program of the forward / backward kernel.
    num_stages_bwd:            software-pipelining stages of the backward's loop.

    The defaults are first guesses (memory-bound tiles of 16 KiB in bf16, ≥ 10⁴ programs at
    B8 T4096 C4096), not yet tuned on a GPU.
    """
    block_t: int | None = None
    block_c: int | None = None
    block_t_bwd: int | None = None
    block_c_bwd: int | None = None
    steps_bwd: int | None = None
    num_warps: int = 4
    num_warps_bwd: int = 8
    num_stages_bwd: int = 1

    def resolve(self, T, C):
        bt_bwd = _given(self.block_t_bwd, _pow2_at_least(min(32, T)))
        steps = self.steps_bwd
        if steps is None and _is_int(bt_bwd) and bt_bwd > 0:
            steps = min(4, -(-T // bt_bwd))
        return dataclasses.replace(
            self,
            block_t=_given(self.block_t, _pow2_at_least(min(64, T))),
            block_c=_given(self.block_c, _pow2_at_least(min(128, C))),
            block_t_bwd=bt_bwd,
            block_c_bwd=_given(self.block_c_bwd, _pow2_at_least(min(128, C))),
            steps_bwd=steps)

    def check(self):
        """ValueError naming the field unless every (resolved) field is valid."""
        for name in ("block_t", "block_c", "block_t_bwd", "block_c_bwd"):
            b = getattr(self, name)
            if not _is_int(b) or b < 1 or b & (b - 1):
                raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a power of two "
                                 f"(a Triton tile side); got {b!r}.")
        for name in ("num_warps", "num_warps_bwd"):
            w = getattr(self, name)
            if not _is_int(w) or w < 1 or w > 32 or w & (w - 1):
                raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a power of two "
                                 f"from 1 to 32 (warps per program); got {w!r}.")
        for name in ("steps_bwd", "num_stages_bwd"):
            n = getattr(self, name)
            if not _is_int(n) or n < 1:
                raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a positive "
                                 f"integer; got {n!r}.")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static description of one call (hashable: the custom_vjp's nondiff argument)."""
    T: int
    C: int
    S: int
    segments: bool
    bs: ConvGpuBlockSizes
    interpret: bool


# ---------------------------------------------------------------------------------------------
# Kernel helpers. Refs: x-like [T, BC] (one sequence, a channel block), w [S, BC], seg [T].


def _col_ok(cfg, bc):
    """[BC] channel in range (None when C is a multiple of the block: no mask needed)."""
    if cfg.C % bc == 0:
        return None
    return pl.program_id(0) * bc + jnp.arange(bc, dtype=jnp.int32) < cfg.C


def _clip_rows(cfg, rows):
    return jnp.minimum(jnp.maximum(rows, 0), cfg.T - 1)


def _tile(cfg, ref, rows, ok, col_ok):
    """Rows `rows` [BT] of the block [T, BC] as a [BT, BC] tile in the stored dtype; zero where
    `ok` [BT] is false or the channel is past C. Integer-array indexing with clipped rows: see
    the module docstring."""
    bt, bc = rows.shape[0], ref.shape[-1]
    cols = jnp.arange(bc, dtype=jnp.int32)
    mask = ok[:, None] if col_ok is None else ok[:, None] & col_ok[None, :]
    return plgpu.load(ref.at[_clip_rows(cfg, rows)[:, None], cols[None, :]],
                      mask=jnp.broadcast_to(mask, (bt, bc)), other=0)


def _segment(cfg, ref, rows):
    """Segment ids at rows `rows` [BT] (clipped: callers mask the rows outside [0, T))."""
    return ref[_clip_rows(cfg, rows)]


def _weight(ref, k, col_ok):
    """w[k] of the channel block as float32 [BC] (zero past C)."""
    bc = ref.shape[-1]
    if col_ok is None:
        return ref[k, :].astype(F32)
    # A traced row index: interpret mode's masked load wants array-like scalar indices.
    return plgpu.load(ref.at[jnp.int32(k), pl.ds(0, bc)], mask=col_ok, other=0).astype(F32)


def _store_tile(cfg, ref, t0, value, col_ok):
    """value [BT, BC] into rows t0 … t0 + BT − 1 of the block (rows past T dropped)."""
    bt, bc = value.shape
    rows = t0 + jnp.arange(bt, dtype=jnp.int32)
    mask = (rows < cfg.T)[:, None]
    if col_ok is not None:
        mask = mask & col_ok[None, :]
    plgpu.store(ref.at[pl.ds(t0, bt), pl.ds(0, bc)], value.astype(ref.dtype),
                mask=jnp.broadcast_to(mask, (bt, bc)))


def _in_range(cfg, rows):
    return (rows >= 0) & (rows < cfg.T)


# ---------------------------------------------------------------------------------------------
# Kernel bodies


def _fwd_kernel(*refs, cfg: _Cfg):
    if cfg.segments:
        x_ref, w_ref, seg_ref, y_ref = refs
    else:
        (x_ref, w_ref, y_ref), seg_ref = refs, None
    S, bt, bc = cfg.S, cfg.bs.block_t, cfg.bs.block_c
    col_ok = _col_ok(cfg, bc)
    t0 = pl.program_id(1) * bt
    rows = t0 + jnp.arange(bt, dtype=jnp.int32)
    seg_t = _segment(cfg, seg_ref, rows) if cfg.segments else None
    pre = jnp.zeros((bt, bc), F32)
    for lag in range(S):
        src = rows - lag
        ok = _in_range(cfg, src)
        if cfg.segments and lag:
            ok = ok & (_segment(cfg, seg_ref, src) == seg_t)
        xs = _tile(cfg, x_ref, src, ok, col_ok).astype(F32)
        pre = pre + xs * _weight(w_ref, S - 1 - lag, col_ok)[None, :]
    _store_tile(cfg, y_ref, t0, pre * jax.nn.sigmoid(pre), col_ok)


def _bwd_kernel(*refs, cfg: _Cfg):
    if cfg.segments:
        x_ref, dy_ref, w_ref, seg_ref, dx_ref, dw_ref = refs
    else:
        (x_ref, dy_ref, w_ref, dx_ref, dw_ref), seg_ref = refs, None
    S, bt, bc, steps = cfg.S, cfg.bs.block_t_bwd, cfg.bs.block_c_bwd, cfg.bs.steps_bwd
    col_ok = _col_ok(cfg, bc)
    w = [_weight(w_ref, k, col_ok)[None, :] for k in range(S)]          # w[k] as [1, BC]
    first = pl.program_id(1) * steps

    def step(i, dw):
        t0 = (first + i) * bt
        rows = t0 + jnp.arange(bt, dtype=jnp.int32)
        # Segment ids and x tiles at the row offsets d = −(S−1) … S−1 around the tile, each
        # loaded once and shared by the (lag, l) pairs with lag − l = d. The x tiles are zero
        # outside [0, T); the document masks depend on the pair and are applied at use.
        seg = ({d: _segment(cfg, seg_ref, rows + d) for d in range(-(S - 1), S)}
               if cfg.segments else None)
        xs = {}

        def x_at(d):
            if d not in xs:
                xs[d] = _tile(cfg, x_ref, rows + d, _in_range(cfg, rows + d), col_ok)
            return xs[d]

        def same(u, l):
            """same(t + u, l) as a [BT, 1] mask (None: always, for l = 0 or no segment ids);
            the t + u − l ≥ 0 part is already in the zeroed x rows and dpre."""
            if seg is None or l == 0:
                return None
            return (seg[u - l] == seg[u])[:, None]

        def masked(m, v):
            return v if m is None else jnp.where(m, v, jnp.zeros((), v.dtype))

        dx = jnp.zeros((bt, bc), F32)
        dw = list(dw)
        for lag in range(S):
            pre = jnp.zeros((bt, bc), F32)       # pre at rows t + lag
            for l in range(S):
                pre = pre + masked(same(lag, l), x_at(lag - l)).astype(F32) * w[S - 1 - l]
            # dy is zero past T, so dpre is too (and rows past T add nothing to dx, dw).
            dy = _tile(cfg, dy_ref, rows + lag, rows + lag < cfg.T, col_ok).astype(F32)
            sig = jax.nn.sigmoid(pre)
            dpre = dy * sig * (1.0 + pre * (1.0 - sig))
            if lag == 0:
                for l in range(S):
                    prod = masked(same(0, l), dpre) * x_at(-l).astype(F32)
                    dw[S - 1 - l] = dw[S - 1 - l] + jnp.sum(prod, axis=0)
            dx = dx + masked(same(lag, lag), dpre) * w[S - 1 - lag]
        _store_tile(cfg, dx_ref, t0, dx, col_ok)
        return tuple(dw)

    dw = lax.fori_loop(0, steps, step, tuple(jnp.zeros((bc,), F32) for _ in range(S)))
    for k in range(S):
        if col_ok is None:
            dw_ref[k, :] = dw[k]
        else:
            plgpu.store(dw_ref.at[jnp.int32(k), pl.ds(0, bc)], dw[k], mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Launchers


def _params(num_warps, num_stages):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _forward(cfg: _Cfg, x, w, seg):
    B, T, C = x.shape
    bt, bc = cfg.bs.block_t, cfg.bs.block_c
    # Channel blocks vary fastest (grid axis 0 is CUDA's x): the neighbouring programs read the
    # same rows, and a T tile's halo was read by the previous T tile's programs shortly before.
    grid = (pl.cdiv(C, bc), pl.cdiv(T, bt), B)
    rows = pl.BlockSpec((None, T, bc), lambda c, t, b: (b, 0, c))
    in_specs = [rows, pl.BlockSpec((cfg.S, bc), lambda c, t, b: (0, c))]
    args = [x, w]
    if cfg.segments:
        in_specs.append(pl.BlockSpec((None, T), lambda c, t, b: (b, 0)))
        args.append(seg)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg), grid=grid,
        in_specs=in_specs, out_specs=rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=_params(cfg.bs.num_warps, 1), interpret=cfg.interpret,
        name="conv_silu_fwd")(*args)


def _backward(cfg: _Cfg, x, w, seg, dy):
    B, T, C = x.shape
    bt, bc, steps = cfg.bs.block_t_bwd, cfg.bs.block_c_bwd, cfg.bs.steps_bwd
    n_t = pl.cdiv(T, bt * steps)
    grid = (pl.cdiv(C, bc), n_t, B)
    rows = pl.BlockSpec((None, T, bc), lambda c, t, b: (b, 0, c))
    in_specs = [rows, rows, pl.BlockSpec((cfg.S, bc), lambda c, t, b: (0, c))]
    args = [x, dy.astype(x.dtype), w]
    if cfg.segments:
        in_specs.append(pl.BlockSpec((None, T), lambda c, t, b: (b, 0)))
        args.append(seg)
    dx, dw_part = pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg), grid=grid, in_specs=in_specs,
        out_specs=[rows, pl.BlockSpec((None, None, cfg.S, bc), lambda c, t, b: (b, t, 0, c))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct((B, n_t, cfg.S, C), F32)],
        compiler_params=_params(cfg.bs.num_warps_bwd, cfg.bs.num_stages_bwd),
        interpret=cfg.interpret, name="conv_silu_bwd")(*args)
    return dx, jnp.sum(dw_part, axis=(0, 1)).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(cfg, x, w, seg):
    return _forward(cfg, x, w, seg)


def _conv_fwd(cfg, x, w, seg):
    return _forward(cfg, x, w, seg), (x, w, seg)


def _conv_bwd(cfg, res, dy):
    x, w, seg = res
    dx, dw = _backward(cfg, x, w, seg, dy)
    return dx, dw, None


_conv.defvjp(_conv_fwd, _conv_bwd)


# ---------------------------------------------------------------------------------------------
# Entry


def _check_args(x, w, segment_ids):
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"{_FN}: argument `x` must be [B, T, C]; got shape "
                         f"{getattr(x, 'shape', None)}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{_FN}: argument `x` must have a floating dtype; got {x.dtype}.")
    B, T, C = x.shape
    if B < 1 or T < 1 or C < 1:
        raise ValueError(f"{_FN}: argument `x` must have B, T, C >= 1; got shape {x.shape}.")
    if getattr(w, "ndim", None) != 2 or w.shape[1] != C or w.shape[0] < 1:
        raise ValueError(f"{_FN}: argument `w` must be [S, C] with S >= 1 and C = {C} (x's "
                         f"channels); got shape {getattr(w, 'shape', None)}.")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{_FN}: argument `w` must have a floating dtype; got {w.dtype}.")
    if segment_ids is not None:
        if getattr(segment_ids, "shape", None) != (B, T):
            raise ValueError(f"{_FN}: argument `segment_ids` must be [B, T] = {(B, T)} or None; "
                             f"got shape {getattr(segment_ids, 'shape', None)}.")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"{_FN}: argument `segment_ids` must have an integer dtype; got "
                             f"{segment_ids.dtype}.")


def causal_conv_silu_gpu(x, w, segment_ids=None, *, interpret=False, block_sizes=None):
    """silu(Σ_{l<S} w[S−1−l] ⊙ x_{t−l} · same(t, l)) in x.dtype, float32 inside, as Pallas GPU
    kernels; differentiable in x and w (custom VJP: dx in x.dtype, dw in w.dtype).

    x [B, T, C] floating; w [S, C] (w[S−1] multiplies the current token); segment_ids [B, T]
    integer or None (a lag that crosses a document boundary contributes 0). Equals
    `atlas_jax.models.layers.causal_conv_silu(x, w, segment_ids)`.

    interpret: run in Pallas interpret mode (CPU, for tests). block_sizes: a
    `ConvGpuBlockSizes` (None: the defaults).
    """
    _check_args(x, w, segment_ids)
    if block_sizes is None:
        block_sizes = ConvGpuBlockSizes()
    elif not isinstance(block_sizes, ConvGpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be a ConvGpuBlockSizes or None; "
                        f"got {type(block_sizes).__name__}.")
    T, C = x.shape[1:]
    bs = block_sizes.resolve(T, C)
    bs.check()
    cfg = _Cfg(T=T, C=C, S=w.shape[0], segments=segment_ids is not None, bs=bs,
               interpret=bool(interpret))
    seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
    return _conv(cfg, x, w, seg)
