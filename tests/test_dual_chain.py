"""The super-chunk chain of a wide-input depth-2 MLP memory (atlas_jax.ops.deep_memory.dual_chain):
its dual form (base products and Gram matrices, θ never formed) equals the chain run on θ itself,
formed chunk by chunk and step by step (`_chain_on_theta`): the sources' cotangents, the second
layer after the super-chunk, every step's read and, through `chain_weights`, the wide weights'
end state; with and without the skip map, ℓ2 and dot objectives, GELU and tanh, odd sizes, decays
from none to full (a chunk that forgets everything). float32 both sides: 1e-5 relative (seen
≤ 1e-6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import rel

from atlas_jax.memory import ACTIVATIONS
from atlas_jax.ops.deep_memory.dual_chain import chain_weights, dual_chain_reference

TOL = 1e-5


def _problem(seed, *, S=3, n=7, b=5, d=11, h=12, dv=6, skip=True):
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 12))
    normal = lambda *s, scale=1.0: scale * jax.random.normal(next(ks), s, jnp.float32)
    theta = {"W0": normal(d, h, scale=d ** -0.5), "W1": normal(h, dv, scale=h ** -0.5)}
    if skip:
        theta["skip"] = normal(d, dv, scale=0.5 * d ** -0.5)
    a, q, targets = normal(S, n, d), normal(S, b, d), normal(S, n, dv)
    from_start = jnp.exp(-jnp.cumsum(jnp.abs(normal(S, b, scale=0.3)), axis=1))
    from_start = from_start.at[1, -1].set(0.0)            # chunk 1 forgets everything at its end
    state_rows = normal(S, b, n, scale=0.2)
    return theta, a, q, targets, from_start, state_rows


def _chain_on_theta(theta, a, q, targets, from_start, state_rows, activation, objective):
    """The chain with θ formed: per chunk the sources' forward and cotangents at θ_k, every step's
    read at its own θ_t = f_t θ_k + Σ_s M[t, s] a_s δ_sᵀ, and θ_{k+1} = θ_t at the last step."""
    act = ACTIVATIONS[activation]

    def apply(th, x):
        y = act(x @ th["W0"]) @ th["W1"]
        return y + x @ th["skip"] if "skip" in th else y

    def at_step(th, f, rows, a_k, hidden, d0, errors):
        out = {"W0": f * th["W0"] + a_k.T @ (rows[:, None] * d0),
               "W1": f * th["W1"] + hidden.T @ (rows[:, None] * errors)}
        if "skip" in th:
            out["skip"] = f * th["skip"] + a_k.T @ (rows[:, None] * errors)
        return out

    d_all, e_all, outs = [], [], []
    for k in range(a.shape[0]):
        z = a[k] @ theta["W0"]
        hidden, act_vjp = jax.vjp(act, z)
        errors = apply(theta, a[k]) - targets[k] if objective == "l2" else -targets[k]
        (d0,) = act_vjp(errors @ theta["W1"].T)
        outs.append(jnp.stack([apply(at_step(theta, from_start[k, t], state_rows[k, t], a[k], hidden, d0, errors),
                                     q[k, t][None])[0] for t in range(q.shape[1])]))
        d_all.append(d0)
        e_all.append(errors)
        theta = at_step(theta, from_start[k, -1], state_rows[k, -1], a[k], hidden, d0, errors)
    return jnp.stack(d_all), jnp.stack(e_all), theta, jnp.stack(outs)


@pytest.mark.parametrize("skip,activation,objective", [(True, "gelu", "l2"), (False, "tanh", "l2"),
                                                       (False, "gelu", "dot"), (True, "silu", "dot")])
def test_chain_equals_the_chain_on_theta(skip, activation, objective):
    theta, a, q, targets, from_start, state_rows = _problem(3, skip=skip)
    width = ["W0", "skip"] if skip else ["W0"]
    wide = jnp.concatenate([theta[key] for key in width], axis=1)
    S, n = a.shape[:2]
    gram = lambda x: jnp.einsum("KRD,JSD->KRJS", x, a)
    got = dual_chain_reference(a @ wide, q @ wide, gram(a), gram(q), theta["W1"], targets, from_start, state_rows,
                               activation=activation, skip=skip, objective=objective)
    d0, errors, theta_end, outputs = _chain_on_theta(theta, a, q, targets, from_start, state_rows, activation,
                                                     objective)
    assert rel(got.d0, d0) <= TOL and rel(got.errors, errors) <= TOL
    assert rel(got.outputs, outputs) <= TOL, rel(got.outputs, outputs)
    assert rel(got.w1_end, theta_end["W1"]) <= TOL
    p, w = chain_weights(from_start, state_rows)
    cotangents = jnp.concatenate([got.d0, got.errors], axis=-1) if skip else got.d0
    end = p[-1] * wide + a.reshape(S * n, -1).T @ (w[-1].reshape(S * n, 1) * cotangents.reshape(S * n, -1))
    want = jnp.concatenate([theta_end[key] for key in width], axis=1)
    assert rel(end, want) <= TOL, rel(end, want)


def test_chain_names_a_misshapen_argument():
    theta, a, q, targets, from_start, state_rows = _problem(4, skip=False)
    gram = jnp.einsum("KRD,JSD->KRJS", a, a)
    with pytest.raises(ValueError, match="base_queries"):
        dual_chain_reference(a @ theta["W0"], q @ theta["W0"][:, :-1], gram, jnp.einsum("KRD,JSD->KRJS", q, a),
                             theta["W1"], targets, from_start, state_rows)
    with pytest.raises(ValueError, match="objective"):
        dual_chain_reference(a @ theta["W0"], q @ theta["W0"], gram, jnp.einsum("KRD,JSD->KRJS", q, a),
                             theta["W1"], targets, from_start, state_rows, objective="lp")
