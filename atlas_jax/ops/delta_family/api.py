"""Public delta-family ops with the flash-linear-attention signatures.

All of them run one recurrence on a state S in R^{K x V} (float32), per token t:

    S <- exp(g_t) * S                       (scalar gate: all of S; channel gate: row-wise)
    S <- S + beta_t k_t (v_t - S^T k_t)^T   (delta write; linear_attention: S + beta_t k_t v_t^T)
    o_t = S^T (scale q_t)

`run_delta_family` is the one entry: it validates the call (`kernels/delta_family/support.py`
owns every rule and supported size), picks the implementation and runs it. The five
fla-compatible ops below are thin wrappers over it, and the forms call it too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from atlas_jax.kernels.delta_family import support
from atlas_jax.ops.delta_family.chunk import chunk_delta_family
from atlas_jax.ops.delta_family.naive import recurrent_delta_family

IMPLS = support.IMPLS


def _backend():
    return jax.default_backend()


def _on_accelerator():
    return _backend() in ("gpu", "cuda", "rocm", "tpu")


def _pallas_kernel():
    """The kernel for this backend: Mosaic on TPU, the Triton lowering elsewhere (on CPU it runs
    in Pallas interpret mode, which is how CI tests it). Imported here, at trace time, so that
    importing atlas_jax.ops does not import Pallas."""
    if _backend() == "tpu":
        from atlas_jax.kernels.delta_family.tpu import chunk_delta_family_tpu
        return chunk_delta_family_tpu
    from atlas_jax.kernels.delta_family.gpu import chunk_delta_family_gpu
    return chunk_delta_family_gpu


def _kernel_gap(call, q, k, v, chunk_size, delta):
    return support.kernel_gap(call, (q.dtype, k.dtype, v.dtype), chunk_size, delta=delta,
                              interpret=_backend() == "cpu")


def _choose_impl(op, impl, call, q, k, v, chunk_size, delta):
    """"auto": the kernels on GPU/TPU when they cover the call, else the exact XLA chunk form
    (on CPU it beats interpret mode by orders of magnitude). "pallas" when they do not cover
    it: NotImplementedError saying why."""
    if impl == "auto":
        if _on_accelerator() and _kernel_gap(call, q, k, v, chunk_size, delta) is None:
            return "pallas"
        return "chunk"
    if impl == "pallas":
        why = _kernel_gap(call, q, k, v, chunk_size, delta)
        if why is not None:
            raise NotImplementedError(f"{op}: impl='pallas' does not support {why}; use "
                                      f"impl='chunk' or impl='auto'.")
    return impl


def _l2norm(x):
    xf = x.astype(jnp.float32)
    rinv = jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + support.L2NORM_EPS)
    return (xf * rinv).astype(x.dtype)


def _execute(impl, q, k, v, beta, g, *, delta, scale, initial_state, output_final_state,
             chunk_size, cu_seqlens=None, normalize_qk=False, **in_kernel):
    """Runs a validated call with a chosen impl ("recurrent", "chunk" or "pallas"). Grouped
    value heads (v with HV = G * H heads): the kernels read q/k head i // G for value head i;
    the XLA forms repeat q and k per group (autodiff sums their gradients over the group).
    in_kernel: fla's activation arguments for the GPU kernels (impl "pallas" only)."""
    group = v.shape[2] // q.shape[2]
    if group > 1 and impl != "pallas":
        q, k = jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)
    if impl == "pallas":
        return _pallas_kernel()(q, k, v, beta, g, scale=float(scale), initial_state=initial_state,
                                output_final_state=output_final_state, chunk_size=int(chunk_size),
                                cu_seqlens=cu_seqlens, normalize_qk=normalize_qk, **in_kernel)
    if normalize_qk:
        q, k = _l2norm(q), _l2norm(k)
    if cu_seqlens is not None:
        return _execute_packed_xla(impl, q, k, v, beta, g, delta=delta, scale=scale,
                                   initial_state=initial_state,
                                   output_final_state=output_final_state,
                                   chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    if impl == "recurrent":
        return recurrent_delta_family(q, k, v, beta, g, delta=delta, scale=scale,
                                      initial_state=initial_state,
                                      output_final_state=output_final_state)
    return chunk_delta_family(q, k, v, beta, g, delta=delta, scale=scale,
                              initial_state=initial_state,
                              output_final_state=output_final_state, chunk_size=int(chunk_size))


def _execute_packed_xla(impl, q, k, v, beta, g, *, cu_seqlens, initial_state, **kw):
    """Packed sequences through the XLA forms: each sequence becomes a batch row padded with
    k = v = beta = g = 0 (which leaves its state unchanged), so nothing crosses a boundary."""
    cu = np.asarray(cu_seqlens).astype(np.int64)
    lens = np.diff(cu)
    n, width = len(lens), max(int(lens.max()), 1)
    pos = np.arange(width)
    index = np.where(pos[None] < lens[:, None], cu[:-1, None] + pos[None], 0)   # [N, L]
    valid = jnp.asarray(pos[None] < lens[:, None])

    def rows(x):
        if x is None:
            return None
        y = jnp.take(x[0], jnp.asarray(index), axis=0)
        return jnp.where(valid.reshape(valid.shape + (1,) * (y.ndim - 2)), y, jnp.zeros((), y.dtype))

    o, final = _execute(impl, rows(q), rows(k), rows(v), rows(beta), rows(g),
                        initial_state=initial_state, **kw)
    seq = np.repeat(np.arange(n), lens)
    within = np.arange(int(cu[-1])) - np.repeat(cu[:-1], lens)
    return o[jnp.asarray(seq), jnp.asarray(within)][None], final


def _validate(op, q, k, v, beta, g, *, scale, initial_state, impl, chunk_size, cu_seqlens,
              delta, gate_ranks=(3, 4), gate_required=False, steps=False, state_v_first=False):
    """The one checker (support.py), then the impl; returns the arrays (initial_state as
    [.., K, V]), the impl, the scale and the call's sizes."""
    support.check_impl(op, impl)
    support.check_chunk_size(op, chunk_size)
    support.check_scale(op, scale)
    q, k, v, beta, g, s0, cu, call = support.check_delta_call(
        op, q, k, v, beta, g, initial_state, cu_seqlens, gate_ranks=gate_ranks,
        gate_required=gate_required, steps=steps, allow_traced_cu_seqlens=True,
        state_v_first=state_v_first)
    impl = _choose_impl(op, impl, call, q, k, v, chunk_size, delta)
    if cu is not None and impl != "pallas":     # the XLA forms lay out packed rows on the host
        support.require_concrete_cu_seqlens(op, cu, impl)
    scale = 1.0 / math.sqrt(call.K) if scale is None else scale
    return q, k, v, beta, g, s0, cu, impl, scale, call


@functools.partial(jax.jit, static_argnames=("channel", "beta_sigmoid", "neg_eigval",
                                             "lower_bound"))
def _activations(beta, g, A_log, dt_bias, *, channel, beta_sigmoid, neg_eigval, lower_bound):
    """fla's in-kernel activations, in float32 (differentiable in every argument):
      beta <- sigmoid(beta) (2 * sigmoid(beta) with neg_eigval) when beta_sigmoid;
      g <- -exp(A_log) * softplus(g + dt_bias), or for the channel gate with a lower_bound
      lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), when A_log or lower_bound is given
      (g None: unchanged). A_log [HV] (None: 1 for the exp), dt_bias [HV] or [HV, K] or None."""
    if beta_sigmoid:
        beta = support.fused_beta(beta, neg_eigval=neg_eigval)
    if g is not None and (A_log is not None or lower_bound is not None):
        g = support.fused_gate(g, A_log, dt_bias, lower_bound=lower_bound if channel else None)
    return beta, g


def run_delta_family(q, k, v, beta, g=None, *, delta: bool = True, scale=None,
                     initial_state=None, output_final_state=False, impl="auto", chunk_size=64,
                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                     allow_neg_eigval=False, state_v_first=False, safe_gate=False,
                     lower_bound=None):
    """Validates and runs one delta-family recurrence; the entry of the ops and the forms.

    Args:
      q, k: [B, T, H, K]. v: [B, T, HV, V] with HV = G * H (grouped value heads, fla's GVA:
        value head i reads q/k head i // G; HV = H is the plain case). beta: [B, T, HV]
        (None means 1.0).
      g: None (no decay), [B, T, HV] scalar or [B, T, HV, K] per-key-channel log-decay (with
        use_gate_in_kernel: the raw gate input).
      delta: True: the delta write S + beta_t k_t (v_t - S^T k_t)^T; False: linear attention's
        additive write S + beta_t k_t v_t^T (the XLA forms only).
      scale: query scale, default 1/sqrt(K).
      initial_state: [B, H, K, V] ([N, H, K, V] with cu_seqlens) or None (zeros).
      output_final_state: also return the final state.
      impl: one of IMPLS: "recurrent" (float32 scan reference), "chunk" (exact chunked XLA
        form), "pallas" (the kernels: Triton lowering on GPU, Mosaic on TPU, interpret mode on
        CPU) or "auto" (the kernels on GPU/TPU when they cover the call, else "chunk").
      chunk_size: tokens per chunk of the chunked forms (any positive int for "chunk"; the
        kernels take support.CHUNK_SIZES); any T is accepted.
      cu_seqlens: None, or int [N + 1] offsets of N sequences packed along T of a batch of one
        (fla's varlen convention); no state crosses a boundary. Must be concrete for the XLA
        impls.
      use_qk_l2norm_in_kernel: L2-normalise q and k first (x / sqrt(sum x^2 + L2NORM_EPS)),
        inside the kernel for impl="pallas".
      use_gate_in_kernel, A_log, dt_bias: fla's fused gate: g is the raw input and the
        log-decay is -exp(A_log) * softplus(g + dt_bias) (A_log [HV]; dt_bias None, [HV] for
        a scalar gate, [HV * K] for a channel gate), computed in float32 inside the op (the
        GPU kernels of a scalar gate activate it as they load it in a primal call; otherwise one
        XLA pass, which a differentiated call keeps for its backward kernels); gradients reach
        g, A_log and dt_bias.
      safe_gate, lower_bound (channel gate): with use_gate_in_kernel and a lower_bound, the
        log-decay is lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), in [lower_bound, 0)
        (A_log may then be None: exp(A_log) = 1); safe_gate=True needs lower_bound in
        [-5, 0) there. safe_gate is fla's speed hint for its kernels and changes no number
        here (every impl is exact at any gate strength); without use_gate_in_kernel both are
        accepted and unused, as in fla.
      use_beta_sigmoid_in_kernel: beta holds logits; the write strength is sigmoid(beta)
        (float32), or 2 * sigmoid(beta) in [0, 2) with allow_neg_eigval=True (negative
        eigenvalues of the state transition, which requires use_beta_sigmoid_in_kernel).
      state_v_first: initial and final states in the [.., V, K] layout (fla's V-first).

    Returns:
      (o [B, T, HV, V] in v.dtype, final state [B or N, HV, K, V] ([.., V, K] with
      state_v_first) float32 or None).
    """
    return _run_op("run_delta_family", q, k, v, beta, g, delta=delta, scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state,
                   impl=impl, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                   safe_gate=safe_gate, lower_bound=lower_bound)


# what each public op checks its arguments with (_validate's keywords): the ops and runs_kernel read it
_OP_CHECKS = {"delta_rule": dict(delta=True), "linear_attention": dict(delta=False),
              "gated_delta_rule": dict(delta=True, gate_ranks=(3,), gate_required=True),
              "kda": dict(delta=True, gate_ranks=(4,), gate_required=True),
              "delta_product": dict(delta=True, steps=True)}


def runs_kernel(op: str, q, k, v, beta=None, g=None, *, impl="auto", chunk_size=64) -> bool:
    """Whether ``ops.<op>`` called on these arrays with ``impl`` runs the Pallas kernels (what
    impl="auto" picks on this backend). Only the kernels take traced ``cu_seqlens``: a model asks
    this before packing its documents into one varlen row, and lays them out as rows otherwise."""
    if op not in _OP_CHECKS:
        raise ValueError(f"runs_kernel: op must be one of {sorted(_OP_CHECKS)}, got {op!r}")
    chosen = _validate(op, q, k, v, beta, g, scale=None, initial_state=None, impl=impl,
                       chunk_size=chunk_size, cu_seqlens=None, **_OP_CHECKS[op])[7]
    return chosen == "pallas"


def _run_op(op, q, k, v, beta, g, *, delta, scale, initial_state, output_final_state, impl,
            chunk_size, cu_seqlens, use_qk_l2norm_in_kernel, gate_ranks=(3, 4),
            gate_required=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
            safe_gate=False, lower_bound=None):
    q, k, v, beta, g, s0, cu, impl, scale, call = _validate(
        op, q, k, v, beta, g, scale=scale, initial_state=initial_state, impl=impl,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens, delta=delta, gate_ranks=gate_ranks,
        gate_required=gate_required, state_v_first=state_v_first)
    A_log, dt_bias = support.check_fla_args(
        op, call, g, beta, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound)
    in_kernel = {}
    if (use_gate_in_kernel or use_beta_sigmoid_in_kernel) and impl == "pallas" \
            and _backend() != "tpu" and call.gate != "channel":
        # The GPU kernels take the raw scalar gate and beta logits: a primal call's kernels
        # activate them as they load them (fla's fusion), a differentiated call activates them
        # once in XLA for its forward and backward kernels (gpu_launch._core_fwd). KDA's
        # channel gate and the TPU kernels take them activated by XLA below.
        in_kernel = dict(use_gate_in_kernel=bool(use_gate_in_kernel), A_log=A_log,
                         dt_bias=dt_bias, use_beta_sigmoid_in_kernel=bool(
                             use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval))
    elif use_gate_in_kernel or use_beta_sigmoid_in_kernel:
        lb = float(lower_bound) if use_gate_in_kernel and lower_bound is not None else None
        beta, g_act = _activations(
            beta, g if use_gate_in_kernel else None, A_log, dt_bias,
            channel=call.gate == "channel", beta_sigmoid=bool(use_beta_sigmoid_in_kernel),
            neg_eigval=bool(allow_neg_eigval), lower_bound=lb)
        g = g_act if use_gate_in_kernel else g
    o, s = _execute(impl, q, k, v, beta, g, delta=delta, scale=scale, initial_state=s0,
                    output_final_state=output_final_state, chunk_size=chunk_size,
                    cu_seqlens=cu, normalize_qk=use_qk_l2norm_in_kernel, **in_kernel)
    if s is not None and state_v_first:
        s = jnp.swapaxes(s, -1, -2)
    return o, s


# ---------------------------------------------------------------------------------------------
# The fla-compatible ops


def delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
               impl="auto", chunk_size=64, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False):
    """DeltaNet: S <- S + beta_t k_t (v_t - S^T k_t)^T, o_t = S^T (scale q_t).

    Args:
      q, k: [B, T, H, K]. v: [B, T, HV, V] (HV = G * H grouped value heads). beta: [B, T, HV]
      (None means 1.0).
      Others as `run_delta_family` (scale, initial_state, output_final_state, impl, chunk_size,
      cu_seqlens, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
      state_v_first; fla's delta rule has none of the last three, gated_delta_rule's do).

    Returns:
      (o [B, T, HV, V] in v.dtype, final state [B or N, HV, K, V] float32 or None).
    """
    return _run_op("delta_rule", q, k, v, beta, None, **_OP_CHECKS["delta_rule"], scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state,
                   impl=impl, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first)


def gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
                     output_final_state=False, impl="auto", chunk_size=64, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                     dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                     state_v_first=False):
    """Gated DeltaNet: delta_rule with a scalar log-decay g [B, T, HV] applied before each write.

    Arguments and returns as `delta_rule` and `run_delta_family`; g is required (with
    use_gate_in_kernel=True the raw input of g = -exp(A_log) * softplus(g + dt_bias), A_log and
    dt_bias [HV]), as fla's chunk_gated_delta_rule.
    """
    return _run_op("gated_delta_rule", q, k, v, beta, g, **_OP_CHECKS["gated_delta_rule"], scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state,
                   impl=impl, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                   dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        impl="auto", chunk_size=64, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False, state_v_first=False, safe_gate=False, lower_bound=None):
    """Kimi Delta Attention: delta_rule with a per-key-channel log-decay g [B, T, HV, K].

    Arguments and returns as `delta_rule` and `run_delta_family`; g is required (with
    use_gate_in_kernel=True the raw input of g = -exp(A_log) * softplus(g + dt_bias), or
    lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) with a lower_bound; A_log [HV], dt_bias
    [HV * K]), as fla's chunk_kda.
    """
    return _run_op("kda", q, k, v, beta, g, **_OP_CHECKS["kda"], scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state,
                   impl=impl, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                   dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                   safe_gate=safe_gate, lower_bound=lower_bound)


