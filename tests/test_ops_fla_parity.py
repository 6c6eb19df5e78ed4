"""fla's parity arguments of the delta-family ops (issue 23): grouped value heads (HV = G * H),
use_gate_in_kernel with A_log / dt_bias (and KDA's lower_bound / safe_gate),
use_beta_sigmoid_in_kernel, allow_neg_eigval and state_v_first.

Each is checked against the mathematically equivalent unfused call: q and k repeated per group,
the gate and beta activations computed outside (plain jax.numpy, float32), states transposed
outside, run by the float32 recurrent reference. Outputs, final states and every gradient (q, k,
v, the raw g and beta, A_log, dt_bias, the initial state) within 1e-5 in float32, for every impl
("pallas" runs the GPU kernels in Pallas interpret mode; the TPU kernels are called directly in
TPU interpret mode), odd T, packed sequences and initial states. Tiny shapes (interpret mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax import ops
from helpers import rel

B, T, H, G, K, V = 1, 37, 2, 2, 16, 32        # T odd; HV = G * H value heads
HV = G * H
f32 = jnp.float32


def make(seed, op, *, b=B, t=T, n_states=None):
    """Raw inputs: q, k [B, T, H, K] (k unit), v [B, T, HV, V], beta logits, the raw gate input
    (or None), A_log [HV], dt_bias ([HV] or [HV * K]), initial state [n, HV, V, K] (V-first)."""
    r = np.random.default_rng(seed)

    def a(*shape, s=1.0):
        return jnp.asarray(s * r.standard_normal(shape), f32)

    k = a(b, t, H, K)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    gshape = {"delta_rule": None, "gated_delta_rule": (b, t, HV), "kda": (b, t, HV, K)}[op]
    x = dict(q=a(b, t, H, K), k=k, v=a(b, t, HV, V), beta=a(b, t, HV),
             g=None if gshape is None else a(*gshape),
             A_log=None if gshape is None else a(HV, s=0.5),
             dt_bias=None if gshape is None else a(HV if op == "gated_delta_rule" else HV * K),
             s0=a(n_states or b, HV, V, K))
    return x


def activated(op, x, *, neg_eigval=True, lower_bound=None):
    """The unfused equivalent: activations outside (float32), q and k repeated per group, the
    state in the [K, V] layout."""
    beta = jax.nn.sigmoid(x["beta"]) * (2.0 if neg_eigval else 1.0)
    g = None
    if x["g"] is not None:
        a = jnp.exp(x["A_log"])
        if op == "kda":
            bias = x["dt_bias"].reshape(HV, K)
            a = a[:, None]
        else:
            bias = x["dt_bias"]
        if lower_bound is None:
            g = -a * jax.nn.softplus(x["g"] + bias)
        else:
            g = lower_bound * jax.nn.sigmoid(a * (x["g"] + bias))
    rep = lambda y: jnp.repeat(y, G, axis=2)          # noqa: E731
    return rep(x["q"]), rep(x["k"]), x["v"], beta, g, jnp.swapaxes(x["s0"], -1, -2)


def fused_fn(op, impl, chunk_size=16, cu=None, **kw):
    """The fused call of `op` as a function of the raw arrays (state V-first in and out)."""
    def fn(q, k, v, beta, g, A_log, dt_bias, s0):
        common = dict(initial_state=s0, output_final_state=True, impl=impl,
                      chunk_size=chunk_size, cu_seqlens=cu, use_beta_sigmoid_in_kernel=True,
                      allow_neg_eigval=True, state_v_first=True)
        if op == "delta_rule":
            return ops.delta_rule(q, k, v, beta, **common)
        return getattr(ops, op)(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log,
                                dt_bias=dt_bias, **common, **kw)
    return fn


def unfused_fn(op, cu=None, **kw):
    """The same call unfused, by the float32 recurrent reference (per sequence with cu)."""
    def fn(q, k, v, beta, g, A_log, dt_bias, s0):
        x = dict(q=q, k=k, v=v, beta=beta, g=g, A_log=A_log, dt_bias=dt_bias, s0=s0)
        q, k, v, beta, g, s0 = activated(op, x, **kw)
        o, s = ops.run_delta_family(q, k, v, beta, g, initial_state=s0, output_final_state=True,
                                    impl="recurrent", cu_seqlens=cu)
        return o, jnp.swapaxes(s, -1, -2)
    return fn


NAMES = ("q", "k", "v", "beta", "g", "A_log", "dt_bias", "s0")


def check(fused, unfused, x, tol=1e-5, seed=0):
    args = [x[n] for n in NAMES]
    o1, s1 = fused(*args)
    o2, s2 = unfused(*args)
    assert o1.shape == o2.shape == x["v"].shape and s1.shape == x["s0"].shape
    assert rel(o1, o2) < tol and rel(s1, s2) < tol, (rel(o1, o2), rel(s1, s2))
    r = np.random.default_rng(seed + 99)
    wo = jnp.asarray(r.standard_normal(o2.shape), f32)
    ws = jnp.asarray(r.standard_normal(s2.shape), f32)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)

    def loss(fn):
        def f(*a):
            o, s = fn(*a)
            return jnp.sum(o.astype(f32) * wo) + jnp.sum(s * ws)
        return f

    g1 = jax.grad(loss(fused), argnums)(*args)
    g2 = jax.grad(loss(unfused), argnums)(*args)
    for i, a, b in zip(argnums, g1, g2):
        assert a.shape == args[i].shape, NAMES[i]
        assert rel(a, b) < tol, (NAMES[i], rel(a, b))


# ---------------------------------------------------------------------------------------------
# Every argument at once, every impl (the kernels: grouped heads through their BlockSpecs)


@pytest.mark.parametrize("op", ["delta_rule", "gated_delta_rule", "kda"])
@pytest.mark.parametrize("impl", ["recurrent", "chunk", "pallas"])
def test_fused_call_equals_unfused(op, impl):
    x = make(1, op)
    check(fused_fn(op, impl), unfused_fn(op), x)


@pytest.mark.parametrize("op,impl", [("gated_delta_rule", "chunk"),
                                     ("gated_delta_rule", "pallas"), ("kda", "pallas")])
def test_packed_sequences(op, impl):
    """cu_seqlens (an empty sequence, lengths not multiples of the chunk) with grouped heads and
    the fused gate."""
    cu = np.array([0, 9, 9, 30, 41], np.int32)
    x = make(2, op, t=41, n_states=4)
    check(fused_fn(op, impl, cu=cu), unfused_fn(op, cu=cu), x)


@pytest.mark.parametrize("safe_gate", [False, True])
def test_kda_lower_bound_gate(safe_gate):
    """KDA's bounded gate lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (safe_gate: fla's
    speed hint, no numeric change here), through the kernels too."""
    x = make(3, "kda")
    for impl in ("recurrent", "chunk") + (("pallas",) if safe_gate else ()):
        check(fused_fn("kda", impl, lower_bound=-5.0, safe_gate=safe_gate),
              unfused_fn("kda", lower_bound=-5.0), x)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_raw_gate_minus_inf(lower_bound):
    """A raw gate of -inf (a masked position) activates to exactly 0 (no decay) with finite
    gradients in both forms (the bounded one's gradient in A_log would be 0 * inf there
    unmasked), through the XLA forms and the kernels alike."""
    x = make(4, "kda")
    x["g"] = x["g"].at[0, 5:9].set(-jnp.inf).at[0, 20, 1].set(-jnp.inf)
    args = [x[n] for n in NAMES]

    def loss(impl):
        def f(*a):
            o, s = fused_fn("kda", impl, lower_bound=lower_bound)(*a)
            return jnp.sum(o * o) + jnp.sum(s * s)
        return f

    finite = [jnp.where(jnp.isinf(a), 0.0, a) if i == 4 else a for i, a in enumerate(args)]
    grads = {}
    for impl in ("chunk", "pallas"):
        grads[impl] = jax.grad(loss(impl), (0, 1, 2, 3, 5, 6, 7))(*args)
        for n, gr in zip(("q", "k", "v", "beta", "A_log", "dt_bias", "s0"), grads[impl]):
            assert bool(jnp.all(jnp.isfinite(gr))), (impl, n)
    for a, b in zip(grads["chunk"], grads["pallas"]):
        assert rel(a, b) < 1e-5
    # the same call with those gates given as already-activated zeros: equal outputs
    o1, _ = fused_fn("kda", "chunk", lower_bound=lower_bound)(*args)
    q, k, v, beta, g, s0 = activated("kda", dict(zip(NAMES, finite)), lower_bound=lower_bound)
    g = jnp.where(jnp.isinf(x["g"]), 0.0, g)
    o2, _ = ops.run_delta_family(q, k, v, beta, g, initial_state=s0, output_final_state=True,
                                 impl="recurrent")
    assert rel(o1, o2) < 1e-5


def test_bf16_grouped_heads_fused_gate():
    """bf16 q, k, v through the kernels (fused gate, grouped heads) within the bf16 bar of the
    float32 unfused call on the same (rounded) inputs."""
    x = make(5, "gated_delta_rule")
    for n in ("q", "k", "v"):
        x[n] = x[n].astype(jnp.bfloat16)
    o1, s1 = fused_fn("gated_delta_rule", "pallas", chunk_size=32)(*[x[n] for n in NAMES])
    up = dict(x, **{n: x[n].astype(f32) for n in ("q", "k", "v")})
    o2, s2 = unfused_fn("gated_delta_rule")(*[up[n] for n in NAMES])
    assert o1.dtype == jnp.bfloat16
    assert rel(o1, o2) < 1e-2 and rel(s1, s2) < 1e-2


@pytest.mark.parametrize("gate,fused", [("scalar", True), ("channel", False)])
def test_tpu_kernels_grouped_heads(gate, fused):
    """The TPU kernels (TPU interpret mode) with grouped value heads: q/k BlockSpecs map value
    head h to h // G, dq and dk summed over each group."""
    from atlas_jax.kernels.delta_family.tpu import BlockSizes, chunk_delta_family_tpu
    op = {"scalar": "gated_delta_rule", "channel": "kda"}[gate]
    x = make(6, op)
    q, k, v, beta, g, s0 = activated(op, x)
    bs = BlockSizes(16, sub_chunk=8, fused=fused)

    def tpu(q_, k_, v_, beta_, g_, s0_):
        return chunk_delta_family_tpu(q_, k_, v_, beta_, g_, scale=0.5, initial_state=s0_,
                                      output_final_state=True, block_sizes=bs)

    def ref(q_, k_, v_, beta_, g_, s0_):
        return ops.run_delta_family(jnp.repeat(q_, G, 2), jnp.repeat(k_, G, 2), v_, beta_, g_,
                                    scale=0.5, initial_state=s0_, output_final_state=True,
                                    impl="recurrent")

    args = (x["q"], x["k"], v, beta, g, s0)
    o1, s1 = tpu(*args)
    o2, s2 = ref(*args)
    assert rel(o1, o2) < 1e-5 and rel(s1, s2) < 1e-5
    w = jnp.asarray(np.random.default_rng(7).standard_normal(o2.shape), f32)
    g1 = jax.grad(lambda *a: jnp.sum(tpu(*a)[0] * w) + jnp.sum(tpu(*a)[1]),
                  argnums=(0, 1, 2, 3, 4, 5))(*args)
    g2 = jax.grad(lambda *a: jnp.sum(ref(*a)[0] * w) + jnp.sum(ref(*a)[1]),
                  argnums=(0, 1, 2, 3, 4, 5))(*args)
    for n, a, b in zip(("q", "k", "v", "beta", "g", "s0"), g1, g2):
        assert rel(a, b) < 1e-5, (n, rel(a, b))


