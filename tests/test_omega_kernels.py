"""Pallas kernels of the exact Omega rule on a linear memory (atlas_jax.kernels.omega, issue 21).

The kernels run the chunk form's sequential pass over chunks (with the read-out fused) and its
reverse pass; the chunk-parallel part stays in XLA. Checked here on CPU:
(a) `omega_linear_kernel` with the GPU kernel (Pallas interpret mode) and the TPU kernel (TPU
    interpret mode) equals the float32 recurrence `omega_linear_recurrent` for outputs, final
    states and the gradients of q, k, v, beta, g, gamma and the initial state: odd T, windows
    c ∈ {1, 2, 4, 7}, per-token and per-position γ, initial states, a filled window cache,
    extreme gates, both objectives;
(b) the kernel entries alone: V split over several programs (partial sums), the per-chunk start
    states as a differentiable output, bf16 operands;
(c) the kernels lower for their hardware without it: Triton for CUDA, Mosaic for TPU (export);
(d) impl= dispatch, argument errors, and a lazy import (importing atlas_jax.ops loads no Pallas).
`gpu`-marked tests compile the GPU kernel on a real GPU (skipped here).

Tolerance: 1e-5 relative (‖a − b‖ / ‖b‖) in float32, as tests/test_omega_linear.py. Both sides
are float32; the chunked form reassociates the sums (the WY solve, per-chunk products), so the
two differ by accumulated rounding (1e-7 to 1e-6 seen at these shapes); 1e-5 leaves an order of
magnitude of headroom while a real error (a missing term, a wrong decay) shows at 1e-3 or more.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from atlas_jax.kernels.omega.gpu import OmegaGpuBlockSizes, omega_state_pass_gpu
from atlas_jax.kernels.omega.tpu import OmegaTpuBlockSizes, omega_state_pass_tpu
from helpers import rel

from atlas_jax import ops
from atlas_jax.ops.omega import (
    omega_linear,
    omega_linear_chunk,
    omega_linear_kernel,
    omega_linear_recurrent,
)
from atlas_jax.ops.omega.chunk import ChunkOperands, chunk_operands, state_pass

B, T, H, K, V = 2, 37, 2, 8, 6          # T odd: never a multiple of the chunk size
TOL = 1e-5
KERNELS = ("gpu", "tpu")


def _inputs(c, *, per_position, gates="random", seed=0, b=B, t=T, h=H, k_dim=K, v_dim=V):
    """Random inputs, none zero (tests/test_omega_linear.py's): unit keys over √c so every
    transition is a contraction, β in (0.05, 0.95), log-decays ≤ 0 (extreme: α from e^-60 to
    e^-5, a few tokens without decay), γ in (0.05, 1), a random initial state."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (b, t, h, k_dim))
    k = jax.random.normal(ks[1], (b, t, h, k_dim))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True) / np.sqrt(c)
    v = jax.random.normal(ks[2], (b, t, h, v_dim))
    beta = jax.random.uniform(ks[3], (b, t, h), minval=0.05, maxval=0.95)
    if gates == "extreme":
        g = -jax.random.uniform(ks[4], (b, t, h), minval=5.0, maxval=60.0)
        g = jnp.where(jax.random.uniform(ks[7], (b, t, h)) < 0.2, -1e-3, g)
    else:
        g = -jax.nn.softplus(jax.random.normal(ks[4], (b, t, h)))
    gamma = jax.random.uniform(ks[5], (b, t, h, c) if per_position else (b, t, h),
                               minval=0.05, maxval=1.0)
    s0 = jax.random.normal(ks[6], (b, h, k_dim, v_dim))
    return q, k, v, beta, g, gamma, s0


