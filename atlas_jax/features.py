"""Axis 1b — feature maps φ applied to keys and queries before the memory reads or writes.

Every map is a small frozen dataclass with
  * ``output_dim(d)``: the width of φ(x) for x ∈ ℝ^d,
  * ``init_params()``: its (outer-loop) parameters, an empty dict when it has none,
  * ``apply(params, x)``: φ(x) on the last axis of x,
  * ``kernel(params, s)``: ⟨φ(x), φ(y)⟩ from s = x·y, for the maps whose kernel is a function of
    the dot product (``has_kernel``): identity, polynomial, exp-Taylor. The chunked dual form
    computes φ(q)·φ(k)ᵀ Gram matrices through it from q·kᵀ (d wide rather than d_φ).

The polynomial maps use the *symmetric* tensor power: for degree i the block holds every monomial
x_{j1}…x_{ji} (j1 ≤ … ≤ ji) once, weighted by √(multinomial), so that
⟨sym_i(x), sym_i(y)⟩ = (x·y)^i exactly with C(d+i−1, i) features instead of d^i. The whole map of
degree ≤ p therefore has C(d+p, p) features, the effective key width of ATLAS Proposition 2.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FeatureMap", "Identity", "EluPlusOne", "Polynomial", "ExpTaylor", "get_feature_map"]


class FeatureMap:
    """Base class: identity-like defaults."""

    name = "feature_map"
    has_kernel = False   # whether ``kernel`` gives ⟨φ(x), φ(y)⟩ from x·y

    def output_dim(self, d: int) -> int:
        return d

    def init_params(self) -> dict:
        return {}

    def apply(self, params: dict, x: jax.Array) -> jax.Array:
        raise NotImplementedError

    def apply_as(self, params: dict, x: jax.Array, dtype, width: int | None = None) -> jax.Array:
        """``apply`` rounded to ``dtype`` and followed by zero features up to ``width`` (default:
        none); a map may form it in one pass whose backward reads the cotangent in ``dtype``
        (Polynomial of degree 2)."""
        y = self.apply(params, x).astype(dtype)
        if width is None:
            return y
        _check_feature_width(self.describe(), width, y.shape[-1])
        return pad_features(y, width)

    def kernel(self, params: dict, s: jax.Array) -> jax.Array:
        """⟨φ(x), φ(y)⟩ as a function of s = x·y (elementwise over s); only where ``has_kernel``."""
        raise NotImplementedError(f"the {self.describe()} feature map's kernel is not a function of x·y")

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class Identity(FeatureMap):
    name = "identity"
    has_kernel = True

    def apply(self, params, x):
        return x

    def kernel(self, params, s):
        return s


@dataclass(frozen=True)
class EluPlusOne(FeatureMap):
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive features, same width."""

    name = "elu+1"

    def apply(self, params, x):
        return jax.nn.elu(x) + 1.0


