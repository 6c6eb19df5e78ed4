"""atlas_jax.ops.deep_memory.chunk_step_memory against titans-pytorch's NeuralMemory (CPU, seconds).

Builds a NeuralMemory, takes every input of its memory (keys, values, queries, per-token lr, the
per-chunk momentum and decay gates, the retrieve gate, θ_0) from its own modules, runs our op on
them and puts the reads through the module's gate and head merge. Prints the largest difference
of the module's output and of its final weights and momentum, for its default ``batch_size=None``
and for ``batch_size=chunk``, float32, T a whole number of chunks and not.

The memory model is NeuralMemory's ``MemoryMLP`` (depth 2, GELU, no biases) without its
``ResidualNorm`` wrapper (``mem_model_norm_add_residual=False``): that wrapper's LayerNorm has a
gain which the inner loop also trains, and none of this library's memories has one.

    python benchmarks/titans_pytorch_parity.py     # needs torch and titans-pytorch (../shared/bench)
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from titans_pytorch_schedule import neural_memory_class  # noqa: E402


def from_torch(mem, x, chunk):
    """Our op's inputs from the module's own layers, float32 numpy, [B, T, H, ·] layout."""
    B, T, _ = x.shape
    H, N = mem.heads, T // chunk
    with torch.no_grad():
        seq = mem.store_norm(x)
        lr = mem.adaptive_step_transform(mem.to_adaptive_step(seq)).reshape(B, H, T)   # '(b h) n'
        pooled = mem.reduce_to_chunk_rep(seq[:, :N * chunk], chunk_size=chunk)
        decay = mem.to_decay_factor(pooled).sigmoid().reshape(B, H, N)
        eta = mem.to_momentum(pooled).sigmoid().reshape(B, H, N)
        keys = mem.split_kv_heads(mem.to_keys(seq))          # [B, H, T, D]
        values = mem.split_kv_heads(mem.to_values(seq))
        retrieve = mem.retrieve_norm(x)
        queries = mem.split_heads(mem.to_queries(retrieve))
        gate = mem.retrieve_gate(retrieve)                  # [B, H, T, 1]
        weights = [p.detach() for p in mem.memory_model_parameters]   # [H, D, h], [H, h, D]
    bthd = lambda t: t.permute(0, 2, 1, 3).numpy()
    bth = lambda t: t.permute(0, 2, 1).numpy()
    d = keys.shape[-1]
    return dict(q=bthd(queries), k=bthd(keys), v=bthd(values),
                # its loss is the channel mean of the squared error; ours is ½‖·‖²
                beta=bth(lr) * 2.0 / d, nu=bth(eta), g=np.log(bth(1.0 - decay)),
                params={"W0": weights[0].numpy(), "W1": weights[1].numpy()}), gate


def main(chunk=4, heads=2, dim_head=8, expansion=4):
    import jax
    import jax.numpy as jnp
    from atlas_jax.memory import MLPMemory
    from atlas_jax.ops.deep_memory import chunk_step_memory

    NeuralMemory = neural_memory_class()
    memory = MLPMemory(2, dim_head * expansion, activation="gelu")
    worst = 0.0
    for batch_size in (None, chunk):
        for T in (6 * chunk, 6 * chunk + 3):
            torch.manual_seed(0)
            mem = NeuralMemory(dim=heads * dim_head, chunk_size=chunk, heads=heads, dim_head=dim_head,
                               batch_size=batch_size, mem_model_norm_add_residual=False,
                               default_model_kwargs=dict(depth=2, expansion_factor=expansion))
            x = torch.randn(2, T, heads * dim_head)
            with torch.no_grad():
                out, state = mem(x)
            a, gate = from_torch(mem, x, chunk)
            whole = T % chunk == 0
            o, final = chunk_step_memory(jnp.asarray(a["q"]), jnp.asarray(a["k"]), jnp.asarray(a["v"]),
                                         jnp.asarray(a["beta"]), jnp.asarray(a["nu"]), jnp.asarray(a["g"]),
                                         a["params"], memory=memory, chunk_size=chunk,
                                         segment=batch_size, output_final_state=whole)
            reads = torch.from_numpy(np.asarray(o)).permute(0, 2, 1, 3) * gate    # [B, H, T, D]
            with torch.no_grad():
                ours = mem.combine_heads(mem.merge_heads(reads))
            diff = (ours - out).abs().max().item()
            line = f"batch_size={batch_size}, T={T}: output max |ours − titans-pytorch| {diff:.2e} (of {out.abs().max().item():.2f})"
            worst = max(worst, diff / out.abs().max().item())
            if whole:
                last_update, last_momentum = state.states
                theirs = [last_update["weights.0"], last_update["weights.1"],
                          last_momentum["weights.0"][-1], last_momentum["weights.1"][-1]]
                mine = [final.params["W0"], final.params["W1"], final.momentum["W0"], final.momentum["W1"]]
                state_diff = max(np.abs(np.asarray(m).reshape(t.shape) - t.numpy()).max() for m, t in zip(mine, theirs))
                line += f"; final weights and momentum {state_diff:.2e}"
                worst = max(worst, state_diff / max(t.abs().max().item() for t in theirs))
            print(line)
    print(f"largest relative difference {worst:.2e}")
    return worst


if __name__ == "__main__":
    sys.exit(0 if main() < 1e-4 else 1)
