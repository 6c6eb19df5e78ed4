"""What the delta-family kernels support, and the one argument checker of every delta-family call.

Pure Python (NumPy and jax.numpy only, no Pallas, Triton or Mosaic), so that the public ops can
validate a call and decide whether the kernels cover it without importing a kernel.

Each knob has exactly one owner here:
  CHUNK_SIZES          chunk sizes the Pallas kernels take (GPU and TPU)
  GPU_HEAD_DIMS        key head dims K (and value head dims V) the GPU (Triton) kernels compile for
  GPU_VALUE_HEAD_DIMS  value head dims V: GPU_HEAD_DIMS and 512 (fla's GatedDeltaNet with
                       expand_v = 2 at K = 256); every kernel tiles V, so V only adds tiles
  INTERPRET_HEAD_DIMS  further head dims (K and V) taken in Pallas interpret mode (CPU tests)
  L2NORM_EPS           in-kernel L2 normalisation of q and k: x / sqrt(sum x^2 + eps), as fla
  KERNEL_DTYPES        dtypes of q, k, v the kernels take (float32 accumulation either way)
  RESIDUALS_NAME       the `checkpoint_name` of what the kernels' forward saves for the backward
                       (a remat policy that keeps it skips rerunning the forward kernels)
  fused_gate           fla's gate activation (use_gate_in_kernel), float32, one XLA pass
  fused_beta           fla's beta activation (use_beta_sigmoid_in_kernel), float32

`check_delta_call` is the one checker of shapes, dtypes and `cu_seqlens` for the public ops
(`atlas_jax.ops`) and the kernel entries (`chunk_delta_family_gpu`, `chunk_delta_family_tpu`);
kernel-specific limits (block sizes fitting the shapes) stay with each kernel's config. Every
message names the op, the argument, the expected layout or shape and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

RESIDUALS_NAME = "memory_kernel_residuals"


def fused_gate(g, A_log, dt_bias, *, lower_bound=None):
    """fla's fused gate in float32: -a * softplus(g + dt_bias), or with a lower_bound
    lower_bound * sigmoid(a * (g + dt_bias)), a = exp(A_log) (A_log None: a = 1). g is
    [B, T, H] or [B, T, H, K]; A_log [H]; dt_bias broadcasts against g ([H] or [H, K]; None: 0).
    A raw gate of -inf (a masked position) gives exactly 0, no decay, with finite gradients: the
    bounded form masks it on both sides of the sigmoid, since its gradient in a would be
    0 * (-inf) = NaN there (the softplus form needs no mask)."""
    x = g.astype(jnp.float32)
    a = 1.0
    if A_log is not None:
        a = jnp.exp(A_log.astype(jnp.float32)).reshape(A_log.shape + (1,) * (g.ndim - 3))
    if dt_bias is not None:
        x = x + dt_bias.astype(jnp.float32)
    if lower_bound is None:
        return -a * jax.nn.softplus(x)
    off = x == -jnp.inf
    return jnp.where(off, 0.0, lower_bound * jax.nn.sigmoid(a * jnp.where(off, 0.0, x)))


def fused_beta(beta, *, neg_eigval=False):
    """fla's in-kernel beta (use_beta_sigmoid_in_kernel) in float32: sigmoid of the logits,
    times 2 with allow_neg_eigval (beta in [0, 2))."""
    return jax.nn.sigmoid(beta.astype(jnp.float32)) * (2.0 if neg_eigval else 1.0)


def name_residuals(tree):
    """Tag every array of the kernels' saved residuals with RESIDUALS_NAME (identity otherwise).

    The per-chunk states h are among them ([B, T/C, H, K, V]: K·V/C values a token, 16 KiB at
    K = 256, V = 512 in bf16): keeping them too took the fla-config LM's loss+grad (H100, B8
    T4096) from 434 to 409 ms, at 54 instead of 43 GiB compiled."""
    return jax.tree.map(lambda x: checkpoint_name(x, RESIDUALS_NAME), tree)


CHUNK_SIZES = (16, 32, 64)
GPU_HEAD_DIMS = (64, 128, 256)
GPU_VALUE_HEAD_DIMS = GPU_HEAD_DIMS + (512,)
INTERPRET_HEAD_DIMS = (16, 32)
L2NORM_EPS = 1e-6
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

IMPLS = ("recurrent", "chunk", "pallas", "auto")

SCALAR_GATE, CHANNEL_GATE = "[B, T, H]", "[B, T, H, K]"


def kernel_head_dims(interpret: bool, *, value: bool = False) -> tuple[int, ...]:
    """Head dims the kernels take, of the keys (K) or with `value` of the values (V): the GPU
    ones, plus the small ones in interpret mode."""
    dims = GPU_VALUE_HEAD_DIMS if value else GPU_HEAD_DIMS
    return tuple(sorted(dims + (INTERPRET_HEAD_DIMS if interpret else ())))


@dataclasses.dataclass(frozen=True)
class DeltaCall:
    """Sizes of one validated call. `H`: heads of q and k; `HV`: heads of v, beta, g and the
    state (grouped value heads, fla's GVA: HV = G * H, value head i reads q/k head i // G;
    None means H). `n_states` is B, or N with `cu_seqlens` (packed sequences); `steps` is
    delta_product's n_h (None for the other ops)."""
    B: int
    T: int
    H: int
    K: int
    V: int
    n_states: int
    gate: str            # "none" | "scalar" | "channel"
    steps: int | None = None
    HV: int | None = None

    def __post_init__(self):
        if self.HV is None:
            object.__setattr__(self, "HV", self.H)

    @property
    def group(self) -> int:
        """Value heads per q/k head (G = HV / H)."""
        return self.HV // self.H