def _window_cache(c, seed=9):
    """A filled window cache (the c − 1 tokens before the first, weights in (0.05, 1))."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    keys = jax.random.normal(ks[0], (B, H, c - 1, K))
    keys = keys / jnp.linalg.norm(keys, axis=-1, keepdims=True) / np.sqrt(c)
    return (keys, jax.random.normal(ks[1], (B, H, c - 1, V)),
            jax.random.uniform(ks[2], (B, H, c - 1), minval=0.05, maxval=1.0))


def _outputs_and_grads(fn, args, **kw):
    """(o, final state, gradients of a fixed random projection of both w.r.t. q, k, v, beta, g,
    gamma and the initial state), one compiled program."""
    b, t, h = args[0].shape[:3]
    wo = jax.random.normal(jax.random.PRNGKey(11), (b, t, h, args[2].shape[-1]))
    ws = jax.random.normal(jax.random.PRNGKey(12), args[6].shape)

    def loss(q, k, v, beta, g, gamma, s0):
        o, s = fn(q, k, v, beta, g, gamma, initial_state=s0, output_final_state=True, **kw)
        return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)

    grads, (o, s) = jax.jit(jax.grad(loss, argnums=tuple(range(7)), has_aux=True))(*args)
    return (o, s) + tuple(grads)


_NAMES = ("o", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dgamma", "ds0")


def _check_kernels_against_recurrence(args, tol=TOL, kernels=KERNELS, **kw):
    """Both kernels (interpret mode here) against the float32 recurrence; returns the errors."""
    chunk_size = kw.pop("chunk_size")
    want = _outputs_and_grads(omega_linear_recurrent, args, **kw)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in want)
    errors = {}
    for kernel in kernels:
        got = _outputs_and_grads(omega_linear_kernel, args, kernel=kernel, chunk_size=chunk_size,
                                 **kw)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in got), kernel
        assert got[0].dtype == args[2].dtype and got[1].dtype == jnp.float32
        errs = {n: rel(a, b) for n, a, b in zip(_NAMES, got, want)}
        errors[kernel] = max(errs.values())
        assert max(errs.values()) <= tol, (kernel, errs)
    return errors


# ---- (a) the kernels through the op, against the recurrence --------------------------------
# One case per window; each case compiles the recurrence once and both kernels once (compiling
# dominates in interpret mode), so the cases share their work across options.
# The last two continue from a filled window cache (the c − 1 tokens before the first).
@pytest.mark.parametrize("c,per_position,objective,gates,chunk,cache", [
    (1, False, "l2", "random", 16, False),
    (2, True, "dot", "random", 8, False),
    (4, True, "l2", "random", 8, True),
    (7, False, "l2", "extreme", 8, False),
    (7, False, "dot", "extreme", 8, True),
], ids=["c1_gamma_token", "c2_gamma_position_dot", "c4_gamma_position_window_cache",
        "c7_extreme_gates", "c7_dot_extreme_gates_window_cache"])
def test_kernels_equal_recurrence_with_gradients(c, per_position, objective, gates, chunk, cache):
    args = _inputs(c, per_position=per_position, gates=gates, seed=c)
    window_cache = _window_cache(c) if cache else None
    _check_kernels_against_recurrence(args, window=c, objective=objective, chunk_size=chunk,
                                      scale=0.7, initial_window=window_cache)


# ---- (b) the kernel entries alone -----------------------------------------------------------
def _operands(c=3, v_dim=40, seed=5):
    """The chunk form's operands (ℓ2) of random inputs, and an initial state."""
    q, k, v, beta, g, gamma, s0 = _inputs(c, per_position=False, seed=seed, v_dim=v_dim)
    build = jax.jit(lambda *a: chunk_operands(*a, window=c, objective="l2", scale=0.5,
                                              initial_window=None, chunk_size=8))
    return build(q, k, v, beta, g, gamma), s0


def _xla_with_starts(x0, w, kd, qg, p, last, s0):
    """The XLA state pass, also returning each chunk's start state (the kernels' option)."""
    def step(s, xs):
        w_n, kd_n, last_n, x0_n = xs
        x = x0_n - jnp.einsum('BHMK,BHKV->BHMV', w_n, s, precision="highest")
        return last_n[..., None, None] * s + jnp.einsum('BHMK,BHMV->BHKV', kd_n, x,
                                                        precision="highest"), s

    sT, starts = jax.lax.scan(step, s0, (w, kd, last, x0))
    o, _ = state_pass(ChunkOperands(x0, w, kd, qg, p, last), s0)
    return o, sT, starts


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_entry_v_blocks_and_chunk_states(kernel):
    """Several V blocks per (batch, head) (GPU: padded V 64 in blocks of 16; TPU: V 256 in blocks
    of 128), the per-chunk start states as an output, and gradients through all three outputs."""
    v_dim = 40 if kernel == "gpu" else 256
    ops_, s0 = _operands(v_dim=v_dim)
    if kernel == "gpu":
        run = functools.partial(omega_state_pass_gpu, output_chunk_states=True, interpret=True,
                                block_sizes=OmegaGpuBlockSizes(block_v=16))
    else:
        run = functools.partial(omega_state_pass_tpu, output_chunk_states=True,
                                block_sizes=OmegaTpuBlockSizes(block_v=128))
    args = (ops_.x0, ops_.w, ops_.kd, ops_.qg, ops_.p, ops_.last, s0)
    weights = [jax.random.normal(jax.random.PRNGKey(i), x.shape)
               for i, x in enumerate(jax.eval_shape(_xla_with_starts, *args))]

    def loss(fn):
        def f(*a):
            outs = fn(*a)
            return sum(jnp.sum(x * w) for x, w in zip(outs, weights)), outs
        return jax.jit(jax.grad(f, argnums=tuple(range(7)), has_aux=True))

    grads, outs = loss(run)(*args)
    grads_r, outs_r = loss(_xla_with_starts)(*args)
    for name, a, b in zip(("o", "final_state", "starts") + _NAMES[2:], outs + grads,
                          outs_r + grads_r):
        assert rel(a, b) <= TOL, (name, rel(a, b))