# ---------------------------------------------------------------------------------------------
# One clear error per bad combination, naming the argument


def test_bad_combinations_name_the_argument():
    x = make(8, "gated_delta_rule")
    q, k, v, beta, g, A_log, dt_bias = (x[n] for n in NAMES[:7])
    gdr, kda = ops.gated_delta_rule, ops.kda
    with pytest.raises(ValueError, match=r"`v` has HV = 3 heads, not a multiple of the H = 2"):
        gdr(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match=r"`A_log` is only used with use_gate_in_kernel=True"):
        gdr(q, k, v, g, beta, A_log=A_log)
    with pytest.raises(ValueError, match=r"`dt_bias` is only used with use_gate_in_kernel=True"):
        gdr(q, k, v, g, beta, dt_bias=dt_bias)
    with pytest.raises(ValueError, match=r"`dt_bias` must have shape \[HV\] = \(4,\)"):
        gdr(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias[:3])
    with pytest.raises(ValueError, match=r"`A_log` \[HV\] = \(4,\) is required"):
        gdr(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=r"`A_log` must have shape \[HV\] = \(4,\)"):
        gdr(q, k, v, g, beta, use_gate_in_kernel=True, A_log=A_log[:2])
    with pytest.raises(ValueError, match=r"`allow_neg_eigval=True` requires"):
        gdr(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match=r"`beta` is required with use_beta_sigmoid"):
        ops.delta_rule(q, k, v, None, use_beta_sigmoid_in_kernel=True)
    with pytest.raises(ValueError, match=r"`initial_state` must have shape \[B, HV, V, K\]"):
        gdr(q, k, v, g, beta, initial_state=jnp.zeros((B, HV, K, V)), state_v_first=True)
    xk = make(9, "kda")
    qk, kk, vk, bk, gk, Ak, dk = (xk[n] for n in NAMES[:7])
    with pytest.raises(ValueError, match=r"`dt_bias` must have shape \[HV \* K\] = \(64,\)"):
        kda(qk, kk, vk, gk, bk, use_gate_in_kernel=True, A_log=Ak, dt_bias=dk[:HV])
    with pytest.raises(ValueError, match=r"`lower_bound` must be in \[-5, 0\)"):
        kda(qk, kk, vk, gk, bk, use_gate_in_kernel=True, A_log=Ak, safe_gate=True)
    with pytest.raises(ValueError, match=r"`lower_bound` must be in \[-5, 0\)"):
        kda(qk, kk, vk, gk, bk, use_gate_in_kernel=True, A_log=Ak, safe_gate=True,
            lower_bound=-7.0)
    # KDA's bounded gate needs no A_log (exp(A_log) = 1), as fla
    o, _ = kda(qk, kk, vk, gk, bk, use_gate_in_kernel=True, lower_bound=-5.0, impl="chunk",
               chunk_size=16)
    assert np.all(np.isfinite(np.asarray(o)))


