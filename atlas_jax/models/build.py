"""Names, building, parameter counts and memory-state sizes of the language models.

    model = atlas_jax.models.build("gated_deltanet", "tiny", rngs=nnx.Rngs(0))
    logits = model(tokens)                                  # [B, T] int32 -> [B, T, vocab] float32
    atlas_jax.models.names()                                # every buildable name
    atlas_jax.models.param_count("atlas", "340m")           # from nnx.eval_shape: nothing allocated

How parameters are counted: every ``nnx.Param`` leaf of the built model, from its abstract shapes
(``nnx.eval_shape``): embedding, every block (projections, short convolutions, gate projections,
norms, MLPs, φ's coefficients, learnable θ_0, persistent tokens) and the output head; a tied head is
the embedding itself and so counted once. A fixed θ_0 (``memory_init=fixed``) is not a parameter.
With the T5 vocabulary (32,000) and tied embeddings as in configs/sizes (ATLAS Table 7 widths and
depths, SwiGLU hidden ≈ 8/3 · width, 16 heads of 64 at 340m), the counts are

    size   transformer  gated_deltanet  titans   atlas    (atlas: θ_0 on C(66, 2) = 2145 features)
    340m   341.1M       367.3M          368.5M   385.0M
    760m   728.7M       787.0M          789.3M   843.8M

all within 15% of the nominal sizes (tested). An untied head adds vocab × width (32.8M at 340m).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax import presets
from atlas_jax.models.backbone import LanguageModel, _num_blocks
from atlas_jax.models.config import FIELDS, ModelConfig, model_values, size_values

__all__ = ["names", "build", "config_for", "param_count", "memory_state_size", "HYBRIDS"]

# name -> (kind, memory preset, config changes)
HYBRIDS = {
    "transformer": ("attention", None, {"attention_window": None}),
    "swa": ("attention", None, {}),
    "titans_mag": ("mag", "titans", {}),
    "titans_mal": ("mal", "titans", {}),
    "titans_mac": ("mac", "titans", {}),
    "atlas_mag": ("mag", "atlas", {}),
    "atlas_mal": ("mal", "atlas", {}),
    "atlas_mac": ("mac", "atlas", {}),
    "moneta_h": ("samba", "moneta", {}),
    "yaad_h": ("samba", "yaad", {}),
    "memora_h": ("samba", "memora", {}),
}


def names() -> list[str]:
    """Every name ``build`` accepts: the presets of DESIGN §2, the baselines and the hybrids."""
    return presets.names() + list(HYBRIDS)


def config_for(name: str, size: str = "tiny", **overrides) -> ModelConfig:
    """The ModelConfig of ``name`` at ``size`` with ``overrides`` (ModelConfig fields; a
    ``preset_options`` dict updates the preset's YAML options)."""
    if name not in names():
        raise ValueError(f"model name: unknown name {name!r}; choose one of {names()}")
    unknown = sorted(set(overrides) - set(FIELDS) - {"name", "kind", "preset"})
    if unknown:
        raise ValueError(f"build: unknown override(s) {unknown}; valid: {[f for f in FIELDS if f not in ('name', 'kind', 'preset')]}")
    if name in HYBRIDS:
        kind, preset, changes = HYBRIDS[name]
    else:
        preset = name
        kind = "closed_form" if isinstance(presets.get(name), presets.ClosedForm) else "memory"
        changes = {}
    values: dict = {}
    options: dict = {}
    if preset is not None:
        options, model = model_values(preset)
        values.update(model)
    values.update(size_values(size))
    values.update(changes)
    overrides = dict(overrides)
    options.update(dict(overrides.pop("preset_options", None) or {}))
    values.update(overrides)
    values.update(name=name, kind=kind, preset=preset, preset_options=tuple(sorted(options.items())))
    return ModelConfig(**values)


def _spec(cfg: ModelConfig):
    return None if cfg.preset is None else presets.get(cfg.preset, **cfg.options)


def build(name: str, size: str = "tiny", *, rngs: nnx.Rngs, **overrides) -> LanguageModel:
    """The language model ``name`` at ``size`` (configs/sizes/<size>.yml), parameters drawn from ``rngs``."""
    cfg = config_for(name, size, **overrides)
    spec = _spec(cfg)
    if spec is not None and cfg.kind in ("mag", "mal", "mac", "samba", "memory") and not hasattr(spec, "init_state"):
        raise ValueError(f"model {name!r}: preset {cfg.preset!r} is a closed form and cannot be a hybrid's memory")
    if cfg.impl == "pallas" and spec is not None and not getattr(spec, "has_kernel", False):
        raise ValueError(f"model config: impl='pallas' covers the exact delta family (ℓ2 objective), the "
                         f"exact Omega rule on a linear memory and depth-2 MLP memories with ℓ2 and GD or "
                         f"momentum (titans, ttt_mlp), and preset {cfg.preset!r} is none of them; choose "
                         f"impl in ['auto', 'chunk', 'recurrent']")
    return LanguageModel(cfg, spec, rngs=rngs)


def param_count(name: str, size: str = "tiny", **overrides) -> int:
    """Trainable parameters of the model (see the module docstring for what is counted)."""
    abstract = nnx.eval_shape(lambda: build(name, size, rngs=nnx.Rngs(0), **overrides))
    state = nnx.state(abstract, nnx.Param)
    return int(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state)))


def memory_state_size(name: str, size: str = "tiny", **overrides) -> dict:
    """Floats one memory layer carries per sequence (all heads): θ, the inner optimizer's state and
    the rest (retention accumulator, Omega-window cache), and how many such layers the model has.
    Attention-only models report zeros (their KV cache grows with the context instead)."""
    cfg = config_for(name, size, **overrides)
    spec = _spec(cfg)
    if spec is None or not hasattr(spec, "init_state"):
        return {"theta": 0, "optimizer": 0, "other": 0, "total": 0, "memory_layers": 0}
    d, d_v = cfg.head_dim, int(cfg.head_dim * cfg.expand_v)
    state = jax.eval_shape(lambda: spec.init_state(jax.random.PRNGKey(0), batch=1, heads=cfg.num_heads, d_k=d, d_v=d_v))
    count = lambda tree: int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))
    theta, opt = count(state.params), count(state.opt_state)
    other = count(state.accumulator) + count(state.window)
    return {"theta": theta, "optimizer": opt, "other": other, "total": theta + opt + other,
            "memory_layers": _num_blocks(cfg)}
