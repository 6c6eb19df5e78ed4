"""Each closed form in the seeds, recovered from the four-axis core."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import atlas_jax as aj
from atlas_jax import closed_forms, presets
from atlas_jax import objectives as obj
from atlas_jax import optimizers as opt
from atlas_jax import retention as ret
from atlas_jax.features import ExpTaylor, Polynomial, symmetric_power
from atlas_jax.forms.common import window_gradient
from atlas_jax.memory import LinearMemory, MLPMemory
from helpers import numpy_delta_family, random_inputs, rel, unit

T = 77   # odd, and not a multiple of any chunk size used


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_dot_objective_plus_gd_is_linear_attention(form):
    q, k, v, beta, g = random_inputs(0, T=T)
    spec = aj.MemorySpec(objective=obj.Dot())
    o, _ = spec(q, k, v, beta=beta, form=form, chunk_size=16)
    # o_t = Σ_{i≤t} β_i (q_t·k_i) v_i
    scores = jnp.einsum("BTHK,BSHK->BHTS", q, k) * jnp.tril(jnp.ones((T, T)))
    expected = jnp.einsum("BHTS,BSH,BSHV->BTHV", scores, beta, v)
    assert rel(o, expected) < 1e-5


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_dot_objective_with_scalar_retention_is_mamba2(form):
    q, k, v, beta, g = random_inputs(1, T=T)
    o, _ = aj.MemorySpec(objective=obj.Dot(), retention=ret.scalar())(q, k, v, beta=beta, g=g, form=form,
                                                                       chunk_size=16)
    G = jnp.cumsum(g, axis=1)                                       # [B, T, H]
    diff = G[:, :, None] - G[:, None, :]                            # [B, T, S, H]
    mask = jnp.tril(jnp.ones((T, T), bool))[None, :, :, None]
    decay = jnp.exp(jnp.where(mask, diff, -jnp.inf))
    expected = jnp.einsum("BTSH,BTHK,BSHK,BSH,BSHV->BTHV", decay, q, k, beta, v)
    assert rel(o, expected) < 1e-5


@pytest.mark.parametrize("retention,channel", [(ret.none(), False), (ret.scalar(), False), (ret.channel(), True)],
                         ids=["deltanet", "gated_deltanet", "kda"])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_l2_objective_plus_gd_is_the_delta_family(retention, channel, form):
    q, k, v, beta, g = random_inputs(2, T=T, K=16, V=12, channel=channel)
    S0 = jax.random.normal(jax.random.PRNGKey(9), (2, 2, 16, 12))
    spec = aj.MemorySpec(objective=obj.L2(), retention=retention)
    gate = None if retention.decay == "none" else g
    o, state = spec(q, k, v, beta=beta, g=gate, initial_state=S0, output_final_state=True, form=form,
                    chunk_size=16)
    o_ref, S_ref = numpy_delta_family(q, k, v, beta, gate, S0=S0)
    assert rel(o, o_ref) < 1e-5
    assert rel(state.params["S"], S_ref) < 1e-5


def test_kda_step_is_the_sherman_morrison_minimiser():
    """KDA's step is the exact minimiser of ½‖v − Sᵀk‖² + 1/(2η)‖S − Diag(α) S_prev‖² for unit k,
    with β = η/(1+η) (seed 000 §5)."""
    rng = np.random.default_rng(0)
    K, V = 6, 5
    for _ in range(5):
        S_prev = rng.normal(size=(K, V))
        k = rng.normal(size=K)
        k /= np.linalg.norm(k)
        v = rng.normal(size=V)
        g = -rng.uniform(0.01, 2.0, size=K)
        eta = rng.uniform(0.1, 5.0)
        beta = eta / (1 + eta)
        prior = np.exp(g)[:, None] * S_prev
        # Normal equations: (I/η + k kᵀ) S = prior/η + k vᵀ.
        exact = np.linalg.solve(np.eye(K) / eta + np.outer(k, k), prior / eta + np.outer(k, v))
        o, state = aj.MemorySpec(retention=ret.channel())(
            jnp.asarray(k, jnp.float32)[None, None, None], jnp.asarray(k, jnp.float32)[None, None, None],
            jnp.asarray(v, jnp.float32)[None, None, None], beta=jnp.full((1, 1, 1), beta, jnp.float32),
            g=jnp.asarray(g, jnp.float32)[None, None, None], initial_state=jnp.asarray(S_prev, jnp.float32)[None, None],
            output_final_state=True)
        assert rel(state.params["S"][0, 0], exact) < 1e-5


def test_omega_window_one_is_the_delta_rule_and_wider_windows_match_their_equation():
    q, k, v, beta, g = random_inputs(3, T=31, K=8, V=8)
    gamma = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(4), beta.shape))
    o1, _ = aj.MemorySpec(window=1)(q, k, v, beta=beta)
    assert rel(o1, numpy_delta_family(q, k, v, beta)[0]) < 1e-5
    # c = 3: S_t = S_{t−1} − β_t Σ_{i=t−2..t} γ_i k_i (k_iᵀ S_{t−1} − v_iᵀ)  (seed 000 §6.1)
    c = 3
    o3, _ = aj.MemorySpec(window=c)(q, k, v, beta=beta, gamma=gamma)
    qn, kn, vn, bn, gn = (np.asarray(x, np.float64) for x in (q, k, v, beta, gamma))
    B, Tn, H, K = qn.shape
    expected = np.zeros(o3.shape)
    for b in range(B):
        for h in range(H):
            S = np.zeros((K, vn.shape[-1]))
            for t in range(Tn):
                grad = sum(gn[b, i, h] * np.outer(kn[b, i, h], kn[b, i, h] @ S - vn[b, i, h])
                           for i in range(max(0, t - c + 1), t + 1))
                S = S - bn[b, t, h] * grad
                expected[b, t, h] = S.T @ qn[b, t, h]
    assert rel(o3, expected) < 1e-5


def test_ttt_mlp_explicit_gradients_equal_autodiff():
    """Seed 000 §2: ∇_{W2} = −r hᵀ, ∇_{W1} = −[W2ᵀ r ⊙ σ'(u)] kᵀ (here with x @ W, so transposed)."""
    memory = MLPMemory(depth=2, hidden=10, activation="tanh")
    params = memory.init(jax.random.PRNGKey(0), 7, 5)
    k = unit(jax.random.normal(jax.random.PRNGKey(1), (7,)))
    v = jax.random.normal(jax.random.PRNGKey(2), (5,))
    grads = window_gradient(memory, obj.L2(), params, k[None], v[None], jnp.ones(1), None)
    u = k @ params["W0"]
    h = jnp.tanh(u)
    r = v - h @ params["W1"]
    explicit_W1 = -jnp.outer(h, r)
    explicit_W0 = -jnp.outer(k, (params["W1"] @ r) * (1 - jnp.tanh(u) ** 2))
    assert rel(grads["W1"], explicit_W1) < 1e-5
    assert rel(grads["W0"], explicit_W0) < 1e-5
    # and one GD step of the core moves θ by exactly −β ∇
    spec = aj.MemorySpec(memory=memory, optimizer=opt.gd(0.3))
    state = spec.init_state(None, batch=1, heads=1, d_k=7, d_v=5,
                            params=jax.tree.map(lambda x: x[None, None], params))
    _, new = spec(k[None, None, None], k[None, None, None], v[None, None, None], initial_state=state,
                  output_final_state=True)
    assert rel(new.params["W0"][0, 0], params["W0"] - 0.3 * explicit_W0) < 1e-5
    assert rel(new.params["W1"][0, 0], params["W1"] - 0.3 * explicit_W1) < 1e-5


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


def test_deep_transformer_is_softmax_attention_when_normalised_and_its_recurrence_converges():
    q, k, v, beta, g = random_inputs(10, B=1, T=17, H=2, K=4, V=3)
    q, k = 0.5 * unit(q), 0.5 * unit(k)
    normalised = closed_forms.deep_transformer(q, k, v, scale=1.0, normalize=True)
    logits = jnp.einsum("BTHK,BSHK->BHTS", q, k)
    mask = jnp.tril(jnp.ones((17, 17), bool))
    attn = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    assert rel(normalised, jnp.einsum("BHTS,BSHV->BTHV", attn, v)) < 1e-5
    exact = presets.get("deep_transformer")(q, k, v, scale=1.0)
    errs = [rel(presets.get("deep_transformer").approximation(p)(q, k, v)[0], exact) for p in (1, 2, 4)]
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-3, errs
    window = closed_forms.swdt(q, k, v, window=4, scale=1.0)
    assert rel(window[:, :4], exact[:, :4]) < 1e-6 and rel(window, exact) > 1e-2


def test_dot_closed_form_is_the_kernelised_delta_rule():
    q, k, v, beta, g = random_inputs(11, B=1, T=13, H=1, K=3, V=2)
    q, k = 0.4 * unit(q), 0.4 * unit(k)
    exact = closed_forms.dot(q, k, v, beta, scale=1.0)
    # direct function-space recurrence M_t(x) = M_{t−1}(x) + β_t (v_t − M_{t−1}(k_t)) exp(k_t·x)
    keys, coeffs = [], []
    M = lambda x: sum(c * np.exp(kk @ x) for kk, c in zip(keys, coeffs)) if keys else np.zeros(2)
    for t in range(13):
        kt, vt, bt = (np.asarray(a, np.float64) for a in (k[0, t, 0], v[0, t, 0], beta[0, t, 0]))
        coeffs.append(bt * (vt - M(kt)))
        keys.append(kt)
        assert rel(exact[0, t, 0], M(np.asarray(q[0, t, 0], np.float64))) < 1e-5
    approx = presets.get("dot").approximation(6)(q, k, v, beta=beta)[0]
    assert rel(approx, exact) < 1e-4
