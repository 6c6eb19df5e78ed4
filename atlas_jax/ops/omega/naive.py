"""Token-by-token reference for the exact Omega rule on a linear memory (float32 `lax.scan`).

The Omega rule (ATLAS eq. 9 / DESIGN §1, seed 000 §6.1) with a linear memory M(x) = Sᵀx,
S ∈ ℝ^{K×V} (the keys are already feature-mapped), one GD step per token and *decoupled* scalar
retention (the gradient is taken at S_{t−1}; the decay then acts on S_{t−1} only — the
``retention.scalar(decoupled=True)`` of the swla / omeganet / atlas presets):

    ∇_t = Σ_{j=0..c−1} w_{t,j} κ_{t,j} r_{t,j}ᵀ,   κ_{t,j} = k_{t−c+1+j},  ν_{t,j} = v_{t−c+1+j}
          r_{t,j} = S_{t−1}ᵀ κ_{t,j} − ν_{t,j}     (ℓ2: ½‖v − Sᵀk‖²)
          r_{t,j} = −ν_{t,j}                        (dot: −⟨Sᵀk, v⟩; no S term)
    S_t = α_t S_{t−1} − β_t ∇_t,                    α_t = exp(g_t)
    o_t = S_tᵀ (scale · q_t)                        (read after the update)

The window weights w_{t,j} are, oldest position first (j = 0 is token t−c+1, j = c−1 is t):
  per-token γ [B, T, H]:       w_{t,j} = γ_{t−c+1+j}            (token i keeps its own γ_i)
  per-position γ [B, T, H, c]: w_{t,j} = γ^{(t)}_j               (step t's weight of position j)
and w_{t,j} = 0 where t−c+1+j < 0: the window starts empty at the first token, exactly as the
library's recurrent form with a fresh ``WindowCache`` (``forms.recurrent.inner_step``). To continue
a sequence, ``initial_window`` = (keys [B, H, c−1, K], values [B, H, c−1, V], weights [B, H, c−1])
holds the c − 1 tokens before the first, oldest first, as ``WindowCache`` does (weights: each
cached token's own γ with per-token gates, 1 with per-position gates, 0 for an empty slot; a
cached token at window position j then weighs weights · γ^{(t)}_j).

So S_t = (α_t I − β_t Σ_j w_{t,j} κ_{t,j} κ_{t,j}ᵀ) S_{t−1} + β_t Σ_j w_{t,j} κ_{t,j} ν_{t,j}ᵀ:
a rank-c transition per token, DeltaProduct-like but over a sliding window. This module runs it
literally, carrying the last c − 1 keys, values and weights; `chunk.py` is the exact chunked form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The reference must not silently drop to TF32/bf16 passes on GPU/TPU.
_HI = jax.lax.Precision.HIGHEST

OBJECTIVES = ("l2", "dot")


def window_triple(initial_window):
    """(keys, values, weights) from a tuple or from the library's ``WindowCache``."""
    if initial_window is not None and hasattr(initial_window, "inputs"):
        return (initial_window.inputs, initial_window.targets, initial_window.weights)
    return initial_window


def check_args(q, k, v, beta, g, gamma, window, objective, initial_window=None):
    """Shape and option checks shared by the reference and the chunked form."""
    if objective not in OBJECTIVES:
        raise ValueError(f"omega: objective must be one of {OBJECTIVES}, got {objective!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"omega: window must be an int >= 1, got {window!r}")
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"omega: q and k must be [B, T, H, K] of one shape, got {q.shape} and {k.shape}")
    bth = q.shape[:3]
    if v.ndim != 4 or v.shape[:3] != bth:
        raise ValueError(f"omega: v must be [B, T, H, V] matching q {q.shape}, got {v.shape}")
    for name, x in (("beta", beta), ("g", g)):
        if x is not None and x.shape != bth:
            raise ValueError(f"omega: {name} must be [B, T, H] = {bth}, got {x.shape}")
    if gamma is not None and gamma.shape not in (bth, bth + (window,)):
        raise ValueError(f"omega: gamma must be [B, T, H] (per token) or [B, T, H, c={window}] "
                         f"(per window position, oldest first), got {gamma.shape}")
    if initial_window is not None:
        b, _, h, d_k = q.shape
        want = ((b, h, window - 1, d_k), (b, h, window - 1, v.shape[-1]), (b, h, window - 1))
        got = tuple(tuple(x.shape) for x in initial_window) if len(initial_window) == 3 else None
        if got != want:
            raise ValueError(f"omega: initial_window must be (keys, values, weights) of shapes {want} "
                             f"(the c - 1 tokens before the first, oldest first), got {got}")


