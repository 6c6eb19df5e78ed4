"""A depth-2 MLP memory's sequential chunk pass, forward and backward, as persistent Pallas GPU
kernels (Triton lowering) with a grid barrier per chunk.

The math is `atlas_jax.ops.deep_memory.state_pass` (its module docstring). The hidden width h is
split into tiles of ``block_hidden`` units; a program (tile j, sequence·head bh) owns tile j of W0's
columns, W1's rows and the momentum's, for all N chunks of its head. Per chunk, forward:

    Z_j = a W0_j,  H_j = σ(Z_j),  share_j = H_j W1_j            [grid barrier of the head's tiles]
    Y = Σ_j share_j (+ a),  E = Y − targets,  D_j = (E W1_jᵀ) ⊙ σ'(Z_j)
    W0_j' = P W0_j + s m0_j + aᵀ (r ⊙ D_j),   W1_j' = P W1_j + s m1_j + H_jᵀ (r ⊙ E)
    m0_j' = μ m0_j + aᵀ (ρ ⊙ D_j),            m1_j' = μ m1_j + H_jᵀ (ρ ⊙ E)

Every chunk's start state and Y are kept (outputs: the dual form's reads and the backward need
them). On the joint route with the reads (``factors``) and bf16 sources the start states are kept
in bf16, as the products take them (the scalar cotangents' inner products below read those
copies too: within the bf16 bar, tested), while the recursion carries float32 tiles in a running
buffer of two slots a head: titans' layer 0.972 (B4 T4096) and 0.953 (B1 T16384) of the float32
starts (H200, one command; benchmarks/results/titans_kept_starts_h200_2026-11-29.md). With
``sources`` H_j and D_j are kept too, in the sources' dtype (the reads' source pass:
`state_pass.MLPSources`, whose cotangents join A_j, Ĥ_j and Ê below). Backward, chunks from the
last, with the chunk-end cotangents X0_j, X1_j (θ) and M0_j, M1_j (momentum) of tile j, and
G_j = E W1_jᵀ:

    A_j = r ⊙ (a X0_j) + ρ ⊙ (a M0_j)           (D_j's cotangent),  Q_j = A_j ⊙ σ'(Z_j)
    Ê_share_j = r ⊙ (H_j X1_j) + ρ ⊙ (H_j M1_j) + Q_j W1_j                  [grid barrier]
    Ê = Σ_j Ê_share_j,   Ĥ_j = (r ⊙ E) X1_jᵀ + (ρ ⊙ E) M1_jᵀ + Ê W1_jᵀ
    Ẑ_j = Ĥ_j ⊙ σ'(Z_j) + A_j ⊙ G_j ⊙ σ''(Z_j)
    start-state cotangents: X0_j ← P X0_j + aᵀ Ẑ_j,  X1_j ← P X1_j + Q_jᵀ E + H_jᵀ Ê,
                            M0_j ← s X0_j + μ M0_j,  M1_j ← s X1_j + μ M1_j   (+ the starts' own)
    â = Σ_j [(r ⊙ D_j) X0_jᵀ + (ρ ⊙ D_j) M0_jᵀ + Ẑ_j W0_jᵀ] (+ Ê),  targets' = −Ê,
    r̂ = Σ_j rowsum(D_j ⊙ a X0_j + H_j ⊙ E X1_jᵀ) (ρ̂ alike with M), and in XLA from every chunk's
    kept chunk-end cotangents: P̂ = <X, θ>, ŝ = <X, m>, μ̂ = <M, m>.

The sums over tiles that feed back into the chunk recursion (Y forward, Ê backward) go through a
double-buffered [2, tiles] slot per head and a grid barrier (an atomic counter per head, spun on
with atomic reads); those that do not (â, r̂, ρ̂) are written per tile and summed in XLA (â in the
sources' dtype; summed in the kernel through the barrier's shares it was slower, 24.97 against
24.54 ms for titans' layer below). The backward's Ê shares and total are stored in the sources'
dtype (bf16 on the fast path, the dtype Ê takes as the products' operand) and summed in float32:
half the bytes a head's tiles exchange through L2 every chunk, titans' layer 0.958 at B4 T4096 and
0.970 at B1 T16384 H8 of the float32 exchange (H200, one command; the total alone in bf16: 0.987
and 1.000; benchmarks/results/titans_register_cap_h200_2026-11-29b.md). The forward's Y shares and
its E total alike (Y stored in float32 from the float32 sum): 0.990 / 0.992 (the total alone 1.007
/ 0.997; benchmarks/results/titans_y_exchange_h200_2026-11-29c.md). The barrier itself keeps
a head's tiles on one chunk, which is what lets their loads of the chunk's shared operands meet in
L2: without the head sum (each tile its own share, wrong numbers) the layer took 1.27× / 1.40×.
The backward keeps every chunk's start-state cotangent ([B·H, N, ...], written over the start
states' own cotangents, the first the initial state's) instead of one in place, so that the three
scalar cotangents are one XLA pass rather than six tile products and full-tile reductions per chunk
in the kernel: the layer 23.64 against 24.55 ms, with that pass. (Again at 16-wide paired tiles,
2026-11-29: those reductions in the kernel, its carried cotangents in two slots a head instead of
kept, took titans' layer 1.07× the time for 2 GiB less peak at B4 T4096 and B1 T16384 H8;
benchmarks/results/titans_register_cap_h200_2026-11-29b.md.)
A head's tiles are consecutive programs (the tile index is the fastest grid axis), so the barrier
needs only a head's tiles resident at once, not the whole grid. A spin that reaches its cap (a
deadlock) poisons that head's results with NaN rather than returning wrong numbers.

Why persistent: the chunk recursion is sequential and its per-chunk work is small (titans: five
64 × 128 × 512 products per head), so a scan in XLA is bound by launches and by copying the carried
state (1 MiB per head) every iteration, and one program per head walking its tiles (this file's
kernel before) leaves most of the GPU idle. Here every tile stays with one program for the whole
sequence.

Where the time goes (H200, 2026-11-29; benchmarks/results/titans_kept_starts_h200_2026-11-29.md):
every kernel here takes all 255 registers a thread (12.5% occupancy: two 4-warp programs a
multiprocessor), and the backward's chain takes ~27 µs a chunk (~25 after the bf16 exchanges and
the single loads above; benchmarks/results/titans_y_exchange_h200_2026-11-29c.md) whether its
programs are all resident (B1 T16384 H8) or run in waves of heads (B4 T4096 H8: ~4 waves). It is
bound mostly by the chain's latency on a program, not by its dots or by the count of
multiprocessors, and then by the L2 traffic a head's tiles share (the Ê exchange above: 0.958 at
half its bytes); hence tiles loaded where used rather than kept (held, they spill), narrow
backward tiles (fewer values a thread) and warps chosen by residency. The defaults, each from a
same-command comparison of titans' layer (bf16, forward+backward, H8 D128; older kernels' numbers
and the rest of the history: benchmarks/results/deep_memory_gpu_kernel_history.md):

- warps: 8 where a kernel's programs fit one a multiprocessor, else 4 (eight warps take a whole
  multiprocessor's registers: the backward on 8 warps at B4 and B1 takes 1.38× and 1.36×);
- forward tiles 32 wide (16 wide: 1.062 at B4 T4096, 1.019 at B1 T16384);
- backward tiles 16 wide with paired products (below) where there is momentum: B4 T4096 17.68 ->
  16.05 ms against 64 wide unpaired (32 wide: 16.57), B8 T2048 18.59 -> 16.91; without momentum
  (ttt_mlp, unpaired) 32 wide where those programs outnumber the multiprocessors (B4 T4096 10.64
  -> 9.25 ms against 16), else 16 (at B1 T16384 32 wide, on 8 warps, took 13.36 against 11.36);
- no register cap and one pipeline stage: Triton's `ttg.maxnreg` (benchmarks/register_cap.py) at
  168 / 128 registers spills, 1.31× / 1.54× at B4 T4096; two stages change nothing (1.000);
- `impl="auto"` takes these kernels for bf16 inputs only: with float32 sources and TF32 dots the
  forward runs level with XLA, with exact dots at about twice its time.

Paired products (``pair_products``, with momentum): the backward keeps each tile's X and M side by
side (W0's columns, W1's rows: `_half`), so that the products of the chunk's rows with both are
one product over the pair — a [X0 | M0], E [X1 | M1]ᵀ, [r ⊙ H | ρ ⊙ H] [X1; M1] and
[r ⊙ D | ρ ⊙ D] [X0 | M0]ᵀ — 12 products a chunk instead of 16. Where the tiles are 16 wide (few
values a thread) the count of products sets the time, and titans' layer at B1 T16384 takes 21.84
against 24.53 ms; with 64-wide tiles on 4 warps the wider values spill, 23.00 against 18.93 at B4
(H200, one command each, 2026-11-28), so by default only 16-wide tiles pair. The kept cotangents
are then a buffer of their own rather than written over the start states' cotangents: one more
[B·H, N, θ + momentum] float32 buffer on the route that loads those (2 GiB at B1 T16384 H8). With
its few values a thread, the paired path also loads the tiles its products take once a chunk,
forms Ẑ's terms but its Ê one before the head sum and loads a and E again after it: titans' layer
at B1 T16384 0.970, then 0.983 (H200, one command each; the unpaired path, where the same order
cost 1.006-1.030 on B4's then 64-wide tiles, keeps its own; `_bwd_kernel`'s notes).

Interpret mode runs programs one after another, so a barrier between programs can never be met
there: in interpret mode the kernel runs with one tile per head (block_hidden = h), the same
code with the barrier trivially met; the cross-tile sums are checked on a GPU.

Precision: bf16 sources take bf16 tensor-core dots (float32 accumulation), every operand of the
backward's dots bf16 too; float32 sources take six bf16 dots of split operands per product
(``dots="exact"``, the default: float32-accurate, the delta family's scheme) or one TF32 dot
(``dots="tf32"``, what XLA does for a float32 matmul on these GPUs at JAX's default precision).
States, coefficients, cotangents and every accumulation are float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.deep_memory import support
from atlas_jax.kernels.deep_memory.support import F32, BF16, act_and_grad, act_grad2
from atlas_jax.kernels.delta_family.gpu import default_interpret
from atlas_jax.kernels.delta_family.gpu_math import load_f32, mm, mm_nt, mm_tn
from atlas_jax.kernels.delta_family.support import check_num_warps, is_int
from atlas_jax.kernels.omega.support import next_pow2
from atlas_jax.ops.deep_memory.state_pass import MLPSources, MLPStates

__all__ = ["MLPGpuBlockSizes", "mlp_state_pass_gpu"]

_FN = "mlp_state_pass_gpu"
DOTS = ("tf32", "exact")
BACKWARDS = ("kernel", "xla")
# Spins of a grid barrier before it gives up (a deadlock; each spin is one atomic read).
SPIN_CAP = 1 << 16


@dataclasses.dataclass(frozen=True)
class MLPGpuBlockSizes:
    """block_hidden / block_hidden_bwd: hidden units per program of the forward / backward kernel
    (powers of two >= 16 dividing h padded to a power of two; None: min(h, 32) forward; backward h
    where h < 64, else 16 with momentum (paired) and, without, 32 where those programs outnumber
    the multiprocessors, else 16; module docstring); in interpret mode both must be h (one tile per
    head, module docstring).
    num_warps_fwd / num_warps_bwd: warps per program (None: 8 when that kernel's programs fit one
    per multiprocessor, else 4; module docstring). dots: the float32 sources' products, "exact"
    (default) or "tf32" (bf16 sources always take bf16 dots). backward: "kernel" (the persistent
    backward kernel; the default) or "xla" (the reverse pass in XLA from the kept start states,
    `support.state_pass_vjp`). pair_products: with momentum, the backward kernel keeps each
    tile's θ and momentum cotangents side by side and takes every two products that share an
    operand as one (a X0 and a M0, E X1ᵀ and E M1ᵀ, ...: 16 products a chunk become 12); None:
    where its tiles are 16 wide (module docstring)."""
    block_hidden: int | None = None
    block_hidden_bwd: int | None = None
    num_warps_fwd: int | None = None
    num_warps_bwd: int | None = None
    dots: str = "exact"
    backward: str = "kernel"
    pair_products: bool | None = None

    def resolve(self, h, interpret, sequences_heads, momentum=True):
        fwd = self.block_hidden
        if fwd is None:
            fwd = h if interpret else min(h, 32)
        bwd = self.block_hidden_bwd
        if bwd is None:   # the module docstring's measurements
            if interpret or h < 64:
                bwd = h
            elif momentum and self.pair_products is not False:   # 16 wide, paired
                bwd = 16
            else:   # unpaired: 32 wide where its programs outnumber the multiprocessors (4 warps)
                bwd = 32 if (h // 32) * sequences_heads > _multiprocessors() else 16

        def warps(given, tile):   # 8 while the programs fit one per multiprocessor
            if given is not None or not is_int(tile) or tile <= 0:
                return given
            return 8 if (h // tile) * sequences_heads <= _multiprocessors() else 4

        pairs = self.pair_products
        if pairs is None:   # pays where the chain's count of products sets its time, not its registers
            pairs = is_int(bwd) and bwd <= 16
        return dataclasses.replace(self, block_hidden=fwd, block_hidden_bwd=bwd,
                                   num_warps_fwd=warps(self.num_warps_fwd, fwd),
                                   num_warps_bwd=warps(self.num_warps_bwd, bwd), pair_products=pairs)

    def check(self, h, interpret):
        for name in ("block_hidden", "block_hidden_bwd"):
            b = getattr(self, name)
            if not is_int(b) or b < 16 or b & (b - 1) or h % b:
                raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a power of two >= 16 dividing "
                                 f"the hidden width {h} (padded to a power of two); got {b!r}.")
            if interpret and b != h:
                raise ValueError(f"{_FN}: in interpret mode `block_sizes.{name}` must be the whole hidden "
                                 f"width {h} (programs run one after another there, so tiles of one head could "
                                 f"never meet at a barrier); got {b}.")
        check_num_warps(_FN, self, ("num_warps_fwd", "num_warps_bwd"))
        if self.backward not in BACKWARDS:
            raise ValueError(f"{_FN}: argument `block_sizes.backward` must be one of {BACKWARDS}; got "
                             f"{self.backward!r}.")
        if self.dots not in DOTS:
            raise ValueError(f"{_FN}: argument `block_sizes.dots` must be one of {DOTS}; got {self.dots!r}.")
        if not isinstance(self.pair_products, bool):
            raise ValueError(f"{_FN}: argument `block_sizes.pair_products` must be True, False or None; got "
                             f"{self.pair_products!r}.")


@dataclasses.dataclass(frozen=True)
class _Cfg(support.PassCfg):
    hidden: int
    block_hidden: int        # this kernel's (forward or backward)
    num_warps_fwd: int
    num_warps_bwd: int
    dots: str
    block_hidden_bwd: int
    sources: bool = False    # the forward also returns every chunk's H, D and Y (state_pass.MLPSources)
    factors: bool = False    # the backward takes the start states' cotangents as `StartFactors`
    pairs: bool = False      # the backward keeps X and M side by side (`_half`; momentum only)
    low_starts: bool = False  # every chunk's start state kept in bf16 (`_forward`; the joint route)

    @property
    def tiles(self):
        return self.hidden // self.block_hidden


def _exchanged(cfg, a, *shape):
    """A head sum's shares or total (Y forward, Ê backward): in the sources' dtype on the bf16 path
    (the dtype the sum takes as the products' operand; summed in float32), else float32 — half the
    bytes a head's tiles exchange through L2 every chunk (module docstring)."""
    return jax.ShapeDtypeStruct(shape, a.dtype if cfg.low else F32)


def _multiprocessors():
    device = jax.devices()[0]
    return getattr(device, "core_count", None) or 132   # an H100's / H200's count where not reported


def _dots(cfg):
    """(mm, mm_nt, mm_tn, operand) for this call's precision."""
    if cfg.low:
        low, exact = True, False
    elif cfg.dots == "tf32":
        low, exact = True, 1
    else:
        low, exact = False, False
    operand = (lambda x: x.astype(BF16)) if cfg.low else (lambda x: x)
    return (functools.partial(mm, low=low, exact=exact), functools.partial(mm_nt, low=low, exact=exact),
            functools.partial(mm_tn, low=low, exact=exact), operand)


def _scalar(ref, bh, i):
    """Element [bh, i] of a per-chunk [BH, N] ref as a [1, 1] value."""
    return load_f32(ref, (bh, pl.ds(i, 1)))[None, :]


def _cta_barrier(cfg):
    if not cfg.interpret:   # interpret mode runs a program's statements in order
        plgpu.debug_barrier()


def _grid_barrier(cfg, cnt, bh, target):
    """Wait until the head's counter reaches ``target`` after adding this program's arrival;
    returns whether the spin gave up (a deadlock). On a GPU the atomics are scalar ones (one per
    program, and every thread sees the value read); interpret mode's discharge rule takes only
    one-element slices."""
    _cta_barrier(cfg)   # every thread's writes of this program before its arrival
    if cfg.interpret:
        add = lambda v: jnp.max(plgpu.atomic_add(cnt, (pl.ds(bh, 1),), jnp.full((1,), v, jnp.int32)))
    else:
        add = lambda v: plgpu.atomic_add(cnt, (bh,), v)
    add(1)

    def cond(s):
        return jnp.logical_and(s[0] < target, s[1] < SPIN_CAP)

    def body(s):
        return add(0), s[1] + 1

    _, spins = lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0)))
    return spins >= SPIN_CAP


