"""The exact Omega rule's sequential pass as Pallas GPU kernels (Triton lowering), and its reverse.

What runs here is the sequential part of `atlas_jax.ops.omega.chunk` (the math: `support.py`),
the chunk-parallel part (gate sums, windows, the per-chunk unit-lower WY solve giving X0, W, and
kd, qg, P) staying in XLA, where autodiff differentiates it. Two kernels, one program per
(batch·head, V block), each a `fori_loop` over the chunks with the state block S [K, BV] in
registers (float32):

  omega_state_fwd   grid (B·H, V/BV): per chunk X = X0 − W S, o = qg S + P X (the read-out
                    fused), S ← last·S + kdᵀ X; writes o, the final state and (for the
                    backward, or when asked) every chunk's start state.
  omega_state_bwd   same grid, chunks in reverse: dS carried backwards from the final state's
                    cotangent; per chunk d X0 (its V block), and the V block's partial sums of
                    d W, d kd, d qg, d P (reduced over the V blocks in XLA afterwards) and the
                    column sums of S ⊙ dS (d last, summed over V in XLA); d S_0 at the end.

Tied with `jax.custom_vjp` (support.state_pass_vjp): the forward saves the per-chunk start
states (float32 [N, B·H, K, V]) as the backward's residual; the backward recomputes X from them.

Triton wants every tile a power of two and every dot side >= 16: the entry zero-pads the chunk
rows C, the pseudo-token rows M = C·c, K and V to powers of two >= 16 (`support.padded_operands`:
padding changes no number), always, so interpret mode on CPU runs exactly what a GPU compiles.

Precision: float32 operands use the delta family's float32-accurate dots (six bf16 tensor-core
dots of split operands, `gpu_math.mm`); bfloat16 operands (x0 in bf16) use bf16 dots with
float32 accumulation, as the delta kernels do for bf16 inputs. The state, `last` and every
accumulation are float32.

Verification status: run in Pallas interpret mode on CPU against the float32 recurrence
(tests/test_omega_kernels.py), and lowered to Triton for CUDA by `jax.export` on CPU. Never
compiled or timed on a GPU here (none was available): the `gpu`-marked tests do that.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from atlas_jax.kernels.delta_family.gpu_math import load_f32, mm, mm_nt, mm_tn
from atlas_jax.kernels.delta_family.support import check_num_warps, is_int
from atlas_jax.kernels.omega import support
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["OmegaGpuBlockSizes", "omega_state_pass_gpu"]

F32 = jnp.float32
_FN = "omega_state_pass_gpu"


@dataclasses.dataclass(frozen=True)
class OmegaGpuBlockSizes:
    """Tiling and launch parameters of the two GPU kernels.

    block_v: V columns per program (a power of two >= 16 dividing V padded to a power of two).
      None: min(V, 64), halved (not below 16) while B·H·V/block_v < 128 programs (one per SM of
      an H100 / H200), as the delta family's state passes choose.
    num_warps / num_warps_bwd: warps per program of the forward / backward kernel.
    num_stages: software-pipelining stages of the loads in the chunk loops (1: none).
    """
    block_v: int | None = None
    num_warps: int = 4
    num_warps_bwd: int = 4
    num_stages: int = 1

    def resolve(self, V, programs):
        bv = self.block_v
        if bv is None:
            bv = min(V, 64)
            while bv > 16 and programs * (V // bv) < 128:
                bv //= 2
        return dataclasses.replace(self, block_v=bv)

    def check(self, V):
        b = self.block_v
        if not is_int(b) or b < 16 or b & (b - 1) or V % b:
            raise ValueError(f"{_FN}: argument `block_sizes.block_v` must be a power of two >= 16 "
                             f"dividing V = {V} (padded to a power of two); got {b!r}.")
        check_num_warps(_FN, self, ("num_warps", "num_warps_bwd"))
        if not is_int(self.num_stages) or self.num_stages < 1:
            raise ValueError(f"{_FN}: argument `block_sizes.num_stages` must be a positive int "
                             f"(pipeline stages); got {self.num_stages!r}.")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static description of one call (hashable: the custom_vjp's nondiff argument)."""
    n_chunks: int
    has_w: bool            # the ℓ2 objective (X = X0 − W S); False: dot (X = X0)
    low: bool              # bf16 operands: bf16 dots (float32 accumulation)
    has_dstarts: bool      # unused by the kernels' math when False (no cotangent input)
    output_starts: bool    # the per-chunk start states are an output of the op
    bs: OmegaGpuBlockSizes
    interpret: bool


