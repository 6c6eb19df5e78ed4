"""Axis 2 — inner objectives ℓ(θ; k, v) ("attentional bias", MIRAS).

An objective is defined by what the inner optimizer needs: the gradient of ℓ with respect to the
memory's prediction, ``output_grad(pred, target, delta)`` = ∂ℓ/∂M(k). The core back-propagates it
through the memory (a VJP) to get ∇_θ ℓ. Defining objectives by that gradient is what lets MIRAS's
smoothed updates (sign ≈ tanh(α·), |x| ≈ √(x²+ε)) be used exactly as the paper writes them, while
``value`` reports the loss itself.

``delta`` is the per-token objective knob (Huber threshold δ_t, robust radius Δ_t); an objective
that has none ignores it. The Omega window (ATLAS) is not an objective of its own: it is the
``window`` of a MemorySpec, which sums any of these objectives over the last c tokens with
per-token gates γ_i.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = ["Objective", "Dot", "L2", "Lp", "Huber", "RobustL2", "smooth_sign", "smooth_abs",
           "get_objective"]


def smooth_sign(x: jax.Array, sharpness: float) -> jax.Array:
    """MIRAS's differentiable sign: tanh(α x)."""
    return jnp.tanh(sharpness * x)


def smooth_abs(x: jax.Array, eps: float) -> jax.Array:
    """MIRAS's differentiable |x|: √(x² + ε)."""
    return jnp.sqrt(jnp.square(x) + eps)


def _norm(x: jax.Array, eps: float) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


class Objective:
    name = "objective"
    uses_delta = False

    def output_grad(self, pred, target, delta=None):
        raise NotImplementedError

    def value(self, pred, target, delta=None):
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class Dot(Objective):
    """ℓ = −⟨M(k), v⟩ (Hebbian): one GD step gives linear attention."""

    name = "dot"

    def output_grad(self, pred, target, delta=None):
        return -target.astype(pred.dtype)

    def value(self, pred, target, delta=None):
        return -jnp.sum(pred * target, axis=-1)


@dataclass(frozen=True)
class L2(Objective):
    """ℓ = ½‖v − M(k)‖² (delta rule)."""

    name = "l2"

    def output_grad(self, pred, target, delta=None):
        return pred - target

    def value(self, pred, target, delta=None):
        return 0.5 * jnp.sum(jnp.square(pred - target), axis=-1)


@dataclass(frozen=True)
class Lp(Objective):
    """ℓ = ‖M(k) − v‖_p^p (Moneta, p = 3), MIRAS's smoothed update.

    ∂ℓ/∂M = p · tanh(α e) · √(e² + ε)^{p−1}, e = M(k) − v.
    """

    p: float = 3.0
    sharpness: float = 10.0
    eps: float = 1e-6
    name = "lp"

    def __post_init__(self):
        if not self.p >= 1:
            raise ValueError(f"Lp: p must be >= 1, got {self.p!r}")

    def output_grad(self, pred, target, delta=None):
        err = pred - target
        return self.p * smooth_sign(err, self.sharpness) * smooth_abs(err, self.eps) ** (self.p - 1)

    def value(self, pred, target, delta=None):
        return jnp.sum(smooth_abs(pred - target, self.eps) ** self.p, axis=-1)

    def describe(self):
        return f"l{self.p:g}"


_HUBER_KINDS = ("coordinate", "norm", "mixture")


@dataclass(frozen=True)
class Huber(Objective):
    """The three Huber-type biases of MIRAS (threshold δ, per token via ``delta``).

    * ``coordinate``: Σ_j H_δ(e_j): ∂ = e clipped to [−δ, δ] per coordinate;
    * ``norm``: H_δ(‖e‖₂): ∂ = e if ‖e‖ ≤ δ else δ e/‖e‖;
    * ``mixture`` (Yaad): ∂ = e if ‖e‖ ≤ δ else δ · sign(e) (ℓ2 near, ℓ1 far; smooth sign).
    """

    kind: str = "mixture"
    delta: float = 1.0
    sharpness: float = 10.0
    eps: float = 1e-6
    name = "huber"
    uses_delta = True

    def __post_init__(self):
        if self.kind not in _HUBER_KINDS:
            raise ValueError(f"Huber: kind must be one of {_HUBER_KINDS}, got {self.kind!r}")
        if not self.delta > 0:
            raise ValueError(f"Huber: delta must be > 0, got {self.delta!r}")

    def _delta(self, delta, like):
        return jnp.asarray(self.delta if delta is None else delta, like.dtype)

    def output_grad(self, pred, target, delta=None):
        err = pred - target
        d = self._delta(delta, err)
        if self.kind == "coordinate":
            return jnp.clip(err, -d, d)
        norm = _norm(err, self.eps)
        near = norm <= d
        if self.kind == "norm":
            return jnp.where(near, err, d * err / norm)
        return jnp.where(near, err, d * smooth_sign(err, self.sharpness))

    def value(self, pred, target, delta=None):
        err = pred - target
        d = self._delta(delta, err)
        if self.kind == "coordinate":
            a = jnp.abs(err)
            return jnp.sum(jnp.where(a <= d, 0.5 * err ** 2, d * (a - 0.5 * d)), axis=-1)
        norm = _norm(err, self.eps)[..., 0]
        if self.kind == "norm":
            return jnp.where(norm <= d, 0.5 * norm ** 2, d * (norm - 0.5 * d))
        l1 = jnp.sum(smooth_abs(err, self.eps), axis=-1)
        return jnp.where(norm <= d, 0.5 * norm ** 2, d * l1)

    def describe(self):
        return f"huber({self.kind})"


@dataclass(frozen=True)
class RobustL2(Objective):
    """Worst case of ½‖M(k) − (v + δv)‖² over ‖δv‖ ≤ Δ (MIRAS "robust to value shifts").

    Closed form ½‖e‖² + Δ‖e‖ + ½Δ², so ∂ = e + Δ e/‖e‖ (‖e‖ smoothed by ε).
    """

    radius: float = 0.1
    eps: float = 1e-6
    name = "robust_l2"
    uses_delta = True

    def __post_init__(self):
        if not self.radius >= 0:
            raise ValueError(f"RobustL2: radius must be >= 0, got {self.radius!r}")

    def output_grad(self, pred, target, delta=None):
        err = pred - target
        radius = jnp.asarray(self.radius if delta is None else delta, err.dtype)
        return err + radius * err / _norm(err, self.eps)

    def value(self, pred, target, delta=None):
        err = pred - target
        radius = jnp.asarray(self.radius if delta is None else delta, err.dtype)
        norm = _norm(err, self.eps)[..., 0]
        return 0.5 * norm ** 2 + radius * norm + 0.5 * radius ** 2

    def describe(self):
        return "robust l2 (Δ)"


_OBJECTIVES = {"dot": Dot, "l2": L2, "lp": Lp, "huber": Huber, "robust_l2": RobustL2}


def get_objective(name: str, **kwargs) -> Objective:
    """Objective by name (dot, l2, lp, huber, robust_l2)."""
    if name not in _OBJECTIVES:
        raise ValueError(f"objective: unknown name {name!r}; choose one of {sorted(_OBJECTIVES)}")
    return _OBJECTIVES[name](**kwargs)
