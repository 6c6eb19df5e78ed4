"""Where does titans-pytorch's NeuralMemory take each chunk's gradients? (CPU, seconds.)

Changes only the first chunk's tokens and prints how much the second chunk's surprise (its
per-token memory loss, `return_surprises=True`) moves. It stays put with the default
``batch_size=None``: every chunk's gradients are taken at the initial weights. It moves with
``batch_size=chunk``: each chunk's gradients are taken at the weights after the chunk before,
as the titans preset here takes them (`deep_memory.py`'s two titans-pytorch entries).

    python benchmarks/titans_pytorch_schedule.py     # needs torch and titans-pytorch (../shared/bench)
"""
import os
import sys
import types

import torch


def neural_memory_class():
    """titans-pytorch's NeuralMemory, imported without the package's __init__ (as ../shared/bench's
    anchors_gpu.py does: the package __init__ pulls in more than the memory needs)."""
    base = [p for p in sys.path if os.path.isdir(os.path.join(p, "titans_pytorch"))]
    if not base:
        raise ImportError("titans_pytorch is not on sys.path")
    pkg = types.ModuleType("titans_pytorch")
    pkg.__path__ = [os.path.join(base[0], "titans_pytorch")]
    sys.modules["titans_pytorch"] = pkg
    from titans_pytorch.neural_memory import NeuralMemory
    return NeuralMemory


def main(chunk=8, chunks=4, dim=32, heads=2):
    NeuralMemory = neural_memory_class()
    for batch_size in (None, chunk):
        torch.manual_seed(0)
        mem = NeuralMemory(dim=dim, chunk_size=chunk, heads=heads, dim_head=dim // heads, batch_size=batch_size)
        x = torch.randn(1, chunks * chunk, dim)
        y = x.clone()
        y[:, :chunk] = torch.randn(1, chunk, dim)      # the first chunk changed, the rest the same
        with torch.no_grad():
            surprise_x = mem(x, return_surprises=True)[2][0]
            surprise_y = mem(y, return_surprises=True)[2][0]
        moved = lambda k: (surprise_x[..., k * chunk:(k + 1) * chunk]
                           - surprise_y[..., k * chunk:(k + 1) * chunk]).abs().max().item()
        print(f"batch_size={batch_size}: the first chunk's surprise moved {moved(0):.3e}, "
              f"the second chunk's {moved(1):.3e}")


if __name__ == "__main__":
    main()
