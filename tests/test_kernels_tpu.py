"""TPU Pallas delta-family kernels, run in TPU *interpret* mode on CPU (there is no TPU here).

Every case compares the kernels' outputs, final states and gradients (one jitted VJP per case)
with the plain-XLA chunked form and the float32 scan. Interpret mode compiles slowly, so shapes
are tiny (B, H <= 2, T < 64, K = 16, V = 24, chunk 16, sub-chunk 8), plus one case with the
default tiles (K = V = 128, chunk 64, sub-chunk 16); more of those are `slow`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.kernels.delta_family.support import L2NORM_EPS
from atlas_jax.kernels.delta_family.tpu import BlockSizes, chunk_delta_family_tpu
from atlas_jax.ops.delta_family import chunk_delta_family, recurrent_delta_family
from helpers import make_inputs, rel

B, T, H, K, V = 2, 37, 2, 16, 24          # T odd: not a multiple of the chunk
SMALL = BlockSizes(chunk_size=16, sub_chunk=8)
SCALE = 0.3
F32_TOL, BF16_TOL = 1e-5, 1e-2


def make(seed, *, gate, strength="normal", b=B, t=T, h=H, k_dim=K, v_dim=V, n_states=None):
    """helpers.make_inputs: float32, unit keys, sigmoid betas, log-decays <= 0."""
    return make_inputs(seed, gate=gate, B=b, T=t, H=h, K=k_dim, V=v_dim, strength=strength,
                       n_states=n_states)[0]


def cotangents(seed, o_shape, s_shape, dtype):
    rng = np.random.default_rng(seed + 1000)
    return (jnp.asarray(rng.standard_normal(o_shape), dtype),
            jnp.asarray(rng.standard_normal(s_shape), jnp.float32))


@functools.partial(jax.jit, static_argnums=(0,))
def vjp_all(fn, args, cts):
    """(o, final state, grads wrt every non-None input) of fn(q, k, v, beta, g, s0)."""
    (o, s), pull = jax.vjp(fn, *args)
    return o, s, pull(cts)


def tpu_fn(**kw):
    def fn(q, k, v, beta, g, s0):
        return chunk_delta_family_tpu(q, k, v, beta, g, scale=SCALE, initial_state=s0,
                                      output_final_state=True, **kw)
    return fn


def xla_fn(chunk_size=16):
    def fn(q, k, v, beta, g, s0):
        return chunk_delta_family(q, k, v, beta, g, scale=SCALE, initial_state=s0,
                                  output_final_state=True, chunk_size=chunk_size)
    return fn


def scan_fn(q, k, v, beta, g, s0):
    return recurrent_delta_family(q, k, v, beta, g, scale=SCALE, initial_state=s0,
                                  output_final_state=True)


# Cached per process: the kernel and reference closures must be the same objects between
# cases, or every case would recompile.
TPU_SMALL = tpu_fn(block_sizes=SMALL)
TPU_SPLIT = tpu_fn(block_sizes=dataclasses.replace(SMALL, fused=False))
XLA_16 = xla_fn(16)


def assert_close(got, want, tol, what):
    o, s, grads = got
    o_r, s_r, grads_r = want
    errs = {"o": rel(o, o_r), "final_state": rel(s, s_r)}
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dstate0"), grads, grads_r):
        if b is not None:
            errs[name] = rel(a, b)
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: relative errors above {tol}: {bad} (all: {errs})"


# ---------------------------------------------------------------------------------------------
# Outputs, final states and gradients against the XLA chunked form and the float32 scan


# One test per compiled kernel configuration (gate kind x fused): the gate strengths share the
# compilation, which is most of the cost in interpret mode.
@pytest.mark.parametrize("gate,fused,strengths", [
    ("none", True, ["normal"]),
    ("scalar", True, ["extreme", "near0"]),          # g in [-8, -5]: G ~ -100 per chunk
    ("channel", True, ["extreme", "near0", "normal"]),
    ("scalar", False, ["extreme"]),
    ("channel", False, ["extreme", "normal"]),
])
def test_matches_xla_chunked_and_scan(gate, fused, strengths):
    for seed, strength in enumerate(strengths):
        args = make(seed, gate=gate, strength=strength)
        cts = cotangents(seed, (B, T, H, V), (B, H, K, V), jnp.float32)
        got = vjp_all(TPU_SMALL if fused else TPU_SPLIT, args, cts)
        o, s, grads = got
        assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
        assert s.shape == (B, H, K, V) and s.dtype == jnp.float32
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
        what = f"{gate}/{strength}/{'fused' if fused else 'split'}"
        assert_close(got, vjp_all(XLA_16, args, cts), F32_TOL, what + " vs XLA chunk")
        assert_close(got, vjp_all(scan_fn, args, cts), F32_TOL, what + " vs scan")


def test_forward_only_without_states():
    """The primal path (no VJP): no initial state, no final state, beta None."""
    q, k, v, _, g, _ = make(1, gate="scalar")
    run = jax.jit(lambda q, k, v, g: chunk_delta_family_tpu(q, k, v, None, g, scale=SCALE,
                                                            block_sizes=SMALL))
    o, s = run(q, k, v, g)
    assert s is None
    o_r, _ = chunk_delta_family(q, k, v, None, g, scale=SCALE, chunk_size=16)
    assert rel(o, o_r) < F32_TOL


def test_bfloat16_inputs():
    """bf16 q/k/v (float32 state and accumulation) against the float32 form on the same values."""
    args = make(2, gate="scalar")
    q, k, v = (x.astype(jnp.bfloat16) for x in args[:3])
    cts = cotangents(2, (B, T, H, V), (B, H, K, V), jnp.bfloat16)
    got = vjp_all(TPU_SMALL, [q, k, v] + args[3:], cts)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    assert got[2][0].dtype == jnp.bfloat16
    up = [x.astype(jnp.float32) for x in (q, k, v)] + args[3:]
    want = vjp_all(XLA_16, up, (cts[0].astype(jnp.float32), cts[1]))
    assert_close(got, want, BF16_TOL, "bf16 scalar gate")


def test_normalize_qk_matches_normalising_outside():
    q, k, v, beta, g, s0 = make(3, gate="scalar")
    q, k = 3.0 * q, 0.5 * k + 0.1                                 # not unit: the norm matters
    cts = cotangents(3, (B, T, H, V), (B, H, K, V), jnp.float32)

    def outside(q, k, v, beta, g, s0):
        n = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + L2NORM_EPS)  # noqa: E731
        return XLA_16(n(q), n(k), v, beta, g, s0)

    got = vjp_all(tpu_fn(block_sizes=SMALL, normalize_qk=True), [q, k, v, beta, g, s0], cts)
    assert_close(got, vjp_all(outside, [q, k, v, beta, g, s0], cts), F32_TOL, "normalize_qk")


@pytest.mark.parametrize("fused", [True, False])
def test_packed_sequences_match_separate_runs(fused):
    """cu_seqlens (with an empty sequence): no state leaks across boundaries, per-sequence
    initial/final states, gradients equal to those of separate runs."""
    cu = np.array([0, 5, 5, 23, 40], np.int32)          # lengths 5, 0, 18, 17
    n = len(cu) - 1
    Tp = int(cu[-1])
    q, k, v, beta, g, s0 = make(4, gate="channel", b=1, t=Tp, n_states=n)
    cts = cotangents(4, (1, Tp, H, V), (n, H, K, V), jnp.float32)
    sizes = dataclasses.replace(SMALL, fused=fused)
    got = vjp_all(tpu_fn(block_sizes=sizes, cu_seqlens=cu), [q, k, v, beta, g, s0], cts)

    def separate(q, k, v, beta, g, s0):
        outs, finals = [], []
        for i in range(n):
            a, b = int(cu[i]), int(cu[i + 1])
            if a == b:                                   # empty: the state passes through
                finals.append(s0[i])
                continue
            o, s = chunk_delta_family(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b],
                                      g[:, a:b], scale=SCALE, initial_state=s0[i:i + 1],
                                      output_final_state=True, chunk_size=16)
            outs.append(o)
            finals.append(s[0])
        return jnp.concatenate(outs, axis=1), jnp.stack(finals)

    want = vjp_all(separate, [q, k, v, beta, g, s0], cts)
    assert_close(got, want, F32_TOL, "packed vs separate")
    # the empty sequence's final state is its initial state, and its cotangent flows straight back
    np.testing.assert_array_equal(np.asarray(got[1][1]), np.asarray(s0[1]))
    np.testing.assert_array_equal(np.asarray(got[2][5][1]), np.asarray(cts[1][1]))


# ---------------------------------------------------------------------------------------------
# Mosaic lowering (no kernel runs): every kernel body must lower to Mosaic MLIR for a TPU.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_to_mosaic_for_tpu(dtype):
    """Exports forward + backward for platform "tpu" with interpret=False: JAX's Pallas->Mosaic
    lowering runs (block-shape checks, a lowering rule for every op in the kernel bodies).
    Mosaic's own compiler passes run only inside libtpu, on a TPU: not covered here."""
    export = pytest.importorskip("jax.export")
    b, t, h, d = 1, 200, 2, 128
    x = jax.ShapeDtypeStruct((b, t, h, d), dtype)
    beta = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
    gates = {"none": None, "scalar": jax.ShapeDtypeStruct((b, t, h), jnp.float32),
             "channel": jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)}
    cases = [(kv, f, kv[0] == "channel") for kv in gates.items() for f in (True, False)]
    for (gate, g), fused, packed in cases:
        cu = np.array([0, 70, 200], np.int32) if packed else None
        s0 = jax.ShapeDtypeStruct((2 if packed else b, h, d, d), jnp.float32)

        def loss(q, k, v, beta, g, s0, fused=fused, cu=cu):
            o, s = chunk_delta_family_tpu(
                q, k, v, beta, g, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                normalize_qk=True, interpret=False, block_sizes=BlockSizes(fused=fused))
            return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)

        argnums = (0, 1, 2, 3, 5) if g is None else (0, 1, 2, 3, 4, 5)
        exp = export.export(jax.jit(jax.grad(loss, argnums=argnums)), platforms=["tpu"])(
            x, x, x, beta, g, s0)
        calls = exp.mlir_module().count("tpu_custom_call")
        assert calls == (2 if fused else 5), (gate, fused, packed, calls)


