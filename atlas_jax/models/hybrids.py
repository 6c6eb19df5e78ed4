"""The hybrids of Titans / ATLAS / MIRAS as sequence mixers built from a memory layer and attention.

* MAG (memory as a gate): a memory branch and a sliding-window-attention branch read the same
  input in parallel; out = RMSNorm(attention) ⊙ σ(RMSNorm(memory)).
* MAL (memory as a layer): the memory layer, then the SWA layer, in one block (backbone.py).
* MAC (memory as context): the sequence is cut into segments; for segment s the memory state left
  by segments < s is *read* at the segment's queries (retrieved memory tokens h), attention runs
  over [persistent tokens | h | segment] (persistent and retrieved tokens causal by position), the
  memory is then *written* with the attention output y, and out = y ⊙ σ(memory(y)).
* Samba-style "-H" (Moneta-H, Yaad-H, Memora-H): memory and SWA layers alternate, each with its MLP.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.models.layers import Attention, MemoryLayer, apply_rope

__all__ = ["MAG", "MAC"]


class MAG(nnx.Module):
    def __init__(self, memory: MemoryLayer, attention: Attention, width: int, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32, eps: float = 1e-6):
        self.memory, self.attention = memory, attention
        norm = lambda: nnx.RMSNorm(width, epsilon=eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.attention_norm, self.memory_norm = norm(), norm()
        self.dtype = dtype

    def _combine(self, a, m):
        return (self.attention_norm(a) * jax.nn.sigmoid(self.memory_norm(m))).astype(self.dtype)

    def __call__(self, x, segment_ids=None, positions=None):
        return self._combine(self.attention(x, segment_ids, positions), self.memory(x, segment_ids))

    def prefill(self, x, max_len):
        a, attention_cache = self.attention.prefill(x, max_len)
        m, memory_cache = self.memory.prefill(x, max_len)
        return self._combine(a, m), {"attention": attention_cache, "memory": memory_cache}

    def decode(self, x, cache, pos, *, chunk_end=None):
        a, attention_cache = self.attention.decode(x, cache["attention"], pos)
        m, memory_cache = self.memory.decode(x, cache["memory"], pos, chunk_end=chunk_end)
        return self._combine(a, m), {"attention": attention_cache, "memory": memory_cache}


class MAC(nnx.Module):
    """Memory as context over segments of ``segment`` tokens (T is padded to a multiple; padding
    comes after every real token, so causality keeps it out of the outputs)."""

    def __init__(self, memory: MemoryLayer, width: int, heads: int, *, segment: int, num_persistent: int,
                 rope_theta: float, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32, eps: float = 1e-6):
        self.memory = memory
        self.attention = Attention(width, heads, window=None, rope_theta=rope_theta, rngs=rngs, dtype=dtype,
                                   param_dtype=param_dtype)
        self.retrieved_proj = nnx.Linear(width, width, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.persistent = nnx.Param(0.02 * jax.random.normal(rngs.params(), (num_persistent, width), param_dtype))
        self.memory_norm = nnx.RMSNorm(width, epsilon=eps, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.segment, self.num_persistent, self.dtype = segment, num_persistent, dtype
        if memory.step_schedule != "token" and segment % memory.chunk_size:
            raise ValueError(f"MAC: mac_segment={segment} must be a multiple of chunk_size={memory.chunk_size} on "
                             f"step_schedule={memory.step_schedule!r}: the memory steps once per whole chunk, and a "
                             "segment's final state needs whole chunks")

    def _read(self, state, x):
        """M_θ(φ(q)) with θ the state at the segment start, for the segment's queries: reading the
        memory is applying its architecture, not running the recurrence."""
        mem = self.memory
        q = mem._inputs(x)[0]
        spec = mem.spec
        coeffs = {} if mem.feature_coeffs is None else {"coeffs": mem.feature_coeffs[...].astype(jnp.float32)}
        fq = spec.feature_map.apply(coeffs, mem.scale * q.astype(jnp.float32))            # [B, S, H, d_φ]
        return mem.read(mem.state_params(state), fq)                                      # [B, S, H, V]

    def _attend(self, x, retrieved, segment_start):
        batch, seg = x.shape[:2]
        p = self.num_persistent
        persistent = jnp.broadcast_to(self.persistent[...].astype(self.dtype), (batch, p, x.shape[-1]))
        context = jnp.concatenate([persistent, retrieved, x], axis=1)            # [B, P + 2S, W]
        att = self.attention
        split = lambda y: y.reshape(y.shape[:2] + (att.heads, att.head_dim))
        q = split(att.q_proj(x))
        k, v = split(att.k_proj(context)), split(att.v_proj(context))
        t = jnp.arange(seg)
        # Persistent tokens sit before the segment, retrieved token i at the position of token i.
        key_pos = jnp.concatenate([jnp.zeros((p,), jnp.int32), t, t]) + segment_start
        q = apply_rope(q, jnp.broadcast_to(t + segment_start, (batch, seg)), att.rope_theta)
        k = apply_rope(k, jnp.broadcast_to(key_pos, (batch, p + 2 * seg)), att.rope_theta)
        visible = jnp.concatenate([jnp.ones((seg, p), bool), t[:, None] >= t[None, :], t[:, None] >= t[None, :]], axis=1)
        o = jax.nn.dot_product_attention(q, k, v, mask=visible[None, None])
        return att._out(o)

    def __call__(self, x, segment_ids=None, positions=None):
        if segment_ids is not None:
            raise NotImplementedError("MAC: packed documents are handled by the model (one row per "
                                      "document), not inside the layer")
        batch, time, width = x.shape
        seg = self.segment
        n_seg = -(-time // seg)
        xs = jnp.pad(x, ((0, 0), (0, n_seg * seg - time), (0, 0))).reshape(batch, n_seg, seg, width)
        mem = self.memory
        state0 = mem.start_state(batch)

        def one_segment(state, inputs):
            index, x_seg = inputs
            retrieved = self.retrieved_proj(self._read(state, x_seg).reshape(batch, seg, -1).astype(self.dtype))
            y = self._attend(x_seg, retrieved, index * seg)
            q, k, v, knobs = mem._inputs(y)
            o, state = mem._run(q, k, v, knobs, impl=mem.impl, initial_state=state, output_final_state=True)
            m = mem._out(o, y)
            return state, (y.astype(jnp.float32) * jax.nn.sigmoid(self.memory_norm(m))).astype(self.dtype)

        _, out = jax.lax.scan(one_segment, state0, (jnp.arange(n_seg), jnp.moveaxis(xs, 1, 0)))
        return jnp.moveaxis(out, 0, 1).reshape(batch, n_seg * seg, width)[:, :time]
