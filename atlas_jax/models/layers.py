"""The layers of the language models: the papers' memory layer, softmax attention, short
convolution, SwiGLU MLP and RoPE, as Flax NNX modules (``*, rngs, dtype, param_dtype``).

Every sequence-mixing layer offers three calls with the same parameters:

  ``layer(x, segment_ids=None, positions=None)``  training / scoring over [B, T, width]
  ``layer.prefill(x, max_len)``                    the same output plus the cache decoding continues from
  ``layer.decode(x, cache, pos, chunk_end=None)``  one token [B, 1, width] at absolute position ``pos``
                                                   (``chunk_end``: whether ``pos`` ends a memory chunk,
                                                   when the caller knows it while tracing)

The memory layer (ATLAS §5 / MIRAS / Titans backbone, fla's GatedDeltaNet layer): linear q/k/v
projections, a causal depthwise short convolution (kernel 4, SiLU) on each, L2-normalised q and k,
the preset's feature map φ with its learnable coefficients, per-token gates computed from the input
(β step size, α retention as log-decay g, ν momentum decay, γ Omega-window gate, δ objective knob;
the channel-wise decay through a low-rank projection), multi-head, a per-head RMSNorm of the output
with a SiLU output gate, and a learnable θ_0 for deep memories. The recurrence itself is the core's
(``MemorySpec.__call__`` or the preset's closed form), called from ``run_memory`` only; or, with
``step_schedule`` "chunk" / "chunk_from_theta0", titans-pytorch's schedule of one inner step per
chunk (`ops.deep_memory.chunk_step_memory`, called from ``run_chunk_steps`` only).
"""
from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from atlas_jax import optimizers as inner_opt
from atlas_jax.kernels.delta_family.support import fused_gate
from atlas_jax.memory import LinearMemory
from atlas_jax.models.config import STEP_SCHEDULES
from atlas_jax.presets import ClosedForm
from atlas_jax.spec import MemoryState

__all__ = ["DTYPES", "BATCH_MESH_AXES", "per_batch_shard", "SwiGLU", "ShortConv", "Attention", "MemoryLayer", "apply_rope", "run_memory", "packs_documents", "takes_restarts",
           "STEP_SCHEDULES", "chunk_steps_refusal", "run_chunk_steps",
           "chunk_aligned_layout", "to_chunk_aligned", "from_chunk_aligned",
           "document_starts", "document_positions", "to_document_rows", "from_document_rows", "l2_normalize"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The mesh axes that split a batch's rows (atlas_jax.train's "batch" logical axis maps here too).
# Under a mesh with these axes the delta-family kernels run on each device's rows (shard_map):
# XLA's partitioner cannot split a Pallas custom call, and would gather the batch onto every device.
BATCH_MESH_AXES = ("data", "fsdp")
# checkpoint_name of the memory layer's recurrence output (remat "dots_and_kernels" keeps it).
MEMORY_OUTPUT = "memory_output"



def delta_family_op(spec):
    """The atlas_jax.ops function that runs ``spec`` exactly (DeltaNet, Gated DeltaNet, KDA, RWKV-7,
    DeltaProduct, TTT-linear: linear memory, identity φ, ℓ2, GD, forget-then-write), else None."""
    from atlas_jax import ops
    from atlas_jax.features import Identity
    from atlas_jax.objectives import L2
    if (isinstance(spec, ClosedForm) or not spec.chunked_is_exact or spec.opt_kind != "gd"
            or type(spec.feature_map) is not Identity or type(spec.objective) is not L2
            or spec.retention.log_decay is not None or spec.window > 1
            or (spec.retention.decoupled and spec.retention.decay != "none")):
        return None
    if spec.steps > 1:
        return ops.delta_product
    return {"none": ops.delta_rule, "scalar": ops.gated_delta_rule, "channel": ops.kda}[spec.retention.decay]


def memory_op(spec, impl: str, initial_state=None):
    """The atlas_jax.ops function ``run_memory`` runs ``spec`` on, or None (MemorySpec's forms): the
    recurrent impl stays the core's float32 scan reference."""
    op = delta_family_op(spec)
    if op is None or impl == "recurrent" or not (initial_state is None or isinstance(initial_state, MemoryState)):
        return None
    return op


def run_memory(spec, q, k, v, knobs: dict, *, impl: str, chunk_size: int, initial_state=None,
               output_final_state: bool = False, feature_params=None, scale: float = 1.0,
               fused: dict | None = None, documents: tuple | None = None, gradient_point=None):
    """The one call into the core: (o [B, T, H, V], final state or None).

    The exact delta family goes to atlas_jax.ops directly (the same algorithm MemorySpec's chunked
    form dispatches to) so that bf16 operands reach the Pallas kernels as bf16: MemorySpec casts
    q, k, v to float32 first. ``fused``: fla's activation arguments for that op
    (use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel); knobs' g and beta are then
    the op's raw inputs, so any other route is an error.

    ``documents``: (segment_ids [B, T], max_documents) of packed rows, every document starting
    from the initial state (no final state). The cheapest exact layout the route allows: one
    varlen row for the delta-family kernels (``packs_documents``: B·T tokens of work), documents
    on chunk boundaries with restarts for the chunk-start forms (``takes_restarts``: about
    T + (M − 1)·C per row), else one row per document (M·T). Under a mesh the layout is built inside
    each device's shard (``per_batch_shard``): its scatters have data-dependent indices, which
    XLA's partitioner would otherwise run on the whole batch on every device. ``gradient_point``:
    MemorySpec's (a chunk-start memory's decode step), for the recurrent form."""
    if gradient_point is not None:
        return spec(q, k, v, **knobs, impl=impl, chunk_size=chunk_size, initial_state=initial_state,
                    output_final_state=output_final_state, feature_params=feature_params, scale=scale,
                    gradient_point=gradient_point)
    op = memory_op(spec, impl, initial_state)
    if fused and op is None:
        raise ValueError(f"run_memory: {sorted(fused)} are arguments of the delta-family ops, which do not "
                         f"run {getattr(spec, 'name', spec)!r} with impl={impl!r} and this initial state")
    if documents is not None and (output_final_state or isinstance(initial_state, MemoryState)):
        raise ValueError("run_memory: documents (packed rows) start every document from the initial parameters "
                         "and return no final state; pass initial_state=None (or θ_0's params) and "
                         "output_final_state=False")
    if isinstance(spec, ClosedForm):
        extra = {"beta": knobs["beta"]} if "beta" in knobs else {}
        closed = lambda q, k, v, extra: spec(q, k, v, scale=scale, **extra)
        if documents is None:
            return closed(q, k, v, extra), None
        return _in_document_rows(closed, documents, q, k, v, extra), None
    if op is not None:
        state = None if initial_state is None else initial_state.params["S"]
        rows = {"q": q, "k": k, "v": v, "beta": knobs["beta"], "initial_state": state}
        if op.__name__ != "delta_rule":
            rows["g"] = knobs.get("g")
        # one document per row (max_documents 1) is a mask (to_document_rows), not a layout
        varlen = documents is not None and documents[1] > 1 and packs_documents(spec, q, k, v, knobs, impl=impl,
                                                                                chunk_size=chunk_size)
        if documents is not None:
            rows["segment_ids"] = documents[0]
        # fla's activation parameters (A_log, dt_bias) go in as arrays, its flags stay static
        fused = fused or {}
        fused_arrays = {name: x for name, x in fused.items() if isinstance(x, jax.Array)}

        def run_op(rows, fused_arrays, cu_seqlens=None):
            args = (rows["q"], rows["k"], rows["v"], rows["beta"]) if op.__name__ == "delta_rule" else \
                (rows["q"], rows["k"], rows["v"], rows["g"], rows["beta"])
            return op(*args, scale=scale, initial_state=rows["initial_state"], output_final_state=output_final_state,
                      impl="pallas" if cu_seqlens is not None else impl, chunk_size=chunk_size,
                      cu_seqlens=cu_seqlens, **{**fused, **fused_arrays})

        def call(rows, fused_arrays):
            rows = dict(rows)
            if documents is None:
                return run_op(rows, fused_arrays)
            segment_ids = rows.pop("segment_ids")
            if not varlen:
                per_document = lambda q, k, v, knobs: run_op({"q": q, "k": k, "v": v, **knobs}, fused_arrays)[0]
                knobs = {name: rows[name] for name in ("beta", "g", "initial_state") if name in rows}
                return _in_document_rows(per_document, (segment_ids, documents[1]), rows["q"], rows["k"],
                                         rows["v"], knobs), None
            batch, time = segment_ids.shape
            cu_seqlens, overflow = _varlen_offsets(segment_ids, batch * documents[1])
            flat = lambda x: None if x is None else x.reshape((1, batch * time) + x.shape[2:])
            o, final = run_op({name: flat(x) for name, x in rows.items()}, fused_arrays, cu_seqlens)
            # tokens of documents past the static budget would share a state: NaN, loud not wrong
            o = jnp.where(overflow.reshape(1, -1, 1, 1), jnp.nan, o).reshape((batch, time) + o.shape[2:])
            return o, final

        o, final = per_batch_shard(call, rows, q.shape[0], fused_arrays)
        if final is not None:
            batch, _, heads, d_k = q.shape
            final = spec.init_state(None, batch=batch, heads=heads, d_k=d_k, d_v=v.shape[-1], params={"S": final})
        return o, final
    if not output_final_state and not isinstance(initial_state, MemoryState):
        # The deep-memory and Omega kernels are custom calls too (impl "pallas", or "auto" on a
        # GPU/TPU): each device runs its own rows; the XLA forms lose nothing by it. θ_0 and the
        # feature coefficients are the same on every device.
        rows = {"q": q, "k": k, "v": v, "knobs": knobs}
        if documents is not None:
            rows["segment_ids"] = documents[0]

        def call(rows, shared):
            def memory(q, k, v, knobs, **restarts):
                return spec(q, k, v, **knobs, impl=impl, chunk_size=chunk_size, initial_state=shared["initial_state"],
                            feature_params=shared["feature_params"], scale=scale, **restarts)[0]
            if documents is None:
                return memory(rows["q"], rows["k"], rows["v"], rows["knobs"])
            if documents[1] == 1 or not takes_restarts(spec, impl):
                return _in_document_rows(memory, (rows["segment_ids"], documents[1]), rows["q"], rows["k"],
                                         rows["v"], rows["knobs"])
            with jax.named_scope(LAYOUT_SCOPE):
                doc, pos = document_positions(rows["segment_ids"])
                dest, length, restarts, valid, overflow = chunk_aligned_layout(doc, pos, chunk_size, documents[1])
                aligned = lambda y: to_chunk_aligned(y, dest, length)
                q, k, v, knobs = aligned(rows["q"]), aligned(rows["k"]), aligned(rows["v"]), jax.tree.map(aligned, rows["knobs"])
            o = memory(q, k, v, knobs, restarts=restarts, valid=valid)
            with jax.named_scope(LAYOUT_SCOPE):
                return from_chunk_aligned(o, dest, overflow)

        shared = {"initial_state": initial_state, "feature_params": feature_params}
        return per_batch_shard(call, rows, q.shape[0], shared), None
    return spec(q, k, v, **knobs, impl=impl, chunk_size=chunk_size, initial_state=initial_state,
                output_final_state=output_final_state, feature_params=feature_params, scale=scale)


