"""One entry for the exact Omega rule on a linear memory, with the delta family's impl= choice.

    impl="recurrent"  `omega_linear_recurrent` (float32 token-by-token scan, the reference)
    impl="chunk"      `omega_linear_chunk` (exact chunked form, plain XLA)
    impl="pallas"     `omega_linear_kernel`: the chunk form's chunk-parallel part in XLA (gate
                      sums, windows, the per-chunk unit-lower solve giving X0 and W, kd, qg, P),
                      its sequential pass over chunks with the read-out fused as a Pallas kernel
                      (forward and backward): Mosaic on TPU, the Triton lowering elsewhere (on
                      CPU in Pallas interpret mode, which is how CI tests it)
    impl="auto"       "pallas" on GPU / TPU, "chunk" on CPU (where interpret mode would be orders
                      of magnitude slower than XLA)

The kernels are imported at trace time, when a call picks them: importing atlas_jax.ops does
not import Pallas.
"""

from __future__ import annotations

import functools

import jax

from atlas_jax.ops.chunking import from_chunks
from atlas_jax.ops.omega.chunk import (
    check_chunk_size,
    chunk_operands,
    omega_linear_chunk,
)
from atlas_jax.ops.omega.naive import check_args, omega_linear_recurrent, window_triple

IMPLS = ("recurrent", "chunk", "pallas", "auto")
KERNELS = ("gpu", "tpu")


def _backend():
    return jax.default_backend()


def _choose_impl(impl):
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"omega_linear: argument `impl` must be one of {IMPLS}; got {impl!r}.")
    if impl == "auto":
        return "pallas" if _backend() in ("gpu", "cuda", "rocm", "tpu") else "chunk"
    return impl


def _state_pass_kernel(kernel):
    """The kernel entry for `kernel` ("gpu": Triton lowering, "tpu": Mosaic), imported here, at
    trace time."""
    if kernel == "tpu":
        from atlas_jax.kernels.omega.tpu import omega_state_pass_tpu
        return omega_state_pass_tpu
    from atlas_jax.kernels.omega.gpu import omega_state_pass_gpu
    return omega_state_pass_gpu


@functools.partial(jax.jit, static_argnames=("window", "objective", "output_final_state",
                                             "chunk_size", "kernel", "interpret", "block_sizes"))
def _kernel_path(q, k, v, beta, g, gamma, scale, initial_state, initial_window, *, window,
                 objective, output_final_state, chunk_size, kernel, interpret, block_sizes):
    T = q.shape[1]
    ops = chunk_operands(q, k, v, beta, g, gamma, window=window, objective=objective, scale=scale,
                         initial_window=initial_window, chunk_size=chunk_size)
    o, s_final, _ = _state_pass_kernel(kernel)(
        ops.x0, ops.w, ops.kd, ops.qg, ops.p, ops.last, initial_state, interpret=interpret,
        block_sizes=block_sizes)
    o = from_chunks(o)[:, :T].astype(v.dtype)
    return o, (s_final if output_final_state else None)


def omega_linear_kernel(q, k, v, beta=None, g=None, gamma=None, *, window=1, objective="l2",
                        scale=None, initial_state=None, output_final_state=False,
                        initial_window=None, chunk_size=16, kernel=None, interpret=None,
                        block_sizes=None):
    """The exact chunked Omega rule with its sequential pass as a Pallas kernel (impl="pallas").

    Arguments and returns as `omega_linear_chunk` (equal to it and to `omega_linear_recurrent`
    at float32 rounding, gradients included), plus
      kernel: "gpu" (Pallas Triton lowering), "tpu" (Mosaic) or None: "tpu" on a TPU backend,
        "gpu" elsewhere.
      interpret: the kernel's interpret mode (None: interpret unless on its own backend; see
        `omega_state_pass_gpu` / `omega_state_pass_tpu`).
      block_sizes: OmegaGpuBlockSizes / OmegaTpuBlockSizes for that kernel, or None.

    The chunk-parallel operands are float32 whatever the inputs' dtype (the XLA part computes in
    float32), so the kernel runs its float32 path; the output is cast to v.dtype.
    """
    initial_window = window_triple(initial_window)
    check_args(q, k, v, beta, g, gamma, window, objective, initial_window)
    C = check_chunk_size(chunk_size)
    if kernel is None:
        kernel = "tpu" if _backend() == "tpu" else "gpu"
    if kernel not in KERNELS:
        raise ValueError(f"omega_linear_kernel: argument `kernel` must be one of {KERNELS} or "
                         f"None; got {kernel!r}.")
    return _kernel_path(q, k, v, beta, g, gamma, scale, initial_state, initial_window,
                        window=window, objective=objective,
                        output_final_state=bool(output_final_state), chunk_size=C, kernel=kernel,
                        interpret=interpret, block_sizes=block_sizes)


def omega_linear(q, k, v, beta=None, g=None, gamma=None, *, window=1, objective="l2", scale=None,
                 initial_state=None, output_final_state=False, initial_window=None, impl="auto",
                 chunk_size=16):
    """The exact Omega rule on a linear memory (see `omega_linear_recurrent` for the math).

    Args: as `omega_linear_recurrent`, plus
      impl: one of IMPLS: "recurrent" (float32 scan reference), "chunk" (exact chunked XLA
        form), "pallas" (the chunk form with its sequential pass as a Pallas kernel: Mosaic on
        TPU, the Triton lowering elsewhere, interpret mode on CPU) or "auto" ("pallas" on
        GPU / TPU, "chunk" on CPU).
      chunk_size: tokens per chunk of "chunk" and "pallas" (any positive int; each token
        expands into `window` pseudo-tokens); unused by "recurrent".

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B, H, K, V] float32 or None).
    """
    impl = _choose_impl(impl)
    check_chunk_size(chunk_size)
    kw = {"window": window, "objective": objective, "scale": scale,
          "initial_state": initial_state, "output_final_state": output_final_state,
          "initial_window": initial_window}
    if impl == "recurrent":
        return omega_linear_recurrent(q, k, v, beta, g, gamma, **kw)
    if impl == "chunk":
        return omega_linear_chunk(q, k, v, beta, g, gamma, chunk_size=chunk_size, **kw)
    return omega_linear_kernel(q, k, v, beta, g, gamma, chunk_size=chunk_size, **kw)
