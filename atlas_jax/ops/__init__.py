"""Public sequence-mixing ops (flash-linear-attention compatible signatures)."""

from __future__ import annotations

from atlas_jax.ops.delta_family.api import (
    delta_product,
    delta_rule,
    gated_delta_rule,
    kda,
    linear_attention,
)

__all__ = ["delta_product", "delta_rule", "gated_delta_rule", "kda", "linear_attention"]