# ---------------------------------------------------------------------------------------------
# Scalar arguments


def is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, bool)


def check_num_warps(op, block_sizes, names):
    """ValueError unless each named field of ``block_sizes`` is a power of two from 1 to 32."""
    for name in names:
        w = getattr(block_sizes, name)
        if not is_int(w) or w < 1 or w > 32 or w & (w - 1):
            raise ValueError(f"{op}: argument `block_sizes.{name}` must be a power of two from 1 to 32 "
                             f"(warps per program); got {w!r}.")


def check_impl(op, impl):
    """ValueError unless `impl` is one of IMPLS."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{op}: argument `impl` must be one of {IMPLS}; got {impl!r}.")


def check_chunk_size(op, chunk_size, *, kernel=False) -> int:
    """A positive int (the XLA chunk form takes any); one of CHUNK_SIZES for the kernels."""
    if not is_int(chunk_size) or int(chunk_size) <= 0:
        raise ValueError(f"{op}: argument `chunk_size` must be a positive int (e.g. 64); got "
                         f"{chunk_size!r}.")
    if kernel and int(chunk_size) not in CHUNK_SIZES:
        raise ValueError(f"{op}: argument `chunk_size` must be one of {CHUNK_SIZES} for the "
                         f"Pallas kernels; got {chunk_size!r}. Pick one of those, or use the "
                         f"XLA chunk form (atlas_jax.ops with impl='chunk'), which takes any.")
    return int(chunk_size)


def check_scale(op, scale, *, static=False):
    """None or a real scalar; with `static`, a finite Python/NumPy number (the kernels bake it in)."""
    if static:
        if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, np.floating)) \
                or not math.isfinite(scale):
            raise TypeError(f"{op}: argument `scale` must be a finite Python float (static); got "
                            f"{scale!r}. Pass float(scale).")
        return
    if scale is None or (isinstance(scale, numbers.Real) and not isinstance(scale, bool)):
        return
    if hasattr(scale, "shape") and tuple(scale.shape) == ():
        return
    raise ValueError(f"{op}: argument `scale` must be None (1/sqrt(K)) or a real scalar; "
                     f"got {scale!r}.")


# ---------------------------------------------------------------------------------------------
# Arrays


def _float_array(op, name, x):
    """`x` as an array; TypeError unless its dtype is floating."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{op}: argument `{name}` must have a floating dtype (float32, bfloat16, float16); "
            f"got {x.dtype}. Cast it first, e.g. `{name}.astype(jnp.float32)`.")
    return x


