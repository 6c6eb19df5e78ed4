"""Delta-family ops: recurrent and chunked forms against an independent float64 loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax import ops
from helpers import random_inputs, rel

B, T, H = 2, 77, 2  # T odd: never a multiple of the chunk size
SPLIT = 30             # two-piece test: first piece length, not a multiple of any chunk size
IMPLS = [("recurrent", 64), ("chunk", 16), ("chunk", 32), ("chunk", 128)]   # 128 > T


# ---------------------------------------------------------------------------------------------
# Inputs and the independent reference


def make_inputs(seed, *, K=16, V=24, gate="scalar", strength="normal", n_h=None):
    """Random inputs: L2-normalised keys, sigmoid betas, log-sigmoid (or extreme) gates."""
    rng = np.random.default_rng(seed)
    extra = () if n_h is None else (n_h,)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H) + extra + (K,))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H) + extra + (V,))
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H) + extra)))
    gshape = {"none": None, "scalar": (B, T, H), "channel": (B, T, H, K)}[gate]
    g = None
    if gshape is not None:
        if strength == "normal":
            g = -np.logaddexp(0.0, -rng.standard_normal(gshape))        # log-sigmoid
        elif strength == "extreme":
            g = -5.0 - 3.0 * rng.random(gshape)                         # G down to -500 / chunk
        elif strength == "near0":
            g = -1e-3 * (0.1 + rng.random(gshape))
        else:
            raise ValueError(strength)
    s0 = rng.standard_normal((B, H, K, V))
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)   # noqa: E731
    return dict(q=f32(q), k=f32(k), v=f32(v), beta=f32(beta), g=f32(g), s0=f32(s0))


def reference(q, k, v, beta, g, s0, *, delta, scale, n_h=None):
    """Plain float64 loop over tokens (and DeltaProduct sub-steps) straight from the definition."""
    c = lambda x: None if x is None else np.asarray(x, np.float64)    # noqa: E731
    q, k, v, beta, g, S = c(q), c(k), c(v), c(beta), c(g), c(s0).copy()
    if n_h is None:                     # one sub-step per token
        k, v, beta = k[:, :, :, None], v[:, :, :, None], beta[:, :, :, None]
    o = np.zeros(q.shape[:3] + (v.shape[-1],))
    for t in range(q.shape[1]):
        if g is not None:
            d = np.exp(g[:, t])
            S = S * (d[..., None, None] if d.ndim == 2 else d[..., None])
        for j in range(k.shape[3]):
            kt, vt, bt = k[:, t, :, j], v[:, t, :, j], beta[:, t, :, j]
            err = vt - np.einsum("bhkv,bhk->bhv", S, kt) if delta else vt
            S = S + bt[..., None, None] * kt[..., :, None] * err[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, scale * q[:, t])
    return o, S


# Each case: (name, op, gate kind, delta, n_h)
CASES = {
    "delta_rule": (ops.delta_rule, "none", True, None),
    "gated_delta_rule": (ops.gated_delta_rule, "scalar", True, None),
    "kda": (ops.kda, "channel", True, None),
    "linear_attention": (ops.linear_attention, "none", False, None),
    "mamba2": (ops.linear_attention, "scalar", False, None),
    "gla": (ops.linear_attention, "channel", False, None),
    "delta_product": (ops.delta_product, "scalar", True, 3),
    "delta_product_nogate": (ops.delta_product, "none", True, 2),
}


def call(name, q, k, v, beta, g, s0, **kw):
    """Calls the op of case `name` with its own positional signature."""
    op = CASES[name][0]
    if op is ops.delta_rule:
        return op(q, k, v, beta, initial_state=s0, output_final_state=True, **kw)
    return op(q, k, v, g, beta, initial_state=s0, output_final_state=True, **kw)


# ---------------------------------------------------------------------------------------------
# Forward against the float64 loop


FWD = [(n, "normal", 16, 24) for n in CASES]
FWD += [("gated_delta_rule", s, 32, 16) for s in ("extreme", "near0")]
FWD += [("kda", s, 32, 16) for s in ("extreme", "near0")]
FWD += [("gla", "extreme", 16, 24), ("delta_product", "extreme", 32, 16)]


@pytest.mark.parametrize("name,strength,K,V", FWD)
def test_forward_matches_float64_loop(name, strength, K, V):
    _, gate, delta, n_h = CASES[name]
    x = make_inputs(hash((name, strength)) % 2**31, K=K, V=V, gate=gate, strength=strength,
                    n_h=n_h)
    scale = K ** -0.5
    o_ref, s_ref = reference(x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"], delta=delta,
                             scale=scale, n_h=n_h)
    for impl, cs in IMPLS:
        o, s = call(name, x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"], impl=impl,
                    chunk_size=cs)
        assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
        assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
        assert rel(o, o_ref) <= 1e-5, (impl, cs, rel(o, o_ref))
        assert rel(s, s_ref) <= 1e-5, (impl, cs, rel(s, s_ref))


def test_defaults_scale_no_state_auto():
    x = make_inputs(1, gate="scalar")
    o, s = ops.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert s is None
    zeros = jnp.zeros_like(x["s0"])
    o_ref, _ = reference(x["q"], x["k"], x["v"], x["beta"], x["g"], zeros, delta=True,
                         scale=16 ** -0.5)
    assert rel(o, o_ref) <= 1e-5
    # beta=None means 1.0 for the additive family.
    o, _ = ops.linear_attention(x["q"], x["k"], x["v"], impl="chunk", chunk_size=16)
    o_ref, _ = reference(x["q"], x["k"], x["v"], jnp.ones((B, T, H)), None, zeros,
                         delta=False, scale=16 ** -0.5)
    assert rel(o, o_ref) <= 1e-5


# ---------------------------------------------------------------------------------------------
# Gradients: chunk against recurrent


def _loss_grads(name, impl, chunk_size):
    def loss(q, k, v, beta, g, s0, co, cs):
        o, s = call(name, q, k, v, beta, g, s0, impl=impl, chunk_size=chunk_size)
        return jnp.sum(o * co) + jnp.sum(s * cs)
    argnums = (0, 1, 2, 3, 5) if CASES[name][1] == "none" else (0, 1, 2, 3, 4, 5)
    return jax.jit(jax.grad(loss, argnums=argnums))


GRAD = [("delta_rule", "normal", 16), ("gated_delta_rule", "normal", 16),
        ("gated_delta_rule", "extreme", 32), ("kda", "normal", 16), ("kda", "extreme", 32),
        ("mamba2", "normal", 32), ("gla", "normal", 16), ("linear_attention", "normal", 32),
        ("delta_product", "normal", 16)]


@pytest.mark.parametrize("name,strength,chunk_size", GRAD)
def test_chunk_gradients_match_recurrent(name, strength, chunk_size):
    _, gate, _, n_h = CASES[name]
    x = make_inputs(7, gate=gate, strength=strength, n_h=n_h)
    rng = np.random.default_rng(8)
    co = jnp.asarray(rng.standard_normal((B, T, H, 24)), jnp.float32)
    cs = jnp.asarray(rng.standard_normal((B, H, 16, 24)), jnp.float32)
    args = (x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"], co, cs)
    g_rec = _loss_grads(name, "recurrent", 64)(*args)
    g_chk = _loss_grads(name, "chunk", chunk_size)(*args)
    names = ["q", "k", "v", "beta", "g", "s0"] if gate != "none" else ["q", "k", "v", "beta",
                                                                       "s0"]
    for n, a, b in zip(names, g_chk, g_rec):
        assert np.all(np.isfinite(np.asarray(a))), n
        assert rel(a, b) <= 1e-5, (n, rel(a, b))


# ---------------------------------------------------------------------------------------------
# State carrying, extreme gates, bf16


@pytest.mark.parametrize("name", ["gated_delta_rule", "kda", "gla", "delta_product"])
def test_two_pieces_equal_whole(name):
    _, gate, _, n_h = CASES[name]
    x = make_inputs(3, gate=gate, n_h=n_h)
    kw = dict(impl="chunk", chunk_size=16)
    o, s = call(name, x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"], **kw)
    cut = lambda a, sl: None if a is None else a[:, sl]      # noqa: E731
    first, second = slice(0, SPLIT), slice(SPLIT, None)
    o1, s1 = call(name, *(cut(x[n], first) for n in ("q", "k", "v", "beta", "g")), x["s0"],
                  **kw)
    o2, s2 = call(name, *(cut(x[n], second) for n in ("q", "k", "v", "beta", "g")), s1, **kw)
    assert rel(jnp.concatenate([o1, o2], axis=1), o) <= 1e-5
    assert rel(s2, s) <= 1e-5


@pytest.mark.parametrize("name", ["gated_delta_rule", "kda", "gla"])
def test_no_nan_with_extreme_gates(name):
    _, gate, _, _ = CASES[name]
    x = make_inputs(5, gate=gate, strength="extreme")
    # Far beyond the float32 exp range inside one chunk: G reaches -50 * 32 = -1600.
    x["g"] = x["g"] * 10.0
    for impl, cs in [("recurrent", 64), ("chunk", 32)]:
        o, s = call(name, x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"], impl=impl,
                    chunk_size=cs)
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))

        def loss(q, k, v, beta, g, s0, impl=impl, cs=cs):
            o, s = call(name, q, k, v, beta, g, s0, impl=impl, chunk_size=cs)
            return jnp.sum(o) + jnp.sum(s)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))(
            x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"])
        for gr in grads:
            assert np.all(np.isfinite(np.asarray(gr)))


@pytest.mark.parametrize("name", ["gated_delta_rule", "kda"])
def test_bf16_inputs(name):
    _, gate, _, _ = CASES[name]
    x = make_inputs(11, gate=gate)
    o32, s32 = call(name, x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"], chunk_size=32)
    bf = {n: x[n].astype(jnp.bfloat16) for n in ("q", "k", "v", "beta", "g")}
    o16, s16 = call(name, bf["q"], bf["k"], bf["v"], bf["beta"], bf["g"], x["s0"],
                    chunk_size=32)
    assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    assert rel(o16, o32) <= 1e-2 and rel(s16, s32) <= 1e-2


# ---------------------------------------------------------------------------------------------
# Validation


def _valid(K=16, V=24):
    x = make_inputs(0, K=K, V=V, gate="scalar")
    x["gc"] = make_inputs(0, K=K, V=V, gate="channel")["g"]
    return x


def test_validation_errors():
    x = _valid()
    q, k, v, beta, g, gc, s0 = x["q"], x["k"], x["v"], x["beta"], x["g"], x["gc"], x["s0"]
    gdr, kda = ops.gated_delta_rule, ops.kda
    with pytest.raises(ValueError, match=r"`q`.*rank 4"):
        ops.delta_rule(q[0], k, v, beta)
    with pytest.raises(ValueError, match=r"`k`.*shape"):
        ops.delta_rule(q, k[..., :8], v, beta)
    with pytest.raises(ValueError, match=r"`v`.*shape"):
        ops.delta_rule(q, k, v[:, :5], beta)
    with pytest.raises(ValueError, match=r"`beta`.*shape"):
        ops.delta_rule(q, k, v, beta[..., None])
    with pytest.raises(ValueError, match=r"`initial_state`.*\[B, H, K, V\]"):
        ops.delta_rule(q, k, v, beta, initial_state=s0[..., :3])
    with pytest.raises(ValueError, match=r"gated_delta_rule.*`g`.*use atlas_jax\.ops\.kda"):
        gdr(q, k, v, gc, beta)
    with pytest.raises(ValueError, match=r"kda.*`g`.*use atlas_jax\.ops\.gated_delta_rule"):
        kda(q, k, v, g, beta)
    with pytest.raises(ValueError, match=r"`g`.*shape"):
        gdr(q, k, v, g[:, :5], beta)
    with pytest.raises(ValueError, match=r"`g` is required"):
        gdr(q, k, v, None, beta)
    with pytest.raises(ValueError, match=r"linear_attention.*`g`"):
        ops.linear_attention(q, k, v, g[..., None, None])
    with pytest.raises(TypeError, match=r"`q`.*floating"):
        ops.delta_rule(q.astype(jnp.int32), k, v, beta)
    with pytest.raises(TypeError, match=r"`g`.*floating"):
        gdr(q, k, v, g.astype(jnp.int32), beta)
    for bad in (0, -16, 16.0, True, "64"):
        with pytest.raises(ValueError, match=r"`chunk_size`"):
            gdr(q, k, v, g, beta, chunk_size=bad)
    with pytest.raises(ValueError, match=r"`impl`"):
        gdr(q, k, v, g, beta, impl="triton")
    with pytest.raises(ValueError, match=r"`scale`"):
        gdr(q, k, v, g, beta, scale=jnp.ones(3))
    with pytest.raises(NotImplementedError, match=r"impl='pallas'"):
        gdr(q, k, v, g, beta, impl="pallas")


def test_validation_delta_product():
    x = make_inputs(0, gate="scalar", n_h=2)
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["g"]
    with pytest.raises(ValueError, match=r"delta_product.*`k`.*\[B, T, H, n_h, K\]"):
        ops.delta_product(q, k[:, :, :, 0], v, g, beta)
    with pytest.raises(ValueError, match=r"delta_product.*`v`.*\[B, T, H, n_h, V\]"):
        ops.delta_product(q, k, v[:, :, :, :1], g, beta)
    with pytest.raises(ValueError, match=r"delta_product.*`beta`.*\[B, T, H, n_h\]"):
        ops.delta_product(q, k, v, g, beta[..., 0])


# ---- impl="pallas" through the public ops (interpret mode on CPU), varlen and q/k normalisation


def _pallas_inputs(seed, gate, B=1, T=37, H=2, K=16, V=32):
    """helpers.random_inputs (g None without a gate) and an initial state from the same seed."""
    q, k, v, beta, g = random_inputs(seed, B, T, H, K, V, channel=gate == "channel")
    s0 = jax.random.normal(jax.random.split(jax.random.PRNGKey(seed), 6)[5], (B, H, K, V))
    return q, k, v, beta, None if gate is None else g, s0


@pytest.mark.parametrize("op", ["delta_rule", "gated_delta_rule", "kda"])
def test_pallas_impl_matches_chunk_outputs_states_and_gradients(op):
    gate = {"delta_rule": None, "gated_delta_rule": "scalar", "kda": "channel"}[op]
    q, k, v, beta, g, s0 = _pallas_inputs(11, gate)
    fn = getattr(ops, op)
    args = (q, k, v, beta) if g is None else (q, k, v, g, beta)

    def loss(impl, *a):
        o, s = fn(*a, initial_state=s0, output_final_state=True, impl=impl, chunk_size=16)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(s * s), (o, s)

    grads = {}
    for impl in ("chunk", "pallas"):
        grads[impl], (o, s) = jax.grad(lambda *a: loss(impl, *a), argnums=tuple(range(len(args))),
                                       has_aux=True)(*args)
        grads[impl] = (o, s) + tuple(grads[impl])
    for a, b in zip(grads["pallas"], grads["chunk"]):
        assert rel(a, b) < 1e-5


def test_pallas_rejects_what_the_kernels_do_not_cover():
    q, k, v, beta, g, s0 = _pallas_inputs(12, None, K=16, V=24)
    with pytest.raises(NotImplementedError, match=r"impl='pallas' does not support head dims"):
        ops.delta_rule(q, k, v, beta, impl="pallas")
    q, k, v, beta, g, s0 = _pallas_inputs(12, None)
    with pytest.raises(NotImplementedError, match=r"delta write only"):
        ops.linear_attention(q, k, v, None, beta, impl="pallas")
    # on CPU, auto keeps to the XLA chunk form
    o_auto, _ = ops.delta_rule(q, k, v, beta, impl="auto", chunk_size=16)
    o_chunk, _ = ops.delta_rule(q, k, v, beta, impl="chunk", chunk_size=16)
    assert rel(o_auto, o_chunk) == 0.0


@pytest.mark.parametrize("op", ["delta_rule", "gated_delta_rule", "kda"])
def test_value_head_dim_512_xla_forms_and_kernel_coverage(op):
    """fla's GatedDeltaNet head shape (K = 256, expand_v = 2: V = 512): the recurrent and chunk
    forms against the float64 loop (a few tokens, one head), and the kernels cover it on GPU
    (V = 512 with K in the GPU head dims; K = 512 stays out)."""
    from atlas_jax.kernels.delta_family import support
    gate = {"delta_rule": "none", "gated_delta_rule": "scalar", "kda": "channel"}[op]
    rng = np.random.default_rng(31)
    b, t, h, kd, vd = 1, 9, 1, 256, 512
    q = jnp.asarray(rng.standard_normal((b, t, h, kd)), jnp.float32)
    k = rng.standard_normal((b, t, h, kd))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, t, h, vd)), jnp.float32)
    beta = jnp.asarray(rng.random((b, t, h)), jnp.float32)
    g = {"none": None, "scalar": -jnp.asarray(rng.random((b, t, h)), jnp.float32),
         "channel": -jnp.asarray(rng.random((b, t, h, kd)), jnp.float32)}[gate]
    s0 = jnp.asarray(rng.standard_normal((b, h, kd, vd)), jnp.float32)
    o_ref, s_ref = reference(q, k, v, beta, g, s0, delta=True, scale=kd ** -0.5)
    fn = getattr(ops, op)
    args = (q, k, v, beta) if g is None else (q, k, v, g, beta)
    for impl in ("recurrent", "chunk"):
        o, s = fn(*args, initial_state=s0, output_final_state=True, impl=impl, chunk_size=4)
        assert rel(o, o_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5, impl
    call_ = support.DeltaCall(B=b, T=t, H=h, K=kd, V=vd, n_states=b, gate=gate)
    f32 = (jnp.dtype(jnp.float32),) * 3
    assert support.kernel_gap(call_, f32, 64, delta=True, interpret=False) is None
    wide_k = support.DeltaCall(B=b, T=t, H=h, K=vd, V=kd, n_states=b, gate=gate)
    assert "K=512" in support.kernel_gap(wide_k, f32, 64, delta=True, interpret=False)


@pytest.mark.parametrize("impl", ["recurrent", "chunk", "pallas"])
def test_packed_sequences_equal_separate_runs(impl):
    q, k, v, beta, g, _ = _pallas_inputs(13, "scalar", T=45)
    cu = np.array([0, 10, 10, 31, 45])
    s0 = jax.random.normal(jax.random.PRNGKey(14), (4, 2, 16, 32))
    o, s = ops.gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, impl=impl,
                                chunk_size=16, cu_seqlens=cu)
    for i in range(4):
        a, b = cu[i], cu[i + 1]
        if a == b:
            assert rel(s[i], s0[i]) == 0.0
            continue
        oi, si = ops.gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                      initial_state=s0[i:i + 1], output_final_state=True, impl="recurrent")
        assert rel(o[:, a:b], oi) < 1e-5 and rel(s[i], si[0]) < 1e-5


def test_cu_seqlens_errors():
    q, k, v, beta, g, _ = _pallas_inputs(15, "scalar", T=20)
    with pytest.raises(ValueError, match=r"`cu_seqlens` must be non-decreasing offsets from 0 to T = 20"):
        ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.array([0, 5, 19]))
    with pytest.raises(ValueError, match=r"`initial_state` must have shape \[N, H, K, V\]"):
        ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens=np.array([0, 5, 20]),
                             initial_state=jnp.zeros((1, 2, 16, 32)))


@pytest.mark.parametrize("impl", ["chunk", "pallas"])
def test_qk_l2norm_in_kernel_equals_normalising_first(impl):
    q, k, v, beta, g, s0 = _pallas_inputs(16, "channel")
    k = 3.0 * k
    o, _ = ops.kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, impl=impl, chunk_size=16)
    unit = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    o_ref, _ = ops.kda(unit(q), unit(k), v, g, beta, impl="recurrent")
    assert rel(o, o_ref) < 1e-5


# ---- run_delta_family: the one validated entry behind the five ops


def test_run_delta_family_is_the_entry_of_the_ops():
    q, k, v, beta, g, s0 = _pallas_inputs(17, "scalar")
    assert ops.IMPLS == ("recurrent", "chunk", "pallas", "auto")
    for delta, op, args in ((True, ops.gated_delta_rule, (q, k, v, g, beta)),
                            (False, ops.linear_attention, (q, k, v, g, beta))):
        o, s = ops.run_delta_family(q, k, v, beta, g, delta=delta, initial_state=s0,
                                    output_final_state=True, impl="chunk", chunk_size=16)
        o_ref, s_ref = op(*args, initial_state=s0, output_final_state=True, impl="recurrent")
        assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5
    with pytest.raises(NotImplementedError, match=r"run_delta_family: impl='pallas'.*delta write"):
        ops.run_delta_family(q, k, v, beta, g, delta=False, impl="pallas", chunk_size=16)
    with pytest.raises(ValueError, match=r"run_delta_family: argument `cu_seqlens` must be "
                                         r"non-decreasing offsets from 0 to T = 37"):
        ops.run_delta_family(q, k, v, beta, g, cu_seqlens=np.array([0, 5, 30]))


def test_importing_the_ops_imports_no_pallas():
    import subprocess
    import sys
    code = ("import sys, atlas_jax.ops; "
            "sys.exit(any(m.startswith('jax.experimental.pallas') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
