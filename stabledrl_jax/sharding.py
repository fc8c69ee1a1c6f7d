"""Device meshes and shardings: the named axes `data`, `fsdp`, `tensor`, and the logical-axis rules
that place parameters and batches on them.

A mesh comes from a `{axis: size}` dict (`-1` = the devices left over). Parameters are sharded by
their logical axes (`models.weight_specs`: `embed` → `fsdp`, `heads`/`mlp`/`vocab` → `tensor`); a
dimension a mesh axis does not divide stays replicated. Batches are split along their leading axis
over `data` × `fsdp`. Under `jax.jit` the compiler propagates these shardings through the step.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from stabledrl_jax import models

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Resolve `-1` (at most one axis) so the sizes multiply to `num_devices`; errors name the axis."""
  unknown = [a for a in sizes if a not in AXES]
  if unknown:
    raise ValueError(f"unknown mesh axis {unknown[0]!r}: expected some of {AXES}")
  shape = {a: int(sizes.get(a, 1)) for a in AXES}
  free = [a for a, n in shape.items() if n == -1]
  if len(free) > 1:
    raise ValueError(f"mesh axes {free} are all -1: at most one axis can take the rest")
  for a, n in shape.items():
    if n == 0 or n < -1:
      raise ValueError(f"mesh.{a}={n}: must be >= 1 or -1")
  known = math.prod(n for n in shape.values() if n != -1)
  if free:
    if num_devices % known:
      raise ValueError(f"mesh.{free[0]}=-1: {num_devices} devices do not divide by the other "
                       f"axes' product {known}")
    shape[free[0]] = num_devices // known
  elif known != num_devices:
    raise ValueError(f"mesh {shape} has {known} devices but {num_devices} are available")
  return shape


def make_mesh(sizes: Mapping[str, int], devices=None) -> Mesh:
  """A mesh over `devices` (default: all) with axes `data, fsdp, tensor` of the given sizes."""
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(sizes, len(devices))
  # Auto axes: the compiler propagates shardings (the samplers' cache updates need it).
  return jax.make_mesh(tuple(shape[a] for a in AXES), AXES, devices=devices,
                       axis_types=(AxisType.Auto,) * len(AXES))


def path_keys(path) -> tuple:
  """A pytree key path as plain dict keys / list indices, e.g. `("blocks", 0, "attn", ...)`."""
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def param_shardings(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str] | None = None) -> dict:
  """A `NamedSharding` per parameter, as a pure dict shaped like `nnx.state(model, nnx.Param)`."""
  axes_of = {spec.path: spec.logical_axes for spec in models.weight_specs(model.config)}
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  def sharding(path, leaf):
    key = path_keys(path)
    if key not in axes_of:
      raise KeyError(f"parameter {'/'.join(map(str, key))} has no logical axes in weight_specs")
    return models.param_sharding(mesh, axes_of[key], tuple(leaf.shape), rules)

  return jax.tree_util.tree_map_with_path(sharding, state)


def create_model(cfg: models.ModelConfig, seed: int, mesh: Mesh,
                 rules: Mapping[str, str] | None = None) -> nnx.Module:
  """A randomly initialised model whose parameters are created already sharded on `mesh` (no
  full replica on any device): `models.create(cfg, seed)`'s initialisation, to float rounding
  (the compiled initialisers may round differently from the eager ones)."""
  abstract = nnx.eval_shape(lambda: models.create(cfg, seed))
  shardings = param_shardings(abstract, mesh, rules)

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.to_pure_dict(nnx.state(models.create(cfg, seed), nnx.Param))

  values = init()
  state = nnx.state(abstract, nnx.Param)
  nnx.replace_by_pure_dict(state, values)
  nnx.update(abstract, state)
  return abstract


def batch_sharding(mesh: Mesh, ndim: int, batch: int | None = None) -> NamedSharding:
  """Leading axis over `data` × `fsdp` (replicated when `batch` does not divide), rest replicated."""
  ways = math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)
  lead = BATCH_AXES if batch is None or batch % ways == 0 else None
  return NamedSharding(mesh, PartitionSpec(lead, *([None] * (ndim - 1))))


def shard_batch(tree, mesh: Mesh | None):
  """`device_put` every array leaf of `tree` with `batch_sharding` (as is when `mesh` is None)."""
  if mesh is None:
    return tree

  def put(x):
    x = np.asarray(x) if not isinstance(x, jax.Array) else x
    if x.ndim == 0:
      return jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    return jax.device_put(x, batch_sharding(mesh, x.ndim, x.shape[0]))

  return jax.tree.map(put, tree)


def model_mesh(model: nnx.Module) -> Mesh | None:
  """The mesh `model`'s parameters live on (None for single-device / unsharded parameters)."""
  s = getattr(model.embed.embedding.get_value(), "sharding", None)
  return s.mesh if isinstance(s, NamedSharding) and s.mesh.size > 1 else None


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str] | None = None) -> None:
  """Move `model`'s parameters onto `mesh` in place, each with its `param_shardings` entry."""
  shardings = param_shardings(model, mesh, rules)
  state = nnx.state(model, nnx.Param)
  values = jax.device_put(nnx.to_pure_dict(state), shardings)
  nnx.replace_by_pure_dict(state, values)
  nnx.update(model, state)
