"""sym_2's backward as a Pallas GPU kernel (atlas_jax/kernels/features/gpu.py), in interpret mode on
the CPU: it equals the XLA backward (`features._symmetric_square_bwd_xla`) and the autodiff of
sym_2's definition, for several widths, odd numbers of rows (padded to the row block), leading
axes, float32 and bf16 cotangents; it lowers to one Triton call for CUDA; errors name the argument.
Tolerance: float32 1e-6 relative (both sides float32, sums in another order); a bf16 cotangent is
widened exactly, so the same. `gpu`-marked: the compiled kernel against XLA on a GPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel

from atlas_jax import features
from atlas_jax.kernels.features.gpu import Sym2GpuBlockSizes, symmetric_square_backward_gpu

TOL = 1e-6


def _by_definition(x):
    """sym_2 written from its definition (x_i x_j for i ≤ j, √2 off the diagonal), for autodiff."""
    pairs = list(itertools.combinations_with_replacement(range(x.shape[-1]), 2))
    return jnp.stack([x[..., i] * x[..., j] * (1.0 if i == j else np.sqrt(2.0)) for i, j in pairs], axis=-1)


@pytest.mark.parametrize("d,lead,dtype,block_rows,block_i", [(8, (13,), jnp.float32, 4, None),
                                                             (16, (2, 3, 5), jnp.float32, 8, 4),
                                                             (16, (7,), jnp.bfloat16, 16, 16), (4, (3,), jnp.float32, 2, 1)])
def test_kernel_equals_the_xla_backward_and_autodiff(d, lead, dtype, block_rows, block_i):
    kx, kg = jax.random.split(jax.random.PRNGKey(d))
    x = jax.random.normal(kx, lead + (d,), jnp.float32)
    g = jax.random.normal(kg, lead + (d * (d + 1) // 2,), jnp.float32).astype(dtype)
    got = symmetric_square_backward_gpu(x, g, block_sizes=Sym2GpuBlockSizes(block_rows=block_rows, block_i=block_i),
                                       interpret=True)
    want = features._symmetric_square_bwd_xla(x, g.astype(jnp.float32))
    _, vjp = jax.vjp(_by_definition, x)
    (by_autodiff,) = vjp(g.astype(jnp.float32))
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel(got, want) <= TOL, rel(got, want)
    assert rel(got, by_autodiff) <= TOL, rel(got, by_autodiff)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_scales_and_forms_the_scales_gradient(dtype):
    """With ``scale`` and ``with_scale_grad`` (`features.scaled_symmetric_square`'s backward): ∂L/∂x
    and ∂L/∂scale of scale · sym_2(x) equal autodiff's, from the same loads of the cotangent."""
    kx, kg = jax.random.split(jax.random.PRNGKey(7))
    x = jax.random.normal(kx, (3, 11, 16), jnp.float32)
    g = jax.random.normal(kg, (3, 11, 16 * 17 // 2), jnp.float32).astype(dtype)
    scale = jnp.float32(0.7)
    dx, dscale = symmetric_square_backward_gpu(x, g, scale, with_scale_grad=True, interpret=True,
                                               block_sizes=Sym2GpuBlockSizes(block_rows=16, block_i=4))
    _, vjp = jax.vjp(lambda x, c: c * _by_definition(x), x, scale)
    want_dx, want_dscale = vjp(g.astype(jnp.float32))
    assert dscale.shape == () and rel(dx, want_dx) <= TOL and rel(dscale, want_dscale) <= TOL


def test_kernel_runs_sym2s_backward_on_a_gpu_backend(monkeypatch):
    """Where `_sym2_kernel_runs`: the gradient of sym_2 (through its custom VJP) goes through the
    kernel (here in interpret mode, the backend only pretended)."""
    calls = []
    from atlas_jax.kernels.features import gpu

    kernel = gpu.symmetric_square_backward_gpu
    monkeypatch.setattr(gpu, "symmetric_square_backward_gpu",
                        lambda *args, **kw: calls.append(1) or kernel(*args, **{**kw, "interpret": True}))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 16))
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(features.symmetric_power(x, 2))))(x)
    scaled = jax.grad(lambda x, c: jnp.sum(jnp.sin(features.scaled_symmetric_square(x, c, jnp.float32))),
                      argnums=(0, 1))(x, jnp.float32(0.7))
    monkeypatch.undo()
    want = jax.grad(lambda x: jnp.sum(jnp.sin(_by_definition(x))))(x)
    want_scaled = jax.grad(lambda x, c: jnp.sum(jnp.sin(c * _by_definition(x))), argnums=(0, 1))(x, jnp.float32(0.7))
    assert len(calls) == 2 and rel(grad, want) <= TOL
    assert rel(scaled[0], want_scaled[0]) <= TOL and rel(scaled[1], want_scaled[1]) <= TOL
    assert not features._sym2_kernel_runs(16) and not features._sym2_kernel_runs(12)


def test_kernel_lowers_to_triton_for_cuda():
    export = pytest.importorskip("jax.export")
    x = jnp.zeros((40, 128), jnp.float32)
    g = jnp.zeros((40, 128 * 129 // 2), jnp.bfloat16)
    run = jax.jit(lambda x, g: symmetric_square_backward_gpu(x, g, interpret=False))
    exp = export.export(run, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(x, g)
    assert exp.mlir_module().count("xla.gpu.triton") == 1


def test_kernel_names_its_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        symmetric_square_backward_gpu(jnp.zeros((3, 12)), jnp.zeros((3, 78)), interpret=True)
    with pytest.raises(ValueError, match="cotangent"):
        symmetric_square_backward_gpu(jnp.zeros((3, 8)), jnp.zeros((3, 35)), interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        Sym2GpuBlockSizes(block_rows=24)
    with pytest.raises(ValueError, match="block_i"):
        symmetric_square_backward_gpu(jnp.zeros((3, 8)), jnp.zeros((3, 36)), interpret=True,
                                      block_sizes=Sym2GpuBlockSizes(block_i=16))


@pytest.mark.gpu
def test_gpu_compiled_kernel_equals_the_xla_backward():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    jax.config.update("jax_default_matmul_precision", "highest")
    kx, kg = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (8, 524, 128), jnp.float32)
    g = jax.random.normal(kg, (8, 524, 128 * 129 // 2), jnp.float32).astype(jnp.bfloat16)
    got = jax.jit(symmetric_square_backward_gpu)(x, g)
    want = jax.jit(features._symmetric_square_bwd_xla)(x, g.astype(jnp.float32))
    assert rel(got, want) <= 1e-5, rel(got, want)
    scale = jnp.float32(0.7)
    dx, dscale = jax.jit(lambda x, g, s: symmetric_square_backward_gpu(x, g, s, with_scale_grad=True))(x, g, scale)
    want_dscale = jnp.sum(g.astype(jnp.float32) * jax.jit(features._symmetric_square)(x))
    assert rel(dx, scale * want) <= 1e-5 and rel(dscale, want_dscale) <= 1e-5, (rel(dx, scale * want), rel(dscale, want_dscale))