def _tile_sum(ref, bh, slot, tiles, shape, rows=slice(None)):
    """Σ over the head's tiles of their shares in ``slot``, of ``rows``, in float32 whatever the
    shares' dtype (volatile loads: other programs wrote them)."""
    share = lambda q: plgpu.load(ref.at[bh, slot, q, rows], volatile=True).astype(F32)
    return lax.fori_loop(0, tiles, lambda q, acc: acc + share(q), jnp.zeros(shape, F32))


def _when(owner, store):
    """``store()`` where ``owner``, a traced bool or True (Triton's lowering of a constant
    condition fails)."""
    if owner is True:
        store()
    else:
        pl.when(owner)(store)


def _head_sum(cfg, r, bh, j, step, stuck, finish):
    """Σ over the head's tiles of the shares they stored in r["share"] at ``step`` (the chunk's
    barrier included), then ``finish``; returns (the result [n, dv] float32, NaN where a spin gave
    up, and stuck). ``finish(rows, total, owner)`` takes the sum of those rows (NaN already where a
    spin gave up, so what it stores is poisoned too) and returns what every tile receives of them
    (the forward: E = Y − targets; the backward: Ê with Y's cotangent); it may store outputs of
    those rows where ``owner`` (`_when`; True: this program forms those rows alone). Where a
    head's tiles divide the rows, in two stages: tile j adds every tile's rows of block j and
    finishes them into r["total"], a second barrier, then every tile loads the total — an eighth
    of the loads of every tile adding every share (titans B4 T4096: eight tiles of [64, 128] each;
    the layer's fwd+bwd 22.52 -> 21.41 ms on an H200, one command), and the float32 [n, dv] tiles
    ``finish`` loads (targets, Y's cotangent) are loaded once a head, a block by each tile, rather
    than whole by every tile (18.15 -> 17.69 ms at B4, 18.50 -> 17.08 at B1 T16384, one command
    each). The shares and the total are stored in their refs' dtype (bf16 with
    bf16 sources) and summed in float32."""
    tiles, slot = cfg.tiles, lax.rem(step, 2)
    n, dv = r["share"].shape[-2:]
    if tiles == 1 or n % tiles:   # one barrier a step; tile 0 owns every row
        stuck = jnp.logical_or(stuck, _grid_barrier(cfg, r["count"], bh, tiles * (step + 1)))
        total = _tile_sum(r["share"], bh, slot, tiles, (n, dv))
        return finish(slice(None), jnp.where(stuck, jnp.nan, total), j == 0), stuck
    stuck = jnp.logical_or(stuck, _grid_barrier(cfg, r["count"], bh, tiles * (2 * step + 1)))
    block = n // tiles
    rows = pl.ds(pl.multiple_of(j * block, block), block)
    total = _tile_sum(r["share"], bh, slot, tiles, (block, dv), rows)
    finished = finish(rows, jnp.where(stuck, jnp.nan, total), True)
    r["total"][bh, slot, rows, :] = finished.astype(r["total"].dtype)
    stuck = jnp.logical_or(stuck, _grid_barrier(cfg, r["count"], bh, tiles * (2 * step + 2)))
    total = plgpu.load(r["total"].at[bh, slot], volatile=True).astype(F32)
    return jnp.where(stuck, jnp.nan, total), stuck