# ---------------------------------------------------------------------------------------------
# Kernel bodies (refs: the per-(batch·head) blocks; chunk n of a [N, R, D] ref is ref[n])


def _chunk_x(r, cfg, n, s):
    """X = X0 − W S of chunk n ([M, BV], float32) from its start state block s [K, BV]."""
    x = load_f32(r["x0"], (n, slice(None), slice(None)))
    if cfg.has_w:
        x = x - mm(r["w"][n, :, :], s, cfg.low)
    return x


def _last(r, n):
    """e^{G_C} of chunk n as a [1, 1] value (a [1] load: Triton tiles are at least 1-D)."""
    return load_f32(r["last"], pl.ds(n, 1))[None, :]


def _fwd_kernel(r, cfg: _Cfg, save: bool):
    low = cfg.low

    def body(n, s):
        if save:
            r["starts"][n, :, :] = s
        x = _chunk_x(r, cfg, n, s)
        o = mm(r["qg"][n, :, :], s, low) + mm(r["p"][n, :, :], x, low)
        r["o"][n, :, :] = o.astype(r["o"].dtype)
        return _last(r, n) * s + mm_tn(r["kd"][n, :, :], x, low)

    s0 = load_f32(r["s0"], (slice(None), slice(None)))
    r["sT"][:, :] = lax.fori_loop(0, cfg.n_chunks, body, s0)


def _bwd_kernel(r, cfg: _Cfg):
    low = cfg.low
    N = cfg.n_chunks

    def body(i, ds):          # ds: cotangent of the end state of chunk n
        n = N - 1 - i
        s = load_f32(r["starts"], (n, slice(None), slice(None)))
        do = load_f32(r["do"], (n, slice(None), slice(None)))
        x = _chunk_x(r, cfg, n, s)
        kd = r["kd"][n, :, :]
        qg = r["qg"][n, :, :]
        dx = mm_tn(r["p"][n, :, :], do, low) + mm(kd, ds, low)
        r["dx0"][n, :, :] = dx.astype(r["dx0"].dtype)
        r["dqg"][n, :, :] = mm_nt(do, s, low)
        r["dp"][n, :, :] = mm_nt(do, x, low)
        r["dkd"][n, :, :] = mm_nt(x, ds, low)
        r["dlast"][n, :] = jnp.sum(s * ds, axis=0)
        ds_prev = _last(r, n) * ds + mm_tn(qg, do, low)
        if cfg.has_w:
            w = r["w"][n, :, :]
            r["dw"][n, :, :] = -mm_nt(dx, s, low)
            ds_prev = ds_prev - mm_tn(w, dx, low)
        if cfg.has_dstarts:
            ds_prev = ds_prev + load_f32(r["dstarts"], (n, slice(None), slice(None)))
        return ds_prev

    dsT = load_f32(r["dsT"], (slice(None), slice(None)))
    r["ds0"][:, :] = lax.fori_loop(0, N, body, dsT)


# ---------------------------------------------------------------------------------------------
# Launchers on the kernel layout: per-chunk operands [N, BH, R, D], states [BH, K, V]


