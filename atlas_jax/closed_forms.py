"""Closed forms of the non-parametric members: DeepTransformer, SWDT and Dot (ATLAS §4).

With a linear memory on the exponential feature map φ* (infinite-dimensional, ⟨φ*(x), φ*(y)⟩ =
exp(x·y)) the recurrences can still be run exactly through the kernel trick, the way softmax
attention runs: keep every (k_i, v_i) and evaluate κ(q, k_i) = exp(q·k_i).

* DeepTransformer (eq. 25–26, Hebbian rule): o_t = Σ_{i≤t} exp(q_t·k_i) v_i — unnormalised causal
  softmax attention; ``normalize=True`` divides by Σ_i exp(q_t·k_i) and gives softmax attention.
* SWDT: the same over the last c tokens (sliding window).
* Dot (eq. 30–31, delta rule, online c = 1): M_t(x) = M_{t−1}(x) + β_t (v_t − M_{t−1}(k_t)) κ(k_t, x),
  i.e. o_t = Σ_{i≤t} κ(q_t, k_i) u_i with u_i = β_i (v_i − Σ_{j<i} κ(k_i, k_j) u_j): the UT transform
  of the delta rule with the kernel matrix in place of K Kᵀ, solved as one triangular system.

Queries are multiplied by ``scale`` (default 1/√K) before the kernel, as in attention. These are
quadratic in T, like attention, and are computed in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from atlas_jax.linalg import solve_unit_lower

__all__ = ["deep_transformer", "swdt", "dot"]


def _check(q, k, v, name):
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{name}: q and k must be [B, T, H, K] and v [B, T, H, V] with matching B, T, H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: {arg} must be floating, got {x.dtype}")


def _causal_mask(t: int, window: int | None) -> jax.Array:
    i = jnp.arange(t)
    mask = i[:, None] >= i[None, :]
    if window is not None:
        mask &= i[:, None] - i[None, :] < window
    return mask


def deep_transformer(q, k, v, *, scale=None, window: int | None = None, normalize: bool = False):
    """o_t = Σ_{i ≤ t, t−i < window} exp(scale q_t·k_i) v_i  (÷ Σ exp(…) when ``normalize``)."""
    _check(q, k, v, "deep_transformer")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"deep_transformer: window must be an int >= 1 or None, got {window!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    logits = jnp.einsum("BTHK,BSHK->BHTS", scale * qf, kf)
    mask = _causal_mask(q.shape[1], window)
    if normalize:
        weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    else:
        weights = jnp.exp(jnp.where(mask, logits, -jnp.inf))   # mask before exp
    return jnp.einsum("BHTS,BSHV->BTHV", weights, vf).astype(v.dtype)


def swdt(q, k, v, *, window: int, scale=None, normalize: bool = False):
    """Sliding-window DeepTransformer: ``deep_transformer`` over the last ``window`` tokens."""
    return deep_transformer(q, k, v, scale=scale, window=window, normalize=normalize)


def dot(q, k, v, beta=None, *, scale=None):
    """Deep Omega Transformer, online (c = 1) closed form: the kernelised delta rule."""
    _check(q, k, v, "dot")
    batch, time, heads, _ = q.shape
    if beta is None:
        beta = jnp.ones((batch, time, heads), jnp.float32)
    if beta.shape != (batch, time, heads):
        raise ValueError(f"dot: beta must be [B, T, H] = {(batch, time, heads)}, got {tuple(beta.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf, bf = (x.astype(jnp.float32) for x in (q, k, v, beta))
    strictly_lower = _causal_mask(time, None) & ~jnp.eye(time, dtype=bool)
    kernel_kk = jnp.exp(jnp.where(strictly_lower, jnp.einsum("BTHK,BSHK->BHTS", kf, kf), -jnp.inf))
    bh = jnp.moveaxis(bf, 1, 2)[..., None]                                # [B, H, T, 1]
    system = jnp.eye(time) + bh * kernel_kk                              # (I + diag(β) A)
    u = solve_unit_lower(system, bh * jnp.moveaxis(vf, 1, 2))       # unit diagonal: I + ...
    kernel_qk = jnp.exp(jnp.where(_causal_mask(time, None), jnp.einsum("BTHK,BSHK->BHTS", scale * qf, kf), -jnp.inf))
    return jnp.einsum("BHTS,BHSV->BTHV", kernel_qk, u).astype(v.dtype)