def test_kernel_entries_bf16_operands():
    """bf16 operands (GPU: bf16 dots; TPU: float32 products of them; float32 state either way):
    within 1e-2 of the float32 pass over the same rounded operands; o comes back in bf16, the
    state in float32."""
    ops_, s0 = _operands(c=2, v_dim=V)
    low = [x.astype(jnp.bfloat16) for x in ops_[:5]]
    o_r, s_r = jax.jit(state_pass)(
        ChunkOperands(*[x.astype(jnp.float32) for x in low], ops_.last), s0)
    for run in (omega_state_pass_gpu, omega_state_pass_tpu):
        o, sT, starts = run(*low, ops_.last, s0)
        assert o.dtype == jnp.bfloat16 and sT.dtype == jnp.float32 and starts is None
        assert rel(o, o_r) <= 1e-2 and rel(sT, s_r) <= 1e-2, (run.__name__, rel(o, o_r))


# ---- (c) lowering for the real hardware (no GPU or TPU needed) ------------------------------
def _export(kernel, dtype, objective, K_=128, V_=128, c=4, C=16):
    export = pytest.importorskip("jax.export")
    N, M = 3, C * c
    shapes = [(N, 2, 2, M, V_), (N, 2, 2, M, K_), (N, 2, 2, M, K_), (N, 2, 2, C, K_),
              (N, 2, 2, C, M)]
    args = [jnp.ones(shape, dtype) for shape in shapes] + [jnp.ones((N, 2, 2)),
                                                            jnp.ones((2, 2, K_, V_))]
    if objective == "dot":
        args[1] = None
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    if kernel == "gpu":
        run = functools.partial(omega_state_pass_gpu, interpret=False, output_chunk_states=True)
        platform, checks, marker = "cuda", [export.DisabledSafetyCheck.custom_call(
            "__gpu$xla.gpu.triton")], "xla.gpu.triton"
    else:
        run = functools.partial(omega_state_pass_tpu, interpret=False, output_chunk_states=True)
        platform, checks, marker = "tpu", [], "tpu_custom_call"

    def loss(*a):
        o, s, starts = run(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s) + jnp.sum(starts)

    exp = export.export(jax.jit(jax.value_and_grad(loss, argnums=argnums)), platforms=[platform],
                        disabled_checks=checks)(*args)
    return exp.mlir_module().count(marker)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype,objective", [(jnp.float32, "l2"), (jnp.bfloat16, "l2"),
                                             (jnp.float32, "dot")])
def test_kernels_lower_for_their_hardware(kernel, dtype, objective):
    """Forward and backward lower to Triton (CUDA) / Mosaic (TPU): every tile a power of two of
    at least 16 on the GPU (a window c = 7 makes M = 112 rows, padded to 128), (8, 128)-legal
    blocks on the TPU. Two kernels each: the forward and the reverse pass."""
    assert _export(kernel, dtype, objective) == 2
    if kernel == "gpu" and objective == "dot":
        assert _export(kernel, dtype, objective, K_=64, V_=40, c=7, C=16) == 2


# ---- (d) dispatch, errors, lazy import -----------------------------------------------------
def test_impl_dispatch_on_cpu():
    c = 2
    q, k, v, beta, g, gamma, s0 = _inputs(c, per_position=False, seed=3)
    kw = {"window": c, "initial_state": s0, "output_final_state": True}
    o_r, s_r = omega_linear_recurrent(q, k, v, beta, g, gamma, **kw)
    o_c, s_c = omega_linear_chunk(q, k, v, beta, g, gamma, chunk_size=8, **kw)
    o, s = omega_linear(q, k, v, beta, g, gamma, impl="recurrent", **kw)
    assert np.array_equal(o, o_r) and np.array_equal(s, s_r)
    for impl in ("chunk", "auto"):           # auto on CPU: the XLA chunk form, not interpret mode
        o, s = omega_linear(q, k, v, beta, g, gamma, impl=impl, chunk_size=8, **kw)
        assert np.array_equal(o, o_c) and np.array_equal(s, s_c), impl
    # The optional arguments left out (β 1, no decay, γ 1, scale 1/√K, zero initial state).
    o_r, _ = omega_linear_recurrent(q, k, v, window=c)
    o, s = omega_linear(q, k, v, window=c, impl="pallas", chunk_size=8)
    assert s is None and rel(o, o_r) <= TOL
    assert ops.omega_linear is omega_linear and "omega_linear" in ops.__all__