def _call(body, grid, ins, outs, *, name, num_warps, num_stages, interpret):
    """ins: [(name, array, BlockSpec)], outs: [(name, ShapeDtypeStruct, BlockSpec)]."""
    names = [n for n, _, _ in ins] + [n for n, _, _ in outs]

    def kernel(*refs):
        body(dict(zip(names, refs)))

    res = pl.pallas_call(
        kernel, grid=grid,
        in_specs=[s for _, _, s in ins], out_specs=[s for _, _, s in outs],
        out_shape=[sd for _, sd, _ in outs],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=name,
    )(*[a for _, a, _ in ins])
    return dict(zip([n for n, _, _ in outs], res))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _specs(N, K, bv):
    """BlockSpecs of grid (BH, V/BV): every chunk of a per-chunk operand (whole rows, or its V
    block), the states' V block, and the V block's slot of a partial sum [V/BV, N, BH, R, D]."""
    def rows(R, D):
        return pl.BlockSpec((N, None, R, D), lambda b, j: (0, b, 0, 0))

    def vrows(R):
        return pl.BlockSpec((N, None, R, bv), lambda b, j: (0, b, 0, j))

    def partial(R, D):
        return pl.BlockSpec((None, N, None, R, D), lambda b, j: (j, 0, b, 0, 0))

    state = pl.BlockSpec((None, K, bv), lambda b, j: (b, 0, j))
    last = pl.BlockSpec((N, None), lambda b, j: (0, b))
    return rows, vrows, partial, state, last


def _operand_ins(cfg, x0, w, kd, qg, p, last, specs):
    rows, vrows, _, _, last_spec = specs
    M, K = kd.shape[-2:]
    C = qg.shape[-2]
    ins = [("x0", x0, vrows(M))]
    if cfg.has_w:
        ins.append(("w", w, rows(M, K)))
    return ins + [("kd", kd, rows(M, K)), ("qg", qg, rows(C, K)), ("p", p, rows(C, M)),
                  ("last", last, last_spec)]


