"""The degree-2 polynomial map's rows and sym_2's backward as Pallas GPU kernels
(atlas_jax/kernels/features/gpu.py), in interpret mode on the CPU: the backward equals the XLA
backward (`features._symmetric_square_bwd_xla`) and the autodiff of sym_2's definition, for several
widths, ragged row blocks (masked), leading axes, float32 and bf16 cotangents, with a scale and its
gradient, and reading sym_2's columns in place from a wider row; the forward equals the map's
definition with zero features after it; both run where `features` routes them on a GPU; they lower
to one Triton call each for CUDA; errors name the argument. Tolerance: float32 1e-6 relative (both
sides float32, sums in another order); a bf16 cotangent is widened exactly, so the same; bf16 rows
one rounding. `gpu`-marked: the compiled kernels against XLA, and omeganet's and dla's layers
with and without them, on a GPU."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel

from atlas_jax import features
from atlas_jax.kernels.features.gpu import (Phi2GpuBlockSizes, Sym2GpuBlockSizes, polynomial2_features_gpu,
                                            symmetric_square_backward_gpu)

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


@pytest.mark.parametrize("dtype,offset,extra", [(jnp.float32, 0, 0), (jnp.bfloat16, 17, 7)])
def test_kernel_scales_and_forms_the_scales_gradient(dtype, offset, extra):
    """With ``scale`` and ``with_scale_grad``: ∂L/∂x and ∂L/∂scale of scale · sym_2(x) equal
    autodiff's, from the same loads of the cotangent; with ``column_offset`` the cotangent is a
    wider row (`polynomial2_features`': the constant and linear blocks first, zero features after)
    read in place. 33 rows: the last block of 16 is ragged (masked, not padded)."""
    kx, kg = jax.random.split(jax.random.PRNGKey(7))
    x = jax.random.normal(kx, (3, 11, 16), jnp.float32)
    g = jax.random.normal(kg, (3, 11, offset + 16 * 17 // 2 + extra), jnp.float32).astype(dtype)
    scale = jnp.float32(0.7)
    dx, dscale = symmetric_square_backward_gpu(x, g, scale, with_scale_grad=True, interpret=True, column_offset=offset,
                                               block_sizes=Sym2GpuBlockSizes(block_rows=16, block_i=4))
    _, vjp = jax.vjp(lambda x, c: c * _by_definition(x), x, scale)
    want_dx, want_dscale = vjp(g[..., offset:offset + 16 * 17 // 2].astype(jnp.float32))
    assert dscale.shape == () and rel(dx, want_dx) <= TOL and rel(dscale, want_dscale) <= TOL


def _polynomial2(x, coeffs, width):
    """φ of the degree-2 polynomial map by definition, then zero features up to ``width``."""
    blocks = [jnp.full(x.shape[:-1] + (1,), coeffs[0]), coeffs[1] * x, coeffs[2] * _by_definition(x)]
    phi = jnp.concatenate(blocks, axis=-1)
    return jnp.pad(phi, [(0, 0)] * (x.ndim - 1) + [(0, width - phi.shape[-1])])


@pytest.mark.parametrize("d,lead,width,dtype,block_rows,block_cols", [(16, (37,), 160, jnp.float32, 16, 64),
                                                                      (16, (2, 20), 153, jnp.bfloat16, 8, 256),
                                                                      (8, (13,), 100, jnp.float32, 4, 32),
                                                                      (4, (3,), 15, jnp.float32, 2, 4)])
def test_feature_kernel_equals_the_map_with_zero_features(d, lead, width, dtype, block_rows, block_cols):
    """`polynomial2_features_gpu` writes [c₀, c₁ x, c₂ sym_2(x), 0 …] in one pass: equal to the
    definition rounded once to ``dtype`` (float32 ≤ 1e-6 relative: products in another order; bf16
    ≤ 4e-3: one rounding, 2⁻⁸ relative), with ragged row blocks, zero features (the last piece
    masked within the row) or none, and several widths."""
    x = jax.random.normal(jax.random.PRNGKey(d + width), lead + (d,), jnp.float32)
    coeffs = jnp.asarray([0.9, 1.1, 0.6])
    got = polynomial2_features_gpu(x, coeffs, width, dtype, interpret=True,
                                   block_sizes=Phi2GpuBlockSizes(block_rows=block_rows, block_cols=block_cols))
    want = _polynomial2(x, coeffs, width)
    assert got.shape == lead + (width,) and got.dtype == dtype
    assert rel(got.astype(jnp.float32), want) <= (TOL if dtype == jnp.float32 else 4e-3)
    assert jnp.all(got[..., 1 + d + d * (d + 1) // 2:] == 0)


def test_kernels_run_the_maps_passes_on_a_gpu_backend(monkeypatch):
    """Where `_sym2_kernel_runs`: the gradient of sym_2 (through its custom VJP) and both passes of
    `polynomial2_features` go through the kernels (here in interpret mode, the backend only
    pretended), and equal autodiff of the definitions."""
    calls = []
    from atlas_jax.kernels.features import gpu

    for name in ("symmetric_square_backward_gpu", "polynomial2_features_gpu"):
        kernel = getattr(gpu, name)
        monkeypatch.setattr(gpu, name, lambda *args, _k=kernel, _n=name, **kw:
                            calls.append(_n) or _k(*args, **{**kw, "interpret": True}))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 16))
    coeffs = jnp.asarray([0.9, 1.1, 0.6])
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(features.symmetric_power(x, 2))))(x)
    phi = lambda x, c: jnp.sum(jnp.sin(features.polynomial2_features(x, c, 160, jnp.float32)))
    value, phi_grads = jax.value_and_grad(phi, argnums=(0, 1))(x, coeffs)
    monkeypatch.undo()
    want = jax.grad(lambda x: jnp.sum(jnp.sin(_by_definition(x))))(x)
    want_value, want_phi = jax.value_and_grad(lambda x, c: jnp.sum(jnp.sin(_polynomial2(x, c, 160))),
                                              argnums=(0, 1))(x, coeffs)
    assert sorted(calls) == ["polynomial2_features_gpu", "symmetric_square_backward_gpu",
                             "symmetric_square_backward_gpu"]
    assert rel(grad, want) <= TOL and rel(value, want_value) <= TOL
    # 1e-5 for φ's gradients: the kernel's values differ from the definition's in the last float32
    # bit (products in another order), and c₂'s gradient sums 680 terms of cos at those values
    assert rel(phi_grads[0], want_phi[0]) <= 1e-5 and rel(phi_grads[1], want_phi[1]) <= 1e-5
    assert not features._sym2_kernel_runs(16) and not features._sym2_kernel_runs(12)


def test_kernel_lowers_to_triton_for_cuda():
    export = pytest.importorskip("jax.export")
    x = jnp.zeros((40, 128), jnp.float32)
    g = jnp.zeros((40, 128 * 129 // 2), jnp.bfloat16)
    run = jax.jit(lambda x, g: symmetric_square_backward_gpu(x, g, interpret=False))
    exp = export.export(run, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(x, g)
    assert exp.mlir_module().count("xla.gpu.triton") == 1
    forward = jax.jit(lambda x: polynomial2_features_gpu(x, jnp.ones((3,)), 8448, jnp.bfloat16, interpret=False))
    exp = export.export(forward, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(x)
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
    with pytest.raises(ValueError, match="column_offset"):
        symmetric_square_backward_gpu(jnp.zeros((3, 8)), jnp.zeros((3, 40)), interpret=True, column_offset=9)
    with pytest.raises(ValueError, match="coeffs"):
        polynomial2_features_gpu(jnp.zeros((3, 8)), jnp.ones((2,)), 45, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="width"):
        polynomial2_features_gpu(jnp.zeros((3, 8)), jnp.ones((3,)), 44, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        polynomial2_features_gpu(jnp.zeros((3, 12)), jnp.ones((3,)), 100, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="block_cols"):
        Phi2GpuBlockSizes(block_cols=24)
    with pytest.raises(TypeError, match="Phi2GpuBlockSizes"):
        polynomial2_features_gpu(jnp.zeros((3, 8)), jnp.ones((3,)), 45, jnp.float32, interpret=True,
                                 block_sizes=Sym2GpuBlockSizes())


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


@pytest.mark.gpu
def test_gpu_compiled_feature_kernel_and_its_backward_equal_xla():
    """On a GPU, omeganet's super-chunk rows (1048 a head: ragged blocks of 32; 8448 wide with 63
    zero features): the forward kernel against XLA's map (bf16: one rounding) and
    `polynomial2_features`' backward through the kernel against XLA's (float32 sums)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    jax.config.update("jax_default_matmul_precision", "highest")
    kx, kg = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (8, 1048, 128), jnp.float32)
    coeffs = jnp.asarray([0.9, 1.1, 0.6])
    got = jax.jit(lambda x: polynomial2_features_gpu(x, coeffs, 8448, jnp.bfloat16))(x)
    want = jax.jit(lambda x: _polynomial2(x, coeffs, 8448))(x)
    assert rel(got.astype(jnp.float32), want) <= 4e-3 and bool(jnp.all(got[..., 8385:] == 0))
    g = jax.random.normal(kg, (8, 1048, 8448), jnp.float32).astype(jnp.bfloat16)
    ours = jax.jit(lambda x, c, g: jax.vjp(lambda x, c: features.polynomial2_features(x, c, 8448, jnp.bfloat16),
                                           x, c)[1](g))(x, coeffs, g)

    @jax.jit
    def xla(x, c, g):   # the backward written out, sym_2's part by XLA's gather
        g = g.astype(jnp.float32)
        linear, square = g[..., 1:129], g[..., 129:8385]
        dx = c[1] * linear + c[2] * features._symmetric_square_bwd_xla(x, square)
        return dx, jnp.stack([jnp.sum(g[..., 0]), jnp.sum(linear * x), jnp.sum(square * features._symmetric_square(x))])

    want_dx, want_dc = xla(x, coeffs, g)
    assert rel(ours[0], want_dx) <= 1e-5 and rel(ours[1], want_dc) <= 1e-5, (rel(ours[0], want_dx), rel(ours[1], want_dc))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["omeganet", "dla"])
