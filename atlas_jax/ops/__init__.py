"""Public sequence-mixing ops (flash-linear-attention compatible signatures).

`run_delta_family` is the one validated entry of the delta family (what the forms call); the
five fla-compatible ops are thin wrappers over it. `omega_linear_chunk` / `omega_linear_recurrent`:
the exact Omega rule on a linear memory (sliding window c, decoupled decay; swla) in XLA;
`omega_linear` picks one of them or the Pallas kernels (impl=, as the delta family).
Importing this package imports no Pallas kernel: they load at trace time, when a call picks them.
"""

from __future__ import annotations

from atlas_jax.ops.delta_family.api import (
    IMPLS,
    delta_product,
    delta_rule,
    gated_delta_rule,
    kda,
    linear_attention,
    run_delta_family,
    runs_kernel,
)
from atlas_jax.ops.omega import omega_linear, omega_linear_chunk, omega_linear_recurrent

__all__ = ["IMPLS", "delta_product", "delta_rule", "gated_delta_rule", "kda",
           "linear_attention", "omega_linear", "omega_linear_chunk", "omega_linear_recurrent",
           "run_delta_family", "runs_kernel"]
