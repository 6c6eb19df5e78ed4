"""The recurrent form: a ``lax.scan`` over inner steps, exact for every point of the design space.

Per step t (one token, or one of its inner steps):

    p_t   = α_t ⊙ θ_{t−1}  (or θ_{t−1} with decoupled retention)          where ∇ is taken
    g_t   = ∇_θ Σ_{i in window} γ_i ℓ(M_{p_t}(φ(k_i)), v_i)                objective + Omega window
    u_t, s = optimizer.update(g_t, s, p_t, step_size=β_t, …)               any optax transform
    A_t   = α_t ⊙ A_{t−1} + u_t,   θ_t = map(A_t)                          retention
    o_t   = M_{θ_t}(φ(q_t))

This is the ground truth the chunked form and the kernels are tested against, and the decode step
for generation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from atlas_jax.forms.common import (MemoryState, Steps, WindowCache, channel_extra_args, optimizer_extra_args,
                                    restarted, tree_add, window_gradient)
from atlas_jax.retention import decay_tree

__all__ = ["recurrent_sequence", "inner_step"]


def inner_step(spec, state: MemoryState, x: Steps, gradient_point=None):
    """One inner step for one sequence and head; ``x`` holds that step's slices (no time axis).

    ``gradient_point``: a params tree at which g_t is taken in place of p_t (the optimizer still
    sees p_t): the chunk-start form's steps inside one chunk, which take every gradient at the
    chunk's start θ₀, where the chunk-start form is that (`spec.MemorySpec.chunk_start_is_recurrent`)."""
    memory, objective, retention = spec.memory, spec.objective, spec.retention
    opt = optax.with_extra_args_support(spec.optimizer)
    params, opt_state, acc, win = state
    channel_axes = memory.channel_axes(params)

    if win is not None:
        inputs = jnp.concatenate([win.inputs, x.inputs[None]])
        targets = jnp.concatenate([win.targets, x.targets[None]])
        own = jnp.concatenate([win.weights, x.gates[None]])
        delta = None if x.delta is None else jnp.concatenate([win.delta, x.delta[None]])
    else:
        inputs, targets, own = x.inputs[None], x.targets[None], x.gates[None]
        delta = None if x.delta is None else x.delta[None]
    weights = own if x.window_gates is None else own * x.window_gates

    base = acc if retention.has_map else params
    if x.log_decay is not None and retention.decay != "none":
        base = decay_tree(base, jnp.exp(x.log_decay), retention.decay, channel_axes)
    # Forget-then-write takes the gradient at the decayed point; decoupled decay at θ_{t−1}.
    if retention.decoupled or retention.decay == "none":
        point = params
    else:
        point = retention.map(base) if retention.has_map else base

    grads = window_gradient(memory, objective, point if gradient_point is None else gradient_point,
                            inputs, targets, weights, delta)
    sq_norm = jnp.sum(weights * jnp.sum(jnp.square(inputs), axis=-1))
    extra = optimizer_extra_args(x, inputs, targets, weights, sq_norm,
                                 scalar_decay=x.log_decay is not None and x.log_decay.ndim == 0)
    updates, new_opt_state = opt.update(grads, opt_state, point, **channel_extra_args(extra, params, channel_axes))

    new_acc = tree_add(base, updates)
    new_params = retention.map(new_acc) if retention.has_map else new_acc

    if win is not None:
        delta_cache = win.delta if x.delta is None else delta[1:]
        new_win = WindowCache(inputs[1:], targets[1:], own[1:], delta_cache)
    else:
        new_win = None
    new_state = MemoryState(new_params, new_opt_state, new_acc if retention.has_map else None, new_win)
    # Padding steps (chunked form only) must leave the state untouched.
    new_state = jax.tree.map(lambda new, old: jnp.where(x.active > 0, new, old), new_state, state)
    return new_state, memory.apply(new_params, x.queries)


def recurrent_sequence(spec, state: MemoryState, steps: Steps, gradient_point=None):
    """Scan ``inner_step`` over all steps of one sequence; returns (final state, outputs [S, d_out]).
    ``gradient_point``: `inner_step`'s, the same for every step."""
    if steps.restart is None:
        return jax.lax.scan(lambda s, x: inner_step(spec, s, x, gradient_point), state, steps)
    if gradient_point is not None:
        raise ValueError("recurrent_sequence: gradient_point is one chunk's start θ; restarts start new sequences")
    return jax.lax.scan(lambda s, x: inner_step(spec, restarted(s, state, x.restart), x), state, steps)