def _names(cfg):
    return ("w0", "w1", "m0", "m1") if cfg.momentum else ("w0", "w1")


def _tile_index(name, cols):
    """A tile of a state: columns of W0 / m0, rows of W1 / m1."""
    return (slice(None), cols) if name in ("w0", "m0") else (cols, slice(None))


def _program(cfg: _Cfg):
    """What a program of either kernel starts from: its tile j, its sequence·head bh, the tile's
    hidden units, the state names and the dots of this call's precision."""
    j, bh = pl.program_id(0), pl.program_id(1)
    bt = cfg.block_hidden
    return j, bh, pl.ds(pl.multiple_of(j * bt, bt), bt), _names(cfg), _dots(cfg)


# ---------------------------------------------------------------------------------------------
# Forward


def _fwd_kernel(r, cfg: _Cfg):
    j, bh, cols, names, (mm_, mm_nt_, mm_tn_, operand) = _program(cfg)
    N, tiles, all_ = cfg.n_chunks, cfg.tiles, slice(None)

    for name in names:   # slot 0 of the start states: the initial state
        initial = load_f32(r[name], (bh,) + _tile_index(name, cols))
        r["s_" + name][(bh, 0) + _tile_index(name, cols)] = initial.astype(r["s_" + name].dtype)
        if cfg.low_starts:
            r["run_" + name][(bh, 0) + _tile_index(name, cols)] = initial
    _cta_barrier(cfg)   # the initial tiles stored before chunk 0 loads them

    def chunk(i, stuck):
        # A state tile is loaded where it is used and loaded again later rather than kept: four
        # [d, 64] float32 tiles and their updates held through the chunk spilled (255 registers a
        # thread, GBs of local-memory traffic by ncu), and the reloads hit L2.
        if cfg.low_starts:   # the float32 state from the running buffer's slot i mod 2
            start = lambda name: load_f32(r["run_" + name], (bh, lax.rem(i, 2)) + _tile_index(name, cols))
        else:
            start = lambda name: load_f32(r["s_" + name], (bh, i) + _tile_index(name, cols))
        if cfg.num_warps_fwd >= 8:
            # where the programs fit one per multiprocessor (8 warps, few values a thread), the
            # chunk's start tiles are loaded once, at its start, rather than where each is used
            # (titans B1 T16384 H8: 0.982 on an H200, one command)
            start = {name: start(name) for name in names}.__getitem__
        if cfg.low_starts and cfg.num_warps_fwd < 8:
            # the products' operands from the bf16 start tiles, half the bytes of the float32
            # ones (titans B4 T4096 H8: 0.978 on an H200, one command); where the float32 tiles
            # are loaded once (8 warps) their casts cost nothing (B1 T16384: 0.999)
            operand_of = lambda name: r["s_" + name][(bh, i) + _tile_index(name, cols)]
        else:
            operand_of = lambda name: operand(start(name))
        a = r["a"][bh, i, :, :]
        a = a if cfg.low else a.astype(F32)
        z = mm_(a, operand_of("w0"))
        hidden, slope = act_and_grad(cfg.activation, z)
        if cfg.sources:
            r["o_hidden"][bh, i, :, cols] = hidden.astype(r["o_hidden"].dtype)
        slot = lax.rem(i, 2)
        w1_operand = operand_of("w1")   # for the share and for D
        r["share"][bh, slot, j, :, :] = mm_(operand(hidden), w1_operand).astype(r["share"].dtype)

        def finish(rows, y, owner):   # Y's rows stored, E's returned
            if cfg.residual:
                y = y + load_f32(r["a"], (bh, i, rows, all_))
            _when(owner, lambda: r["y"].__setitem__((bh, i, rows, all_), y))
            return y - load_f32(r["t"], (bh, i, rows, all_))

        e, stuck = _head_sum(cfg, r, bh, j, i, stuck, finish)
        rows = load_f32(r["rows"], (bh, i, all_))[:, None]
        decay = _scalar(r["decay"], bh, i)
        d0 = mm_nt_(e, w1_operand) * slope
        if cfg.sources:
            r["o_d0"][bh, i, :, cols] = d0.astype(r["o_d0"].dtype)

        def put(name, value):   # chunk i + 1's start, or the final state after the last chunk
            if cfg.low_starts:   # the other slot: chunk i + 1 reads it after the CTA barrier below
                r["run_" + name][(bh, 1 - lax.rem(i, 2)) + _tile_index(name, cols)] = value

            @pl.when(i + 1 < N)
            def _():
                r["s_" + name][(bh, i + 1) + _tile_index(name, cols)] = value.astype(r["s_" + name].dtype)

            @pl.when(i + 1 == N)
            def _():
                r["f_" + name][(bh,) + _tile_index(name, cols)] = value

        if cfg.momentum:
            mrows = load_f32(r["mrows"], (bh, i, all_))[:, None]
            carry, mcarry = _scalar(r["carry"], bh, i), _scalar(r["mcarry"], bh, i)
        # each state's update is stored before the next one is formed
        for layer, (left, right) in (("0", (a, d0)), ("1", (operand(hidden), e))):
            w, m = "w" + layer, "m" + layer
            update = decay * start(w) + mm_tn_(left, operand(rows * right))
            if cfg.momentum:
                # loaded once for both updates (where start tiles are not preloaded: titans'
                # layer 0.991 at B4 T4096 with W1's operand above, 1.002 at B1 T16384 H8, where
                # only that applies; H200, one command)
                m_start = start(m)
                update = update + carry * m_start
                put(m, mcarry * m_start + mm_tn_(left, operand(mrows * right)))
            put(w, update)

        _cta_barrier(cfg)   # this chunk's end state is stored before the next chunk loads it
        return stuck

    lax.fori_loop(0, N, chunk, jnp.bool_(False))