def linear_attention(q, k, v, g=None, beta=None, *, scale=None, initial_state=None,
                     output_final_state=False, impl="auto", chunk_size=64, cu_seqlens=None,
                     use_qk_l2norm_in_kernel=False):
    """Additive write S <- exp(g_t) S + beta_t k_t v_t^T: linear attention, RetNet, Mamba2, GLA.

    g is None (linear attention), [B, T, H] (RetNet with a constant, Mamba2) or [B, T, H, K]
    (GLA); beta [B, T, H] or None (1.0). Other arguments and returns as `delta_rule`.
    """
    return _run_op("linear_attention", q, k, v, beta, g, **_OP_CHECKS["linear_attention"], scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state,
                   impl=impl, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def delta_product(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  impl="auto", chunk_size=64, cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """DeltaProduct: n_h delta steps per token, decay once before the first, read after the last.

    Args:
      q: [B, T, H, K]. k: [B, T, H, n_h, K]. v: [B, T, H, n_h, V].
      g: None, [B, T, H] (scalar log-decay) or [B, T, H, K] (per-channel) applied once per token.
      beta: [B, T, H, n_h] (None means 1.0).
      chunk_size: counts sub-steps (T * n_h of them), not tokens.
      Others as `delta_rule`.

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B, H, K, V] float32 or None).
    """
    q, k, v, beta, g, s0, cu, impl, scale, _ = _validate(
        "delta_product", q, k, v, beta, g, scale=scale, initial_state=initial_state, impl=impl,
        chunk_size=chunk_size, cu_seqlens=cu_seqlens, **_OP_CHECKS["delta_product"])
    B, T, H, n, K = k.shape
    V = v.shape[-1]

    # Expand to T*n_h ordinary delta steps, sub-step axis right after time.
    def flat(x):
        return jnp.moveaxis(x, 3, 2).reshape((B, T * n, H) + x.shape[4:])

    kx, vx = flat(k), flat(v)
    bx = None if beta is None else flat(beta)
    first = jnp.arange(n) == 0
    last = jnp.arange(n) == n - 1
    gx = None
    if g is not None:
        # The token's decay belongs to its first sub-step only.
        sel = first.reshape((1, 1, n, 1) + (1,) * (g.ndim - 3))
        gx = jnp.where(sel, g[:, :, None], jnp.zeros((), g.dtype))
        gx = gx.reshape((B, T * n) + g.shape[2:])
    # Only the last sub-step's output is kept, so q is only needed there.
    qx = jnp.where(last.reshape(1, 1, n, 1, 1), q[:, :, None], jnp.zeros((), q.dtype))
    qx = qx.reshape(B, T * n, H, K)
    if cu is None:
        cu_steps = None
    else:   # offsets in sub-steps
        cu_steps = cu * n if hasattr(cu, "dtype") else np.asarray(cu) * n
    o, s = _execute(impl, qx, kx, vx, bx, gx, delta=True, scale=scale, initial_state=s0,
                    output_final_state=output_final_state, chunk_size=chunk_size,
                    cu_seqlens=cu_steps, normalize_qk=use_qk_l2norm_in_kernel)
    return o.reshape(B, T, n, H, V)[:, :, -1], s