def _forward(cfg: _Cfg, x0, w, kd, qg, p, last, s0, save):
    N, BH, _, V = x0.shape
    K, C = kd.shape[-1], qg.shape[-2]
    bv = cfg.bs.block_v
    specs = _specs(N, K, bv)
    _, vrows, _, state, _ = specs
    ins = _operand_ins(cfg, x0, w, kd, qg, p, last, specs) + [("s0", s0, state)]
    outs = [("o", _sds((N, BH, C, V), x0.dtype), vrows(C)), ("sT", _sds((BH, K, V), F32), state)]
    if save:
        outs.append(("starts", _sds((N, BH, K, V), F32), vrows(K)))
    r = _call(functools.partial(_fwd_kernel, cfg=cfg, save=save), (BH, V // bv), ins, outs,
              name="omega_state_fwd", num_warps=cfg.bs.num_warps, num_stages=cfg.bs.num_stages,
              interpret=cfg.interpret)
    return r["o"], r["sT"], r.get("starts")


def _backward(cfg: _Cfg, x0, w, kd, qg, p, last, starts, do, dsT, dstarts):
    N, BH, M, V = x0.shape
    K, C = kd.shape[-1], qg.shape[-2]
    bv = cfg.bs.block_v
    nv = V // bv
    specs = _specs(N, K, bv)
    _, vrows, partial, state, _ = specs
    cfg = dataclasses.replace(cfg, has_dstarts=dstarts is not None)
    ins = _operand_ins(cfg, x0, w, kd, qg, p, last, specs)
    ins += [("starts", starts, vrows(K)), ("do", do, vrows(C)), ("dsT", dsT, state)]
    if dstarts is not None:
        ins.append(("dstarts", dstarts, vrows(K)))
    outs = [("dx0", _sds(x0.shape, x0.dtype), vrows(M)),
            ("dkd", _sds((nv, N, BH, M, K), F32), partial(M, K)),
            ("dqg", _sds((nv, N, BH, C, K), F32), partial(C, K)),
            ("dp", _sds((nv, N, BH, C, M), F32), partial(C, M)),
            ("dlast", _sds((N, BH, V), F32), pl.BlockSpec((N, None, bv), lambda b, j: (0, b, j))),
            ("ds0", _sds((BH, K, V), F32), state)]
    if cfg.has_w:
        outs.append(("dw", _sds((nv, N, BH, M, K), F32), partial(M, K)))
    r = _call(functools.partial(_bwd_kernel, cfg=cfg), (BH, nv), ins, outs,
              name="omega_state_bwd", num_warps=cfg.bs.num_warps_bwd,
              num_stages=cfg.bs.num_stages, interpret=cfg.interpret)
    # The V blocks' partial sums, reduced here (one program per V block wrote each slot).
    dw = r["dw"].sum(axis=0) if cfg.has_w else None
    return (r["dx0"], dw, r["dkd"].sum(axis=0), r["dqg"].sum(axis=0), r["dp"].sum(axis=0),
            r["dlast"].sum(axis=-1), r["ds0"])


_core = support.state_pass_vjp(_forward, _backward)


# ---------------------------------------------------------------------------------------------
# Entry


@functools.partial(jax.jit, static_argnames=("cfg", "sizes"))
def _run(x0, w, kd, qg, p, last, s0, *, cfg, sizes):
    N, B, H, C, M, K, V = sizes
    Cp, Mp, Kp, Vp = (support.next_pow2(n, 16) for n in (C, M, K, V))
    x0, w, kd, qg, p, s0 = support.kernel_operands(x0, w, kd, qg, p, s0, C=Cp, M=Mp, K=Kp, V=Vp)

    def flat(a):      # [N, B, H, ...] -> [N, B·H, ...] (free: B and H are adjacent)
        return None if a is None else a.reshape((N, B * H) + a.shape[3:])

    o, sT, starts = _core(cfg, flat(x0), flat(w), flat(kd), flat(qg), flat(p),
                          flat(last.astype(F32)), s0.reshape(B * H, Kp, Vp))
    o = o.reshape(N, B, H, Cp, Vp)[..., :C, :V]
    sT = sT.reshape(B, H, Kp, Vp)[..., :K, :V]
    if starts is not None:
        starts = starts.reshape(N, B, H, Kp, Vp)[..., :K, :V]
    return o, sT, starts


def default_interpret():
    """Interpret mode unless a GPU backend is the default (CPU CI runs the kernels this way)."""
    return jax.default_backend() not in ("gpu", "cuda", "rocm")


def omega_state_pass_gpu(x0, w, kd, qg, p, last, initial_state=None, *,
                         output_chunk_states=False, interpret=None, block_sizes=None):
    """The Omega chunk form's sequential pass with its read-out, as Pallas GPU kernels (custom VJP).

    Per chunk n, from S_0 = initial_state: X = X0 − W S, o = qg S + P X, S ← last·S + kdᵀ X
    (`atlas_jax.ops.omega.chunk.state_pass`, which is the plain-XLA equal of this function).

    Args (the chunk form's layout; `atlas_jax.ops.omega.chunk.chunk_operands` builds them):
      x0: [N, B, H, M, V] per-chunk X0 (M = C·c pseudo-tokens). float32 or bfloat16 (bf16: the
        operands are loaded and multiplied in bf16, float32 accumulation); it fixes the dtype
        every operand is cast to.
      w: [N, B, H, M, K] (ℓ2 objective) or None (dot objective: X = X0).
      kd: [N, B, H, M, K].  qg: [N, B, H, C, K].  p: [N, B, H, C, M].
      last: [N, B, H] e^{G_C} per chunk (float32).
      initial_state: [B, H, K, V] or None (zeros).
      output_chunk_states: also return every chunk's start state S_n.
      interpret: Pallas interpret mode; None: unless the default backend is a GPU.
      block_sizes: OmegaGpuBlockSizes or None (defaults).

    Returns:
      (o [N, B, H, C, V] in the operand dtype, final state [B, H, K, V] float32, start states
      [N, B, H, K, V] float32 or None), differentiable in every array argument.
    """
    sizes = support.check_state_pass(_FN, x0, w, kd, qg, p, last, initial_state)
    N, B, H, V = sizes[0], sizes[1], sizes[2], sizes[-1]
    bs = OmegaGpuBlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, OmegaGpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be an OmegaGpuBlockSizes; got "
                        f"{type(bs).__name__}.")
    Vp = support.next_pow2(V, 16)
    bs = bs.resolve(Vp, programs=B * H)
    bs.check(Vp)
    cfg = _Cfg(n_chunks=N, has_w=w is not None, low=support.operand_dtype(x0) == support.BF16,
               has_dstarts=False, output_starts=bool(output_chunk_states), bs=bs,
               interpret=bool(default_interpret() if interpret is None else interpret))
    return _run(x0, w, kd, qg, p, last, initial_state, cfg=cfg, sizes=sizes)
