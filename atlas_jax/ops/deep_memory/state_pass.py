"""The sequential pass of the dual form for a depth-2 MLP memory, reference and dispatch.

Per chunk, from the chunk's start state θ = (W0 [d, h], W1 [h, dv]) and momentum (m0, m1), with
the chunk's n gradient sources a [n, d] (φ(k) of the chunk extended by the Omega window's c − 1
previous steps) and their targets [n, dv]:

    Z = a W0,  H = σ(Z),  Y = H W1 (+ a with the identity residual),  E = Y − targets   (ℓ2)
    D = (E W1ᵀ) ⊙ σ'(Z)                           the first layer's output cotangents
    W0' = P W0 + s m0 + aᵀ (r ⊙ D),   W1' = P W1 + s m1 + Hᵀ (r ⊙ E)
    m0' = μ m0 + aᵀ (ρ ⊙ D),          m1' = μ m1 + Hᵀ (ρ ⊙ E)

P (``decay_end``: the retention's decay over the chunk), s (``carry_end``: the carried momentum's
weight in the chunk-end θ), μ (``momentum_carry``), r (``rows``) and ρ (``momentum_rows``) are
the dual form's chunk-end coefficients (`atlas_jax.forms.dual.chunk_terms`): step sizes, momentum
(either convention), decay and the Omega window's gates are all in them, so the pass itself is the
same for GD and momentum, with or without decay and window. Without momentum m, s, μ, ρ are None.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from atlas_jax import optimizers as inner_opt
from atlas_jax.memory import ACTIVATIONS, MLPMemory
from atlas_jax.objectives import L2

IMPLS = ("chunk", "pallas")
KERNELS = ("gpu", "tpu")
# Activations the kernel evaluates itself (with their first and second derivatives).
KERNEL_ACTIVATIONS = ("gelu", "silu", "tanh", "identity")


class MLPStates(NamedTuple):
    """A depth-2 MLP memory's weights and momentum; leading axes [B, H] (and [N] for per-chunk
    states). m0 / m1 are None without momentum."""

    w0: jax.Array
    w1: jax.Array
    m0: jax.Array | None = None
    m1: jax.Array | None = None


class MLPSources(NamedTuple):
    """A chunk's gradient sources through the memory at its start θ: H = σ(a W0) [n, h], the first
    layer's output cotangents D = (E W1ᵀ) ⊙ σ'(a W0) [n, h] and the predictions Y [n, dv] (E =
    Y − targets). The dual form's reads need exactly these (leading axes [B, H, N] from the op)."""

    hidden: jax.Array
    d0: jax.Array
    y: jax.Array


def mlp_chunk_sources(state: MLPStates, a, targets, *, activation: str, residual: bool) -> MLPSources:
    """The module docstring's Z, H, Y, E, D for one chunk of one sequence and head, float32."""
    z = a @ state.w0
    hidden, act_vjp = jax.vjp(ACTIVATIONS[activation], z)
    y = hidden @ state.w1
    if residual:
        y = y + a
    (d0,) = act_vjp((y - targets) @ state.w1.T)
    return MLPSources(hidden, d0, y)


def mlp_chunk_step(state: MLPStates, a, targets, rows, momentum_rows, decay_end, carry_end,
                   momentum_carry, *, activation: str, residual: bool) -> MLPStates:
    """One chunk for one sequence and head (the module docstring's update), float32."""
    hidden, d0, y = mlp_chunk_sources(state, a, targets, activation=activation, residual=residual)
    e = y - targets
    w0 = decay_end * state.w0 + a.T @ (rows[:, None] * d0)
    w1 = decay_end * state.w1 + hidden.T @ (rows[:, None] * e)
    if state.m0 is None:
        return MLPStates(w0, w1)
    w0 = w0 + carry_end * state.m0
    w1 = w1 + carry_end * state.m1
    m0 = momentum_carry * state.m0 + a.T @ (momentum_rows[:, None] * d0)
    m1 = momentum_carry * state.m1 + hidden.T @ (momentum_rows[:, None] * e)
    return MLPStates(w0, w1, m0, m1)