def _forward(cfg: _Cfg, state: MLPStates, a, t, rows, mrows, decay, carry, mcarry):
    """Kernel layout in ([BH, N, ...] operands, [BH, ...] states, padded); returns (starts, final, y)."""
    BH, N, n, d = a.shape
    h, dv = state.w0.shape[-1], state.w1.shape[-1]
    ins = {"a": a, "t": t, "rows": rows, "decay": decay, "w0": state.w0, "w1": state.w1}
    shapes = {"w0": (d, h), "w1": (h, dv)}
    if cfg.momentum:
        ins.update(mrows=mrows, carry=carry, mcarry=mcarry, m0=state.m0, m1=state.m1)
        shapes.update(m0=(d, h), m1=(h, dv))
    sds = lambda *s: jax.ShapeDtypeStruct(s, F32)
    kept = lambda *s: jax.ShapeDtypeStruct(s, BF16 if cfg.low_starts else F32)
    outs = {**{"s_" + k: kept(BH, N, *s) for k, s in shapes.items()},
            **{"f_" + k: sds(BH, *s) for k, s in shapes.items()},
            # Y stored in float32 from the float32 sum of the exchanged shares
            "y": sds(BH, N, n, dv), "share": _exchanged(cfg, a, BH, 2, cfg.tiles, n, dv),
            "total": _exchanged(cfg, a, BH, 2, n, dv),
            "count": jax.ShapeDtypeStruct((BH,), jnp.int32)}
    if cfg.low_starts:
        outs.update({"run_" + k: sds(BH, 2, *s) for k, s in shapes.items()})
    if cfg.sources:
        # H and D in the sources' dtype: halves their stores and the backward's cotangent loads
        # (titans' layer, B4 T4096 bf16, H200: 22.58 against 23.28 ms, one process)
        per_source = jax.ShapeDtypeStruct((BH, N, n, h), a.dtype)
        outs.update(o_hidden=per_source, o_d0=per_source)
    in_names, out_names = list(ins) + ["count_in"], list(outs)

    def kernel(*refs):
        named = dict(zip(in_names + out_names, refs))
        _fwd_kernel(named, cfg)

    res = pl.pallas_call(
        kernel, grid=(cfg.tiles, BH), out_shape=list(outs.values()),
        input_output_aliases={len(ins): out_names.index("count")},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps_fwd, num_stages=1),
        interpret=cfg.interpret, name="mlp_state_pass_gpu_fwd",
    )(*ins.values(), jnp.zeros((BH,), jnp.int32))
    res = dict(zip(out_names, res))
    pick = lambda prefix: MLPStates(*(res.get(prefix + k) for k in ("w0", "w1", "m0", "m1")))
    sources = MLPSources(res["o_hidden"], res["o_d0"], res["y"]) if cfg.sources else None
    return pick("s_"), pick("f_"), res["y"], sources


