"""Token-by-token reference for the delta family (float32 `jax.lax.scan`).

This is the ground truth the chunked and Pallas forms are tested against, and the decode step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The reference must not silently drop to TF32/bf16 passes on GPU/TPU.
_HI = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("delta", "output_final_state"))
def recurrent_delta_family(q, k, v, beta, g=None, *, delta=True, scale=1.0,
                           initial_state=None, output_final_state=False):
    """Runs the delta-family recurrence one token at a time.

    Per token t: S <- exp(g_t) * S; then S <- S + beta_t k_t (v_t - S^T k_t)^T if `delta`
    (else S <- S + beta_t k_t v_t^T); then o_t = S^T (scale q_t).

    Args:
      q: [B, T, H, K] queries.
      k: [B, T, H, K] keys.
      v: [B, T, H, V] values.
      beta: [B, T, H] write strengths, or None for 1.0.
      g: None (no decay), [B, T, H] scalar log-decay, or [B, T, H, K] per-key-channel log-decay.
      delta: delta-rule write if True, plain additive (linear attention) write if False.
      scale: multiplier applied to q.
      initial_state: [B, H, K, V] start state, or None for zeros.
      output_final_state: whether to return the final state.

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B, H, K, V] float32 or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = jnp.float32
    q = q.astype(f32) * jnp.asarray(scale, f32)
    k = k.astype(f32)
    vf = v.astype(f32)
    beta = jnp.ones((B, T, H), f32) if beta is None else beta.astype(f32)
    if g is None:
        g = jnp.zeros((B, T, H, K), f32)
    else:
        g = g.astype(f32)
        if g.ndim == 3:
            # A scalar gate is a channel gate that is equal on every key row.
            g = jnp.broadcast_to(g[..., None], (B, T, H, K))
    s0 = (jnp.zeros((B, H, K, V), f32) if initial_state is None
          else initial_state.astype(f32))

    def step(s, xs):
        q_t, k_t, v_t, b_t, g_t = xs
        s = jnp.exp(g_t)[..., None] * s
        if delta:
            pred = jnp.einsum('BHKV,BHK->BHV', s, k_t, precision=_HI)
            write = v_t - pred
        else:
            write = v_t
        s = s + jnp.einsum('BHK,BHV->BHKV', b_t[..., None] * k_t, write, precision=_HI)
        o_t = jnp.einsum('BHKV,BHK->BHV', s, q_t, precision=_HI)
        return s, o_t

    # Scan over the token axis, which must lead.
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, vf, beta, g))
    s, o = jax.lax.scan(step, s0, xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (s if output_final_state else None)