def _check_rank(op, name, x, layout):
    rank = len(layout.strip("[]").split(","))
    if x.ndim != rank:
        raise ValueError(
            f"{op}: argument `{name}` must have rank {rank} with layout {layout}; got shape "
            f"{tuple(x.shape)} (rank {x.ndim}). Inputs are batch-first, time-second: reshape "
            f"`{name}` to {layout}.")


def _check_shape(op, name, x, expected, layout, hint=""):
    if tuple(x.shape) != tuple(expected):
        msg = (f"{op}: argument `{name}` must have shape {layout} = {tuple(expected)}; got "
               f"{tuple(x.shape)}.")
        raise ValueError(msg + (" " + hint if hint else ""))


def _check_gate(op, g, B, T, H, K, ranks):
    g = _float_array(op, "g", g)
    if g.ndim not in ranks:
        if ranks == (3,) and g.ndim == 4:
            raise ValueError(
                f"{op}: argument `g` must be a scalar log-decay per head and token with shape "
                f"{SCALAR_GATE} = {(B, T, H)}; got {tuple(g.shape)}, a per-key-channel gate "
                f"{CHANNEL_GATE}. For channel-wise decay use atlas_jax.ops.kda.")
        if ranks == (4,) and g.ndim == 3:
            raise ValueError(
                f"{op}: argument `g` must be a per-key-channel log-decay with shape "
                f"{CHANNEL_GATE} = {(B, T, H, K)}; got {tuple(g.shape)}, a scalar gate "
                f"{SCALAR_GATE}. For one scalar decay per head use "
                f"atlas_jax.ops.gated_delta_rule.")
        layouts = " or ".join({3: SCALAR_GATE, 4: CHANNEL_GATE}[r] for r in ranks)
        raise ValueError(f"{op}: argument `g` must have layout {layouts} (log-decay per head "
                         f"and token{', and key channel' if 4 in ranks else ''}); got shape "
                         f"{tuple(g.shape)}.")
    if g.ndim == 3:
        _check_shape(op, "g", g, (B, T, H), SCALAR_GATE, "g is a log-decay per head and token.")
    else:
        _check_shape(op, "g", g, (B, T, H, K), CHANNEL_GATE,
                     "g is a log-decay per head, token and key channel.")
    return g