def _in_document_rows(memory, documents, q, k, v, knobs):
    """memory(q, k, v, knobs) -> o run with each packed document in its own row (``to_document_rows``)."""
    doc, pos = document_positions(documents[0])
    rows = lambda y: None if y is None else to_document_rows(y, doc, pos, documents[1])
    o = memory(rows(q), rows(k), rows(v), {name: rows(x) for name, x in knobs.items()})
    return from_document_rows(o, doc, pos, documents[1])


def packs_documents(spec, q, k, v, knobs: dict, *, impl: str, chunk_size: int, initial_state=None) -> bool:
    """Whether run_memory can take packed documents as one varlen row (``documents=``): the spec
    runs on a delta-family op whose Pallas kernels this call reaches. The XLA forms take only
    concrete ``cu_seqlens``; there each document gets its own row (``to_document_rows``)."""
    from atlas_jax import ops
    op = memory_op(spec, impl, initial_state)
    if op is None or initial_state is not None:
        return False
    g = None if op.__name__ == "delta_rule" else knobs.get("g")
    return ops.runs_kernel(op.__name__, q, k, v, knobs["beta"], g, impl=impl, chunk_size=chunk_size)


def _varlen_offsets(segment_ids, max_sequences: int):
    """segment_ids [B, T] -> (cu_seqlens int32 [max_sequences + 1] of the rows laid end to end,
    every row and every change of segment id starting a sequence (unused ones empty at the end);
    overflow bool [B·T]: tokens of sequences past max_sequences)."""
    batch, time = segment_ids.shape
    starts = document_starts(segment_ids).reshape(-1)
    first = jnp.nonzero(starts, size=max_sequences, fill_value=batch * time)[0].astype(jnp.int32)
    cu_seqlens = jnp.concatenate([first, jnp.full((1,), batch * time, jnp.int32)])
    overflow = jnp.cumsum(starts.astype(jnp.int32)) > max_sequences
    return cu_seqlens, overflow


def per_batch_shard(fn, rows: dict, batch: int, shared=None):
    """fn(rows, shared) with every array of ``rows`` (leading axis: the ``batch`` rows) split over
    the context mesh's BATCH_MESH_AXES, each device running fn on its own rows, and ``shared`` (a
    pytree, e.g. parameters) whole on every device; fn(rows, shared) as is outside a mesh. fn's
    outputs are row-leading arrays (or None). A non-batch mesh axis of size > 1 (tensor) stays
    automatic inside fn; otherwise every axis is manual and fn compiles as one device's program.

    Pass what fn needs through ``shared``, never by closure: a traced array closed over keeps the
    outer mesh's sharding, and transposing a checkpointed scan inside shard_map then fails
    ("Context mesh ... should match the mesh of sharding")."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in BATCH_MESH_AXES if not mesh.empty and a in mesh.axis_names and mesh.shape[a] > 1)
    shards = math.prod(mesh.shape[a] for a in axes)
    if not axes or batch % shards:
        return fn(rows, shared)
    spec = jax.sharding.PartitionSpec(axes)
    # check_vma off: Pallas calls carry no varying-axes annotation
    # every axis manual where the others are trivial: a partly automatic body is still run through
    # the SPMD partitioner, whose annotations change the per-device program XLA compiles
    others = [a for a in mesh.axis_names if a not in axes]
    manual = set(mesh.axis_names) if all(mesh.shape[a] == 1 for a in others) else set(axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, jax.sharding.PartitionSpec()), out_specs=spec,
                         axis_names=manual, check_vma=False)(rows, shared)


def l2_normalize(x, eps: float = 1e-6):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _inverse_softplus(y):
    return y + math.log(-math.expm1(-y))


# ---- packed documents ---------------------------------------------------------------------------
def document_starts(segment_ids):
    """bool [B, T]: where a document begins (each row's first token, every change of segment id)."""
    return jnp.concatenate([jnp.ones(segment_ids.shape[:1] + (1,), bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def document_positions(segment_ids):
    """(document index within the row, position within the document), both [B, T] int32.
    A document is a maximal run of equal segment ids."""
    batch, time = segment_ids.shape
    starts = document_starts(segment_ids)
    doc = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1
    t = jnp.broadcast_to(jnp.arange(time, dtype=jnp.int32), (batch, time))
    start_of_doc = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return doc, t - start_of_doc


def to_document_rows(x, doc, pos, max_documents: int):
    """[B, T, ...] -> [B·M, T, ...]: each document moved to the start of its own row (zeros after it),
    so a recurrence run over the rows starts every document from θ_0 — exactly, for any preset."""
    batch, time = doc.shape
    if max_documents == 1:    # the first document already starts its row: mask, not scatter (no copy)
        return jnp.where((doc == 0).reshape(doc.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))
    rows = jnp.zeros((batch, max_documents, time) + x.shape[2:], x.dtype)
    b = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, time))
    rows = rows.at[b, doc, pos].set(x, mode="drop")
    return rows.reshape((batch * max_documents, time) + x.shape[2:])


def takes_restarts(spec, impl: str) -> bool:
    """Whether ``spec`` runs packed documents in one row with restarts (MemorySpec's ``restarts``):
    the recurrent form, and the chunk-start forms (dual and materialising) on XLA. The exact
    delta-family and Omega routes and the kernels take document rows instead."""
    from atlas_jax.forms.chunked import is_exact, is_omega_exact
    if isinstance(spec, ClosedForm) or impl == "pallas" or spec.steps > 1:
        return False
    return impl == "recurrent" or not (is_exact(spec) or is_omega_exact(spec))


# jax.named_scope of the packed rows' chunk-aligned layout (its scatters and gathers): a profile
# attributes their kernels to it (benchmarks/deep_memory.py --trace).
LAYOUT_SCOPE = "packed_layout"


def chunk_aligned_layout(doc, pos, chunk_size: int, max_documents: int, *, gap: bool = False):
    """Packed rows -> rows where every document starts on a chunk boundary (zeros pad each to a
    multiple of ``chunk_size``), so a chunk-start form restarts exactly where a document does.
    ``gap``: every document is followed by at least one padding token, so the token before each
    restart is padding (``chunk_step_memory``'s ``padding_before_restarts``).

    Returns (dest [B, T] each token's position in the new rows, length T' (a multiple of
    ``chunk_size``, room for max_documents documents), restarts [B, T'] at each document's first
    position, valid [B, T'] on the documents' tokens (False on the padding), overflow [B, T]:
    tokens of documents past max_documents). A row's first document starts at 0, a chunk boundary
    already, and only the documents before its last are padded, so T' is T + (M − 1)·(C − 1)
    (T + (M − 1)·C + 1 with ``gap``) rounded up to a multiple of C, where one row per document
    (``to_document_rows``) costs M·T. (The demo's rows, T 128 with up to 2 documents at C 64:
    3 chunks instead of the 4 of T + M·(C − 1).)"""
    batch, time = doc.shape
    c, m = chunk_size, max_documents
    clipped = jnp.minimum(doc, m - 1)
    b = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, time))
    lengths = jnp.zeros((batch, m), jnp.int32).at[b, clipped].add(1)
    padded = (lengths + c - 1 + gap) // c * c
    offsets = jnp.cumsum(padded, axis=1) - padded                          # [B, M]
    # the last document's tokens end by T + (M − 1)(C − 1 + gap), and a gap follows it too
    length = -(-(time + (m - 1) * (c - 1 + gap) + gap) // c) * c
    overflow = doc >= m
    dest = jnp.where(overflow, length, offsets[b, clipped] + pos)            # out of range: dropped
    starts = jnp.where(lengths > 0, offsets, length)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, m))
    restarts = jnp.zeros((batch, length), bool).at[rows, starts].set(True, mode="drop")
    valid = jnp.zeros((batch, length), bool).at[b, dest].set(True, mode="drop")
    return dest, length, restarts, valid, overflow


