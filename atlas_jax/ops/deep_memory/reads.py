"""The dual form's reads of a depth-2 MLP memory: every chunk's outputs from its start state and
its gradient sources, chunk-parallel (the part of the split dual form that follows the
sequential pass, `state_pass`).

Per chunk, with its start θ = (W0 [d, h], W1 [h, dv]) and momentum (m0, m1), its b queries
q [b, d], its n gradient sources a [n, d] with `state_pass.MLPSources` H [n, h], D [n, h] and the
ℓ2 errors E = Y − targets [n, dv], and the dual form's read coefficients P [b] (``from_start``),
c [b] (``state_carry``, momentum only) and M [b, n] (``state_rows``): step t reads θ_t = P_t θ +
c_t m + Σ_s M[t, s] (a_s D_sᵀ for W0, H_s E_sᵀ for W1) without forming it,

    Z = P ⊙ (q W0) + c ⊙ (q m0) + (M ⊙ q aᵀ) D,          Ĥ = σ(Z)
    O = P ⊙ (Ĥ W1) + c ⊙ (Ĥ m1) + (M ⊙ Ĥ Hᵀ) E  (+ q with the identity residual)

(`atlas_jax.forms.dual.chunk_read` for this memory, whose general form XLA runs). impl="chunk" is
that in float32 XLA (the reference); impl="pallas" a GPU kernel for the forward, which rounds each
chunk's start state to bf16 as it loads it and keeps Z with those bf16 copies, and the backward
in XLA from them (`atlas_jax.kernels.deep_memory.gpu_reads`; interpret mode off a GPU). The dual
form's kernel route reads this way for bf16 inputs (`forms.dual.dual_batched_kernel`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from atlas_jax.memory import ACTIVATIONS
from atlas_jax.ops.deep_memory.state_pass import (MLPSources, MLPStates, check_kernel_activation, check_pass_arguments,
                                                  check_shapes, mlp_sources_from_starts, mlp_state_pass_reference)

READ_IMPLS = ("chunk", "pallas")


def mlp_chunk_read(start: MLPStates, queries, a, sources: MLPSources, errors, from_start, state_carry,
                   state_rows, *, activation: str, residual: bool):
    """The module docstring's O [b, dv] for one chunk of one sequence and head, float32."""
    f32 = lambda x: None if x is None else x.astype(jnp.float32)
    start, queries, a, errors = MLPStates(*map(f32, start)), f32(queries), f32(a), f32(errors)
    hidden, d0 = f32(sources.hidden), f32(sources.d0)
    p = from_start[:, None]
    z = p * (queries @ start.w0) + (state_rows * (queries @ a.T)) @ d0
    if start.m0 is not None:
        z = z + state_carry[:, None] * (queries @ start.m0)
    h = ACTIVATIONS[activation](z)
    out = p * (h @ start.w1) + (state_rows * (h @ hidden.T)) @ errors
    if start.m1 is not None:
        out = out + state_carry[:, None] * (h @ start.m1)
    return out + queries if residual else out


def mlp_reads_reference(starts: MLPStates, queries, a, sources: MLPSources, errors, from_start,
                        state_carry, state_rows, *, activation: str = "gelu", residual: bool = False):
    """`mlp_chunk_read` over every chunk [B, H, N] (float32 XLA); arguments as `mlp_reads`."""
    def one(st, q, a_, src, e, p, c, m):
        return mlp_chunk_read(st, q, a_, src, e, p, c, m, activation=activation, residual=residual)
    return jax.vmap(jax.vmap(jax.vmap(one)))(starts, queries, a, sources, errors, from_start, state_carry,
                                             state_rows)


def _check(starts, queries, a, sources, errors, from_start, state_carry, state_rows, activation, residual):
    fn = "mlp_reads"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{fn}: argument `activation` must be one of {sorted(ACTIVATIONS)}; got {activation!r}.")
    if queries.ndim != 5 or a.ndim != 5:
        raise ValueError(f"{fn}: arguments `queries` [B, H, N, b, d] and `a` [B, H, N, n, d] must be 5-D; got "
                         f"shapes {tuple(queries.shape)} and {tuple(a.shape)}.")
    B, H, N, b, d = queries.shape
    n = a.shape[3]
    h, dv = starts.w0.shape[-1], starts.w1.shape[-1]
    expect = {"a": (a, (B, H, N, n, d)), "starts.w0": (starts.w0, (B, H, N, d, h)),
              "starts.w1": (starts.w1, (B, H, N, h, dv)), "sources.hidden": (sources.hidden, (B, H, N, n, h)),
              "sources.d0": (sources.d0, (B, H, N, n, h)), "errors": (errors, (B, H, N, n, dv)),
              "from_start": (from_start, (B, H, N, b)), "state_rows": (state_rows, (B, H, N, b, n))}
    if starts.m0 is not None:
        expect.update({"starts.m0": (starts.m0, (B, H, N, d, h)), "starts.m1": (starts.m1, (B, H, N, h, dv)),
                       "state_carry": (state_carry, (B, H, N, b))})
    elif starts.m1 is not None or state_carry is not None:
        raise ValueError(f"{fn}: without momentum (starts.m0 None) pass starts.m1 and state_carry as None too.")
    check_shapes(fn, expect, "from queries = [B, H, N, b, d], a = [B, H, N, n, d] and starts.w0 = [B, H, N, d, h]",
                 residual, d, dv)


