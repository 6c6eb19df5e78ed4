"""Axis 1, memory architectures: parameters, gradients and blocks as the papers define them."""
from __future__ import annotations


import jax
import jax.numpy as jnp

import atlas_jax as aj
from atlas_jax import objectives as obj
from atlas_jax import optimizers as opt
from atlas_jax.forms.common import window_gradient
from atlas_jax.memory import MLPMemory
from helpers import rel, unit

T = 77   # odd, and not a multiple of any chunk size used


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