@lru_cache(maxsize=None)
def _symmetric_power_table(d: int, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Index tuples and √multinomial weights of the degree-`degree` symmetric power of ℝ^d."""
    combos = list(itertools.combinations_with_replacement(range(d), degree))
    index = np.asarray(combos, dtype=np.int32).reshape(len(combos), degree)
    weights = np.empty(len(combos), dtype=np.float64)
    for row, combo in enumerate(combos):
        counts = np.bincount(np.asarray(combo), minlength=d)
        multinomial = math.factorial(degree) / np.prod([math.factorial(int(c)) for c in counts])
        weights[row] = math.sqrt(multinomial)
    return index, weights.astype(np.float32)


def symmetric_power(x: jax.Array, degree: int) -> jax.Array:
    """sym_i(x) with ⟨sym_i(x), sym_i(y)⟩ = (x·y)^i; degree 0 is the constant feature 1."""
    if degree == 0:
        return jnp.ones(x.shape[:-1] + (1,), x.dtype)
    if degree == 2:
        return _symmetric_square(x)
    index, weights = _symmetric_power_table(x.shape[-1], degree)
    monomials = jnp.prod(x[..., index], axis=-1)  # [..., n_monomials]
    return monomials * jnp.asarray(weights, x.dtype)


@lru_cache(maxsize=None)
def _pair_table(d: int) -> tuple[np.ndarray, np.ndarray]:
    """For sym_2 of ℝ^d: the monomial of every ordered pair (k, j) [d, d] and ∂(x_i x_j)/∂x_k's
    factor (2 on the diagonal, where the monomial is x_k²)."""
    index, _ = _symmetric_power_table(d, 2)
    position = np.empty((d, d), np.int32)
    position[index[:, 0], index[:, 1]] = np.arange(len(index), dtype=np.int32)
    position[index[:, 1], index[:, 0]] = np.arange(len(index), dtype=np.int32)
    return position, (1.0 + np.eye(d)).astype(np.float32)


@jax.custom_vjp
def _symmetric_square(x):
    index, weights = _symmetric_power_table(x.shape[-1], 2)
    return x[..., index[:, 0]] * x[..., index[:, 1]] * jnp.asarray(weights, x.dtype)


def _symmetric_square_fwd(x):
    return _symmetric_square(x), x


def _sym2_kernel_runs(d: int) -> bool:
    """Whether sym_2's backward and `polynomial2_features`' passes run as the GPU kernels
    (`atlas_jax.kernels.features.gpu`): on a GPU backend, for widths d that are powers of two from
    16."""
    return jax.default_backend() == "gpu" and d >= 16 and d & (d - 1) == 0


def _symmetric_square_bwd(x, cotangent):
    d = x.shape[-1]
    if _sym2_kernel_runs(d):
        from atlas_jax.kernels.features.gpu import symmetric_square_backward_gpu
        return (symmetric_square_backward_gpu(x, cotangent),)
    return (_symmetric_square_bwd_xla(x, cotangent),)


def _symmetric_square_bwd_xla(x, cotangent):
    # Autodiff's transpose of the monomials' gather is a scatter-add (each x_k collects d + 1
    # monomials; on a GPU, atomics: ~110 µs a chunk of atlas' 64 × 8 heads at d 128). Gathered
    # instead: ∂L/∂x_k = Σ_j S[k, j] x_j with S[k, j] the weighted cotangent of x_min·x_max.
    # B1 T1024 H8 D128 bf16 fwd+bwd on an H200, interleaved in one command: omeganet 42.9 ->
    # 42.2 ms, atlas 186.7 -> 182.1.
    # On a GPU the kernel replaces this (`_sym2_kernel_runs`): XLA read the cotangent here in the
    # transposed layout its producer left it in (benchmarks/results/dual_chain_h200_2026-11-28.md).
    d = x.shape[-1]
    _, weights = _symmetric_power_table(d, 2)
    position, diagonal = _pair_table(d)
    weighted = cotangent * jnp.asarray(weights, cotangent.dtype)
    pairs = weighted[..., position] * jnp.asarray(diagonal, cotangent.dtype)   # [..., d, d]
    return jnp.sum(pairs * x[..., None, :].astype(pairs.dtype), axis=-1).astype(x.dtype)


_symmetric_square.defvjp(_symmetric_square_fwd, _symmetric_square_bwd)


def pad_features(y, width: int):
    """y [..., m] followed by width − m zero features."""
    return jnp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, width - y.shape[-1])])


def _check_feature_width(name, width, features):
    if width < features:
        raise ValueError(f"apply_as: argument `width` = {width} is narrower than the {name} map's "
                         f"{features} features; pass at least {features} (zero features are appended, "
                         "none dropped).")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def polynomial2_features(x, coeffs, width, dtype):
    """φ(x) of the degree-2 polynomial map, [c₀, c₁ x, c₂ sym_2(x)], followed by zero features up to
    ``width`` and returned in ``dtype`` (bf16 where only bf16 products read it: the dual form's φ
    rows, `atlas_jax.forms.dual`). On a GPU both passes are kernels
    (`atlas_jax.kernels.features.gpu`): the forward writes the rows in one pass (XLA formed them as a
    gather of two inputs per feature, then joined and padded the blocks), and the backward reads
    the cotangent in ``dtype`` once, in place, forming ∂L/∂x and c₂'s gradient together."""
    d = x.shape[-1]
    _check_feature_width("polynomial(p=2)", width, 1 + d + d * (d + 1) // 2)
    if _sym2_kernel_runs(d):
        from atlas_jax.kernels.features.gpu import polynomial2_features_gpu
        return polynomial2_features_gpu(x, coeffs, width, dtype)
    blocks = [coeffs[i].astype(x.dtype) * symmetric_power(x, i) for i in range(3)]
    out = jnp.concatenate(blocks, axis=-1).astype(dtype)
    return pad_features(out, width)


def _polynomial2_features_fwd(x, coeffs, width, dtype):
    return polynomial2_features(x, coeffs, width, dtype), (x, coeffs)


def _polynomial2_features_bwd(width, dtype, residuals, cotangent):
    x, coeffs = residuals
    d = x.shape[-1]
    f32 = jnp.float32
    c = coeffs.astype(f32)
    linear = cotangent[..., 1:1 + d].astype(f32)
    if _sym2_kernel_runs(d):
        from atlas_jax.kernels.features.gpu import symmetric_square_backward_gpu
        dx_sym, d_c2 = symmetric_square_backward_gpu(x, cotangent, c[2], with_scale_grad=True, column_offset=1 + d)
    else:
        g = cotangent[..., 1 + d:1 + d + d * (d + 1) // 2].astype(f32)
        x32 = x.astype(f32)
        dx_sym = c[2] * _symmetric_square_bwd_xla(x32, g)
        d_c2 = jnp.sum(g * _symmetric_square(x32))
    dx = c[1] * linear + dx_sym.astype(f32)
    d_coeffs = jnp.stack([jnp.sum(cotangent[..., 0].astype(f32)), jnp.sum(linear * x.astype(f32)), d_c2])
    return dx.astype(x.dtype), d_coeffs.astype(coeffs.dtype)


polynomial2_features.defvjp(_polynomial2_features_fwd, _polynomial2_features_bwd)


def _power(s: jax.Array, i: int) -> jax.Array:
    """s^i by repeated products (s^0 = 1 also where s = 0, and a finite gradient there)."""
    out = jnp.ones_like(s)
    for _ in range(i):
        out = out * s
    return out


def _check_degree(name: str, degree) -> None:
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
        raise ValueError(f"{name}: degree must be an int >= 1, got {degree!r}")
    if degree > 6:
        raise ValueError(f"{name}: degree {degree} makes C(d+p, p) features explode; use degree <= 6")


@dataclass(frozen=True)
class Polynomial(FeatureMap):
    """φ_p(x) = [c_0, c_1 x, c_2 sym_2(x), …, c_p sym_p(x)] with learnable c_i.

    The coefficients gate whole degree blocks (ATLAS §3.1, "input feature gating": c_i = 0 drops
    x^{⊗i}); the induced kernel is ⟨φ(x), φ(y)⟩ = Σ_i a_i (x·y)^i with a_i = c_i². ATLAS
    initialises a_i = 1/i! so that the kernel starts as the Taylor series of exp (1 + s + s²/2 +
    …); the feature weights therefore start at c_i = 1/√(i!) (weights 1/i! on the features would
    give 1 + s + s²/4).
    """

    degree: int = 2
    name = "polynomial"

    def __post_init__(self):
        _check_degree("Polynomial", self.degree)

    def output_dim(self, d: int) -> int:
        return math.comb(d + self.degree, self.degree)

    def init_params(self) -> dict:
        return {"coeffs": jnp.asarray([1.0 / math.sqrt(math.factorial(i)) for i in range(self.degree + 1)],
                                      jnp.float32)}

    has_kernel = True

    def apply(self, params, x):
        coeffs = params["coeffs"] if params else self.init_params()["coeffs"]
        blocks = [coeffs[i].astype(x.dtype) * symmetric_power(x, i) for i in range(self.degree + 1)]
        return jnp.concatenate(blocks, axis=-1)

    def apply_as(self, params, x, dtype, width=None):
        if self.degree != 2:
            return super().apply_as(params, x, dtype, width)
        coeffs = params["coeffs"] if params else self.init_params()["coeffs"]
        return polynomial2_features(x, coeffs, width or self.output_dim(x.shape[-1]), dtype)

    def kernel(self, params, s):
        # Block i contributes c_i² ⟨sym_i(x), sym_i(y)⟩ = c_i² (x·y)^i (the constant block: c_0²).
        coeffs = (params["coeffs"] if params else self.init_params()["coeffs"]).astype(s.dtype)
        return sum(jnp.square(coeffs[i]) * _power(s, i) for i in range(self.degree + 1))

    def describe(self) -> str:
        return f"polynomial(p={self.degree})"


@dataclass(frozen=True)
class ExpTaylor(FeatureMap):
    """Order-p Taylor feature map of exp: ⟨φ(x), φ(y)⟩ = Σ_{i≤p} (x·y)^i / i! → exp(x·y).

    Fixed coefficients 1/√(i!); the p → ∞ limit is the exponential kernel of softmax attention
    (ATLAS §4.2, DeepTransformers).
    """

    order: int = 2
    name = "exp_taylor"

    def __post_init__(self):
        _check_degree("ExpTaylor", self.order)

    def output_dim(self, d: int) -> int:
        return math.comb(d + self.order, self.order)

    has_kernel = True

    def apply(self, params, x):
        blocks = [symmetric_power(x, i) / math.sqrt(math.factorial(i)) for i in range(self.order + 1)]
        return jnp.concatenate(blocks, axis=-1)

    def kernel(self, params, s):
        return sum(_power(s, i) / math.factorial(i) for i in range(self.order + 1))

    def describe(self) -> str:
        return f"exp-taylor(p={self.order})"


_FEATURE_MAPS = {"identity": Identity, "elu+1": EluPlusOne, "elu_plus_one": EluPlusOne,
                 "polynomial": Polynomial, "exp_taylor": ExpTaylor}


def get_feature_map(name: str, **kwargs) -> FeatureMap:
    """Feature map by name (identity, elu+1, polynomial, exp_taylor)."""
    if name not in _FEATURE_MAPS:
        raise ValueError(f"feature_map: unknown name {name!r}; choose one of {sorted(_FEATURE_MAPS)}")
    return _FEATURE_MAPS[name](**kwargs)
