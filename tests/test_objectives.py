"""Axis 2, objectives: each inner objective (with the Omega window) against its model's equation."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax import objectives as obj
from atlas_jax import retention as ret
from helpers import numpy_delta_family, random_inputs, rel

T = 77   # odd, and not a multiple of any chunk size used


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_dot_objective_plus_gd_is_linear_attention(form):
    q, k, v, beta, g = random_inputs(0, T=T)
    spec = aj.MemorySpec(objective=obj.Dot())
    o, _ = spec(q, k, v, beta=beta, impl=form, chunk_size=16)
    # o_t = Σ_{i≤t} β_i (q_t·k_i) v_i
    scores = jnp.einsum("BTHK,BSHK->BHTS", q, k) * jnp.tril(jnp.ones((T, T)))
    expected = jnp.einsum("BHTS,BSH,BSHV->BTHV", scores, beta, v)
    assert rel(o, expected) < 1e-5


@pytest.mark.parametrize("retention,channel", [(ret.none(), False), (ret.scalar(), False), (ret.channel(), True)],
                         ids=["deltanet", "gated_deltanet", "kda"])
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_l2_objective_plus_gd_is_the_delta_family(retention, channel, form):
    q, k, v, beta, g = random_inputs(2, T=T, K=16, V=12, channel=channel)
    S0 = jax.random.normal(jax.random.PRNGKey(9), (2, 2, 16, 12))
    spec = aj.MemorySpec(objective=obj.L2(), retention=retention)
    gate = None if retention.decay == "none" else g
    o, state = spec(q, k, v, beta=beta, g=gate, initial_state=S0, output_final_state=True, impl=form,
                    chunk_size=16)
    o_ref, S_ref = numpy_delta_family(q, k, v, beta, gate, S0=S0)
    assert rel(o, o_ref) < 1e-5
    assert rel(state.params["S"], S_ref) < 1e-5


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

