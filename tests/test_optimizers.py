"""Axis 3, inner optimizers: each optax transform against its closed form or hand computation."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax import presets
from atlas_jax import optimizers as opt
from helpers import dot_operand_dtypes, numpy_delta_family, random_inputs, rel

T = 77   # odd, and not a multiple of any chunk size used


def test_momentum_with_the_step_outside_and_decay_recurrence():
    """m_t = ν_t m_{t−1} + ∇ℓ(θ_{t−1}),  θ_t = α_t θ_{t−1} − β_t m_t  (seed 000 §3's Adam-style form,
    ``momentum(step_inside=False)``), by hand. The titans preset's own form, the step inside the
    momentum, is tested in test_paper_fidelity.py."""
    B, Tn, H, K, V = 1, 19, 2, 6, 6
    q, k, v, beta, g = random_inputs(5, B=B, T=Tn, H=H, K=K, V=V)
    nu = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(6), beta.shape))
    spec = dataclasses.replace(presets.get("titans", hidden=12), optimizer=opt.momentum(1.0, 0.9))
    state0 = spec.init_state(jax.random.PRNGKey(7), batch=B, heads=H, d_k=K, d_v=V)
    o, final = spec(q, k, v, beta=0.5 * beta, g=g, nu=nu, initial_state=state0, output_final_state=True)
    memory = spec.memory
    loss = lambda p, x, y: 0.5 * jnp.sum((memory.apply(p, x) - y) ** 2)
    for h in range(H):
        theta = jax.tree.map(lambda x: x[0, h], state0.params)
        m = jax.tree.map(jnp.zeros_like, theta)
        for t in range(Tn):
            grad = jax.grad(loss)(theta, k[0, t, h], v[0, t, h])
            m = jax.tree.map(lambda mm, gg: nu[0, t, h] * mm + gg, m, grad)
            theta = jax.tree.map(lambda th, mm: jnp.exp(g[0, t, h]) * th - 0.5 * beta[0, t, h] * mm, theta, m)
            assert rel(o[0, t, h], memory.apply(theta, q[0, t, h])) < 1e-5
        assert rel(final.params["W0"][0, h], theta["W0"]) < 1e-5


def test_newton_schulz_approaches_the_polar_factor():
    m = jax.random.normal(jax.random.PRNGKey(0), (12, 7))
    u, _, vt = np.linalg.svd(np.asarray(m, np.float64), full_matrices=False)
    polar = u @ vt
    errors = [rel(opt.newton_schulz(m, j, opt.CUBIC_COEFFICIENTS), polar) for j in (1, 2, 4, 8, 16, 32)]
    # strictly decreasing until float32 rounding (~2e-7) is reached
    assert all(b < a or max(a, b) < 1e-6 for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > 0.3 and errors[-1] < 1e-6, errors
    # Muon's quintic trades convergence for speed: after 5 steps every singular value is ≈ 1.
    s = np.linalg.svd(np.asarray(opt.newton_schulz(m, 5), np.float64), compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.3
    # tall and wide give transposed results
    assert rel(opt.newton_schulz(m.T, 20, opt.CUBIC_COEFFICIENTS), polar.T) < 1e-3


def test_newton_schulz_names_its_norm_and_gram_matrices_for_rematerialisation(capsys):
    """``residual_name``: a policy that saves that name keeps the norm and the two Gram matrices of
    the Gram route (restart included) and nothing x-sized but the input; the values are unchanged."""
    from jax.ad_checkpoint import print_saved_residuals
    m = jax.random.normal(jax.random.PRNGKey(1), (1024, 256))   # the Gram route: 4x tall, 2^18 entries
    policy = jax.checkpoint_policies.save_only_these_names("ns_kept")
    for name, kept in ((None, 0), ("ns_kept", 3)):
        loss = jax.checkpoint(lambda x: jnp.sum(jnp.sin(opt.newton_schulz(x, 5, residual_name=name))), policy=policy)
        print_saved_residuals(loss, m)
        lines = capsys.readouterr().out.strip().splitlines()
        named = [line for line in lines if "named 'ns_kept'" in line]
        assert len(named) == kept and len(lines) == kept + 1, lines
        assert sum("f32[256,256]" in line for line in named) == (2 if name else 0), lines
    assert np.array_equal(opt.newton_schulz(m, 5, residual_name="ns_kept"), opt.newton_schulz(m, 5))


def test_newton_schulz_from_the_gram_matrix_alone():
    """`newton_schulz_factor`: NS_J(m) = scale·m + m·right from mᵀm alone (the dual form's Muon
    super-chunks), for tall, wide and square m, J = 0 … 5, and for momenta of decayed rank-one
    terms (many small singular values; rank-deficient), against `newton_schulz` on m itself.
    Tolerances: 2e-6 relative on a well-conditioned tall m (σ_min/σ_max ≈ 0.5: a few float32
    roundings). The Gram matrix resolves singular values only to ~√ε of the largest (float32
    rounding of A is ε·‖A‖ on every direction, null ones included), which Muon's quintic amplifies
    by up to a^J: 1e-4 on a wide m (a 33-dimensional null space; measured 4.5e-5) and a square
    Gaussian one (σ ratio ~1e-2; 6e-6), 1e-3 on a momentum of 300 rank-one terms decayed by 0.9 and
    on a rank-8 one (measured 2.7e-4 and 5.7e-5, where `newton_schulz`'s Gram route, restarting
    from its formed iterate, is within 2e-5; its direct iteration on TF32 operands, a GPU's default,
    is 1e-3 off). A zero m gives a zero result and finite gradients."""
    exact = lambda f, m: f.scale * m + jnp.matmul(m, f.right, precision=jax.lax.Precision.HIGHEST)
    for shape in ((40, 7), (7, 40), (24, 24)):
        m = jax.random.normal(jax.random.PRNGKey(3), shape)
        for steps in (0, 1, 2, 3, 5):
            got = exact(opt.newton_schulz_factor(m.T @ m, steps), m)
            assert rel(got, opt.newton_schulz(m, steps, method="direct")) < (2e-6 if shape == (40, 7) else 1e-4), \
                (shape, steps)
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    rows, values = jax.random.normal(keys[0], (300, 512)), jax.random.normal(keys[1], (300, 64))
    low_rank = jax.random.normal(keys[2], (512, 8)) @ values[:8]
    for m in ((rows * (0.9 ** jnp.arange(300)[::-1, None])).T @ values, low_rank):
        assert rel(exact(opt.newton_schulz_factor(m.T @ m, 5), m), opt.newton_schulz(m, 5, method="direct")) < 1e-3
    zero = jnp.zeros((6, 4))
    factor = opt.newton_schulz_factor(zero.T @ zero, 5)
    assert float(factor.scale) == 0.0 and float(jnp.abs(factor.right).max()) == 0.0
    grad = jax.grad(lambda m: jnp.sum(jnp.sin(opt.newton_schulz_factor(m.T @ m, 5).right)) * 1.7)(zero)
    assert bool(jnp.isfinite(grad).all())


def test_implicit_gd_is_longhorn_closed_form():
    """Longhorn: S_t = S_{t−1} + β/(1+β‖k‖²) k (v − S_{t−1}ᵀk)ᵀ, unnormalised keys."""
    q, k, v, beta, g = random_inputs(8, T=T)
    k = 1.7 * k
    o, _ = presets.get("longhorn")(q, k, v, beta=beta)
    eff = beta / (1 + beta * jnp.sum(k * k, -1))
    assert rel(o, numpy_delta_family(q, k, v, eff)[0]) < 1e-5


def test_least_squares_is_the_mesa_solution():
    """MesaNet: θ_t = (Σ k kᵀ + λI)^{-1} Σ k vᵀ (no gates) equals the per-step solve."""
    q, k, v, beta, g = random_inputs(9, B=1, T=23, H=1, K=5, V=4)
    o, state = presets.get("mesanet", ridge=0.5)(q, k, v, output_final_state=True)
    kn, vn, qn = (np.asarray(x[0, :, 0], np.float64) for x in (k, v, q))
    for t in (0, 7, 22):
        S = np.linalg.solve(kn[:t + 1].T @ kn[:t + 1] + 0.5 * np.eye(5), kn[:t + 1].T @ vn[:t + 1])
        assert rel(o[0, t, 0], S.T @ qn[t]) < 1e-5



def test_newton_schulz_of_a_zero_momentum_has_finite_gradients():
    """An empty packed row has zero momentum: NS gives 0 and its gradient must be finite (0)."""
    zero = jnp.zeros((6, 4))
    assert float(jnp.abs(opt.newton_schulz(zero, 5)).max()) == 0.0
    grad = jax.grad(lambda m: jnp.sum(opt.newton_schulz(m, 5) * 1.7))(zero)
    assert bool(jnp.isfinite(grad).all())
    m = jax.random.normal(jax.random.PRNGKey(0), (6, 4))
    assert float(jnp.abs(jax.grad(lambda m: jnp.sum(opt.newton_schulz(m, 5)))(m)).max()) > 0


def test_newton_schulz_on_bf16_operands_still_orthogonalises_and_atlas_runs_with_it():
    """muon(ns_dtype="bfloat16"): bf16 matmul operands, float32 iterate and accumulation (Muon's
    practice). Entry by entry it moves a few percent from float32 (Muon's quintic multiplies small
    singular directions by a = 3.4 an iteration, rounding included), so what is tested is what an
    orthogonaliser must do: the convergent cubic still reaches the polar factor to bf16 accuracy
    (2^-8 ≈ 4e-3, bar 1e-2), the quintic's five steps give float32's singular-value band, the
    gradient points the same way (cosine > 0.99), and a whole atlas layer (dual form, NS per
    chunk) stays within 5e-2 of float32 NS (relative norm)."""
    m = jax.random.normal(jax.random.PRNGKey(0), (12, 7))
    u, _, vt = np.linalg.svd(np.asarray(m, np.float64), full_matrices=False)
    assert rel(opt.newton_schulz(m, 32, opt.CUBIC_COEFFICIENTS, operand_dtype="bfloat16"), u @ vt) < 1e-2
    for shape in ((40, 24), (24, 40)):   # wide and tall: the Gram matrix is the smaller side
        m = jax.random.normal(jax.random.PRNGKey(5), shape)
        low = opt.newton_schulz(m, 5, operand_dtype="bfloat16")
        assert low.dtype == jnp.float32 and float(jnp.max(jnp.abs(low - opt.newton_schulz(m, 5)))) > 1e-4
        s = np.linalg.svd(np.asarray(low, np.float64), compute_uv=False)
        assert s.min() > 0.5 and s.max() < 1.3
        cot = jax.random.normal(jax.random.PRNGKey(2), shape)
        g_exact = jax.grad(lambda m: jnp.sum(opt.newton_schulz(m, 5) * cot))(m)
        g_low = jax.grad(lambda m: jnp.sum(opt.newton_schulz(m, 5, operand_dtype="bfloat16") * cot))(m)
        assert float(jnp.sum(g_exact * g_low) / jnp.linalg.norm(g_exact) / jnp.linalg.norm(g_low)) > 0.99

    B, Tn, H, K = 1, 37, 2, 8
    q, k, v, beta, g = random_inputs(3, B=B, T=Tn, H=H, K=K, V=K)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        spec = presets.get("atlas", ns_every="chunk", hidden=16, ns_dtype=dtype)
        assert opt.info(spec.optimizer).ns_dtype == dtype
        state0 = spec.init_state(jax.random.PRNGKey(7), batch=B, heads=H, d_k=K, d_v=K)
        outs[dtype] = spec(q, k, v, beta=0.5 * beta, g=g, impl="chunk", chunk_size=16, initial_state=state0)[0]
    assert 0 < rel(outs["bfloat16"], outs["float32"]) <= 5e-2
    try:
        opt.muon(ns_dtype="float16")
    except ValueError as e:
        assert "ns_dtype" in str(e) and "bfloat16" in str(e)
    else:
        raise AssertionError("muon(ns_dtype='float16') must raise")


@pytest.mark.parametrize("method", ["direct", "gram"])
def test_newton_schulz_on_bf16_operands_takes_its_backward_on_float32_operands(method):
    """ns_dtype="bfloat16": the forward's products take bf16 operands (through `linalg.product`),
    the backward's float32 ones. NS's derivative is up to a⁵ ≈ 480 on the momentum's near-null
    directions, and a cotangent rounded to bf16 there leaks into the others: in the dual form that
    grew atlas' backward chunk after chunk (max |dk| 7.8e15 over the first 2048 of 16384 tokens on
    an H200, against 0.74 in float32; benchmarks/results/atlas_backward_growth_h200_2026-11-29.md).
    float32 operands stay float32 throughout. Tall and wide momenta, both routes."""
    for shape in ((40, 12), (12, 40)):
        m = jax.random.normal(jax.random.PRNGKey(3), (2,) + shape)
        cot = jax.random.normal(jax.random.PRNGKey(4), (2,) + shape)
        forward = lambda m, dtype: opt.newton_schulz(m, 5, operand_dtype=dtype, method=method)
        for dtype in ("bfloat16", "float32"):
            n_forward = len(dot_operand_dtypes(lambda m: forward(m, dtype), m))
            dots = dot_operand_dtypes(jax.grad(lambda m: jnp.sum(forward(m, dtype) * cot)), m)
            assert n_forward >= 5 and len(dots) > 2 * n_forward, (shape, dtype, n_forward, len(dots))
            want = [(dtype, dtype)] * n_forward + [("float32", "float32")] * (len(dots) - n_forward)
            assert sorted(dots) == sorted(want), (shape, dtype, dots)


def test_newton_schulz_through_the_gram_matrix_equals_the_direct_iteration():
    """newton_schulz(method="gram"): the same polynomial of X carried on n × n matrices
    (X_k = R_k X_0, A_k = R_k A_0 R_kᵀ, one restart halfway, R X as αX + (R − αI)X). Against
    float64 truth both routes are within 5e-5 of the largest entry in float32, on a Gaussian and on
    an ill-conditioned tall matrix (singular values 1 … 1e-6, where A_0 resolves only √ε: without
    the restart the Gram route is off by 1e-4 at the atlas size), and within 8e-2 with bf16
    operands (direct: 5.3e-2; R's scalar part, up to a⁵ ≈ 480, rounded with the operands put the
    Gram route at 2e-2 with TF32-rounded operands before the α split); gradients agree to 1e-4;
    "auto" takes the Gram route exactly where stated."""
    def truth(x, steps=5):
        a, b, c = opt.MUON_COEFFICIENTS
        x = np.swapaxes(np.asarray(x, np.float64), -1, -2)
        x = x / np.sqrt((x ** 2).sum(axis=(-2, -1), keepdims=True))
        for _ in range(steps):
            g = x @ np.swapaxes(x, -1, -2)
            x = a * x + (b * g + c * g @ g) @ x
        return np.swapaxes(x, -1, -2)

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    u, _ = jnp.linalg.qr(jax.random.normal(k1, (2, 300, 48)))
    w, _ = jnp.linalg.qr(jax.random.normal(k2, (2, 48, 48)))
    ill = jnp.einsum("bmk,k,bnk->bmn", u, jnp.logspace(0, -6, 48), w)
    for x in (jax.random.normal(k3, (2, 300, 48)), ill):
        t = truth(x)
        for method in ("direct", "gram"):
            got = np.asarray(opt.newton_schulz(x, 5, method=method))
            assert np.abs(got - t).max() / np.abs(t).max() < 5e-5, method
            got = np.asarray(opt.newton_schulz(x, 5, operand_dtype="bfloat16", method=method))
            assert np.abs(got - t).max() / np.abs(t).max() < 8e-2, method
        cot = jax.random.normal(k1, x.shape)
        grads = {m: jax.grad(lambda x: jnp.sum(opt.newton_schulz(x, 5, method=m) * cot))(x) for m in ("direct", "gram")}
        assert rel(grads["gram"], grads["direct"]) < 1e-4
    # wide input, fewer steps than a restart needs, and a zero matrix: same as direct
    wide = jax.random.normal(k2, (40, 200))
    for steps in (0, 1, 2, 3):
        assert rel(opt.newton_schulz(wide, steps, method="gram"), opt.newton_schulz(wide, steps, method="direct")) < 1e-5
    assert float(jnp.abs(opt.newton_schulz(jnp.zeros((300, 48)), 5, method="gram")).max()) == 0.0

    jaxpr = lambda shape, **kw: str(jax.make_jaxpr(lambda x: opt.newton_schulz(x, 5, **kw))(jnp.ones(shape)))
    assert jaxpr((1100, 256)) == jaxpr((1100, 256), method="gram")              # 4.3× tall, 2.8e5 entries
    assert jaxpr((256, 1100)) == jaxpr((256, 1100), method="gram")
    assert jaxpr((1225, 192)) == jaxpr((1225, 192), method="gram")              # 6.4× tall, 2.4e5 entries
    assert jaxpr((1225, 48)) == jaxpr((1225, 48), method="gram")                # 25× tall, 5.9e4 entries
    assert jaxpr((512, 128)) == jaxpr((512, 128), method="direct")              # 4× tall, 6.6e4 entries
    assert jaxpr((192, 48)) == jaxpr((192, 48), method="direct")                # small
    assert jaxpr((700, 256)) == jaxpr((700, 256), method="direct")              # 2.7× tall
    assert jaxpr((1100, 256), operand_dtype="bfloat16") == jaxpr((1100, 256), operand_dtype="bfloat16", method="gram")
    assert jaxpr((700, 256), operand_dtype="bfloat16") == jaxpr((700, 256), operand_dtype="bfloat16", method="direct")
    spec = presets.get("atlas", ns_every="chunk", hidden=16, ns_method="direct")
    assert opt.info(spec.optimizer).ns_method == "direct"
    for bad in (lambda: opt.muon(ns_method="fast"), lambda: opt.newton_schulz(wide, 5, method="fast")):
        try:
            bad()
        except ValueError as e:
            assert "method" in str(e) and "gram" in str(e)
        else:
            raise AssertionError("an unknown Newton–Schulz method must raise")


def test_atlas_layer_at_a_size_where_auto_takes_the_gram_route(monkeypatch):
    """A 64-wide head with polynomial features (d_φ = 2145) and hidden 128: "auto" orthogonalises
    the [2145, 128] momentum through its Gram matrix; the layer's θ_0 gradients stay as close to the
    direct iteration as float32 rounding allows. The dual form's per-chunk route, where
    ``ns_method`` reaches every weight (its super-chunks take the wide weights' NS from their Gram
    matrix whatever the method: `forms.dual._muon_super_chunk`).

    "As rounding allows" is measured, not assumed: the gradients of this layer move by ~3e-5
    (relative norm) when q alone is perturbed by one float32 ulp, so a fixed 1e-4 between two
    correctly rounded routes failed on some CPUs (1.1e-4 on one, 5e-5 on another). The Gram route
    squares the momentum's condition number for a few products, so the bound is a small multiple
    (10×) of that one-ulp sensitivity, taken on the same machine in the same test."""
    from atlas_jax.forms import dual
    monkeypatch.setattr(dual, "SUPER_CHUNK", 1)
    B, Tn, H, K = 1, 21, 1, 64
    q, k, v, beta, g = random_inputs(4, B=B, T=Tn, H=H, K=K, V=K)

    def loss_and_grad(method):
        spec = presets.get("atlas", ns_every="chunk", hidden=128, ns_method=method)
        state0 = spec.init_state(jax.random.PRNGKey(7), batch=B, heads=H, d_k=K, d_v=K)
        loss = lambda params, q: jnp.sum(spec(q, k, v, beta=0.5 * beta, g=g, impl="chunk", chunk_size=8,
                                              initial_state=state0._replace(params=params))[0] ** 2)
        return jax.jit(jax.value_and_grad(loss)), state0.params
    functions = {method: loss_and_grad(method) for method in ("auto", "direct")}
    results = {method: fn(params0, q) for method, (fn, params0) in functions.items()}
    one_ulp = 1 + 2.0 ** -23 * jax.random.normal(jax.random.PRNGKey(3), q.shape)
    direct, params0 = functions["direct"]
    perturbed = direct(params0, q * one_ulp)                       # compiled already: q ± 1 ulp
    w0 = jax.tree.leaves(results["auto"][1])
    assert max(x.shape[-2] for x in w0 if x.ndim >= 2) == 2145
    assert abs(float(results["auto"][0] / results["direct"][0]) - 1) < 1e-4
    pairs = lambda x, y: zip(jax.tree.leaves(x[1]), jax.tree.leaves(y[1]))
    sensitivity = max(rel(a, b) for a, b in pairs(results["direct"], perturbed))
    gap = max(rel(a, b) for a, b in pairs(results["auto"], results["direct"]))
    assert 0 < sensitivity < 1e-4, sensitivity      # the layer is well enough conditioned to test
    assert gap < 10 * sensitivity, (gap, sensitivity)
