"""The optimizer, in one function: global-norm clipping -> AdamW, linear warmup then cosine decay."""
from __future__ import annotations

import jax
import optax

from .config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio)


DECAYED_NAMES = ("kernel", "embedding")


def decay_mask(params):
    """Weight decay on the weight matrices of linear maps and embeddings (Flax names them `kernel`
    and `embedding`) only: norms' scales, biases, gates, initial memories and persistent tokens
    keep their meaning without being pulled to zero. Names, not ndim: blocks are stacked for
    nnx.scan, so a norm's scale is 2-D."""
    def decayed(path, leaf):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return bool(names) and names[-1] in DECAYED_NAMES and getattr(leaf, "ndim", 0) >= 2
    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*chain, adamw), schedule
