"""The language model: embedding, pre-norm blocks (RMSNorm) scanned over depth with ``nnx.scan``,
a final RMSNorm and a tied or untied output head; float32 logits.

A block is a fixed sequence of residual sub-layers, x ← x + sublayer(RMSNorm(x)), by model kind:

  memory / closed_form   [memory, MLP]
  attention              [attention (full or sliding window), MLP]   (Transformer++, SWA)
  mag                    [MAG(memory ∥ SWA), MLP]
  mal                    [memory, SWA, MLP]
  mac                    [MAC(memory as context), MLP]
  samba                  [memory, MLP, SWA, MLP]    (num_layers counts mixers: num_layers / 2 blocks)

The residual stream is float32; sub-layers compute in ``dtype`` (bf16 for training) with float32
parameters. ``remat`` rematerialises each block in the backward pass: none | full | dots |
dots_and_kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.models.config import ModelConfig
from atlas_jax.models.hybrids import MAC, MAG
from atlas_jax.kernels.delta_family.support import RESIDUALS_NAME
from atlas_jax.models.layers import DTYPES, MEMORY_OUTPUT, Attention, MemoryLayer, SwiGLU, document_positions

__all__ = ["Block", "LanguageModel", "LAYOUTS"]

LAYOUTS = {
    "memory": ("memory", "mlp"),
    "closed_form": ("memory", "mlp"),
    "attention": ("attention", "mlp"),
    "mag": ("mag", "mlp"),
    "mal": ("memory", "attention", "mlp"),
    "mac": ("mac", "mlp"),
    "samba": ("memory", "mlp", "attention", "mlp"),
}

_REMAT = {"full": jax.checkpoint_policies.nothing_saveable,
          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          # The backward reruns only elementwise work (norms, short conv, gates, activations): the
          # matmul outputs, the memory layer's output and the memory kernels' residuals are kept.
          "dots_and_kernels": jax.checkpoint_policies.save_from_both_policies(
              jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
              jax.checkpoint_policies.save_only_these_names(MEMORY_OUTPUT, RESIDUALS_NAME))}


def _num_blocks(cfg: ModelConfig) -> int:
    return cfg.num_layers // 2 if cfg.kind == "samba" else cfg.num_layers


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec, *, rngs: nnx.Rngs):
        dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        common = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)

        def memory():
            return MemoryLayer(spec, width=cfg.width, heads=cfg.num_heads, impl=cfg.impl, chunk_size=cfg.chunk_size,
                               conv_size=cfg.conv_size, gate_rank=cfg.gate_rank, memory_init=cfg.memory_init,
                               max_documents=cfg.max_documents, step_size_max=cfg.step_size_max,
                               expand_v=cfg.expand_v, step_schedule=cfg.step_schedule, **common)

        def attention():
            return Attention(cfg.width, cfg.num_heads, window=cfg.attention_window, rope_theta=cfg.rope_theta, **common)

        makers = {
            "memory": memory,
            "attention": attention,
            "mlp": lambda: SwiGLU(cfg.width, cfg.mlp_hidden, **common),
            "mag": lambda: MAG(memory(), attention(), cfg.width, eps=cfg.norm_eps, **common),
            "mac": lambda: MAC(memory(), cfg.width, cfg.num_heads, segment=cfg.mac_segment,
                               num_persistent=cfg.num_persistent, rope_theta=cfg.rope_theta, eps=cfg.norm_eps, **common),
        }
        self.kinds = LAYOUTS[cfg.kind]
        for i, kind in enumerate(self.kinds):
            setattr(self, f"norm{i}", nnx.RMSNorm(cfg.width, epsilon=cfg.norm_eps, dtype=dtype,
                                                  param_dtype=param_dtype, rngs=rngs))
            setattr(self, f"mix{i}", makers[kind]())

    def _parts(self):
        return [(getattr(self, f"norm{i}"), getattr(self, f"mix{i}")) for i in range(len(self.kinds))]

    def __call__(self, x, segment_ids=None, positions=None):
        for norm, mix in self._parts():
            x = x + mix(norm(x), segment_ids=segment_ids, positions=positions).astype(jnp.float32)
        return x

    def prefill(self, x, max_len: int):
        caches = {}
        for i, (norm, mix) in enumerate(self._parts()):
            y, caches[f"mix{i}"] = mix.prefill(norm(x), max_len)
            x = x + y.astype(jnp.float32)
        return x, caches

    def decode(self, x, cache, pos, *, chunk_end=None):
        new = {}
        for i, (norm, mix) in enumerate(self._parts()):
            y, new[f"mix{i}"] = mix.decode(norm(x), cache[f"mix{i}"], pos, chunk_end=chunk_end)
            x = x + y.astype(jnp.float32)
        return x, new


class LanguageModel(nnx.Module):
    """``model(tokens [B, T] int32, segment_ids=None) -> logits [B, T, vocab] float32``."""

    def __init__(self, cfg: ModelConfig, spec, *, rngs: nnx.Rngs):
        self.config, self.spec = cfg, spec
        dtype, param_dtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                               embedding_init=nnx.initializers.normal(0.02))

        @nnx.split_rngs(splits=_num_blocks(cfg))
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, spec, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = nnx.RMSNorm(cfg.width, epsilon=cfg.norm_eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.head = None if cfg.tie_embeddings else nnx.Linear(
            cfg.width, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    # -- helpers ---------------------------------------------------------------------------------
    def _check_tokens(self, tokens, name="tokens"):
        if not hasattr(tokens, "ndim") or tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"{name} must be an int32 array [B, T], got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} of shape {getattr(tokens, 'shape', None)}")

    def _logits(self, x):
        x = self.final_norm(x)
        if self.head is None:
            logits = self.embed.attend(x.astype(DTYPES[self.config.dtype]))
        else:
            logits = self.head(x.astype(DTYPES[self.config.dtype]))
        return logits.astype(jnp.float32)

    def _run_blocks(self, fn, x, *scanned):
        """Apply ``fn(block, x, *per_block) -> (x, out)`` over the stacked blocks with nnx.scan."""
        if self.config.remat != "none":
            fn = nnx.remat(fn, policy=_REMAT[self.config.remat])

        @nnx.scan(in_axes=(0, nnx.Carry) + (0,) * len(scanned), out_axes=(nnx.Carry, 0),
                  unroll=1 if self.config.scan_layers else True)
        def step(block, carry, *per_block):
            return fn(block, carry, *per_block)

        return step(self.blocks, x, *scanned)

    @property
    def can_decode(self) -> bool:
        return self.config.kind not in ("mac", "closed_form")

    @property
    def decodes_chunk_ends(self) -> bool:
        """Whether a decode step's work depends on ``pos`` being a chunk's last position (a memory
        layer that decodes its chunk-start form: `MemoryLayer.decodes_by_chunk`)."""
        block = self.blocks
        mixes = [getattr(block, f"mix{i}") for i in range(len(block.kinds))]
        layers = [getattr(mix, "memory", mix) for mix in mixes]
        return any(isinstance(layer, MemoryLayer) and layer.decodes_by_chunk for layer in layers)

    # -- the calls -------------------------------------------------------------------------------
    def __call__(self, tokens, segment_ids=None):
        self._check_tokens(tokens)
        if segment_ids is not None:
            self._check_tokens(segment_ids, "segment_ids")
            if segment_ids.shape != tokens.shape:
                raise ValueError(f"segment_ids must have the tokens' shape {tuple(tokens.shape)}, "
                                 f"got {tuple(segment_ids.shape)}")
        if segment_ids is not None and self.config.kind == "mac":
            return self._packed_by_rows(tokens, segment_ids)
        x = self.embed(tokens).astype(jnp.float32)
        positions = None if segment_ids is None else document_positions(segment_ids)[1]

        def apply(block, x):
            return block(x, segment_ids=segment_ids, positions=positions), None

        x, _ = self._run_blocks(apply, x)
        return self._logits(x)

    def _packed_by_rows(self, tokens, segment_ids):
        """Packed documents for layers without a per-token restart: every document becomes its own
        row (exact; costs max_documents rows)."""
        from atlas_jax.models.layers import from_document_rows, to_document_rows
        m = self.config.max_documents
        doc, pos = document_positions(segment_ids)
        logits = self(to_document_rows(tokens, doc, pos, m))
        return from_document_rows(logits, doc, pos, m)

    def prefill(self, tokens, max_len: int):
        """Logits of the prompt and every layer's cache (memory state, short-conv tail, KV cache of
        ``max_len`` slots or a ``window`` ring buffer)."""
        self._check_tokens(tokens)
        if not self.can_decode:
            raise NotImplementedError(f"{self.config.name}: kind {self.config.kind!r} has no decode cache")
        x = self.embed(tokens).astype(jnp.float32)
        x, cache = self._run_blocks(lambda block, x: block.prefill(x, max_len), x)
        return self._logits(x), cache

    def decode(self, token, cache, pos, *, chunk_end=None):
        """One token [B, 1] at absolute position ``pos`` (int32 scalar) -> (logits [B, 1, V], cache).
        ``chunk_end``: None, or whether ``pos`` is a memory chunk's last position
        (pos % config.chunk_size == config.chunk_size − 1), as a Python bool (`MemoryLayer.decode`)."""
        x = self.embed(token).astype(jnp.float32)
        layer = lambda cache, i: jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False), cache)

        # The stacked cache rides in the layer scan's carry: each block reads its slice and writes
        # back only the entries its step changed, in place where the cache is carried (`generate`'s
        # scan over tokens). As the scan's input and output it was a new [layers, ...] buffer every
        # token, every entry copied (a deep memory's cache is θ-sized: 1.34 GB at atlas 170m B2).
        # atlas 170m, NS per chunk, bf16 B2 on an H200: generate 5.94 -> 3.53 ms a token with the
        # static chunk ends (`MemoryLayer.decode`), 4.28 with them and the cache as input and output
        # (benchmarks/results/decode_carry_h200_2026-12-01.md).
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0), unroll=1 if self.config.scan_layers else True)
        def blocks(block, carry):
            x, cache, i = carry
            old = layer(cache, i)
            x, new = block.decode(x, old, pos, chunk_end=chunk_end)
            cache = jax.tree.map(lambda c, n, o: c if n is o else jax.lax.dynamic_update_index_in_dim(
                c, n.astype(c.dtype), i, 0), cache, new, old)
            return (x, cache, i + 1), None

        (x, cache, _), _ = blocks(self.blocks, (x, cache, jnp.int32(0)))
        return self._logits(x), cache

