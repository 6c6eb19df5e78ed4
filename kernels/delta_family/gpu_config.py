"""Tiling and launch parameters of the GPU (Pallas, Triton lowering) delta-family kernels.

`GpuBlockSizes` holds every knob of the kernels in `gpu_fwd.py` / `gpu_bwd.py` (labels: the table
in `gpu.py`); `resolve` fills the unset ones from the shapes, `check` validates the result
against them. Why each default: benchmarks/results/gpu_block_sizes_notes.md (timings on H100 /
H200 of each choice); sweep candidates with benchmarks/tune.py.
"""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.delta_family.support import check_num_warps, is_int

# The wide K1 layout needs the Triton barrier primitive (present in jax 0.10 and 0.11).
HAS_BARRIER = hasattr(plgpu, "debug_barrier")


def _given(value, default):
    """The field if set (0 included, so that validation sees it), else the heuristic's value."""
    return default if value is None else value


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tiling and launch parameters of the GPU kernels (None: a heuristic from the shapes).

    block_v:        V block of the forward state pass K2 (V / block_v programs per sequence and
                    head); also K3's unless block_v_state_bwd is given.
    block_v_state_bwd: V block of the reverse state pass K3 (None: block_v when given, else
                    the same heuristic at >= 128 programs).
    block_v_bwd:    V block of the loop inside K4 (K4q, K4w when split; register use).
    num_warps_intra / num_warps_state / num_warps_bwd: warps of K1 (K1b when split), of K2 and
                    K3, and of K4 (K4q when split).
    num_stages_intra / num_stages_state / num_stages_bwd: pipeline stages of the same kernels.
    split_intra_bwd: no / scalar gate with the lean state pass (fuse_output=False): K4 as K4q,
                    parallel over chunks and pieces of block_k_bwd columns of K (dq, dk's P and
                    state terms, dW), then K4w over chunks (the W / U0 side: dv, dbeta, dk,
                    dg), as fla splits dqkwg and the WY backward. Default True; `resolve`
                    turns it off for the channel gate (its K4d / K4b take the one K4's dense
                    parts) and with fuse_output (K4q reads the lean K2's v_new).
    block_k_bwd:    K columns per K4q program (power of two >= 16; whole rows with in-kernel
                    q/k normalisation).
    num_warps_wy / num_stages_wy: warps and pipeline stages of K4w.
    inter_dtype:    storage of W, U0 (and K4q's dW and partial dk) between kernels: "input"
                    (bf16 for bf16 inputs, as fla stores them) or "float32".
    state_dtype:    storage of the per-chunk states h, dh: "input" (as fla stores h) or "float32".
    fuse_output:    True: K2 also computes O (no K2o); False (default): lean K2, then K2o.
    overlap_output: KDA (channel gate, K1b's gate operands, no packed sequences), forward
                    without residuals (the primal call, not the VJP's): K2 and K2o in one
                    launch, each output program waiting for its chunk's flag, so that the
                    outputs of early chunks are formed while K2 walks the later ones (the
                    output programs take all of V). None: bf16, K and V <= 128 (an output program
                    holds a whole [C, V] block), >= 128 state programs at block_v_overlap.
    block_v_overlap: V block of the state programs in that launch (None: 64).
    block_v_out / num_warps_out: V block and warps of K2o and K3a.
    wide_intra:     K1 forms A and W, U0 as whole-chunk [C, C] dots through the T buffer (needs
                    the Triton barrier); False: 16-row sub-block dots.
    merge_dots:     bf16 dots per 16x16 product in K1's blocked-inverse merges: 1 (tf32),
                    3 (hi/lo split, default) or 6 (float32-exact; always for float32 inputs).
    block_k_kkt:    K1a, no / scalar gate: K columns per piece of A = K K^T formed in registers
                    (a power of two >= 16); 0: the wide or 16-row layout.
    num_stages_solve: pipeline stages of that loop.
    diag_inverse:   16x16 diagonal inverses for bf16: "products" (Neumann series on tensor cores,
                    default) or "substitution" (always for float32 inputs).
    split_state_bwd: K3a computes dU_local = P^T dO in parallel and K3 runs lean (default for
                    the scalar gate); False: one reverse pass with P^T dO inside.
    split_intra:    K1 as K1a (solve, few warps) + K1b (W, U0; + K1d, K1p for KDA); default True.
    num_warps_solve: warps of K1a.
    num_warps_diag / diag_heads: warps and heads per program of KDA's K1d and K4d (diag_heads a
                    power of two; programs take the largest power of two dividing H up to it).
    block_k_pairs / block_k_pairs_bwd: K columns per piece of KDA's K1p / K4b (power of two
                    >= 16), K1p's loop over num_stages_pairs stages.
    num_warps_pairs / num_warps_pairs_bwd: warps of K1p / K4b.
    fuse_pairs_solve: KDA: K1p also forms T in registers (no separate K1a); default: bf16 inputs.
    block_k_out / num_stages_out: KDA: K columns per piece of K2o's loop over K, and its stages.
    block_wu:       no / scalar gate: columns per piece of K1b's W = T X, U0 = T Y; also the
                    V columns per piece of U0 in the one-kernel K1 and with in-kernel q/k
                    normalisation (so no kernel holds a whole [C, V] row block at V = 512).
    block_wu_channel: KDA: the same for K1b (gate operands, W, U0).
    """
    block_v: int | None = None
    block_v_state_bwd: int | None = None
    block_v_bwd: int | None = None
    num_warps_intra: int | None = None
    num_warps_state: int | None = None
    num_warps_bwd: int | None = None
    num_stages_intra: int | None = None
    num_stages_state: int | None = None
    num_stages_bwd: int | None = None
    split_intra_bwd: bool | None = None
    block_k_bwd: int | None = None
    num_warps_wy: int | None = None
    num_stages_wy: int | None = None
    inter_dtype: str = "input"
    state_dtype: str = "input"
    fuse_output: bool | None = None
    overlap_output: bool | None = None
    block_v_overlap: int | None = None
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

        Warps from ptxas register/spill reports (sm_90, bf16, K = V = 128) and timings; stages
        from the shared memory each pass needs. The numbers behind every choice:
        benchmarks/results/gpu_block_sizes_notes.md.
        """
        def seq_block(target):
            # One program per (sequence, head, V block) runs the sequential chunk loop: aim at
            # >= target of them without V blocks below 16.
            bv = min(V, 64)
            while programs is not None and bv > 16 and programs * (V // bv) < target:
                bv //= 2
            return bv

        # 128: one per SM on H100/H200. KDA's forward pass: 256 (H200, B4 T4096 H16 D128 bf16,
        # 128 -> 256 programs, best of 4 interleaved rounds: fwd 0.869 -> 0.849 ms; the reverse
        # pass keeps 128: fwd+bwd 4.87 -> 5.00 with both at 256, an earlier call).
        bv = _given(self.block_v, seq_block(256 if gate == "channel" else 128))
        bv_state_bwd = _given(self.block_v_state_bwd, _given(self.block_v, seq_block(128)))
        # K4's V loop: 64 columns, except float32 at K >= 256 (32; registers). bf16 K = 256,
        # V = 512 (fla's GatedDeltaNet LM), H100: 64 took fwd+bwd from 6.19 to 5.37 ms.
        bvo_overlap = _given(self.block_v_overlap, min(V, 64))
        bvb = _given(self.block_v_bwd, min(V, 32 if K >= 256 and not low else 64))
        big = max(K, V) >= 256
        split_intra = True if self.split_intra is None else self.split_intra
        if low and K <= 128:
            # Three stages fit the state passes' shared memory in bf16 at K <= 128, except
            # KDA's five [C, K] operands per chunk at V blocks wider than 16, and W stored in
            # float32 (H200, GDN K3: 238600 bytes asked at three stages, 232448 there): two.
            stages = 2 if (gate == "channel" and bv > 16) or self.inter_dtype == "float32" else 3
        else:
            stages = 1
        kkt = _given(self.block_k_kkt, 64 if low and split_intra and gate != "channel" else 0)
        fuse_pairs = bool(_given(self.fuse_pairs_solve, low))
        fuse_output = False if self.fuse_output is None else self.fuse_output
        split_bwd = ((True if self.split_intra_bwd is None else self.split_intra_bwd)
                     and gate != "channel" and not fuse_output)
        return dataclasses.replace(
            self, block_v=bv, block_v_state_bwd=bv_state_bwd, block_v_bwd=bvb,
            num_warps_intra=_given(self.num_warps_intra, 8 if big else 4),
            # bf16 at K = 256, V = 512 (fla's GatedDeltaNet LM), H100: four warps took the
            # forward from 1.61 to 1.44 ms (K2), to 1.47 (K2o).
            num_warps_state=_given(self.num_warps_state, 8 if K >= 256 and not (low and V >= 512) else 4),
            # K4q + K4w: H200, GDN B4 T4096 H16 D128 bf16, fwd+bwd, best of 3 interleaved
            # rounds: 1.539 ms against 1.896 with the one K4 (DeltaNet 1.030 against 1.273).
            # K4q on 4 warps, 2 stages, 64 columns a piece (8 warps 1.871 ms against 1.630,
            # 2 warps 2.252, 1 stage 1.691, 3 stages 1.627, 128 columns 1.782, V blocks of 32
            # 1.830 against 1.539); K4w on 4 warps (8: 1.867 against 1.539, 2: 2.218 against
            # 1.630). benchmarks/results/k4_split_h200_2026-11-26.md.
            num_warps_bwd=_given(self.num_warps_bwd, 4 if gate == "none" or split_bwd else 8),
            num_stages_bwd=_given(self.num_stages_bwd, 2 if split_bwd and low else 1),
            split_intra_bwd=split_bwd,
            block_k_bwd=_given(self.block_k_bwd, min(K, 64)),
            num_warps_wy=_given(self.num_warps_wy, 4),
            num_stages_wy=_given(self.num_stages_wy, 1),
            num_stages_state=_given(self.num_stages_state, stages),
            fuse_output=fuse_output,
            # H200, KDA B4 T4096 H16 D128 bf16, fwd, best of 3-4 interleaved rounds: K2 then
            # K2o 0.854-0.858 ms, one launch with V blocks of 64 (128 state programs) 0.832-
            # 0.836; HV 32 (256) 1.615 / 1.613; at 32 programs (B1 H16, V blocks of 16) one
            # launch was slower, 1.187 against 1.043: the waiting output programs then share
            # the multiprocessors with too few state programs.
            overlap_output=bool(_given(self.overlap_output,
                                       low and gate == "channel" and programs is not None
                                       and max(K, V) <= 128
                                       and is_int(bvo_overlap) and 0 < bvo_overlap <= V
                                       and programs * (V // bvo_overlap) >= 128)),
            block_v_overlap=bvo_overlap,
            # K2o holds a [K, block_v_out] tile of h as a dot operand; float32 dots take it as
            # three bf16 parts, so at K = 256 a 128-wide tile asked 256 KiB of shared memory
            # (H100: 227 KiB a block) at V = 512. 64 there (estimate 192 KiB, see
            # tests/test_kernels_gpu.py::test_default_blocks_fit_shared_memory); V <= 256 as tuned.
            block_v_out=_given(self.block_v_out,
                               64 if not low and K >= 256 and V > 256 else min(V, 128)),
            num_warps_out=_given(self.num_warps_out, 8 if big and not (low and V >= 512) else 4),
            # Wide for the scalar or no gate at K <= 128 when K1 is split or the inputs are
            # float32 (more accurate in float32, faster split); 16-row otherwise.
            wide_intra=((HAS_BARRIER and gate != "channel" and K <= 128
                         and (split_intra or not low))
                        if self.wide_intra is None else self.wide_intra),
            merge_dots=_given(self.merge_dots, 3),
            # bf16, split K1, no / scalar gate: A in registers over 64-column pieces on two
            # stages; float32 keeps the wide A (the accuracy the float32 GPU checks measured).
            block_k_kkt=kkt,
            num_stages_solve=_given(self.num_stages_solve, 2 if kkt else 1),
            diag_inverse=_given(self.diag_inverse, "products"),
            split_state_bwd=(gate == "scalar" if self.split_state_bwd is None
                             else self.split_state_bwd),
            split_intra=split_intra,
            num_warps_solve=_given(self.num_warps_solve, 1),
            num_warps_diag=_given(self.num_warps_diag, 1),
            diag_heads=_given(self.diag_heads, min(4, max(1, 256 // K))),
            # 32 with T formed in K1p (H200, KDA B4 T4096 H16 D128 bf16, best of 4 interleaved
            # rounds: fwd 0.904 -> 0.851 ms, HV 32: 1.726 -> 1.618; K1p alone 0.215 -> 0.181),
            # 64 with the split solve (H100: 0.282 ms at 64 against 0.303 at 128).
            block_k_pairs=_given(self.block_k_pairs, 32 if fuse_pairs else 64),
            block_k_pairs_bwd=_given(self.block_k_pairs_bwd, 64),
            num_warps_pairs=_given(self.num_warps_pairs, 1),
            num_warps_pairs_bwd=_given(self.num_warps_pairs_bwd, 4),
            # bf16: K1p forms T itself (H200, KDA B4 T4096 HV 32 fwd: 1.711 vs 1.738 ms, 1.4%
            # faster the session before; H16 the same time); float32 keeps the split solve.
            fuse_pairs_solve=fuse_pairs,
            block_k_out=_given(self.block_k_out, 64),
            num_stages_out=_given(self.num_stages_out, 2 if gate == "channel" else 1),
            block_wu=_given(self.block_wu, 64),
            num_stages_pairs=_given(self.num_stages_pairs, 2),
            block_wu_channel=_given(self.block_wu_channel, 64),
            num_stages_intra=_given(self.num_stages_intra,
                                    3 if gate == "channel" and split_intra else 2))

    def check(self, op, V, *, interpret):
        """ValueError unless every (resolved) field is valid and fits the value head dim V."""
        for name, b in (("block_v", self.block_v), ("block_v_state_bwd", self.block_v_state_bwd),
                        ("block_v_overlap", self.block_v_overlap),
                        ("block_v_bwd", self.block_v_bwd), ("block_v_out", self.block_v_out)):
            if not is_int(b) or b < 16 or b & (b - 1) or V % b:
                raise ValueError(f"{op}: argument `block_sizes.{name}` must be a power of two >= 16 "
                                 f"dividing V = {V}; got {b!r}.")
        b = self.block_k_bwd
        if not is_int(b) or b < 16 or b & (b - 1):
            raise ValueError(f"{op}: argument `block_sizes.block_k_bwd` must be a power of two "
                             f">= 16 (K columns per K4q program); got {b!r}.")
        check_num_warps(op, self, ("num_warps_intra", "num_warps_solve", "num_warps_state",
                                   "num_warps_bwd", "num_warps_wy",
                                   "num_warps_out", "num_warps_diag", "num_warps_pairs", "num_warps_pairs_bwd"))
        for name in ("block_k_pairs", "block_k_pairs_bwd", "block_k_out", "block_wu",
                     "block_wu_channel"):
            b = getattr(self, name)
            if not is_int(b) or b < 16 or b & (b - 1):
                raise ValueError(f"{op}: argument `block_sizes.{name}` must be a power of two "
                                 f">= 16 (K columns per piece); got {b!r}.")
        d = self.diag_heads
        if not is_int(d) or d < 1 or d & (d - 1):
            raise ValueError(f"{op}: argument `block_sizes.diag_heads` must be a power of two >= 1 "
                             f"(heads per diagonal-block program); got {d!r}.")
        for name in ("num_stages_intra", "num_stages_state", "num_stages_bwd", "num_stages_out",
                     "num_stages_pairs", "num_stages_solve", "num_stages_wy"):
            n = getattr(self, name)
            if not is_int(n) or n < 1:
                raise ValueError(f"{op}: argument `block_sizes.{name}` must be a positive integer "
                                 f"(pipeline stages); got {n!r}.")
        if self.diag_inverse not in ("products", "substitution"):
            raise ValueError(f"{op}: argument `block_sizes.diag_inverse` must be 'products' or "
                             f"'substitution'; got {self.diag_inverse!r}.")
        if self.merge_dots not in (1, 3, 6):
            raise ValueError(f"{op}: argument `block_sizes.merge_dots` must be 1 (tf32), 3 or 6; "
                             f"got {self.merge_dots!r}.")
        b = self.block_k_kkt
        if not is_int(b) or (b != 0 and (b < 16 or b & (b - 1))):
            raise ValueError(f"{op}: argument `block_sizes.block_k_kkt` must be 0 (off) or a power "
                             f"of two >= 16 (K columns per piece); got {b!r}.")
        if self.wide_intra and not HAS_BARRIER and not interpret:
            raise ValueError(f"{op}: `block_sizes.wide_intra` needs "
                             f"jax.experimental.pallas.triton.debug_barrier (missing here).")
        for name in ("inter_dtype", "state_dtype"):
            if getattr(self, name) not in ("float32", "input"):
                raise ValueError(f"{op}: argument `block_sizes.{name}` must be 'float32' or "
                                 f"'input'; got {getattr(self, name)!r}.")
