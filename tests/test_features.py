"""Axis 1b, feature maps: the kernels the maps induce."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest

from atlas_jax.features import ExpTaylor, Polynomial, symmetric_power
from helpers import rel, unit

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



def test_kernel_from_the_dot_product_equals_the_features_inner_product_and_its_gradient():
    """``kernel(params, x·y)`` is ⟨φ(x), φ(y)⟩ (the dual form's Gram matrices use it), with the same
    gradient with respect to x, y and the learnable coefficients."""
    from atlas_jax.features import Identity
    x = 1.5 * unit(jax.random.normal(jax.random.PRNGKey(2), (5, 7)))
    y = unit(jax.random.normal(jax.random.PRNGKey(3), (6, 7)))
    maps = [(Identity(), {}), (Polynomial(2), {"coeffs": jnp.asarray([0.9, -0.6, 0.8])}),
            (Polynomial(3), {"coeffs": jnp.asarray([0.3, -1.2, 0.7, 0.4])}), (ExpTaylor(3), {})]
    probe = jax.random.normal(jax.random.PRNGKey(4), (5, 6))
    with jax.default_matmul_precision("highest"):   # the 1e-6 bar is float32's, not TF32's (a GPU's default)
        _kernel_and_features_agree(maps, x, y, probe)


def _kernel_and_features_agree(maps, x, y, probe):
    for fmap, params in maps:
        assert fmap.has_kernel
        got, want = (_gram_value_and_grads(gram, x, y, params, probe) for gram in (
            lambda x, y, p, fmap=fmap: fmap.kernel(p, x @ y.T),
            lambda x, y, p, fmap=fmap: fmap.apply(p, x) @ fmap.apply(p, y).T))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert rel(a, b) < 1e-6, fmap


def _gram_value_and_grads(gram, x, y, params, probe):
    """The Gram matrix and the gradients of ⟨gram, probe⟩ with respect to x, y and the map's parameters."""
    loss = lambda x, y, p: jnp.sum(gram(x, y, p) * probe)
    return jax.jit(gram)(x, y, params), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, y, params)


def test_degree_two_features_gradient_gathers_what_autodiff_scatters():
    """sym_2's backward (a gather of the cotangent into a d × d pair grid, not autodiff's scatter-add
    of the monomials' gather) equals the autodiff of the plain monomials, float32 to rounding
    (≤ 1e-6 relative: sums of d + 1 terms in another order), bf16 inputs to bf16 rounding."""
    from atlas_jax.features import _symmetric_power_table
    pullback = jax.jit(lambda f, x, g: jax.vjp(f, x)[1](g)[0], static_argnums=0)   # compiled, not op by op
    for d in (1, 2, 5, 16):
        index, weights = _symmetric_power_table(d, 2)
        plain = lambda x: jnp.prod(x[..., index], axis=-1) * jnp.asarray(weights, x.dtype)
        x = jax.random.normal(jax.random.PRNGKey(d), (3, 7, d))
        cotangent = jax.random.normal(jax.random.PRNGKey(d + 100), (3, 7, index.shape[0]))
        assert rel(symmetric_power(x, 2), plain(x)) == 0.0
        ours = pullback(lambda x: symmetric_power(x, 2), x, cotangent)
        ref = pullback(plain, x, cotangent)
        assert rel(ours, ref) < 1e-6, (d, rel(ours, ref))
        low = x.astype(jnp.bfloat16)
        ours_bf16 = pullback(lambda x: symmetric_power(x, 2), low, cotangent.astype(jnp.bfloat16))
        assert ours_bf16.dtype == jnp.bfloat16 and rel(ours_bf16.astype(jnp.float32), ref) < 2e-2


def test_polynomial_apply_as_equals_apply_rounded_and_padded_with_its_gradients():
    """`Polynomial.apply_as` (degree 2: `polynomial2_features`, one pass whose backward reads the
    cotangent in the output's dtype and forms ∂L/∂x and the coefficients' gradients together)
    equals ``apply(...).astype(dtype)`` followed by zero features up to ``width``: values to one
    rounding (float32 ≤ 1e-6 relative; bf16 ≤ 1e-2: the XLA route multiplies in x's dtype), and
    the gradients of the coefficients and of x to float32 rounding (≤ 1e-6 relative: the same
    terms summed in another order), for a bf16 cotangent too."""
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 7, 16))
    width = 1 + 16 + 16 * 17 // 2 + 7
    cotangent = jax.random.normal(jax.random.PRNGKey(4), (5, 7, width))
    fmap = Polynomial(2)
    params = {"coeffs": jnp.asarray([0.9, 1.1, 0.6])}
    pad = lambda y: jnp.pad(y, [(0, 0), (0, 0), (0, width - y.shape[-1])])
    for dtype in (jnp.float32, jnp.bfloat16):
        ours, ours_vjp = jax.vjp(lambda p, x: fmap.apply_as(p, x, dtype, width), params, x)
        want, want_vjp = jax.vjp(lambda p, x: pad(fmap.apply(p, x).astype(dtype)), params, x)
        assert ours.dtype == dtype and ours.shape == want.shape
        assert rel(ours.astype(jnp.float32), want.astype(jnp.float32)) <= (1e-6 if dtype == jnp.float32 else 1e-2)
        (d_params, d_x), (w_params, w_x) = ours_vjp(cotangent.astype(dtype)), want_vjp(cotangent.astype(dtype))
        assert rel(d_params["coeffs"], w_params["coeffs"]) <= 1e-6 and rel(d_x, w_x) <= 1e-6, dtype
    # without a width: φ's own; other degrees: apply(...).astype, padded
    assert fmap.apply_as(params, x, jnp.float32).shape[-1] == fmap.output_dim(16)
    assert rel(Polynomial(3).apply_as({}, x, jnp.float32, 1000)[..., :969], Polynomial(3).apply({}, x)) == 0.0
    for degree in (2, 3):   # a width narrower than φ is an error that names it, not a truncation
        with pytest.raises(ValueError, match="width"):
            Polynomial(degree).apply_as({}, x, jnp.float32, 100)