def _concrete(x):
    """NumPy value of `x`, or None while it is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def require_concrete_cu_seqlens(op, cu_seqlens, impl=None):
    """ValueError if `cu_seqlens` is traced: the XLA forms lay packed rows out on the host."""
    if _concrete(cu_seqlens) is None:
        where = "here" if impl is None else f"for impl={impl!r}"
        raise ValueError(f"{op}: argument `cu_seqlens` must be concrete (not traced) {where}; "
                         f"pass it as a NumPy array, or use impl='pallas', which takes traced "
                         f"offsets.")


def _check_cu_seqlens(op, cu_seqlens, B, T, *, allow_traced):
    """Returns (cu_seqlens, number of packed sequences)."""
    if not hasattr(cu_seqlens, "dtype"):
        cu_seqlens = np.asarray(cu_seqlens)
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"{op}: argument `cu_seqlens` must be integer offsets [N + 1]; got dtype "
                        f"{cu_seqlens.dtype}. Pass e.g. np.array([0, len_1, len_1 + len_2], "
                        f"np.int32).")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{op}: argument `cu_seqlens` must have shape [N + 1] (N >= 1 "
                         f"sequences); got {tuple(cu_seqlens.shape)}.")
    if B != 1:
        raise ValueError(f"{op}: argument `cu_seqlens` packs sequences along T of a batch of "
                         f"one; got B = {B}. Reshape the inputs to [1, total_T, H, D].")
    c = _concrete(cu_seqlens)
    if c is None:
        if not allow_traced:
            require_concrete_cu_seqlens(op, cu_seqlens)
    elif c[0] != 0 or c[-1] != T or np.any(np.diff(c.astype(np.int64)) < 0):
        raise ValueError(f"{op}: argument `cu_seqlens` must be non-decreasing offsets from 0 to "
                         f"T = {T}; got {c.tolist()}.")
    return cu_seqlens, cu_seqlens.shape[0] - 1


def check_delta_call(op, q, k, v, beta=None, g=None, initial_state=None, cu_seqlens=None, *,
                     gate_ranks=(3, 4), gate_required=False, steps=False, kernel=False,
                     allow_traced_cu_seqlens=False, state_v_first=False):
    """Checks one delta-family call; returns (q, k, v, beta, g, initial_state, cu_seqlens, call).

    Layouts: q [B, T, H, K]; k [B, T, H, K] and v [B, T, HV, V] (with `steps`, delta_product's
    k [B, T, H, n_h, K], v [B, T, H, n_h, V], beta [B, T, H, n_h]); beta [B, T, HV] or None;
    g None, scalar [B, T, HV] or channel [B, T, HV, K] (ranks in `gate_ranks`); initial_state
    [B, HV, K, V] (or [N, HV, K, V] with cu_seqlens; [.., V, K] with `state_v_first`, and
    returned transposed to [.., K, V]) or None; cu_seqlens None or int [N + 1] offsets from 0
    to T, non-decreasing, packing N sequences along T of a batch of one. HV = G * H (grouped
    value heads, fla's GVA: value head i reads q/k head i // G); HV = H without steps only.

    `kernel`: also the kernels' own limits (q, k, v float32 or bfloat16 sharing one dtype, at
    least one token). `allow_traced_cu_seqlens`: traced offsets are trusted (the kernels build
    their layout in-graph); otherwise they must be concrete. Arrays come back as arrays, with
    their dtypes unchanged.
    """
    q, k, v = (_float_array(op, n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    _check_rank(op, "q", q, "[B, T, H, K]")
    B, T, H, K = q.shape
    n = None
    if steps:
        _check_rank(op, "k", k, "[B, T, H, n_h, K]")
        n = k.shape[3]
        _check_shape(op, "k", k, (B, T, H, n, K), "[B, T, H, n_h, K]",
                     "k must share B, T, H and K with q.")
        _check_rank(op, "v", v, "[B, T, H, n_h, V]")
        _check_shape(op, "v", v, (B, T, H, n, v.shape[-1]), "[B, T, H, n_h, V]",
                     "v must share B, T, H and n_h with k.")
        beta_shape, beta_layout = (B, T, H, n), "[B, T, H, n_h]"
    else:
        _check_rank(op, "k", k, "[B, T, H, K]")
        _check_shape(op, "k", k, (B, T, H, K), "[B, T, H, K]", "k must have q's shape.")
        _check_rank(op, "v", v, "[B, T, HV, V]")
        HV = v.shape[2]
        if HV < 1 or HV % H:
            raise ValueError(
                f"{op}: argument `v` has HV = {HV} heads, not a multiple of the H = {H} heads of "
                f"q and k; v [B, T, HV, V] takes HV = G * H heads (grouped value heads: value "
                f"head i reads q/k head i // G). Pass v with a multiple of {H} heads.")
        _check_shape(op, "v", v, (B, T, HV, v.shape[-1]), "[B, T, HV, V]",
                     "v must share B and T with q.")
        beta_shape, beta_layout = (B, T, HV), "[B, T, HV]"
    V = v.shape[-1]
    HV = beta_shape[2]
    if kernel:
        if q.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{op}: argument `q` must be float32 or bfloat16 for the kernels; got "
                            f"{q.dtype}. Cast q, k, v, or use the XLA forms (impl='chunk').")
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"{op}: arguments `q`, `k`, `v` must share one dtype; got {q.dtype}, "
                            f"{k.dtype}, {v.dtype}. Cast them to one of float32, bfloat16.")
        if T < 1:
            raise ValueError(f"{op}: argument `q` must have at least one token (T >= 1) in "
                             f"[B, T, H, K]; got T = {T}.")
    if beta is not None:
        beta = _float_array(op, "beta", beta)
        _check_shape(op, "beta", beta, beta_shape, beta_layout,
                     "beta is one write strength per head and token"
                     + (" and step." if steps else ". Pass None for 1.0."))
    if g is None:
        if gate_required:
            raise ValueError(f"{op}: argument `g` is required (log-decay); for no decay use "
                             f"atlas_jax.ops.delta_rule.")
        gate = "none"
    else:
        g = _check_gate(op, g, B, T, HV, K, tuple(gate_ranks))
        gate = "scalar" if g.ndim == 3 else "channel"
    n_states = B
    if cu_seqlens is not None:
        cu_seqlens, n_states = _check_cu_seqlens(op, cu_seqlens, B, T,
                                                 allow_traced=allow_traced_cu_seqlens)
    if initial_state is not None:
        initial_state = _float_array(op, "initial_state", initial_state)
        rows = "N" if cu_seqlens is not None else "B"
        kv = "V, K" if state_v_first else "K, V"
        layout = f"[{rows}, {'HV' if HV != H else 'H'}, {kv}]"
        if cu_seqlens is not None:
            layout += " (N packed sequences)"
        expected = (n_states, HV, V, K) if state_v_first else (n_states, HV, K, V)
        _check_shape(op, "initial_state", initial_state, expected, layout,
                     "The state is float32 with " + ("values on rows and keys on columns "
                                                     "(state_v_first)." if state_v_first else
                                                     "keys on rows and values on columns."))
        if state_v_first:
            initial_state = jnp.swapaxes(initial_state, -1, -2)
    call = DeltaCall(B=B, T=T, H=H, K=K, V=V, n_states=n_states, gate=gate, steps=n, HV=HV)
    return q, k, v, beta, g, initial_state, cu_seqlens, call


def check_fla_args(op, call: DeltaCall, g, beta, *, use_gate_in_kernel=False, A_log=None,
                   dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                   safe_gate=False, lower_bound=None):
    """Checks fla's activation arguments against a validated call; returns (A_log, dt_bias) as
    float arrays ([HV]; dt_bias [HV] for the scalar gate, [HV, K] for the channel gate).

    Rules (fla's, each error naming its argument): `A_log` and `dt_bias` only with
    use_gate_in_kernel=True; use_gate_in_kernel needs g and A_log (the channel gate: A_log or
    lower_bound); `A_log` has HV elements, `dt_bias` HV (scalar gate) or HV * K (channel gate);
    safe_gate with use_gate_in_kernel needs lower_bound in [-5, 0); allow_neg_eigval needs
    use_beta_sigmoid_in_kernel=True, which needs beta (its logits)."""
    HV, K = call.HV, call.K
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and not use_gate_in_kernel:
            raise ValueError(f"{op}: argument `{name}` is only used with use_gate_in_kernel=True "
                             f"(g is then the raw gate input); pass use_gate_in_kernel=True, or "
                             f"drop `{name}` and pass the log-decay g.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{op}: argument `allow_neg_eigval=True` requires "
                         f"use_beta_sigmoid_in_kernel=True (beta = 2 * sigmoid(beta logits), in "
                         f"[0, 2)), as fla. For a beta already in [0, 2], pass it as is.")
    if use_beta_sigmoid_in_kernel and beta is None:
        raise ValueError(f"{op}: argument `beta` is required with use_beta_sigmoid_in_kernel=True "
                         f"(its logits, [B, T, HV]).")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real) \
                or not math.isfinite(lower_bound):
            raise ValueError(f"{op}: argument `lower_bound` must be a finite float (e.g. -5.0); "
                             f"got {lower_bound!r}.")
    if not use_gate_in_kernel:
        return None, None
    if g is None:
        raise ValueError(f"{op}: argument `g` (the raw gate input) is required with "
                         f"use_gate_in_kernel=True.")
    if safe_gate and (lower_bound is None or not -5.0 <= lower_bound < 0.0):
        raise ValueError(f"{op}: argument `lower_bound` must be in [-5, 0) with safe_gate=True and "
                         f"use_gate_in_kernel=True (the gate is then lower_bound * "
                         f"sigmoid(exp(A_log) * (g + dt_bias))); got {lower_bound!r}.")
    if A_log is None and (call.gate != "channel" or lower_bound is None):
        need = "" if call.gate != "channel" else " (or lower_bound)"
        raise ValueError(f"{op}: argument `A_log` [HV] = ({HV},) is required with "
                         f"use_gate_in_kernel=True{need}.")
    if A_log is not None:
        A_log = _float_array(op, "A_log", A_log)
        if A_log.size != HV:
            raise ValueError(f"{op}: argument `A_log` must have shape [HV] = ({HV},), one per value "
                             f"head; got {tuple(A_log.shape)}.")
        A_log = A_log.reshape(HV)
    if dt_bias is not None:
        dt_bias = _float_array(op, "dt_bias", dt_bias)
        shape, layout = ((HV,), "[HV]") if call.gate == "scalar" else ((HV, K), "[HV * K]")
        if dt_bias.size != math.prod(shape):
            raise ValueError(f"{op}: argument `dt_bias` must have shape {layout} = "
                             f"({math.prod(shape)},), added to g before the activation; got "
                             f"{tuple(dt_bias.shape)}.")
        dt_bias = dt_bias.reshape(shape)
    return A_log, dt_bias


def check_kernel_head_dims(op, K, V, *, interpret):
    """ValueError unless the GPU kernels take head dims K and V (interpret mode: more)."""
    for name, d, value in (("q", K, False), ("v", V, True)):
        dims = kernel_head_dims(interpret, value=value)
        if d not in dims:
            where = ("in interpret mode" if interpret else
                     "on GPU (the Triton kernels; other sizes run in interpret mode only)")
            raise ValueError(f"{op}: argument `{name}` has head dim {d}; supported {where}: "
                             f"{dims}. Pad the head dim, or use the XLA forms "
                             f"(atlas_jax.ops with impl='chunk').")


def kernel_gap(call: DeltaCall, dtypes, chunk_size, *, delta, interpret) -> str | None:
    """Why the Pallas kernels cannot take a validated call (None when they can). `dtypes`:
    those of q, k, v; `interpret`: the kernels would run in interpret mode (CPU)."""
    if not delta:
        return "the kernels implement the delta write only (not linear_attention's additive write)"
    kdims = kernel_head_dims(interpret)
    vdims = kernel_head_dims(interpret, value=True)
    if call.K not in kdims or call.V not in vdims:
        return f"head dims K={call.K}, V={call.V} (supported: K in {kdims}, V in {vdims})"
    if int(chunk_size) not in CHUNK_SIZES:
        return f"chunk_size={chunk_size} (supported: {CHUNK_SIZES})"
    if dtypes[0] not in KERNEL_DTYPES or len(set(dtypes)) != 1:
        return (f"dtypes {'/'.join(str(d) for d in dtypes)} of q/k/v (supported: float32 or "
                f"bfloat16, the same for q, k, v)")
    return None
