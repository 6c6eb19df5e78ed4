"""Axis 1 — memory architectures M_θ.

A memory is a frozen dataclass with
  * ``init(key, d_in, d_out)``: θ_0, a dict of float32 arrays,
  * ``apply(params, x)``: M_θ(x) for x of shape [..., d_in] (one vector or a batch of them),
  * ``channel_axes(params)``: for channel-wise knobs (retention α_t, step β_t, momentum decay ν_t
    in ℝ^d), the axis of every leaf that indexes a channel, or None when the architecture has no
    such axis of one common size in every leaf; ``channel_dim(params)`` is that size,
  * ``describe()``: a short human-readable form for the preset table.

Matrices act on the right (x @ W), so the linear memory's θ = {"S": S} with S ∈ ℝ^{d_in × d_out} is
exactly flash-linear-attention's K×V state (S = Wᵀ of the papers' θ).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = ["MemoryArch", "LinearMemory", "MLPMemory", "GatedMLPMemory", "get_memory", "ACTIVATIONS"]

ACTIVATIONS = {
    # The exact (erf) GELU of Hendrycks & Gimpel, as the papers cite it and as PyTorch's default
    # (titans-pytorch) computes it; jax.nn.gelu's default is the tanh approximation.
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "identity": lambda x: x,
}


def _layer_norm(x: jax.Array, eps: float = 1e-5) -> jax.Array:
    # Parameter-free: θ stays a set of matrices, which Newton–Schulz and channel decay expect.
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def _dense_init(key, fan_in: int, fan_out: int, scale: float) -> jax.Array:
    return scale * jax.random.normal(key, (fan_in, fan_out), jnp.float32) / jnp.sqrt(fan_in)


class MemoryArch:
    name = "memory"

    def init(self, key, d_in: int, d_out: int) -> dict:
        raise NotImplementedError

    def apply(self, params: dict, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def channel_axes(self, params: dict):
        return None

    def apply_linear(self, x: jax.Array, matmul) -> jax.Array:
        """M_θ(x) with every weight product x @ θ[key] delegated to ``matmul(key, x)``.

        ``apply(params, x)`` is ``apply_linear(x, lambda key, h: h @ params[key])``. The chunked
        dual form (forms/dual.py) passes its own product, the one with θ_t = P_t θ₀ + c_t m₀ −
        Σ_i M[t, i] a_i δ_iᵀ for the batch's row t, so it needs only the memory's structure
        (activations, LayerNorm, residual) around its linear maps. Memories whose every leaf of θ
        is such a weight implement it; the others raise NotImplementedError.
        """
        raise NotImplementedError(f"{type(self).__name__} does not expose its linear layers")

    def channel_dim(self, params: dict) -> int | None:
        """The size d of the channel axis (None when channel-wise knobs do not apply)."""
        axes = self.channel_axes(params)
        if axes is None:
            return None
        return int(params[next(iter(axes))].shape[axes[next(iter(axes))]])

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class LinearMemory(MemoryArch):
    """M_θ(x) = x S: linear attention, DeltaNet, Gated DeltaNet, KDA, … (θ_0 = 0)."""

    name = "linear"

    def init(self, key, d_in, d_out):
        return {"S": jnp.zeros((d_in, d_out), jnp.float32)}

    def apply(self, params, x):
        return x @ params["S"].astype(x.dtype)

    def apply_linear(self, x, matmul):
        return matmul("S", x)

    def channel_axes(self, params):
        return {"S": 0}

    def describe(self):
        return "linear"


def _check_common(name, activation, init_scale):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
    if not init_scale > 0:
        raise ValueError(f"{name}: init_scale must be > 0, got {init_scale!r}")


@dataclass(frozen=True)
class MLPMemory(MemoryArch):
    """MLP memory of ``depth`` ≥ 2 layers (TTT-MLP, Titans, Moneta/Yaad/Memora, OmegaNet, ATLAS).

    y = W_L σ(… σ(W_1 x)); with ``layernorm`` the branch is LN(y) (parameter-free LN); with
    ``residual`` the output is x + branch (ATLAS eq. 42, MIRAS: x + LN(W_1 σ(W_2 x))). When φ makes
    d_in ≠ d_out the identity skip cannot apply, so the residual path is a linear map S (zero at
    init) that is part of θ and trained by the inner optimizer like every other weight.
    Hidden width: ``hidden`` if given, else ``expansion`` × d_out.
    """

    depth: int = 2
    hidden: int | None = None
    expansion: int = 4
    activation: str = "gelu"
    residual: bool = False
    layernorm: bool = False
    init_scale: float = 1.0
    name = "mlp"

    def __post_init__(self):
        if not isinstance(self.depth, int) or self.depth < 2:
            raise ValueError(f"MLPMemory: depth must be an int >= 2, got {self.depth!r}; "
                             "use LinearMemory for depth 1")
        if self.hidden is not None and (not isinstance(self.hidden, int) or self.hidden < 1):
            raise ValueError(f"MLPMemory: hidden must be a positive int or None, got {self.hidden!r}")
        _check_common("MLPMemory", self.activation, self.init_scale)

    def _hidden(self, d_out):
        return self.hidden if self.hidden is not None else self.expansion * d_out

    def init(self, key, d_in, d_out):
        width = self._hidden(d_out)
        dims = [d_in] + [width] * (self.depth - 1) + [d_out]
        keys = jax.random.split(key, self.depth)
        params = {f"W{i}": _dense_init(keys[i], dims[i], dims[i + 1], self.init_scale)
                  for i in range(self.depth)}
        if self.residual and d_in != d_out:
            params["skip"] = jnp.zeros((d_in, d_out), jnp.float32)
        return params

    def apply(self, params, x):
        act = ACTIVATIONS[self.activation]
        h = x
        for i in range(self.depth - 1):
            h = act(h @ params[f"W{i}"].astype(x.dtype))
        y = h @ params[f"W{self.depth - 1}"].astype(x.dtype)
        if self.layernorm:
            y = _layer_norm(y)
        if self.residual:
            y = y + (x @ params["skip"].astype(x.dtype) if "skip" in params else x)
        return y

    def apply_linear(self, x, matmul):
        # The same computation as ``apply``; whether a skip map exists is told by the input and
        # output widths (``init`` adds one exactly when d_in != d_out).
        act = ACTIVATIONS[self.activation]
        h = x
        for i in range(self.depth - 1):
            h = act(matmul(f"W{i}", h))
        y = matmul(f"W{self.depth - 1}", h)
        if self.layernorm:
            y = _layer_norm(y)
        if self.residual:
            y = y + (matmul("skip", x) if y.shape[-1] != x.shape[-1] else x)
        return y

    def channel_axes(self, params):
        # A depth-2 memory that reads and writes the same d channels: channel j owns row j of
        # W0 (how input channel j feeds the hidden layer) and column j of W1 (how the hidden layer
        # writes output channel j), so every weight has exactly one channel axis. Deeper MLPs
        # have hidden×hidden layers with none, and a skip map means d_in ≠ d_out.
        if self.depth != 2 or "skip" in params:
            return None
        return {"W0": 0, "W1": 1}

    def describe(self):
        parts = [f"MLP(depth={self.depth}, {self.activation}"]
        if self.residual:
            parts.append(", residual")
        if self.layernorm:
            parts.append(", LN")
        return "".join(parts) + ")"


@dataclass(frozen=True)
class GatedMLPMemory(MemoryArch):
    """Atlas++ (ATLAS eq. 43): M(x) = x + W_d (σ(W_g x) ⊙ W_u x), residual optional."""

    hidden: int | None = None
    expansion: int = 4
    activation: str = "silu"
    residual: bool = True
    init_scale: float = 1.0
    name = "gated_mlp"

    def __post_init__(self):
        _check_common("GatedMLPMemory", self.activation, self.init_scale)

    def init(self, key, d_in, d_out):
        width = self.hidden if self.hidden is not None else self.expansion * d_out
        kg, ku, kd = jax.random.split(key, 3)
        params = {"Wg": _dense_init(kg, d_in, width, self.init_scale),
                  "Wu": _dense_init(ku, d_in, width, self.init_scale),
                  "Wd": _dense_init(kd, width, d_out, self.init_scale)}
        if self.residual and d_in != d_out:
            params["skip"] = jnp.zeros((d_in, d_out), jnp.float32)
        return params

    def apply(self, params, x):
        act = ACTIVATIONS[self.activation]
        gate = act(x @ params["Wg"].astype(x.dtype))
        y = (gate * (x @ params["Wu"].astype(x.dtype))) @ params["Wd"].astype(x.dtype)
        if self.residual:
            y = y + (x @ params["skip"].astype(x.dtype) if "skip" in params else x)
        return y

    def apply_linear(self, x, matmul):
        act = ACTIVATIONS[self.activation]
        gate = act(matmul("Wg", x))
        y = matmul("Wd", gate * matmul("Wu", x))
        if self.residual:
            y = y + (matmul("skip", x) if y.shape[-1] != x.shape[-1] else x)
        return y

    def channel_axes(self, params):
        if "skip" in params:   # d_in ≠ d_out: no single channel size (see MLPMemory)
            return None
        return {"Wg": 0, "Wu": 0, "Wd": 1}

    def describe(self):
        return f"gated MLP({self.activation}{', residual' if self.residual else ''})"


_MEMORIES = {"linear": LinearMemory, "mlp": MLPMemory, "gated_mlp": GatedMLPMemory}


def get_memory(name: str, **kwargs) -> MemoryArch:
    """Memory architecture by name (linear, mlp, gated_mlp)."""
    if name not in _MEMORIES:
        raise ValueError(f"memory: unknown name {name!r}; choose one of {sorted(_MEMORIES)}")
    return _MEMORIES[name](**kwargs)
