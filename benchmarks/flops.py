"""Matmul FLOPs of a JAX program as traced, for TFLOP/s against a device's peak.

``dot_flops(fn, *args)`` walks ``jax.make_jaxpr(fn)(*args)``: every dot_general counts 2 × (the
product of its output's dimensions) × (the product of its contracted dimensions), a scan's body
``length`` times, a cond's costliest branch once, and any other sub-program (jit, checkpoint,
custom derivatives) once. A gradient's program holds its rematerialised forward passes (JAX writes
them into the backward's ``remat`` sub-programs), so the count is the products a GPU executes,
recomputation included, not the model's FLOPs. Elementwise work is not counted.

Not counted, and reported as such (``FlopCount.complete`` False): a while loop (trip count unknown
to the jaxpr) and a Pallas kernel (its body's products run on tiles of a grid this walk does not
price): a layer on the state-pass kernels is then not given a TFLOP/s.
"""

from __future__ import annotations

import math
from typing import NamedTuple

# Dense tensor-core peaks (TFLOP/s, no sparsity) by device kind: bf16 operands, and float32
# operands at JAX's default precision on these GPUs (TF32).
PEAK_TFLOPS = {"H200": {"bf16": 989.0, "tf32": 494.0}, "H100": {"bf16": 989.0, "tf32": 494.0}}


class FlopCount(NamedTuple):
    flops: float               # every counted dot_general, both operand kinds
    bf16_flops: float          # those with bf16 (or narrower) operands
    complete: bool             # False: a while loop or a Pallas kernel was left out
    left_out: tuple            # the primitives left out


def _dot(eqn) -> float:
    (contract, _), _ = eqn.params["dimension_numbers"]   # (lhs, rhs) contracted, (lhs, rhs) batch
    lhs = eqn.invars[0].aval.shape
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)


def _subprograms(eqn):
    for value in eqn.params.values():
        for item in (value if isinstance(value, (tuple, list)) else [value]):
            jaxpr = item if hasattr(item, "eqns") else getattr(item, "jaxpr", None)
            if hasattr(jaxpr, "eqns"):
                yield jaxpr


def _walk(jaxpr, scale, acc):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            flops = scale * _dot(eqn)
            acc["flops"] += flops
            if all(v.aval.dtype.itemsize <= 2 for v in eqn.invars[:2]):
                acc["bf16"] += flops
        elif name == "scan":
            _walk(eqn.params["jaxpr"].jaxpr, scale * eqn.params["length"], acc)
        elif name == "cond":
            branches = []
            for branch in eqn.params["branches"]:
                sub = {"flops": 0.0, "bf16": 0.0, "left_out": acc["left_out"]}
                _walk(branch.jaxpr, scale, sub)
                branches.append(sub)
            best = max(branches, key=lambda b: b["flops"])
            acc["flops"] += best["flops"]
            acc["bf16"] += best["bf16"]
        elif name in ("while", "pallas_call"):
            acc["left_out"].add(name)
        else:
            for sub in _subprograms(eqn):
                _walk(sub, scale, acc)


def dot_flops(fn, *args) -> FlopCount:
    """The matmul FLOPs of ``fn(*args)`` as traced (module docstring)."""
    import jax

    closed = jax.make_jaxpr(fn)(*args)
    acc = {"flops": 0.0, "bf16": 0.0, "left_out": set()}
    _walk(closed.jaxpr, 1.0, acc)
    return FlopCount(acc["flops"], acc["bf16"], not acc["left_out"], tuple(sorted(acc["left_out"])))


def peak_tflops(device_kind: str, count: FlopCount) -> float | None:
    """The peak a program with this mix of bf16 and float32 products could reach on the device: its
    FLOPs over the time each kind would take at its own peak (None for an unknown device)."""
    peaks = next((v for k, v in PEAK_TFLOPS.items() if k in device_kind), None)
    if peaks is None or count.flops <= 0:
        return None
    seconds = count.bf16_flops / peaks["bf16"] + (count.flops - count.bf16_flops) / peaks["tf32"]
    return count.flops / seconds