@pytest.mark.parametrize("fused", [True, False])
def test_lowers_to_mosaic_at_value_head_dim_512(fused):
    """fla's GatedDeltaNet head shape (K = 256, V = 512) lowers to Mosaic, fused (the whole
    [K, V] state in VMEM) and unfused (V in 128-wide state tiles)."""
    export = pytest.importorskip("jax.export")
    b, t, h, kd, vd = 1, 100, 1, 256, 512
    xk = jax.ShapeDtypeStruct((b, t, h, kd), jnp.bfloat16)
    xv = jax.ShapeDtypeStruct((b, t, h, vd), jnp.bfloat16)
    sc = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
    s0 = jax.ShapeDtypeStruct((b, h, kd, vd), jnp.float32)

    def loss(q, k, v, beta, g, s0):
        o, s = chunk_delta_family_tpu(q, k, v, beta, g, initial_state=s0,
                                      output_final_state=True, interpret=False,
                                      block_sizes=BlockSizes(fused=fused))
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s)

    exp = export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))),
                        platforms=["tpu"])(xk, xk, xv, sc, sc, s0)
    assert exp.mlir_module().count("tpu_custom_call") == (2 if fused else 5)


# ---------------------------------------------------------------------------------------------
# Argument checks (no kernel runs)


def test_rejects_bad_arguments():
    q, k, v, beta, g, s0 = make(5, gate="scalar")
    f = chunk_delta_family_tpu
    with pytest.raises(ValueError, match="`k`"):
        f(q, k[..., :8], v, beta, g)
    with pytest.raises(ValueError, match="`v`"):
        f(q, k, v[:, :5], beta, g)
    with pytest.raises(ValueError, match="`beta`"):
        f(q, k, v, beta[..., :1], g)
    with pytest.raises(ValueError, match="`g`"):
        f(q, k, v, beta, g[..., None, None])
    with pytest.raises(ValueError, match="`initial_state`"):
        f(q, k, v, beta, g, initial_state=s0[:1])
    with pytest.raises(ValueError, match="`chunk_size`"):
        f(q, k, v, beta, g, chunk_size=12)
    with pytest.raises(ValueError, match="`chunk_size`"):
        f(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), beta, g,
          chunk_size=8)
    with pytest.raises(ValueError, match="`block_sizes.sub_chunk`"):
        f(q, k, v, beta, g, block_sizes=BlockSizes(16, sub_chunk=12))
    with pytest.raises(ValueError, match="`block_sizes.block_v`"):
        f(q, k, v, beta, g, block_sizes=BlockSizes(16, block_v=8))
    with pytest.raises(TypeError, match="`q`"):
        f(q.astype(jnp.int32), k, v, beta, g)
    with pytest.raises(TypeError, match="`q`"):
        f(q.astype(jnp.float16), k, v, beta, g)
    with pytest.raises(TypeError, match="share one dtype"):
        f(q.astype(jnp.bfloat16), k, v, beta, g)
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        f(q, k, v, beta, g, cu_seqlens=np.array([0, T], np.int32))          # B = 2
    with pytest.raises(ValueError, match="`cu_seqlens`"):
        f(q[:1], k[:1], v[:1], beta[:1], g[:1], cu_seqlens=np.array([0, 9, 7, T], np.int32))
    with pytest.raises(TypeError, match="`interpret`"):
        f(q, k, v, beta, g, interpret="yes")


