"""atlas_jax: test-time-memory sequence models on four axes (memory, objective, optimizer, retention).

    import atlas_jax as aj
    spec = aj.MemorySpec(memory=aj.memory.MLPMemory(), objective=aj.objectives.L2(),
                         optimizer=aj.optimizers.momentum(), retention=aj.retention.scalar())
    o, state = spec(q, k, v, beta=beta, g=g, initial_state=spec.init_state(key, batch=B, heads=H, d_k=K, d_v=V))
"""
from atlas_jax import features, memory, objectives, optimizers, retention
from atlas_jax.forms.common import MemoryState, WindowCache
from atlas_jax.spec import MemorySpec

__version__ = "0.1.0"
__all__ = ["MemorySpec", "MemoryState", "WindowCache", "features", "memory", "objectives", "optimizers",
           "retention", "__version__"]
