"""atlas_jax: test-time-memory sequence models on four axes (memory, objective, optimizer, retention).

    import atlas_jax as aj
    spec = aj.presets.get("titans")                                  # any model of the design space
    o, state = spec(q, k, v, beta=beta, g=g, initial_state=spec.init_state(key, batch=B, heads=H, d_k=K, d_v=V),
                    impl="chunk")
    o, S = aj.ops.gated_delta_rule(q, k, v, g, beta)                 # flash-linear-attention's ops
    model = aj.models.build("atlas", "tiny", rngs=flax.nnx.Rngs(0))  # a language model

``ops``, ``presets`` and the four axes load with the package; ``models`` (Flax) and ``train`` load
on first use, and no Pallas kernel or plotting library is imported until a call needs it.
"""
import importlib

from atlas_jax import features, memory, objectives, ops, optimizers, presets, retention
from atlas_jax.forms.common import MemoryState, WindowCache
from atlas_jax.spec import IMPLS, MemorySpec

__version__ = "0.1.0"
__all__ = ["MemorySpec", "MemoryState", "WindowCache", "IMPLS", "features", "memory", "objectives", "ops",
           "optimizers", "presets", "retention", "models", "train", "__version__"]

_LAZY = ("models", "train")   # Flax, orbax, grain: only for those who build or train a model


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f"atlas_jax.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'atlas_jax' has no attribute {name!r}")