def test_gpu_layer_with_the_feature_kernels_equals_it_without(name, monkeypatch):
    """On a GPU, the dual form's layer with bf16 q, k, v in super-chunks (φ's rows by the kernels,
    `_super_chunk_rows`) against the same layer with φ in XLA (`_sym2_kernel_runs` off): outputs
    and the gradients of q, k, v and φ's coefficients within bf16 rounding (2e-2 outputs, 5e-2
    gradients: the kernels' bars)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from helpers import deep_spec_inputs

    from atlas_jax import presets
    from atlas_jax.forms import chunked, dual
    monkeypatch.setattr(dual, "BOUNDARY_BYTES_PER_TOKEN", 1)
    monkeypatch.setattr(dual, "GROUP_TOKENS", 64)
    spec = presets.get(name)
    q, k, v, knobs, state, feature_params = deep_spec_inputs(spec, 0, 1, 301, 2, 32, 32)
    # steps of at most 0.06: omeganet's window of 4 takes β Σ γ |φ(k)|² per step, and at the
    # helper's β ≤ 0.3 its inner GD diverges (NaN by T 97, in either form)
    knobs["beta"] = 0.2 * knobs["beta"]
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    probe = jax.random.normal(jax.random.PRNGKey(5), v.shape)

    def loss(q, k, v, feature_params):
        o, _ = spec(q, k, v, **knobs, initial_state=state, impl="chunk", chunk_size=16, feature_params=feature_params)
        return jnp.sum(o.astype(jnp.float32) * probe), o

    def run():
        with chunked.dual_form():
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, feature_params)

    grads, o = run()
    monkeypatch.setattr(features, "_sym2_kernel_runs", lambda d: False)
    want_grads, want_o = run()
    assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves((o, grads)))
    assert rel(o.astype(jnp.float32), want_o.astype(jnp.float32)) <= 2e-2
    for label, a, b in zip("qkv", grads[:3], want_grads[:3]):
        assert rel(a.astype(jnp.float32), b.astype(jnp.float32)) <= 5e-2, (label, rel(a.astype(jnp.float32), b.astype(jnp.float32)))
    assert rel(grads[3]["coeffs"], want_grads[3]["coeffs"]) <= 5e-2
