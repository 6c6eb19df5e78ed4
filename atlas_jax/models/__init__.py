"""Language models of every preset, the attention baselines and the papers' hybrids (Flax NNX).

    from flax import nnx
    import atlas_jax.models as models
    model = models.build("gated_deltanet", "tiny", rngs=nnx.Rngs(0))
    logits = model(tokens)                                   # [B, T] int32 -> [B, T, vocab] float32
    out = models.generate(model, prompt_tokens, 32, temperature=0.0, rng=jax.random.PRNGKey(0))
"""
from atlas_jax.models.backbone import Block, LanguageModel
from atlas_jax.models.build import build, config_for, memory_state_size, names, param_count
from atlas_jax.models.config import ModelConfig
from atlas_jax.models.generation import generate, sample_logits

__all__ = ["build", "config_for", "names", "param_count", "memory_state_size", "generate", "sample_logits",
           "LanguageModel", "Block", "ModelConfig"]
