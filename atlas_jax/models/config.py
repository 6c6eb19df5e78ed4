"""Model configuration: one frozen dataclass, validated on construction, built from YAML files.

A model is a *name* (a memory preset, a baseline or a hybrid) and a *size*:

    configs/models/<preset>.yml   preset + options (the recurrence), optional ``model:`` mapping
    configs/sizes/<size>.yml      blocks, width, heads, MLP width, vocabulary (ATLAS Table 7)

and ``build(name, size, **overrides)`` merges defaults < model mapping < size < hybrid recipe <
overrides. Every field that does not fit raises one ValueError naming the field and what is allowed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atlas_jax.config import load_yaml

try:        # the shipped configs, also from an installed (non-editable) package
    from atlas_jax.config import config_dir as _config_dir
except ImportError:   # older atlas_jax.config
    from atlas_jax.config import repo_root

    def _config_dir() -> Path:
        return repo_root() / "configs"

__all__ = ["ModelConfig", "KINDS", "IMPLS", "REMAT_POLICIES", "SIZES", "size_values", "model_values",
           "sizes_dir", "models_dir"]

KINDS = ("memory", "attention", "closed_form", "mag", "mal", "mac", "samba")
IMPLS = ("auto", "pallas", "chunk", "recurrent")
REMAT_POLICIES = ("none", "full", "dots", "dots_and_kernels")
DTYPES = ("float32", "bfloat16")
MEMORY_INITS = ("per_head", "shared", "fixed")
SIZES = ("tiny", "170m", "340m", "760m", "1.3b")
STEP_SCHEDULES = ("token", "chunk", "chunk_from_theta0")   # the memory layer's (models.layers.run_chunk_steps)


def sizes_dir() -> Path:
    return _config_dir() / "sizes"


def models_dir() -> Path:
    return _config_dir() / "models"


def _positive_int(name, value, *, allow_zero=False):
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"model config: {name} must be an int {'>= 0' if allow_zero else '>= 1'}, got {value!r}")


def _choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"model config: {name} must be one of {list(allowed)}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Everything that shapes a language model. Field names are the YAML keys and override names."""

    name: str = "gated_deltanet"
    kind: str = "memory"                 # memory | attention | closed_form | mag | mal | mac | samba
    preset: str | None = "gated_deltanet"  # the memory preset of memory/closed_form/hybrid layers
    preset_options: tuple = ()           # ((key, value), ...) of the preset factory (hashable)
    # size (configs/sizes)
    vocab_size: int = 256
    width: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_hidden: int = 128
    context_length: int = 64             # the training context; attention windows must fit in it
    tie_embeddings: bool = True
    # attention
    attention_window: int | None = None  # sliding window of swa and the hybrids' attention
    rope_theta: float = 10000.0
    num_persistent: int = 4              # MAC: learnable persistent memory tokens
    mac_segment: int = 16                # MAC: segment length
    # memory layer
    impl: str = "auto"                   # auto | pallas | chunk | recurrent
    chunk_size: int = 64
    conv_size: int = 4                   # causal depthwise short convolution on q, k, v (0: none)
    gate_rank: int = 16                  # low-rank projection of channel-wise gates
    memory_init: str = "shared"          # learnable θ_0 of deep memories: per_head | shared | fixed
    max_documents: int = 8               # packed rows: at most this many documents per row
    step_size_max: float | None = None   # β = step_size_max·sigmoid(·); None: 1 (linear), 1e-3 (deep)
    expand_v: float = 1                  # value head width = expand_v · head_dim (fla's expand_v)
    # token: the preset's recurrence; chunk / chunk_from_theta0: titans-pytorch's one inner step per
    # chunk, gradients at each chunk's start / at θ_0 (its batch_size=chunk_size / its default)
    step_schedule: str = "token"
    # numerics and compilation
    dtype: str = "float32"               # compute dtype (bfloat16 for training on accelerators)
    param_dtype: str = "float32"
    remat: str = "none"                  # none | full | dots | dots_and_kernels
    # True: one lax.scan over the blocks (a compact program); False: unrolled (longer compile; on
    # GPU the backward's saved values are not copied in and out of stacked scan buffers)
    scan_layers: bool = True
    norm_eps: float = 1e-6

    def __post_init__(self):
        _choice("kind", self.kind, KINDS)
        _choice("impl", self.impl, IMPLS)
        _choice("remat", self.remat, REMAT_POLICIES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("param_dtype", self.param_dtype, DTYPES)
        _choice("memory_init", self.memory_init, MEMORY_INITS)
        _choice("step_schedule", self.step_schedule, STEP_SCHEDULES)
        for name in ("vocab_size", "width", "num_layers", "num_heads", "mlp_hidden", "context_length",
                     "chunk_size", "gate_rank", "mac_segment", "max_documents"):
            _positive_int(name, getattr(self, name))
        _positive_int("conv_size", self.conv_size, allow_zero=True)
        for name in ("tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model config: {name} must be true or false, got {getattr(self, name)!r}")
        _positive_int("num_persistent", self.num_persistent, allow_zero=True)
        if self.width % self.num_heads:
            divisors = [h for h in range(1, self.width + 1) if self.width % h == 0]
            raise ValueError(f"model config: num_heads={self.num_heads} does not divide width={self.width}; "
                             f"allowed num_heads for this width: {divisors}")
        if self.kind in ("memory", "closed_form", "mag", "mal", "mac", "samba") and self.preset is None:
            raise ValueError(f"model config: kind {self.kind!r} needs a memory preset (preset=...)")
        if self.kind == "samba" and self.num_layers % 2:
            raise ValueError(f"model config: num_layers={self.num_layers} must be even for a Samba-style "
                             "hybrid (memory and attention layers alternate)")
        if self.kind in ("mag", "mal", "samba", "attention") and self.attention_window is not None:
            _positive_int("attention_window", self.attention_window)
            if self.attention_window > self.context_length:
                raise ValueError(f"model config: attention_window={self.attention_window} is larger than "
                                 f"context_length={self.context_length}; allowed: 1..{self.context_length}")
        if self.kind in ("mag", "mal", "samba") and self.attention_window is None:
            raise ValueError(f"model config: the {self.kind} hybrid needs attention_window (1..{self.context_length})")
        if self.kind == "mac" and self.mac_segment > self.context_length:
            raise ValueError(f"model config: mac_segment={self.mac_segment} is larger than "
                             f"context_length={self.context_length}; allowed: 1..{self.context_length}")
        if self.step_size_max is not None and not (isinstance(self.step_size_max, (int, float)) and self.step_size_max > 0):
            raise ValueError(f"model config: step_size_max must be a float > 0 or null, got {self.step_size_max!r}")
        value_dim = self.head_dim * self.expand_v if isinstance(self.expand_v, (int, float)) else 0
        if isinstance(self.expand_v, bool) or value_dim < 1 or value_dim != int(value_dim):
            raise ValueError(f"model config: expand_v={self.expand_v!r} must make expand_v · head_dim "
                             f"({self.head_dim}) a whole number >= 1, e.g. 1 or 2")
        if self.expand_v != 1 and self.kind != "memory":
            raise ValueError(f"model config: expand_v={self.expand_v} needs kind 'memory' (a pure memory model); "
                             f"kind {self.kind!r} mixes the memory with attention heads of width {self.head_dim}")
        if not isinstance(self.preset_options, tuple):
            raise ValueError("model config: preset_options must be a tuple of (key, value) pairs "
                             "(build() converts a dict)")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def options(self) -> dict:
        return dict(self.preset_options)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def size_values(size: str) -> dict:
    """The mapping of ``configs/sizes/<size>.yml``."""
    if not isinstance(size, str) or not (sizes_dir() / f"{size}.yml").is_file():
        available = sorted(p.stem for p in sizes_dir().glob("*.yml"))
        raise ValueError(f"size: unknown size {size!r}; choose one of {available}")
    values = load_yaml(sizes_dir() / f"{size}.yml")
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(f"size {size!r}: unknown key(s) {unknown}; valid keys: {list(FIELDS)}")
    return values


def model_values(preset: str) -> tuple[dict, dict]:
    """(options, model mapping) of ``configs/models/<preset>.yml``."""
    path = models_dir() / f"{preset}.yml"
    if not path.is_file():    # a preset without a config file: its factory defaults
        return {}, {}
    data: dict[str, Any] = load_yaml(path)
    model = dict(data.get("model") or {})
    unknown = sorted(set(model) - set(FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown} under 'model'; valid keys: {list(FIELDS)}")
    return dict(data.get("options") or {}), model
