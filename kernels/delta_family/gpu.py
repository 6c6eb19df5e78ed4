"""Exact chunked delta family (DeltaNet, Gated DeltaNet, KDA) as Pallas kernels for GPU (Hopper).

Semantics (per token t, state S in R^{K x V}, float32), as `atlas_jax.ops.chunk_delta_family`:
    S <- exp(g_t) * S          (g None: no decay; [B,T,H]: scalar; [B,T,H,K]: per key row of S)
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

Files: this entry (validation, padding / packed-varlen layout, `chunk_delta_family_gpu`);
`gpu_config.py` (GpuBlockSizes: every knob, its default, its checks); `gpu_launch.py` (one
launcher per kernel: BlockSpecs, grid, buffers; the `jax.custom_vjp`); `gpu_fwd.py` and
`gpu_bwd.py` (kernel bodies); `gpu_math.py` (KernelCfg and the in-kernel math); `support.py`
(supported sizes and the argument checker shared with the ops and the TPU entry).

Kernels. C = chunk size, NT = chunks, Tp = NT * C, NS = sequences (B, or N packed), BV =
block_v, BV3 = block_v_state_bwd, BVo = block_v_out, bh = diag_heads dividing H (grouped value
heads: gcd(G, diag_heads) heads of one group sharing one q/k row). "Default" means
GpuBlockSizes() at bf16 or float32; every kernel runs for every gate unless the column says
otherwise.

  label kernel (gpu_fwd / gpu_bwd)       launcher (gpu_launch)  grid               runs when
  K1    intra_fwd_kernel(part="all")     _intra_forward         (NT, B, H)         split_intra=False
  K1d   channel_diag_fwd_kernel          _intra_forward_split   (Tp, H/bh, B)      channel gate (KDA)
  K1p   channel_pairs_kernel             _intra_forward_split   (NT, B, H)         channel gate (KDA)
  K1a   intra_fwd_kernel(part="solve")   _intra_forward_split   (NT, B, H)         default; KDA only
                                                                                   without
                                                                                   fuse_pairs_solve
                                                                                   (float32)
  K1b   intra_fwd_kernel(part="wu")      _intra_forward_split   (NT, B, H)         default
  K2    state_fwd_lean_kernel            _state_forward_lean    (NS, H, V/BV)      default
        state_fwd_kernel                 _state_forward_fused   (NS, H, V/BV)      fuse_output=True
  K2o   output_kernel                    _output                (V/BVo, NT, B, H)  default (lean K2)
  K2+o  state_out_fwd_kernel             _state_output_overlapped (NS·H·V/BV      KDA primal forward,
                                                                + NT·B·H)         overlap_output
                                                                                   (bf16 default at
                                                                                   >= 128 programs)
  K3a   du_local_kernel                  _du_local              (V/BVo, NT, B, H)  split_state_bwd
                                                                                   (default: scalar)
  K3    state_bwd_lean_kernel            _state_backward        (NS, H, V/BV3)     split_state_bwd
        state_bwd_kernel                 _state_backward        (NS, H, V/BV3)     otherwise (default:
                                                                                   none, channel)
  K4q   intra_bwd_qk_kernel              _intra_backward_split  (K/BK, NT, B, H)   default: none,
                                                                                   scalar (the lean
                                                                                   K2's v_new)
  K4w   intra_bwd_wy_kernel              _intra_backward_split  (NT, B, H)         after K4q
  K4    intra_bwd_kernel                 _intra_backward        (NT, B, H)         channel gate (the
                                                                                   dense part);
                                                                                   split_intra_bwd=
                                                                                   False
  K4d   channel_diag_bwd_kernel          _intra_backward        (Tp, H/bh, B)      channel gate (KDA)
  K4b   intra_bwd_channel_kernel         _intra_backward        (NT, B, H)         channel gate (KDA)

The `pallas_call` names (what profilers and benchmarks/tune.py --per-kernel show): K1
delta_intra_fwd, K1d delta_intra_diag, K1p delta_intra_pairs, K1a delta_intra_solve, K1b
delta_intra_wu, K2 delta_state_fwd_lean (fused: delta_state_fwd), K2o delta_output, K3a
delta_du_local, K3 delta_state_bwd_lean / delta_state_bwd, K4q delta_intra_bwd_qk, K4w
delta_intra_bwd_wy, K4 delta_intra_bwd, K4d
delta_intra_bwd_diag, K4b delta_intra_bwd_kda.

What they compute (math in gpu_math.py): K1* the blocked inverse T = (I + diag(beta) A)^-1
(16x16 diagonal blocks as Neumann products for bf16, by substitution for float32), W = T X and
U0 = T Y (+ P for KDA, + the state passes' gated operands with split_intra); K2 the sequential
recurrence over chunks (h per chunk, U = U0 - W S "v_new", the final state); K2o
O = (Gam q) h + P U in parallel; K3 the reverse pass (dS per chunk, dU, dS0); K3a dU_local =
P^T dO in parallel; K4* dq, dk, dv, dbeta, dg per chunk (K4q the state / output side per piece
of K, K4w the W / U0 side). Forward: K1* -> K2 -> K2o; backward: K3a -> K3 -> K4q -> K4w (KDA:
K4 -> K4d -> K4b). Plain XLA glue here: padding T to a multiple of C and the
packed-varlen layout (each sequence starts on a chunk boundary, so no state crosses one).

Why the Pallas *Triton* lowering (`jax.experimental.pallas.triton`) and not Mosaic GPU: it runs
unchanged in Pallas interpret mode on CPU (how CI tests these kernels), its small API
(`pallas_call`, `BlockSpec`, `pl.ds`, `CompilerParams(num_warps, num_stages)`) is the same in
jax 0.10.2 and 0.11.2, and Triton is what flash-linear-attention uses, so benchmarks compare like
with like. Mosaic GPU (wgmma, barriers, TMA) cannot run in interpret mode and its API moved a lot
between those versions.

Supported: forward and backward (gradients for q, k, v, beta, g and the initial state;
final-state cotangent), bf16 or float32 inputs (float32 accumulation, float32 solves/states),
key head dims support.GPU_HEAD_DIMS and value head dims support.GPU_VALUE_HEAD_DIMS (up to 512:
every kernel tiles V, by block_v, block_v_out, block_v_bwd or block_wu) on GPU (and
support.INTERPRET_HEAD_DIMS in interpret mode), any
T, chunk sizes support.CHUNK_SIZES, `cu_seqlens` (B = 1 packed), in-kernel L2 normalisation,
fla's fused scalar gate and beta logits (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`:
the forward kernels activate them on load; `gpu_launch._core_fwd` says where a
differentiated call does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from atlas_jax.kernels.delta_family import gpu_launch as launch
from atlas_jax.kernels.delta_family import gpu_math as gm
from atlas_jax.kernels.delta_family import support
from atlas_jax.kernels.delta_family.gpu_config import GpuBlockSizes

__all__ = ["GpuBlockSizes", "chunk_delta_family_gpu", "default_interpret"]

F32 = jnp.float32
_FN = "chunk_delta_family_gpu"


# ---------------------------------------------------------------------------------------------
# Validation: the shared checker (support.py), then the block sizes against the shapes


def _kernel_float(x):
    """beta, g: float32 or bfloat16 as the kernels load them (other floating dtypes as float32)."""
    if x is None or x.dtype in support.KERNEL_DTYPES:
        return x
    return x.astype(F32)


def _validate(q, k, v, beta, g, initial_state, chunk_size, cu_seqlens, interpret, block_sizes):
    q, k, v, beta, g, initial_state, cu_seqlens, call = support.check_delta_call(
        _FN, q, k, v, beta, g, initial_state, cu_seqlens, kernel=True,
        allow_traced_cu_seqlens=True)
    support.check_kernel_head_dims(_FN, call.K, call.V, interpret=interpret)
    support.check_chunk_size(_FN, chunk_size, kernel=True)
    beta, g = _kernel_float(beta), _kernel_float(g)
    if cu_seqlens is not None:
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    bs = block_sizes or GpuBlockSizes()
    if not isinstance(bs, GpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be a GpuBlockSizes; got "
                        f"{type(bs).__name__}.")
    gate = None if g is None else call.gate
    bs = bs.resolve(call.K, call.V, programs=call.n_states * call.HV, gate=gate,
                    low=q.dtype == jnp.bfloat16)
    bs.check(_FN, call.V, interpret=interpret)
    return q, k, v, beta, g, initial_state, cu_seqlens, call, bs


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


def _gather_tokens(x, src, fill=0.0):
    """x [1, T, ...] -> [1, len(src), ...] with `fill` where src < 0."""
    y = jnp.take(x[0], jnp.maximum(src, 0), axis=0)
    mask = (src >= 0).reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(mask, y, jnp.asarray(fill, y.dtype))[None]


@functools.partial(jax.jit, static_argnames=("st", "want_final"))
def _run(st, want_final, q, k, v, beta, g, s0, cu, A_log=None, dt_bias=None):
    kc = st.kc
    B, T, H, K = q.shape
    C = kc.C
    s0 = None if s0 is None else s0.astype(F32)
    # A raw gate (kc.gate_act) pads with -inf, which activates to exactly 0: no decay, as the
    # activated gate's 0 padding.
    g_fill = -jnp.inf if kc.gate_act else 0.0
    offs = None
    if kc.varlen:
        src, dst, offs, _ = _varlen_maps(cu, T, C)
        tok = functools.partial(_gather_tokens, src=src)
        qp, kp, vp, bp = tok(q), tok(k), tok(v), tok(beta)
        gp = None if g is None else tok(g, fill=g_fill)
    else:
        pad = (-T) % C
        if pad:
            def padt(x, fill=0.0):
                return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2),
                               constant_values=fill)
            qp, kp, vp, bp = padt(q), padt(k), padt(v), padt(beta)
            gp = None if g is None else padt(g, g_fill)
        else:
            qp, kp, vp, bp, gp = q, k, v, beta, g
    if kc.gate_act:
        bias = jnp.zeros_like(A_log) if dt_bias is None else dt_bias
        gp = launch.RawGate(gp, A_log, bias)
    o, sT = launch.core(st, qp, kp, vp, bp, gp, s0, offs)
    if kc.varlen:
        o = jnp.take(o[0], dst, axis=0)[None]
    else:
        o = o[:, :T]
    return o, (sT if want_final else None)


def prepare(q, k, v, beta, g, scale, initial_state, output_final_state, chunk_size, cu_seqlens,
            normalize_qk, interpret, block_sizes, *, use_gate_in_kernel=False, A_log=None,
            dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Validated arrays and the static description (launch.Static) of one call; also what
    benchmarks/tune.py uses to time each kernel alone. Returns (q, k, v, beta, g, s0, cu, st,
    A_log, dt_bias)."""
    if interpret is None:
        interpret = default_interpret()
    interpret = bool(interpret)
    (q, k, v, beta, g, s0, cu, call, bs) = _validate(
        q, k, v, beta, g, initial_state, chunk_size, cu_seqlens, interpret, block_sizes)
    A_log, dt_bias = support.check_fla_args(
        _FN, call, g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    for name, on in (("use_gate_in_kernel", use_gate_in_kernel),
                     ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)):
        if on and call.gate == "channel":
            raise ValueError(f"{_FN}: argument `{name}=True` takes no gate or the scalar gate g "
                             f"[B, T, HV]; with the channel gate [B, T, HV, K] activate outside "
                             f"(atlas_jax.ops.kda does, with the same arguments).")
    B, T, H, K = q.shape
    V = v.shape[-1]
    support.check_scale(_FN, scale, static=True)
    gate = "none" if g is None else ("scalar" if g.ndim == 3 else "channel")
    if beta is None:
        beta = jnp.ones((B, T, call.HV), q.dtype)
    beta_act = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else 0.0
    kc = gm.KernelCfg(C=int(chunk_size), K=K, V=V, gate=gate, low=q.dtype == jnp.bfloat16,
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
                      block_kkt=int(bs.block_k_kkt), gate_act=bool(use_gate_in_kernel),
                      beta_act=beta_act)
    st = launch.Static(kc=kc, bs=bs, interpret=interpret, n_seq=call.n_states, group=call.group)
    return q, k, v, beta, g, s0, cu, st, A_log, dt_bias