def check_pass_arguments(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry,
           activation, residual):
    fn = "mlp_state_pass"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{fn}: argument `activation` must be one of {sorted(ACTIVATIONS)}; got "
                         f"{activation!r}.")
    if a.ndim != 5:
        raise ValueError(f"{fn}: argument `a` must be [B, H, N, n, d]; got shape {tuple(a.shape)}.")
    B, H, N, n, d = a.shape
    h = state.w0.shape[-1]
    dv = targets.shape[-1]
    expect = {"state.w0": (state.w0, (B, H, d, h)), "state.w1": (state.w1, (B, H, h, dv)),
              "targets": (targets, (B, H, N, n, dv)), "rows": (rows, (B, H, N, n)),
              "decay_end": (decay_end, (B, H, N))}
    momentum = state.m0 is not None
    if momentum:
        expect.update({"state.m0": (state.m0, (B, H, d, h)), "state.m1": (state.m1, (B, H, h, dv)),
                       "momentum_rows": (momentum_rows, (B, H, N, n)),
                       "carry_end": (carry_end, (B, H, N)),
                       "momentum_carry": (momentum_carry, (B, H, N))})
    elif any(x is not None for x in (state.m1, momentum_rows, carry_end, momentum_carry)):
        raise ValueError(f"{fn}: without momentum (state.m0 None) pass state.m1, momentum_rows, "
                         "carry_end and momentum_carry as None too.")
    check_shapes(fn, expect, "from a = [B, H, N, n, d] and state.w0 = [B, H, d, h]", residual, d, dv)


def check_kernel_activation(fn, activation):
    """NotImplementedError unless the kernels evaluate ``activation`` (impl="pallas")."""
    if activation not in KERNEL_ACTIVATIONS:
        raise NotImplementedError(f"{fn}: impl='pallas' evaluates the activations {KERNEL_ACTIVATIONS}; got "
                                  f"{activation!r}. Use impl='chunk'.")


def check_shapes(fn, expect, origin, residual, d, dv):
    """ValueError naming the first of ``expect`` ({argument: (array or None, shape)}) whose shape
    is not its own (``origin`` says where the shapes come from), or the identity residual's widths."""
    for name, (x, shape) in expect.items():
        if x is None or tuple(x.shape) != shape:
            got = None if x is None else tuple(x.shape)
            raise ValueError(f"{fn}: argument `{name}` must have shape {shape} ({origin}); got {got}.")
    if residual and d != dv:
        raise ValueError(f"{fn}: the identity residual needs d == dv; got d = {d}, dv = {dv}.")


def mlp_state_pass_reference(state: MLPStates, a, targets, rows, momentum_rows=None, decay_end=None,
                             carry_end=None, momentum_carry=None, *, activation: str = "gelu",
                             residual: bool = False):
    """`mlp_chunk_step` scanned over the N chunks of every sequence and head (float32 XLA).

    Args: state [B, H, ...] (θ_0 and m_0); a [B, H, N, n, d]; targets [B, H, N, n, dv]; rows and
    momentum_rows [B, H, N, n]; decay_end, carry_end, momentum_carry [B, H, N].
    Returns: (starts, final): every chunk's start state [B, H, N, ...] and the state after the last.
    """
    f32 = lambda x: None if x is None else x.astype(jnp.float32)
    state = MLPStates(*map(f32, state))

    def one(st, xs):
        def body(carry, chunk):
            new = mlp_chunk_step(carry, *chunk, activation=activation, residual=residual)
            return new, carry
        return jax.lax.scan(jax.checkpoint(body), st, xs)

    xs = tuple(map(f32, (a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry)))
    final, starts = jax.vmap(jax.vmap(one))(state, xs)
    return starts, final


def mlp_sources_from_starts(starts: MLPStates, a, targets, *, activation: str, residual: bool) -> MLPSources:
    """Every chunk's `MLPSources` [B, H, N, ...] from its start state (chunk-parallel, float32)."""
    one = lambda st, a_, t_: mlp_chunk_sources(st, a_, t_, activation=activation, residual=residual)
    f32 = lambda x: x.astype(jnp.float32)
    return jax.vmap(jax.vmap(jax.vmap(one)))(starts, f32(a), f32(targets))


