"""A depth-2 MLP memory's sequential chunk pass as a Pallas GPU kernel (Triton lowering).

The math is `atlas_jax.ops.deep_memory.state_pass` (its module docstring): per chunk a forward
pass of the chunk's gradient sources at the start state, the ℓ2 residual, the first layer's
cotangents and the chunk-end update of W0, W1 (and the momentum m0, m1). One program per
(batch·head) walks the N chunks in a `fori_loop`; the hidden width h is tiled (``block_hidden``
columns of W0 / rows of W1 at a time), in two sweeps per chunk: the first sums Y = σ(a W0) W1 over
the tiles, the second, with E = Y − targets known, forms each tile's cotangents and writes its
updated weights. The states live in the outputs: every chunk's start state [N] per program (slot 0
the initial state; chunk n reads slot n and writes slot n + 1, the last chunk the final-state
output instead, a CTA barrier between chunks), which the backward pass and the dual form's
chunk-parallel reads need anyway; a state [d, h] does not fit a program's registers or shared
memory at the sizes users train (titans: 2 × 128 × 512 float32 weights plus the momentum, 1 MiB
per head). Start states and final state are separate outputs: one [N + 1] buffer sliced afterwards
copied it whole (2 GB at titans sizes).

Performance: only B·H programs run, each walking N chunks of two sweeps over h / block_hidden
tiles, so the pass is latency-bound; the sweeps are `fori_loop`s over the tile index (not unrolled
Python loops) so Triton's software pipeliner (``num_stages``) prefetches the next tile's float32
state loads while the current tile's dots run. Measured on an H100 (titans sizes: B4 H8, 64 chunks
of 64, d 128, h 512, momentum, bf16 sources): forward 9.7 ms against 9.85 for the XLA scan (19.7
with unrolled tile loops and the [N + 1] buffer sliced afterwards; block_hidden 128 asks 256 KiB of
shared memory, over the H100's 227 KiB).

Backward: `jax.custom_vjp` (`support.state_pass_vjp`, shared with the TPU kernel); the reverse
pass over chunks runs in XLA from the kept start states (`mlp_chunk_step`'s VJP, chunk by chunk in
reverse), so the kernel is the forward pass only. Padding (to powers of two) and its exactness:
`support.py`.

Precision: bf16 sources (``a`` in bf16) take bf16 tensor-core dots with float32 accumulation;
float32 sources take the delta family's float32-accurate dots (six bf16 dots of split operands,
`gpu_math.mm`). States, coefficients and every accumulation are float32. GELU is the exact (erf)
one, with erf from Abramowitz–Stegun 7.1.26 (`support.erf_as`, absolute error below 1.5e-7: the
Triton lowering has no erf).

Verification: interpret mode on CPU against the XLA reference (tests/test_deep_memory_kernel.py);
the `gpu`-marked tests compile it. On an H100 (2026-11-25, after the tile loops became
`fori_loop`s): float32 without momentum (residual MLP, d = dv = h = 128) and bf16 with momentum
(h 512) equal the XLA pass, states and all gradients (1e-5 and 2e-2 bars). float32 with momentum
does not fit shared memory (270 KiB asked at block_hidden 32 and one stage, 227 available): the
call raises NotImplementedError naming the fix (bf16 sources, or impl='chunk'); the default
block sizes for float32 are block_hidden 32 and one stage (64 and two asked 352 KiB).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.deep_memory import support
from atlas_jax.kernels.deep_memory.support import F32, act_and_grad, is_int
from atlas_jax.kernels.delta_family.gpu_math import load_f32, mm, mm_nt, mm_tn
from atlas_jax.ops.deep_memory.state_pass import MLPStates

__all__ = ["MLPGpuBlockSizes", "mlp_state_pass_gpu"]

_FN = "mlp_state_pass_gpu"


def _next_pow2(n, least=16):
    return max(least, 1 << (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class MLPGpuBlockSizes:
    """block_hidden: hidden columns per tile (a power of two >= 16 dividing h padded to a power
    of two; None: min(h, 64)). num_warps: warps per program. num_stages: Triton's software
    pipelining depth for the loops over hidden tiles (a positive int; 1: no prefetch; None: 2 for
    bf16 inputs, 1 for float32, whose two stages of 64-wide tiles ask 352 KiB of shared memory
    where an H100 has 227)."""
    block_hidden: int | None = None
    num_warps: int = 8
    num_stages: int | None = None

    def resolve(self, h, low: bool):
        return dataclasses.replace(
            self, block_hidden=min(h, 64 if low else 32) if self.block_hidden is None else self.block_hidden,
            num_stages=(2 if low else 1) if self.num_stages is None else self.num_stages)

    def check(self, h):
        b = self.block_hidden
        if not is_int(b) or b < 16 or b & (b - 1) or h % b:
            raise ValueError(f"{_FN}: argument `block_sizes.block_hidden` must be a power of two >= 16 "
                             f"dividing the hidden width {h} (padded to a power of two); got {b!r}.")
        w = self.num_warps
        if not is_int(w) or w < 1 or w > 32 or w & (w - 1):
            raise ValueError(f"{_FN}: argument `block_sizes.num_warps` must be a power of two from 1 "
                             f"to 32; got {w!r}.")
        st = self.num_stages
        if not is_int(st) or st < 1:
            raise ValueError(f"{_FN}: argument `block_sizes.num_stages` must be a positive int; "
                             f"got {st!r}.")


@dataclasses.dataclass(frozen=True)
class _Cfg(support.PassCfg):
    hidden: int
    block_hidden: int
    num_warps: int
    num_stages: int


# ---------------------------------------------------------------------------------------------
# The kernel


def _scalar(ref, i):
    """Element i of a per-chunk [N] ref as a [1, 1] value (Triton tiles are at least 1-D)."""
    return load_f32(ref, pl.ds(i, 1))[None, :]


def _kernel(r, cfg: _Cfg):
    """r: the refs by name: operands (a, t, rows, decay, w0, w1; with momentum mrows, carry,
    mcarry, m0, m1), start-state outputs s_* [N, ...] and final-state outputs f_* [...]."""
    low, bt, N = cfg.low, cfg.block_hidden, cfg.n_chunks
    names = ("w0", "w1", "m0", "m1") if cfg.momentum else ("w0", "w1")

    def barrier():
        if not cfg.interpret:   # interpret mode runs a program's statements in order
            plgpu.debug_barrier()

    def tile(j):                # hidden columns of tile j (rows of W1 / m1)
        return pl.ds(pl.multiple_of(j * bt, bt), bt)

    def idx(name, cols):        # a tile of a state: columns of W0 / m0, rows of W1 / m1
        return (slice(None), cols) if name in ("w0", "m0") else (cols, slice(None))

    # Slot 0 of the start states is the initial state.
    def copy_initial(j, carry):
        cols = tile(j)
        for name in names:
            r["s_" + name][(0,) + idx(name, cols)] = load_f32(r[name], idx(name, cols))
        return carry

    lax.fori_loop(0, cfg.hidden // bt, copy_initial, 0)
    barrier()

    def operand(x):
        return x if low else x.astype(F32)

    def chunk(i, carry):
        a = operand(r["a"][i, :, :])                         # [n, d]
        targets = load_f32(r["t"], (i, slice(None), slice(None)))
        rows = load_f32(r["rows"], (i, slice(None)))[:, None]  # [n, 1]
        decay = _scalar(r["decay"], i)

        def load(name, cols):                                # chunk i's start state, one tile
            return load_f32(r["s_" + name], (i,) + idx(name, cols))

        def store(name, cols, value):                        # chunk i's end state, one tile
            @pl.when(i + 1 < N)
            def _():
                r["s_" + name][(i + 1,) + idx(name, cols)] = value

            @pl.when(i + 1 == N)
            def _():
                r["f_" + name][idx(name, cols)] = value

        def forward_tile(j, y):                              # Y = σ(a W0) W1, tile by tile
            cols = tile(j)
            hidden, _ = act_and_grad(cfg.activation, mm(a, load("w0", cols), low))
            return y + mm(hidden, load("w1", cols), low)

        y0 = a.astype(F32) if cfg.residual else jnp.zeros(targets.shape, F32)
        y = lax.fori_loop(0, cfg.hidden // bt, forward_tile, y0)
        e = y - targets
        row_e = rows * e
        if cfg.momentum:
            mrows = load_f32(r["mrows"], (i, slice(None)))[:, None]
            mrow_e = mrows * e
            carry_end, momentum_carry = _scalar(r["carry"], i), _scalar(r["mcarry"], i)

        def update_tile(j, unused):                          # cotangents and the chunk-end update
            cols = tile(j)
            w0, w1 = load("w0", cols), load("w1", cols)
            hidden, slope = act_and_grad(cfg.activation, mm(a, w0, low))
            d0 = mm_nt(e, w1, low) * slope                   # [n, bt]
            new_w0 = decay * w0 + mm_tn(a, operand(rows * d0), low)
            new_w1 = decay * w1 + mm_tn(operand(hidden), operand(row_e), low)
            if cfg.momentum:
                m0, m1 = load("m0", cols), load("m1", cols)
                new_w0 = new_w0 + carry_end * m0
                new_w1 = new_w1 + carry_end * m1
                store("m0", cols, momentum_carry * m0 + mm_tn(a, operand(mrows * d0), low))
                store("m1", cols, momentum_carry * m1 + mm_tn(operand(hidden), operand(mrow_e), low))
            store("w0", cols, new_w0)
            store("w1", cols, new_w1)
            return unused

        lax.fori_loop(0, cfg.hidden // bt, update_tile, 0)
        barrier()
        return carry

    lax.fori_loop(0, N, chunk, 0)


def _forward(cfg: _Cfg, state: MLPStates, a, t, rows, mrows, decay, carry, mcarry):
    """Operands on the kernel layout ([BH, N, ...], states [BH, ...], padded); returns the start
    states [BH, N, ...] and the final state [BH, ...] (separate outputs of the kernel)."""
    BH, N, n, d = a.shape
    h, dv = state.w0.shape[-1], state.w1.shape[-1]
    seq = lambda *rest: pl.BlockSpec((None, N) + rest, lambda b: (b,) + (0,) * (len(rest) + 1))
    whole = lambda *rest: pl.BlockSpec((None,) + rest, lambda b: (b,) + (0,) * len(rest))
    ins = [("a", a, seq(n, d)), ("t", t, seq(n, dv)), ("rows", rows, seq(n)), ("decay", decay, seq()),
           ("w0", state.w0, whole(d, h)), ("w1", state.w1, whole(h, dv))]
    shapes = [("w0", (d, h)), ("w1", (h, dv))]
    if cfg.momentum:
        ins += [("mrows", mrows, seq(n)), ("carry", carry, seq()), ("mcarry", mcarry, seq()),
                ("m0", state.m0, whole(d, h)), ("m1", state.m1, whole(h, dv))]
        shapes += [("m0", (d, h)), ("m1", (h, dv))]
    outs = ([("s_" + name, seq(*shape), (BH, N) + shape) for name, shape in shapes]
            + [("f_" + name, whole(*shape), (BH,) + shape) for name, shape in shapes])
    names = [x[0] for x in ins] + [x[0] for x in outs]

    def kernel(*refs):
        _kernel(dict(zip(names, refs)), cfg)

    res = pl.pallas_call(
        kernel, grid=(BH,),
        in_specs=[x[2] for x in ins], out_specs=[x[1] for x in outs],
        out_shape=[jax.ShapeDtypeStruct(x[2], F32) for x in outs],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=cfg.interpret, name="mlp_state_pass",
    )(*[x[1] for x in ins])
    k = len(shapes)
    return MLPStates(*res[:k]), MLPStates(*res[k:])


# ---------------------------------------------------------------------------------------------
# Entry: padding, layout, custom VJP (support.py)


_run = support.jitted_pass(_forward)


def default_interpret():
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def mlp_state_pass_gpu(state: MLPStates, a, targets, rows, momentum_rows, decay_end, carry_end,
                       momentum_carry, *, activation: str, residual: bool, interpret=None,
                       block_sizes=None):
    """`atlas_jax.ops.deep_memory.mlp_state_pass` on the Pallas GPU kernel (arguments checked
    there). Returns (starts [B, H, N, ...], final [B, H, ...]) as MLPStates, float32."""
    bs = MLPGpuBlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, MLPGpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be an MLPGpuBlockSizes; got "
                        f"{type(bs).__name__}.")
    hp = _next_pow2(state.w0.shape[-1])
    bs = bs.resolve(hp, low=a.dtype == jnp.bfloat16)
    bs.check(hp)
    cfg = _Cfg(**support.pass_fields(_FN, state, a, activation, residual), hidden=hp,
               block_hidden=bs.block_hidden, num_warps=bs.num_warps, num_stages=bs.num_stages,
               interpret=bool(default_interpret() if interpret is None else interpret))
    if cfg.momentum and not cfg.low and not cfg.interpret:
        # H100, d = dv = h = 128: 270 KiB of shared memory asked (227 available) even at
        # block_hidden 32 and one stage; the float32 momentum copies are not tiled
        raise NotImplementedError(f"{_FN}: float32 sources with momentum do not fit a GPU's shared memory "
                                  f"in this kernel; pass `a` (q, k, v) as bfloat16, or use impl='chunk'.")
    padded = tuple(_next_pow2(x) for x in (a.shape[3], a.shape[4], hp, targets.shape[-1]))
    return _run(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry,
                cfg=cfg, padded=padded)
