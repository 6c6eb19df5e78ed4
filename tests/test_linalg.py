"""atlas_jax.linalg: the layout-keeping product, and the matmul-only unit lower-triangular solve
that the XLA chunk forms use."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import solve_triangular

from atlas_jax.linalg import gram, product, solve_unit_lower, unit_lower_inverse


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


PLAIN = {"nn": lambda x, y: x @ y, "nt": lambda x, y: x @ jnp.swapaxes(y, -1, -2),
         "tn": lambda x, y: jnp.swapaxes(x, -1, -2) @ y}


@pytest.mark.parametrize("layout", sorted(PLAIN))
def test_product_has_the_matmul_value_and_derivatives_in_every_layout(layout):
    """`product` (cotangents formed in their operands' layouts): the plain matmul's value, gradients
    and second derivatives, float32 with a batch axis to rounding (≤ 1e-6: the same sums), and with
    bf16 operands to bf16 rounding (2e-2) with every product of the first and second derivatives
    on bf16 operands (autodiff's transposes would multiply a float32 cotangent: TF32 on a GPU)."""
    from helpers import dot_operand_dtypes, rel
    ks = jax.random.split(jax.random.PRNGKey(len(layout) + ord(layout[0])), 4)
    x_shape = {"nn": (3, 7, 11), "nt": (3, 7, 11), "tn": (3, 11, 7)}[layout]
    y_shape = {"nn": (3, 11, 5), "nt": (3, 5, 11), "tn": (3, 11, 5)}[layout]
    x, y = jax.random.normal(ks[0], x_shape), jax.random.normal(ks[1], y_shape)
    probe, probe2 = jax.random.normal(ks[2], (3, 7, 5)), jax.random.normal(ks[3], x_shape)

    def derivatives(f):
        first = jax.grad(lambda x, y: jnp.sum(f(x, y) * probe), (0, 1))(x, y)
        second = jax.grad(lambda y: jnp.sum(jax.grad(lambda x: jnp.sum(f(x, y) * probe))(x) * probe2))(y)
        return (f(x, y),) + first + (second,)

    want = derivatives(PLAIN[layout])
    for operands, bar in ((None, 1e-6), (jnp.dtype(jnp.bfloat16), 2e-2)):
        got = derivatives(lambda x, y: product(x, y, layout, operands))
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == jnp.float32 and rel(a, b) < bar, (layout, operands)
    dots = dot_operand_dtypes(lambda y: derivatives(lambda x, y: product(x, y, layout, jnp.bfloat16))[-1], y)
    assert len(dots) >= 3 and all(d == ("bfloat16", "bfloat16") for d in dots), dots
    with pytest.raises(ValueError, match="layout"):
        product(x, y, "tt")
    with pytest.raises(ValueError, match="same leading"):
        product(x[0], y, layout)


def test_product_and_gram_take_the_backward_operands_and_precision_asked_for():
    """``backward_operands`` (float32 cotangents behind a bf16 forward: `newton_schulz`) and
    ``precision`` (HIGHEST: exact float32 products on a GPU, whose default is TF32; the dual form's
    chunk-end momentum before Newton–Schulz) reach the backward's products as well as the forward's,
    and the values are unchanged: the same sums as without them (float32) or the plain product's
    within bf16 rounding (2e-2)."""
    from helpers import equations, rel
    ks = jax.random.split(jax.random.PRNGKey(21), 3)
    x, y = jax.random.normal(ks[0], (2, 7, 11)), jax.random.normal(ks[1], (2, 11, 5))
    probe = jax.random.normal(ks[2], (2, 7, 5))

    def dots(f):
        closed = jax.make_jaxpr(jax.grad(lambda x, y: jnp.sum(f(x, y) * probe), (0, 1)))(x, y)
        return [(tuple(str(v.aval.dtype) for v in e.invars), e.params["precision"])
                for e in equations(closed.jaxpr) if e.primitive.name == "dot_general"]

    bf16, f32, hi = jnp.dtype(jnp.bfloat16), "float32", jax.lax.Precision.HIGHEST
    mixed = dots(lambda x, y: product(x, y, "nn", bf16, None))
    assert [d for d, _ in mixed] == [("bfloat16", "bfloat16"), (f32, f32), (f32, f32)], mixed
    exact = dots(lambda x, y: product(x, y, "nn", None, precision=hi))
    assert len(exact) == 3 and all(p == (hi, hi) for _, p in exact), exact
    grams = dots(lambda x, y: gram(x, "nt", bf16, None) @ jnp.ones((7, 5)))
    # the Gram matrix's forward on bf16 operands; its backward, and the float32 product after it, not
    assert sorted(d for d, _ in grams) == [("bfloat16", "bfloat16")] + [(f32, f32)] * 3, grams
    grad = lambda f: jax.grad(lambda x, y: jnp.sum(f(x, y) * probe), (0, 1))(x, y)
    for a, b in zip(grad(lambda x, y: product(x, y, "nn", bf16, None)), grad(lambda x, y: x @ y)):
        assert rel(a, b) < 2e-2
    for a, b in zip(grad(lambda x, y: product(x, y, "nn", precision=hi)), grad(lambda x, y: product(x, y, "nn"))):
        assert rel(a, b) < 1e-6
    with pytest.raises(ValueError, match="backward_operands"):
        product(x, y, "nn", bf16, "float32_please")
    with pytest.raises(ValueError, match="backward_operands"):
        gram(x, "nt", bf16, "as_fwd")


@pytest.mark.parametrize("side", ["tn", "nt"])
def test_gram_has_the_matmul_value_and_derivatives_with_one_product_per_cotangent(side):
    """`gram` (xᵀx or x xᵀ, backward x (g + gᵀ)): the plain product's value, gradient and second
    derivative, float32 with a batch axis to rounding (1e-6) and with bf16 operands to bf16 rounding
    (2e-2), on a non-symmetric cotangent; its gradient is one product (product(x, x)'s takes two),
    on bf16 operands where asked."""
    from helpers import dot_operand_dtypes, rel
    ks = jax.random.split(jax.random.PRNGKey(11 + len(side)), 3)
    x = jax.random.normal(ks[0], (3, 13, 6))
    n = 6 if side == "tn" else 13
    probe, probe2 = jax.random.normal(ks[1], (3, n, n)), jax.random.normal(ks[2], x.shape)
    plain = PLAIN[side]

    def derivatives(f):
        first = jax.grad(lambda x: jnp.sum(f(x) * probe))(x)
        second = jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(f(x) * probe))(x) * probe2))(x)
        return f(x), first, second

    want = derivatives(lambda x: plain(x, x))
    for operands, bar in ((None, 1e-6), (jnp.dtype(jnp.bfloat16), 2e-2)):
        got = derivatives(lambda x: gram(x, side, operands))
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == jnp.float32 and rel(a, b) < bar, (side, operands)
    grad = lambda x: jax.grad(lambda x: jnp.sum(gram(x, side, jnp.bfloat16) * probe))(x)
    assert dot_operand_dtypes(grad, x) == [("bfloat16", "bfloat16")] * 2     # the forward's and the backward's
    with pytest.raises(ValueError, match="side"):
        gram(x, "nn")
