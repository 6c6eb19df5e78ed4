"""Pieces shared by the recurrent and chunked forms (per sequence, per head)."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Steps(NamedTuple):
    """One sequence (one batch element, one head) as a list of inner steps, each [S, ...].

    With several inner steps per token (DeltaProduct) a token is several steps: the decay acts on
    its first step only and the output is read after its last (``emit``).
    """

    inputs: jax.Array            # φ(k)            [S, d_in]
    targets: jax.Array           # v               [S, d_out]
    queries: jax.Array           # φ(scale·q)      [S, d_in]
    step_size: jax.Array | None  # β               [S] or [S, d] (channel-wise)
    log_decay: jax.Array | None  # g               [S] or [S, d] (0 where no decay acts)
    momentum_decay: jax.Array | None  # ν          [S] or [S, d]
    gates: jax.Array             # γ_i, the step's own Omega weight (1 with per-position γ)  [S]
    delta: jax.Array | None      # objective knob  [S, d_out] (a scalar knob broadcast over channels)
    active: jax.Array            # 1 for real steps, 0 for padding  [S]
    window_gates: jax.Array | None = None   # γ^{(t)}: step t's weight of each window position,
                                            # oldest first  [S, c]; None = all ones
    restart: jax.Array | None = None        # 1 where the memory restarts from its initial state
                                            # before the step (a new packed document)  [S]; None = never


def restarted(carry, initial, restart):
    """``carry``, or the ``initial`` state (θ_0, the optimizer's first state, an empty window)
    where the scalar ``restart`` is set."""
    return jax.tree.map(lambda c, i: jnp.where(restart > 0, i, c), carry, initial)


def restarting_chunks(one_chunk, initial, steps_of=lambda xs: xs):
    """A chunk-scan body that starts a chunk from ``initial`` where its first step restarts. The
    chunk-start forms restart only at chunk boundaries: a chunk with a restart inside gives NaN
    outputs (loud, not wrong). ``steps_of`` finds the chunk's Steps in the scanned ``xs``."""
    def body(carry, xs):
        xc = steps_of(xs)
        if xc.restart is None:
            return one_chunk(carry, xs)
        new_state, outputs = one_chunk(restarted(carry, initial, xc.restart[0]), xs)
        inside = jnp.any(xc.restart[1:] > 0)
        return new_state, jnp.where(inside, jnp.nan, outputs)
    return body


class Features:
    """φ with its (outer-loop) parameters, for a form that applies φ itself.

    The chunked form takes Steps whose ``inputs`` / ``queries`` are the raw k and scale·q when it is
    given one of these: the dual form then forms φ chunk by chunk inside its rematerialised chunk
    (no [T, d_φ] array is kept for the backward pass), and ``gram`` gives φ(x)·φ(y)ᵀ from x·yᵀ
    through the map's kernel where it has one. Not a pytree: close over it.
    """

    def __init__(self, feature_map, params):
        self.feature_map, self.params = feature_map, params

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.feature_map.apply(self.params, x)

    def as_dtype(self, x: jax.Array, dtype, width: int | None = None) -> jax.Array:
        """φ(x) rounded to ``dtype``, zero features up to ``width`` (`FeatureMap.apply_as`)."""
        return self.feature_map.apply_as(self.params, x, dtype, width)

    def output_dim(self, d: int) -> int:
        return self.feature_map.output_dim(d)

    @property
    def has_kernel(self) -> bool:
        return self.feature_map.has_kernel

    def gram(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """φ(x) φ(y)ᵀ [n, m] from raw rows x [n, d], y [m, d] (only where ``has_kernel``)."""
        return self.feature_map.kernel(self.params, x @ y.T)


class WindowCache(NamedTuple):
    """The last c − 1 steps, so the Omega window spans piece and chunk boundaries."""

    inputs: jax.Array    # [c-1, d_in]
    targets: jax.Array   # [c-1, d_out]
    weights: jax.Array   # [c-1]  γ_i of each cached step (1 with per-position γ), 0 for empty slots
    delta: jax.Array     # [c-1, d_out]


class MemoryState(NamedTuple):
    """Everything a memory carries between tokens (leaves have leading [B, H] in the public API).

    params:      θ, what the memory reads with;
    opt_state:   the inner optimizer's state (momentum, least-squares statistics, adam moments, …);
    accumulator: A of the retention (θ = map(A)); None when the map is the identity;
    window:      the Omega window's cache, None when c = 1.
    """

    params: Any
    opt_state: Any
    accumulator: Any
    window: WindowCache | None


def window_gradient(memory, objective, params, inputs, targets, weights, delta):
    """∇_θ Σ_i w_i ℓ(M_θ(x_i), y_i) through one VJP of the memory (inputs [n, d_in])."""
    preds, pullback = jax.vjp(lambda p: memory.apply(p, inputs), params)
    knob = delta   # [n, d_out]
    cotangent = weights[:, None] * objective.output_grad(preds, targets, knob)
    (grads,) = pullback(cotangent.astype(preds.dtype))
    return grads


def optimizer_extra_args(steps: Steps, inputs, targets, weights, sq_norm, scalar_decay: bool) -> dict:
    """The keyword-only extra args every inner optimizer update receives (see optimizers.py).

    ``steps`` holds one step's knobs or a chunk's (then every value has a leading step axis);
    ``scalar_decay`` says whether the log-decay is a scalar per step (least squares reads α_t).
    Channel-wise β / ν stay vectors here; ``channel_extra_args`` turns one step's into trees.
    """
    extra = {"input_sq_norm": sq_norm, "inputs": inputs, "targets": targets, "weights": weights}
    if steps.step_size is not None:
        extra["step_size"] = steps.step_size
    if steps.momentum_decay is not None:
        extra["momentum_decay"] = steps.momentum_decay
    if steps.log_decay is not None and scalar_decay:
        extra["decay"] = jnp.exp(steps.log_decay)
    return extra


def channel_tree(vector: jax.Array, like, channel_axes: dict, lead: int = 0):
    """A [*lead, d] channel vector as a tree shaped to broadcast against ``like``'s leaves, each
    along its channel axis (leaves of ``like`` carry ``lead`` leading axes of their own)."""
    def one(key, leaf):
        shape = [1] * leaf.ndim
        shape[:lead] = vector.shape[:lead]
        shape[lead + channel_axes[key]] = vector.shape[-1]
        return jnp.reshape(vector, shape)
    return {key: one(key, leaf) for key, leaf in like.items()}


def channel_extra_args(extra: dict, params, channel_axes) -> dict:
    """One step's extra args with channel-wise β_t / ν_t ([d] vectors) as per-leaf trees, the
    form the optimizers' ``scale_tree`` takes."""
    out = dict(extra)
    for key in ("step_size", "momentum_decay"):
        if key in out and jnp.ndim(out[key]) == 1:
            out[key] = channel_tree(out[key], params, channel_axes)
    return out


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def segsum(log_factors: jax.Array) -> jax.Array:
    """S[t, i] = Σ_{j=i+1..t} a_j for i ≤ t and −inf above the diagonal (over axis 0).

    Built from masked per-segment sums rather than differences of one cumsum, so no cancellation;
    feeding it to exp gives the decay matrix with the mask applied *before* exp.
    ``log_factors``: [b] or [b, C] (channel-wise).
    """
    b = log_factors.shape[0]
    x = jnp.broadcast_to(log_factors[:, None], (b, b) + log_factors.shape[1:])   # x[t, i] = a_t
    strictly_lower = jnp.tril(jnp.ones((b, b), bool), -1)
    lower = jnp.tril(jnp.ones((b, b), bool), 0)
    expand = (...,) + (None,) * (log_factors.ndim - 1)
    x = jnp.where(strictly_lower[expand], x, 0.0)
    sums = jnp.cumsum(x, axis=0)
    return jnp.where(lower[expand], sums, -jnp.inf)


def decay_matrix(log_factors: jax.Array) -> jax.Array:
    """L[t, i] = Π_{j=i+1..t} exp(a_j) for i ≤ t, else 0 (see ``segsum``)."""
    return jnp.exp(segsum(log_factors))


def safe_log(x: jax.Array) -> jax.Array:
    # A factor of exactly 0 (ν = 0: plain GD) must give a finite log and a finite gradient.
    return jnp.log(jnp.maximum(x, 1e-30))
