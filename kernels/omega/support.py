"""What the Omega-rule kernels share, Pallas-free: the argument checks, the padding, the custom VJP.

Pure Python and jax.numpy (no Pallas, Triton or Mosaic), so that the ops can validate a call
without importing a kernel. The GPU (`gpu.py`) and TPU (`tpu.py`) kernels run one computation,
the sequential pass of `atlas_jax.ops.omega.chunk.state_pass` with its read-out fused: per chunk
n (N of them) of one (batch, head), from the start state S_0 [K, V] (float32),

    X_n      = X0_n − W_n S_n                  [M, V]   (ℓ2; the dot objective has no W: X = X0)
    o_n      = qg_n S_n + P_n X_n              [C, V]
    S_{n+1}  = last_n S_n + kd_nᵀ X_n          [K, V]

and its reverse pass. With dS the cotangent of S_{n+1} (the final state's for the last chunk)
and do_n the output's, chunk n gives

    dX   = P_nᵀ do_n + kd_n dS                 → d X0_n = dX,  d W_n = −dX S_nᵀ
    d qg_n = do_n S_nᵀ,  d P_n = do_n X_nᵀ,  d kd_n = X_n dSᵀ,  d last_n = ⟨S_n, dS⟩
    dS  ←  last_n dS + qg_nᵀ do_n − W_nᵀ dX  (+ the cotangent of S_n itself when the per-chunk
                                               start states are an output)

and the cotangent of S_0 at the end. `state_pass_vjp` ties a forward and a backward launcher
together with `jax.custom_vjp`; the forward saves the per-chunk start states S_n (float32,
[N, B·H, K, V], the same O(T·K·V / C) the XLA scan keeps) as the backward's residual, and the
backward recomputes X_n = X0_n − W_n S_n from them (one [M, K]·[K, V] product per chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32
BF16 = jnp.bfloat16

# The layout of the kernel entries' arguments (the chunk form's [N, B, H, ...] layout).
LAYOUTS = {"x0": "[N, B, H, M, V]", "w": "[N, B, H, M, K]", "kd": "[N, B, H, M, K]",
           "qg": "[N, B, H, C, K]", "p": "[N, B, H, C, M]", "last": "[N, B, H]",
           "initial_state": "[B, H, K, V]"}


def _shape_error(fn, name, want, got, why=""):
    return ValueError(f"{fn}: argument `{name}` must be {LAYOUTS[name]} = {tuple(want)}{why}; "
                      f"got {tuple(got)}.")


def check_state_pass(fn, x0, w, kd, qg, p, last, initial_state):
    """ValueError naming the first argument whose shape or dtype does not fit; returns the sizes
    (N, B, H, C, M, K, V). x0 fixes N, B, H, M, V; kd fixes K; qg fixes C."""
    arrays = {"x0": x0, "w": w, "kd": kd, "qg": qg, "p": p, "last": last,
              "initial_state": initial_state}
    for name, x in arrays.items():
        if x is None and name in ("w", "initial_state"):
            continue
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{fn}: argument `{name}` must be an array {LAYOUTS[name]}; got "
                            f"{type(x).__name__}.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{fn}: argument `{name}` must have a floating dtype; got {x.dtype}.")
    if x0.ndim != 5:
        raise ValueError(f"{fn}: argument `x0` must be {LAYOUTS['x0']} (5-D); got "
                         f"{tuple(x0.shape)}.")
    N, B, H, M, V = x0.shape
    if kd.ndim != 5 or kd.shape[:4] != (N, B, H, M):
        raise _shape_error(fn, "kd", (N, B, H, M, "K"), kd.shape, " (N, B, H, M as `x0`)")
    K = kd.shape[-1]
    if w is not None and w.shape != kd.shape:
        raise _shape_error(fn, "w", kd.shape, w.shape, " (as `kd`), or None for the dot objective")
    if qg.ndim != 5 or qg.shape[:3] != (N, B, H) or qg.shape[-1] != K:
        raise _shape_error(fn, "qg", (N, B, H, "C", K), qg.shape)
    C = qg.shape[3]
    if p.shape != (N, B, H, C, M):
        raise _shape_error(fn, "p", (N, B, H, C, M), p.shape)
    if last.shape != (N, B, H):
        raise _shape_error(fn, "last", (N, B, H), last.shape)
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise _shape_error(fn, "initial_state", (B, H, K, V), initial_state.shape, " or None")
    return N, B, H, C, M, K, V


def operand_dtype(x0):
    """The dtype the kernels load every per-chunk operand in: bfloat16 when x0 is bfloat16 (its
    dots then run on bf16 operands with float32 accumulation, as the delta kernels do for bf16
    inputs), float32 otherwise. States, `last` and all accumulation stay float32."""
    return BF16 if x0.dtype == BF16 else F32


def pad_to(x, axis, size):
    """Zero-pads axis `axis` of x to `size` (differentiable: the pad's cotangent is a slice)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def next_pow2(n, least=1):
    return max(least, 1 << max(int(n) - 1, 0).bit_length())


def round_up(n, multiple):
    return -(-int(n) // multiple) * multiple


def kernel_operands(x0, w, kd, qg, p, s0, *, C, M, K, V):
    """The operands as both kernels load them: in `operand_dtype(x0)`, the state in float32 (zeros
    when s0 is None; x0 is [N, B, H, M, V], s0 [B, H, K, V]), zero-padded by `padded_operands`."""
    dtype = operand_dtype(x0)
    x0, kd, qg, p = (a.astype(dtype) for a in (x0, kd, qg, p))
    w = None if w is None else w.astype(dtype)
    s0 = jnp.zeros(x0.shape[1:3] + (kd.shape[-1], x0.shape[-1]), F32) if s0 is None else s0.astype(F32)
    return padded_operands(x0, w, kd, qg, p, s0, C=C, M=M, K=K, V=V)


def padded_operands(x0, w, kd, qg, p, s0, *, C, M, K, V):
    """The operands zero-padded to chunk rows C, pseudo-token rows M, key width K and value width
    V. Padding changes no number: padded pseudo-tokens have X0 = W = kd = P = 0 (they write
    nothing), padded tokens qg = P = 0 (their outputs are 0 and dropped), padded key rows of the
    state start at 0 and stay 0 (kd, W and qg are 0 there), padded value columns likewise."""
    x0 = pad_to(pad_to(x0, -2, M), -1, V)
    kd = pad_to(pad_to(kd, -2, M), -1, K)
    w = None if w is None else pad_to(pad_to(w, -2, M), -1, K)
    qg = pad_to(pad_to(qg, -2, C), -1, K)
    p = pad_to(pad_to(p, -2, C), -1, M)
    s0 = pad_to(pad_to(s0, -2, K), -1, V)
    return x0, w, kd, qg, p, s0


def state_pass_vjp(forward, backward):
    """`core(cfg, x0, w, kd, qg, p, last, s0) -> (o, final state, start states or None)` on the
    kernels' layout, differentiable in every array argument through the kernels' reverse pass.

    forward(cfg, x0, w, kd, qg, p, last, s0, save) -> (o, sT, starts or None): save asks for the
    per-chunk start states. backward(cfg, x0, w, kd, qg, p, last, starts, do, dsT, dstarts)
    -> (dx0, dw or None, dkd, dqg, dp, dlast, ds0). cfg.output_starts (static): whether the
    start states are an output of `core` (their cotangent then joins the reverse pass).
    """
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def core(cfg, x0, w, kd, qg, p, last, s0):
        return forward(cfg, x0, w, kd, qg, p, last, s0, cfg.output_starts)

    def core_fwd(cfg, x0, w, kd, qg, p, last, s0):
        o, sT, starts = forward(cfg, x0, w, kd, qg, p, last, s0, True)
        out = (o, sT, starts if cfg.output_starts else None)
        return out, (x0, w, kd, qg, p, last, starts)

    def core_bwd(cfg, res, cts):
        x0, w, kd, qg, p, last, starts = res
        do, dsT, dstarts = cts
        grads = backward(cfg, x0, w, kd, qg, p, last, starts, do, dsT.astype(F32),
                         None if dstarts is None else dstarts.astype(F32))
        *grads, ds0 = grads
        # s0 is float32 on the kernels' layout (the entries cast it); the rest as their primals.
        return tuple(None if g is None else g.astype(a.dtype)
                     for g, a in zip(grads, (x0, w, kd, qg, p, last))) + (ds0.astype(F32),)

    core.defvjp(core_fwd, core_bwd)
    return core
