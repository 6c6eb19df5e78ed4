"""Up-front argument checks shared by the public ops.

Every message names the op, the argument, what was expected and how to fix it, so that a shape
mistake surfaces here rather than as an opaque einsum or scan error deep inside a kernel.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

IMPLS = ("recurrent", "chunk", "pallas", "auto")


def as_float_array(fn, name, x):
    """Returns `x` as an array; TypeError unless its dtype is floating."""
    if not hasattr(x, "dtype"):
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{fn}: argument `{name}` must have a floating dtype (float32, bfloat16, float16); "
            f"got {x.dtype}. Cast it first, e.g. `{name}.astype(jnp.float32)`.")
    return x


def check_rank(fn, name, x, layout):
    """ValueError unless `x.ndim` equals the number of axes in `layout` (e.g. "[B, T, H, K]")."""
    rank = len(layout.strip("[]").split(","))
    if x.ndim != rank:
        raise ValueError(
            f"{fn}: argument `{name}` must have rank {rank} with layout {layout}; got shape "
            f"{tuple(x.shape)} (rank {x.ndim}). Inputs are batch-first, time-second: reshape "
            f"`{name}` to {layout}.")


def check_shape(fn, name, x, expected, layout, hint=""):
    """ValueError unless `x.shape == expected`; `hint` is appended to the message."""
    if tuple(x.shape) != tuple(expected):
        msg = (f"{fn}: argument `{name}` must have shape {layout} = {tuple(expected)}; got "
               f"{tuple(x.shape)}.")
        raise ValueError(msg + (" " + hint if hint else ""))


def check_impl(fn, impl):
    """ValueError unless `impl` is one of IMPLS."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"{fn}: argument `impl` must be one of {IMPLS}; got {impl!r}.")


def check_chunk_size(fn, chunk_size):
    """ValueError unless `chunk_size` is a positive Python/NumPy integer."""
    ok = (isinstance(chunk_size, (numbers.Integral, np.integer))
          and not isinstance(chunk_size, bool))
    if not ok or int(chunk_size) <= 0:
        raise ValueError(
            f"{fn}: argument `chunk_size` must be a positive int (e.g. 64); got {chunk_size!r}.")


def check_scale(fn, scale):
    """ValueError unless `scale` is None or a real scalar."""
    if scale is None:
        return
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return
    if hasattr(scale, "shape") and tuple(scale.shape) == ():
        return
    raise ValueError(f"{fn}: argument `scale` must be None (1/sqrt(K)) or a real scalar; "
                     f"got {scale!r}.")
