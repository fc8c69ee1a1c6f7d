"""Which mesh axes split the batch, and the constraint that keeps activations split that way.

Parameters are sharded over `fsdp` along one of their dimensions, often the one a matrix product
contracts. Left to itself, the compiler may then keep the weights sharded and gather the
activations instead: every device computes partial products for the whole batch (measured on the
8B programs for TPU: a full micro-batch's `[tokens, mlp]` activations on each chip). Constraining
the residual stream to be split over the batch axes makes it gather the weights (FSDP) instead.
"""
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

BATCH_AXES = ("data", "fsdp")


def constrain_batch(tree, mesh):
  """Every array of `tree` with its leading axis split over `data` x `fsdp` (where that
  divides; the rest replicated), as a sharding constraint. `mesh` may be abstract
  (`jax.typeof(x).sharding.mesh` inside `jit`); without batch axes, or outside `jit`, the tree
  is returned as it is."""
  axes = tuple(a for a in BATCH_AXES if a in getattr(mesh, "axis_names", ()))
  ways = math.prod(mesh.shape[a] for a in axes) if axes else 1
  if ways == 1:
    return tree

  def put(x):
    if not isinstance(x, jax.core.Tracer) or x.ndim == 0 or x.shape[0] % ways:
      return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, PartitionSpec(axes, *([None] * (x.ndim - 1)))))

  return jax.tree.map(put, tree)


def mesh_of(x):
  """The (abstract, inside `jit`) mesh `x` is sharded over; an empty mesh when it is not."""
  return jax.typeof(x).sharding.mesh