# ---------------------------------------------------------------------------------------------
# Backward


def _bwd_kernel(r, cfg: _Cfg):
    j, bh, cols, names, (mm_, mm_nt_, mm_tn_, operand) = _program(cfg)
    N, tiles, all_ = cfg.n_chunks, cfg.tiles, slice(None)

    # Every chunk's start-state cotangent is kept, g_[i] for chunk i, written over the cotangent
    # the start state received directly (ds_[i], the same buffer: read just before; or, with
    # cfg.factors, formed here from the reads' `StartFactors` in a buffer of its own), so that the
    # decay's and momentum coefficients' cotangents <X, θ>, <X, m>, <M, m> are one XLA pass over
    # them and the kept start states, not six tile products and reductions per chunk here.

    pairs, bt = cfg.pairs, cfg.block_hidden

    def halves(v):   # a product's [n, 2·bt] result over a pair -> its X and M halves
        return jnp.unstack(jnp.transpose(v.reshape(v.shape[0], 2, bt), (0, 2, 1)), axis=-1)

    def side_by_side(u, w):   # [n, bt], [n, bt] -> [n, 2·bt]
        return jnp.transpose(jnp.stack([u, w], axis=-1), (0, 2, 1)).reshape(u.shape[0], 2 * bt)

    def chunk(k, stuck, last):
        i = N - 1 - k
        # Tiles are loaded where they are used, again where used again (the forward kernel's note;
        # the paired path loads its products' tiles once, below): the start state's from s_, the
        # carried cotangent X / M (chunk i's end state's) from df_ for the last chunk, else from
        # g_[i + 1] (this program's own writes of the chunk before, behind the CTA barrier).
        # in the dtype kept: float32, or bf16 on the joint route (the products' operand dtype)
        st = lambda name: r["s_" + name][(bh, i) + _tile_index(name, cols)]
        if pairs:
            # tile j's X0 and M0 columns side by side in one buffer (X1 and M1 rows), so that the
            # products that take both (a X0 and a M0, ...) are one product over the pair
            at = (bh,) if last else (bh, i + 1)
            src = {"0": r["df_x0" if last else "g_x0"], "1": r["df_x1" if last else "g_x1"]}
            pair = pl.ds(pl.multiple_of(2 * j * bt, 2 * bt), 2 * bt)
            load_pair = {"0": lambda: load_f32(src["0"], at + (all_, pair)),
                         "1": lambda: load_f32(src["1"], at + (pair, all_))}
            x = lambda name: load_f32(src[name[1]], at + _tile_index(name, _half(j, bt, name)))
        elif last:
            x = lambda name: load_f32(r["df_" + name], (bh,) + _tile_index(name, cols))
        else:
            x = lambda name: load_f32(r["g_" + name], (bh, i + 1) + _tile_index(name, cols))
        def operands_of_rows():   # the chunk's a and E, as stored (E in the products' dtype)
            a_ = r["a"][bh, i, :, :]
            return (a_ if cfg.low else a_.astype(F32)), r["e"][bh, i, :, :]

        a, e = operands_of_rows()
        rows = load_f32(r["rows"], (bh, i, all_))[:, None]
        if pairs:
            mrows = load_f32(r["mrows"], (bh, i, all_))[:, None]
            # the start tiles and the carried pairs the chunk's products take, loaded (and cast to
            # the products' dtype) once, at the chunk's start, rather than where each product is:
            # 16-wide tiles are few values a thread, and the chain waits on each load (titans B1
            # T16384 H8 0.983 on an H200, one command; the start tiles alone 0.991)
            st = {name: operand(st(name)) for name in ("w0", "w1")}.__getitem__
            block = {k: operand(load()) for k, load in load_pair.items()}   # [X0 | M0], [X1; M1]
        hidden, slope, curve = act_grad2(cfg.activation, mm_(a, st("w0")))
        g = mm_nt_(e, st("w1"))                                # E W1ᵀ [n, bt]
        d0, g_curve = g * slope, g * curve
        if pairs:
            # Ẑ's terms but its Ê one (Ĥ ⊙ σ' + A ⊙ G ⊙ σ''), Q and r̂'s first terms are formed
            # before the head sum and a and E loaded again after it, so that A, σ'', a and E do
            # not stay live through it: titans' layer at B1 T16384 H8 (16-wide tiles)
            # 0.967-0.970 of the order below on an H200, two commands. Not the unpaired path: at B4
            # (64-wide tiles) this order took 1.006 and with the loads 1.030
            # (benchmarks/results/titans_backward_order_h200_2026-11-29.md).
            ax0, axm = halves(mm_(a, block["0"]))     # a X0, a M0 [n, bt]
            big_a, drows = rows * ax0, jnp.sum(d0 * ax0, axis=1)
            big_a, dmrows = big_a + mrows * axm, jnp.sum(d0 * axm, axis=1)
            if cfg.sources:   # what the returned D of this chunk receives
                big_a = big_a + load_f32(r["c_d0"], (bh, i, all_, cols))
            curvature, q = big_a * g_curve, operand(big_a * slope)
            ex1, em1 = halves(mm_nt_(e, block["1"]))  # E X1ᵀ, E M1ᵀ [n, bt]
            h_hat = rows * ex1
            r["drows"][bh, i, j, :] = drows + jnp.sum(hidden * ex1, axis=1)
            h_hat = h_hat + mrows * em1
            r["dmrows"][bh, i, j, :] = dmrows + jnp.sum(hidden * em1, axis=1)
            if cfg.sources:   # what the returned H of this chunk receives
                h_hat = h_hat + load_f32(r["c_hidden"], (bh, i, all_, cols))
            z_base = h_hat * slope + curvature
            z_hat_of = lambda e_w1: z_base + e_w1 * slope      # Ẑ from its Ê term, Ê W1ᵀ
            # (r ⊙ H) X1 + (ρ ⊙ H) M1 as one product
            e_share = mm_(operand(side_by_side(rows * hidden, mrows * hidden)), block["1"])
            hidden = operand(hidden)   # from here only a product's operand
        else:
            ax0 = mm_(a, operand(x("w0")))
            # rowsum(E ⊙ H X1) = rowsum(H ⊙ E X1ᵀ): r̂'s two terms in one [n, bt] reduction, and
            # E X1ᵀ is Ĥ's term anyway
            ex1 = mm_nt_(e, operand(x("w1")))                      # E X1ᵀ [n, bt]
            big_a, h_hat = rows * ax0, rows * ex1
            r["drows"][bh, i, j, :] = jnp.sum(d0 * ax0 + hidden * ex1, axis=1)
            e_share = rows * mm_(operand(hidden), operand(x("w1")))   # [n, dv]
            if cfg.momentum:
                mrows = load_f32(r["mrows"], (bh, i, all_))[:, None]
                axm = mm_(a, operand(x("m0")))
                em1 = mm_nt_(e, operand(x("m1")))
                big_a, h_hat = big_a + mrows * axm, h_hat + mrows * em1
                r["dmrows"][bh, i, j, :] = jnp.sum(d0 * axm + hidden * em1, axis=1)
                e_share = e_share + mrows * mm_(operand(hidden), operand(x("m1")))
            if cfg.sources:   # what the returned H and D of this chunk receive
                big_a = big_a + load_f32(r["c_d0"], (bh, i, all_, cols))
                h_hat = h_hat + load_f32(r["c_hidden"], (bh, i, all_, cols))
            q = big_a * slope
            z_hat_of = lambda e_w1: (h_hat + e_w1) * slope + big_a * g_curve
        slot = lax.rem(k, 2)
        r["share"][bh, slot, j, :, :] = (e_share + mm_(operand(q), st("w1"))).astype(r["share"].dtype)

        def finish(rows, e_hat, owner):   # the targets' rows stored, Ê's returned
            _when(owner, lambda: r["dt"].__setitem__((bh, i, rows, all_), -e_hat))
            if cfg.sources:   # the returned Y's cotangent joins E's after the targets took theirs
                e_hat = e_hat + load_f32(r["c_y"], (bh, i, rows, all_))
            return e_hat

        e_hat, stuck = _head_sum(cfg, r, bh, j, k, stuck, finish)
        e_res = e_hat if cfg.residual else None
        e_hat = operand(e_hat)
        z_hat = z_hat_of(mm_nt_(e_hat, st("w1")))

        if pairs:   # (r ⊙ D) X0ᵀ + (ρ ⊙ D) M0ᵀ as one product
            a, e = operands_of_rows()
            da = mm_nt_(operand(z_hat), st("w0"))
            da = da + mm_nt_(operand(side_by_side(rows * d0, mrows * d0)), block["0"])
        else:
            da = mm_nt_(operand(rows * d0), operand(x("w0"))) + mm_nt_(operand(z_hat), st("w0"))
            if cfg.momentum:
                da = da + mm_nt_(operand(mrows * d0), operand(x("m0")))
        if cfg.residual:
            da = da + (1 - jnp.minimum(j, 1)).astype(F32) * e_res   # tile 0 adds it
        r["da"][bh, i, j, :, :] = da.astype(r["da"].dtype)

        decay = _scalar(r["decay"], bh, i)
        if cfg.momentum:
            carry, mcarry = _scalar(r["carry"], bh, i), _scalar(r["mcarry"], bh, i)
        # + the cotangent chunk i's start state receives directly
        owns = {"0": lambda: mm_tn_(a, operand(z_hat)),
                "1": lambda: mm_tn_(operand(q), e) + mm_tn_(operand(hidden), operand(e_hat))}
        for layer, own in owns.items():
            w, m = "w" + layer, "m" + layer
            x_w = x(w)
            new = {w: decay * x_w + own()}
            if cfg.momentum:
                new[m] = carry * x_w + mcarry * x(m)
            # the factors' left operand (q_w, h_w's tile) loaded once for θ's and m's products:
            # titans' layer 0.991 at B4 T4096 and B1 T16384 H8 of a load for each (H200, one command)
            left = None
            if cfg.factors:
                left = r["f_q_w"][bh, i, :, :] if layer == "0" else r["f_h_w"][bh, i, :, cols]
            for name, value in new.items():
                idx = (bh, i) + _tile_index(name, cols)
                value = value + _start_cotangent(r, cfg, name, bh, i, cols, idx, mm_tn_, left)
                if pairs:
                    r["g_x" + layer][(bh, i) + _tile_index(name, _half(j, bt, name))] = value
                else:
                    r["g_" + name][idx] = value
        _cta_barrier(cfg)
        return stuck

    # the last chunk peeled (its X is d_final's), the others in the loop
    stuck = chunk(0, jnp.bool_(False), last=True)
    lax.fori_loop(1, N, functools.partial(chunk, last=False), stuck)


