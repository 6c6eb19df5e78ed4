"""Public delta-family ops with the flash-linear-attention signatures.

All of them run one recurrence on a state S in R^{K x V} (float32), per token t:

    S <- exp(g_t) * S                       (scalar gate: all of S; channel gate: row-wise)
    S <- S + beta_t k_t (v_t - S^T k_t)^T   (delta write; linear_attention: S + beta_t k_t v_t^T)
    o_t = S^T (scale q_t)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.ops import _validate as val
from atlas_jax.ops.delta_family.chunk import chunk_delta_family
from atlas_jax.ops.delta_family.naive import recurrent_delta_family

# What a gate of each rank means, for the error messages.
_SCALAR, _CHANNEL = "[B, T, H]", "[B, T, H, K]"


# What the Pallas kernels (atlas_jax.kernels.delta_family) cover.
PALLAS_HEAD_DIMS = (64, 128, 256)
PALLAS_CHUNK_SIZES = (16, 32, 64)
L2NORM_EPS = 1e-6   # fla's l2norm: x / sqrt(sum x^2 + eps)


def _backend():
    return jax.default_backend()


def _pallas_kernel():
    """The kernel for this backend: Mosaic on TPU, the Triton lowering elsewhere (on CPU it runs
    in Pallas interpret mode, which is how CI tests it)."""
    if _backend() == "tpu":
        from atlas_jax.kernels.delta_family.tpu import chunk_delta_family_tpu
        return chunk_delta_family_tpu
    from atlas_jax.kernels.delta_family.gpu import chunk_delta_family_gpu
    return chunk_delta_family_gpu


def _pallas_unsupported(delta, q, v, chunk_size):
    """Why the Pallas kernels cannot take this call (None when they can)."""
    if not delta:
        return "the kernels implement the delta write only (not linear_attention's additive write)"
    # Interpret mode (CPU) also takes the small head dims the kernel tests use.
    dims = PALLAS_HEAD_DIMS + ((16, 32) if _backend() == "cpu" else ())
    if q.shape[-1] not in dims or v.shape[-1] not in dims:
        return f"head dims K={q.shape[-1]}, V={v.shape[-1]} (supported: {dims})"
    if int(chunk_size) not in PALLAS_CHUNK_SIZES:
        return f"chunk_size={chunk_size} (supported: {PALLAS_CHUNK_SIZES})"
    if q.dtype not in (jnp.float32, jnp.bfloat16) or not (q.dtype == v.dtype):
        return f"dtype {q.dtype}/{v.dtype} (supported: float32 or bfloat16, the same for q, k, v)"
    return None


def _resolve_impl(fn, impl, *, delta, q, v, chunk_size):
    if impl == "auto":
        # The kernels on GPU/TPU when they cover the call; the exact XLA chunk form otherwise
        # (on CPU it beats interpret mode by orders of magnitude).
        if _backend() in ("gpu", "cuda", "tpu") and _pallas_unsupported(delta, q, v, chunk_size) is None:
            return "pallas"
        return "chunk"
    if impl == "pallas":
        why = _pallas_unsupported(delta, q, v, chunk_size)
        if why is not None:
            raise NotImplementedError(f"{fn}: impl='pallas' does not support {why}; use impl='chunk' "
                                      "or impl='auto'.")
    return impl


def _l2norm(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2NORM_EPS)).astype(x.dtype)


def _run(impl, q, k, v, beta, g, *, delta, scale, initial_state, output_final_state,
         chunk_size, cu_seqlens=None, normalize_qk=False):
    if impl == "pallas":
        return _pallas_kernel()(q, k, v, beta, g, scale=float(scale), initial_state=initial_state,
                                output_final_state=output_final_state, chunk_size=int(chunk_size),
                                cu_seqlens=cu_seqlens, normalize_qk=normalize_qk)
    if normalize_qk:
        q, k = _l2norm(q), _l2norm(k)
    if cu_seqlens is not None:
        return _run_varlen_xla(impl, q, k, v, beta, g, delta=delta, scale=scale,
                               initial_state=initial_state, output_final_state=output_final_state,
                               chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if impl == "recurrent":
        return recurrent_delta_family(q, k, v, beta, g, delta=delta, scale=scale,
                                      initial_state=initial_state,
                                      output_final_state=output_final_state)
    return chunk_delta_family(q, k, v, beta, g, delta=delta, scale=scale,
                              initial_state=initial_state,
                              output_final_state=output_final_state, chunk_size=int(chunk_size))


def _run_varlen_xla(impl, q, k, v, beta, g, *, cu_seqlens, initial_state, **kw):
    """Packed sequences through the XLA forms: each sequence becomes a batch row padded with
    k = v = beta = g = 0 (which leaves its state unchanged), so nothing crosses a boundary."""
    cu = np.asarray(cu_seqlens).astype(np.int64)
    lens = np.diff(cu)
    n, width = len(lens), max(int(lens.max()), 1)
    pos = np.arange(width)
    index = np.where(pos[None] < lens[:, None], cu[:-1, None] + pos[None], 0)   # [N, L]
    valid = jnp.asarray(pos[None] < lens[:, None])

    def rows(x):
        if x is None:
            return None
        y = jnp.take(x[0], jnp.asarray(index), axis=0)
        return jnp.where(valid.reshape(valid.shape + (1,) * (y.ndim - 2)), y, jnp.zeros((), y.dtype))

    o, final = _run(impl, rows(q), rows(k), rows(v), rows(beta), rows(g), initial_state=initial_state, **kw)
    seq = np.repeat(np.arange(n), lens)
    within = np.arange(int(cu[-1])) - np.repeat(cu[:-1], lens)
    return o[jnp.asarray(seq), jnp.asarray(within)][None], final


def _check_cu_seqlens(fn, cu_seqlens, B, T, impl):
    """Returns the number of packed sequences (or B without cu_seqlens)."""
    if cu_seqlens is None:
        return B
    if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        cu_seqlens = np.asarray(cu_seqlens)
        if not np.issubdtype(cu_seqlens.dtype, np.integer):
            raise TypeError(f"{fn}: argument `cu_seqlens` must be integer offsets; got {cu_seqlens.dtype}.")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{fn}: argument `cu_seqlens` must have shape [N + 1] (N >= 1 sequences); "
                         f"got {tuple(cu_seqlens.shape)}.")
    if B != 1:
        raise ValueError(f"{fn}: argument `cu_seqlens` packs sequences along T of a batch of one; "
                         f"got B = {B}. Reshape to [1, total_T, H, D].")
    if isinstance(cu_seqlens, jax.core.Tracer):
        if impl != "pallas":
            raise ValueError(f"{fn}: argument `cu_seqlens` must be concrete (not traced) for "
                             f"impl={impl!r}; pass it as a NumPy array or use impl='pallas'.")
    else:
        c = np.asarray(cu_seqlens)
        if c[0] != 0 or c[-1] != T or np.any(np.diff(c) < 0):
            raise ValueError(f"{fn}: argument `cu_seqlens` must be non-decreasing offsets from 0 to "
                             f"T = {T}; got {c.tolist()}.")
    return cu_seqlens.shape[0] - 1


def _check_gate(fn, g, B, T, H, K, allowed):
    """Validates g against the gate ranks `allowed` (subset of {3, 4}); None handled by caller."""
    g = val.as_float_array(fn, "g", g)
    if g.ndim not in allowed:
        if fn == "gated_delta_rule" and g.ndim == 4:
            raise ValueError(
                f"gated_delta_rule: argument `g` must be a scalar log-decay per head and token "
                f"with shape {_SCALAR} = {(B, T, H)}; got {tuple(g.shape)}, a per-key-channel "
                f"gate {_CHANNEL}. For channel-wise decay use atlas_jax.ops.kda.")
        if fn == "kda" and g.ndim == 3:
            raise ValueError(
                f"kda: argument `g` must be a per-key-channel log-decay with shape {_CHANNEL} = "
                f"{(B, T, H, K)}; got {tuple(g.shape)}, a scalar gate {_SCALAR}. For one scalar "
                f"decay per head use atlas_jax.ops.gated_delta_rule.")
        layouts = " or ".join({3: _SCALAR, 4: _CHANNEL}[r] for r in allowed)
        raise ValueError(f"{fn}: argument `g` must have layout {layouts}; got shape "
                         f"{tuple(g.shape)}.")
    if g.ndim == 3:
        val.check_shape(fn, "g", g, (B, T, H), _SCALAR, "g is a log-decay per head and token.")
    else:
        val.check_shape(fn, "g", g, (B, T, H, K), _CHANNEL,
                        "g is a log-decay per head, token and key channel.")
    return g


def _prepare(fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, *, g_ranks,
             g_required, product=False, cu_seqlens=None):
    """Shared validation; returns arrays (g and beta possibly None) and the resolved impl/scale."""
    val.check_impl(fn, impl)
    val.check_chunk_size(fn, chunk_size)
    val.check_scale(fn, scale)
    q = val.as_float_array(fn, "q", q)
    k = val.as_float_array(fn, "k", k)
    v = val.as_float_array(fn, "v", v)
    val.check_rank(fn, "q", q, "[B, T, H, K]")
    B, T, H, K = q.shape
    if product:
        val.check_rank(fn, "k", k, "[B, T, H, n_h, K]")
        n = k.shape[3]
        val.check_shape(fn, "k", k, (B, T, H, n, K), "[B, T, H, n_h, K]",
                        "k must share B, T, H and K with q.")
        val.check_rank(fn, "v", v, "[B, T, H, n_h, V]")
        val.check_shape(fn, "v", v, (B, T, H, n, v.shape[-1]), "[B, T, H, n_h, V]",
                        "v must share B, T, H and n_h with k.")
        beta_shape, beta_layout = (B, T, H, n), "[B, T, H, n_h]"
    else:
        val.check_rank(fn, "k", k, "[B, T, H, K]")
        val.check_shape(fn, "k", k, (B, T, H, K), "[B, T, H, K]", "k must have q's shape.")
        val.check_rank(fn, "v", v, "[B, T, H, V]")
        val.check_shape(fn, "v", v, (B, T, H, v.shape[-1]), "[B, T, H, V]",
                        "v must share B, T and H with q.")
        beta_shape, beta_layout = (B, T, H), "[B, T, H]"
    V = v.shape[-1]
    if beta is not None:
        beta = val.as_float_array(fn, "beta", beta)
        val.check_shape(fn, "beta", beta, beta_shape, beta_layout,
                        "beta is one write strength per head and token"
                        + (" and step." if product else "."))
    if g is None:
        if g_required:
            raise ValueError(
                f"{fn}: argument `g` is required (log-decay); for no decay use "
                f"atlas_jax.ops.delta_rule.")
    else:
        g = _check_gate(fn, g, B, T, H, K, g_ranks)
    impl = _resolve_impl(fn, impl, delta=fn != "linear_attention", q=q, v=v, chunk_size=chunk_size)
    n_states = _check_cu_seqlens(fn, cu_seqlens, B, T, impl)
    if initial_state is not None:
        initial_state = val.as_float_array(fn, "initial_state", initial_state)
        layout = "[N, H, K, V] (N packed sequences)" if cu_seqlens is not None else "[B, H, K, V]"
        val.check_shape(fn, "initial_state", initial_state, (n_states, H, K, V), layout,
                        "The state is float32 with keys on rows and values on columns.")
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    return q, k, v, beta, g, scale, initial_state, impl


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               impl="auto", chunk_size=64, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """DeltaNet: S <- S + beta_t k_t (v_t - S^T k_t)^T, o_t = S^T (scale q_t).

    Args:
      q, k: [B, T, H, K]. v: [B, T, H, V]. beta: [B, T, H] (None means 1.0).
      scale: query scale, default 1/sqrt(K).
      initial_state: [B, H, K, V] or None (zeros).
      output_final_state: also return the final state.
      impl: "recurrent" (float32 scan reference), "chunk" (exact chunked XLA form), "pallas"
        (the kernels: Triton lowering on GPU, Mosaic on TPU, interpret mode on CPU) or "auto"
        (the kernels on GPU/TPU when they cover the call, else "chunk").
      chunk_size: tokens per chunk for the chunked forms; any T is accepted.
      cu_seqlens: None, or int [N + 1] offsets of N sequences packed along T of a batch of one
        (fla's varlen convention); initial/final states are then [N, H, K, V] and no state
        crosses a boundary. Must be concrete for the XLA impls.
      use_qk_l2norm_in_kernel: L2-normalise q and k first (x / sqrt(sum x^2 + 1e-6)), inside
        the kernel for impl="pallas".

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B or N, H, K, V] float32 or None).
    """
    fn = "delta_rule"
    q, k, v, beta, _, scale, s0, impl = _prepare(
        fn, q, k, v, beta, None, scale, initial_state, impl, chunk_size, g_ranks=(),
        g_required=False, cu_seqlens=cu_seqlens)
    return _run(impl, q, k, v, beta, None, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size,
                cu_seqlens=cu_seqlens, normalize_qk=use_qk_l2norm_in_kernel)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                     output_final_state=False, impl="auto", chunk_size=64, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False):
    """Gated DeltaNet: delta_rule with a scalar log-decay g [B, T, H] applied before each write.

    Arguments and returns as `delta_rule`; g is required.
    """
    fn = "gated_delta_rule"
    q, k, v, beta, g, scale, s0, impl = _prepare(
        fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, g_ranks=(3,),
        g_required=True, cu_seqlens=cu_seqlens)
    return _run(impl, q, k, v, beta, g, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size,
                cu_seqlens=cu_seqlens, normalize_qk=use_qk_l2norm_in_kernel)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        impl="auto", chunk_size=64, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """Kimi Delta Attention: delta_rule with a per-key-channel log-decay g [B, T, H, K].

    Arguments and returns as `delta_rule`; g is required.
    """
    fn = "kda"
    q, k, v, beta, g, scale, s0, impl = _prepare(
        fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, g_ranks=(4,),
        g_required=True, cu_seqlens=cu_seqlens)
    return _run(impl, q, k, v, beta, g, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size,
                cu_seqlens=cu_seqlens, normalize_qk=use_qk_l2norm_in_kernel)


def linear_attention(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                     output_final_state=False, impl="auto", chunk_size=64, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False):
    """Additive write S <- exp(g_t) S + beta_t k_t v_t^T: linear attention, RetNet, Mamba2, GLA.

    g is None (linear attention), [B, T, H] (RetNet with a constant, Mamba2) or [B, T, H, K]
    (GLA); beta [B, T, H] or None (1.0). Other arguments and returns as `delta_rule`.
    """
    fn = "linear_attention"
    q, k, v, beta, g, scale, s0, impl = _prepare(
        fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, g_ranks=(3, 4),
        g_required=False, cu_seqlens=cu_seqlens)
    return _run(impl, q, k, v, beta, g, delta=False, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size,
                cu_seqlens=cu_seqlens, normalize_qk=use_qk_l2norm_in_kernel)


def delta_product(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  impl="auto", chunk_size=64, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """DeltaProduct: n_h delta steps per token, decay once before the first, read after the last.

    Args:
      q: [B, T, H, K]. k: [B, T, H, n_h, K]. v: [B, T, H, n_h, V].
      g: None, [B, T, H] (scalar log-decay) or [B, T, H, K] (per-channel) applied once per token.
      beta: [B, T, H, n_h] (None means 1.0).
      chunk_size: counts sub-steps (T * n_h of them), not tokens.
      Others as `delta_rule`.

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B, H, K, V] float32 or None).
    """
    fn = "delta_product"
    q, k, v, beta, g, scale, s0, impl = _prepare(
        fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, g_ranks=(3, 4),
        g_required=False, product=True, cu_seqlens=cu_seqlens)
    B, T, H, n, K = k.shape
    V = v.shape[-1]

    # Expand to T*n_h ordinary delta steps, sub-step axis right after time.
    def flat(x):
        return jnp.moveaxis(x, 3, 2).reshape((B, T * n, H) + x.shape[4:])

    kx, vx = flat(k), flat(v)
    bx = None if beta is None else flat(beta)
    first = jnp.arange(n) == 0
    last = jnp.arange(n) == n - 1
    gx = None
    if g is not None:
        # The token's decay belongs to its first sub-step only.
        sel = first.reshape((1, 1, n, 1) + (1,) * (g.ndim - 3))
        gx = jnp.where(sel, g[:, :, None], jnp.zeros((), g.dtype))
        gx = gx.reshape((B, T * n) + g.shape[2:])
    # Only the last sub-step's output is kept, so q is only needed there.
    qx = jnp.where(last.reshape(1, 1, n, 1, 1), q[:, :, None], jnp.zeros((), q.dtype))
    qx = qx.reshape(B, T * n, H, K)
    if cu_seqlens is None:
        cu_steps = None
    else:   # offsets in sub-steps
        cu_steps = cu_seqlens * n if hasattr(cu_seqlens, "dtype") else np.asarray(cu_seqlens) * n
    o, s = _run(impl, qx, kx, vx, bx, gx, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size,
                cu_seqlens=cu_steps, normalize_qk=use_qk_l2norm_in_kernel)
    return o.reshape(B, T, n, H, V)[:, :, -1], s
