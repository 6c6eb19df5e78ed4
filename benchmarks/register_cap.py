"""A cap on the registers a thread of chosen Pallas Triton kernels may take (a benchmark experiment).

Why: every deep-memory kernel compiles to 255 registers a thread, so a multiprocessor holds two
4-warp programs and titans' backward at B4 T4096 H8 runs its 32 heads in ~4 waves
(benchmarks/results/titans_kept_starts_h200_2026-11-29.md). With 128 registers four programs
would fit, at the price of spills. Pallas' Triton `CompilerParams` has only num_warps and
num_stages, and XLA's ptxas flags do not reach these kernels (jax >= 0.11 compiles them through
jaxlib's Triton, not XLA's). Triton itself honours a module attribute, ``ttg.maxnreg`` (lowered to
PTX's ``.maxnreg``): `set_cap` wraps Pallas' (private) Triton lowering so that the modules of the
kernels whose name contains one of ``names`` carry it.

This touches jax's private `jax._src.pallas.triton` modules (checked against jax 0.10.2's
lowering); it belongs to the benchmarks, not to the library. Measured (H200, jax 0.11.2,
titans' layer, one command): jaxlib's Triton honours the cap, and the spills cost more than the
occupancy gains: 168 registers 1.31× the time at B4 T4096 and 1.30× at B1 T16384, 128 registers
1.54× and 1.56× (benchmarks/results/titans_register_cap_h200_2026-11-29b.md).

    import register_cap
    register_cap.set_cap(128)     # kernels compiled from here on: mlp_* capped at 128
    ...compile...
    register_cap.set_cap(None)    # later compiles uncapped
"""

from __future__ import annotations

_STATE = {"cap": None, "names": ("mlp_",), "installed": False}


def set_cap(cap: int | None, names=("mlp_",)):
    """Caps kernels lowered from now on whose name contains one of ``names`` at ``cap``
    registers a thread (None: no cap). Takes effect at lowering, i.e. when a function is
    compiled, not when it runs."""
    if cap is not None and (not isinstance(cap, int) or not 24 <= cap <= 255):
        raise ValueError(f"set_cap: argument `cap` must be an int in [24, 255] or None; got {cap!r}.")
    _STATE.update(cap=cap, names=tuple(names))
    if not _STATE["installed"]:
        _install()


def _install():
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering

    lower = lowering.lower_jaxpr_to_triton_module

    def capped(*args, **kwargs):
        result = lower(*args, **kwargs)
        cap = _STATE["cap"]
        module = result.module
        name = ir.StringAttr(module.operation.attributes["sym_name"]).value
        if cap is not None and any(n in name for n in _STATE["names"]):
            with module.context:
                module.operation.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(32), cap)
        return result

    lowering.lower_jaxpr_to_triton_module = capped
    _STATE["installed"] = True