def test_argument_errors():
    q, k, v, *_ = _inputs(2, per_position=False)
    with pytest.raises(ValueError, match=r"omega_linear: argument `impl` must be one of"):
        omega_linear(q, k, v, window=2, impl="triton")
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        omega_linear(q, k, v, window=2, impl="pallas", chunk_size=0)
    with pytest.raises(ValueError, match=r"argument `kernel` must be one of \('gpu', 'tpu'\)"):
        omega_linear_kernel(q, k, v, window=2, kernel="cuda")
    with pytest.raises(ValueError, match="objective"):
        omega_linear(q, k, v, window=2, impl="pallas", objective="huber")

    ops_, s0 = _operands(c=2, v_dim=V)
    good = dict(zip(("x0", "w", "kd", "qg", "p", "last"), ops_))
    bad = {"x0": ops_.x0[0], "w": ops_.w[..., :-1], "kd": ops_.kd[:, :1], "qg": ops_.qg[..., :-1],
           "p": ops_.p[..., :-1], "last": ops_.last[..., None]}
    for entry in (omega_state_pass_gpu, omega_state_pass_tpu):
        for name, wrong in bad.items():
            args = dict(good, **{name: wrong})
            with pytest.raises(ValueError, match=rf"{entry.__name__}: argument `{name}` must be"):
                entry(*args.values(), s0)
        with pytest.raises(ValueError, match="argument `initial_state` must be"):
            entry(*good.values(), s0[..., :-1])
        with pytest.raises(ValueError, match="argument `x0` must have a floating dtype"):
            entry(*dict(good, x0=ops_.x0.astype(jnp.int32)).values(), s0)
    with pytest.raises(ValueError, match=r"argument `block_sizes.block_v` must be a power of two"):
        omega_state_pass_gpu(*good.values(), s0, block_sizes=OmegaGpuBlockSizes(block_v=24))
    with pytest.raises(ValueError, match=r"argument `block_sizes.num_warps` must be"):
        omega_state_pass_gpu(*good.values(), s0, block_sizes=OmegaGpuBlockSizes(num_warps=3))
    with pytest.raises(ValueError, match=r"argument `block_sizes.block_v` must be V = 6"):
        omega_state_pass_tpu(*good.values(), s0, block_sizes=OmegaTpuBlockSizes(block_v=4))
    with pytest.raises(TypeError, match="OmegaTpuBlockSizes"):
        omega_state_pass_tpu(*good.values(), s0, block_sizes=OmegaGpuBlockSizes())


def test_importing_the_ops_and_the_kernel_package_loads_no_pallas():
    code = ("import sys, atlas_jax.ops, atlas_jax.kernels.omega; "
            "print(sorted(m for m in sys.modules if m.startswith('jax.experimental.pallas')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


# ---- compiled on a GPU (skipped without one) ------------------------------------------------
def _check_compiled(c, objective, per_position, *, k_dim, v_dim, gates="random"):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args = _inputs(c, per_position=per_position, gates=gates, seed=30 + c, b=2, t=300, h=2,
                   k_dim=k_dim, v_dim=v_dim)
    # impl="auto" on a GPU runs the compiled kernel (interpret=False): the dispatch is checked too.
    want = _outputs_and_grads(omega_linear_recurrent, args, window=c, objective=objective)
    got = _outputs_and_grads(omega_linear, args, window=c, objective=objective, impl="auto",
                             chunk_size=16)
    errs = {n: rel(a, b) for n, a, b in zip(_NAMES, got, want)}
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in got)
    assert max(errs.values()) <= TOL, errs


@pytest.mark.gpu
@pytest.mark.parametrize("c,objective,per_position,gates", [
    (1, "l2", False, "random"), (2, "dot", True, "random"), (4, "l2", True, "random"),
    (7, "l2", False, "extreme")])
def test_gpu_compiled_equals_recurrence(c, objective, per_position, gates):
    """B2 T300 H2 K64 V64, chunk 16, float32: outputs, final states and every gradient."""
    _check_compiled(c, objective, per_position, k_dim=64, v_dim=64, gates=gates)


@pytest.mark.gpu
def test_gpu_compiled_head_dim_128():
    _check_compiled(4, "l2", False, k_dim=128, v_dim=128)
