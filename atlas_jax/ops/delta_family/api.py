"""Public delta-family ops with the flash-linear-attention signatures.

All of them run one recurrence on a state S in R^{K x V} (float32), per token t:

    S <- exp(g_t) * S                       (scalar gate: all of S; channel gate: row-wise)
    S <- S + beta_t k_t (v_t - S^T k_t)^T   (delta write; linear_attention: S + beta_t k_t v_t^T)
    o_t = S^T (scale q_t)
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from atlas_jax.ops import _validate as val
from atlas_jax.ops.delta_family.chunk import chunk_delta_family
from atlas_jax.ops.delta_family.naive import recurrent_delta_family

# What a gate of each rank means, for the error messages.
_SCALAR, _CHANNEL = "[B, T, H]", "[B, T, H, K]"


def _resolve_impl(fn, impl):
    if impl == "auto":
        # The chunked XLA form is the fastest exact one on every backend until Pallas lands.
        return "chunk"
    if impl == "pallas":
        raise NotImplementedError(
            f"{fn}: impl='pallas' is not available yet; use impl='chunk' (exact, plain XLA) or "
            f"impl='auto'.")
    return impl


def _run(impl, q, k, v, beta, g, *, delta, scale, initial_state, output_final_state,
         chunk_size):
    if impl == "recurrent":
        return recurrent_delta_family(q, k, v, beta, g, delta=delta, scale=scale,
                                      initial_state=initial_state,
                                      output_final_state=output_final_state)
    return chunk_delta_family(q, k, v, beta, g, delta=delta, scale=scale,
                              initial_state=initial_state,
                              output_final_state=output_final_state, chunk_size=int(chunk_size))


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
             g_required, product=False):
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
    if initial_state is not None:
        initial_state = val.as_float_array(fn, "initial_state", initial_state)
        val.check_shape(fn, "initial_state", initial_state, (B, H, K, V), "[B, H, K, V]",
                        "The state is float32 with keys on rows and values on columns.")
    impl = _resolve_impl(fn, impl)
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    return q, k, v, beta, g, scale, initial_state, impl


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               impl="auto", chunk_size=64):
    """DeltaNet: S <- S + beta_t k_t (v_t - S^T k_t)^T, o_t = S^T (scale q_t).

    Args:
      q, k: [B, T, H, K]. v: [B, T, H, V]. beta: [B, T, H] (None means 1.0).
      scale: query scale, default 1/sqrt(K).
      initial_state: [B, H, K, V] or None (zeros).
      output_final_state: also return the final state.
      impl: "recurrent", "chunk", "pallas" or "auto".
      chunk_size: tokens per chunk for the chunked forms; any T is accepted.

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B, H, K, V] float32 or None).
    """
    fn = "delta_rule"
    q, k, v, beta, _, scale, s0, impl = _prepare(
        fn, q, k, v, beta, None, scale, initial_state, impl, chunk_size, g_ranks=(),
        g_required=False)
    return _run(impl, q, k, v, beta, None, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                     output_final_state=False, impl="auto", chunk_size=64):
    """Gated DeltaNet: delta_rule with a scalar log-decay g [B, T, H] applied before each write.

    Arguments and returns as `delta_rule`; g is required.
    """
    fn = "gated_delta_rule"
    q, k, v, beta, g, scale, s0, impl = _prepare(
        fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, g_ranks=(3,),
        g_required=True)
    return _run(impl, q, k, v, beta, g, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        impl="auto", chunk_size=64):
    """Kimi Delta Attention: delta_rule with a per-key-channel log-decay g [B, T, H, K].

    Arguments and returns as `delta_rule`; g is required.
    """
    fn = "kda"
    q, k, v, beta, g, scale, s0, impl = _prepare(
        fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, g_ranks=(4,),
        g_required=True)
    return _run(impl, q, k, v, beta, g, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size)


def linear_attention(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                     output_final_state=False, impl="auto", chunk_size=64):
    """Additive write S <- exp(g_t) S + beta_t k_t v_t^T: linear attention, RetNet, Mamba2, GLA.

    g is None (linear attention), [B, T, H] (RetNet with a constant, Mamba2) or [B, T, H, K]
    (GLA); beta [B, T, H] or None (1.0). Other arguments and returns as `delta_rule`.
    """
    fn = "linear_attention"
    q, k, v, beta, g, scale, s0, impl = _prepare(
        fn, q, k, v, beta, g, scale, initial_state, impl, chunk_size, g_ranks=(3, 4),
        g_required=False)
    return _run(impl, q, k, v, beta, g, delta=False, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size)


def delta_product(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  impl="auto", chunk_size=64):
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
        g_required=False, product=True)
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
    o, s = _run(impl, qx, kx, vx, bx, gx, delta=True, scale=scale, initial_state=s0,
                output_final_state=output_final_state, chunk_size=chunk_size)
    return o.reshape(B, T, n, H, V)[:, :, -1], s
