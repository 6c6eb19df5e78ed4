"""Axis 4 — retention: how θ forgets, kept apart from the optimizer so the two compose freely.

Every retention here has the same two-part shape,

    A_t = α_t ⊙ A_{t−1} + u_t          (decay: none | scalar α_t | channel α_t ∈ ℝ^{d_in})
    θ_t = map(A_t)                      (identity | ℓq normalisation | softmax | soft threshold)

where u_t are the inner optimizer's updates and α_t = exp(g_t). With the identity map A is θ
itself (linear attention … KDA, Titans, ATLAS).

Where the inner gradient is taken is part of retention too, and the models differ on it:

* forget, then write (default): ∇ℓ at the decayed α_t ⊙ θ_{t−1}. This is the linearised
  minimiser of ℓ(θ) + 1/(2η)‖θ − α_t θ_{t−1}‖² (retention as a regulariser toward the decayed
  past, MIRAS), and exactly Mamba2 / GLA / Gated DeltaNet / KDA / RWKV-7 (S ← αS, then the delta
  write reads the decayed S — the flash-linear-attention semantics);
* ``decoupled=True``: ∇ℓ at θ_{t−1}, then θ_t = α_t θ_{t−1} + u_t — decoupled weight decay, as
  Titans, ATLAS and the MIRAS variants (Moneta, Yaad, Memora) write their updates.

The two coincide for the dot objective (its gradient does not depend on θ) and without decay.

The non-identity maps are MIRAS's retention gates:

* ``lq``: Moneta, A_t = α_t A_{t−1} − η∇ℓ, θ_t = A_t / ‖A_t‖_q^{q−2};
* ``kl``: Memora, θ_t = Softmax(α_t log θ_{t−1} − η∇ℓ). Softmax ignores constant shifts, so
  A = log θ up to a constant is an *exact* linear recurrence and θ = c·softmax(A);
* ``elastic_net``: MIRAS's soft-thresholding form, θ_t = S_γ(A_t), with the smooth
  S_γ(z) ≈ |z| · arctan(z/γ) / (π/2) (or the exact shrinkage with ``smooth=False``).

Because the decay is linear in A, the chunked form can run any of them as in-chunk linear
recurrences. Where the map applies in the chunked form is ``map_at``:

* ``"token"``: θ_t = map(A_t) for every token (the recurrence itself, at any chunk size);
* ``"chunk_end"`` (MIRAS §5 "Parallelizable Training", the moneta and memora presets): inside a
  chunk the memory moves linearly, θ_t = P_t θ₀ + Σ_{i≤t} (P_t/P_i) u_i with θ₀ the chunk's
  starting memory, and the map is applied at the chunk's end, θ_end = map(A_end), with A carried
  across chunks as in the recurrence. This keeps every in-chunk read linear in the updates (what
  the dual form needs: MIRAS "we do not apply this non-linearity inside each chunk and instead use
  it at the end of each chunk"). At chunk size 1 both are the per-token recurrence; the recurrent
  form always maps per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = ["Retention", "none", "scalar", "channel", "lq", "kl", "elastic_net", "decay_tree",
           "get_retention"]

_DECAYS = ("none", "scalar", "channel")
MAP_SCHEDULES = ("token", "chunk_end")


@dataclass(frozen=True)
class Retention:
    """Identity-map retention with the given decay (the base of all others).

    ``log_decay``: a constant g (RetNet / Lightning attention); None means g comes per token.
    ``decoupled``: take the inner gradient at θ_{t−1} instead of at the decayed α_t ⊙ θ_{t−1}.
    """

    decay: str = "none"
    log_decay: float | None = None
    decoupled: bool = False
    map_at: str = "token"
    name = "retention"

    def __post_init__(self):
        if self.decay not in _DECAYS:
            raise ValueError(f"retention: decay must be one of {_DECAYS}, got {self.decay!r}")
        if self.map_at not in MAP_SCHEDULES:
            raise ValueError(f"retention: map_at must be one of {MAP_SCHEDULES}, got {self.map_at!r}")
        if self.map_at != "token" and not self.has_map:
            raise ValueError("retention: map_at only applies to a retention with a map (lq, kl, elastic_net)")
        if self.log_decay is not None:
            if self.decay != "scalar":
                raise ValueError("retention: a constant log_decay is only meaningful with decay='scalar'")
            if not self.log_decay <= 0:
                raise ValueError(f"retention: log_decay must be <= 0 (α = exp(g) ≤ 1), got {self.log_decay!r}")

    has_map = False

    @property
    def needs_gate(self) -> bool:
        """True when the per-token log-decay g must be supplied."""
        return self.decay != "none" and self.log_decay is None

    def map(self, acc):
        return acc

    def inverse_map(self, params):
        return params

    def describe_decay(self) -> str:
        if self.decay == "none":
            return "none"
        if self.log_decay is not None:
            text = f"constant scalar α={math.exp(self.log_decay):.4g}"
        else:
            text = "scalar α_t" if self.decay == "scalar" else "channel α_t"
        return text + (" (decoupled)" if self.decoupled else "")

    def describe(self) -> str:
        return self.describe_decay()

    def describe_map_at(self) -> str:
        return ", map at chunk ends" if self.map_at == "chunk_end" else ""


def none() -> Retention:
    return Retention("none")


def scalar(log_decay: float | None = None, decoupled: bool = False) -> Retention:
    """Scalar α_t = exp(g_t) (Mamba2, GDN; decoupled: Titans, ATLAS); constant if ``log_decay`` given."""
    return Retention("scalar", log_decay, decoupled)


def channel(decoupled: bool = False) -> Retention:
    """Channel-wise α_t ∈ ℝ^{d_in} (GLA, KDA, RWKV-7): decays each input-feature row of θ."""
    return Retention("channel", decoupled=decoupled)


@dataclass(frozen=True)
class LqRetention(Retention):
    q: float = 4.0
    eps: float = 1e-6
    has_map = True

    def __post_init__(self):
        super().__post_init__()
        if not self.q > 2 or self.q == 3:
            # q = 3 makes ‖θ‖_q ≡ 1 (not invertible); q ≤ 2 is plain ℓ2 retention.
            raise ValueError(f"lq retention: q must be > 2 and != 3, got {self.q!r}")

    def _norm(self, x):
        return jnp.maximum(jnp.sum(jnp.abs(x) ** self.q) ** (1.0 / self.q), self.eps)

    def map(self, acc):
        return jax.tree.map(lambda a: a / self._norm(a) ** (self.q - 2), acc)

    def inverse_map(self, params):
        # ‖θ‖ = ‖A‖^{3−q}  ⇒  A = θ · ‖θ‖^{(q−2)/(3−q)}.
        return jax.tree.map(lambda w: w * self._norm(w) ** ((self.q - 2) / (3 - self.q)), params)

    def describe(self):
        return f"ℓ{self.q:g} normalisation + {self.describe_decay()}{self.describe_map_at()}"


@dataclass(frozen=True)
class KLRetention(Retention):
    scale: float = 1.0
    axis: int = -1
    has_map = True

    def map(self, acc):
        return jax.tree.map(lambda a: self.scale * jax.nn.softmax(a, axis=self.axis), acc)

    def inverse_map(self, params):
        return jax.tree.map(lambda w: jnp.log(jnp.maximum(w / self.scale, 1e-30)), params)

    def describe(self):
        return f"KL (softmax) + {self.describe_decay()}{self.describe_map_at()}"


@dataclass(frozen=True)
class ElasticNetRetention(Retention):
    threshold: float = 1e-2
    smooth: bool = True
    has_map = True

    def __post_init__(self):
        super().__post_init__()
        if not self.threshold > 0:
            raise ValueError(f"elastic_net retention: threshold must be > 0, got {self.threshold!r}")

    def map(self, acc):
        if self.smooth:
            return jax.tree.map(lambda a: jnp.abs(a) * jnp.arctan(a / self.threshold) / (math.pi / 2), acc)
        return jax.tree.map(lambda a: jnp.sign(a) * jnp.maximum(jnp.abs(a) - self.threshold, 0.0), acc)

    def inverse_map(self, params):
        # Not invertible in closed form; θ itself is a fine accumulator start (the map ≈ identity
        # away from the threshold).
        return params

    def describe(self):
        return (f"elastic net ({'smooth ' if self.smooth else ''}soft-threshold) + {self.describe_decay()}"
                f"{self.describe_map_at()}")


# MIRAS writes its variants with the gradient at θ_{t−1}, hence decoupled by default.
def lq(q: float = 4.0, decay: str = "scalar", decoupled: bool = True, map_at: str = "token") -> Retention:
    return LqRetention(decay=decay, decoupled=decoupled, map_at=map_at, q=q)


def kl(scale: float = 1.0, axis: int = -1, decay: str = "scalar", decoupled: bool = True,
       map_at: str = "token") -> Retention:
    return KLRetention(decay=decay, decoupled=decoupled, map_at=map_at, scale=scale, axis=axis)


def elastic_net(threshold: float = 1e-2, smooth: bool = True, decay: str = "scalar",
                decoupled: bool = True, map_at: str = "token") -> Retention:
    return ElasticNetRetention(decay=decay, decoupled=decoupled, map_at=map_at, threshold=threshold,
                               smooth=smooth)


def decay_tree(tree, factor, kind: str, channel_axes=None):
    """α ⊙ tree: ``factor`` is a scalar (kind 'scalar') or a [d] vector along each leaf's channel
    axis (kind 'channel', ``channel_axes`` from the memory)."""
    if kind == "none":
        return tree
    if kind == "scalar":
        return jax.tree.map(lambda x: factor * x, tree)

    def per_leaf(path_key, x):
        axis = channel_axes[path_key]
        shape = [1] * x.ndim
        shape[axis] = x.shape[axis]
        return jnp.reshape(factor, shape) * x

    return {key: per_leaf(key, value) for key, value in tree.items()}


_RETENTIONS = {"none": none, "scalar": scalar, "channel": channel, "lq": lq, "kl": kl,
               "elastic_net": elastic_net}


def get_retention(name: str, **kwargs) -> Retention:
    """Retention by name (none, scalar, channel, lq, kl, elastic_net)."""
    if name not in _RETENTIONS:
        raise ValueError(f"retention: unknown name {name!r}; choose one of {sorted(_RETENTIONS)}")
    return _RETENTIONS[name](**kwargs)
