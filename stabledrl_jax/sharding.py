"""Device meshes and shardings: the named axes `data`, `fsdp`, `tensor`, `expert`, and the
logical-axis rules that place parameters and batches on them.

A mesh comes from a `{axis: size}` dict (`-1` = the devices left over). Parameters are sharded by
their logical axes (`models.weight_specs`: `embed` → `fsdp`, `heads`/`mlp`/`vocab` → `tensor`,
`expert` → `expert`: a mixture of experts' stacked expert kernels); a dimension a mesh axis does
not divide stays replicated. Batches are split along their leading axis over `data` × `fsdp` ×
`expert`. A mixture-of-experts layer keeps each device's rows on it (`models.moe.local_rows`: it
routes and sorts them there and gathers the layer's expert kernels, split over `fsdp` and
`expert`, as FSDP gathers any weight). Under `jax.jit` the compiler propagates these shardings
through the step.

With several processes (hosts), each holds only its devices' rows of a batch: `process_rows` says
which, `shard_batch` assembles the processes' rows into one global array, and `to_host` gathers a
global array back onto every host (rollouts for the graders).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from stabledrl_jax import lora, models

AXES = ("data", "fsdp", "tensor", "expert")
BATCH_AXES = models.weights.BATCH_AXES


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
  """A mesh over `devices` (default: all) with axes `data, fsdp, tensor, expert` of the given
  sizes (an axis not given: 1)."""
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
  axes_of.update(lora.logical_axes(model))  # LoRA adapters, if any: A and B split like their kernel
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
  """Leading axis over `data` × `fsdp` × `expert` (replicated when `batch` does not divide), rest
  replicated."""
  ways = math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)
  lead = BATCH_AXES if batch is None or batch % ways == 0 else None
  return NamedSharding(mesh, PartitionSpec(lead, *([None] * (ndim - 1))))


def constrain_batch(tree, mesh):
  """Inside `jit`: every array of `tree` with its leading axis split over the batch axes (where
  that divides; the rest replicated), as a sharding constraint. `mesh` may be abstract
  (`jax.typeof(x).sharding.mesh`); without batch axes the tree is returned as it is.

  A micro-batch sliced from a sharded batch (`x.reshape(accumulation, -1, ...)[a]`) lives on the
  few devices that held those rows; left alone, the compiler computed each micro-batch's
  attention whole on every device (the 8B programs for TPU: `[64, heads, 1544, tile]` scores
  per chip where a quarter of the rows were that chip's share)."""
  axes = tuple(a for a in BATCH_AXES if a in getattr(mesh, "axis_names", ()))
  ways = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if ways == 1:
    return tree

  def put(x):
    if x.ndim == 0 or x.shape[0] % ways:
      return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, PartitionSpec(axes, *([None] * (x.ndim - 1)))))

  return jax.tree.map(put, tree)


def process_rows(mesh: Mesh | None, rows: int) -> tuple[int, int]:
  """The rows `[start, stop)` of a `rows`-row batch that this process's devices hold under
  `batch_sharding`: the slice of each global batch this process reads (all rows on one host)."""
  if mesh is None:
    return 0, rows
  held = batch_sharding(mesh, 1, rows).addressable_devices_indices_map((rows,))
  spans = sorted({(i[0].start or 0, rows if i[0].stop is None else i[0].stop) for i in held.values()})
  for (_, stop), (start, _) in zip(spans, spans[1:]):
    if stop < start:
      raise ValueError(f"process {jax.process_index()}'s devices hold rows {spans} of a batch of "
                       f"{rows}, not one slice: the mesh must keep each process's devices together")
  return spans[0][0], spans[-1][1]


def shard_batch(tree, mesh: Mesh | None, *, rows: int | None = None, start: int = 0):
  """Global arrays, split by `batch_sharding`, from the host arrays of `tree`.

  Each host array holds rows `[start, start + len)` of a `rows`-row global batch (default: all of
  it); a process needs only the rows of its own devices (`process_rows`). Device arrays that
  already hold the whole batch (global arrays, or any array on a single process) are resharded on
  the devices, without a trip through the host. As is when `mesh` is None.
  """
  if mesh is None:
    return tree

  def put(x):
    on_devices = isinstance(x, jax.Array) and (not x.is_fully_addressable or jax.process_count() == 1)
    if np.ndim(x) == 0:
      return jax.device_put(x if on_devices else np.asarray(x), NamedSharding(mesh, PartitionSpec()))
    if on_devices:
      return jax.device_put(x, batch_sharding(mesh, x.ndim, x.shape[0]))
    x = np.asarray(x)
    n = x.shape[0] if rows is None else rows

    def rows_of(index):
      lo, hi = (index[0].start or 0) - start, (n if index[0].stop is None else index[0].stop) - start
      if lo < 0 or hi > x.shape[0]:
        raise ValueError(f"this process holds rows [{start}, {start + x.shape[0]}) of the batch, "
                         f"but its devices need rows [{lo + start}, {hi + start})")
      return x[(slice(lo, hi), *index[1:])]

    return jax.make_array_from_callback((n, *x.shape[1:]), batch_sharding(mesh, x.ndim, n), rows_of)

  return jax.tree.map(put, tree)


def to_host(x) -> np.ndarray:
  """The whole value of a (possibly multi-process) array as NumPy, on every process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def model_mesh(model: nnx.Module) -> Mesh | None:
  """The mesh `model`'s parameters live on (None for single-device / unsharded parameters)."""
  s = getattr(model.embed.embedding.get_value(), "sharding", None)
  return s.mesh if isinstance(s, NamedSharding) and s.mesh.size > 1 else None


def replicate_rest(module: nnx.Module, mesh: Mesh | None) -> None:
  """Replicate on `mesh`, in place, the arrays of `module` that are not on it (the optimiser's
  step counts, created on one device), so restored and fresh state share the step's devices."""
  if mesh is None:
    return
  state = nnx.state(module)

  def put(x):
    if not isinstance(x, jax.Array) or (isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh):
      return x
    value = np.asarray(x)  # a process-local array: the same value on every process
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, PartitionSpec()),
                                        lambda index: value[index])

  values = jax.tree.map(put, nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, values)
  nnx.update(module, state)


def resharded(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str] | None = None) -> nnx.Module:
  """A copy of `model` with its parameters placed on `mesh` (the original keeps its own)."""
  copy = nnx.clone(model)
  shard_model(copy, mesh, rules)
  return copy


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, str] | None = None) -> None:
  """Move `model`'s parameters onto `mesh` in place, each with its `param_shardings` entry."""
  shardings = param_shardings(model, mesh, rules)
  state = nnx.state(model, nnx.Param)
  values = jax.device_put(nnx.to_pure_dict(state), shardings)
  nnx.replace_by_pure_dict(state, values)
  nnx.update(model, state)