@jax.custom_vjp
def _take_rows(x, index, taken, inverse, inverse_taken):
    """out[b, i] = x[b, index[b, i]] where taken[b, i], else 0: rows moved by a one-to-one map
    between the taken positions and x's ``inverse_taken`` ones (``inverse`` its inverse). Its
    transpose is the same gather by the inverse, where autodiff would scatter-add."""
    return _gather_rows(x, index, taken)


def _gather_rows(x, index, taken):
    batch = index.shape[0]
    out = x[jnp.arange(batch)[:, None], jnp.clip(index, 0, x.shape[1] - 1)]
    return jnp.where(taken.reshape(taken.shape + (1,) * (out.ndim - 2)), out, jnp.zeros((), out.dtype))


def _take_rows_fwd(x, index, taken, inverse, inverse_taken):
    return _gather_rows(x, index, taken), (inverse, inverse_taken)


def _take_rows_bwd(residuals, d_out):
    inverse, inverse_taken = residuals
    return _gather_rows(d_out, inverse, inverse_taken), None, None, None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _source_positions(dest, length: int):
    """[B, T'] the packed position each chunk-aligned position holds (T where it holds padding)."""
    batch, time = dest.shape
    b = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, time))
    positions = jnp.broadcast_to(jnp.arange(time, dtype=jnp.int32), (batch, time))
    return jnp.full((batch, length), time, jnp.int32).at[b, dest].set(positions, mode="drop")


def to_chunk_aligned(x, dest, length: int):
    """[B, T, ...] -> [B, T', ...] by ``chunk_aligned_layout``'s dest (zeros between documents).
    A gather both ways (forward and backward): the layout is one-to-one on the documents' tokens."""
    source = _source_positions(dest, length)
    return _take_rows(x, source, source < dest.shape[1], dest, dest < length)


def from_chunk_aligned(y, dest, overflow):
    """Inverse of ``to_chunk_aligned``; tokens of documents past max_documents become NaN."""
    source = _source_positions(dest, y.shape[1])
    out = _take_rows(y, dest, dest < y.shape[1], source, source < dest.shape[1])
    return jnp.where(overflow.reshape(overflow.shape + (1,) * (out.ndim - 2)), jnp.nan, out)


def from_document_rows(y, doc, pos, max_documents: int):
    """Inverse of ``to_document_rows``; a row with more than M documents becomes NaN (loud, not wrong)."""
    batch, time = doc.shape
    if max_documents == 1:
        return jnp.where((doc >= 1).reshape(doc.shape + (1,) * (y.ndim - 2)), jnp.nan, y)
    y = y.reshape((batch, max_documents) + y.shape[1:])
    b = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, time))
    out = y[b, jnp.minimum(doc, max_documents - 1), pos]
    overflow = (doc >= max_documents).reshape(doc.shape + (1,) * (out.ndim - 2))
    return jnp.where(overflow, jnp.nan, out)


# ---- small pieces -------------------------------------------------------------------------------
class SwiGLU(nnx.Module):
    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate, self.up, self.down = linear(width, hidden), linear(width, hidden), linear(hidden, width)

    def __call__(self, x, **_):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))

    def prefill(self, x, max_len):
        return self(x), {}

    def decode(self, x, cache, pos, *, chunk_end=None):
        return self(x), cache


def _select(last, new, old):
    """``new`` where ``last`` else ``old``, leaf by leaf; ``last`` a traced bool or a Python one
    (then no select is traced)."""
    if isinstance(last, bool):
        return new if last else old
    return jax.tree.map(lambda n, o: jnp.where(last, n, o), new, old)


def _cond(last, when_true, when_false, operand):
    """`jax.lax.cond`, or the one branch a Python bool ``last`` picks."""
    if isinstance(last, bool):
        return (when_true if last else when_false)(operand)
    return jax.lax.cond(last, when_true, when_false, operand)


def _shift(x, lag):
    """x_{t−lag} along axis 1, zeros before the start."""
    return jnp.pad(x, ((0, 0), (lag, 0)) + ((0, 0),) * (x.ndim - 2))[:, :x.shape[1]]


def _unshift(x, lag):
    """x_{t+lag} along axis 1, zeros after the end."""
    return jnp.pad(x, ((0, 0), (0, lag)) + ((0, 0),) * (x.ndim - 2))[:, lag:]


def _same_document(segment_ids, lag):
    """[B, T, 1]: token t − lag exists and is in token t's document (None: no packing)."""
    if segment_ids is None:
        return None
    prev = jnp.pad(segment_ids, ((0, 0), (lag, 0)), constant_values=-1)[:, :segment_ids.shape[1]]
    return (prev == segment_ids)[..., None]


def _conv_pre(x, w, segment_ids):
    """Σ_lag w[S−1−lag] ⊙ x_{t−lag} (masked across documents), float32 [B, T, C]."""
    size = w.shape[0]
    w = w.astype(jnp.float32)
    out = x.astype(jnp.float32) * w[size - 1]
    for lag in range(1, size):
        shifted = _shift(x, lag)
        same = _same_document(segment_ids, lag)
        if same is not None:
            shifted = jnp.where(same, shifted, jnp.zeros((), x.dtype))
        out = out + shifted.astype(jnp.float32) * w[size - 1 - lag]
    return out


@jax.custom_vjp
def causal_conv_silu(x, w, segment_ids):
    """silu(causal depthwise conv of x [B, T, C] with w [S, C]) in x.dtype, float32 inside.

    The backward keeps only x and recomputes the pre-activation once, materialised behind an
    optimization barrier so that XLA does not re-derive it inside each consumer (H100, bf16
    [8, 4096, 1024]: fwd+bwd 0.32 ms)."""
    return jax.nn.silu(_conv_pre(x, w, segment_ids)).astype(x.dtype)


def _causal_conv_silu_fwd(x, w, segment_ids):
    return causal_conv_silu(x, w, segment_ids), (x, w, segment_ids)


def _causal_conv_silu_bwd(res, dy):
    x, w, segment_ids = res
    size = w.shape[0]
    pre = _conv_pre(x, w, segment_ids)
    sig = jax.nn.sigmoid(pre)
    # Materialised once (the barrier stops XLA from fusing the recomputation into each use).
    dpre = jax.lax.optimization_barrier(dy.astype(jnp.float32) * sig * (1.0 + pre * (1.0 - sig)))
    dx = jnp.zeros(x.shape, jnp.float32)
    dw = []
    for lag in range(size):
        same = _same_document(segment_ids, lag) if lag else None
        masked = dpre if same is None else jnp.where(same, dpre, 0.0)
        dx = dx + _unshift(masked, lag) * w[size - 1 - lag].astype(jnp.float32)
        dw.append(jnp.sum(masked * _shift(x, lag).astype(jnp.float32), axis=(0, 1)))
    dw = jnp.stack(dw[::-1]).astype(w.dtype)       # dw[S−1−lag]
    return dx.astype(x.dtype), dw, None


causal_conv_silu.defvjp(_causal_conv_silu_fwd, _causal_conv_silu_bwd)


