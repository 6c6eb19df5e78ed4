"""The non-parametric members (DeepTransformer, SWDT, Dot: ATLAS §4) in closed form, against their recurrences."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax import closed_forms, presets
from helpers import random_inputs, rel, unit

T = 77   # odd, and not a multiple of any chunk size used


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
