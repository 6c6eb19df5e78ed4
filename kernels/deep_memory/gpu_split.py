"""The split dual form of a depth-2 MLP memory on the GPU kernels, its state pass (`gpu.py`) and its
reads (`gpu_reads.py`) in one custom VJP (`atlas_jax.ops.deep_memory.mlp_state_pass_and_reads`).

Apart, the reads' backward forms every chunk's start-state cotangent θ-sized (W0's qᵀ (P ⊙ Z̄)
[d, h] and three more per chunk: XLA writing 2.1 GB at titans B4 T4096 H8 D128) and the state
pass's backward kernel loads it. Together, the reads' backward hands the kernel those cotangents
as their rank-b factors (`gpu.StartFactors`: q, P ⊙ Z̄, c ⊙ Z̄, Ĥ, P ⊙ Ō, c ⊙ Ō) and the kernel
forms each tile's product itself where it added the loaded one. The reads' other cotangents join
the state pass's as `MLPSources` cotangents (H̄, D̄, and Ē as Y's, −Ē the targets').

Layouts: the state pass's [B·H, N, ...] and the reads' [P = B·H·N, ...] are one array reshaped;
every size is padded as both kernels pad it (`support.run_padded`, `gpu_reads`).

Measured on an H200 (titans' layer, bf16 fwd+bwd, one command each against the two ops apart):
B4 T4096 H8 D128 19.91 -> 18.72 ms (2026-11-28,
benchmarks/results/titans_reads_kernel_h200_2026-11-28.md); B1 T16384 17.01 -> 16.37 (2026-11-29,
benchmarks/results/titans_ablations_h200_2026-11-29.md; 24.22 -> 24.74 on 2026-11-28, before the
backward kernel's paired products and fewer whole-row loads), so the dual form takes it for every
bf16 call on a GPU. Tested in interpret mode (one tile a head) against the references, and
compiled on an H200 inside titans' layer against the dual form: float32 (hidden 128, eight
backward tiles a head) at 1e-5, and bf16 (hidden 512, 16-wide paired backward tiles, 2026-11-29)
within 1e-2 of the chunked form (`tests/test_deep_memory_reads.py`'s gpu cases).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from atlas_jax.kernels.deep_memory import gpu, gpu_reads
from atlas_jax.kernels.deep_memory.support import F32, pass_operands, unpad_states
from atlas_jax.ops.deep_memory.state_pass import MLPSources, MLPStates

__all__ = ["mlp_state_pass_and_reads_gpu"]


def _as_reads(x):
    """[B·H, N, ...] -> [B·H·N, ...]."""
    return None if x is None else x.reshape((-1,) + x.shape[2:])


def _as_pass(x, n_chunks):
    """[B·H·N, ...] -> [B·H, N, ...]."""
    return None if x is None else x.reshape((-1, n_chunks) + x.shape[1:])


def _forward(cfgs, state, a, t, rows, mrows, decay, carry, mcarry, q, fs, sc, m):
    cfg_pass, cfg_reads = cfgs
    starts, final, y, sources = gpu._forward(cfg_pass, state, a, t, rows, mrows, decay, carry, mcarry)
    errors = _as_reads(y - t)   # ℓ2's output cotangent (the op routes no other objective here)
    reads_args = (MLPStates(*map(_as_reads, starts)), q, _as_reads(a), _as_reads(sources.hidden),
                  _as_reads(sources.d0), errors, fs, sc, m)
    out, kept = gpu_reads.forward(cfg_reads, *reads_args)
    return (final, out), (starts, y, (a, t, rows, mrows, decay, carry, mcarry), reads_args, kept)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfgs, *args):
    return _forward(cfgs, *args)[0]


def _core_bwd(cfgs, res, cts):
    cfg_pass, cfg_reads = cfgs
    starts, y, pass_args, reads_args, kept = res
    a, t, rows, mrows, decay, carry, mcarry = pass_args
    d_final, d_out = cts
    N = a.shape[1]
    factors, (dq, da_reads, d_hidden, d_d0, d_errors, d_fs, d_sc, d_m) = gpu_reads.backward_parts(
        cfg_reads, (reads_args, kept), d_out)
    d_errors = _as_pass(d_errors, N)
    d_sources = MLPSources(_as_pass(d_hidden, N), _as_pass(d_d0, N), d_errors)
    d_first, da, dt, drows, dmrows, d_decay, d_carry, d_mcarry = gpu._backward(
        cfg_pass, starts, y, a, t, rows, mrows, decay, carry, mcarry,
        gpu.StartFactors(*(_as_pass(f, N) for f in factors)), d_final, d_sources)
    da = (da.astype(F32) + _as_pass(da_reads, N).astype(F32)).astype(a.dtype)
    return (d_first, da, dt - d_errors, drows, dmrows, d_decay, d_carry, d_mcarry, dq, d_fs, d_sc, d_m)


_core.defvjp(lambda cfgs, *args: _forward(cfgs, *args), _core_bwd)


@functools.partial(jax.jit, static_argnames=("cfgs", "padded"))
def _run(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry, queries, from_start,
         state_carry, state_rows, *, cfgs, padded):
    B, H, N, _, d = a.shape
    b, h, dv = queries.shape[3], state.w0.shape[-1], state.w1.shape[-1]
    final, out = _core(cfgs, *pass_operands(padded, state, a, targets, rows, momentum_rows, decay_end, carry_end,
                                            momentum_carry),
                       *gpu_reads.query_operands(queries, from_start, state_carry, state_rows, padded[0], padded[1]))
    return unpad_states(final, B, H, (), d, h, dv), out[:, :b, :dv].reshape(B, H, N, b, dv)


def mlp_state_pass_and_reads_gpu(state: MLPStates, a, targets, rows, momentum_rows, decay_end, carry_end,
                                 momentum_carry, queries, from_start, state_carry, state_rows, *, activation: str,
                                 residual: bool, interpret=None, block_sizes=None, read_block_sizes=None):
    """`atlas_jax.ops.deep_memory.mlp_state_pass_and_reads` on the GPU kernels (arguments checked
    there): (the final state [B, H, ...], every chunk's outputs [B, H, N, b, dv]), float32."""
    cfg_pass, padded, backward = gpu.pass_config(state, a, targets, activation=activation, residual=residual,
                                                 interpret=interpret, block_sizes=block_sizes, sources=True,
                                                 factors=True)
    if backward != "kernel":
        raise ValueError("mlp_state_pass_and_reads_gpu: argument `block_sizes.backward` must be 'kernel' (the "
                         f"reads' cotangents go to the backward kernel); got {backward!r}.")
    cfg_reads = gpu_reads.reads_config(state.w0.shape[-1], state.m0 is not None, a.dtype == jnp.bfloat16,
                                       activation=activation, residual=residual, interpret=interpret,
                                       block_sizes=read_block_sizes)
    return _run(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry,
                queries.astype(a.dtype), from_start, state_carry, state_rows, cfgs=(cfg_pass, cfg_reads),
                padded=padded)