class ShortConv(nnx.Module):
    """Causal depthwise convolution over time (kernel ``size``) followed by SiLU; weight index
    size−1 multiplies the current token. Restarts at document boundaries when given segment ids."""

    def __init__(self, channels: int, size: int, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        bound = 1.0 / math.sqrt(size)
        self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (size, channels), param_dtype, -bound, bound))
        self.size, self.dtype = size, dtype

    def __call__(self, x, segment_ids=None):
        return self.pieces([x], segment_ids)[0]

    def pieces(self, xs, segment_ids=None):
        """The convolution of inputs that together hold the channels, in order, each with its
        columns of the kernel (one parameter for q, k, v; no concatenated copy of them)."""
        w = self.kernel[...].astype(self.dtype)
        out, start = [], 0
        for x in xs:
            width = x.shape[-1]
            # A sum over the lags: on an H100 this beat XLA's depthwise conv_general_dilated (340m
            # GDN step 185 vs 233 ms) and a Pallas kernel of ours (fwd+bwd at [8, 4096, 1024] bf16
            # 0.32 vs 0.35 ms; benchmarks/results/lm_throughput_h100_2026-11-25.md).
            out.append(causal_conv_silu(x.astype(self.dtype), w[:, start:start + width], segment_ids))
            start += width
        if start != w.shape[1]:
            raise ValueError(f"ShortConv: the inputs hold {start} channels, the kernel {w.shape[1]}")
        return out

    def history(self, x):
        """The last size−1 inputs [B, size−1, C] (zeros before the sequence start)."""
        padded = jnp.pad(x, ((0, 0), (self.size - 1, 0), (0, 0)))
        return padded[:, padded.shape[1] - (self.size - 1):]

    def step(self, x, history):
        """One token x [B, 1, C] after ``history`` -> (output [B, 1, C], new history)."""
        window = jnp.concatenate([history.astype(x.dtype), x], axis=1)       # [B, size, C]
        w = self.kernel[...].astype(self.dtype)
        out = jnp.einsum("BSC,SC->BC", window.astype(jnp.float32), w.astype(jnp.float32))[:, None]
        return jax.nn.silu(out).astype(self.dtype), window[:, 1:]