def float32_inputs(q, k, v, beta, g, gamma, initial_window, *, window, scale):
    """Both forms' inputs in float32 with their defaults: (scale·q, k, v, β (1), g (0), γ (1), the
    window cache (previous c − 1 keys, values and own weights; zeros = empty slots))."""
    B, T, H, K = q.shape
    V, c, f32 = v.shape[-1], window, jnp.float32
    scale = K ** -0.5 if scale is None else scale
    qf = q.astype(f32) * jnp.asarray(scale, f32)
    beta = jnp.ones((B, T, H), f32) if beta is None else beta.astype(f32)
    g = jnp.zeros((B, T, H), f32) if g is None else g.astype(f32)
    gamma = jnp.ones((B, T, H), f32) if gamma is None else gamma.astype(f32)
    if initial_window is None:
        cache = (jnp.zeros((B, H, c - 1, K), f32), jnp.zeros((B, H, c - 1, V), f32),
                 jnp.zeros((B, H, c - 1), f32))
    else:
        cache = tuple(x.astype(f32) for x in initial_window)
    return qf, k.astype(f32), v.astype(f32), beta, g, gamma, cache


@functools.partial(jax.jit, static_argnames=("window", "objective", "output_final_state"))
def omega_linear_recurrent(q, k, v, beta=None, g=None, gamma=None, *, window=1, objective="l2",
                           scale=None, initial_state=None, output_final_state=False,
                           initial_window=None):
    """Runs the Omega rule on a linear memory one token at a time (see the module docstring).

    Args:
      q: [B, T, H, K] queries (feature-mapped).
      k: [B, T, H, K] keys (feature-mapped).
      v: [B, T, H, V] values.
      beta: [B, T, H] GD step sizes β_t, or None for 1.0.
      g: [B, T, H] log-decays g_t (α_t = exp(g_t), decoupled), or None for no decay.
      gamma: None (all 1), [B, T, H] per-token gates γ_i, or [B, T, H, c] per-position gates
        γ^{(t)}_j, oldest position first.
      window: the Omega window c (1 = the current token only).
      objective: "l2" (½‖v − Sᵀk‖²) or "dot" (−⟨Sᵀk, v⟩).
      scale: multiplier applied to q; None for 1/√K.
      initial_state: [B, H, K, V] start state S_0, or None for zeros (the window starts empty).
      output_final_state: whether to return the final state.
      initial_window: None (the window starts empty) or (keys [B, H, c−1, K], values
        [B, H, c−1, V], weights [B, H, c−1]): the c − 1 tokens before the first, oldest first,
        as the library's ``WindowCache`` (which is accepted too; see the module docstring).

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B, H, K, V] float32 or None). The final window is
      the inputs' last c − 1 tokens (with ``initial_window`` in front when T < c − 1).
    """
    initial_window = window_triple(initial_window)
    check_args(q, k, v, beta, g, gamma, window, objective, initial_window)
    B, T, H, K = q.shape
    V = v.shape[-1]
    c = window
    f32 = jnp.float32
    qf, kf, vf, beta, g, gamma, cache = float32_inputs(q, k, v, beta, g, gamma, initial_window,
                                                       window=c, scale=scale)
    if gamma.ndim == 4:      # per position: every real token's own weight is 1
        own, pos = jnp.ones((B, T, H), f32), gamma
    else:                    # per token: token i weighs γ_i wherever it sits in a window
        own, pos = gamma, jnp.ones((B, T, H, c), f32)
    s0 = (jnp.zeros((B, H, K, V), f32) if initial_state is None
          else initial_state.astype(f32))

    def step(carry, xs):
        s, (ck, cv, cw) = carry
        q_t, k_t, v_t, b_t, g_t, own_t, pos_t = xs
        kw = jnp.concatenate([ck, k_t[:, :, None]], axis=2)        # [B, H, c, K] oldest first
        vw = jnp.concatenate([cv, v_t[:, :, None]], axis=2)        # [B, H, c, V]
        ow = jnp.concatenate([cw, own_t[:, :, None]], axis=2)      # [B, H, c]
        w = ow * pos_t
        if objective == "l2":
            resid = jnp.einsum('BHCK,BHKV->BHCV', kw, s, precision=_HI) - vw
        else:
            resid = -vw
        grad = jnp.einsum('BHCK,BHC,BHCV->BHKV', kw, w, resid, precision=_HI)
        s = jnp.exp(g_t)[..., None, None] * s - b_t[..., None, None] * grad
        o_t = jnp.einsum('BHKV,BHK->BHV', s, q_t, precision=_HI)
        return (s, (kw[:, :, 1:], vw[:, :, 1:], ow[:, :, 1:])), o_t

    # Scan over the token axis, which must lead.
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (qf, kf, vf, beta, g, own, pos))
    (s, _), o = jax.lax.scan(step, (s0, cache), xs)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (s if output_final_state else None)
