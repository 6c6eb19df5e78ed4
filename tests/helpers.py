"""Shared test helpers: random inputs (never zeros), relative errors, a float64 numpy reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.features import Polynomial


def rel(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are 0)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / denom) if denom > 0 else float(np.linalg.norm(a))


def tree_rel(a, b) -> float:
    return max(rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def unit(x, axis=-1):
    return x / jnp.linalg.norm(x, axis=axis, keepdims=True)


def random_inputs(seed, B=2, T=77, H=2, K=16, V=12, *, channel=False, extreme=False, d_gate=None):
    """q, k (unit), v, beta = sigmoid(randn), g = logsigmoid(randn) (or ≤ −5 with ``extreme``)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = unit(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    gate_shape = (B, T, H, d_gate or K) if channel else (B, T, H)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[4], gate_shape))
    if extreme:
        g = g - 5.0
    return q, k, v, beta, g


def numpy_delta_family(q, k, v, beta, g=None, *, delta=True, scale=1.0, S0=None):
    """The ops' per-token semantics (flash-linear-attention's) as a float64 numpy loop (independent of JAX)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, K = q.shape
    V = v.shape[-1]
    beta = np.ones((B, T, H)) if beta is None else np.asarray(beta, np.float64)
    S = np.zeros((B, H, K, V)) if S0 is None else np.array(S0, np.float64)
    o = np.zeros((B, T, H, V))
    for b in range(B):
        for h in range(H):
            s = S[b, h]
            for t in range(T):
                if g is not None:
                    gt = np.asarray(g, np.float64)[b, t, h]
                    s = (np.exp(gt)[:, None] * s) if np.ndim(gt) == 1 else np.exp(gt) * s
                kt, vt = k[b, t, h], v[b, t, h]
                if delta:
                    s = s + beta[b, t, h] * np.outer(kt, vt - s.T @ kt)
                else:
                    s = s + beta[b, t, h] * np.outer(kt, vt)
                o[b, t, h] = s.T @ (scale * q[b, t, h])
            S[b, h] = s
    return o, S


def make_inputs(seed, *, gate, B=1, T=37, H=2, K=16, V=32, strength="normal", n_states=None):
    """`random_inputs` for one gate kind, as the kernel tests take them: [q, k, v, beta, g, s0]
    (g None for gate "none") and cotangent weights (wo [B, T, H, V], ws [n_states, H, K, V]).

    gate: "none" | "scalar" [B, T, H] | "channel" [B, T, H, K]. strength: "normal"
    (log-sigmoid), "extreme" (<= -5: a chunk's cumulative gate reaches -300 and beyond) or
    "near0" (in (-1.1e-3, -1e-4): decays of ~1, nothing forgotten). n_states: rows of the
    initial state (N packed sequences; default B). All float32, never zeros.
    """
    q, k, v, beta, g = random_inputs(seed, B, T, H, K, V, channel=gate == "channel",
                                     extreme=strength == "extreme")
    ks = jax.random.split(jax.random.PRNGKey(seed + 7919), 4)
    if strength == "near0":
        g = -1e-3 * (0.1 + jax.random.uniform(ks[0], g.shape))
    elif strength not in ("normal", "extreme"):
        raise ValueError(f"strength must be 'normal', 'extreme' or 'near0'; got {strength!r}")
    n = n_states or B
    s0 = jax.random.normal(ks[1], (n, H, K, V))
    wo = jax.random.normal(ks[2], (B, T, H, V))
    ws = jax.random.normal(ks[3], (n, H, K, V))
    return [q, k, v, beta, None if gate == "none" else g, s0], (wo, ws)


def omega_spec_inputs(spec, *, per_position, seed, T, K, V, prefix):
    """Random inputs of a linear-memory Omega spec (B 2, H 2): (q, k, v, beta, g, gamma), a state
    to continue from (S_0 random and, for a window c > 1, the cache filled by the recurrence over
    the first `prefix` tokens), and cotangents for the outputs and the final S."""
    B, H = 2, 2
    c, d = spec.window, spec.feature_dim(K)
    ks = jax.random.split(jax.random.PRNGKey(seed), 10)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    k = 0.5 * k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, V))
    beta = 0.3 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    g = -jax.nn.softplus(jax.random.normal(ks[4], (B, T, H)))
    gamma = jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, H) + ((c,) if per_position else ())))
    state0 = spec.init_state(None, batch=B, heads=H, d_k=K, d_v=V,
                             params={"S": 0.1 * jax.random.normal(ks[6], (B, H, d, V))})
    if c > 1:
        def pre(x):
            return x[:, :prefix]
        _, state0 = spec(pre(q), pre(k), pre(v), beta=pre(beta), g=pre(g), gamma=pre(gamma),
                         initial_state=state0, output_final_state=True, impl="recurrent")
        assert float(jnp.min(state0.window.weights)) > 0
    co = jax.random.normal(ks[7], (B, T, H, V))
    cs = jax.random.normal(ks[8], (B, H, d, V))
    return (q, k, v, beta, g, gamma), state0, co, cs


def deep_spec_inputs(spec, seed, B, T, H, K, V, *, per_position_gates=False):
    """Random q, k (unit), v, every knob ``spec`` takes, a state mid-sequence (momentum moved off
    its initial value) and perturbed feature-map coefficients: (q, k, v, knobs, state, feature_params)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 10)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, V))
    knobs = {"beta": 0.3 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))}
    if spec.retention.needs_gate:
        knobs["g"] = jax.nn.log_sigmoid(2.0 + jax.random.normal(ks[4], (B, T, H)))
    if spec.opt_kind in ("momentum", "muon"):
        knobs["nu"] = jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, H)))
    if spec.objective.uses_delta:
        knobs["delta"] = 0.5 + jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    if spec.window > 1:
        shape = (B, T, H, spec.window) if per_position_gates else (B, T, H)
        knobs["gamma"] = jax.nn.sigmoid(jax.random.normal(ks[7], shape))
    state = spec.init_state(ks[8], batch=B, heads=H, d_k=K, d_v=V)
    # A state mid-sequence: momentum (and θ) away from their initial values.
    bump = lambda x, key: x + 0.1 * jax.random.normal(key, x.shape)
    leaves, tree = jax.tree.flatten(state.opt_state)
    keys = jax.random.split(ks[9], len(leaves) + 1)
    state = state._replace(opt_state=jax.tree.unflatten(tree, [bump(x, kk) for x, kk in zip(leaves, keys)]))
    feature_params = spec.feature_map.init_params()
    if isinstance(spec.feature_map, Polynomial):
        feature_params = {"coeffs": feature_params["coeffs"] * (1.0 + 0.1 * jax.random.normal(keys[-1], (3,)))}
    return q, k, v, knobs, state, feature_params


def equations(jaxpr):
    """Every equation of a jaxpr, its sub-programs' (scan, jit, checkpoint, custom rules…) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for x in (p if isinstance(p, (tuple, list)) else [p]):
                sub = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
                if hasattr(sub, "eqns"):
                    yield from equations(sub)


def dot_operand_dtypes(fn, *args, theta_shape=None):
    """The operand dtypes of every dot_general in ``fn``'s program (sub-programs included), or of
    those that take an operand shaped like θ's weight ``theta_shape`` ([d_in, d_out], or transposed)."""
    shapes = None if theta_shape is None else (tuple(theta_shape), tuple(theta_shape)[::-1])
    found = []
    for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name == "dot_general":
            avals = [v.aval for v in eqn.invars]
            if shapes is None or any(tuple(a.shape[-2:]) in shapes for a in avals):
                found.append(tuple(str(a.dtype) for a in avals))
    return found
