"""A depth-2 MLP memory's sequential chunk pass as a Pallas TPU (Mosaic) kernel.

The math is `atlas_jax.ops.deep_memory.state_pass` (its module docstring), the same pass as the
GPU kernel `gpu.py`: per chunk a forward pass of the chunk's gradient sources at the start state,
the ℓ2 residual, the first layer's cotangents and the chunk-end update of W0, W1 (and the momentum
m0, m1). The TPU way of writing the chunk loop is the grid:

  grid (B·H, N), the chunk axis last and "arbitrary" (sequential), B·H "parallel". The current
  state (W0 [d, h], W1 [h, dv], m0, m1) lives in VMEM scratch across the chunk axis, copied from
  the initial state at chunk 0. Each grid step loads its chunk's operands (BlockSpecs: a [n, d],
  targets [n, dv], rows / momentum rows [n, 1], the chunk-end coefficients [1, 1]; pipelined by
  Mosaic), writes the state it starts from to the per-chunk start-state output (block [d, h] at
  (b, n)), then updates the scratch; the last chunk also writes the final state (a separate
  output whose block stays put along the chunk axis, so it goes back to HBM once per b·h).

The whole hidden width is one tile: Z = a W0, H = σ(Z) and σ'(Z) of a chunk are [n, h] values
(64 × 512 float32 is 128 KiB) computed once and used by both the forward and the update, where
the GPU kernel tiles h in two sweeps (registers). VMEM per program, float32: the scratch state,
double-buffered blocks of the initial state, the start-state output and the final state, i.e.
about 7 × the state (titans, d = dv = 128, h = 512 with momentum: 1 MiB a state, ~7 MiB), under
the default scoped limit; `MLPTpuBlockSizes.vmem_limit_bytes` raises it for larger memories.

Padding: d, h and dv to multiples of 128 (lanes; every one of them is a lane dimension of some
operand), n to a multiple of 8 (16 for bf16 sources: the sublane tile), so every block is
(8, 128)-legal; zero padding changes no number (`support.py` says why). The entry's layout,
padding and custom VJP are `support.py`'s, shared with the GPU kernel.

Precision: float32 sources take float32 dots with Precision.HIGHEST (float32-accurate on the MXU)
and float32 accumulation (the delta family's `tpu_math` helpers); bf16 sources (``a`` in bf16)
take bf16 operands in every dot (the state, H, E and the row-scaled cotangents rounded to bf16),
float32 accumulation. States, coefficients, activations and every accumulation are float32. GELU
is the exact (erf) one with `lax.erf` (Mosaic lowers it to math.erf).

Backward: `jax.custom_vjp` (`support.state_pass_vjp`): the reverse pass over chunks runs in XLA
from the kept start states (`mlp_chunk_step`'s VJP, chunk by chunk in reverse), as for the GPU
kernel; the kernel is the forward pass only.

Verification status, honestly: verified in TPU interpret mode (`pltpu.InterpretParams`, on CPU)
against the XLA reference, states and gradients (tests/test_deep_memory_kernel.py), and by Mosaic
lowering only (`jax.export` for platform "tpu": JAX's Pallas->Mosaic rules for the block shapes
and every op in the body). It has never run on a TPU (none available): Mosaic's own compiler
passes in libtpu, VMEM limits and all performance are unchecked.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from atlas_jax.kernels.deep_memory import support
from atlas_jax.kernels.deep_memory.support import F32, BF16, act_and_grad
from atlas_jax.kernels.delta_family.support import is_int
from atlas_jax.kernels.delta_family.tpu import resolve_interpret
from atlas_jax.kernels.delta_family.tpu_math import mm, mm_nt, mm_tn
from atlas_jax.ops.deep_memory.state_pass import MLPStates

__all__ = ["MLPTpuBlockSizes", "mlp_state_pass_tpu"]

_FN = "mlp_state_pass_tpu"
_PARALLEL = getattr(pltpu, "PARALLEL", "parallel")
_ARBITRARY = getattr(pltpu, "ARBITRARY", "arbitrary")
_LANES = 128


def _round_up(n, multiple):
    return -(-int(n) // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class MLPTpuBlockSizes:
    """vmem_limit_bytes: Mosaic's scoped VMEM limit for the kernel (None: the compiler's default;
    the module docstring estimates the need)."""
    vmem_limit_bytes: int | None = None

    def check(self):
        v = self.vmem_limit_bytes
        if v is not None and (not is_int(v) or v <= 0):
            raise ValueError(f"{_FN}: argument `block_sizes.vmem_limit_bytes` must be a positive "
                             f"int or None; got {v!r}.")


@dataclasses.dataclass(frozen=True)
class _Cfg(support.PassCfg):   # interpret: False or a pltpu.InterpretParams
    vmem_limit_bytes: int | None


# ---------------------------------------------------------------------------------------------
# The kernel: one grid step = one chunk of one batch·head


def _kernel(r, cfg: _Cfg):
    names = ("w0", "w1", "m0", "m1") if cfg.momentum else ("w0", "w1")
    operand = (lambda x: x.astype(BF16)) if cfg.low else (lambda x: x.astype(F32))

    @pl.when(pl.program_id(1) == 0)
    def _():
        for name in names:
            r["c_" + name][...] = r[name][...]

    st = {name: r["c_" + name][...] for name in names}
    for name in names:                                      # this chunk's start state
        r["s_" + name][...] = st[name]

    a = operand(r["a"][...])                                 # [n, d]
    rows = r["rows"][...]                                    # [n, 1]
    w1 = operand(st["w1"])
    hidden, slope = act_and_grad(cfg.activation, mm(a, operand(st["w0"])), erf=lax.erf)
    y = mm(operand(hidden), w1)
    if cfg.residual:
        y = y + a.astype(F32)
    e = y - r["t"][...]                                      # [n, dv]
    d0 = mm_nt(operand(e), w1) * slope                       # [n, h]
    decay = r["decay"][...]                                  # [1, 1]
    new = {"w0": decay * st["w0"] + mm_tn(a, operand(rows * d0)),
           "w1": decay * st["w1"] + mm_tn(operand(hidden), operand(rows * e))}
    if cfg.momentum:
        mrows, carry, mcarry = r["mrows"][...], r["carry"][...], r["mcarry"][...]
        new["w0"] = new["w0"] + carry * st["m0"]
        new["w1"] = new["w1"] + carry * st["m1"]
        new["m0"] = mcarry * st["m0"] + mm_tn(a, operand(mrows * d0))
        new["m1"] = mcarry * st["m1"] + mm_tn(operand(hidden), operand(mrows * e))
    for name in names:
        r["c_" + name][...] = new[name]

    @pl.when(pl.program_id(1) == cfg.n_chunks - 1)
    def _():
        for name in names:
            r["f_" + name][...] = new[name]


def _forward(cfg: _Cfg, state: MLPStates, a, t, rows, mrows, decay, carry, mcarry):
    """Operands on the kernel layout ([BH, N, ...], states [BH, ...], padded); returns the start
    states [BH, N, ...] and the final state [BH, ...]."""
    BH, N, n, d = a.shape
    h, dv = state.w0.shape[-1], state.w1.shape[-1]
    chunk = lambda R, D: pl.BlockSpec((None, None, R, D), lambda b, i: (b, i, 0, 0))
    whole = lambda R, D: pl.BlockSpec((None, R, D), lambda b, i: (b, 0, 0))
    column = lambda x: x.reshape(x.shape + (1,))            # [.., n] -> [.., n, 1]
    scalar = lambda x: x.reshape(x.shape + (1, 1))          # [BH, N] -> [BH, N, 1, 1]
    shapes = {"w0": (d, h), "w1": (h, dv), "m0": (d, h), "m1": (h, dv)}
    ins = [("a", a, chunk(n, d)), ("t", t, chunk(n, dv)), ("rows", column(rows), chunk(n, 1)),
           ("decay", scalar(decay), chunk(1, 1)),
           ("w0", state.w0, whole(d, h)), ("w1", state.w1, whole(h, dv))]
    names = ["w0", "w1"]
    if cfg.momentum:
        ins += [("mrows", column(mrows), chunk(n, 1)), ("carry", scalar(carry), chunk(1, 1)),
                ("mcarry", scalar(mcarry), chunk(1, 1)),
                ("m0", state.m0, whole(d, h)), ("m1", state.m1, whole(h, dv))]
        names += ["m0", "m1"]
    outs = [("s_" + x, jax.ShapeDtypeStruct((BH, N) + shapes[x], F32), chunk(*shapes[x])) for x in names]
    outs += [("f_" + x, jax.ShapeDtypeStruct((BH,) + shapes[x], F32), whole(*shapes[x])) for x in names]
    scratch = [("c_" + x, pltpu.VMEM(shapes[x], F32)) for x in names]
    keys = [x[0] for x in ins + outs + scratch]

    def kernel(*refs):
        _kernel(dict(zip(keys, refs)), cfg)

    grid_spec = pl.GridSpec(grid=(BH, N), in_specs=[x[2] for x in ins],
                            out_specs=[x[2] for x in outs], scratch_shapes=[x[1] for x in scratch])
    res = pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=[x[1] for x in outs],
        compiler_params=pltpu.CompilerParams(dimension_semantics=(_PARALLEL, _ARBITRARY),
                                             vmem_limit_bytes=cfg.vmem_limit_bytes),
        interpret=cfg.interpret, name="mlp_state_pass_tpu",
    )(*[x[1] for x in ins])
    k = len(names)
    return MLPStates(*res[:k]), MLPStates(*res[k:])


# ---------------------------------------------------------------------------------------------
# Entry: padding, layout, custom VJP (support.py)


_run = support.jitted_pass(_forward)


def mlp_state_pass_tpu(state: MLPStates, a, targets, rows, momentum_rows, decay_end, carry_end,
                       momentum_carry, *, activation: str, residual: bool, interpret=None,
                       block_sizes=None):
    """`atlas_jax.ops.deep_memory.mlp_state_pass` on the Pallas TPU kernel (arguments checked
    there). Returns (starts [B, H, N, ...], final [B, H, ...]) as MLPStates, float32.

    interpret: None: TPU interpret mode unless the default backend is a TPU; True or a
    pltpu.InterpretParams: interpret mode; False: compile with Mosaic (TPU only).
    block_sizes: MLPTpuBlockSizes or None. Only TPU interpret mode on CPU and the Mosaic lowering
    have been checked (no TPU was available); see the module docstring.
    """
    bs = MLPTpuBlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, MLPTpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be an MLPTpuBlockSizes; got "
                        f"{type(bs).__name__}.")
    bs.check()
    cfg = _Cfg(**support.pass_fields(_FN, state, a, activation, residual),
               vmem_limit_bytes=bs.vmem_limit_bytes, interpret=resolve_interpret(interpret, _FN))
    n, d, h, dv = a.shape[3], a.shape[4], state.w0.shape[-1], targets.shape[-1]
    padded = (_round_up(n, 16 if cfg.low else 8),) + tuple(_round_up(x, _LANES) for x in (d, h, dv))
    return _run(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry,
                cfg=cfg, padded=padded)