# ---------------------------------------------------------------------------------------------
# Real GPU (compiled Triton kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_gpu_fused_gate_grouped_heads(op, dtype, tol):
    """Every parity argument through the compiled kernels at K = V = 128, HV = 2 H, T = 300,
    against the float32 unfused reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    global K, V
    saved = K, V
    K, V = 128, 128
    try:
        x = make(10, op, t=300)
        for n in ("q", "k", "v"):
            x[n] = x[n].astype(dtype)
        args = [x[n] for n in NAMES]
        o1, s1 = fused_fn(op, "pallas", chunk_size=64)(*args)
        up = [a.astype(f32) if i < 3 else a for i, a in enumerate(args)]
        o2, s2 = unfused_fn(op)(*up)
        assert rel(o1, o2) < tol and rel(s1, s2) < tol, (rel(o1, o2), rel(s1, s2))
        if dtype == jnp.float32:
            check(fused_fn(op, "pallas", chunk_size=64), unfused_fn(op), x, tol=tol)
    finally:
        K, V = saved


# ---------------------------------------------------------------------------------------------
# The GPU kernels' own activation (use_gate_in_kernel on the scalar gate, beta logits): a primal
# call's kernels activate g and beta on load in every layout; a differentiated call activates
# them once in XLA and its backward kernels read them


@pytest.mark.parametrize("layout", ["one_k1_fused_output_one_k4", "unsplit_k1"])
def test_gpu_kernels_activate_on_load(layout):
    """chunk_delta_family_gpu with the raw gate, A_log, dt_bias and beta logits against the same
    kernels (same layout) fed the XLA-activated gate and beta: outputs, final state and every
    gradient (raw g, A_log, dt_bias, beta logits included) within 1e-5, odd T (padded with a raw
    -inf gate), an initial state, grouped value heads. The layouts where K1 / K2 / K2o read g
    themselves (the default, where K1b stores the cumulative gate, runs in the tests above)."""
    from atlas_jax.kernels.delta_family.gpu import GpuBlockSizes
    bs = {"one_k1_fused_output_one_k4": GpuBlockSizes(
              fuse_output=True, split_intra=False, split_state_bwd=False, split_intra_bwd=False),
          "unsplit_k1": GpuBlockSizes(split_intra=False)}[layout]
    x = make(12, "gated_delta_rule")
    kw = dict(scale=0.25, output_final_state=True, chunk_size=16, interpret=True, block_sizes=bs)
    check(gpu_kernel_call(True, **kw), gpu_kernel_call(False, **kw),
          dict(x, s0=jnp.swapaxes(x["s0"], -1, -2)))


def gpu_kernel_call(fused, **kw):
    """chunk_delta_family_gpu as a function of fla's raw arrays: fused (the kernels take the raw
    gate and beta logits) or with both activated outside by XLA."""
    from atlas_jax.kernels.delta_family.gpu import chunk_delta_family_gpu

    def fn(q, k, v, beta, g, A_log, dt_bias, s0=None):
        if fused:
            return chunk_delta_family_gpu(q, k, v, beta, g, initial_state=s0,
                                          use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                          use_beta_sigmoid_in_kernel=True, **kw)
        g = -jnp.exp(A_log) * jax.nn.softplus(g + dt_bias)
        return chunk_delta_family_gpu(q, k, v, jax.nn.sigmoid(beta), g, initial_state=s0, **kw)
    return fn


def test_gpu_kernels_fused_gate_lowering():
    """The CUDA lowering (no GPU needed) with the fused gate and beta logits: the same Triton
    kernels as the activated call, and the forward has no activation outside them (no softplus's
    log1p, no sigmoid in the exported program)."""
    import re
    from jax import export
    x = make(13, "gated_delta_rule", t=128)
    q, k, v = (x[n].astype(jnp.bfloat16) for n in ("q", "k", "v"))
    q, k = (jnp.pad(a, [(0, 0)] * 3 + [(0, 112)]) for a in (q, k))      # K = 128 on a GPU
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, 96)])

    def lower(fused, grad):
        fwd = gpu_kernel_call(fused, scale=0.1, output_final_state=True, chunk_size=64,
                              interpret=False)

        def loss(*a):
            o, s = fwd(*a)
            return jnp.sum(o.astype(f32)) + jnp.sum(s)
        fn = jax.value_and_grad(loss, argnums=tuple(range(7))) if grad else fwd
        return export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(q, k, v, x["beta"], x["g"], x["A_log"], x["dt_bias"]).mlir_module()

    for grad in (False, True):
        fused, unfused = lower(True, grad), lower(False, grad)
        assert fused.count("xla.gpu.triton") == unfused.count("xla.gpu.triton") >= 4
    assert not re.search(r"log_plus_one|logistic", lower(True, False))
    assert re.search(r"log_plus_one", lower(False, False))
