"""What the deep-memory state-pass kernels share, Pallas-free: activations, padding, layout, VJP.

Pure Python and jax.numpy (no Pallas, Triton or Mosaic). The GPU (`gpu.py`) and TPU (`tpu.py`)
kernels run one computation, `atlas_jax.ops.deep_memory.state_pass` (its module docstring), on
one layout: per-chunk operands [B·H, N, ...] (a [n, d], targets [n, dv], rows [n], per-chunk
coefficients []), states [B·H, ...] (W0 [d, h], W1 [h, dv]), every size zero-padded to what the
kernel's tiles want. A kernel's forward returns every chunk's start state [B·H, N, ...] and the
final state [B·H, ...]; `state_pass_vjp` makes it differentiable through one reverse pass in XLA.

Zero padding changes no number, for activations with σ(0) = 0 (gelu, silu, tanh, identity):
padded sources (rows of a, with r = ρ = 0) write nothing; a padded input column of a meets only
zero rows of W0 and writes only them; a padded hidden unit has Z = 0, so H = σ(0) = 0, with a
zero row of W1 its cotangent D = (E W1ᵀ) ⊙ σ' is 0 too, so its column of W0 and row of W1 (and
momentum) start at 0 and stay 0; a padded value column has Y = targets = 0 (the residual adds a
padded column of a, also 0), so E is 0 there.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from atlas_jax.ops.deep_memory.state_pass import MLPSources, MLPStates, mlp_chunk_step

F32, BF16 = jnp.float32, jnp.bfloat16
_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclasses.dataclass(frozen=True)
class PassCfg:
    """Static description of one call (hashable: the custom_vjp's nondiff argument); each kernel
    subclasses it with its own fields."""
    n_chunks: int
    momentum: bool
    residual: bool
    activation: str
    low: bool              # bf16 sources: bf16 dot operands, float32 accumulation
    interpret: object


def pass_fields(fn, state, a, activation, residual):
    """PassCfg's fields for a call (the op checked the shapes), less `interpret`; TypeError
    unless the sources are float32 or bfloat16."""
    if a.dtype not in (F32, BF16):
        raise TypeError(f"{fn}: argument `a` must be float32 or bfloat16; got {a.dtype}.")
    return dict(n_chunks=int(a.shape[2]), momentum=state.m0 is not None, residual=bool(residual),
                activation=activation, low=a.dtype == BF16)


# ---------------------------------------------------------------------------------------------
# Activations with their derivatives, from elementwise operations both lowerings have


def erf_as(x):
    """erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), for lowerings without erf
    (Triton)."""
    t = 1.0 / (1.0 + 0.3275911 * jnp.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y = 1.0 - poly * jnp.exp(-x * x)
    return jnp.where(x < 0, -y, y)


def act_grad2(name, z, erf=erf_as):
    """(σ(z), σ'(z), σ''(z)) in float32 (σ'' is the backward's curvature term); GELU is the exact
    (erf) one, with `erf` (lax.erf where the lowering has it)."""
    if name == "gelu":
        cdf = 0.5 * (1.0 + erf(z * _SQRT_HALF))
        pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * z * z)
        return z * cdf, cdf + z * pdf, pdf * (2.0 - z * z)
    if name == "silu":
        s = 1.0 / (1.0 + jnp.exp(-z))
        return z * s, s * (1.0 + z * (1.0 - s)), s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))
    if name == "tanh":
        t = jnp.tanh(z)
        return t, 1.0 - t * t, -2.0 * t * (1.0 - t * t)
    return z, jnp.ones_like(z), jnp.zeros_like(z)   # identity


def act_and_grad(name, z, erf=erf_as):
    """(σ(z), σ'(z)): `act_grad2` less the curvature (which the compiler then drops)."""
    return act_grad2(name, z, erf)[:2]


# ---------------------------------------------------------------------------------------------
# The custom VJP: a kernel's forward, the reverse pass in XLA


def state_pass_vjp(forward):
    """`core(cfg, state, a, t, rows, mrows, decay, carry, mcarry) -> (starts, final)` on the
    kernel layout (module docstring), differentiable in every array argument.

    forward(cfg, ...) (same arguments) runs the kernel; cfg (static, hashable) carries
    `activation` and `residual`. The backward walks the chunks from the last in XLA: the VJP of
    `mlp_chunk_step` at each kept start state, plus the cotangent that start state receives
    directly (the starts are an output); the first chunk's start state is the initial one.
    """
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def core(cfg, state, *xs):
        return forward(cfg, state, *xs)

    def core_fwd(cfg, state, *xs):
        starts, final = forward(cfg, state, *xs)
        return (starts, final), (starts,) + xs

    def core_bwd(cfg, res, cts):
        starts, *xs = res
        d_starts, d_final = cts

        def one(start, xs_, d_start, d_last):
            def body(d_next, chunk):
                st, d_st, operands = chunk
                step = lambda s, *ops: mlp_chunk_step(s, *ops, activation=cfg.activation,
                                                      residual=cfg.residual)
                _, pullback = jax.vjp(step, st, *operands)
                d_state, *d_ops = pullback(d_next)
                d_state = jax.tree.map(jnp.add, d_state, d_st)
                return d_state, tuple(d_ops)

            return lax.scan(body, d_last, (start, d_start, xs_), reverse=True)

        f32 = lambda x: None if x is None else x.astype(F32)
        d_first, d_ops = jax.vmap(one)(starts, tuple(map(f32, xs)), d_starts, d_final)
        d_ops = tuple(None if x is None else g.astype(x.dtype) for g, x in zip(d_ops, xs))
        return (d_first,) + d_ops

    core.defvjp(core_fwd, core_bwd)
    return core


# ---------------------------------------------------------------------------------------------
# Layout and padding around a kernel


def pad_to(x, shape):
    """x zero-padded at the end of every axis to ``shape``."""
    return jnp.pad(x, [(0, s - n) for n, s in zip(x.shape, shape)])


def pass_operands(padded, state, a, t, rows, mrows, decay, carry, mcarry):
    """The op's arguments ([B, H, N, ...], states [B, H, ...]) in the kernels' layout: B·H
    flattened, per-chunk operands cast to float32 (a keeps its dtype), n, d, h, dv zero-padded to
    ``padded`` = (n', d', h', dv')."""
    B, H, N = a.shape[:3]
    np_, dp, hp, vp = padded

    def flat(x, *tail):
        return None if x is None else pad_to(x.reshape((B * H,) + x.shape[2:]), (B * H,) + tail)

    f32 = lambda x: None if x is None else x.astype(F32)
    st = MLPStates(flat(f32(state.w0), dp, hp), flat(f32(state.w1), hp, vp),
                   flat(f32(state.m0), dp, hp), flat(f32(state.m1), hp, vp))
    return (st, flat(a, N, np_, dp), flat(f32(t), N, np_, vp), flat(f32(rows), N, np_), flat(f32(mrows), N, np_),
            flat(f32(decay), N), flat(f32(carry), N), flat(f32(mcarry), N))


def _unflat(x, B, H, lead, rows, cols):
    return None if x is None else x.reshape((B, H) + lead + x.shape[-2:])[..., :rows, :cols]


def unpad_states(s: MLPStates, B, H, lead, d, h, dv) -> MLPStates:
    """Kernel-layout states [B·H, *lead, ...] (padded) as [B, H, *lead, ...] of the op's sizes."""
    return MLPStates(_unflat(s.w0, B, H, lead, d, h), _unflat(s.w1, B, H, lead, h, dv),
                     _unflat(s.m0, B, H, lead, d, h), _unflat(s.m1, B, H, lead, h, dv))


def run_padded(core, cfg, padded, state, a, t, rows, mrows, decay, carry, mcarry):
    """`core` (a `state_pass_vjp`) on the op's arguments in the kernels' layout (`pass_operands`);
    returns (starts [B, H, N, ...], final [B, H, ...]) unpadded, float32; and every chunk's
    MLPSources [B, H, N, ...] where ``core`` returns them too."""
    B, H, N, n, d = a.shape
    h, dv = state.w0.shape[-1], state.w1.shape[-1]
    starts, final, *sources = core(cfg, *pass_operands(padded, state, a, t, rows, mrows, decay, carry, mcarry))
    out = (unpad_states(starts, B, H, (N,), d, h, dv), unpad_states(final, B, H, (), d, h, dv))
    if sources:   # a kernel that returns every chunk's MLPSources as well
        (src,) = sources
        out += (MLPSources(_unflat(src.hidden, B, H, (N,), n, h), _unflat(src.d0, B, H, (N,), n, h),
                           _unflat(src.y, B, H, (N,), n, dv)),)
    return out


def jitted_pass(forward):
    """The jitted entry `run(state, a, t, rows, mrows, decay, carry, mcarry, *, cfg, padded)` of a
    kernel's forward: `run_padded` around its `state_pass_vjp`."""
    core = state_pass_vjp(forward)

    @functools.partial(jax.jit, static_argnames=("cfg", "padded"))
    def run(*args, cfg, padded):
        return run_padded(core, cfg, padded, *args)

    return run
