"""One device mesh with (data, fsdp, tensor) axes, and where every array of the train state lives.

What a pmap script did is a jit over this mesh: data parallelism is a mesh whose `data` axis spans
the devices; the batch is sharded over it, parameters are replicated, and the gradient all-reduce a
pmap script wrote as `lax.pmean` is inserted by the compiler where the replicated parameters meet
sharded activations. `fsdp` additionally shards parameters and optimizer state (gathered for the
forward, gradients reduce-scattered); `tensor` splits matrices along a feature axis.

Parameters carry *logical* axis names (batch, embed, vocab, mlp, heads ...) that `LOGICAL_AXIS_RULES`
maps to mesh axes, as MaxText's `logical_axis_rules` do. A parameter that declares no names gets
names from its shape (the largest axis is `embed`, a 2-D matrix's other axis `mlp`), and an axis
that a mesh axis does not divide stays replicated: sharding changes where values live, never what
is computed.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from atlas_jax.models.layers import BATCH_MESH_AXES

from .config import ConfigError, MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis name -> mesh axes (tried in order; an axis already used by the array is skipped)
LOGICAL_AXIS_RULES = (
    ("batch", BATCH_MESH_AXES),
    ("embed", ("fsdp",)),
    ("vocab", ("tensor",)),
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("kv", ()),
    ("length", ()),
)


def mesh_shape(cfg: MeshConfig, device_count: int) -> tuple[int, int, int]:
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if device_count % fixed:
            raise ConfigError(f"config: mesh: fsdp x tensor x data = {fixed} (without the -1 axis) does not "
                              f"divide the {device_count} devices; choose axes whose product divides {device_count}")
        sizes[sizes.index(-1)] = device_count // fixed
    if math.prod(sizes) != device_count:
        raise ConfigError(f"config: mesh: data x fsdp x tensor = {sizes[0]} x {sizes[1]} x {sizes[2]} = "
                          f"{math.prod(sizes)} does not match the {device_count} devices; make the product "
                          f"{device_count} (or set one axis to -1)")
    return tuple(sizes)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(cfg, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(names, shape, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> P:
    """PartitionSpec for an array whose axes have these logical names (None: replicated)."""
    table = dict(rules)
    used, spec = set(), []
    for name, dim in zip(names, shape):
        chosen = []
        for axis in table.get(name, ()) if name is not None else ():
            size = mesh.shape[axis]
            if axis in used or size == 1:
                continue
            if dim % (math.prod(mesh.shape[a] for a in chosen) * size) == 0:
                chosen.append(axis)
        used.update(chosen)
        spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
    return P(*spec)


def default_logical_names(shape) -> tuple:
    """Names for a parameter that declares none: the largest axis (the model width, vocabulary or
    an embedding table's rows) is sharded by fsdp; a matrix's other large axis by tensor."""
    if len(shape) < 2:
        return (None,) * len(shape)
    order = sorted(range(len(shape)), key=lambda i: (-shape[i], i))
    names = [None] * len(shape)
    names[order[0]] = "embed"
    names[order[1]] = "mlp"
    return tuple(names)


def param_sharding(value, mesh: Mesh, names=None) -> NamedSharding:
    shape = np.shape(value)
    names = names if names is not None else default_logical_names(shape)
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


STACKED_PREFIXES = ("blocks",)    # atlas_jax.models stacks its blocks on a leading layer axis for nnx.scan


def _names_for(path, leaf) -> tuple:
    shape = np.shape(leaf)
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    if shape and any(k in STACKED_PREFIXES for k in keys):
        # the layer axis stays whole: the scan walks it one block at a time
        return (None,) + default_logical_names(shape[1:])
    return default_logical_names(shape)


def state_shardings(tree, mesh: Mesh):
    """NamedSharding for every array leaf of a train-state pytree (parameters, optimizer moments)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: param_sharding(leaf, mesh, _names_for(path, leaf)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_MESH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch_array(batch: dict, mesh: Mesh) -> dict:
    """The global batch (every process holds it) -> jax.Arrays sharded over (data, fsdp); each
    process hands over only the rows its own devices hold, whatever order the mesh puts them in."""
    sharding = batch_sharding(mesh)
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.shape[0] % shards:
            raise ConfigError(f"config: batch_size: {value.shape[0]} rows do not split over the mesh's "
                              f"data x fsdp = {shards} batch shards; use a multiple of {shards}")
        out[key] = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
    return out