def mlp_reads(starts: MLPStates, queries, a, sources: MLPSources, errors, from_start, state_carry=None,
              state_rows=None, *, activation: str = "gelu", residual: bool = False, impl: str = "chunk",
              interpret=None, block_sizes=None):
    """Every chunk's outputs [B, H, N, b, dv] (module docstring), differentiable in every array.

    Args: starts (MLPStates [B, H, N, ...]: every chunk's start state, momentum or None);
    queries [B, H, N, b, d]; a [B, H, N, n, d] (the chunk's gradient sources' inputs); sources
    (`MLPSources` [B, H, N, ...]: their H and D; Y is not used); errors [B, H, N, n, dv] (E);
    from_start, state_carry [B, H, N, b]; state_rows [B, H, N, b, n]. impl="chunk": float32 XLA;
    "pallas": the GPU kernel's forward, XLA's backward (interpret / block_sizes go to the kernel;
    bf16 queries, a and sources give every product bf16 operands, float32 accumulation; float32
    ones float32-accurate products). Returns float32.
    """
    if impl not in READ_IMPLS:
        raise ValueError(f"mlp_reads: argument `impl` must be one of {READ_IMPLS}; got {impl!r}.")
    _check(starts, queries, a, sources, errors, from_start, state_carry, state_rows, activation, residual)
    if impl == "chunk":
        return mlp_reads_reference(starts, queries, a, sources, errors, from_start, state_carry, state_rows,
                                   activation=activation, residual=residual)
    check_kernel_activation("mlp_reads", activation)
    from atlas_jax.kernels.deep_memory.gpu_reads import mlp_reads_gpu
    return mlp_reads_gpu(starts, queries, a, sources, errors, from_start, state_carry, state_rows,
                         activation=activation, residual=residual, interpret=interpret, block_sizes=block_sizes)


def mlp_state_pass_and_reads(state: MLPStates, a, targets, rows, momentum_rows, decay_end, carry_end,
                             momentum_carry, queries, from_start, state_carry=None, state_rows=None, *,
                             activation: str = "gelu", residual: bool = False, impl: str = "chunk",
                             interpret=None, block_sizes=None, read_block_sizes=None):
    """The split dual form of a depth-2 MLP memory with the ℓ2 objective: `state_pass.mlp_state_pass`
    (its first eight arguments, as there), then `mlp_reads` of every chunk from the start states,
    the sources they give and E = Y − targets (its queries and coefficients, as there). Returns
    (the final state [B, H, ...], outputs [B, H, N, b, dv]), float32, differentiable in every array.
    impl="chunk": the two references in XLA; "pallas": the GPU kernels in one custom VJP, whose
    backward hands the reads' start-state cotangents to the state pass's backward kernel as their
    factors (`atlas_jax.kernels.deep_memory.gpu_split`); block_sizes / read_block_sizes go to the
    state pass's and the reads' kernels. The dual form routes its bf16 kernel calls on a GPU to it."""
    if impl not in READ_IMPLS:
        raise ValueError(f"mlp_state_pass_and_reads: argument `impl` must be one of {READ_IMPLS}; got {impl!r}.")
    if decay_end is None:
        decay_end = jnp.ones(a.shape[:3], jnp.float32)
    check_pass_arguments(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry, activation,
                         residual)
    N, n, h = a.shape[2], a.shape[3], state.w0.shape[-1]
    shaped = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    per_chunk = MLPStates(*(None if x is None else shaped(x.shape[:2] + (N,) + x.shape[2:]) for x in state))
    hidden = shaped(a.shape[:4] + (h,))
    _check(per_chunk, queries, a, MLPSources(hidden, hidden, None), targets, from_start, state_carry, state_rows,
           activation, residual)
    if impl == "pallas":
        check_kernel_activation("mlp_state_pass_and_reads", activation)
        from atlas_jax.kernels.deep_memory.gpu_split import mlp_state_pass_and_reads_gpu
        return mlp_state_pass_and_reads_gpu(state, a, targets, rows, momentum_rows, decay_end, carry_end,
                                            momentum_carry, queries, from_start, state_carry, state_rows,
                                            activation=activation, residual=residual, interpret=interpret,
                                            block_sizes=block_sizes, read_block_sizes=read_block_sizes)
    starts, final = mlp_state_pass_reference(state, a, targets, rows, momentum_rows, decay_end, carry_end,
                                                        momentum_carry, activation=activation, residual=residual)
    sources = mlp_sources_from_starts(starts, a, targets, activation=activation, residual=residual)
    errors = sources.y - targets.astype(jnp.float32)
    return final, mlp_reads_reference(starts, queries, a, sources, errors, from_start, state_carry, state_rows,
                                      activation=activation, residual=residual)
