"""Axis 1b, feature maps: the kernels the maps induce."""
from __future__ import annotations


import jax
import jax.numpy as jnp

from atlas_jax.features import ExpTaylor, Polynomial, symmetric_power
from helpers import unit

T = 77   # odd, and not a multiple of any chunk size used


def test_polynomial_features_have_the_stated_kernel():
    x, y = (unit(jax.random.normal(jax.random.PRNGKey(i), (9,))) for i in (0, 1))
    for degree in (1, 2, 3):
        assert abs(float(symmetric_power(x, degree) @ symmetric_power(y, degree)) - float(x @ y) ** degree) < 1e-5
    poly = Polynomial(3)
    coeffs = jnp.asarray([0.3, -1.2, 0.7, 2.0])
    kernel = poly.apply({"coeffs": coeffs}, x) @ poly.apply({"coeffs": coeffs}, y)
    assert abs(float(kernel) - sum(float(c) ** 2 * float(x @ y) ** i for i, c in enumerate(coeffs))) < 1e-5
    assert poly.output_dim(9) == poly.apply({}, x).shape[-1] == 220   # C(9+3, 3)
    taylor = ExpTaylor(6)
    assert abs(float(taylor.apply({}, x) @ taylor.apply({}, y)) - float(jnp.exp(x @ y))) < 2e-4

