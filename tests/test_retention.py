"""Axis 4, retention: each decay and map against its model's equation (MIRAS' chunk-end schedule is in test_paper_fidelity.py)."""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

import atlas_jax as aj
from atlas_jax import objectives as obj
from atlas_jax import retention as ret
from helpers import random_inputs, rel

T = 77   # odd, and not a multiple of any chunk size used


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_dot_objective_with_scalar_retention_is_mamba2(form):
    q, k, v, beta, g = random_inputs(1, T=T)
    o, _ = aj.MemorySpec(objective=obj.Dot(), retention=ret.scalar())(q, k, v, beta=beta, g=g, impl=form,
                                                                       chunk_size=16)
    G = jnp.cumsum(g, axis=1)                                       # [B, T, H]
    diff = G[:, :, None] - G[:, None, :]                            # [B, T, S, H]
    mask = jnp.tril(jnp.ones((T, T), bool))[None, :, :, None]
    decay = jnp.exp(jnp.where(mask, diff, -jnp.inf))
    expected = jnp.einsum("BTSH,BTHK,BSHK,BSH,BSHV->BTHV", decay, q, k, beta, v)
    assert rel(o, expected) < 1e-5


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

