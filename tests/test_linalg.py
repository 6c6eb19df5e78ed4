"""The matmul-only unit lower-triangular solve that the XLA chunk forms use (atlas_jax.linalg)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import solve_triangular

from atlas_jax.linalg import solve_unit_lower, unit_lower_inverse


def wy_system(seed, n, batch=(3, 2), k_dim=8, m=5):
    """A delta-rule WY system: strictly lower beta K K^T (unit keys), random right-hand sides."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(batch + (n, k_dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = 1 / (1 + np.exp(-rng.standard_normal(batch + (n, 1))))
    a = beta * (k @ np.swapaxes(k, -1, -2))
    a += np.triu(rng.standard_normal(a.shape))      # diagonal and upper part must be ignored
    b = rng.standard_normal(batch + (n, m))
    return a.astype(np.float32), b.astype(np.float32)


@pytest.mark.parametrize("n", [1, 2, 7, 16, 37, 64])
def test_matches_float64_solve(n):
    """Within 1e-6 relative of a float64 solve, like LAPACK trsm in float32 (~1e-7 here)."""
    a, b = wy_system(n, n)
    x = solve_unit_lower(jnp.asarray(a), jnp.asarray(b))
    lower = np.tril(a.astype(np.float64), -1) + np.eye(n)
    want = np.linalg.solve(lower, b.astype(np.float64))
    err = np.linalg.norm(np.asarray(x, np.float64) - want) / np.linalg.norm(want)
    assert x.shape == b.shape and x.dtype == jnp.float32
    assert err < 1e-6, err
    inv = np.asarray(unit_lower_inverse(jnp.asarray(a)), np.float64)
    assert np.abs(np.triu(inv, 1)).max() == 0.0 and np.all(np.diagonal(inv, 0, -2, -1) == 1.0)


def test_gradients_match_trsm():
    a, b = wy_system(5, 23, batch=(2,))
    a, b = jnp.asarray(a), jnp.asarray(b)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(b.shape), jnp.float32)

    def loss(solve):
        return lambda a, b: jnp.sum(solve(a, b) * w)

    def trsm(a, b):
        unit = jnp.tril(a, -1) + jnp.eye(a.shape[-1])
        return solve_triangular(unit, b, lower=True, unit_diagonal=True)

    got = jax.grad(loss(solve_unit_lower), argnums=(0, 1))(a, b)
    want = jax.grad(loss(trsm), argnums=(0, 1))(a, b)
    for g, h in zip(got, want):
        g = jnp.tril(g, -1) if g.shape == a.shape else g    # only the strict lower part is used
        h = jnp.tril(h, -1) if h.shape == a.shape else h
        assert float(jnp.linalg.norm(g - h) / jnp.linalg.norm(h)) < 1e-5


def test_rejects_non_square():
    with pytest.raises(ValueError, match="square"):
        unit_lower_inverse(jnp.zeros((3, 4)))