def apply_rope(x, positions, theta: float):
    """Rotary embedding (half-split pairs) of x [B, T, H, D] at integer positions [B, T]."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None, None] * freq                # [B, T, 1, half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:2 * half]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if x.shape[-1] % 2:
        rotated.append(xf[..., 2 * half:])
    return jnp.concatenate(rotated, axis=-1).astype(x.dtype)


# ---- attention ----------------------------------------------------------------------------------
def causal_attention(q, k, v, window: int | None):
    """Causal (sliding-window) attention without an explicit mask: cuDNN's flash attention on GPU
    for bf16/fp16 operands (``implementation=None`` would pick XLA), XLA otherwise."""
    local = None if window is None else (window - 1, 0)
    use_cudnn = (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
                 and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)
    if use_cudnn:
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                                implementation="cudnn")
        except Exception:   # a shape or cuDNN version it does not cover: XLA computes the same
            pass
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local)


class Attention(nnx.Module):
    """Causal softmax attention with RoPE, full or sliding-window (``window`` tokens incl. the
    current one), through ``jax.nn.dot_product_attention`` (cuDNN flash attention on GPU when no
    explicit mask is needed). Decoding keeps a KV cache: ``max_len`` slots, or a ring buffer of
    ``window`` slots for a sliding window."""

    def __init__(self, width: int, heads: int, *, window: int | None, rope_theta: float, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj = linear(width, width), linear(width, width), linear(width, width)
        self.o_proj = linear(width, width)
        self.heads, self.head_dim, self.window, self.rope_theta, self.dtype = heads, width // heads, window, rope_theta, dtype

    def _qkv(self, x, positions):
        split = lambda y: y.reshape(y.shape[:2] + (self.heads, self.head_dim))
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        return apply_rope(q, positions, self.rope_theta), apply_rope(k, positions, self.rope_theta), v

    def _out(self, o):
        return self.o_proj(o.reshape(o.shape[:2] + (-1,)).astype(self.dtype))

    def __call__(self, x, segment_ids=None, positions=None):
        batch, time = x.shape[:2]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(time), (batch, time))
        q, k, v = self._qkv(x, positions)
        if segment_ids is None:
            o = causal_attention(q, k, v, self.window)
        else:
            t = jnp.arange(time)
            mask = (t[:, None] >= t[None, :])[None]
            if self.window is not None:
                mask &= (t[:, None] - t[None, :] < self.window)[None]
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
            o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
        return self._out(o)

    def prefill(self, x, max_len: int):
        batch, time = x.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(time), (batch, time))
        q, k, v = self._qkv(x, positions)
        o = causal_attention(q, k, v, self.window)
        slots = max_len if self.window is None else self.window
        keep = min(time, slots)
        kept = jnp.arange(time - keep, time)                  # the newest tokens that fit
        index = kept % slots
        cache = {"k": jnp.zeros((batch, slots) + k.shape[2:], k.dtype).at[:, index].set(k[:, kept]),
                 "v": jnp.zeros((batch, slots) + v.shape[2:], v.dtype).at[:, index].set(v[:, kept]),
                 "pos": jnp.full((slots,), -1, jnp.int32).at[index].set(kept.astype(jnp.int32))}
        return self._out(o), cache

    def decode(self, x, cache, pos, *, chunk_end=None):
        batch = x.shape[0]
        q, k, v = self._qkv(x, jnp.full((batch, 1), pos))
        slots = cache["pos"].shape[0]
        slot = pos % slots
        keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), slot, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), slot, axis=1)
        key_pos = cache["pos"].at[slot].set(pos)
        valid = (key_pos >= 0) & (key_pos <= pos)
        if self.window is not None:
            valid &= key_pos > pos - self.window
        o = jax.nn.dot_product_attention(q, keys, values, mask=valid[None, None, None, :])
        return self._out(o), {"k": keys, "v": values, "pos": key_pos}


# ---- one inner step per chunk (titans-pytorch's schedule) ----------------------------------------
# step_schedule (models.config.STEP_SCHEDULES; "token" is the preset's own recurrence, run_memory)
# -> chunk_step_memory's segment in chunks (None: the whole sequence)
SEGMENT_CHUNKS = {"chunk": 1, "chunk_from_theta0": None}


def chunk_steps_refusal(spec) -> str | None:
    """Why ``spec`` cannot take one inner step per chunk from a segment's start
    (`ops.deep_memory.chunk_step_memory`: G_n = Σ β ∇ℓ(θ_s), m_n = η_n m − G_n, θ_n = α_n θ + m_n),
    or None where it can: any memory and objective without a per-token objective knob, identity
    features, window 1, one step a token, GD or Titans' momentum (β inside the momentum), no
    retention or a decoupled scalar decay without a map (titans, ttt_mlp)."""
    from atlas_jax import optimizers as inner_opt
    from atlas_jax.features import Identity
    if isinstance(spec, ClosedForm):
        return "a closed form has no inner steps"
    info = inner_opt.info(spec.optimizer)
    reasons = []
    if type(spec.feature_map) is not Identity:
        reasons.append(f"its feature map is {spec.feature_map.describe()} (the op reads q and k as they are)")
    if spec.window > 1:
        reasons.append(f"its Omega window is {spec.window} (the op takes each token's own gradient)")
    if spec.steps > 1:
        reasons.append(f"it takes {spec.steps} steps a token")
    if not (info.kind == "gd" or (info.kind == "momentum" and info.step_inside)):
        reasons.append(f"its optimizer is {inner_opt.describe(spec.optimizer)} (the op takes GD or Titans' "
                       "momentum, m = η m − β∇ℓ)")
    retention = spec.retention
    if retention.has_map or retention.log_decay is not None or retention.decay == "channel" or (
            retention.decay == "scalar" and not retention.decoupled):
        reasons.append(f"its retention is {retention.describe()} (the op takes none or a decoupled per-chunk "
                       "scalar decay)")
    if spec.objective.uses_delta:
        reasons.append(f"its objective {spec.objective.describe()} takes a per-token knob")
    return "; ".join(reasons) or None


def run_chunk_steps(spec, q, k, v, knobs: dict, *, schedule: str, impl: str, chunk_size: int, state: dict,
                    decay_params: tuple | None = None, output_final_state: bool = False,
                    documents: tuple | None = None):
    """The one call into ``chunk_step_memory``: (o [B, T, H, V], the next state or None).

    ``knobs`` [B, T, H]: β per token, activated ("beta"), and per token the momentum gate's logit
    ("nu_logit") and the decay's raw input ("g_raw", activated by fla's gate with ``decay_params``
    (A_log [H], dt_bias [H])). A chunk's gates are those of its tokens' mean: titans-pytorch pools
    a chunk's inputs before its gates' linear maps, which commute with the mean. ``state``:
    {"params": θ, "momentum": m (None: zeros), "point": the segment's gradient point} with leaves
    [H, ...] or [B, H, ...]; the next state has the same keys, "point" moved on where each chunk is
    a segment. A sequence shorter than a chunk is read with the state's θ (nothing is written).
    ``documents``: as ``run_memory``'s: each document moved to a chunk boundary, the op restarting
    from ``state`` there (``chunk_aligned_layout``; about T + (M − 1)·C tokens of work a row). Without a
    final state and from a state per head, each device of a batch mesh runs its own rows
    (``per_batch_shard``)."""
    from atlas_jax.ops.deep_memory import chunk_step_memory
    if schedule not in SEGMENT_CHUNKS:
        raise ValueError(f"run_chunk_steps: schedule must be one of {list(SEGMENT_CHUNKS)}, got {schedule!r}")
    segment = None if SEGMENT_CHUNKS[schedule] is None else SEGMENT_CHUNKS[schedule] * chunk_size
    if documents is not None and output_final_state:
        raise ValueError("run_chunk_steps: documents (packed rows) return no final state; pass output_final_state=False")

    def memory(q, k, v, knobs, state, decay_params, restarts=None):
        batch, time, heads = q.shape[:3]
        short = time < chunk_size      # no whole chunk: pad one (the padding is written, never read)
        if short:
            pad = lambda x: jnp.pad(x, [(0, 0), (0, chunk_size - time)] + [(0, 0)] * (x.ndim - 2))
            q, k, v = pad(q), pad(k), pad(v)
            knobs = {name: pad(x) for name, x in knobs.items()}
        n = q.shape[1] // chunk_size
        pool = lambda x: jnp.mean(x[:, :n * chunk_size].reshape(batch, n, chunk_size, heads), axis=2)
        zeros = jnp.zeros((batch, n, heads), jnp.float32)
        nu = jax.nn.sigmoid(pool(knobs["nu_logit"])) if "nu_logit" in knobs else zeros
        if "g_raw" in knobs:
            A_log, dt_bias = decay_params
            g = fused_gate(pool(knobs["g_raw"])[..., None], A_log, dt_bias.reshape(heads, 1))[..., 0]
        else:
            g = zeros
        o, final = chunk_step_memory(q, k, v, knobs["beta"], nu, g, state["params"], state["momentum"],
                                     memory=spec.memory, objective=spec.objective, chunk_size=chunk_size,
                                     segment=segment, gradient_params=None if restarts is not None else state["point"],
                                     restarts=restarts, padding_before_restarts=restarts is not None,
                                     impl="recurrent" if impl == "recurrent" else "auto",
                                     output_final_state=output_final_state and not short)
        o = o[:, :time]
        if not output_final_state:
            return o, None
        if short:
            return o, state
        point = final.params if segment is not None else state["point"]
        return o, {"params": final.params, "momentum": final.momentum, "point": point}

    if output_final_state:
        return memory(q, k, v, knobs, state, decay_params)

    def call(rows, shared):
        """One device's rows (``per_batch_shard``): the layout's scatters have data-dependent indices."""
        q, k, v, knobs = rows["q"], rows["k"], rows["v"], rows["knobs"]
        run = lambda q, k, v, knobs, restarts=None: memory(q, k, v, knobs, shared["state"], shared["decay"],
                                                           restarts)[0]
        if documents is None:
            return run(q, k, v, knobs)
        if documents[1] == 1:      # one document a row: a mask
            return _in_document_rows(run, (rows["segment_ids"], 1), q, k, v, knobs)
        with jax.named_scope(LAYOUT_SCOPE):
            doc, pos = document_positions(rows["segment_ids"])
            # a gap after every document: the token before a restart is padding, so the op reads
            # it where it reads the restarted chunk (no read of the whole row at θ_0 for it)
            dest, length, restarts, _, overflow = chunk_aligned_layout(doc, pos, chunk_size, documents[1], gap=True)
            aligned = lambda y: to_chunk_aligned(y, dest, length)
            q, k, v, knobs = aligned(q), aligned(k), aligned(v), jax.tree.map(aligned, knobs)
        o = run(q, k, v, knobs, restarts[:, ::chunk_size])
        with jax.named_scope(LAYOUT_SCOPE):
            return from_chunk_aligned(o, dest, overflow)

    rows = {"q": q, "k": k, "v": v, "knobs": knobs}
    if documents is not None:
        rows["segment_ids"] = documents[0]
    shared = {"state": state, "decay": decay_params}
    per_head = jax.eval_shape(lambda: spec.memory.init(jax.random.PRNGKey(0), q.shape[-1], v.shape[-1]))
    if all(x.ndim == ref.ndim + 1 for x, ref in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(per_head))):
        return per_batch_shard(call, rows, q.shape[0], shared), None
    return call(rows, shared), None        # a state per row: the rows stay whole


# ---- the memory layer ---------------------------------------------------------------------------
def _uses_beta(spec) -> bool:
    """A data-dependent step size β_t, except where the papers have none: linear Hebbian memories
    (linear attention, RetNet, Mamba2, GLA) and least squares. A deep Hebbian memory (DLA) gets
    one: its objective is unbounded below, and a fixed step of 1 blows its weights up."""
    from atlas_jax.objectives import Dot
    if isinstance(spec, ClosedForm):
        return spec.name == "dot"
    hebbian_linear = isinstance(spec.objective, Dot) and isinstance(spec.memory, LinearMemory)
    return spec.opt_kind != "least_squares" and not hebbian_linear


class MemoryLayer(nnx.Module):
    """The papers' memory layer around one preset (a MemorySpec, or a ClosedForm for DeepTransformer,
    SWDT and Dot). ``impl``: auto | pallas | chunk | recurrent (the core's forms; the exact delta
    family runs through atlas_jax.ops and so the Pallas kernels on GPU/TPU). ``step_schedule``:
    "token", the preset's recurrence; "chunk" / "chunk_from_theta0", titans-pytorch's one inner step
    per chunk with each chunk's gradients at its start weights (its ``batch_size=chunk_size``) / at
    the sequence's θ_0 (its default), the momentum and decay gates from each chunk's mean input
    (``run_chunk_steps``; ``chunk_steps_refusal`` says which presets take it)."""

    # On a delta-family op the op applies the gate and β activations to raw inputs (fla's
    # use_gate_in_kernel / use_beta_sigmoid_in_kernel), and its backward recomputes them instead of
    # keeping g and β. The layer keeps its own copy for the routes that are not an op (the recurrent
    # decode step, the core's forms). False keeps them in the layer everywhere: the reference the
    # tests compare the fused layer against.
    fuse_activations = True

    def __init__(self, spec, *, width: int, heads: int, impl: str = "auto", chunk_size: int = 64,
                 conv_size: int = 4, gate_rank: int = 16, memory_init: str = "shared", max_documents: int = 8,
                 step_size_max: float | None = None, expand_v: float = 1, step_schedule: str = "token",
                 rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.spec, self.impl, self.chunk_size, self.max_documents = spec, impl, chunk_size, max_documents
        if step_schedule not in STEP_SCHEDULES:
            raise ValueError(f"MemoryLayer: step_schedule must be one of {list(STEP_SCHEDULES)}, got {step_schedule!r}")
        if step_schedule != "token":
            refusal = chunk_steps_refusal(spec)
            if refusal:
                raise ValueError(f"MemoryLayer: step_schedule={step_schedule!r} takes one inner step per chunk, and "
                                 f"preset {getattr(spec, 'name', spec)!r} cannot: {refusal}. Use step_schedule='token' "
                                 "or a preset such as titans or ttt_mlp")
            if impl == "pallas":
                raise ValueError(f"MemoryLayer: step_schedule={step_schedule!r} has no Pallas kernel (its XLA form "
                                 "is the fast path); use impl 'auto', 'chunk' or 'recurrent'")
        self.step_schedule = step_schedule
        self.heads, self.head_dim, self.dtype = heads, width // heads, dtype
        # fla's expand_v: value heads wider than the key heads (V = expand_v · K per head).
        self.value_dim = int(self.head_dim * expand_v)
        closed = isinstance(spec, ClosedForm)
        linear_memory = closed or isinstance(spec.memory, LinearMemory)
        self.steps = 1 if closed else spec.steps
        d, dv, n = self.head_dim, self.value_dim, self.steps
        linear = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj = linear(width, heads * d), linear(width, heads * n * d), linear(width, heads * n * dv)
        channels = heads * (d + n * d + n * dv)
        self.conv = ShortConv(channels, conv_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype) if conv_size else None
        self.out_norm = nnx.RMSNorm(dv, epsilon=1e-6, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.out_gate, self.o_proj = linear(width, heads * dv), linear(heads * dv, width)
        # Deep memories read M(φ(q)) with the keys' scale; a linear read only rescales the output.
        self.scale = d ** -0.5 if linear_memory else 1.0

        self.beta_proj = linear(width, heads * n, bias=True) if _uses_beta(spec) else None
        # β = step_size_max · sigmoid(·). A deep memory's curvature in its weights is ~‖hidden‖², not
        # ‖k‖² = 1, momentum multiplies the step by ~1/(1 − ν) and the chunk-start form sums a
        # chunk's gradients at one θ: at 0.1 Titans diverged after ~400 tokens (chunk 64, 340m),
        # at 0.01 Titans-MAG (4 layers, 340m, chunk 64, float32) still did; at 1e-3, and at chunk 16 or
        # in the recurrent form with 0.01, it stayed finite (H100 checks, untrained weights).
        if step_size_max is None:
            step_size_max = 1.0 if linear_memory else 1e-3
        self.step_size_max = float(step_size_max)
        decay, a_proj, g_down, g_up = None, None, None, None
        if not closed and (spec.retention.needs_gate or spec.opt_kind == "least_squares"):
            decay = "channel" if spec.retention.decay == "channel" else "scalar"
            lanes = spec.feature_dim(d) if decay == "channel" else 1
            key_a, key_dt = rngs.params(), rngs.params()
            # Mamba2 / GDN parametrisation: g = −exp(A_log)·softplus(a(x) + dt_bias), A ~ U(1, 16).
            self.A_log = nnx.Param(jnp.log(jax.random.uniform(key_a, (heads,), jnp.float32, 1.0, 16.0)))
            dt = jnp.exp(jax.random.uniform(key_dt, (heads * lanes,), jnp.float32, math.log(1e-3), math.log(1e-1)))
            self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
            if decay == "channel":
                g_down, g_up = linear(width, gate_rank), linear(gate_rank, heads * lanes)
            else:
                a_proj = linear(width, heads)
        self.decay, self.a_proj, self.g_down, self.g_up = decay, a_proj, g_down, g_up
        momentum = not closed and spec.opt_kind in ("momentum", "muon")
        self.nu_proj = self._gate_linear(width, heads, 2.2, rngs, dtype, param_dtype) if momentum else None
        window = not closed and spec.window > 1
        self.gamma_proj = self._gate_linear(width, heads, 3.0, rngs, dtype, param_dtype) if window else None
        uses_delta = not closed and spec.objective.uses_delta
        self.delta_proj = self._gate_linear(width, heads, _inverse_softplus(1.0), rngs, dtype, param_dtype) if uses_delta else None

        coeffs = None if closed else spec.feature_map.init_params()
        self.feature_coeffs = nnx.Param(coeffs["coeffs"].astype(param_dtype)) if coeffs else None
        self.theta_keys = ()
        if not linear_memory:
            self._init_theta0(rngs.params(), memory_init, param_dtype)

    @staticmethod
    def _gate_linear(width, heads, bias, rngs, dtype, param_dtype):
        return nnx.Linear(width, heads, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                          bias_init=nnx.initializers.constant(bias))

    def _init_theta0(self, key, memory_init, param_dtype):
        """θ_0 (the retention accumulator when retention has a map): per head [H, ...], one shared
        by all heads, or fixed (drawn once, not trained)."""
        spec, d, dv = self.spec, self.head_dim, self.value_dim
        d_in = spec.feature_dim(d)
        if memory_init == "per_head":
            raw = jax.vmap(lambda kk: spec.memory.init(kk, d_in, dv))(jax.random.split(key, self.heads))
        else:
            raw = spec.memory.init(key, d_in, dv)
        kind = nnx.Param if memory_init != "fixed" else nnx.Variable
        self.theta_keys = tuple(sorted(raw))
        self.theta_per_head = memory_init == "per_head"
        for name in self.theta_keys:
            setattr(self, f"theta0_{name}", kind(raw[name].astype(param_dtype)))

    def theta0(self):
        """θ_0 as a params dict with leaves [H, ...] or shared [...] (None: the core's zero state)."""
        if not self.theta_keys:
            return None
        raw = {name: getattr(self, f"theta0_{name}")[...].astype(jnp.float32) for name in self.theta_keys}
        if self.spec.retention.has_map:
            raw = jax.vmap(self.spec.retention.map)(raw) if self.theta_per_head else self.spec.retention.map(raw)
        return raw

    # -- the input-dependent pieces --------------------------------------------------------------
    def _projections(self, x):
        """The raw q, k, v projections, kept apart: concatenating them for one convolution and
        splitting after cost a copy each way (H100, fla-config LM: ≈ 20 ms of slice and concatenate
        kernels in a 434 ms loss+grad profile)."""
        return [self.q_proj(x), self.k_proj(x), self.v_proj(x)]

    def _inputs(self, x, segment_ids=None, raw=None, *, impl=None):
        """(q, k, v, knobs) of x for ``impl`` (default self.impl): projections, the short
        convolution of each, the heads."""
        raw = self._projections(x) if raw is None else raw
        pieces = raw if self.conv is None else self.conv.pieces(raw, segment_ids)
        return self._split(*pieces, x, impl=impl)

    def _split(self, q, k, v, x, *, impl=None):
        batch, time = x.shape[:2]
        h, d, dv, n = self.heads, self.head_dim, self.value_dim, self.steps
        q = l2_normalize(q.reshape(batch, time, h, d))
        steps = (n,) if n > 1 else ()
        k = l2_normalize(k.reshape((batch, time, h, *steps, d)))
        v = v.reshape((batch, time, h, *steps, dv))
        return q, k, v, self._knobs(x, self._fused(self.impl if impl is None else impl))

    def _fused(self, impl) -> dict:
        """fla's activation arguments of the delta-family op that runs this layer with ``impl``
        ({}: the layer activates its knobs itself). β only at step_size_max 1, where
        step_size_max · sigmoid is fla's sigmoid; delta_product takes no such arguments."""
        if not self.fuse_activations or self.steps > 1 or memory_op(self.spec, impl) is None:
            return {}
        fused = {}
        if self.decay is not None:
            fused.update(use_gate_in_kernel=True, A_log=self.A_log[...], dt_bias=self.dt_bias[...])
        if self.beta_proj is not None and self.step_size_max == 1.0:
            fused["use_beta_sigmoid_in_kernel"] = True
        return fused

    def _knobs(self, x, fused):
        """The per-token knobs, float32; g and β raw where ``fused`` hands their activation to the op."""
        batch, time = x.shape[:2]
        h, f32 = self.heads, lambda y: y.astype(jnp.float32)
        knobs = {}
        if self.beta_proj is not None:
            beta = f32(self.beta_proj(x)).reshape(batch, time, h, self.steps)
            if not fused.get("use_beta_sigmoid_in_kernel"):
                beta = self.step_size_max * jax.nn.sigmoid(beta)
            knobs["beta"] = beta if self.steps > 1 else beta[..., 0]
        # one step per chunk: the gates' inputs per token, pooled over each chunk (run_chunk_steps)
        per_chunk = self.step_schedule != "token"
        if self.decay is not None:
            a = f32(self.a_proj(x)) if self.decay == "scalar" else f32(self.g_up(self.g_down(x)))
            g = a.reshape(batch, time, h, -1)
            if per_chunk:
                knobs["g_raw"] = g[..., 0]
            else:
                if not fused.get("use_gate_in_kernel"):
                    g = fused_gate(g, self.A_log[...], self.dt_bias[...].reshape(h, -1))
                knobs["g"] = g if self.decay == "channel" else g[..., 0]
        if self.nu_proj is not None:
            logit = f32(self.nu_proj(x))
            knobs.update({"nu_logit": logit} if per_chunk else {"nu": jax.nn.sigmoid(logit)})
        if self.gamma_proj is not None:
            knobs["gamma"] = jax.nn.sigmoid(f32(self.gamma_proj(x)))
        if self.delta_proj is not None:
            knobs["delta"] = jax.nn.softplus(f32(self.delta_proj(x)))
        return knobs

    def start_state(self, batch: int):
        """The state a sequence starts from ([B, H, ...] leaves): the core's MemoryState of θ_0, or
        on a chunk-step schedule run_chunk_steps' {"params", "momentum", "point"}."""
        if self.step_schedule != "token":
            return self._chunk_step_state(batch)
        return self.spec._coerce_state(self.theta0(), batch, self.heads, self.head_dim, self.value_dim)

    @staticmethod
    def state_params(state) -> dict:
        """θ of a state ``start_state`` or a final state made: what reading the memory applies."""
        return state["params"] if isinstance(state, dict) else state.params

    def _feature_params(self):
        """φ's parameters as the spec takes them: the layer's learned coefficients, else φ's own."""
        if self.feature_coeffs is None:
            return self.spec.feature_map.init_params()
        return {"coeffs": self.feature_coeffs[...].astype(jnp.float32)}

    def read(self, params, x):
        """M_θ(x) without a step: θ ``params`` [B, H, ...] per row and head, x [B, S, H, d_in] ->
        [B, S, H, V] (MAC's retrieval; a chunk-step decode token before its chunk's last)."""
        apply = jax.vmap(jax.vmap(self.spec.memory.apply, in_axes=(0, 1), out_axes=1))   # over B, then H
        return apply(params, x)

    def _chunk_step_state(self, batch: int | None) -> dict:
        """run_chunk_steps' state at a sequence's start: θ_0 ([B, H, ...], as every later state, so
        that a decode cache keeps its shapes; [H, ...] for batch None; zeros for a linear memory), no
        momentum, θ_0 the gradient point."""
        theta = self.theta0()
        per_head = jax.eval_shape(lambda: self.spec.memory.init(jax.random.PRNGKey(0), self.head_dim, self.value_dim))
        if theta is None:
            theta = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), per_head)
        lead = (self.heads,) if batch is None else (batch, self.heads)
        theta = jax.tree.map(lambda x, ref: jnp.broadcast_to(x, lead + ref.shape), theta, per_head)
        return {"params": theta, "momentum": jax.tree.map(jnp.zeros_like, theta), "point": theta}

    def _run(self, q, k, v, knobs, *, impl, initial_state=None, output_final_state=False, documents=None,
             gradient_point=None, spec=None):
        """``spec``: in place of the layer's (`MemorySpec.inside_chunk`, a decode step's)."""
        if self.step_schedule != "token":
            state = self._chunk_step_state(None) if initial_state is None else initial_state
            decay = None if self.decay is None else (self.A_log[...], self.dt_bias[...])
            o, final = run_chunk_steps(self.spec, q, k, v, knobs, schedule=self.step_schedule, impl=impl,
                                       chunk_size=self.chunk_size, state=state, decay_params=decay,
                                       output_final_state=output_final_state, documents=documents)
            return o * self.scale, final
        feature_params = None if self.feature_coeffs is None else self._feature_params()
        if initial_state is None:
            initial_state = self.theta0()
        return run_memory(self.spec if spec is None else spec, q, k, v, knobs, impl=impl, chunk_size=self.chunk_size,
                          initial_state=initial_state, output_final_state=output_final_state,
                          feature_params=feature_params, scale=self.scale, fused=self._fused(impl),
                          documents=documents, gradient_point=gradient_point)

    def _out(self, o, x):
        o = checkpoint_name(o, MEMORY_OUTPUT)
        o = self.out_norm(o.astype(jnp.float32)) * jax.nn.silu(self.out_gate(x).astype(jnp.float32)).reshape(o.shape)
        return self.o_proj(o.reshape(o.shape[:2] + (-1,)).astype(self.dtype))

    # -- the three calls -------------------------------------------------------------------------
    def __call__(self, x, segment_ids=None, positions=None):
        # One document per row (max_documents 1): its tokens' lags never reach another document
        # (run_memory makes a second one NaN), so the convolution needs no document mask.
        conv_segments = None if self.max_documents == 1 else segment_ids
        q, k, v, knobs = self._inputs(x, conv_segments)
        documents = None if segment_ids is None else (segment_ids, self.max_documents)
        o, _ = self._run(q, k, v, knobs, impl=self.impl, documents=documents)
        return self._out(o, x)

    @property
    def can_decode(self) -> bool:
        return not isinstance(self.spec, ClosedForm)

    @property
    def decodes_by_chunk(self) -> bool:
        """Whether decoding replays the current chunk rather than stepping the recurrence: the
        layer's forward takes every gradient of a chunk at the chunk's start θ (the chunk-start
        form of titans, atlas, the MIRAS memories, …), which a token-by-token recurrence does not
        compute. The exact families' chunked form is their recurrence, and so is any form at chunk 1."""
        if self.step_schedule != "token":
            return True     # titans-pytorch's schedule steps once per chunk in every impl
        return (self.can_decode and not self.spec.chunked_is_exact and self.impl != "recurrent"
                and self.chunk_size > 1)

    @property
    def decodes_at_chunk_start(self) -> bool:
        """Whether such a layer decodes a token as one recurrent step with its gradient taken at the
        current chunk's start θ (the cache: the running state and that θ) rather than by replaying
        the chunk: where the chunk-start form's steps inside a chunk are that recurrence
        (`MemorySpec.inside_chunk`'s ``chunk_start_is_recurrent``) and a token is one step. Muon
        with Newton–Schulz once per chunk and the retention maps at chunk ends (moneta, memora)
        step linearly inside a chunk and close it at its last token (`_step_closing_chunks`; a scalar
        decay or none, not both at once). A step then costs one token's step, not the chunk's."""
        inside = self.spec.inside_chunk
        closes = inside is not self.spec
        both = inside.optimizer is not self.spec.optimizer and self.spec.retention.has_map
        return (self.decodes_by_chunk and self.step_schedule == "token" and self.steps == 1
                and inside.chunk_start_is_recurrent and not (closes and (both or self.decay == "channel")))

    def prefill(self, x, max_len: int):
        if not self.can_decode:
            raise NotImplementedError(f"{self.spec.name}: a closed form keeps no recurrent state; "
                                      "generate re-runs the whole sequence instead")
        raw = self._projections(x)
        q, k, v, knobs = self._inputs(x, raw=raw)
        if self.decodes_at_chunk_start:
            o, cache = self._prefill_at_chunk_start(q, k, v, knobs)
        elif self.decodes_by_chunk:
            o, cache = self._prefill_by_chunk(q, k, v, knobs)
        else:
            o, state = self._run(q, k, v, knobs, impl=self.impl, output_final_state=True)
            cache = {"memory": state}
        if self.conv is not None:
            tail = self.conv.size - 1
            cache["conv"] = self.conv.history(jnp.concatenate([r[:, max(r.shape[1] - tail, 0):] for r in raw], axis=-1))
        return self._out(o, x), cache

    def decode(self, x, cache, pos, *, chunk_end=None):
        """One token [B, 1, width] at absolute position ``pos``. ``chunk_end``: None, or whether
        ``pos`` is a chunk's last position (pos % chunk_size == chunk_size − 1) as a Python bool,
        for a caller that knows it statically (`generation.generate`): a chunk-start layer then
        traces only the branch that runs, with no conditional on the device."""
        raw = self._projections(x)
        new_cache = dict(cache)
        if self.conv is not None:
            out, new_cache["conv"] = self.conv.step(jnp.concatenate(raw, axis=-1), cache["conv"])
            edges = list(itertools.accumulate(r.shape[-1] for r in raw))[:-1]
            raw = jnp.split(out, edges, axis=-1)
        if self.decodes_at_chunk_start:
            q, k, v, knobs = self._split(*raw, x, impl="recurrent")
            last = self._chunk_end(pos, chunk_end)
            if self.spec.inside_chunk is not self.spec:
                o, open_chunk = self._step_closing_chunks(q, k, v, knobs, cache, last)
                return self._out(o, x), {**new_cache, **open_chunk}
            o, state = self._run(q, k, v, knobs, impl="recurrent", initial_state=cache["memory"],
                                 output_final_state=True, gradient_point=cache["point"])
            point = _select(last, state.params, cache["point"])
            return self._out(o, x), {**new_cache, "memory": state, "point": point}
        if self.decodes_by_chunk:
            q, k, v, knobs = self._split(*raw, x)
            o, chunk_cache = self._decode_by_chunk(q, k, v, knobs, cache, pos, chunk_end)
            return self._out(o, x), {**new_cache, **chunk_cache}
        q, k, v, knobs = self._split(*raw, x, impl="recurrent")
        o, new_cache["memory"] = self._run(q, k, v, knobs, impl="recurrent", initial_state=cache["memory"],
                                           output_final_state=True)
        return self._out(o, x), new_cache

    def _chunk_end(self, pos, chunk_end):
        """Whether ``pos`` is its chunk's last position: ``chunk_end`` where the caller knows it
        (a Python bool), else a traced bool."""
        if chunk_end is None:
            return jnp.asarray(pos, jnp.int32) % self.chunk_size == self.chunk_size - 1
        if not isinstance(chunk_end, bool):
            raise ValueError(f"decode: argument `chunk_end` must be None or a Python bool (static), got "
                             f"{type(chunk_end).__name__}; pass None to derive it from `pos` on the device.")
        return chunk_end

    # -- decoding a chunk-start form -------------------------------------------------------------
    # Where the chunk-start form is the recurrence from the chunk's start θ (`decodes_at_chunk_start`)
    # the cache keeps the running state ("memory") and that θ ("point"), moved on after a chunk's last
    # token; where a chunk's end acts on the chunk, also what closing it needs ("chunk_sums" or
    # "accumulator", `_step_closing_chunks`). Elsewhere a step replays the chunk: the cache keeps the
    # state at the current chunk's start ("memory") and the chunk's inputs so far ("chunk": q, k, v
    # and the knobs, [B, chunk_size, ...]; chunks start at multiples of chunk_size from the prompt's
    # first token, as in the forward). A replaying step writes its token at slot pos mod chunk_size
    # and runs the chunk form on the whole buffer from the chunk's start state: the slots after the
    # token hold other real tokens (the chunk before's, or the prompt's last repeated), which only
    # later reads see, so the token's output is the forward's. Once the slot is the chunk's last,
    # every slot is this chunk's and the call's final state is the next chunk's start. It costs one
    # chunk's forward, whatever the context.
    def _prefill_at_chunk_start(self, q, k, v, knobs):
        """The prompt's outputs, and the cache of `decodes_at_chunk_start`: the state after the prompt
        and θ at its last chunk boundary A (the prompt's first A tokens run, then the rest from there).
        Where a chunk's end acts on the chunk (`MemorySpec.inside_chunk`) the rest runs as the
        inside-chunk recurrence from θ at A (the chunk form would close the open chunk at the
        prompt's last token), and the cache keeps what closing the chunk needs
        (`_step_closing_chunks`): with Muon the open chunk's P and Σ (P/P_i) β_i, with a retention
        map the accumulator's own recurrence from A."""
        size, length = self.chunk_size, q.shape[1]
        start = length // size * size
        part = lambda lo, hi: (q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], jax.tree.map(lambda y: y[:, lo:hi], knobs))
        inside = self.spec.inside_chunk
        closes = inside is not self.spec
        outputs, state = [], self.start_state(q.shape[0])
        if start > 0:
            o, state = self._run(*part(0, start), impl=self.impl, initial_state=state, output_final_state=True)
            outputs.append(o)
        point, accumulator = state.params, state.accumulator
        if closes:   # inside a chunk the memory moves without the map: no accumulator
            state = state._replace(accumulator=None)
        if start < length:
            if closes:
                inside_run = lambda s: self._run(*part(start, length), impl="recurrent", initial_state=s,
                                                 output_final_state=True, gradient_point=point, spec=inside)
                if accumulator is not None:   # the same steps from A
                    accumulator = inside_run(state._replace(params=accumulator))[1].params
                o, state = inside_run(state)
            else:
                o, state = self._run(*part(start, length), impl=self.impl, initial_state=state, output_final_state=True)
            outputs.append(o)
        cache = {"memory": state, "point": point}
        if closes and accumulator is not None:
            cache["accumulator"] = accumulator
        elif closes:
            beta, log_alpha = self._steps_and_log_decays(part(start, length)[3], q[:, start:])
            after = jnp.cumsum(log_alpha[:, ::-1], axis=1)[:, ::-1] - log_alpha   # Σ_{j>i} log α_j
            cache["chunk_sums"] = {"decay": jnp.exp(jnp.sum(log_alpha, axis=1)),
                                   "step": jnp.sum(jnp.exp(after) * beta, axis=1)}
        return jnp.concatenate(outputs, axis=1), cache

    def _steps_and_log_decays(self, knobs, q):
        """Each token's step size β and log decay log α, [B, T, H] float32, as the spec's forms take them."""
        shape = q.shape[:3]
        beta = knobs.get("beta")
        if beta is None:
            beta = jnp.full(shape, inner_opt.info(self.spec.optimizer).step_size, jnp.float32)
        retention = self.spec.retention
        if retention.decay == "none" or (retention.log_decay is None and knobs.get("g") is None):
            log_alpha = jnp.zeros(shape, jnp.float32)
        elif retention.log_decay is not None:
            log_alpha = jnp.full(shape, retention.log_decay, jnp.float32)
        else:
            log_alpha = knobs["g"].astype(jnp.float32)
        return beta.astype(jnp.float32), log_alpha

    def _step_closing_chunks(self, q, k, v, knobs, cache, last):
        """A decode token where a chunk's end acts on the chunk (`MemorySpec.inside_chunk`): the
        token's inside-chunk step, its gradient at the chunk's start θ₀, and at the chunk's last
        token the chunk's close, which that token reads and the next chunk starts from. Returns
        (o, the cache's new entries).

        * Muon with NS once per chunk: the running state is θ's plain-momentum recurrence, read as
          it is; the open chunk's P = Π α_i and S = Σ_i (P/P_i) β_i move on, and the chunk closes
          to θ = P θ₀ − S NS_J(m) (`forms.chunked._chunk_end_orthogonalized`).
        * A retention map at chunk ends (moneta, memora): the linear θ (read) and the accumulator A
          take the same steps u_t from θ₀ and A₀ (θ = α θ + u, A = α A + u, u from the step on
          zero weights), and the chunk closes to θ = map(A). Both are kept: θ₀ = map(A₀) can be
          thousands of times A₀ (moneta) or far below it (memora), and either one formed from the
          other loses its digits."""
        inside = self.spec.inside_chunk
        run = lambda state: self._run(q, k, v, knobs, impl="recurrent", initial_state=state, output_final_state=True,
                                      gradient_point=cache["point"], spec=inside)
        beta, log_alpha = self._steps_and_log_decays(knobs, q)
        alpha = jnp.exp(log_alpha[:, 0])
        per_head = lambda s, x: s.reshape(s.shape + (1,) * (x.ndim - 2))
        fq = self.spec.feature_map.apply(self._feature_params(), self.scale * q.astype(jnp.float32))
        read = lambda theta: self.read(theta, fq).astype(v.dtype)
        retention = self.spec.retention

        if "accumulator" in cache:
            zero = cache["memory"]._replace(params=jax.tree.map(jnp.zeros_like, cache["memory"].params))
            _, stepped = run(zero)
            advance = lambda x, u: per_head(alpha, x) * x + u
            theta = jax.tree.map(advance, cache["memory"].params, stepped.params)
            accumulator = jax.tree.map(advance, cache["accumulator"], stepped.params)
            # a select, not a lax.cond: the map is cheap, and a GPU conditional syncs with the host
            if last is not False:
                mapped = jax.vmap(jax.vmap(retention.map))(accumulator)
                theta = _select(last, mapped, theta)
            point = _select(last, theta, cache["point"])
            return read(theta), {"memory": stepped._replace(params=theta), "point": point, "accumulator": accumulator}

        o, state = run(cache["memory"])
        decay = alpha * cache["chunk_sums"]["decay"]
        step = alpha * cache["chunk_sums"]["step"] + beta[:, 0]
        info = inner_opt.info(self.spec.optimizer)

        def close(_):
            direction = jax.vmap(jax.vmap(lambda m: inner_opt.orthogonalize(m, info)))(state.opt_state.momentum)
            theta = jax.tree.map(lambda p0, n: per_head(decay, p0) * p0 - per_head(step, n) * n, cache["point"], direction)
            return read(theta), theta, jnp.ones_like(decay), jnp.zeros_like(step)

        o, theta, decay, step = _cond(last, close, lambda _: (o, state.params, decay, step), None)
        point = _select(last, theta, cache["point"])
        return o, {"memory": state._replace(params=theta), "point": point,
                   "chunk_sums": {"decay": decay, "step": step}}

    def _prefill_by_chunk(self, q, k, v, knobs):
        """The prompt's outputs, and the cache at its last chunk boundary A: the prompt's first A
        tokens (whole chunks) give the state, the rest run from it into the chunk buffer."""
        size, length = self.chunk_size, q.shape[1]
        start = length // size * size
        inputs = {"q": q, "k": k, "v": v, "knobs": knobs}
        part = lambda lo, hi: jax.tree.map(lambda y: y[:, lo:hi], inputs)
        # the cache's memory is always a state of this layer's schedule, [B, H, ...] from the start
        outputs, state = [], self.start_state(q.shape[0])
        if start > 0:
            head = part(0, start)
            o, state = self._run(head["q"], head["k"], head["v"], head["knobs"], impl=self.impl,
                                 initial_state=state, output_final_state=True)
            outputs.append(o)
        so_far = part(start, length) if start < length else part(length - 1, length)
        if start < length:
            outputs.append(self._run(so_far["q"], so_far["k"], so_far["v"], so_far["knobs"], impl=self.impl,
                                     initial_state=state)[0])

        def buffer(y):   # the open chunk's tokens, then its last token repeated (or the prompt's last)
            fill = jnp.repeat(y[:, -1:], size - (length - start), axis=1)
            return jnp.concatenate([y, fill], axis=1) if start < length else jnp.repeat(y, size, axis=1)
        return jnp.concatenate(outputs, axis=1), {"memory": state, "chunk": jax.tree.map(buffer, so_far)}

    def _decode_by_chunk(self, q, k, v, knobs, cache, pos, chunk_end=None):
        size = self.chunk_size
        slot = jnp.asarray(pos, jnp.int32) % size
        put = lambda buf, y: jax.lax.dynamic_update_slice_in_dim(buf, y.astype(buf.dtype), slot, axis=1)
        chunk = jax.tree.map(put, cache["chunk"], {"q": q, "k": k, "v": v, "knobs": knobs})
        last = self._chunk_end(pos, chunk_end)
        if self.step_schedule != "token":
            o, state = self._decode_chunk_steps(q, chunk, cache["memory"], last)
            return o, {"memory": state, "chunk": chunk}
        o, end = self._run(chunk["q"], chunk["k"], chunk["v"], chunk["knobs"], impl=self.impl,
                           initial_state=cache["memory"], output_final_state=True)
        state = _select(last, end, cache["memory"])
        return jax.lax.dynamic_slice_in_dim(o, slot, 1, axis=1), {"memory": state, "chunk": chunk}

    def _decode_chunk_steps(self, q, chunk, state, last):
        """A decode step on a chunk-step schedule: a token before its chunk's last reads the weights
        at the chunk's start, which is all the chunk form computes for it; the chunk's last token
        runs the chunk (its step, then its read). So C − 1 of every C steps cost one read."""
        def step(state):
            o, end = self._run(chunk["q"], chunk["k"], chunk["v"], chunk["knobs"], impl=self.impl,
                               initial_state=state, output_final_state=True)
            return o[:, -1:], end

        def read(state):
            # the chunk form reads θ in q's dtype, the per-chunk reference in float32
            dtype = jnp.float32 if self.impl == "recurrent" else q.dtype
            params = jax.tree.map(lambda x: x.astype(dtype), state["params"])
            return (self.read(params, q) * self.scale).astype(q.dtype), state

        return _cond(last, step, read, state)