# ---------------------------------------------------------------------------------------------
# Realistic tiles: the default block sizes (chunk 64, sub-chunk 16) at K = V = 128


@pytest.mark.parametrize("gate", [pytest.param("scalar", marks=pytest.mark.slow), "channel"])
def test_realistic_tiles(gate):
    """K = V = 128, default chunk 64 / sub-chunk 16, T not a multiple of 64."""
    b, t, h, d = 1, 150, 1, 128
    args = make(6, gate=gate, strength="extreme" if gate == "channel" else "normal",
                b=b, t=t, h=h, k_dim=d, v_dim=d)
    cts = cotangents(6, (b, t, h, d), (b, h, d, d), jnp.float32)
    got = vjp_all(tpu_fn(chunk_size=64), args, cts)
    assert_close(got, vjp_all(xla_fn(64), args, cts), F32_TOL, f"{gate} K=V=128")


@pytest.mark.slow
def test_v_tiles_and_bf16_channel_gate():
    """V = 256 split into two 128-wide state tiles; bf16 inputs with the channel gate."""
    b, t, h, kd, vd = 1, 40, 1, 16, 256
    args = make(7, gate="channel", b=b, t=t, h=h, k_dim=kd, v_dim=vd)
    q, k, v = (x.astype(jnp.bfloat16) for x in args[:3])
    cts = cotangents(7, (b, t, h, vd), (b, h, kd, vd), jnp.bfloat16)
    fn = tpu_fn(block_sizes=BlockSizes(16, sub_chunk=8, fused=False, block_v=128))
    got = vjp_all(fn, [q, k, v] + args[3:], cts)
    up = [x.astype(jnp.float32) for x in (q, k, v)] + args[3:]
    want = vjp_all(XLA_16, up, (cts[0].astype(jnp.float32), cts[1]))
    assert_close(got, want, BF16_TOL, "bf16 channel gate, V tiles")