class StartFactors(NamedTuple):
    """Every chunk's start-state cotangents as the reads form them, rank-b products [B·H, N, ...]
    the backward kernel forms itself instead of loading them θ-sized: W0's q_wᵀ u0 and m0's
    q_wᵀ v0 (q_w [b, d], u0 and v0 [b, h]), W1's h_wᵀ u1 and m1's h_wᵀ v1 (h_w [b, h], u1 and v1
    [b, dv]); v0, v1 None without momentum."""
    q_w: jax.Array
    u0: jax.Array
    v0: Any
    h_w: jax.Array
    u1: jax.Array
    v1: Any


def _half(j, bt, name):
    """Where tile j of X (name "w0" / "w1") or of M ("m0" / "m1") lies in the backward's buffers
    that keep the two side by side: columns of W0's, rows of W1's [.., tiles · 2 · bt]."""
    return pl.ds(pl.multiple_of(2 * j * bt, 2 * bt) + (bt if name[0] == "m" else 0), bt)


def _pairs(x, m, tiles, axis):
    """X and M [BH, ..., h, ...] -> [BH, ..., 2h, ...] with tile j's X then M along ``axis`` (W0's
    columns: -1, W1's rows: -2), the layout of `_half`."""
    ax, shape = axis % x.ndim, x.shape
    tiled = lambda v: v.reshape(shape[:ax] + (tiles, shape[ax] // tiles) + shape[ax + 1:])
    both = jnp.stack([tiled(x), tiled(m)], axis=ax + 1)
    return both.reshape(shape[:ax] + (2 * shape[ax],) + shape[ax + 1:])


def _unpairs(v, tiles, axis):
    """`_pairs`' inverse: (X, M)."""
    ax, shape = axis % v.ndim, v.shape
    both = v.reshape(shape[:ax] + (tiles, 2, shape[ax] // (2 * tiles)) + shape[ax + 1:])
    half = shape[:ax] + (shape[ax] // 2,) + shape[ax + 1:]
    return tuple(jnp.take(both, k, axis=ax + 1).reshape(half) for k in (0, 1))


def _start_cotangent(r, cfg, name, bh, i, cols, idx, mm_tn_, left):
    """What chunk i's start state `name` receives directly (its tile): loaded, or formed from the
    reads' `StartFactors` with ``left``, their left operand for this layer (q_w, or h_w's tile)."""
    if not cfg.factors:
        return load_f32(r["ds_" + name], idx)
    if name in ("w0", "m0"):
        return mm_tn_(left, r["f_u0" if name == "w0" else "f_v0"][bh, i, :, cols])
    return mm_tn_(left, r["f_u1" if name == "w1" else "f_v1"][bh, i, :, :])


def _backward(cfg: _Cfg, starts: MLPStates, y, a, t, rows, mrows, decay, carry, mcarry, d_starts, d_final,
              d_sources=None):
    cfg = dataclasses.replace(cfg, block_hidden=cfg.block_hidden_bwd)
    BH, N, n, d = a.shape
    h, dv = starts.w0.shape[-1], starts.w1.shape[-1]
    tiles = cfg.tiles
    keys = ("w0", "w1", "m0", "m1") if cfg.momentum else ("w0", "w1")
    # E = Y − targets once in XLA, in the products' dtype, rather than every program loading both
    # float32 [n, dv] tiles and subtracting them at each use (titans' layer on an H200, one
    # command: B4 T4096 18.88 -> 18.16 ms, B1 T16384 20.40 -> 18.50)
    ins = {"a": a, "e": (y - t).astype(a.dtype if cfg.low else F32), "rows": rows, "decay": decay}
    if cfg.momentum:
        ins.update(mrows=mrows, carry=carry, mcarry=mcarry)
    if cfg.sources:
        ins.update(c_hidden=d_sources.hidden, c_d0=d_sources.d0, c_y=d_sources.y)
    pairs = cfg.pairs
    for i, key in enumerate(keys):
        ins["s_" + key] = starts[i]
        if not pairs:
            ins["df_" + key] = d_final[i]
        if not cfg.factors:
            ins["ds_" + key] = d_starts[i]
    if pairs:   # tile j's X and M side by side: columns of W0's, rows of W1's (`_half`)
        ins["df_x0"] = _pairs(d_final.w0, d_final.m0, tiles, -1)
        ins["df_x1"] = _pairs(d_final.w1, d_final.m1, tiles, -2)
    if cfg.factors:   # d_starts is a StartFactors
        ins.update({"f_" + k: v for k, v in d_starts._asdict().items() if v is not None})
    sds = lambda *s: jax.ShapeDtypeStruct(s, F32)
    shapes = {"w0": (d, h), "w1": (h, dv), "m0": (d, h), "m1": (h, dv)}
    kept_shapes = ({"g_x0": (d, 2 * h), "g_x1": (2 * h, dv)} if pairs
                   else {"g_" + k: shapes[k] for k in keys})
    outs = {**{k: sds(BH, N, *s) for k, s in kept_shapes.items()},
            # â per tile in the sources' dtype: its sum is returned in that dtype anyway
            "da": jax.ShapeDtypeStruct((BH, N, tiles, n, d), a.dtype), "dt": sds(BH, N, n, dv),
            "drows": sds(BH, N, tiles, n)}
    if cfg.momentum:
        outs.update(dmrows=sds(BH, N, tiles, n))
    outs.update(share=_exchanged(cfg, a, BH, 2, tiles, n, dv), total=_exchanged(cfg, a, BH, 2, n, dv),
                count=jax.ShapeDtypeStruct((BH,), jnp.int32))
    in_names, out_names = list(ins) + ["count_in"], list(outs)

    def kernel(*refs):
        _bwd_kernel(dict(zip(in_names + out_names, refs)), cfg)

    # g_ is written over ds_ (no second [B·H, N, ...] buffer per state), unless paired
    aliases = ({} if cfg.factors or pairs else
               {list(ins).index("ds_" + k): out_names.index("g_" + k) for k in keys})
    res = pl.pallas_call(
        kernel, grid=(tiles, BH), out_shape=list(outs.values()),
        input_output_aliases={**aliases, len(ins): out_names.index("count")},
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps_bwd, num_stages=1),
        interpret=cfg.interpret, name="mlp_state_pass_gpu_bwd",
    )(*ins.values(), jnp.zeros((BH,), jnp.int32))
    res = dict(zip(out_names, res))
    if pairs:
        (x0, m0), (x1, m1) = _unpairs(res["g_x0"], tiles, -1), _unpairs(res["g_x1"], tiles, -2)
        kept = MLPStates(x0, x1, m0, m1)
    else:
        kept = MLPStates(*(res.get("g_" + k) for k in ("w0", "w1", "m0", "m1")))    # [BH, N, ...]
    d_first = MLPStates(*(None if g is None else g[:, 0] for g in kept))

    def dot(name, state):
        """<chunk i's end-state cotangent of `name`, chunk i's start `state`> for every i [BH, N]."""
        g, end, v = getattr(kept, name), getattr(d_final, name), getattr(starts, state).astype(F32)
        inner = jnp.sum(g[:, 1:] * v[:, :-1], axis=(2, 3))
        return jnp.concatenate([inner, jnp.sum(end * v[:, -1], axis=(1, 2))[:, None]], axis=1)

    d_decay = dot("w0", "w0") + dot("w1", "w1")
    d_carry = d_mcarry = None
    if cfg.momentum:
        d_carry = dot("w0", "m0") + dot("w1", "m1")
        d_mcarry = dot("m0", "m0") + dot("m1", "m1")
    over_tiles = lambda key: None if key not in res else jnp.sum(res[key].astype(F32), axis=2)
    return (d_first, over_tiles("da").astype(a.dtype), res["dt"], over_tiles("drows"), over_tiles("dmrows"),
            d_decay, d_carry, d_mcarry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, state, a, t, rows, mrows, decay, carry, mcarry):
    starts, final, _, sources = _forward(cfg, state, a, t, rows, mrows, decay, carry, mcarry)
    return (starts, final, sources) if cfg.sources else (starts, final)


def _core_fwd(cfg, state, a, t, rows, mrows, decay, carry, mcarry):
    starts, final, y, sources = _forward(cfg, state, a, t, rows, mrows, decay, carry, mcarry)
    out = (starts, final, sources) if cfg.sources else (starts, final)
    return out, (starts, y, a, t, rows, mrows, decay, carry, mcarry)


def _core_bwd(cfg, res, cts):
    starts, y, a, t, rows, mrows, decay, carry, mcarry = res
    return _backward(cfg, starts, y, a, t, rows, mrows, decay, carry, mcarry, *cts)


_core.defvjp(_core_fwd, _core_bwd)


@functools.partial(jax.jit, static_argnames=("cfg", "padded"))
def _run(*args, cfg, padded):
    return support.run_padded(_core, cfg, padded, *args)


# The persistent forward with the XLA reverse pass (`support.state_pass_vjp`) as its backward (the
# op forms the sources from the start states on this route).
_run_xla_backward = support.jitted_pass(lambda cfg, *xs: _forward(cfg, *xs)[:2])


def mlp_state_pass_gpu(state: MLPStates, a, targets, rows, momentum_rows, decay_end, carry_end,
                              momentum_carry, *, activation: str, residual: bool, interpret=None,
                              block_sizes=None, sources: bool = False):
    """`atlas_jax.ops.deep_memory.mlp_state_pass` on the persistent kernels (arguments checked
    there). Returns (starts [B, H, N, ...], final [B, H, ...]) as MLPStates, float32, and with
    ``sources`` every chunk's MLPSources [B, H, N, ...] as the forward kernel formed them (the
    backward kernel takes their cotangents; with ``block_sizes.backward="xla"`` the pair only:
    the op forms them from the start states)."""
    cfg, padded, backward = pass_config(state, a, targets, activation=activation, residual=residual,
                                        interpret=interpret, block_sizes=block_sizes, sources=sources)
    run = _run if backward == "kernel" else _run_xla_backward
    return run(state, a, targets, rows, momentum_rows, decay_end, carry_end, momentum_carry,
               cfg=cfg, padded=padded)


def pass_config(state: MLPStates, a, targets, *, activation, residual, interpret, block_sizes, sources, factors=False):
    """(the kernels' static config, the padded (n, d, h, dv), block_sizes.backward) for a call of
    `mlp_state_pass_gpu`'s arguments."""
    bs = MLPGpuBlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, MLPGpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be an MLPGpuBlockSizes; got "
                        f"{type(bs).__name__}.")
    interpret = bool(default_interpret() if interpret is None else interpret)
    hp = next_pow2(state.w0.shape[-1], least=16)
    bs = bs.resolve(hp, interpret, a.shape[0] * a.shape[1], momentum=state.m0 is not None)
    bs.check(hp, interpret)
    fields = support.pass_fields(_FN, state, a, activation, residual)
    cfg = _Cfg(**fields, hidden=hp,
               block_hidden=bs.block_hidden, num_warps_fwd=bs.num_warps_fwd, num_warps_bwd=bs.num_warps_bwd,
               dots=bs.dots, interpret=interpret, block_hidden_bwd=bs.block_hidden_bwd,
               sources=bool(sources) and bs.backward == "kernel", factors=factors,
               pairs=bs.pair_products and fields["momentum"], low_starts=factors and fields["low"])
    padded = tuple(next_pow2(x, least=16) for x in (a.shape[3], a.shape[4], hp, targets.shape[-1]))
    return cfg, padded, bs.backward
