"""Exact chunked delta family (DeltaNet, Gated DeltaNet, KDA) as Pallas kernels for GPU (Hopper).

Why the Pallas *Triton* lowering (`jax.experimental.pallas.triton`) and not Mosaic GPU: it runs
unchanged in Pallas interpret mode on CPU (how CI tests these kernels), its small API
(`pallas_call`, `BlockSpec`, `pl.ds`, `CompilerParams(num_warps, num_stages)`) is the same in
jax 0.10.2 and 0.11.2, and Triton is what flash-linear-attention uses, so benchmarks compare like
with like. Mosaic GPU (wgmma, barriers, TMA) cannot run in interpret mode and its API moved a lot
between those versions; it is deprecated-free but would be a separate, GPU-only code path.

Semantics (per token t, state S in R^{K x V}, float32), as `atlas_jax.ops.chunk_delta_family`:
    S <- exp(g_t) * S          (g None: no decay; [B,T,H]: scalar; [B,T,H,K]: per key row of S)
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

Kernels (see gpu_kernels.py for the math); C = chunk size, NT = number of chunks:
  forward   K1 intra  grid (NT, B, H): blocked (I + diag(beta) A)^-1 (16x16 diagonal blocks
                      as Neumann products for bf16, by substitution for float32), W, U0
                      (+ P for KDA); by default split (split_intra): K1a the inverse T on
                      few warps (bf16 GDN / DeltaNet: A's 16x16 blocks accumulated in
                      registers over pieces of K, block_k_kkt), K1b W, U0 = T X, T Y; for KDA
                      A and P come first from K1d
                      (diagonal 16x16 blocks, one token and a few heads per program, grid
                      (Tp, H/bh, B)) and K1p (the others, in pieces of K columns), and K1b
                      also stores the state passes' gated operands Gam q, exp(G_C - G) k and
                      exp(G_C) (for GDN: the chunk-local cumulative gate)
            K2 state  grid (NS, H, V/BV): sequential over chunks; lean (default): only
                      U = U0 - W S (stored, "v_new"), the state update and h per chunk, two
                      dots per chunk on the sequential path; fused (fuse_output=True): also
                      the output O, five dots per chunk
            K2o out   grid (V/BVo, NT, B, H), lean only: O = (Gam q) h + P U, all in parallel
  backward  K3 state  grid (NS, H, V/BV): reverse pass for dS per chunk and dU; with
                      split_state_bwd=True, K3a grid (V/BVo, NT, B, H) first computes
                      dU_local = P^T dO in parallel and K3 adds the state's part in place
            K4 intra  grid (NT, B, H): dq, dk, dv, dbeta, dg (KDA: the dense part, then
                      K4d for the diagonal blocks, one token per program, and K4b for the
                      off-diagonal ones)
Plain XLA glue: padding T to a multiple of C and the packed-varlen layout (each sequence starts
on a chunk boundary, so no state crosses a boundary; sequences are chunk ranges of the state
passes). On CPU the same kernels run with `interpret=True`.

Supported: forward and backward (`jax.custom_vjp`; gradients for q, k, v, beta, g and the
initial state; final-state cotangent), bf16 or float32 inputs (float32 accumulation, float32
solves/states), head dims K, V in {64, 128, 256} on GPU (powers of two from 16 in interpret
mode), any T, chunk 16/32/64, `cu_seqlens` (B = 1 packed), in-kernel L2 normalisation of q, k.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.delta_family import gpu_kernels as gk

F32 = jnp.float32
_FN = "chunk_delta_family_gpu"
GPU_HEAD_DIMS = (64, 128, 256)
INTERPRET_HEAD_DIMS = (16, 32, 64, 128, 256)
CHUNK_SIZES = (16, 32, 64)
_HAS_BARRIER = hasattr(plgpu, "debug_barrier")


def _given(value, default):
    """The field if set (0 included, so that validation sees it), else the heuristic's value."""
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tiling and launch parameters of the GPU kernels (None: a heuristic from the shapes).

    block_v:       V block of the sequential state passes; V / block_v programs per (seq, head)
                   run in parallel (64 for V = 128 gives B*H*2 programs).
    block_v_bwd:   V block of the loop inside the intra-chunk backward kernel (register use).
    inter_dtype:   storage of W and U0 between the kernels: "float32" or "input" (bf16 for bf16
                   inputs: half the traffic, slightly less accurate).
    state_dtype:   storage of the per-chunk states h and dh kept for the backward: "input"
                   (bf16 for bf16 inputs, as fla stores h; float32 inputs stay exact) or
                   "float32" (twice the traffic; measured 10% slower GDN fwd+bwd on an H200).
    fuse_output:   True: the sequential state pass also computes the output (five dots per
                   chunk on the sequential path, B*H*V/block_v programs). False (default, as
                   fla splits it): the state pass only stores h and U = v_new and updates the
                   state (two dots per chunk), and a parallel kernel over chunks computes O.
                   The lean pass writes h in every forward (also without gradients); the
                   backward reads v_new instead of recomputing U0 - W h.
    block_v_out:   V block of that output kernel (None: min(V, 128)).
    num_warps_out: warps of the output kernel (None: 4, 8 for head dims of 256).
    wide_intra:    K1 forms A = K K^T (no gate, scalar gate) and W = T X, U0 = T Y as
                   whole-chunk [C, C] dots, round-tripping 16x16 blocks of A and T through the
                   T output buffer with barriers (default for float32 inputs, no gate or the
                   scalar gate, K <= 128: more accurate there; with the split K1 it shapes
                   only the solve, and for bf16 inputs block_k_kkt takes precedence there);
                   False (the other defaults): 16-row sub-block dots.
    block_k_kkt:   no gate / scalar gate, split K1: K columns per piece of the solve kernel's
                   A = K K^T, formed as 16x16 blocks in registers over a loop of pieces (as
                   fla's fused kkt + solve kernel; a power of two >= 16, capped at K; the whole
                   row with in-kernel q/k normalisation); 0: the wide / 16-row layout. None:
                   64 for bf16 inputs, 0 for float32 (wide: the layout the float32 GPU checks
                   measured at 8e-7).
    num_stages_solve: pipeline stages of that loop (None: 2 with pieces, else 1).
    merge_dots:    bf16 dots per 16x16 product in the merges of K1's blocked inverse for bf16
                   inputs: 3 (default; hi/lo split, ~2^-16 relative) or 6 (float32-exact); or
                   1: one tf32 dot (fla's solve precision, ~2^-11). float32 inputs always use
                   6. H100, B4 T4096 H16 D128, GDN's solve alone with A in register blocks:
                   0.080 ms at 3, 0.082 at 1 (KDA's solve 0.082 / 0.084), so 3 stays.
    split_state_bwd: True: the backward splits like fla's dv_local + dhu: a parallel kernel
                   over chunks (K3a, V blocks of block_v_out, num_warps_out warps) computes the
                   state-free dU_local = P^T dO, and the reverse state pass keeps three dots
                   per chunk ((exp(G_C - G) k) dS, (Gam q)^T dO, W^T dU) with no P on its
                   sequential path; False: one reverse pass that also recomputes P and P^T dO
                   per chunk. Default: split for the scalar gate (faster on an H100), one pass
                   for no gate (equal or faster) and the channel gate (H100, B4 T4096 H16
                   D128: one pass 0.46 ms against 0.13 + 0.52 split).
    split_intra:   True (default): K1 as two kernels, as fla splits it: K1a (num_warps_solve
                   warps) forms A and its blocked inverse T (stored in the input dtype for
                   bf16 inputs, whose readers round it to bf16 anyway, else float32); K1b
                   (num_warps_intra warps) reads T back and forms W, U0 as whole-chunk dots.
                   The 16x16 steps of the inverse then run on fewer warps than the [C, K] dots
                   want. For the channel gate A (and P) come first from K1d (diagonal blocks,
                   one program per token) and K1p (the other blocks). False: one kernel.
    num_warps_solve: warps of K1a (None: 1). Its 16x16 steps are a serial chain of small dots,
                   each a layout round trip, so more programs per SM beat more warps per
                   program: H100, B1 T16384 H16 D128 bf16, GDN's K1a 0.155 ms on 2 warps,
                   0.119 on 1, 0.207 on 4; KDA's solve 0.118 -> 0.078 (H200) on 1.
    num_warps_diag: warps of the channel gate's diagonal-block kernels K1d and K4d, one
                   program per token and diag_heads heads (None: 1).
    diag_heads:    heads per K1d / K4d program (None: 256 // K, between 1 and 4: 256 values
                   of a row per one-warp program), a power of two; programs take the largest
                   power of two dividing H up to it. H100, B4 T4096 H16 D128 bf16: K1d 0.33
                   ms and K4d 0.87 at 4 heads on 1 warp; 1 to 16 heads on 1 to 4 warps all
                   within 15% (one program per 16-row block before: 1.21 and 2.86). Whole
                   forward with K1p on one warp, best of 4-5 interleaved rounds (H100, bf16):
                   2 heads against 4 at D128 B4 T4096 1.085 -> 1.069 ms, B1 T16384 1.265 ->
                   1.237; at D64 (B8 T2048 H32) 4 heads stay (1.153 ms against 1.172 at 2).
    block_k_pairs: K columns per piece of the channel gate's off-diagonal pair kernel K1p
                   (None: 64; a power of two >= 16, capped at K; the whole row with in-kernel
                   q/k normalisation), its loop pipelined over num_stages_pairs stages (None:
                   2), as fla's inter kernel takes 32 or 64. H100, B4 T4096 H16 D128 bf16: K1p
                   alone 0.303 ms at 128 columns on one stage, 0.282 at 64 on two; the whole
                   forward 1.153 -> 1.136 ms, best of 5 interleaved rounds (B8 T2048 H32 D64:
                   1.223 -> 1.217).
    block_k_pairs_bwd: the same for its backward K4b (None: 64).
    fuse_pairs_solve: KDA: K1p also forms the blocked inverse T from its blocks in registers and
                   K1d's diagonal blocks, as fla's inter + solve kernel, so that M makes no
                   round trip through memory and the solve kernel is skipped (None: False).
                   H100, B1 T16384 H16 D128 bf16, each kernel alone: 0.381 ms fused against
                   0.322 + 0.116 split, but the whole forward at B4 T4096 took the same time
                   (1.204 vs 1.202 ms), so it stays off.
    block_k_out:   KDA: K columns per piece of the output kernel's loop over K, as fla's
                   output kernel (None: 64; the whole row with in-kernel q/k normalisation).
                   H200, B1 T16384 H16 D128 bf16, each kernel alone: 0.140 ms unlooped, 0.120
                   at 64 columns and two stages. The other gates take the whole row: GDN's
                   looped form (q h and q k^T in pieces) measured 0.141 -> 0.130 alone but no
                   faster in the whole forward (0.571 vs 0.572 ms, H100).
    num_stages_out: pipeline stages of that loop (None: 2 for the channel gate, else 1).
    block_wu:      columns per piece of K1b's W = T X and U0 = T Y for the scalar or no gate
                   (None: 64), pipelined over num_stages_intra stages (None: 2; 3 for the
                   channel gate's K1b). H100, B1 T16384 H16 D128 bf16, GDN's K1b alone:
                   0.167 ms unlooped, 0.153 at 64 columns and two stages (0.151 with the gates
                   on k rather than T's columns); GDN fwd at B4 T4096: 0.574 -> 0.565 ms,
                   DeltaNet unchanged (0.549 / 0.552).
    block_wu_channel: KDA: columns per piece of K1b (its gate operands, W = T X over K and
                   U0 = T Y over V), pipelined over num_stages_intra stages (None: 64, over
                   three stages for the channel gate; whole [C, K] tiles with in-kernel q/k
                   normalisation). H100, B4 T4096 H16 D128 bf16, best of 4 interleaved rounds:
                   the whole forward 1.112 ms with whole tiles, 1.106 at 64 columns on two
                   stages, 1.092 on three (K1b alone 0.307 -> 0.295), 1.122 at 32 columns on
                   three, 1.147 at 64 on 8 warps.
    num_warps_pairs: warps of K1p (None: 1, as fla's inter kernel may pick). H100 bf16, the
                   whole KDA forward, best of 4-5 interleaved rounds, 2 warps -> 1: B4 T4096
                   H16 D128 1.109 -> 1.085 ms (K1p alone 0.290 -> 0.279), B8 T2048 H32 D64
                   1.202 -> 1.153, B1 T16384 1.260 -> 1.265 (1.237 with 2 diag_heads);
                   fwd+bwd unchanged (5.380 -> 5.369). H200, B1 T16384 H16 D128, blocks in
                   order (each pairing with the earlier ones): 0.233 ms on 2 warps, 0.29 on 4.
    num_warps_pairs_bwd: warps of K4b (None: 4). H100, B4 T4096 H16 D128 bf16: 1.61 ms at 64
                   columns and 4 warps, 1.65 at 128 on 8, 1.99 at 128 on 4.
    diag_inverse:  K1's 16x16 diagonal inverses for bf16 inputs: "products" (default; the
                   Neumann series as three squarings and three products on tensor cores) or
                   "substitution" (forward substitution, a serial chain of 15 row steps, which
                   measured half of K1's time for GDN on an H200). float32 inputs always use
                   the substitution.
    """
    block_v: int | None = None
    block_v_bwd: int | None = None
    num_warps_intra: int | None = None
    num_warps_state: int | None = None
    num_warps_bwd: int | None = None
    num_stages_intra: int | None = None
    num_stages_state: int | None = None
    num_stages_bwd: int = 1
    inter_dtype: str = "input"
    state_dtype: str = "input"
    fuse_output: bool | None = None
    block_v_out: int | None = None
    num_warps_out: int | None = None
    wide_intra: bool | None = None
    merge_dots: int | None = None
    block_k_kkt: int | None = None
    num_stages_solve: int | None = None
    diag_inverse: str | None = None
    split_state_bwd: bool | None = None
    split_intra: bool | None = None
    num_warps_solve: int | None = None
    num_warps_diag: int | None = None
    diag_heads: int | None = None
    block_k_pairs: int | None = None
    block_k_pairs_bwd: int | None = None
    num_stages_pairs: int | None = None
    num_warps_pairs: int | None = None
    num_warps_pairs_bwd: int | None = None
    fuse_pairs_solve: bool | None = None
    block_k_out: int | None = None
    num_stages_out: int | None = None
    block_wu: int | None = None
    block_wu_channel: int | None = None

    def resolve(self, K, V, programs=None, gate=None, low=True):
        """Fills the None fields; `programs` = sequences x heads of the sequential passes.

        Warp defaults come from ptxas register/spill reports of the kernels compiled for sm_90
        (Triton 3.9, bf16, K = V = 128) and from timings: the intra-chunk backward needs 8
        (16 halves the register cap and spills more); the state passes spill < 300 B at 4 or 8
        warps. Pipeline stages in the state passes multiply their shared memory: three fit
        bf16 with K <= 128 and a scalar or no gate, and KDA at V blocks of 16; two bf16 KDA
        with K <= 128 at wider V blocks (<= 150 KB);
        K = 256 KDA (282 KB at two) and float32 KDA (224 KB at two) use one.
        Timings on an H100 (B4 T4096 H16 D128 bf16, each kernel alone, 2026-11-21, in
        benchmarks/results): three stages take the lean state pass K2 from 0.434 to 0.386 ms
        (GDN) and 0.410 to 0.353 (DeltaNet); the split reverse pass with three stages takes
        GDN's K3 from 0.610 to 0.535 ms (DeltaNet's unsplit K3: 0.493 at three stages against
        0.528 split); splitting K1 (solve on 2 warps with the wide A, then W and U0) takes
        GDN's K1 from 0.375 to 0.282 ms and DeltaNet's from 0.302 to 0.255; KDA's K1 takes
        3.69 ms at 4 warps against 4.85 at 8 (and 4.24 split).
        """
        bv = self.block_v
        if bv is None:
            # One program per (sequence, head, V block) runs the sequential chunk loop: aim at
            # >= 128 of them (one per SM on H100/H200) without V blocks below 16. H100, B1
            # T16384 H16 D128 bf16 (16 x V / block_v programs), the DeltaNet state pass with
            # operands as stored: 0.30 ms at 32, 0.26 at 16.
            bv = min(V, 64)
            while programs is not None and bv > 16 and programs * (V // bv) < 128:
                bv //= 2
        bvb = _given(self.block_v_bwd, min(V, 32 if K >= 256 else 64))
        big = max(K, V) >= 256
        split_intra = True if self.split_intra is None else self.split_intra
        if low and K <= 128:
            # KDA's reverse pass loads five [C, K] operands per chunk: three stages fit its
            # shared memory at V blocks of 16 (H100, B1 T16384 H16 D128: K2 0.525 -> 0.395 ms,
            # K3 0.768 -> 0.630; four stages overflow K3), two at wider blocks.
            stages = 2 if gate == "channel" and bv > 16 else 3
        else:
            stages = 1
        kkt = _given(self.block_k_kkt, 64 if low and split_intra and gate != "channel" else 0)
        return dataclasses.replace(
            self, block_v=bv, block_v_bwd=bvb,
            num_warps_intra=_given(self.num_warps_intra, 8 if big else 4),
            num_warps_state=_given(self.num_warps_state, 8 if K >= 256 else 4),
            # Measured on an H200 (B4 T4096 H16 D128 bf16, this K4): 8 warps for the
            # scalar gate (GDN fwd+bwd 2.89 -> 2.60 ms), 4 for none and channel (DeltaNet 1.86
            # vs 2.04 with 8, KDA 22.6 vs 25.8).
            # KDA's K4 (H100, same shape, new kernel split): 1.92 ms at 8 vs 2.62 at 4; its
            # K4b 2.68 vs 2.52.
            num_warps_bwd=_given(self.num_warps_bwd, 4 if gate == "none" else 8),
            num_stages_state=_given(self.num_stages_state, stages),
            fuse_output=False if self.fuse_output is None else self.fuse_output,
            block_v_out=_given(self.block_v_out, min(V, 128)),
            num_warps_out=_given(self.num_warps_out, 8 if big else 4),
            # The wide K1 needs the Triton barrier primitive (present in jax 0.10 and 0.11).
            # Measured on an H200: for GDN in float32 (B2 T1000 H4 D128) the 16-row K1's output
            # is 1.4e-5 off the float32 reference (bar 1e-5) against 8e-7 for the wide one;
            # in bf16 both are ~4e-3 (bar 1e-2). In one K1 the 16-row layout was 2-3% faster
            # for bf16 (H200, GDN fwd+bwd 2.84 vs 2.89 ms); in the split K1 the wide A is
            # faster (H100, GDN K1a+K1b 0.282 vs 0.332 ms). For KDA the wide W / U0 is much
            # slower (22.6 vs 18.6 ms). So wide for the scalar or no gate at K <= 128 when K1
            # is split or the inputs are float32 (the configurations checked on the GPU),
            # 16-row otherwise.
            wide_intra=((_HAS_BARRIER and gate != "channel" and K <= 128
                         and (split_intra or not low))
                        if self.wide_intra is None else self.wide_intra),
            merge_dots=_given(self.merge_dots, 3),
            # bf16, split K1, no / scalar gate: A in registers over 64-column pieces on two
            # stages. H100, B4 T4096 H16 D128, the solve kernel alone 0.136 -> 0.080 ms (0.090
            # on one stage, 0.085 on three); whole fwd, best of 4 interleaved rounds: GDN 0.560
            # -> 0.521 ms, DeltaNet 0.544 -> 0.498. float32 keeps the wide A (its accuracy was
            # what the GPU checks measured there).
            block_k_kkt=kkt,
            num_stages_solve=_given(self.num_stages_solve, 2 if kkt else 1),
            diag_inverse=_given(self.diag_inverse, "products"),
            split_state_bwd=(gate == "scalar" if self.split_state_bwd is None
                             else self.split_state_bwd),
            split_intra=split_intra,
            num_warps_solve=_given(self.num_warps_solve, 1),
            num_warps_diag=_given(self.num_warps_diag, 1),
            diag_heads=_given(self.diag_heads, min(4, max(1, 256 // K))),
            block_k_pairs=_given(self.block_k_pairs, 64),
            block_k_pairs_bwd=_given(self.block_k_pairs_bwd, 64),
            num_warps_pairs=_given(self.num_warps_pairs, 1),
            num_warps_pairs_bwd=_given(self.num_warps_pairs_bwd, 4),
            fuse_pairs_solve=bool(self.fuse_pairs_solve),
            block_k_out=_given(self.block_k_out, 64),
            num_stages_out=_given(self.num_stages_out, 2 if gate == "channel" else 1),
            block_wu=_given(self.block_wu, 64),
            num_stages_pairs=_given(self.num_stages_pairs, 2),
            block_wu_channel=_given(self.block_wu_channel, 64),
            num_stages_intra=_given(self.num_stages_intra,
                                    3 if gate == "channel" and split_intra else 2))


@dataclasses.dataclass(frozen=True)
class _Static:
    kc: gk.KernelCfg
    bs: GpuBlockSizes
    interpret: bool
    n_seq: int


# ---------------------------------------------------------------------------------------------
# Validation


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _float_array(name, x, allow_none=False):
    if x is None:
        if allow_none:
            return None
        raise ValueError(f"{_FN}: argument `{name}` is required.")
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if x.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"{_FN}: argument `{name}` must be float32 or bfloat16; got {x.dtype}.")
    return x


def _check(name, x, shape, layout):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{_FN}: argument `{name}` must have shape {layout} = {tuple(shape)}; "
                         f"got {tuple(x.shape)}.")


def _validate(q, k, v, beta, g, initial_state, chunk_size, cu_seqlens, interpret, block_sizes):
    q, k, v = _float_array("q", q), _float_array("k", k), _float_array("v", v)
    if q.ndim != 4:
        raise ValueError(f"{_FN}: argument `q` must have layout [B, T, H, K]; got shape "
                         f"{tuple(q.shape)}.")
    B, T, H, K = q.shape
    _check("k", k, (B, T, H, K), "[B, T, H, K]")
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"{_FN}: argument `v` must have shape [B, T, H, V] with (B, T, H) = "
                         f"{(B, T, H)}; got {tuple(v.shape)}.")
    V = v.shape[-1]
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{_FN}: arguments `q`, `k`, `v` must share one dtype; got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}.")
    if T < 1:
        raise ValueError(f"{_FN}: argument `q` must have at least one token (T >= 1); got T = {T}.")
    dims = INTERPRET_HEAD_DIMS if interpret else GPU_HEAD_DIMS
    for name, d in (("q", K), ("v", V)):
        if d not in dims:
            where = ("in interpret mode" if interpret else
                     "on GPU (the Triton kernels; other sizes run in interpret mode only)")
            raise ValueError(f"{_FN}: argument `{name}` has head dim {d}; supported {where}: "
                             f"{dims}. Pad the head dim or use atlas_jax.ops.chunk_delta_family.")
    beta = _float_array("beta", beta, allow_none=True)
    if beta is not None:
        _check("beta", beta, (B, T, H), "[B, T, H]")
    g = _float_array("g", g, allow_none=True)
    if g is not None and g.ndim == 3:
        _check("g", g, (B, T, H), "[B, T, H]")
    elif g is not None:
        _check("g", g, (B, T, H, K), "[B, T, H, K] (or [B, T, H] for a scalar gate)")
    if not _is_int(chunk_size) or int(chunk_size) not in CHUNK_SIZES:
        raise ValueError(f"{_FN}: argument `chunk_size` must be one of {CHUNK_SIZES}; got "
                         f"{chunk_size!r}.")
    n_seq = B
    if cu_seqlens is not None:
        if not hasattr(cu_seqlens, "dtype"):
            cu_seqlens = np.asarray(cu_seqlens)
        if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
            raise TypeError(f"{_FN}: argument `cu_seqlens` must be an integer array; got "
                            f"{cu_seqlens.dtype}.")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"{_FN}: argument `cu_seqlens` must have shape [N + 1] with N >= 1 "
                             f"sequences; got {tuple(cu_seqlens.shape)}.")
        if B != 1:
            raise ValueError(f"{_FN}: argument `cu_seqlens` needs packed sequences in a batch of "
                             f"one (B = 1); got B = {B}.")
        n_seq = cu_seqlens.shape[0] - 1
        if isinstance(cu_seqlens, np.ndarray):
            c = cu_seqlens.astype(np.int64)
            if c[0] != 0 or c[-1] != T or np.any(np.diff(c) < 0):
                raise ValueError(f"{_FN}: argument `cu_seqlens` must be non-decreasing offsets "
                                 f"from 0 to T = {T}; got {c.tolist()}.")
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    if initial_state is not None:
        initial_state = _float_array("initial_state", initial_state)
        _check("initial_state", initial_state, (n_seq, H, K, V),
               "[N, H, K, V] (N = number of sequences)" if cu_seqlens is not None
               else "[B, H, K, V]")
    bs = block_sizes or GpuBlockSizes()
    if not isinstance(bs, GpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be a GpuBlockSizes; got "
                        f"{type(bs).__name__}.")
    gate = None if g is None else ("scalar" if g.ndim == 3 else "channel")
    bs = bs.resolve(K, V, programs=n_seq * H, gate=gate, low=q.dtype == jnp.bfloat16)
    for name, b in (("block_v", bs.block_v), ("block_v_bwd", bs.block_v_bwd),
                    ("block_v_out", bs.block_v_out)):
        if not _is_int(b) or b < 16 or b & (b - 1) or V % b:
            raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a power of two >= 16 "
                             f"dividing V = {V}; got {b!r}.")
    for name in ("num_warps_intra", "num_warps_solve", "num_warps_state", "num_warps_bwd",
                 "num_warps_out", "num_warps_diag", "num_warps_pairs", "num_warps_pairs_bwd"):
        w = getattr(bs, name)
        if not _is_int(w) or w < 1 or w > 32 or w & (w - 1):
            raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a power of two from "
                             f"1 to 32 (warps per program); got {w!r}.")
    for name in ("block_k_pairs", "block_k_pairs_bwd", "block_k_out", "block_wu",
                 "block_wu_channel"):
        b = getattr(bs, name)
        if not _is_int(b) or b < 16 or b & (b - 1):
            raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a power of two "
                             f">= 16 (K columns per piece); got {b!r}.")
    d = bs.diag_heads
    if not _is_int(d) or d < 1 or d & (d - 1):
        raise ValueError(f"{_FN}: argument `block_sizes.diag_heads` must be a power of two >= 1 "
                         f"(heads per diagonal-block program); got {d!r}.")
    for name in ("num_stages_intra", "num_stages_state", "num_stages_bwd", "num_stages_out",
                 "num_stages_pairs", "num_stages_solve"):
        n = getattr(bs, name)
        if not _is_int(n) or n < 1:
            raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be a positive integer "
                             f"(pipeline stages); got {n!r}.")
    if bs.diag_inverse not in ("products", "substitution"):
        raise ValueError(f"{_FN}: argument `block_sizes.diag_inverse` must be 'products' or "
                         f"'substitution'; got {bs.diag_inverse!r}.")
    if bs.merge_dots not in (1, 3, 6):
        raise ValueError(f"{_FN}: argument `block_sizes.merge_dots` must be 1 (tf32), 3 or 6; "
                         f"got {bs.merge_dots!r}.")
    b = bs.block_k_kkt
    if not _is_int(b) or (b != 0 and (b < 16 or b & (b - 1))):
        raise ValueError(f"{_FN}: argument `block_sizes.block_k_kkt` must be 0 (off) or a power "
                         f"of two >= 16 (K columns per piece); got {b!r}.")
    if bs.wide_intra and not _HAS_BARRIER and not interpret:
        raise ValueError(f"{_FN}: `block_sizes.wide_intra` needs "
                         f"jax.experimental.pallas.triton.debug_barrier (missing here).")
    for name in ("inter_dtype", "state_dtype"):
        if getattr(bs, name) not in ("float32", "input"):
            raise ValueError(f"{_FN}: argument `block_sizes.{name}` must be 'float32' or "
                             f"'input'; got {getattr(bs, name)!r}.")
    return q, k, v, beta, g, initial_state, cu_seqlens, n_seq, bs


# ---------------------------------------------------------------------------------------------
# pallas_call plumbing


def _call(body, grid, ins, outs, *, name, num_warps, num_stages, interpret, aliases=None):
    """ins: [(name, array, BlockSpec)], outs: [(name, ShapeDtypeStruct, BlockSpec)];
    aliases: {input name: output name} written in place."""
    names = [n for n, _, _ in ins] + [n for n, _, _ in outs]
    in_index = {n: i for i, (n, _, _) in enumerate(ins)}
    out_index = {n: i for i, (n, _, _) in enumerate(outs)}

    def kernel(*refs):
        body(dict(zip(names, refs)))

    res = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[s for _, _, s in ins],
        out_specs=[s for _, _, s in outs],
        out_shape=[sd for _, sd, _ in outs],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
        input_output_aliases={in_index[a]: out_index[b] for a, b in (aliases or {}).items()},
    )(*[a for _, a, _ in ins])
    return dict(zip([n for n, _, _ in outs], res))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _chunk_specs(C):
    """BlockSpecs of per-chunk kernels, grid (NT, B, H)."""
    def rows(d):
        return pl.BlockSpec((None, C, None, d), lambda n, b, h: (b, n, h, 0))
    vec = pl.BlockSpec((None, C, None), lambda n, b, h: (b, n, h))
    return rows, vec


def _token_specs(C, bh):
    """BlockSpecs of the per-token kernels (channel gate), grid (Tp, H / bh, B): block(d) the
    token's 16-row sub-block [16, bh, d] for bh heads, bvec its per-token scalars [16, bh],
    row(d) the token's own row [bh, d], rvec its scalar [bh], drow its row of the sub-block's
    diagonal 16x16 block of a [C, C] per-chunk matrix [bh, 16] and dblock that block
    [16, bh, 16]."""
    S, nb = gk.SUB, C // gk.SUB

    def block(d):
        return pl.BlockSpec((None, S, bh, d), lambda t, h, b: (b, t // S, h, 0))

    def row(d):
        return pl.BlockSpec((None, None, bh, d), lambda t, h, b: (b, t, h, 0))

    return dict(
        block=block, row=row,
        bvec=pl.BlockSpec((None, S, bh), lambda t, h, b: (b, t // S, h)),
        rvec=pl.BlockSpec((None, None, bh), lambda t, h, b: (b, t, h)),
        drow=pl.BlockSpec((None, None, bh, S), lambda t, h, b: (b, t, h, (t // S) % nb)),
        dblock=pl.BlockSpec((None, S, bh, S), lambda t, h, b: (b, t // S, h, (t // S) % nb)))


def _vblock_specs(C, bv):
    """BlockSpecs of the parallel kernels over chunks and V blocks, grid (V / bv, NT, B, H):
    rows(d) of one chunk, its per-token scalars and its [C, bv] V block."""
    def rows(d):
        return pl.BlockSpec((None, C, None, d), lambda j, n, b, h: (b, n, h, 0))
    vec = pl.BlockSpec((None, C, None), lambda j, n, b, h: (b, n, h))
    vrows = pl.BlockSpec((None, C, None, bv), lambda j, n, b, h: (b, n, h, j))
    return rows, vec, vrows


def _seq_specs(st, Tp, NT):
    """BlockSpecs of the sequential kernels, grid (NS, H, V / BV)."""
    kc = st.kc
    var = kc.varlen
    bv = kc.block_v

    def full(d):
        return pl.BlockSpec((None, Tp, None, d), lambda s, h, j: (0 if var else s, 0, h, 0))

    vblk = pl.BlockSpec((None, Tp, None, bv), lambda s, h, j: (0 if var else s, 0, h, j))
    vec = pl.BlockSpec((None, Tp, None), lambda s, h, j: (0 if var else s, 0, h))
    state = pl.BlockSpec((None, None, kc.K, bv), lambda s, h, j: (s, h, 0, j))
    hs = pl.BlockSpec((None, NT, None, kc.K, bv), lambda s, h, j: (0 if var else s, 0, h, 0, j))
    offs = pl.BlockSpec((st.n_seq + 1,), lambda s, h, j: (0,))
    return full, vblk, vec, state, hs, offs


def _gated_seq_ins(st, r, Tp, NT, names=("qg", "kg", "gend")):
    """K1b-stored gate operands (cfg.pre_gates) for the sequential kernels, those in `names`:
    the channel gate's Gam q, exp(G_C - G) k and exp(G_C) per chunk, or the scalar gate's
    chunk-local cumulative gate gcum."""
    K = st.kc.K
    full, _, vec = _seq_specs(st, Tp, NT)[:3]
    specs = dict(qg=full(K), kg=full(K), gcum=vec,
                 gend=pl.BlockSpec((None, NT, None, K),
                                   lambda s, h, j: (0 if st.kc.varlen else s, 0, h, 0)))
    return [(n, r[n], specs[n]) for n in names]


def _inter_dtype(bs, dtype):
    return dtype if bs.inter_dtype == "input" else F32


def _state_dtype(bs, dtype):
    return dtype if bs.state_dtype == "input" else F32


# ---------------------------------------------------------------------------------------------
# Forward and backward on the padded layout [B, Tp, H, *] (Tp a multiple of C)


def _gate_spec(kc, rows, vec):
    return vec if kc.gate == "scalar" else rows(kc.K)


def _intra_forward(st: _Static, q, k, v, beta, g, save):
    """K1: per-chunk W, U0 (and T, and P for KDA), all chunks in parallel."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = q.shape
    V, C = kc.V, kc.C
    NT = Tp // C
    rows, vec = _chunk_specs(C)
    idt = _inter_dtype(bs, q.dtype)
    ins = [("k", k, rows(K)), ("v", v, rows(V)), ("beta", beta, vec)]
    if kc.gate != "none":
        ins.append(("g", g, _gate_spec(kc, rows, vec)))
    if kc.gate == "channel":
        ins.append(("q", q, rows(K)))
    outs = [("w", _sds((B, Tp, H, K), idt), rows(K)), ("u0", _sds((B, Tp, H, V), idt), rows(V))]
    if bs.split_intra:
        return _intra_forward_split(st, ins, outs, rows)
    if save or kc.wide:       # the wide layout also uses it as the in-kernel scratch
        outs.append(("tmat", _sds((B, Tp, H, C), F32), rows(C)))
    if kc.gate == "channel":
        outs.append(("p", _sds((B, Tp, H, C), F32), rows(C)))
    return _call(functools.partial(gk.intra_fwd_kernel, cfg=kc, store_t=save), (NT, B, H), ins,
                 outs, name="delta_intra_fwd", num_warps=bs.num_warps_intra,
                 num_stages=bs.num_stages_intra, interpret=st.interpret)


def _intra_forward_split(st: _Static, ins, outs, rows):
    """K1a (T, and P for KDA) then K1b (W, U0 from T); same inputs and outputs as K1."""
    kc, bs = st.kc, st.bs
    B, Tp, H, _ = outs[0][1].shape
    C, NT = kc.C, outs[0][1].shape[1] // kc.C
    # T is stored in the input dtype for bf16 inputs: its readers (K1b's W = T X, U0 = T Y and
    # K4's T^T dU) use it only as a bf16 dot operand, so no bit changes, half its traffic, and
    # they load it as stored. M (KDA) and the wide A, which the inverse reads, stay float32 in
    # their own buffer.
    tmat = ("tmat", _sds((B, Tp, H, C), jnp.bfloat16 if kc.low else F32), rows(C))
    mbuf = ("m", _sds((B, Tp, H, C), F32), rows(C))
    solve_ins = [x for x in ins if x[0] != "v"]
    if kc.gate == "channel":
        # K1d: the diagonal 16x16 blocks of M and P, one program per token; K1p: the other
        # blocks around them (in place); the solve then reads M and writes T (fuse_solve:
        # K1p forms T itself). P is stored in the inter dtype: every reader uses it as a dot
        # operand only (O, P^T dO), which rounds it to bf16 for bf16 inputs anyway, so bf16
        # storage changes no bit and lets the readers load it as stored.
        pmat = _sds((B, Tp, H, C), outs[0][1].dtype)
        bh = math.gcd(bs.diag_heads, H)
        ts = _token_specs(C, bh)
        d = _call(functools.partial(gk.channel_diag_fwd_kernel, cfg=kc), (Tp, H // bh, B),
                  [(n, a, ts["block"](kc.K) if n != "beta" else ts["bvec"])
                   for n, a, _ in solve_ins],
                  [("m", mbuf[1], ts["drow"]), ("p", pmat, ts["drow"])],
                  name="delta_intra_diag", num_warps=bs.num_warps_diag, num_stages=1,
                  interpret=st.interpret)
        pair_ins = solve_ins + [("m_d", d["m"], rows(C)), ("p_d", d["p"], rows(C))]
        if kc.fuse_solve:       # T straight from the blocks: M is read, never written back
            r = _call(functools.partial(gk.channel_pairs_kernel, cfg=kc), (NT, B, H),
                      pair_ins, [tmat, ("p", pmat, rows(C))], name="delta_intra_pairs",
                      num_warps=bs.num_warps_pairs, num_stages=bs.num_stages_pairs,
                      interpret=st.interpret,
                      aliases={"p_d": "p"})
        else:
            r = _call(functools.partial(gk.channel_pairs_kernel, cfg=kc), (NT, B, H),
                      pair_ins, [mbuf, ("p", pmat, rows(C))], name="delta_intra_pairs",
                      num_warps=bs.num_warps_pairs, num_stages=bs.num_stages_pairs,
                      interpret=st.interpret,
                      aliases={"m_d": "m", "p_d": "p"})
            solve_ins = [x for x in ins if x[0] == "beta"] + [("m", r["m"], rows(C))]
            r.update(_call(functools.partial(gk.intra_fwd_kernel, cfg=kc, store_t=True,
                                             part="solve"),
                           (NT, B, H), solve_ins, [tmat], name="delta_intra_solve",
                           num_warps=bs.num_warps_solve, num_stages=1, interpret=st.interpret))
    else:
        # The wide A goes through a float32 scratch buffer that the inverse reads back.
        # (block_kkt: A stays in registers, no scratch.)
        scratch = [("ascr", mbuf[1], rows(C))] if kc.wide and not kc.block_kkt else []
        r = _call(functools.partial(gk.intra_fwd_kernel, cfg=kc, store_t=True, part="solve"),
                  (NT, B, H), solve_ins, [tmat] + scratch, name="delta_intra_solve",
                  num_warps=bs.num_warps_solve, num_stages=bs.num_stages_solve,
                  interpret=st.interpret)
    wu_ins = [x for x in ins if x[0] != "q" or kc.pre_gates] + [("tmat", r["tmat"], rows(C))]
    if kc.pre_gates and kc.gate == "scalar":
        outs = outs + [("gcum", _sds((B, Tp, H), F32), _chunk_specs(C)[1])]
    elif kc.pre_gates:
        K = kc.K
        outs = outs + [("qg", _sds((B, Tp, H, K), outs[0][1].dtype), rows(K)),
                       ("kg", _sds((B, Tp, H, K), outs[0][1].dtype), rows(K)),
                       ("gend", _sds((B, NT, H, K), F32),
                        pl.BlockSpec((None, None, None, K), lambda n, b, h: (b, n, h, 0)))]
    r.update(_call(functools.partial(gk.intra_fwd_kernel, cfg=kc, store_t=False, part="wu"),
                   (NT, B, H), wu_ins, outs, name="delta_intra_wu",
                   num_warps=bs.num_warps_intra, num_stages=bs.num_stages_intra,
                   interpret=st.interpret))
    return r


def _state_forward(st: _Static, q, k, v, g, s0, offs, r1, save):
    """K2 (+ K2o): o, sT and, when save (or always in the lean form), h; lean also v_new."""
    if st.bs.fuse_output:
        return _state_forward_fused(st, q, k, v, g, s0, offs, r1, save)
    r2 = _state_forward_lean(st, q, k, v, g, s0, offs, r1)
    r2["o"] = _output(st, q, k, v, g, r1, r2)
    return r2


def _state_forward_lean(st: _Static, q, k, v, g, s0, offs, r1):
    """K2, lean: h per chunk, v_new and the final state (no output)."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = q.shape
    NT = Tp // kc.C
    NS = st.n_seq
    full, vblk, svec, state, hs, ospec = _seq_specs(st, Tp, NT)
    ins = [("w", r1["w"], full(K)), ("u0", r1["u0"], vblk)]
    if kc.pre_gates and kc.gate == "channel":
        ins += _gated_seq_ins(st, r1, Tp, NT, names=("kg", "gend"))
    else:
        ins.append(("k", k, full(K)))
        if kc.pre_gates:
            ins += _gated_seq_ins(st, r1, Tp, NT, names=("gcum",))
        elif kc.gate == "scalar":
            ins.append(("g", g, svec))
        elif kc.gate == "channel":
            ins.append(("g", g, full(K)))
    if kc.has_s0:
        ins.append(("s0", s0, state))
    if kc.varlen:
        ins.append(("offs", offs, ospec))
    outs = [("sT", _sds((NS, H, K, kc.V), F32), state),
            ("h", _sds((B, NT, H, K, kc.V), _state_dtype(bs, q.dtype)), hs),
            ("vn", _sds((B, Tp, H, kc.V), q.dtype), vblk)]
    return _call(functools.partial(gk.state_fwd_lean_kernel, cfg=kc, nt_static=NT),
                 (NS, H, kc.V // kc.block_v), ins, outs, name="delta_state_fwd_lean",
                 num_warps=bs.num_warps_state, num_stages=bs.num_stages_state,
                 interpret=st.interpret)


def _output(st: _Static, q, k, v, g, r1, r2):
    """K2o: O = (Gam q) h + P v_new for every chunk and V block in parallel."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = q.shape
    V, C = kc.V, kc.C
    NT = Tp // C
    bvo = bs.block_v_out
    rows, vec, vrows = _vblock_specs(C, bvo)
    if kc.pre_gates and kc.gate == "channel":
        ins = [("qg", r1["qg"], rows(K)), ("p", r1["p"], rows(C))]
    else:
        ins = [("q", q, rows(K))]
        if kc.gate != "channel":
            ins.append(("k", k, rows(K)))
        if kc.gate == "scalar":
            ins.append(("gcum", r1["gcum"], vec) if kc.pre_gates else ("g", g, vec))
        elif kc.gate == "channel":
            ins += [("g", g, rows(K)), ("p", r1["p"], rows(C))]
    ins += [("h", r2["h"], pl.BlockSpec((None, None, None, K, bvo),
                                        lambda j, n, b, h: (b, n, h, 0, j))),
            ("vn", r2["vn"], vrows)]
    outs = [("o", _sds((B, Tp, H, V), v.dtype), vrows)]
    # V blocks vary fastest: the programs of one chunk run together and share q, k in L2.
    return _call(functools.partial(gk.output_kernel, cfg=kc), (V // bvo, NT, B, H), ins, outs,
                 name="delta_output", num_warps=bs.num_warps_out, num_stages=bs.num_stages_out,
                 interpret=st.interpret)["o"]


def _state_forward_fused(st: _Static, q, k, v, g, s0, offs, r1, save):
    """K2, fused: the sequential state pass over chunks with the output fused in."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = q.shape
    NT = Tp // kc.C
    NS = st.n_seq
    full, vblk, svec, state, hs, ospec = _seq_specs(st, Tp, NT)
    kc2 = dataclasses.replace(kc, store_h=save)
    ins = [("q", q, full(K)), ("k", k, full(K)), ("w", r1["w"], full(K)), ("u0", r1["u0"], vblk)]
    if kc.gate == "scalar":
        ins.append(("g", g, svec))
    elif kc.gate == "channel":
        ins += [("g", g, full(K)), ("p", r1["p"], full(kc.C))]
    if kc.pre_gates and kc.gate == "channel":
        ins += _gated_seq_ins(st, r1, Tp, NT)
    if kc.has_s0:
        ins.append(("s0", s0, state))
    if kc.varlen:
        ins.append(("offs", offs, ospec))
    outs = [("o", _sds((B, Tp, H, kc.V), v.dtype), vblk), ("sT", _sds((NS, H, K, kc.V), F32), state)]
    if save:
        outs.append(("h", _sds((B, NT, H, K, kc.V), _state_dtype(bs, q.dtype)), hs))
    return _call(functools.partial(gk.state_fwd_kernel, cfg=kc2, nt_static=NT),
                 (NS, H, kc.V // kc.block_v), ins, outs, name="delta_state_fwd",
                 num_warps=bs.num_warps_state, num_stages=bs.num_stages_state,
                 interpret=st.interpret)


def _forward(st: _Static, q, k, v, beta, g, s0, offs, save):
    r1 = _intra_forward(st, q, k, v, beta, g, save)
    r2 = _state_forward(st, q, k, v, g, s0, offs, r1, save)
    res = None
    if save:
        res = dict(w=r1["w"], u0=r1["u0"], tmat=r1["tmat"], p=r1.get("p"), h=r2["h"],
                   vn=r2.get("vn"), qg=r1.get("qg"), kg=r1.get("kg"), gend=r1.get("gend"),
                   gcum=r1.get("gcum"))
    return r2["o"], r2["sT"], res


def _du_local(st: _Static, q, k, g, res, do):
    """K3a: dU_local = P^T dO for every chunk and V block in parallel (float32)."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = q.shape
    V, C = kc.V, kc.C
    NT = Tp // C
    bvo = bs.block_v_out
    rows, vec, vrows = _vblock_specs(C, bvo)
    ins = [("q", q, rows(K))]
    if kc.gate == "channel":
        ins.append(("p", res["p"], rows(C)))
    else:
        ins.append(("k", k, rows(K)))
        if kc.gate == "scalar":
            ins.append(("gcum", res["gcum"], vec) if kc.pre_gates else ("g", g, vec))
    ins.append(("do", do, vrows))
    outs = [("du", _sds((B, Tp, H, V), F32), vrows)]
    return _call(functools.partial(gk.du_local_kernel, cfg=kc), (V // bvo, NT, B, H), ins, outs,
                 name="delta_du_local", num_warps=bs.num_warps_out, num_stages=1,
                 interpret=st.interpret)["du"]


def _state_backward(st: _Static, q, k, g, offs, res, do, dsT):
    """K3: the reverse state pass: dS per chunk, dU and the initial state's gradient; with
    split_state_bwd, K3a computes dU_local first and the lean pass adds the state's part."""
    kc, bs = st.kc, st.bs
    split = bs.split_state_bwd
    B, Tp, H, K = q.shape
    V = kc.V
    NT = Tp // kc.C
    NS = st.n_seq
    full, vblk, svec, state, hs, ospec = _seq_specs(st, Tp, NT)
    kc3 = dataclasses.replace(kc, has_dsT=dsT is not None)
    ins = [("q", q, full(K)), ("k", k, full(K)), ("w", res["w"], full(K))]
    if kc.gate == "scalar":
        ins += (_gated_seq_ins(st, res, Tp, NT, names=("gcum",)) if kc.pre_gates
                else [("g", g, svec)])
    elif kc.gate == "channel":
        ins.append(("g", g, full(K)))
        if not split:
            ins.append(("p", res["p"], full(kc.C)))
        if kc.pre_gates:
            ins += _gated_seq_ins(st, res, Tp, NT)
    ins.append(("do", do, vblk))
    if split:
        ins.append(("du_local", _du_local(st, q, k, g, res, do), vblk))
    if dsT is not None:
        ins.append(("dsT", dsT, state))
    if kc.varlen:
        ins.append(("offs", offs, ospec))
    outs = [("dh", _sds((B, NT, H, K, V), _state_dtype(bs, q.dtype)), hs),
            ("du", _sds((B, Tp, H, V), F32), vblk),
            ("ds0", _sds((NS, H, K, V), F32), state)]
    kernel = gk.state_bwd_lean_kernel if split else gk.state_bwd_kernel
    return _call(functools.partial(kernel, cfg=kc3, nt_static=NT),
                 (NS, H, V // kc.block_v), ins, outs,
                 name="delta_state_bwd_lean" if split else "delta_state_bwd",
                 num_warps=bs.num_warps_state, num_stages=bs.num_stages_state,
                 interpret=st.interpret, aliases={"du_local": "du"} if split else None)


def _intra_backward(st: _Static, q, k, v, beta, g, res, do, r3):
    """K4 (+ K4b for KDA): dq, dk, dv, dbeta, dg of every chunk in parallel."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = q.shape
    V, C = kc.V, kc.C
    NT = Tp // C
    rows, vec = _chunk_specs(C)
    hchunk = pl.BlockSpec((None, None, None, K, V), lambda n, b, h: (b, n, h, 0, 0))
    vn = res.get("vn")
    kc = dataclasses.replace(kc, has_vn=vn is not None)
    ins = [("q", q, rows(K)), ("k", k, rows(K)), ("v", v, rows(V)), ("beta", beta, vec)]
    if kc.gate != "none":
        ins.append(("g", g, _gate_spec(kc, rows, vec)))
    ins += [("tmat", res["tmat"], rows(C)), ("w", res["w"], rows(K)), ("u0", res["u0"], rows(V)),
            ("h", res["h"], hchunk), ("dh", r3["dh"], hchunk), ("do", do, rows(V)),
            ("du", r3["du"], rows(V))]
    if vn is not None:
        ins.append(("vn", vn, rows(V)))
    outs = [("dv", _sds(v.shape, v.dtype), rows(V))]
    if kc.gate == "channel":
        outs += [("dq_p", _sds((B, Tp, H, K), F32), rows(K)),
                 ("dk_p", _sds((B, Tp, H, K), F32), rows(K)),
                 ("dg_p", _sds((B, Tp, H, K), F32), rows(K)),
                 ("db_p", _sds((B, Tp, H), F32), vec),
                 ("dp", _sds((B, Tp, H, C), F32), rows(C)),
                 ("dm", _sds((B, Tp, H, C), F32), rows(C))]
    else:
        outs += [("dq", _sds(q.shape, q.dtype), rows(K)), ("dk", _sds(k.shape, k.dtype), rows(K)),
                 ("dbeta", _sds(beta.shape, beta.dtype), vec)]
        if kc.gate == "scalar":
            outs.append(("dg", _sds(g.shape, g.dtype), vec))
    r4 = _call(functools.partial(gk.intra_bwd_kernel, cfg=kc), (NT, B, H), ins, outs,
               name="delta_intra_bwd", num_warps=bs.num_warps_bwd,
               num_stages=bs.num_stages_bwd, interpret=st.interpret)
    if kc.gate == "channel":
        # K4d: the diagonal blocks' pairwise terms, one program per token, added in place to
        # K4's dense parts (the gate's part to its own buffer); K4b: the off-diagonal ones and
        # the gate's reverse sum.
        bh = math.gcd(bs.diag_heads, H)
        ts = _token_specs(C, bh)
        blk, row = ts["block"](K), ts["row"](K)
        d = _call(functools.partial(gk.channel_diag_bwd_kernel, cfg=kc), (Tp, H // bh, B),
                  [("q", q, blk), ("k", k, blk), ("g", g, blk), ("beta", beta, ts["bvec"]),
                   ("dp_d", r4["dp"], ts["dblock"]), ("dm_d", r4["dm"], ts["dblock"]),
                   ("dq_in", r4["dq_p"], row), ("dk_in", r4["dk_p"], row),
                   ("db_in", r4["db_p"], ts["rvec"])],
                  [("dq", _sds((B, Tp, H, K), F32), row), ("dk", _sds((B, Tp, H, K), F32), row),
                   ("db", _sds((B, Tp, H), F32), ts["rvec"]),
                   ("dgd", _sds((B, Tp, H, K), F32), row)],
                  name="delta_intra_bwd_diag", num_warps=bs.num_warps_diag, num_stages=1,
                  interpret=st.interpret,
                  aliases={"dq_in": "dq", "dk_in": "dk", "db_in": "db"})
        ins = [("q", q, rows(K)), ("k", k, rows(K)), ("beta", beta, vec), ("g", g, rows(K)),
               ("dq_p", d["dq"], rows(K)), ("dk_p", d["dk"], rows(K)),
               ("dg_p", r4["dg_p"], rows(K)), ("db_p", d["db"], vec),
               ("dp", r4["dp"], rows(C)), ("dm", r4["dm"], rows(C)),
               ("dgd", d["dgd"], rows(K))]
        outs = [("dq", _sds(q.shape, q.dtype), rows(K)), ("dk", _sds(k.shape, k.dtype), rows(K)),
                ("dg", _sds(g.shape, g.dtype), rows(K)),
                ("dbeta", _sds(beta.shape, beta.dtype), vec)]
        kc5 = dataclasses.replace(kc, block_k_pairs=bs.block_k_pairs_bwd)
        r5 = _call(functools.partial(gk.intra_bwd_channel_kernel, cfg=kc5), (NT, B, H), ins,
                   outs, name="delta_intra_bwd_kda", num_warps=bs.num_warps_pairs_bwd,
                   num_stages=bs.num_stages_bwd, interpret=st.interpret)
        r4.update(r5)
    return r4


def _backward(st: _Static, q, k, v, beta, g, s0, offs, res, do, dsT):
    r3 = _state_backward(st, q, k, g, offs, res, do, dsT)
    r4 = _intra_backward(st, q, k, v, beta, g, res, do, r3)
    dg = r4.get("dg") if st.kc.gate != "none" else None
    ds0 = r3["ds0"].astype(s0.dtype) if s0 is not None else None
    return r4["dq"], r4["dk"], r4["dv"], r4["dbeta"], dg, ds0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(st, q, k, v, beta, g, s0, offs):
    o, sT, _ = _forward(st, q, k, v, beta, g, s0, offs, save=False)
    return o, sT


def _core_fwd(st, q, k, v, beta, g, s0, offs):
    o, sT, res = _forward(st, q, k, v, beta, g, s0, offs, save=True)
    return (o, sT), (q, k, v, beta, g, s0, offs, res)


def _core_bwd(st, saved, cts):
    q, k, v, beta, g, s0, offs, res = saved
    do, dsT = cts
    dsT = dsT.astype(F32) if st.kc.has_dsT else None
    dq, dk, dv, dbeta, dg, ds0 = _backward(st, q, k, v, beta, g, s0, offs, res,
                                           do.astype(v.dtype), dsT)
    return dq, dk, dv, dbeta, dg, ds0, None


_core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------------------------------------
# Layout glue (plain XLA): padding and packed variable-length sequences


def _varlen_maps(cu, T, C):
    """Chunk-aligned layout of packed sequences.

    Returns (src [NTa*C] source token or -1, dst [T] padded position of each token, offs [N+1]
    chunk offsets for the state passes). Every sequence starts on a chunk boundary; the last
    sequence also owns the trailing all-zero chunks (zero k, beta and g leave a state unchanged),
    so every chunk is visited by the state passes and no state crosses a sequence boundary.
    """
    N = cu.shape[0] - 1
    nta = T // C + N                                  # >= sum_i ceil(len_i / C)
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    coff = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])
    p = jnp.arange(nta * C, dtype=jnp.int32)
    c = p // C
    seq = jnp.searchsorted(coff, c, side="right").astype(jnp.int32) - 1
    seqc = jnp.clip(seq, 0, N - 1)
    within = (c - coff[seqc]) * C + p % C
    valid = (seq < N) & (within < lens[seqc])
    src = jnp.where(valid, cu[seqc] + within, -1)
    t = jnp.arange(T, dtype=jnp.int32)
    tseq = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, N - 1)
    dst = coff[tseq] * C + (t - cu[tseq])
    offs = coff.at[N].set(nta)
    return src, dst, offs, nta


def _gather_tokens(x, src):
    """x [1, T, ...] -> [1, len(src), ...] with zeros where src < 0."""
    y = jnp.take(x[0], jnp.maximum(src, 0), axis=0)
    mask = (src >= 0).reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(mask, y, jnp.zeros((), y.dtype))[None]


@functools.partial(jax.jit, static_argnames=("st", "want_final"))
def _run(st, want_final, q, k, v, beta, g, s0, cu):
    kc = st.kc
    B, T, H, K = q.shape
    C = kc.C
    s0 = None if s0 is None else s0.astype(F32)
    offs = None
    if kc.varlen:
        src, dst, offs, _ = _varlen_maps(cu, T, C)
        tok = functools.partial(_gather_tokens, src=src)
        qp, kp, vp, bp = tok(q), tok(k), tok(v), tok(beta)
        gp = None if g is None else tok(g)
    else:
        pad = (-T) % C
        if pad:
            def padt(x):
                return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            qp, kp, vp, bp = padt(q), padt(k), padt(v), padt(beta)
            gp = None if g is None else padt(g)
        else:
            qp, kp, vp, bp, gp = q, k, v, beta, g
    o, sT = _core(st, qp, kp, vp, bp, gp, s0, offs)
    if kc.varlen:
        o = jnp.take(o[0], dst, axis=0)[None]
    else:
        o = o[:, :T]
    return o, (sT if want_final else None)


def _prepare(q, k, v, beta, g, scale, initial_state, output_final_state, chunk_size, cu_seqlens,
             normalize_qk, interpret, block_sizes):
    """Validated arrays and the static description of one call (also used by the benchmark's
    per-kernel timings)."""
    if interpret is None:
        interpret = default_interpret()
    interpret = bool(interpret)
    (q, k, v, beta, g, s0, cu, n_seq, bs) = _validate(
        q, k, v, beta, g, initial_state, chunk_size, cu_seqlens, interpret, block_sizes)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if not isinstance(scale, (int, float, np.floating, np.integer)) or not math.isfinite(scale):
        raise ValueError(f"{_FN}: argument `scale` must be a finite Python float; got {scale!r}.")
    gate = "none" if g is None else ("scalar" if g.ndim == 3 else "channel")
    if beta is None:
        beta = jnp.ones((B, T, H), q.dtype)
    kc = gk.KernelCfg(C=int(chunk_size), K=K, V=V, gate=gate, low=q.dtype == jnp.bfloat16,
                      scale=float(scale), normalize=bool(normalize_qk), block_v=bs.block_v,
                      block_v_bwd=bs.block_v_bwd, has_s0=s0 is not None,
                      has_dsT=bool(output_final_state), store_h=False,
                      varlen=cu is not None, merge_dots=bs.merge_dots,
                      wide=bool(bs.wide_intra), interpret=interpret,
                      diag_products=bs.diag_inverse == "products",
                      block_k_pairs=bs.block_k_pairs,
                      pre_gates=gate != "none" and bool(bs.split_intra),
                      fuse_solve=gate == "channel" and bool(bs.fuse_pairs_solve),
                      block_k_out=bs.block_k_out, block_wu=bs.block_wu,
                      block_wu_channel=bs.block_wu_channel,
                      block_kkt=int(bs.block_k_kkt))
    st = _Static(kc=kc, bs=bs, interpret=interpret, n_seq=n_seq)
    return q, k, v, beta, g, s0, cu, st


def default_interpret():
    """Interpret mode unless a GPU backend is the default (CPU CI runs the kernels this way)."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def chunk_delta_family_gpu(q, k, v, beta, g=None, *, scale=1.0, initial_state=None,
                           output_final_state=False, chunk_size=64, cu_seqlens=None,
                           normalize_qk=False, interpret=None, block_sizes=None):
    """Exact chunked delta rule / gated delta rule / KDA as Pallas GPU kernels (custom VJP).

    Args:
      q, k: [B, T, H, K] (float32 or bfloat16; q, k, v share one dtype).
      v: [B, T, H, V].
      beta: [B, T, H] write strengths, or None for 1.
      g: None (DeltaNet), [B, T, H] scalar log-decay (Gated DeltaNet) or [B, T, H, K] channel
        log-decay (KDA). Gates are assumed <= 0 (decays); any strength is exact.
      scale: query multiplier (1/sqrt(K) in the fla convention is the caller's choice).
      initial_state: [B, H, K, V] (or [N, H, K, V] with cu_seqlens), float32 or None.
      output_final_state: also return the final state(s).
      chunk_size: 16, 32 or 64.
      cu_seqlens: None, or int32 [N + 1] offsets of N packed sequences in a batch of one;
        states never cross a boundary.
      normalize_qk: L2-normalise q and k inside the kernels (x / sqrt(sum x^2 + 1e-6)).
      interpret: run the kernels in Pallas interpret mode; None: on CPU only.
      block_sizes: GpuBlockSizes (tiling, warps, storage dtypes), None for defaults.

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B or N, H, K, V] float32 or None).
    """
    q, k, v, beta, g, s0, cu, st = _prepare(q, k, v, beta, g, scale, initial_state, output_final_state,
                                            chunk_size, cu_seqlens, normalize_qk, interpret, block_sizes)
    return _run(st, bool(output_final_state), q, k, v, beta, g, s0, cu)