def mlp_state_pass(state: MLPStates, a, targets, rows, momentum_rows=None, decay_end=None,
                   carry_end=None, momentum_carry=None, *, activation: str = "gelu",
                   residual: bool = False, impl: str = "chunk", kernel=None, interpret=None,
                   block_sizes=None, sources: bool = False):
    """The sequential pass (module docstring) for every sequence and head; see
    `mlp_state_pass_reference` for the arguments. impl="chunk": the XLA scan; "pallas": a Pallas
    kernel, differentiable in every array argument: kernel="gpu" (Triton lowering,
    `atlas_jax.kernels.deep_memory.gpu`), "tpu" (Mosaic, `...deep_memory.tpu`) or None ("tpu" on
    a TPU backend, "gpu" elsewhere); interpret and block_sizes go to that kernel (interpret None:
    interpret mode off the kernel's own backend). a may be bf16 (the kernel's dots then take
    bf16 operands, float32 accumulation); states, coefficients and every accumulation are
    float32.

    sources=True also returns every chunk's `MLPSources` (differentiable too): the GPU kernel
    keeps the ones it forms (H and D in a's dtype, Y float32; its backward takes their cotangents
    in the same pass), the others form them from the start states (`mlp_sources_from_starts`,
    float32)."""
    if impl not in IMPLS:
        raise ValueError(f"mlp_state_pass: argument `impl` must be one of {IMPLS}; got {impl!r}.")
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"mlp_state_pass: argument `kernel` must be one of {KERNELS} or None; got "
                         f"{kernel!r}.")
    if decay_end is None:
        decay_end = jnp.ones(a.shape[:3], jnp.float32)
    check_pass_arguments(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry, activation,
                         residual)
    if impl == "chunk":
        out = mlp_state_pass_reference(state, a, targets, rows, momentum_rows, decay_end, carry_end,
                                       momentum_carry, activation=activation, residual=residual)
    else:
        check_kernel_activation("mlp_state_pass", activation)
        if kernel is None:
            kernel = "tpu" if jax.default_backend() == "tpu" else "gpu"
        extra = {"sources": True} if sources and kernel == "gpu" else {}
        out = _state_pass_kernel(kernel)(state, a, targets, rows, momentum_rows, decay_end, carry_end,
                                         momentum_carry, activation=activation, residual=residual,
                                         interpret=interpret, block_sizes=block_sizes, **extra)
    if sources and len(out) == 2:
        out = out + (mlp_sources_from_starts(out[0], a, targets, activation=activation, residual=residual),)
    return out


def _state_pass_kernel(kernel):
    """The kernel entry for `kernel` ("gpu": Triton lowering, "tpu": Mosaic), imported here, at
    trace time (importing the op loads no Pallas)."""
    if kernel == "tpu":
        from atlas_jax.kernels.deep_memory.tpu import mlp_state_pass_tpu
        return mlp_state_pass_tpu
    from atlas_jax.kernels.deep_memory.gpu import mlp_state_pass_gpu
    return mlp_state_pass_gpu


def kernel_covers(spec, d_in: int, d_out: int) -> str | None:
    """Why the state-pass kernel does not run ``spec``'s dual form on a d_in-wide input and d_out
    outputs (None: it does). The dual form decides the rest (the state budget)."""
    memory, opt_kind = spec.memory, inner_opt.info(spec.optimizer).kind
    if type(memory) is not MLPMemory or memory.depth != 2 or memory.layernorm:
        return f"a {memory.describe()} memory (the kernel runs a depth-2 MLP without LayerNorm)"
    if memory.residual and d_in != d_out:
        return "a residual MLP with a skip map (d_φ != V)"
    if memory.activation not in KERNEL_ACTIVATIONS:
        return f"the {memory.activation} activation"
    if type(spec.objective) is not L2:
        return f"the {spec.objective.describe()} objective (the kernel runs ℓ2)"
    if opt_kind not in ("gd", "implicit_gd", "momentum"):
        return f"the {opt_kind} optimizer (the kernel runs GD and momentum)"
    if spec.retention.has_map:
        return "a retention map"
    if spec.retention.decay != "none" and not spec.retention.decoupled:
        return "forget-first decay (gradients at the decayed θ)"
    return None
