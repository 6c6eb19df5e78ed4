"""The dual form of the chunk-start scheme: O(T·d) memory for MLP (and linear) memories.

The chunked form takes every gradient of a chunk at the chunk's starting θ₀ (Titans §3.2, TTT's
mini-batch GD, ATLAS §3.3, MIRAS §5). For a memory made of linear maps x ↦ x W joined by
activations, LayerNorm and residuals (``memory.apply_linear``), the gradient of one token's loss
with respect to a weight W is the outer product a δᵀ, a the layer's input and δ the cotangent of its
output, both evaluated at θ₀. Decay, momentum and the Omega window are scalar linear recurrences
over the chunk's steps, so every step's state is

    θ_t[W] = P_t W₀ + c_t m₀[W] + Σ_s M[t, s] a_s δ_sᵀ

with s over the chunk's gradient sources (the b + c − 1 tokens of the extended window when the
gradient point is θ₀; the b·c (step, window position) pairs when it is θ₀ decayed to the step,
forget-first retention P_t θ₀), M a [b, n_sources] coefficient matrix (products of the masked decay
matrices, the step sizes, the momentum and the window weights), P_t the retention's decay from the
chunk start and c_t the carried momentum's coefficient. A read never forms θ_t: layer by layer,

    x θ_t[W] = P_t (x W₀) + c_t (x m₀[W]) + (M ⊙ (x Aᵀ)) D          A = [a_s], D = [δ_s]

(a Gram matrix [b, n_sources] times the δ's), then the memory's activation, LayerNorm and residual.
The chunk-end θ (and momentum) is one matmul per weight. Nothing of size [b, |θ|] exists; the
backward pass is JAX's autodiff with rematerialisation of each chunk and, for a large θ, of each
group of chunks, so what it keeps is O(T·d) activations plus one state per group of chunks
(``BOUNDARY_BYTES_PER_TOKEN``). Where θ's chunk end is linear in the gradients (GD), the grouped
scan forms θ once per ``SUPER_CHUNK`` chunks: a later chunk's gradients are taken at the earlier
chunks' θ₀ plus their low-rank updates, by the same products as a read (`_super_chunk`); the state
is then kept at every super-chunk's start where that fits ``SUPER_CHUNK_BYTES_PER_TOKEN`` (one
level of rematerialisation), else once per group of super-chunks (`_schedule`). Muon
(Newton–Schulz per chunk) runs in super-chunks too: NS of the momentum is taken from its Gram
matrix, carried through the sub-chunks' low-rank updates (`_muon_super_chunk`).

Feature maps: the form takes the raw k and scale·q (``features``, from MemorySpec) and forms φ
chunk by chunk, inside the rematerialised chunk: φ(x) [b, d_φ] only where it meets θ₀ (x W₀, the
momentum) and in the chunk-end update (Aᵀ D). For the layers that read the memory's input itself
(the first layer, a skip map) the Gram matrix is φ(q)·φ(k)ᵀ = κ(q·kᵀ) through the map's kernel
(``FeatureMap.kernel``: Σ_i c_i² (q·k)^i for the polynomial map), d wide rather than d_φ (8385 at
degree 2, d = 128). So the backward pass keeps nothing of size [T, d_φ] either (omeganet at B1 H8
D128 grew by 2.61 MiB per token of compiled temp memory with φ applied to the whole sequence
first, 0.24 with it here; atlas with per-chunk NS 2.83 → 0.46).

Precision: θ, the momentum, φ, the coefficients and every sum are float32; with bf16 q, k, v
(``low_precision``) the products with θ take bf16 operands with float32 accumulation, forward and
backward (`operand_dtype`, `linalg.product`), as the deep-memory kernels' dots do, and φ's rows
(which meet only such products and float32-result Gram matrices) are rounded to bf16 once, where
they are formed (`_OperandFeatures`). Muon's momentum and what meets Newton–Schulz's factor are
float32-accurate products whatever the operands (`MUON_CHUNK_END_PRECISION`, `MUON_CHAIN_PRECISION`).

Covered: memories with ``apply_linear`` whose θ is exactly those weights (LinearMemory, MLPMemory,
GatedMLPMemory); GD, implicit GD, momentum (both conventions) and Muon with ``ns_every="chunk"``;
every objective (``objective.output_grad`` is per token); the Omega window with per-token or
per-position gates; no or scalar decay, decoupled or forget-first; retention maps applied at chunk
ends (``map_at="chunk_end"``). Not covered (the materialising form runs them): channel-wise knobs,
channel decay, per-token Newton–Schulz, other optax transforms, least squares, per-token maps.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from atlas_jax import optimizers as inner_opt
from atlas_jax.features import pad_features
from atlas_jax.linalg import product
from atlas_jax.forms.common import (
    MemoryState,
    Steps,
    WindowCache,
    decay_matrix,
    restarted,
    restarting_chunks,
    safe_log,
)

__all__ = ["BOUNDARY_BYTES_PER_TOKEN", "GROUP_TOKENS", "covers", "dual_batched_kernel", "dual_sequence",
           "kernel_gap", "keeps_every_chunk_state", "state_bytes"]

# The backward pass keeps the state (θ and the optimizer state) at every chunk boundary while that
# costs at most BOUNDARY_BYTES_PER_TOKEN per token (per sequence and head: titans at D = 128 and
# chunk 64, 1 MiB of θ and momentum, 16 KiB per token); a larger state is kept once per super-chunk
# (SUPER_CHUNK_BYTES_PER_TOKEN, below) or once per group of about GROUP_TOKENS tokens, and the
# backward pass holds one state per chunk of the group it is in (two-level rematerialisation).
# Keeping a fixed group length, rather than √(number of chunks), makes the memory kept per token
# independent of T.
BOUNDARY_BYTES_PER_TOKEN = 16 * 1024
GROUP_TOKENS = 1024
# Chunks per iteration of the scan that keeps every chunk's state. XLA copies the carried state
# (θ and the momentum) at the start of every loop iteration (a copy per carried array, also in a
# ten-line scan with a checkpointed body), so fewer, longer iterations copy it less often.
# titans B4 T4096 H8 D128 float32 fwd+bwd on an H200, interleaved in one command: 41.6 ms at 1,
# 39.4 at 2, 38.5 at 4 (peak memory +0.23 GiB, compile +3 s). Sequences of fewer than
# UNROLL_MIN_CHUNKS chunks keep one chunk per iteration (the longer body costs compile time there
# and saves little).
CHUNK_UNROLL = 4
UNROLL_MIN_CHUNKS = 16
# φ's width is padded with zero features to a multiple of FEATURE_ALIGN inside the form (the
# first layer's rows of θ and of the optimizer state, and the window cache, with zero rows), and
# the final state sliced back. The outputs and states are exactly the same (a zero feature meets
# only zero rows, its gradient rows are zero, NS and norms see zeros), but degree-2 features at
# d = 128 are 8385 wide, and at that odd width the GPU pads θ [8385, h] for every product. Only
# where the padding adds at most FEATURE_PAD_MAX_FRACTION of the width (not at small test widths).
# B1 T1024 H8 D128 bf16 fwd+bwd on an H200, interleaved in one command: omeganet 56.8 -> 45.1 ms,
# atlas (NS per chunk) 217.9 -> 190.2.
FEATURE_ALIGN = 128
FEATURE_PAD_MAX_FRACTION = 1 / 16
# In the grouped scan the backward pass evaluates a chunk three times: the forward, the group's
# rematerialised forward (for the chunks' start states) and the chunk's own rematerialisation (for
# its residuals); twice with super-chunks kept at their start (SUPER_CHUNK_BYTES_PER_TOKEN), where
# the forward takes the group's part below. The group's rematerialised forward therefore keeps the
# chunk's products with θ that are not θ-sized (CHUNK_RESIDUAL, jax.ad_checkpoint.checkpoint_name:
# the first layer's [n + b, h] products, the later layers' inputs and every layer's output
# cotangents), so the chunk's rematerialisation skips them (above all the first layer's [n + b, d_φ]
# × [d_φ, h]); φ itself is recomputed (cheap, and [n, d_φ] a chunk). Nothing θ-sized is kept:
# Newton–Schulz's iterates are recomputed. B1 T1024 H8 D128 bf16 fwd+bwd on an H200, interleaved in
# one command: omeganet 41.3 -> 36.2 ms, atlas 176.0 -> 177.9 (Newton–Schulz dominates it); compiled
# memory at B1 T4096 +0.08 GiB (omeganet). Newton–Schulz's norm and Gram matrices (n × n) are kept
# too (`newton_schulz`'s ``residual_name``, where it is measured).
CHUNK_RESIDUAL = "dual_chunk_residual"
# Chunks per θ formed in the grouped scan where the chunk end is linear in the chunk's gradients
# (GD; `_super_chunk`): chunk k of a super-chunk takes its gradients at θ_B plus the low-rank
# updates of the chunks before it (the dual form's reads at one step), so θ-sized work — the chunk
# end's product and decay, the scan's copies of the carried θ, the kept states and their
# cotangents — is done once per SUPER_CHUNK chunks. The chunk-start scheme is unchanged. The
# corrections' Gram matrices go through φ's kernel (d wide), so longer super-chunks stay cheap.
# With the chain of a depth-2 MLP (`_chain`), B1 T4096 H8 D128 bf16 fwd+bwd on an H200, three
# trees interleaved in one command: omeganet 80.3 ms (the per-sub-chunk loop, 4) -> 73.9 (the
# chain, 4) -> 68.8 (the chain, 8); dla 49.0 -> 46.3 -> 41.6. XLA on the CPU compiles omeganet's
# layer there in 29 s at 8 against 15 at 4, and its memory grows 2.84 -> 2.95 GiB
# (benchmarks/results/dual_chain_h200_2026-11-28.md).
SUPER_CHUNK = 8
# Where super-chunks apply, the backward pass keeps the state at every super-chunk's start (one
# level of rematerialisation: a super-chunk is evaluated twice, the forward and its own
# rematerialisation, which reads the residuals the forward named) while that costs at most
# SUPER_CHUNK_BYTES_PER_TOKEN per token, per sequence and head; a larger state is kept once per
# group of GROUP_TOKENS (two levels: three evaluations, the group's rematerialised forward between).
# omeganet (D 128, d_φ 8448: 42 KiB a token at super-chunks of 512 tokens), dla (34) and atlas (θ
# and momentum, 84) fit it; atlas_pp (its gated MLP's two wide weights and their momentum, 150)
# keeps two levels, which holds its compiled memory near atlas' (the bound is what a token may cost
# at H8 D128: under 1 MiB with the rest of the layer, as tests/test_dual_form.py holds omeganet and
# atlas to). H200, bf16 fwd+bwd, two trees interleaved in one command each: omeganet B1 T4096 50.16
# -> 39.14 ms (×0.780), B4 T4096 149.4 -> 116.8 (×0.782); dla B1 T4096 ×0.797; atlas B1 T4096 535.5
# -> 434.4 (×0.811), B4 T4096 ×0.801. XLA's compiled memory at B4 T4096 10.5 -> 12.9 GiB (omeganet),
# 28.5 -> 33.9 (atlas); atlas at B1 T65536 6.94 s (8.51 s grouped) at 66.3 GiB measured peak (30.7
# grouped), its gradients as close to the float32 reference as the grouped scan's
# (benchmarks/results/dual_super_chunks_kept_h200_2026-11-30.md). Super-chunks of 16 chunks kept
# alike were slower (×0.830 / ×0.827 at B4 T4096) and took more memory.
SUPER_CHUNK_BYTES_PER_TOKEN = 128 * 1024
# The precision of Muon's chunk-end momentum product, forward and backward (`chunk_end`, which says
# why it must not be rounded like the other products): three bf16 tensor-core passes (each operand
# split into a bf16 head and tail, float32 accumulation; float32 on a CPU). atlas B1 T16384 H8
# D128 bf16 q, k, v on an H200, max |dk| of the first 2048 tokens (float32 at HIGHEST: 0.81): this
# 0.44, HIGHEST 0.49, TF32×3 0.52, bf16×6 0.46; one command at B1 T4096, forward+backward: HIGHEST
# 666.2 ms, this 630.6 (×0.947), TF32×3 658.4, bf16×6 659.4
# (benchmarks/results/atlas_chunk_end_algorithms_h200_2026-11-30.md).
MUON_CHUNK_END_PRECISION = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
# jax.named_scope names of the kernel route's three parts: a profile of a call attributes its
# kernels to them (benchmarks/deep_memory.py --trace).
# The fused per-chunk scan's parts likewise (Newton–Schulz first: it is inside the chunk end).
SCOPES = {"terms": "dual_terms", "state_pass": "dual_state_pass", "reads": "dual_reads",
          "newton_schulz": "dual_newton_schulz", "chunk_terms": "dual_chunk_terms",
          "chunk_source": "dual_chunk_source", "chunk_end": "dual_chunk_end", "chunk_read": "dual_chunk_read"}


def _linear_layers(memory, params, d_in):
    """(the weights that multiply the memory's input itself, every weight used) when ``apply_linear``
    runs on a d_in-wide input with weights of these shapes (arrays or ShapeDtypeStructs), else None."""
    first, used = set(), set()

    def run(x):
        def matmul(key, h):
            used.add(key)
            if h is x:
                first.add(key)
            return h @ jnp.zeros(params[key].shape, jnp.float32)
        return memory.apply_linear(x, matmul)

    try:
        jax.eval_shape(run, jax.ShapeDtypeStruct((1, d_in), jnp.float32))
    except (NotImplementedError, KeyError):   # no linear layers; a weight that is not in params
        return None
    return frozenset(first), frozenset(used)


def _memory_has_linear_layers(memory, params, d_in) -> bool:
    """Whether the memory exposes ``apply_linear`` and θ is exactly the weights it multiplies by."""
    layers = _linear_layers(memory, params, d_in)
    return layers is not None and layers[1] == set(params)


def covers(spec, state: MemoryState, steps: Steps, *, d_in: int | None = None) -> bool:
    """Whether the dual form runs ``spec`` on these steps (one sequence and head); ``d_in`` is the
    memory's input width when the steps carry raw keys (φ applied by the form), else their width."""
    opt_info = inner_opt.info(spec.optimizer)
    retention = spec.retention
    if opt_info.kind not in ("gd", "implicit_gd", "momentum", "muon"):
        return False
    if opt_info.kind == "muon" and opt_info.ns_every != "chunk":
        return False
    if retention.decay == "channel" or (retention.has_map and retention.map_at != "chunk_end"):
        return False
    knobs = (steps.step_size, steps.momentum_decay, steps.log_decay)
    if any(k is not None and k.ndim != 1 for k in knobs):   # channel-wise [S, d] knobs
        return False
    if not isinstance(state.params, dict) or any(jnp.ndim(w) != 2 for w in state.params.values()):
        return False
    return _memory_has_linear_layers(spec.memory, state.params, d_in or steps.inputs.shape[-1])


def _chunk_index(chunk_size, window):
    return jnp.arange(chunk_size)[:, None] + jnp.arange(window)[None, :]


class ChunkTerms(NamedTuple):
    """What a chunk of the dual form needs that does not read θ: its gradient sources, the
    coefficient matrices of the decay, step sizes, momentum and Omega window, and (with a feature
    map) the first layer's Gram matrix. All of it is chunk-parallel."""

    queries: jax.Array          # φ(scale·q)  [b, d_φ]
    src_inputs: jax.Array       # the gradient sources' inputs φ(k)  [n, d_φ]
    src_targets: jax.Array      # [n, d_out]
    src_delta: Any              # [n, d_out] or None
    src_scale: Any              # [n] (forget-first: the source's decay from the chunk start) or None
    first_gram: Any             # φ(q)·φ(k_s) [b, n] through φ's kernel, or None
    from_start: jax.Array       # P_t  [b]
    state_rows: jax.Array       # M [b, n]: θ_t = P_t θ₀ + state_carry_t m₀ + Σ_s M[t, s] a_s δ_sᵀ
    state_carry: Any            # [b] or None
    momentum_rows: Any          # the chunk-end momentum's rows [n] or None
    momentum_carry: Any         # the chunk-end momentum's coefficient of m₀ (scalar) or None
    total_step: Any             # Σ_i (P_b/P_i) β_i (Muon per chunk) or None
    reads_end: jax.Array        # [b] 1 where step t reads the chunk-end state (a map or Muon), else 0
    next_window: Any            # the window cache after the chunk (WindowCache) or None


def chunk_terms(spec, opt_info, features, xc: Steps, win: WindowCache | None, raw_window=None,
                rows=None) -> ChunkTerms:
    """The θ-free part of one chunk (``win``: the previous c − 1 steps, φ(k) already applied;
    ``raw_window``: all c − 1 of their raw k where known, for φ's kernel; ``rows``: (the window's
    and the chunk's φ(k) [b + c − 1, d_φ] (``win``'s first), φ(scale·q) [b, d_φ]) where the caller
    formed them, `_super_chunk_rows`)."""
    retention = spec.retention
    c, b = spec.window, xc.active.shape[0]
    active = xc.active
    if rows is None:
        inputs = xc.inputs if features is None else features(xc.inputs)       # φ(k)      [b, d_φ]
        queries = xc.queries if features is None else features(xc.queries)    # φ(scale·q) [b, d_φ]
        window_inputs = None if win is None else jnp.concatenate([win.inputs.astype(inputs.dtype), inputs])
    else:
        window_inputs, queries = rows
        inputs = window_inputs[window_inputs.shape[0] - b:]

    # The Omega window over the chunk extended by the previous c − 1 steps (as the materialising form).
    gates = xc.gates * active
    ext = {"inputs": inputs, "targets": xc.targets, "weights": gates, "delta": xc.delta}
    if win is not None:
        ext = {"inputs": window_inputs,
               "targets": jnp.concatenate([win.targets, xc.targets]),
               "weights": jnp.concatenate([win.weights, gates]),
               "delta": None if xc.delta is None else jnp.concatenate([win.delta, xc.delta])}
    window_index = _chunk_index(b, c)
    weights = ext["weights"][window_index] * active[:, None]   # [b, c]; padding takes no gradient
    if xc.window_gates is not None:
        weights = weights * xc.window_gates

    decays = retention.decay != "none" and xc.log_decay is not None
    log_decay = jnp.where(active > 0, xc.log_decay, 0.0) if decays else jnp.zeros((b,), jnp.float32)
    from_start = jnp.exp(jnp.cumsum(log_decay))      # P_t
    within = decay_matrix(log_decay)                 # P_t / P_i for i ≤ t, 0 above

    # Gradient sources and G[t, s], the weight of source s in step t's gradient.
    decayed_point = decays and not retention.decoupled
    if decayed_point:   # forget-first: step t's gradient at P_t θ₀, a forward pass per (t, window position)
        pick = lambda x: None if x is None else x[window_index].reshape((b * c,) + x.shape[1:])
        src_inputs, src_targets, src_delta = pick(ext["inputs"]), pick(ext["targets"]), pick(ext["delta"])
        src_scale = jnp.repeat(from_start, c)
        gradient_weights = (jnp.eye(b, dtype=jnp.float32)[:, :, None] * weights[None]).reshape(b, b * c)
    else:               # every gradient at θ₀: one forward pass per token of the extended window
        src_inputs, src_targets, src_delta = ext["inputs"], ext["targets"], ext["delta"]
        src_scale = None
        one_hot = jax.nn.one_hot(window_index, b + c - 1, dtype=jnp.float32)   # [b, c, b + c − 1]
        gradient_weights = jnp.einsum("TC,TCS->TS", weights, one_hot)

    # The first layer's Gram matrix φ(q_t)·φ(k_s) through φ's kernel of q·k (d wide, not d_φ): the
    # chunk's own keys from the raw steps, the window cache's (already φ(k)) as a product.
    first_gram = None
    if features is not None and features.has_kernel:
        first_gram = features.gram(xc.queries, xc.inputs)                         # [b, b]
        if win is not None:   # [b, b + c − 1]
            cached = (rows_gram(queries, win.inputs) if raw_window is None
                      else features.gram(xc.queries, raw_window))
            first_gram = jnp.concatenate([cached, first_gram], axis=1)
        if decayed_point:
            first_gram = first_gram[:, window_index.reshape(-1)]                  # [b, b·c]

    # Coefficients: u_t = Σ_s U[t, s] a_s δ_sᵀ + carry_u[t] m₀; the momentum m_t likewise.
    beta = xc.step_size if xc.step_size is not None else jnp.full((b,), opt_info.step_size, jnp.float32)
    beta = beta * active
    momentum_rows, momentum_carry, carry_u = None, None, None
    if opt_info.kind == "gd":
        update_rows = -beta[:, None] * gradient_weights
    elif opt_info.kind == "implicit_gd":
        window_inputs = ext["inputs"][window_index].astype(jnp.float32)
        sq_norm = jnp.sum(weights * jnp.sum(jnp.square(window_inputs), axis=-1), axis=-1)
        effective = beta / (1.0 + beta * sq_norm)
        update_rows = -effective[:, None] * gradient_weights
    else:
        nu = xc.momentum_decay if xc.momentum_decay is not None else jnp.full((b,), opt_info.momentum_decay, jnp.float32)
        log_nu = safe_log(jnp.where(active > 0, nu, 1.0))   # padding keeps m
        momentum_carry = jnp.exp(jnp.cumsum(log_nu))
        if opt_info.step_inside:   # Titans: S_t = ν_t S_{t−1} − β_t ∇, updates = S_t
            momentum_rows = -(decay_matrix(log_nu) @ (beta[:, None] * gradient_weights))
            update_rows = active[:, None] * momentum_rows
            carry_u = active * momentum_carry
        else:                      # m_t = ν_t m_{t−1} + ∇, updates = −β_t m_t (Muon: NS at the chunk end)
            momentum_rows = decay_matrix(log_nu) @ gradient_weights
            update_rows = -beta[:, None] * momentum_rows
            carry_u = -beta * momentum_carry
    next_window = None
    if win is not None:
        keep = lambda x: x[-(c - 1):]
        next_window = WindowCache(keep(ext["inputs"]).astype(win.inputs.dtype), keep(ext["targets"]),
                                  keep(ext["weights"]), win.delta if ext["delta"] is None else keep(ext["delta"]))
    last = b - 1
    reads_end = jnp.zeros((b,), jnp.float32)
    if retention.has_map or opt_info.kind == "muon":
        # The chunk-end state is not the linear one: the chunk's last step reads it. Only the
        # last position: a sequence that ends inside a chunk ends on a real step that a longer
        # sequence reads mid-chunk, and its output must not depend on what follows (the state
        # returned there is still the chunk-end one, `chunk_end`).
        reads_end = (jnp.arange(b) == last).astype(jnp.float32)
    return ChunkTerms(
        queries=queries, src_inputs=src_inputs, src_targets=src_targets, src_delta=src_delta,
        src_scale=src_scale, first_gram=first_gram, from_start=from_start,
        state_rows=within @ update_rows, state_carry=None if carry_u is None else within @ carry_u,
        momentum_rows=None if momentum_rows is None else momentum_rows[last],
        momentum_carry=None if momentum_carry is None else momentum_carry[last],
        total_step=(within[last] @ beta) if opt_info.kind == "muon" else None,
        reads_end=reads_end, next_window=next_window)


def operand_dtype(low_precision: bool):
    """The dtype θ's products take their operands in: bf16 for bf16 q, k, v (``low_precision``, as
    `MemorySpec` decides it: bf16 tensor-core products with float32 accumulation and results, as the
    deep-memory kernels take them), else None (float32 operands at JAX's default precision). θ, the
    momentum, the Gram matrices and every sum stay float32 (φ's rows: `_OperandFeatures`). bf16
    q/k/v, B1 T1024 H8 D128 fwd+bwd on an H200, interleaved in one command: omeganet 27.82 -> 24.32
    ms, atlas 177.5 -> 168.6; titans (B4 T4096, its reads) 21.23 -> 21.08
    (benchmarks/results/deep_memory_h200_2026-11-27e.md)."""
    return jnp.dtype(jnp.bfloat16) if low_precision else None


def rows_gram(x, y):
    """x yᵀ [n, m] of rows x [n, d], y [m, d] with a float32 result, on operands of their promoted
    dtype (φ's rows are bf16 with `operand_dtype` bf16: `_OperandFeatures`)."""
    return product(x, y, "nt", jnp.promote_types(x.dtype, y.dtype))


def outer_product(x, g, operands=None, precision=None):
    """xᵀ g [d, h] for rows x [n, d] and g [n, h] (a chunk-end update), formed as it is stored."""
    return product(x, g, "tn", operands, precision=precision)


def weight_product(x, w, operands=None):
    """x @ w [n, h] for a weight w [d, h], whose cotangent xᵀ g is formed [d, h] as it is stored
    (`linalg.product`). Both operands 2-D (vmap for leading axes). ``operands``: the dtype the products
    (this one and the backward's two) take their operands in (`operand_dtype`)."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"weight_product: arguments `x` [n, d] and `w` [d, h] must be 2-D (vmap over "
                         f"leading axes); got shapes {tuple(x.shape)} and {tuple(w.shape)}.")
    return product(x, w, "nn", operands)


def first_layer_keys(memory, params, width: int) -> frozenset:
    """The weights that multiply the memory's input itself (the first layer, a skip map)."""
    layers = _linear_layers(memory, params, width)
    return frozenset() if layers is None else layers[0]


def _join_rows(pieces):
    """jnp.concatenate(pieces) along rows, written piece by piece into one buffer (in-place
    dynamic-update-slices). `first_layer_products` joins a super-chunk's φ rows (omeganet at B4
    T4096: twelve pieces into [32, 524, 8448] bf16), where XLA's concatenate fusion took 0.67 ms a
    join; the layer's fwd+bwd 216.6 -> 200.3 and 216.0 -> 199.7 ms (H200, two commands). Where
    `_LowRankStart` joins its sources' inputs it lost (216.0 -> 219.4): not used there."""
    out = jnp.zeros((sum(p.shape[0] for p in pieces),) + pieces[0].shape[1:], jnp.result_type(*pieces))
    lo = 0
    for piece in pieces:
        out = jax.lax.dynamic_update_slice_in_dim(out, piece.astype(out.dtype), lo, 0)
        lo += piece.shape[0]
    return out


def first_layer_products(spec, params0, terms: ChunkTerms, *more: ChunkTerms, extra=None, operands=None,
                         rows=None):
    """The sources' and the queries' products with every first-layer weight, one matmul each
    ({key: ([n, ·], [b, ·])}): θ's widest rows are read once a chunk rather than twice, and the
    backward pass forms their cotangent in one product rather than two and a sum. omeganet and
    atlas (first layer [8448, 512] per head), B1 T1024 H8 D128 bf16 fwd+bwd on an H200,
    interleaved in one command: 42.2 -> 40.3 ms and 182.1 -> 178.6. With ``more`` chunks' terms
    (`_super_chunk`), all of them in the same matmul; then a list of such dicts, one per chunk.
    ``extra``: {name: [d, m]} further matrices the same rows multiply (entries of the dicts too).
    ``operands``: `operand_dtype`'s. ``rows``: the rows already joined as this joins them, every
    chunk's sources first, then every chunk's queries (`_super_chunk_rows`)."""
    chunks = (terms,) + more
    pieces = [t.src_inputs for t in chunks] + [t.queries.astype(t.src_inputs.dtype) for t in chunks]
    edges = [0]
    for piece in pieces:
        edges.append(edges[-1] + piece.shape[0])
    both = _join_rows(pieces) if rows is None else rows
    outs = [{} for _ in range(1 + len(more))]
    weights = {key: params0[key] for key in first_layer_keys(spec.memory, params0, terms.src_inputs.shape[-1])}
    for key, w in {**weights, **(extra or {})}.items():
        if key.startswith(MOMENTUM_OF):   # (its products meet R: `_muon_super_chunk`)
            joint = product(both, w, "nn", None, precision=MUON_CHAIN_PRECISION)
        else:
            joint = weight_product(both, w, operands)
        parts = [joint[lo:hi] for lo, hi in zip(edges[:-1], edges[1:])]
        for out, src, queries in zip(outs, parts[:len(chunks)], parts[len(chunks):]):
            out[key] = (src, queries)
    return outs if more else outs[0]


def source_pass(spec, params0, terms: ChunkTerms, first_products=None, product=None, operands=None):
    """Every gradient source through the memory at θ₀ (decayed per source when forget-first): the
    layer inputs a_s and the output cotangents δ_s of every weight, {key: [n, ·]} each.
    ``first_products``: `first_layer_products` (the sources' part is used here). ``product``:
    (key, h) ↦ h θ₀[key] where θ₀ is not ``params0`` itself (`_LowRankStart`; ``params0`` then
    gives the weights' shapes). ``operands``: `operand_dtype`'s."""
    product = product or (lambda key, h: weight_product(h, params0[key], operands))

    def tapped(offsets):
        layer_inputs = {}

        def matmul(key, h):
            layer_inputs[key] = h
            if first_products is not None and key in first_products and h is terms.src_inputs:
                y = first_products[key][0]
            else:
                y = product(key, h)
            if terms.src_scale is not None:
                y = terms.src_scale[:, None] * y
            return y + offsets[key]

        return spec.memory.apply_linear(terms.src_inputs, matmul), layer_inputs

    n_sources = terms.src_inputs.shape[0]
    offsets = {key: jnp.zeros((n_sources, w.shape[1]), jnp.float32) for key, w in params0.items()}
    preds, pullback, layer_inputs = jax.vjp(tapped, offsets, has_aux=True)
    (cotangents,) = pullback(spec.objective.output_grad(preds, terms.src_targets, terms.src_delta).astype(preds.dtype))
    return layer_inputs, cotangents


def chunk_end(spec, opt_info, carry: MemoryState, terms: ChunkTerms, layer_inputs, cotangents,
              operands=None) -> MemoryState:
    """The state after the chunk (θ, momentum, accumulator; the window cache is the caller's)."""
    retention = spec.retention
    params0, opt_state, acc0, _ = carry
    momentum0 = None if terms.momentum_rows is None else opt_state.momentum

    def at_end(rows, carry_coefficient, start, start_factor, operands=operands, precision=None):
        """Σ_s rows[s] a_s δ_sᵀ + carry·m₀ + factor·start, one matmul per weight."""
        out = {}
        for key in params0:
            value = outer_product(layer_inputs[key], rows[:, None] * cotangents[key], operands, precision)
            if start is not None:
                value = value + start_factor * start[key]
            if carry_coefficient is not None:
                value = value + carry_coefficient * momentum0[key]
            out[key] = value
        return out

    base0 = acc0 if retention.has_map else params0
    decay_end = terms.from_start[-1]
    new_momentum = None
    if terms.momentum_rows is not None:
        # Before Newton–Schulz (Muon) the update is an exact float32 product, forward and backward,
        # whatever ``operands`` says. NS's derivative is up to a⁵ ≈ 480 on the momentum's
        # near-null directions, so the cotangent it hands back is large exactly where the chunk's
        # rows annihilate it; a rounded cotangent in that product leaks a fraction of it into the
        # rows' cotangents, and the backward grows chunk after chunk. atlas (NS per chunk) B1 T16384
        # H8 D128 bf16 q, k, v, β = 1e-3·sigmoid, max |dk| of the first 2048 tokens on an H200
        # (float32 at HIGHEST: 0.74): bf16 operands 5.6e12 (non-finite at T65536); float32 at the
        # default precision (TF32) 3.2, its error against HIGHEST doubling every 32 chunks; HIGHEST
        # 0.39. What remains is the layer's own conditioning: float32 on bf16-rounded q, k, v moves
        # dk as much (benchmarks/results/atlas_backward_growth_h200_2026-11-29.md). Three bf16
        # passes do as well as HIGHEST, at less cost (MUON_CHUNK_END_PRECISION).
        exact = opt_info.kind == "muon"
        new_momentum = at_end(terms.momentum_rows, terms.momentum_carry, None, None,
                              operands=None if exact else operands,
                              precision=MUON_CHUNK_END_PRECISION if exact else None)
    if opt_info.kind == "muon":   # ns_every="chunk": the chunk's steps along NS of the chunk-end momentum
        with jax.named_scope(SCOPES["newton_schulz"]):
            direction = inner_opt.orthogonalize(new_momentum, opt_info, residual_name=CHUNK_RESIDUAL)
        acc_end = jax.tree.map(lambda a0, n: decay_end * a0 - terms.total_step * n, base0, direction)
    else:
        carry_end = None if terms.state_carry is None else terms.state_carry[-1]
        acc_end = at_end(terms.state_rows[-1], carry_end, base0, decay_end)
    params_end = retention.map(acc_end) if retention.has_map else acc_end
    new_opt_state = opt_state if new_momentum is None else inner_opt.MomentumState(new_momentum)
    return MemoryState(params_end, new_opt_state, acc_end if retention.has_map else None, carry.window)


def chunk_read(spec, params0, momentum0, params_end, terms: ChunkTerms, layer_inputs, cotangents,
               first_products=None, product=None, operands=None, momentum_product=None, end_product=None):
    """o_t = M_{θ_t}(φ(q_t)) for the chunk's steps without forming θ_t (the module docstring's
    layer-by-layer product); steps that read the chunk-end state (``reads_end``) read ``params_end``.
    ``first_products``: `first_layer_products` (the queries' part is used here). ``product``: as
    `source_pass`'s (without momentum); ``momentum_product`` and ``end_product`` likewise (key, h) ↦
    h m₀[key] and h θ_end[key] where ``momentum0`` / ``params_end`` are not formed (`_muon_super_chunk`).
    ``operands``: `operand_dtype`'s."""
    queries = terms.queries
    product = product or (lambda key, h: weight_product(h, params0[key], operands))
    momentum_product = momentum_product or (lambda key, h: weight_product(h, momentum0[key], operands))
    end_product = end_product or (lambda key, h: weight_product(h, params_end[key], operands))

    def read(key, h):
        if first_products is not None and key in first_products and h is queries:
            y = terms.from_start[:, None] * first_products[key][1]
        else:
            y = terms.from_start[:, None] * product(key, h)
        if terms.state_carry is not None:
            y = y + terms.state_carry[:, None] * momentum_product(key, h)
        # A layer that takes the memory's input itself (the first layer, a skip map) meets φ(k).
        first = terms.first_gram is not None and h is queries
        gram = terms.first_gram if first else rows_gram(h, layer_inputs[key])
        return y + (terms.state_rows * gram) @ cotangents[key]

    outputs = spec.memory.apply_linear(queries, read)
    if spec.retention.has_map or inner_opt.info(spec.optimizer).kind == "muon":
        at_end = spec.memory.apply_linear(queries, end_product)
        outputs = jnp.where((terms.reads_end > 0)[:, None], at_end, outputs)
    return outputs


def _kept(tree):
    """``tree`` named CHUNK_RESIDUAL (kept by the grouped scan's rematerialised chunks)."""
    return jax.tree.map(lambda x: checkpoint_name(x, CHUNK_RESIDUAL), tree)


def _kept_sources(spec, params0, terms: ChunkTerms, first_products, product=None, operands=None):
    """`source_pass` with the chunk's non-θ-sized products named CHUNK_RESIDUAL: (first products,
    layer inputs, cotangents); φ itself (the first layer's input) is not kept."""
    first_products = _kept(first_products)
    layer_inputs, cotangents = source_pass(spec, params0, terms, first_products, product=product, operands=operands)
    layer_inputs = {key: h if key in first_products else _kept(h) for key, h in layer_inputs.items()}
    return first_products, layer_inputs, _kept(cotangents)


def _one_chunk(spec, opt_info, features, carry: MemoryState, xc: Steps, padding_chunks=True,
               terms: ChunkTerms | None = None, operands=None):
    """One chunk of b steps in the dual form; returns (state after it, outputs [b, d_out]).

    With ``features`` the steps carry raw k and scale·q, and φ is formed here, chunk-locally.
    ``padding_chunks``: whole chunks of padding may occur (they must leave the state alone).
    ``terms``: the chunk's θ-free terms when the caller formed them (`_split_terms`). ``operands``:
    `operand_dtype`'s."""
    if terms is None:
        with jax.named_scope(SCOPES["chunk_terms"]):
            terms = chunk_terms(spec, opt_info, features, xc, carry.window)
    with jax.named_scope(SCOPES["chunk_source"]):
        first_products, layer_inputs, cotangents = _kept_sources(
            spec, carry.params, terms, first_layer_products(spec, carry.params, terms, operands=operands),
            operands=operands)
    with jax.named_scope(SCOPES["chunk_end"]):
        new_state = chunk_end(spec, opt_info, carry, terms, layer_inputs, cotangents, operands)
    momentum0 = None if terms.momentum_rows is None else carry.opt_state.momentum
    with jax.named_scope(SCOPES["chunk_read"]):
        outputs = chunk_read(spec, carry.params, momentum0, new_state.params, terms, layer_inputs, cotangents,
                             first_products, operands=operands)
    new_state = new_state._replace(window=terms.next_window)
    if padding_chunks:
        # Whole chunks of padding (added to fill the last rematerialisation group) leave the state
        # alone. Without them the select is skipped: it reads and writes the whole state (θ and
        # the momentum) once more per chunk, and again in the backward pass.
        any_real = jnp.any(xc.active > 0)
        new_state = jax.tree.map(lambda new, old: jnp.where(any_real, new, old), new_state, carry)
    return new_state, outputs


CACHED_WINDOW = "_cached_window"   # `_super_chunk`'s extra product in `first_layer_products` (not a weight)


def _first_gram(kernel, inputs, raws, phi, raw, n_cached, cached_gram=None):
    """φ(x)·φ(k_s) [rows, Σ n_s] of rows x with the sources of earlier sub-chunks (``inputs``: their
    φ rows, ``raws``: their raw k or None): ``phi`` the rows' φ, ``raw`` the raw inputs of all but
    their first ``n_cached`` (or None); ``cached_gram``: φ(x)·φ(k_s) for the first sub-chunk's
    window rows (the entering window cache, φ alone), formed with the products with θ_B. Through
    φ's ``kernel`` where both rows' raw inputs are known."""
    blocks = []
    for index, (a, raw_s) in enumerate(zip(inputs, raws)):
        if kernel is None or raw is None or raw_s is None:
            blocks.append(rows_gram(phi, a))
            continue
        cached_s = a.shape[0] - raw_s.shape[0]
        block = kernel.gram(raw, raw_s)
        if cached_s:
            use = cached_gram is not None and index == 0 and n_cached == 0
            cached = cached_gram if use else rows_gram(phi[n_cached:], a[:cached_s])
            block = jnp.concatenate([cached, block], axis=1)
        if n_cached:
            block = jnp.concatenate([rows_gram(phi[:n_cached], a), block], axis=0)
        blocks.append(block)
    return jnp.concatenate(blocks, axis=1)


class _LowRankStart:
    """A sub-chunk's start θ₀ = p θ_B + Σ_s w_s a_s δ_sᵀ without forming it: θ_B the super-chunk's
    start, (a_s, δ_s) the layer inputs and output cotangents of the sub-chunks before
    (`source_pass`), w_s their weights in θ₀ and p the decay since θ_B. Its products
    x θ₀[W] = p (x θ_B[W]) + ((x Aᵀ) ⊙ w) D are the dual form's reads at one step, over every earlier
    source at once (A, D, w concatenated). For the weights that take the memory's input itself the
    Gram matrix x Aᵀ = φ(x)·φ(k_s) goes through φ's kernel where both rows' raw inputs are known
    (d wide; `features.gram`); only the entering window cache's c − 1 rows (their raw k are gone)
    meet φ itself, in the products `_super_chunk` forms with θ_B's (and, with chunks shorter than
    the window, in a product for the rows that still reach back to them)."""

    def __init__(self, base, features=None, operands=None):
        self.base, self.operands = base, operands
        self.kernel = features if features is not None and features.has_kernel else None
        self.decay = jnp.float32(1.0)
        self.inputs, self.cotangents, self.weights, self.raw = [], [], [], []

    def _cat(self, parts, key):
        return jnp.concatenate([part[key] for part in parts])

    def product(self, key, h):
        out = self.decay * weight_product(h, self.base[key], self.operands)
        return out + self.correction(key, rows_gram(h, self._cat(self.inputs, key))) if self.inputs else out

    def correction(self, key, gram):
        """((x Aᵀ) ⊙ w) D for the Gram matrix ``gram`` = x Aᵀ [rows, Σ n_s]."""
        return (gram * jnp.concatenate(self.weights)) @ self._cat(self.cotangents, key)

    def _first_gram(self, key, phi, raw, n_cached, cached_gram=None):
        """φ(x)·φ(k_s) [rows, Σ n_s] over the earlier sub-chunks' sources (`_first_gram`)."""
        return _first_gram(self.kernel, [inputs[key] for inputs in self.inputs], self.raw, phi, raw, n_cached,
                           cached_gram)

    def first_products(self, base_products, terms: ChunkTerms, raw_sources=None, raw_queries=None,
                       cached=(None, None)):
        """A sub-chunk's `first_layer_products` from its products with θ_B; ``raw_sources`` /
        ``raw_queries``: the raw k of the chunk's sources (all but the entering window cache's
        rows) and scale·q, for φ's kernel; ``cached``: the sources' and queries' products with the
        entering window cache's φ [d_φ, c − 1]."""
        if not self.inputs:
            return base_products
        n_cached = terms.src_inputs.shape[0] - (0 if raw_sources is None else raw_sources.shape[0])
        grams = None
        out = {}
        for key, (src, queries) in base_products.items():
            if grams is None:   # every first-layer weight takes the same input: one pair of Grams
                grams = (self._first_gram(key, terms.src_inputs, raw_sources, n_cached, cached[0]),
                         self._first_gram(key, terms.queries, raw_queries, 0, cached[1]))
            out[key] = (self.decay * src + self.correction(key, grams[0]),
                        self.decay * queries + self.correction(key, grams[1]))
        return out

    def end_chunk(self, decay_end, rows, layer_inputs, cotangents, raw_sources=None):
        """θ after the sub-chunk: decay_end θ₀ + Σ_s rows[s] a_s δ_sᵀ (GD's chunk end)."""
        self.weights = [decay_end * w for w in self.weights] + [rows]
        self.inputs.append(layer_inputs)
        self.cotangents.append(cotangents)
        self.raw.append(raw_sources)
        self.decay = decay_end * self.decay

    def materialise(self):
        """θ itself: one matmul per weight over every sub-chunk's sources."""
        weights = jnp.concatenate(self.weights)
        return {key: outer_product(self._cat(self.inputs, key), weights[:, None] * self._cat(self.cotangents, key),
                                   self.operands) + self.decay * w for key, w in self.base.items()}


def _super_chunk(spec, opt_info, features, carry: MemoryState, xs: Steps, padding_chunks=True, operands=None,
                 initial: MemoryState | None = None, fresh_opt_state: bool = False):
    """``SUPER_CHUNK`` chunks of the grouped scan with θ formed once, at their end: chunk k > 0
    takes its gradients at θ₀ of the earlier chunks' low-rank updates (`_LowRankStart`, or for a
    depth-2 MLP the super-chunk chain, `_chain`): what
    `_one_chunk` computes chunk after chunk, to float32 rounding (sums in another order). Only
    where the chunk end is θ's linear update (GD or implicit GD, no map, gradients at θ₀:
    `_super_chunks`); Muon's chunk end through `_muon_super_chunk`. Steps with restarts
    (packed documents, ``initial`` the state a sequence starts from) run through the chain or
    Muon's super-chunks only: a restart at the first chunk starts the super-chunk from ``initial``,
    one at a later chunk decays θ to zero there with ``initial``'s θ as a source (the chain:
    `ops.deep_memory.chain_weights`; Muon: a second base), and a chunk with a restart after its
    first step gives NaN outputs (`restarting_chunks`). ``fresh_opt_state``: ``initial``'s optimizer
    state is the optimizer's init (Muon's momentum zero, whose products a restart then skips)."""
    restart = None if xs.restart is None else xs.restart[:, 0]
    b = xs.active.shape[1]
    if restart is not None:
        if initial is None or not (opt_info.kind == "muon" or _chain_covers(spec, carry.params)):
            raise NotImplementedError("_super_chunk: restarts run through the super-chunk chain or Muon's "
                                      "super-chunks only (`_super_chunks`)")
        carry = restarted(carry, initial, restart[0])
    if opt_info.kind == "muon":
        state, outputs = _muon_super_chunk(spec, opt_info, features, carry, xs, padding_chunks, operands, restart,
                                           initial, zero_origin_momentum=fresh_opt_state)
    else:
        state, outputs = _linear_super_chunk(spec, opt_info, features, carry, xs, padding_chunks, operands, restart,
                                             initial)
    if restart is not None:
        inside = jnp.any(xs.restart[:, 1:] > 0, axis=1)                 # [S]
        outputs = jnp.where(jnp.repeat(inside, b)[:, None], jnp.nan, outputs)
    return state, outputs


def _linear_super_chunk(spec, opt_info, features, carry: MemoryState, xs: Steps, padding_chunks, operands,
                        restart=None, initial: MemoryState | None = None):
    """`_super_chunk` where θ's chunk end is linear in the gradients (GD, implicit GD): the chain
    for a depth-2 MLP, else `_LowRankStart` sub-chunk by sub-chunk. ``restart`` [S] / ``initial``:
    as `_muon_super_chunk`'s (the chain only)."""
    chain = _chain_covers(spec, carry.params)
    parts = _super_chunk_terms(spec, opt_info, features, carry, xs, padding_chunks, joined_rows=chain,
                               initial_window=None if initial is None or restart is None else initial.window)
    terms, win, joined, raw_keys, raw_sources = parts
    with jax.named_scope(SCOPES["chunk_source"]):
        # every sub-chunk's sources and queries times θ_B's first layer: one matmul per weight,
        # and, for φ's kernel, times the entering window cache's φ (whose raw k are gone)
        extra = None
        if features is not None and features.has_kernel and carry.window is not None:
            extra = {CACHED_WINDOW: carry.window.inputs.T}
        base_products = _kept(first_layer_products(spec, carry.params, *terms, extra=extra, operands=operands,
                                                   rows=joined))
    if chain:
        origin = None
        if restart is not None:
            with jax.named_scope(SCOPES["chunk_source"]):
                # the rows' products with the sequences' start θ, which a sub-chunk after a restart
                # reads: a second set of the base products' matmuls (omeganet's layer, B1 T4096 H8
                # D128 bf16 with 8 documents a row: 7.38 TFLOP of matmuls fwd+bwd, against 5.40 on the
                # per-chunk route and 3.68 without documents; on an H200 54.9 ms against the
                # per-chunk route's 171.2 and 38.2 without documents, one command:
                # benchmarks/results/packed_super_chunks_h200_2026-11-30.md)
                origin = (restart, initial.params, first_layer_products(spec, initial.params, *terms, operands=operands,
                                                                         rows=joined))
        params_end, outputs = _chain(spec, carry.params, features, terms, base_products, joined, raw_keys,
                                     raw_sources, xs.queries if features is not None else None, operands, origin)
        return carry._replace(params=params_end, window=win), outputs
    start = _LowRankStart(carry.params, features, operands)
    outputs = []
    for k, (t, base, raw) in enumerate(zip(terms, base_products, raw_sources)):
        raw_queries = None if features is None else xs.queries[k]
        cached = base.pop(CACHED_WINDOW, (None, None))
        with jax.named_scope(SCOPES["chunk_source"]):
            first_products, layer_inputs, cotangents = _kept_sources(
                spec, carry.params, t, start.first_products(base, t, raw, raw_queries, cached), product=start.product)
        with jax.named_scope(SCOPES["chunk_read"]):
            outputs.append(chunk_read(spec, carry.params, None, None, t, layer_inputs, cotangents, first_products,
                                      product=start.product, operands=operands))
        start.end_chunk(t.from_start[-1], t.state_rows[-1], layer_inputs, cotangents, raw)
    with jax.named_scope(SCOPES["chunk_end"]):
        params_end = start.materialise()
    return carry._replace(params=params_end, window=win), jnp.concatenate(outputs)


def _super_chunk_terms(spec, opt_info, features, carry: MemoryState, xs: Steps, padding_chunks, joined_rows,
                       initial_window=None):
    """A super-chunk's θ-free part: (every sub-chunk's `ChunkTerms`, the window cache after it, the
    joined φ rows of `_super_chunk_rows` where ``joined_rows`` and the chunks are at least c − 1
    long (else None), the raw keys [S·b, d] and every sub-chunk's sources' raw keys, for φ's
    kernel (None without a feature map))."""
    n_sub, b = xs.active.shape[:2]
    win = carry.window
    n_window = 0 if win is None else win.inputs.shape[0]
    # The raw k of a sub-chunk's sources, for φ's kernel: its window rows are the last ones before
    # it, so all but the entering window cache's (φ alone) are in the sub-chunks' raw k. (After a
    # chunk of padding the window cache stays and these rows do not; only chunks of padding follow
    # it, whose outputs and updates are dropped.)
    raw_keys = None if features is None else xs.inputs.reshape((n_sub * b,) + xs.inputs.shape[2:])
    raw_sources = [None if raw_keys is None else raw_keys[max(0, k * b - n_window):(k + 1) * b]
                   for k in range(n_sub)]
    n = b + n_window
    joined = None
    terms = []
    with jax.named_scope(SCOPES["chunk_terms"]):
        if joined_rows and b >= n_window:   # (shorter chunks' windows reach into the entering cache)
            joined = _super_chunk_rows(features, xs, carry.window, n_sub, b, n_window)
        for k in range(n_sub):
            xc = jax.tree.map(lambda x: x[k], xs)
            if initial_window is not None and k:   # a restart: the sequence's own (empty) window
                win = jax.tree.map(lambda i, w: jnp.where(xc.restart[0] > 0, i.astype(w.dtype), w), initial_window, win)
            raw_window = None if raw_keys is None or not n_window or k * b < n_window else raw_keys[k * b - n_window:k * b]
            rows = None if joined is None else (joined[k * n:(k + 1) * n], joined[n_sub * n + k * b:n_sub * n + (k + 1) * b])
            t = chunk_terms(spec, opt_info, features, xc, win, raw_window, rows)
            next_window = t.next_window
            if padding_chunks:   # a chunk of padding leaves θ and the window cache alone
                real = jnp.any(xc.active > 0)
                t = t._replace(from_start=jnp.where(real, t.from_start, 1.0),
                               state_rows=jnp.where(real, t.state_rows, 0.0))
                if t.momentum_rows is not None:   # (Muon) nor the momentum
                    t = t._replace(momentum_rows=jnp.where(real, t.momentum_rows, 0.0),
                                   momentum_carry=jnp.where(real, t.momentum_carry, 1.0),
                                   total_step=jnp.where(real, t.total_step, 0.0))
                if win is not None:
                    next_window = jax.tree.map(lambda new, old: jnp.where(real, new, old), next_window, win)
            terms.append(t)
            win = next_window
    return terms, win, joined, raw_keys, raw_sources


# Products of `_muon_super_chunk` that meet Newton–Schulz's factor R (eigenvalues up to a^J ≈ 480
# on the momentum's small directions, which its pieces cancel) or form it: float32-accurate, on
# three bf16 tensor-core passes (MUON_CHUNK_END_PRECISION's algorithm). On TF32 operands R was 0.23
# off `newton_schulz` (a [512, 64] momentum of 300 decayed rank-one terms), on bf16 ones the route
# diverged; at HIGHEST (off the tensor cores) it took 0.96× the per-chunk route's time, with these
# 0.729× (MUON_SUB_CHUNK_UNROLL), and atlas' dk stayed bounded at B1 T16384 H8 D128 on an H200 as
# the per-chunk route's does
# (benchmarks/results/atlas_muon_super_chunks_h200_2026-11-30.md).
MUON_CHAIN_PRECISION = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
_exact = functools.partial(jnp.matmul, precision=MUON_CHAIN_PRECISION)
# How many of `_muon_super_chunk`'s sub-chunks one step of its scan runs. atlas B1 T4096 H8 D128
# bf16 fwd+bwd on an H200: all S = SUPER_CHUNK (a Python loop) took 0.729× the per-chunk route's
# time but 208 s to compile (the per-chunk route: 43 s, same command); 1 took 0.867× (72 s); against
# 1 in one command, 2 took 0.956× and 4 0.945×. XLA on the CPU compiles it in 29 / 34 / 50 / 67 s
# (1 / 2 / 4 / 8; the per-chunk route 8 s) to 6.97 / 7.29 / 8.05 / 7.32 GiB (9.82).
MUON_SUB_CHUNK_UNROLL = 2
MOMENTUM_OF = "_momentum_"   # `_muon_super_chunk`'s extra products with m_B in `first_layer_products`


def _muon_super_chunk(spec, opt_info, features, carry: MemoryState, xs: Steps, padding_chunks=True, operands=None,
                      restart=None, initial: MemoryState | None = None, zero_origin_momentum: bool = False):
    """`_super_chunk` for Muon with Newton–Schulz at chunk ends (``ns_every="chunk"``): θ and the
    momentum formed once a super-chunk, although the chunk end NS_J(m) is not linear in m.

    The weights that take the memory's input (the first layer and a skip map: d_φ rows) are never
    formed inside the super-chunk. After sub-chunk j their momentum is m_B's decay plus the
    sub-chunks' rank-n updates, m = μ m_B + Uᵀ V (U the sources' φ rows, V their ν-weighted output
    cotangents), and NS_J(m) = m (s I + F), with s and F [h, h] from the Gram matrix mᵀm alone
    (`optimizers.newton_schulz_factor`), which the super-chunk carries as
        A ← ν² A + ν (Pᵀ W + Wᵀ P) + Wᵀ (U_j U_jᵀ) W      (P = U_j m: the sources' momentum products,
                                                           W the sub-chunk's new rows of V).
    So θ = p θ_B + m_B (c I + C) + Uᵀ Ṽ keeps one form (p, c scalars, C [h, h], Ṽ [N, h]); every
    product with θ or m is a product with θ_B and m_B (formed for the whole super-chunk's rows at
    once, `first_layer_products`) plus Gram matrices of φ rows through φ's kernel (d wide); and the
    θ-sized work — m_B's Gram matrix, θ and m at the end — is done once a super-chunk, where
    `_one_chunk` forms m, its Gram matrix, the iterate at NS's restart and NS's result every chunk.
    The other weights (those after the first layer: h wide) are formed chunk by chunk as
    `chunk_end` forms them. Equal to `_one_chunk` chunk after chunk up to rounding, and to the
    rounding of NS's restart: `_one_chunk` takes it from the formed iterate's Gram matrix, this from
    A's (`newton_schulz_factor`; float32 ≤ 1e-4 relative, tested). The wide weights' NS is always
    the Gram route on float32-accurate products (`MUON_CHAIN_PRECISION`): ``ns_dtype`` and
    ``ns_method`` apply to the other weights only.

    Packed documents (``restart`` [S], the sub-chunks a sequence starts at, ``initial`` the state it
    starts from; the caller has restarted the first): a restart at sub-chunk j > 0 is a second base
    (θ_O, m_O) = ``initial``'s, with its own p, μ, c, C, next to (θ_B, m_B), whose coefficients, the
    rows V, Ṽ and the narrow weights go to zero (the initial ones) there, and A to m_Oᵀm_O. The rows'
    products with θ_O and m_O are a second set of the base products. atlas B1 T4096 H8 D128 bf16
    with 8 documents a row, fwd+bwd on an H200: 553.8 ms against the per-chunk route's 804.6 (435.2
    without documents; benchmarks/results/packed_super_chunks_h200_2026-11-30.md).
    ``zero_origin_momentum``: m_O is zero (``initial`` was built from θ_0, as a model's packed rows
    are): its products, its Gram matrix and its terms of θ and m are left out (the same layer:
    552.2 -> 500.9 ms; benchmarks/results/zero_origin_momentum_h200_2026-11-30.md)."""
    terms, win, joined, raw_keys, raw_sources = _super_chunk_terms(
        spec, opt_info, features, carry, xs, padding_chunks, joined_rows=True,
        initial_window=None if restart is None else initial.window)
    params_b, momentum_b = carry.params, carry.opt_state.momentum
    n_sub, n, b = len(terms), terms[0].src_inputs.shape[0], terms[0].queries.shape[0]
    n_window = n - b
    wide = sorted(first_layer_keys(spec.memory, params_b, terms[0].src_inputs.shape[-1]))
    kernel = features if features is not None and features.has_kernel else None
    ns = dict(steps=opt_info.ns_steps, coefficients=opt_info.ns_coefficients, eps=opt_info.ns_eps)
    with jax.named_scope(SCOPES["chunk_source"]):
        # every sub-chunk's sources and queries times θ_B's and m_B's wide weights, one matmul each
        extra = {MOMENTUM_OF + key: momentum_b[key] for key in wide}
        if kernel is not None and carry.window is not None:
            extra[CACHED_WINDOW] = carry.window.inputs.T
        base = _kept(first_layer_products(spec, params_b, *terms, extra=extra, operands=operands, rows=joined))
        cached = [products.pop(CACHED_WINDOW, (None, None)) for products in base]
        raw_queries = None if features is None else xs.queries.reshape((n_sub * b,) + xs.queries.shape[2:])
        if (kernel is not None and b >= n_window and (n_window == 0 or all(c[0] is not None for c in cached))):
            gram_src, gram_q = _chain_grams(kernel, raw_keys, raw_queries, cached, n_sub, b, n_window)
            if n_window:   # chunk 0's own Gram matrix, whose rows of the entering window cache `_chain` never reads
                gram_src = gram_src.at[0, :n_window, 0, :].set(cached[0][0].T.astype(jnp.float32))
        else:
            gram_src, gram_q = _grams_by_chunk(kernel, terms, raw_sources, None if features is None else xs.queries,
                                               cached)
        gram_src, gram_q = _kept(gram_src), _kept(gram_q)
        gram = {key: _kept(_exact(momentum_b[key].T, momentum_b[key])) for key in wide}   # A = mᵀm
        # the bases: (θ_B, m_B), and with restarts (θ_O, m_O), each with the rows' products with it
        bases = [(params_b, momentum_b)]
        products_by_base = [base]
        if restart is not None:
            params_o, momentum_o = initial.params, initial.opt_state.momentum
            bases.append((params_o, None if zero_origin_momentum else momentum_o))
            products_by_base.append(_kept(first_layer_products(
                spec, params_o, *terms, operands=operands, rows=joined,
                extra=None if zero_origin_momentum else {MOMENTUM_OF + key: momentum_o[key] for key in wide})))
            gram_origin = {key: (jnp.zeros((hidden, hidden), jnp.float32) if zero_origin_momentum
                                 else _exact(momentum_o[key].T, momentum_o[key]))
                           for key, hidden in ((key, params_b[key].shape[-1]) for key in wide)}

    S, N = n_sub, n_sub * n
    hidden = {key: params_b[key].shape[-1] for key in wide}
    narrow = [key for key in params_b if key not in wide]
    zero = jnp.zeros((), jnp.float32)
    # The sub-chunks run as one lax.scan (XLA compiles one body, not S of them: unrolled, atlas' layer
    # took 208 s to compile on an H200 against 43 s for the per-chunk route). What grows from
    # sub-chunk to sub-chunk (the rows V, Ṽ) is kept in buffers of the super-chunk's N rows, zero
    # where no sub-chunk wrote yet, so the products with them need no slices.
    def coefficients(weight):   # a base's p, μ, c, C: θ = p θ_base + m_base (c I + C) + …, m = μ m_base + …
        return dict(decay=jnp.float32(weight), mu=jnp.float32(weight), coef={key: zero for key in wide},
                    mix={key: jnp.zeros((hidden[key],) * 2, jnp.float32) for key in wide})

    init = dict(bases=[coefficients(1.0)] + [coefficients(0.0) for _ in bases[1:]],
                gram=gram,                                                     # A = mᵀm
                rows_m={key: jnp.zeros((N, hidden[key]), jnp.float32) for key in wide},       # V
                rows_t={key: jnp.zeros((N, hidden[key]), jnp.float32) for key in wide},       # Ṽ
                theta={key: params_b[key] for key in narrow}, momentum={key: momentum_b[key] for key in narrow})
    stacked_terms = jax.tree.map(lambda *x: jnp.stack(x), *[t._replace(next_window=None) for t in terms])
    stacked_products = [jax.tree.map(lambda *x: jnp.stack(x), *products) for products in products_by_base]
    # a restart at the first sub-chunk is the caller's (`_super_chunk` starts the carry from ``initial``)
    restarts = jnp.zeros((S,), bool) if restart is None else (restart > 0).at[0].set(False)

    def theta_of(c, key, products, side, grams):
        """x θ[key] from x θ_base and x m_base of every base (``side`` 0: the sources' rows, 1: the
        queries') and x Uᵀ."""
        out = _exact(grams, c["rows_t"][key])
        for coef, rows in zip(c["bases"], products):
            out = out + coef["decay"] * rows[key][side]
            if MOMENTUM_OF + key in rows:   # not for a zero m_O
                x_m = rows[MOMENTUM_OF + key][side]
                out = out + coef["coef"][key] * x_m + _exact(x_m, coef["mix"][key])
        return out

    def momentum_of(c, key, products, side, grams):
        out = _exact(grams, c["rows_m"][key])
        for coef, rows in zip(c["bases"], products):
            if MOMENTUM_OF + key in rows:
                out = out + coef["mu"] * rows[MOMENTUM_OF + key][side]
        return out

    def restarted_at(c, restart_here):
        """The carry a sequence starts with at this sub-chunk: only (θ_O, m_O), with weight one."""
        start = dict(bases=[coefficients(0.0), coefficients(1.0)], gram=gram_origin,
                     rows_m=jax.tree.map(jnp.zeros_like, c["rows_m"]), rows_t=jax.tree.map(jnp.zeros_like, c["rows_t"]),
                     theta={key: params_o[key] for key in narrow}, momentum={key: momentum_o[key] for key in narrow})
        return jax.tree.map(lambda s, old: jnp.where(restart_here, s, old), start, c)

    def sub_chunk(c, xs):
        t, products, g_src, g_q, j, restart_here = xs
        if len(bases) > 1:
            c = restarted_at(c, restart_here)
        before = jnp.arange(S)[None, :, None] < j
        earlier_src = jnp.where(before, g_src, 0.0).reshape(n, N)
        earlier_q = jnp.where(before, g_q, 0.0).reshape(b, N)
        with jax.named_scope(SCOPES["chunk_source"]):
            first, mom_q, mom_src = {}, {}, {}
            for key in wide:
                first[key] = (theta_of(c, key, products, 0, earlier_src), theta_of(c, key, products, 1, earlier_q))
                mom_src[key] = momentum_of(c, key, products, 0, earlier_src)
                mom_q[key] = momentum_of(c, key, products, 1, earlier_q)
            old_theta, old_m = c["theta"], c["momentum"]
            first, layer_inputs, cotangents = _kept_sources(
                spec, params_b, t, first, product=lambda key, h: weight_product(h, old_theta[key], operands))
        with jax.named_scope(SCOPES["chunk_end"]):
            nu, step, decay = t.momentum_carry, t.total_step, t.from_start[-1]
            # the narrow weights' chunk end as `_one_chunk` takes it (θ and m formed every chunk)
            narrow_end = chunk_end(spec, opt_info, MemoryState(old_theta, inner_opt.MomentumState(old_m), None, None),
                                   t, layer_inputs, cotangents, operands)
            new = dict(theta=narrow_end.params, momentum=narrow_end.opt_state.momentum, gram={}, rows_m={}, rows_t={},
                       bases=[dict(mu=nu * coef["mu"], decay=decay * coef["decay"], coef={}, mix={})
                              for coef in c["bases"]])
            own = jax.lax.dynamic_index_in_dim(g_src, j, axis=1, keepdims=False)   # U_j U_jᵀ [n, n]
            for key in wide:
                new_rows = t.momentum_rows[:, None] * cotangents[key]   # W [n, h]
                cross = _exact(mom_src[key].T, new_rows)
                new["gram"][key] = (nu * nu * c["gram"][key] + nu * (cross + cross.T)
                                    + _exact(new_rows.T, _exact(own, new_rows)))
                rows_m = jax.lax.dynamic_update_slice_in_dim(nu * c["rows_m"][key], new_rows, j * n, 0)
                # Formed again by each rematerialisation, never kept from the forward pass: kept, the
                # backward's carries came from the forward's factor and its transpose's residuals from
                # the chain formed again, which a GPU rounds differently, and NS's derivative (up to
                # a⁵ ≈ 480) grew that mismatch chunk after chunk (atlas B1 T16384 H8: max |dk| 2e29,
                # 0.3 rematerialised; benchmarks/results/atlas_time_and_kept_factor_h200_2026-11-30.md).
                with jax.named_scope(SCOPES["newton_schulz"]):
                    factor = inner_opt.newton_schulz_factor(new["gram"][key], **ns, precision=MUON_CHAIN_PRECISION)
                new["rows_m"][key] = rows_m
                new["rows_t"][key] = decay * c["rows_t"][key] - step * (factor.scale * rows_m
                                                                       + _exact(rows_m, factor.right))
                for coef, new_coef in zip(c["bases"], new["bases"]):
                    new_coef["coef"][key] = decay * coef["coef"][key] - step * new_coef["mu"] * factor.scale
                    new_coef["mix"][key] = decay * coef["mix"][key] - step * new_coef["mu"] * factor.right
        with jax.named_scope(SCOPES["chunk_read"]):
            own_q = jnp.where(jnp.arange(S)[None, :, None] <= j, g_q, 0.0).reshape(b, N)
            end_q = {key: theta_of(new, key, products, 1, own_q) for key in wide}

            def wide_only(values, fallback):
                def read(key, h):
                    if key not in values:
                        return fallback(key, h)
                    if h is not t.queries:
                        raise AssertionError(f"_muon_super_chunk: weight {key!r} read with other rows than φ(q)")
                    return values[key]
                return read

            end_theta = new["theta"]
            outputs = chunk_read(
                spec, params_b, None, None, t, layer_inputs, cotangents, first,
                product=lambda key, h: weight_product(h, old_theta[key], operands), operands=operands,
                momentum_product=wide_only(mom_q, lambda key, h: weight_product(h, old_m[key], operands)),
                end_product=wide_only(end_q, lambda key, h: weight_product(h, end_theta[key], operands)))
        return new, outputs

    c, outputs = jax.lax.scan(sub_chunk, init,
                              (stacked_terms, stacked_products, gram_src, gram_q, jnp.arange(S), restarts),
                              unroll=MUON_SUB_CHUNK_UNROLL)
    with jax.named_scope(SCOPES["chunk_end"]):
        sources = jnp.concatenate([t.src_inputs for t in terms]) if joined is None else joined[:N]
        params_end, momentum_end = dict(c["theta"]), dict(c["momentum"])
        for key in wide:
            params_end[key] = _exact(sources.astype(jnp.float32).T, c["rows_t"][key])
            momentum_end[key] = outer_product(sources, c["rows_m"][key], None, MUON_CHUNK_END_PRECISION)
            for coef, (params, momentum) in zip(c["bases"], bases):
                params_end[key] = params_end[key] + coef["decay"] * params[key]
                if momentum is not None:
                    m = momentum[key]
                    params_end[key] = params_end[key] + coef["coef"][key] * m + _exact(m, coef["mix"][key])
                    momentum_end[key] = momentum_end[key] + coef["mu"] * m
    state = MemoryState(params_end, inner_opt.MomentumState(momentum_end), carry.accumulator, win)
    return state, outputs.reshape((S * b,) + outputs.shape[2:])


def _grams_by_chunk(kernel, terms, raw_sources, raw_queries, cached):
    """`_chain_grams`' [S, n, S, n] and [S, b, S, n] chunk by chunk (`_first_gram`), each sub-chunk's
    sources with its own sources too, where the raw keys do not cover every chunk's window or φ has
    no kernel. Blocks no caller reads (later chunks') are zero."""
    n_sub, n = len(terms), terms[0].src_inputs.shape[0]
    sources = [t.src_inputs for t in terms]
    full = lambda block: jnp.pad(block, [(0, 0), (0, n_sub * n - block.shape[1])]).reshape(block.shape[0], n_sub, n)
    gram_src, gram_q = [], []
    for k, (t, raw) in enumerate(zip(terms, raw_sources)):
        n_cached = n - (0 if raw is None else raw.shape[0])
        gram_src.append(full(_first_gram(kernel, sources[:k + 1], raw_sources[:k + 1], t.src_inputs, raw, n_cached,
                                         cached[k][0]).astype(jnp.float32)))
        own = t.first_gram if t.first_gram is not None else rows_gram(t.queries, t.src_inputs)
        earlier = [] if k == 0 else [_first_gram(kernel, sources[:k], raw_sources[:k], t.queries,
                                                 None if raw_queries is None else raw_queries[k], 0, cached[k][1])]
        gram_q.append(full(jnp.concatenate(earlier + [own], axis=1).astype(jnp.float32)))
    return jnp.stack(gram_src), jnp.stack(gram_q)


def _super_chunk_rows(features, xs: Steps, window: WindowCache | None, n_sub, b, n_window):
    """`_chain`'s super-chunk rows as one buffer [S·n + S·b, d_φ] (n = b + c − 1): every sub-chunk's
    sources (its c − 1 window rows, then its b steps' φ(k)), then every sub-chunk's φ(scale·q) —
    the order `first_layer_products` joins them in. φ runs once, on the raw rows gathered into that
    order (d wide: a window row of chunk k > 0 is the raw k of chunk k − 1's last steps, where
    chunks are at least c − 1 long), so no [n, d_φ] piece is joined and the backward splits no
    d_φ-wide cotangent into pieces: φ's backward takes the whole buffer's and scatters d-wide rows.
    B1 T4096 H8 D128 bf16 fwd+bwd on an H200, interleaved in one command: omeganet 56.12 -> 50.82
    ms, dla 42.83 -> 39.98. The entering window cache's φ rows (raw k gone) are written over chunk
    0's first c − 1. (After a chunk of padding the window cache stays and these rows do not; only
    chunks of padding follow it, whose outputs and updates are dropped.)"""
    keys = xs.inputs.reshape((n_sub * b,) + xs.inputs.shape[2:])
    queries = xs.queries.reshape((n_sub * b,) + xs.queries.shape[2:])
    raw = jnp.concatenate([keys[_source_rows(n_sub, b, n_window).reshape(-1)], queries.astype(keys.dtype)])
    rows = raw if features is None else features(raw)
    if n_window:
        rows = jax.lax.dynamic_update_slice_in_dim(rows, window.inputs.astype(rows.dtype), 0, 0)
        # without the barrier XLA fused the chunk end's slice of the sources through this update,
        # so it read φ's pre-update rows, which kept them alive and made the in-place update copy
        # the whole buffer first ([32, 1048, 8448] bf16 at B4: 0.26 ms a super-chunk). omeganet
        # B4 T4096 H8 D128 bf16 fwd+bwd on an H200, one command: 113.2 -> 111.4 ms, 12.88 -> 12.34
        # GiB compiled (benchmarks/results/phi_tiles_h200_2026-12-02.md)
        rows = jax.lax.optimization_barrier(rows)
    return rows


def _source_rows(n_sub, b, n_window):
    """[S, n]: the row of the super-chunk's raw keys [S·b, d] that sub-chunk k's source j is,
    k·b − (c − 1) + j; the entering window cache's rows (raw k gone) clipped to row 0, a stand-in
    the caller overwrites."""
    return np.maximum(np.arange(n_sub)[:, None] * b - n_window + np.arange(b + n_window)[None, :], 0)


def _chain_covers(spec, params) -> bool:
    """Whether `_chain` runs a super-chunk: a depth-2 MLP memory without LayerNorm, whose residual
    (if any) is a skip map, with the ℓ2 or dot objective (super-chunks take gradients at θ₀:
    `_super_chunks`)."""
    from atlas_jax.memory import MLPMemory
    from atlas_jax.objectives import L2, Dot

    memory = spec.memory
    if type(memory) is not MLPMemory or memory.depth != 2 or memory.layernorm:
        return False
    if memory.residual and "skip" not in params:
        return False
    return type(spec.objective) in (L2, Dot)


def _chain(spec, params, features, terms, base_products, joined, raw_keys, raw_sources, raw_queries, operands,
           origin=None):
    """`_super_chunk`'s sub-chunks after their products with θ_B (``base_products``) through the
    super-chunk chain (`ops.deep_memory.dual_chain`): every Gram matrix of a sub-chunk's rows with
    an earlier one's sources at once, then the chain, then θ after the super-chunk (the wide
    weights' updates in one matmul, from the sub-chunks' sources as the first rows of ``joined``,
    `_super_chunk_rows`' buffer, or joined here where that is None; ``raw_keys`` [S·b, d],
    ``raw_sources`` (per sub-chunk) and ``raw_queries`` [S, b, d]: the raw k and scale·q, for φ's
    kernel). ``origin``: (restarts [S], θ_origin, its `first_layer_products` of the same rows) for
    packed documents (`_super_chunk`). Returns (θ after it, outputs [S·b, dv])."""
    from atlas_jax.ops.deep_memory.dual_chain import dual_chain_reference

    kernel = features if features is not None and features.has_kernel else None
    skip = "skip" in params
    wide = ["W0", "skip"] if skip else ["W0"]
    n_sub, n, b = len(terms), terms[0].src_inputs.shape[0], terms[0].queries.shape[0]
    sources = [t.src_inputs for t in terms]
    base_src, base_q, gram_src, gram_q = [], [], [], []
    cached = [base.pop(CACHED_WINDOW, (None, None)) for base in base_products]
    n_window = n - b
    with jax.named_scope(SCOPES["chunk_source"]):
        for base in base_products:
            base_src.append(jnp.concatenate([base[key][0] for key in wide], axis=1))
            base_q.append(jnp.concatenate([base[key][1] for key in wide], axis=1))
        if (kernel is not None and raw_keys is not None and raw_queries is not None and b >= n_window
                and (n_window == 0 or all(c[0] is not None for c in cached))):
            gram_src, gram_q = _chain_grams(kernel, raw_keys, raw_queries.reshape((n_sub * b, -1)), cached, n_sub,
                                            b, n_window)
        else:
            gram_src, gram_q = _chain_grams_by_chunk(kernel, terms, sources, cached, raw_sources, raw_queries)
    from_start = jnp.stack([t.from_start for t in terms])
    state_rows = jnp.stack([t.state_rows for t in terms])
    restarts = {}
    if origin is not None:
        restart, params_origin, origin_products = origin
        restarts = dict(restarts=restart,
                        origin_sources=jnp.stack([jnp.concatenate([o[key][0] for key in wide], axis=1)
                                                  for o in origin_products]),
                        origin_queries=jnp.stack([jnp.concatenate([o[key][1] for key in wide], axis=1)
                                                  for o in origin_products]),
                        w1_origin=params_origin["W1"])
    with jax.named_scope(SCOPES["chunk_read"]):
        # the Gram matrices ([S, rows, S, n]: small) are kept for the grouped scan's backward
        out = dual_chain_reference(jnp.stack(base_src), jnp.stack(base_q), _kept(gram_src), _kept(gram_q),
                                   params["W1"], jnp.stack([t.src_targets for t in terms]), from_start, state_rows,
                                   activation=spec.memory.activation, skip=skip,
                                   objective="l2" if spec.objective.name == "l2" else "dot", operands=operands,
                                   **restarts)
    with jax.named_scope(SCOPES["chunk_end"]):
        # the sources' rows of the buffer the base products read: joining them again took 4.1 of
        # omeganet's 63 ms (B1 T4096 H8 bf16 fwd+bwd, H200 trace; the layer 60.3 -> 58.2 ms)
        rows = jnp.concatenate(sources) if joined is None else joined[:n_sub * n]
        cotangents = {"W0": _kept(out.d0), "skip": _kept(out.errors)}
        params_end = {"W1": out.w1_end}
        # the wide weights' updates as one product (their rows read once, their cotangent formed by
        # one product): omeganet 51.01 -> 49.88 ms (B1 T4096 H8 bf16 fwd+bwd, H200, one command)
        weighted = [(out.end_weights[..., None] * cotangents[key]).reshape(n_sub * n, -1) for key in wide]
        update = outer_product(rows, jnp.concatenate(weighted, axis=1), operands)
        column = 0
        for key, part in zip(wide, weighted):
            params_end[key] = update[:, column:column + part.shape[1]] + out.end_decay * params[key]
            if origin is not None:
                params_end[key] = params_end[key] + out.end_origin * origin[1][key]
            column += part.shape[1]
    return params_end, out.outputs.reshape((n_sub * out.outputs.shape[1],) + out.outputs.shape[2:])


def _chain_grams(kernel, raw_keys, raw_queries, cached, n_sub, b, n_window):
    """`_chain`'s Gram matrices ([S, n, S, n] sources', [S, b, S, n] queries') from two [S·b, S·b]
    Gram matrices through φ's kernel, of the super-chunk's raw keys with themselves and of its raw
    queries with them: chunk k's sources are rows k·b − (c − 1) … k·b + b − 1 of the raw keys, and
    the first chunk's window rows (raw k gone: the entering window cache) take their columns from
    the products with the cache's φ (``cached``, one (sources', queries') pair per chunk). Entries
    no chain reads (chunk 0's sources, later chunks' columns) hold finite values of other pairs."""
    src_rows = _source_rows(n_sub, b, n_window)
    columns = src_rows[None, None]
    f32 = lambda x: x.astype(jnp.float32)
    gram_src = f32(kernel.gram(raw_keys, raw_keys))[src_rows[:, :, None, None], columns]
    gram_q = f32(kernel.gram(raw_queries, raw_keys))[np.arange(n_sub * b).reshape(n_sub, b)[:, :, None, None], columns]
    if n_window:
        gram_src = gram_src.at[:, :, 0, :n_window].set(f32(jnp.stack([c[0] for c in cached])))
        gram_q = gram_q.at[:, :, 0, :n_window].set(f32(jnp.stack([c[1] for c in cached])))
    return gram_src, gram_q


def _chain_grams_by_chunk(kernel, terms, sources, cached, raw_sources, raw_queries):
    """`_chain_grams` chunk by chunk (`_first_gram`), where the raw keys do not cover every chunk's
    window (chunks shorter than it) or φ has no kernel."""
    n_sub, n = len(terms), terms[0].src_inputs.shape[0]
    gram_src, gram_q = [], []
    full = lambda block: jnp.pad(block, [(0, 0), (0, n_sub * n - block.shape[1])]).reshape(block.shape[0], n_sub, n)
    for k, (t, raw) in enumerate(zip(terms, raw_sources)):
        own = t.first_gram if t.first_gram is not None else rows_gram(t.queries, t.src_inputs)
        if k == 0:
            gram_src.append(jnp.zeros((n, n_sub, n), jnp.float32))
            gram_q.append(full(own))
            continue
        n_cached = n - (0 if raw is None else raw.shape[0])
        queries_raw = None if raw_queries is None else raw_queries[k]
        gram_src.append(full(_first_gram(kernel, sources[:k], raw_sources[:k], t.src_inputs, raw, n_cached,
                                         cached[k][0])))
        gram_q.append(full(jnp.concatenate([_first_gram(kernel, sources[:k], raw_sources[:k], t.queries,
                                                        queries_raw, 0, cached[k][1]), own], axis=1)))
    return jnp.stack(gram_src), jnp.stack(gram_q)


def _super_chunks(spec, opt_info, steps: Steps, params=None) -> int:
    """Chunks per `_super_chunk` of the grouped scan: SUPER_CHUNK where θ's chunk end is linear
    in the chunk's gradients (GD, implicit GD) or Muon's (linear in them up to Newton–Schulz, which
    `_muon_super_chunk` takes from the momentum's Gram matrix), else 1. With restarts (packed
    documents) only where the super-chunk chain runs (GD or implicit GD on a depth-2 MLP, `_chain`)
    or Muon's, which restart inside a super-chunk (θ decays to zero there and takes θ_0 as a source)."""
    linear = opt_info.kind in ("gd", "implicit_gd", "muon") and not spec.retention.has_map
    at_start = spec.retention.decay == "none" or spec.retention.decoupled
    chain = opt_info.kind in ("gd", "implicit_gd") and params is not None and _chain_covers(spec, params)
    if steps.restart is not None and not (chain or opt_info.kind == "muon"):
        return 1
    return SUPER_CHUNK if linear and at_start else 1


def _schedule(spec, opt_info, state: MemoryState, steps: Steps, n_chunks: int, b: int, boundary_bytes_per_token):
    """(chunks a group, chunks a super-chunk, whether a group is one super-chunk kept at its start)
    of the scan over ``n_chunks`` chunks of ``b`` steps: every chunk's state kept (1, 1, False), or
    super-chunks kept at their start (S, S, True), or groups of chunks or super-chunks (G, S, False)."""
    if keeps_every_chunk_state(state, b, boundary_bytes_per_token):
        return 1, 1, False
    per_super = _super_chunks(spec, opt_info, steps, state.params)
    if per_super > 1 and _carried_bytes(state) <= per_super * b * SUPER_CHUNK_BYTES_PER_TOKEN:
        per_super = -(-n_chunks // -(-n_chunks // per_super))   # balanced: < 1 chunk of padding a super-chunk
        return per_super, per_super, per_super > 1
    n_groups = -(-n_chunks // max(1, GROUP_TOKENS // b))
    per_group = -(-n_chunks // n_groups)   # balanced groups: fewer than n_groups chunks of padding
    per_super = min(per_super, per_group)
    return -(-per_group // per_super) * per_super, per_super, False


def dual_sequence(spec, state: MemoryState, steps: Steps, *, chunk_size: int, features=None,
                  boundary_bytes_per_token=None, low_precision: bool = False, fresh_opt_state: bool = False):
    """The dual form for one sequence and head (steps padded to a multiple of ``chunk_size``):
    the same (final state, outputs [S, d_out]) as the materialising chunked form.

    ``features`` (a ``common.Features``): the steps' inputs and queries are the raw k and scale·q,
    and φ is formed chunk by chunk (what the backward pass keeps is then d wide, not d_φ).
    ``low_precision``: θ's products take bf16 operands (`operand_dtype`). ``fresh_opt_state``:
    ``state``'s optimizer state is the optimizer's init, a fact the restarts take (`_super_chunk`)."""
    opt_info = inner_opt.info(spec.optimizer)
    operands = operand_dtype(low_precision)
    aligned = _aligned_features(spec, state, steps, features)
    if aligned is not None:
        features, pad_state, unpad_state = aligned
        final, outputs = dual_sequence(spec, pad_state(state), steps, chunk_size=chunk_size, features=features,
                                       boundary_bytes_per_token=boundary_bytes_per_token, low_precision=low_precision,
                                       fresh_opt_state=fresh_opt_state)
        return unpad_state(final), outputs
    if features is not None and operands is not None:
        features = _OperandFeatures(features, operands)
    b = chunk_size
    total = steps.active.shape[0]
    n_chunks = total // b
    per_group, per_super, one_level = _schedule(spec, opt_info, state, steps, n_chunks, b, boundary_bytes_per_token)
    n_groups = -(-n_chunks // per_group)
    pad = n_groups * per_group * b - total
    padded = steps if pad == 0 else jax.tree.map(lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)), steps)

    # Every chunk's state kept: the θ-free terms of every chunk are formed at once, outside the
    # sequential scan, whose body (and the backward's rematerialised one) then keeps only the ops
    # that read θ. titans B4 T4096 H8 D128 float32 fwd+bwd on an H200, interleaved in one command:
    # 38.0 -> 34.0 ms (forward 9.4 -> 8.5), peak 3.60 -> 3.96 GiB (every chunk's terms are kept).
    hoist = per_group == 1 and _hoists_terms(state, steps, features)

    def one(carry, xs):
        xc, terms = xs if hoist else (xs, None)
        return _one_chunk(spec, opt_info, features, carry, xc, padding_chunks=pad >= b, terms=terms, operands=operands)

    # grouped: the group's rematerialised forward keeps what CHUNK_RESIDUAL names
    policy = None if per_group == 1 else jax.checkpoint_policies.save_only_these_names(CHUNK_RESIDUAL)
    chunk = jax.checkpoint(restarting_chunks(one, state, steps_of=lambda xs: xs[0] if hoist else xs), policy=policy)
    if per_group == 1:
        chunks = jax.tree.map(lambda x: x.reshape((n_chunks, b) + x.shape[1:]), padded)
        unroll = CHUNK_UNROLL if n_chunks >= UNROLL_MIN_CHUNKS else 1
        if hoist:
            chunks = (chunks, _split_terms(spec, opt_info, features, state, chunks))
        final, outputs = jax.lax.scan(chunk, state, chunks, unroll=unroll)
    else:   # two levels of rematerialisation: an outer scan over groups, the inner scan checkpointed
        grouped = jax.tree.map(lambda x: x.reshape((n_groups, per_group // per_super, per_super, b) + x.shape[1:]),
                               padded)
        if per_super == 1:
            grouped = jax.tree.map(lambda x: x[:, :, 0], grouped)
        else:
            chunk = jax.checkpoint(
                lambda carry, xs: _super_chunk(spec, opt_info, features, carry, xs, padding_chunks=pad >= b,
                                               operands=operands, initial=state, fresh_opt_state=fresh_opt_state),
                policy=policy)
        # Not unrolled (CHUNK_UNROLL): on an H200 unrolling by 4 made omeganet B1 T1024 H8 D128 bf16
        # fwd+bwd 45.1 -> 42.1 ms and atlas 190.2 -> 185.9, but XLA's compiled memory at B1 T4096
        # grew by a constant 1.2 GiB (omeganet, 4.3 -> 5.5) and 7.4 GiB (atlas, 9.9 -> 17.3) per
        # sequence: unrolled, the backward keeps several chunks' state-sized intermediates at once.
        if one_level:   # each group is one super-chunk, kept at its start
            final, outputs = jax.lax.scan(chunk, state, jax.tree.map(lambda x: x[:, 0], grouped))
        else:
            group = jax.checkpoint(lambda carry, xs: jax.lax.scan(chunk, carry, xs))
            final, outputs = jax.lax.scan(group, state, grouped)
    outputs = outputs.reshape((n_groups * per_group * b,) + outputs.shape[-1:])
    return final, outputs if pad == 0 else outputs[:total]


class _WrappedFeatures:
    """φ as the form uses it, built on ``features``: the same width, kernel and Gram matrix unless
    a subclass says otherwise."""

    def __init__(self, features):
        self.features = features

    def output_dim(self, d):
        return self.features.output_dim(d)

    @property
    def has_kernel(self):
        return self.features.has_kernel

    def gram(self, x, y):
        return self.features.gram(x, y)

    def as_dtype(self, x, dtype, width=None):
        y = self(x).astype(dtype)
        return y if width is None else pad_features(y, width)


class _AlignedFeatures(_WrappedFeatures):
    """φ followed by ``pad`` zero features (FEATURE_ALIGN); its kernel is φ's."""

    def __init__(self, features, pad):
        super().__init__(features)
        self.pad = pad

    def __call__(self, x):
        return pad_features(self.features(x), self.output_dim(x.shape[-1]))

    def as_dtype(self, x, dtype, width=None):
        return self.features.as_dtype(x, dtype, width or self.output_dim(x.shape[-1]))

    def output_dim(self, d):
        return self.features.output_dim(d) + self.pad


class _OperandFeatures(_WrappedFeatures):
    """φ rounded to the dtype θ's products take their operands in (`operand_dtype`; computed in
    float32 first). Every use of φ is such a product or a float32-result Gram matrix of its rows
    (`rows_gram`), so the products' values are unchanged, while φ's rows (the widest arrays of the
    chunk: [n, d_φ], 8448 wide at degree 2, d = 128; formed once in the forward and twice more in
    the rematerialisations) and their cotangents take half the memory traffic. The window cache
    carried between chunks stays float32 (bf16 values, exactly). omeganet B4 T4096 H8 D128 bf16
    fwd+bwd on an H200, interleaved in one command: 237.5 -> 226.2 ms (atlas 2311.7 -> 2212.9 with
    `linalg.gram` too; benchmarks/results/deep_memory_h200_2026-11-27g.md).

    Each piece of φ is formed behind an optimisation barrier: left to fuse, XLA formed the pieces
    inside the fusion that joins a super-chunk's rows (a gather of pairs per element, selected among
    ~30 operands: 0.67 ms for [32 heads, 524, 8448] bf16, against 0.18 ms for forming those rows
    alone), three times per super-chunk. omeganet, same shape and command: 226.0 -> 215.5 ms; with
    the rows joined in place (`_join_rows`) the barrier still pays: 216.4 ms without it against
    200.0 with it (one command)."""

    def __init__(self, features, dtype):
        super().__init__(features)
        self.dtype = dtype

    def __call__(self, x):
        return jax.lax.optimization_barrier(self.features.as_dtype(x, self.dtype))


def _aligned_features(spec, state: MemoryState, steps: Steps, features):
    """(aligned features, pad_state, unpad_state) when φ's width is not a multiple of
    FEATURE_ALIGN, else None. The rows padded are those of the weights that take the memory's input
    itself (found by tracing ``apply_linear``), in θ, the optimizer state and the accumulator, and
    the window cache's inputs. Not with a retention map (a map need not leave zeros alone)."""
    if features is None or isinstance(features, _AlignedFeatures) or spec.retention.has_map:
        return None
    d_phi = features.output_dim(steps.inputs.shape[-1])
    pad = -d_phi % FEATURE_ALIGN
    if pad == 0 or pad > FEATURE_PAD_MAX_FRACTION * d_phi:
        return None

    # The padded width must reach the same weights (an identity residual would need a skip map).
    layers = _linear_layers(spec.memory, state.params, d_phi)
    if layers is None:
        return None
    first = layers[0]
    padded = {key: jax.ShapeDtypeStruct((w.shape[0] + pad,) + w.shape[1:], jnp.float32) if key in first else w
              for key, w in state.params.items()}
    if _linear_layers(spec.memory, padded, d_phi + pad) != layers:
        return None

    def rows(tree, amount):
        def one(path, x):
            key = path[-1].key if path and isinstance(path[-1], jax.tree_util.DictKey) else None
            if key not in first or x.ndim != 2 or x.shape[0] != (d_phi if amount > 0 else d_phi + pad):
                return x
            return jnp.pad(x, [(0, pad), (0, 0)]) if amount > 0 else x[:d_phi]
        return jax.tree_util.tree_map_with_path(one, tree)

    def window(win, amount):
        if win is None:
            return None
        return win._replace(inputs=jnp.pad(win.inputs, [(0, 0), (0, pad)]) if amount > 0 else win.inputs[:, :d_phi])

    def pad_state(st):
        return MemoryState(rows(st.params, 1), rows(st.opt_state, 1), rows(st.accumulator, 1), window(st.window, 1))

    def unpad_state(st):
        return MemoryState(rows(st.params, -1), rows(st.opt_state, -1), rows(st.accumulator, -1), window(st.window, -1))

    return _AlignedFeatures(features, pad), pad_state, unpad_state


def _hoists_terms(state: MemoryState, steps: Steps, features) -> bool:
    """Whether `dual_sequence` forms every chunk's θ-free terms before its scan (the split form's
    `_split_terms`): not with a feature map (φ(q), φ(k) of the whole sequence would be kept for the
    backward pass, d_φ wide; a map no wider than its input, such as the identity, is hoisted),
    nor with an Omega window on packed documents (a restarted chunk's window is the initial one,
    which `_entering_windows` does not know)."""
    d = steps.inputs.shape[-1]
    narrow = features is None or features.output_dim(d) <= d
    return narrow and (state.window is None or steps.restart is None)


def _entering_windows(spec, win0: WindowCache, chunks: Steps, features) -> WindowCache:
    """The Omega window cache entering every chunk, [N, c − 1, ·] each: the c − 1 steps before the
    chunk, from the sequence (φ applied to just these rows) or, before its start, the initial cache."""
    c = spec.window
    n_chunks, b = chunks.active.shape[:2]
    position = jnp.arange(n_chunks)[:, None] * b - (c - 1) + jnp.arange(c - 1)[None, :]   # [N, c − 1]
    in_sequence = position >= 0
    seq_index, cache_index = jnp.maximum(position, 0), jnp.maximum(position + c - 1, 0)
    flat = lambda x: x.reshape((n_chunks * b,) + x.shape[2:])

    def pick(from_sequence, cached):
        mask = in_sequence.reshape(in_sequence.shape + (1,) * (from_sequence.ndim - 2))
        return jnp.where(mask, from_sequence, cached[cache_index])

    raw_inputs = flat(chunks.inputs)[seq_index]
    inputs = pick(raw_inputs if features is None else features(raw_inputs), win0.inputs)
    delta = (jnp.broadcast_to(win0.delta, (n_chunks,) + win0.delta.shape) if chunks.delta is None
             else pick(flat(chunks.delta)[seq_index], win0.delta))
    return WindowCache(inputs, pick(flat(chunks.targets)[seq_index], win0.targets),
                       pick(flat(chunks.gates * chunks.active)[seq_index], win0.weights), delta)


# The split form (the kernel's route): what does not read θ for all chunks at once, the sequential
# pass that carries θ (and the momentum) from chunk to chunk — a source pass and the chunk-end
# update only, on the state-pass kernel — then every chunk's reads at once from its start and end
# states. XLA keeps the fused per-chunk scan above: run in XLA (H100, titans B4 T4096 H8 D128,
# float32) the split form took 46.5 ms forward+backward against the fused scan's 47.7 ms, but
# 14.6 against 10.9 ms forward and 8.0 against 3.4 GiB peak (it keeps every chunk's read
# intermediates for the backward pass).
def _split_terms(spec, opt_info, features, state: MemoryState, chunks: Steps):
    """What does not read θ, for every chunk of one sequence at once (leaves [N, ...])."""
    windows = None if state.window is None else _entering_windows(spec, state.window, chunks, features)
    return jax.vmap(lambda xc, win: chunk_terms(spec, opt_info, features, xc, win))(chunks, windows)


def _split_reads(spec, starts: MemoryState, final: MemoryState, terms: ChunkTerms, sources=None, operands=None):
    """Every chunk's outputs [N, b, d_out] from its start and end states (chunk-parallel).
    ``sources``: every chunk's source pass as the state pass formed it (an ``MLPSources`` of a
    depth-2 MLP, [N, n, ...]), else it is formed again here from the start states."""
    ends = jax.tree.map(lambda s, f: jnp.concatenate([s[1:], f[None]]), starts.params, final.params)

    def read(start: MemoryState, params_end, chunk_terms_, src):
        if src is None:
            layer_inputs, cotangents = source_pass(spec, start.params, chunk_terms_, operands=operands)
        else:
            layer_inputs = {"W0": chunk_terms_.src_inputs, "W1": src.hidden}
            cotangents = {"W0": src.d0, "W1": spec.objective.output_grad(src.y, chunk_terms_.src_targets,
                                                                         chunk_terms_.src_delta)}
        momentum0 = None if chunk_terms_.momentum_rows is None else start.opt_state.momentum
        return chunk_read(spec, start.params, momentum0, params_end, chunk_terms_, layer_inputs, cotangents,
                          operands=operands)

    return jax.vmap(read)(starts, ends, terms, sources)


def _reads_on_kernel(low_precision: bool, terms: ChunkTerms) -> bool:
    """Whether `dual_batched_kernel` runs the reads on the GPU kernels, with the state pass in one
    custom VJP (`ops.deep_memory.mlp_state_pass_and_reads`): bf16 inputs on a GPU (float32 ones
    keep XLA's reads, as they keep XLA's state pass under impl="auto"; on a TPU the reads have no
    kernel), gradients at θ₀ (`kernel_gap` has checked the rest: a depth-2 MLP, ℓ2, no chunk-end
    map)."""
    return low_precision and jax.default_backend() != "tpu" and terms.src_scale is None


def keeps_every_chunk_state(state: MemoryState, chunk_size: int, boundary_bytes_per_token=None) -> bool:
    """Whether the dual form keeps every chunk's state (one sequence and head's ``state``): the
    split form, whose sequential pass a kernel can run; else chunks are grouped (fused form)."""
    budget = BOUNDARY_BYTES_PER_TOKEN if boundary_bytes_per_token is None else boundary_bytes_per_token
    return _carried_bytes(state) <= chunk_size * budget


def _carried_bytes(state: MemoryState) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state.params, state.opt_state, state.accumulator)))


def kernel_gap(spec, state: MemoryState, steps: Steps, *, chunk_size: int, d_in: int | None = None) -> str | None:
    """Why the state-pass kernel (``ops.deep_memory``) cannot run the dual form of these steps (one
    sequence and head), or None when it can."""
    from atlas_jax.ops.deep_memory import kernel_covers

    if not covers(spec, state, steps, d_in=d_in):
        return "a spec outside the dual form"
    if not keeps_every_chunk_state(state, chunk_size):
        return "a state too large to keep per chunk (the grouped form)"
    return kernel_covers(spec, d_in or steps.inputs.shape[-1], steps.targets.shape[-1])


def dual_batched_kernel(spec, state: MemoryState, steps: Steps, *, chunk_size: int, features=None,
                        low_precision: bool = False):
    """The split dual form for [B, H, S, ...] steps (padded to a multiple of ``chunk_size``) with
    its sequential pass on the state-pass kernel (``ops.deep_memory.mlp_state_pass``, impl
    "pallas") and, for bf16 inputs on a GPU, its reads on theirs (`_reads_on_kernel`);
    ``kernel_gap`` must be None. ``low_precision``: the kernels' dots and the reads' products with
    θ take bf16 operands (float32 accumulation; `operand_dtype`). Returns (final state
    [B, H, ...], outputs [B, H, S, d_out])."""
    from atlas_jax.ops import deep_memory
    from atlas_jax.ops.deep_memory import MLPStates

    opt_info = inner_opt.info(spec.optimizer)
    b = chunk_size
    n_chunks = steps.active.shape[2] // b
    chunks = jax.tree.map(lambda x: x.reshape(x.shape[:2] + (n_chunks, b) + x.shape[3:]), steps)
    vmap2 = lambda f: jax.vmap(jax.vmap(f))
    with jax.named_scope(SCOPES["terms"]):
        terms = vmap2(lambda st, xc: _split_terms(spec, opt_info, features, st, xc))(state, chunks)

    momentum = terms.momentum_rows is not None
    m = state.opt_state.momentum if momentum else None
    first = MLPStates(state.params["W0"], state.params["W1"], None if m is None else m["W0"],
                      None if m is None else m["W1"])
    end = lambda x: None if x is None else x[..., -1]
    a = terms.src_inputs.astype(jnp.bfloat16) if low_precision else terms.src_inputs
    pass_args = (first, a, terms.src_targets, terms.state_rows[..., -1, :], terms.momentum_rows,
                 terms.from_start[..., -1], end(terms.state_carry), terms.momentum_carry)
    memory = dict(activation=spec.memory.activation, residual=spec.memory.residual)

    def as_state(k, opt_state) -> MemoryState:
        if momentum:
            opt_state = inner_opt.MomentumState({"W0": k.m0, "W1": k.m1})
        return MemoryState({"W0": k.w0, "W1": k.w1}, opt_state, None, None)

    on_kernel = _reads_on_kernel(low_precision, terms)
    if on_kernel:
        # The pass and the reads in one custom VJP: the reads' start-state cotangents reach the
        # pass's backward kernel as their rank-b factors (`ops.deep_memory.mlp_state_pass_and_reads`),
        # rather than XLA writing them θ-sized for the kernel to load. titans' layer, bf16 fwd+bwd on
        # an H200 against the two ops apart, one command each: B4 T4096 H8 D128 0.940 (2026-11-28),
        # B1 T16384 0.962 (2026-11-29, 17.01 -> 16.37 ms; 1.022 on 2026-11-28, before the backward
        # kernel's paired products and fewer whole-row loads).
        with jax.named_scope(SCOPES["state_pass"]):
            final_k, outputs = deep_memory.mlp_state_pass_and_reads(
                *pass_args, terms.queries.astype(a.dtype), terms.from_start, terms.state_carry, terms.state_rows,
                impl="pallas", **memory)
        final = as_state(final_k, state.opt_state)
    else:
        # The pass also returns every chunk's source pass (H, D, Y), which the reads need: formed
        # once, in the kernel (whose backward takes their cotangents), instead of again in XLA from
        # the start states. titans B4 T4096 H8 D128 bf16 fwd+bwd on an H200, alternated in one
        # command: 24.8 against 27.5 ms, peak 6.11 against 6.44-6.65 GiB.
        with jax.named_scope(SCOPES["state_pass"]):
            starts_k, final_k, sources = deep_memory.mlp_state_pass(*pass_args, impl="pallas", sources=True,
                                                                    **memory)
        # Without momentum the optimizer's state does not change: the reads get it per chunk.
        per_chunk = jax.tree.map(lambda x: jnp.broadcast_to(x[:, :, None], x.shape[:2] + (n_chunks,) + x.shape[2:]),
                                 state.opt_state)
        starts, final = as_state(starts_k, per_chunk), as_state(final_k, state.opt_state)
        with jax.named_scope(SCOPES["reads"]):
            read = lambda st, fi, tm, src: _split_reads(spec, st, fi, tm, src, operand_dtype(low_precision))
            outputs = vmap2(read)(starts, final, terms, sources)
    window = None if state.window is None else jax.tree.map(lambda x: x[:, :, -1], terms.next_window)
    outputs = outputs.reshape(outputs.shape[:2] + (n_chunks * b,) + outputs.shape[4:])
    return final._replace(window=window), outputs


def state_bytes(spec, *, d_k: int, d_v: int, heads: int = 1) -> dict:
    """Bytes of one memory layer's state per sequence at ``heads`` heads of widths d_k / d_v:
    θ, the inner optimizer's state, and the rest (retention accumulator, Omega-window cache).
    (``atlas_jax.models.memory_state_size`` counts the same in floats for a model config.)"""
    shapes = jax.eval_shape(lambda: spec.init_state(jax.random.PRNGKey(0), batch=1, heads=heads, d_k=d_k, d_v=d_v))
    size = lambda tree: int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
    theta, optimizer = size(shapes.params), size(shapes.opt_state)
    other = size(shapes.accumulator) + size(shapes.window)
    return {"theta": theta, "optimizer": optimizer, "other": other, "total": theta + optimizer + other}