def default_interpret():
    """Interpret mode unless a GPU backend is the default (CPU CI runs the kernels this way)."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def chunk_delta_family_gpu(q, k, v, beta, g=None, *, scale=1.0, initial_state=None,
                           output_final_state=False, chunk_size=64, cu_seqlens=None,
                           normalize_qk=False, interpret=None, block_sizes=None,
                           use_gate_in_kernel=False, A_log=None, dt_bias=None,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """Exact chunked delta rule / gated delta rule / KDA as Pallas GPU kernels (custom VJP).

    Args:
      q, k: [B, T, H, K] (float32 or bfloat16; q, k, v share one dtype).
      v: [B, T, HV, V], HV = G * H: grouped value heads (fla's GVA), value head i reads q/k
        head i // G straight from q and k (their BlockSpecs map the head; dq, dk are summed
        over each group).
      beta: [B, T, HV] write strengths, or None for 1.
      g: None (DeltaNet), [B, T, HV] scalar log-decay (Gated DeltaNet) or [B, T, HV, K] channel
        log-decay (KDA). Gates are assumed <= 0 (decays); any strength is exact.
      scale: query multiplier (1/sqrt(K) in the fla convention is the caller's choice).
      initial_state: [B, HV, K, V] (or [N, HV, K, V] with cu_seqlens), float32 or None.
      output_final_state: also return the final state(s).
      chunk_size: one of support.CHUNK_SIZES (16, 32, 64).
      cu_seqlens: None, or int32 [N + 1] offsets of N packed sequences in a batch of one;
        states never cross a boundary.
      normalize_qk: L2-normalise q and k inside the kernels (x / sqrt(sum x^2 + L2NORM_EPS)).
      interpret: run the kernels in Pallas interpret mode; None: on CPU only.
      block_sizes: GpuBlockSizes (tiling, warps, storage dtypes), None for defaults.
      use_gate_in_kernel, A_log, dt_bias: fla's fused scalar gate: g is the raw input and the
        kernels activate it on load, g = -exp(A_log) softplus(g + dt_bias) (A_log [HV],
        dt_bias [HV] or None); the activated gate is never stored, the backward recomputes it.
      use_beta_sigmoid_in_kernel, allow_neg_eigval: beta holds logits, activated on load as
        sigmoid(beta) (2 sigmoid(beta) with allow_neg_eigval).
      Gradients flow to the raw g, A_log, dt_bias and beta logits.

    Returns:
      (o [B, T, HV, V] in v.dtype, final state [B or N, HV, K, V] float32 or None).
    """
    q, k, v, beta, g, s0, cu, st, A_log, dt_bias = prepare(
        q, k, v, beta, g, scale, initial_state, output_final_state, chunk_size, cu_seqlens,
        normalize_qk, interpret, block_sizes, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval)
    return _run(st, bool(output_final_state), q, k, v, beta, g, s0, cu, A_log, dt_bias)
