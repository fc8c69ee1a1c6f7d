"""Mixture-of-experts feed-forward layer of LLaDA2.0 (inclusionAI's `llada2_moe`): group-limited
top-k routing with an expert bias, dropless grouped matmuls, shared experts.

The routing, as the released remote code computes it (`modeling_llada2_moe.py`):
  scores   = sigmoid(x W_router), in float32
  choice   = scores + expert_bias                  (the bias only moves the choice)
  a group's score = the sum of its two best `choice` entries; keep the `topk_group` best groups
  experts  = the `num_experts_per_tok` best `choice` entries inside the kept groups
  weights  = the chosen experts' `scores` / their sum (+1e-20; k = 1: unnormalised)
             * routed_scaling_factor
Ties go to the lower index (`jax.lax.top_k`'s order; torch's `topk` leaves it unspecified).

The experts run dropless: each token's k assignments are sorted by expert, and no token is
dropped for capacity. Two formulations (`ModelConfig.moe_impl`): `ragged_dot`, one
`jax.lax.ragged_dot` per projection (XLA's CPU lowering of it multiplies every row by every
expert, masked; accelerators have grouped kernels), and `tiles`, each expert's rows padded to
whole tiles of rows and every tile multiplied by its own expert's weights (a batched matmul of
at most M·k + min(M·k, experts)·tile rows: the work of the active experts on any backend, plus
the padding). On a mesh each device does this for its own rows (`local_rows`). Routing replay
(RL): `route_experts` takes the experts chosen by an earlier forward (`forced_MxK`) and
recomputes only their weights.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax.models.weights import BATCH_AXES

Array = jax.Array


class RouterParam(nnx.Param):
  """The router's weights and expert bias: frozen unless `ModelConfig.train_router` (the bias has
  no gradient in any case: it only moves the discrete choice)."""


def route_experts(logits_MxE: Array, expert_bias_E: Array, *, k: int, n_group: int,
                  topk_group: int, scaling: float,
                  forced_MxK: Array | None = None) -> tuple[Array, Array]:
  """`(experts [M, k] int32, weights [M, k] float32)` of each token (module docstring)."""
  m, e = logits_MxE.shape
  scores_MxE = jax.nn.sigmoid(logits_MxE.astype(jnp.float32))
  if forced_MxK is None:
    choice_MxE = scores_MxE + expert_bias_E.astype(jnp.float32)
    group_MxGxS = choice_MxE.reshape(m, n_group, e // n_group)
    group_score_MxG = jnp.sum(jax.lax.top_k(group_MxGxS, 2)[0], axis=-1)
    _, kept_MxT = jax.lax.top_k(group_score_MxG, topk_group)
    keep_MxG = jnp.any(jax.nn.one_hot(kept_MxT, n_group, dtype=bool), axis=1)
    keep_MxE = jnp.repeat(keep_MxG, e // n_group, axis=1)
    _, experts_MxK = jax.lax.top_k(jnp.where(keep_MxE, choice_MxE, -jnp.inf), k)
  else:
    experts_MxK = forced_MxK
  experts_MxK = experts_MxK.astype(jnp.int32)
  weights_MxK = jnp.take_along_axis(scores_MxE, experts_MxK, axis=-1)
  if k > 1:
    weights_MxK = weights_MxK / (jnp.sum(weights_MxK, axis=-1, keepdims=True) + 1e-20)
  return experts_MxK, weights_MxK * scaling


IMPLS = ("ragged_dot", "tiles")


def _tiled(x_NxD: Array, sorted_N: Array, sizes_E: Array, weights_ExIxO: list[Array],
           fn) -> Array:
  """`fn(x, W_e...)` of each row with its expert's weights, the rows sorted by expert
  (`sorted_N`, `sizes_E` rows each): every expert's rows padded to whole tiles, each tile one
  matmul with its expert's weights."""
  n, e = x_NxD.shape[0], sizes_E.shape[0]
  tile = int(np.clip(n // e, 8, 128))
  # >= sum_e ceil(size_e / tile): at most min(n, e) experts have rows, each wasting < one tile.
  num_tiles = -(-(n + min(n, e) * (tile - 1)) // tile)
  padded_E = (sizes_E + tile - 1) // tile * tile
  first_E = jnp.cumsum(sizes_E) - sizes_E
  padded_first_E = jnp.cumsum(padded_E) - padded_E
  slot_N = padded_first_E[sorted_N] + jnp.arange(n) - first_E[sorted_N]
  x_TxSxD = jnp.zeros((num_tiles * tile, x_NxD.shape[1]), x_NxD.dtype).at[slot_N].set(
      x_NxD).reshape(num_tiles, tile, -1)
  # searchsorted(..., side="right") written out: jnp.searchsorted fails inside jax.shard_map.
  tile_expert_T = jnp.minimum(jnp.sum(jnp.cumsum(padded_E)[None, :]
                                      <= (jnp.arange(num_tiles) * tile)[:, None], axis=1), e - 1)
  y_TxSxO = fn(x_TxSxD, *(w[tile_expert_T] for w in weights_ExIxO))
  return y_TxSxO.reshape(num_tiles * tile, -1)[slot_N]


def grouped_swiglu(x_MxD: Array, experts_MxK: Array, weights_MxK: Array, gate_ExDxF: Array,
                   up_ExDxF: Array, down_ExFxD: Array, impl: str = "ragged_dot",
                   adapters: tuple = (None, None, None)) -> Array:
  """Σ_k weight_k · SwiGLU_{expert_k}(x) per token, dropless: the M·k assignments sorted by
  expert, grouped matmuls (`impl`, module docstring), then unsorted. float32 sum.

  `adapters`: per projection (gate, up, down) None or a LoRA adapter of every expert
  (`lora.ExpertAdapter`: `lora_a` [E, I, r], `lora_b` [E, r, O], `scale`, `dropped(x)` its input
  dropout), which adds scale · dropped(x) A_e B_e to the rows of expert e."""
  m, d = x_MxD.shape
  k = experts_MxK.shape[1]
  e = gate_ExDxF.shape[0]
  flat_N = experts_MxK.reshape(-1)
  order_N = jnp.argsort(flat_N, stable=True)
  sizes_E = jnp.bincount(flat_N, length=e).astype(jnp.int32)
  x_NxD = x_MxD[order_N // k]
  dtype = x_MxD.dtype
  # Per projection: its stacked kernel, then A and B of its adapter if it has one.
  stacks = [[w.astype(dtype)] + ([] if a is None else [a.lora_a[...].astype(dtype),
                                                       a.lora_b[...].astype(dtype)])
            for w, a in zip((gate_ExDxF, up_ExDxF, down_ExFxD), adapters)]
  if impl == "tiles":
    def matmul(x, ws, adapter):  # x [tiles, rows, I]; ws: the tiles' kernels (and A, B)
      y = jnp.einsum("tsi,tio->tso", x, ws[0])
      if adapter is None:
        return y
      xa = jnp.einsum("tsi,tir->tsr", adapter.dropped(x), ws[1])
      return y + adapter.scale * jnp.einsum("tsr,tro->tso", xa, ws[2])
  else:
    def matmul(x, ws, adapter):  # x [N, I] sorted by expert; ws: [E, ...] stacks
      y = jax.lax.ragged_dot(x, ws[0], sizes_E)
      if adapter is None:
        return y
      xa = jax.lax.ragged_dot(adapter.dropped(x), ws[1], sizes_E)
      return y + adapter.scale * jax.lax.ragged_dot(xa, ws[2], sizes_E)

  def swiglu(x, *flat):
    ws, i = [], 0
    for stack in stacks:
      ws.append(flat[i:i + len(stack)])
      i += len(stack)
    h = jax.nn.silu(matmul(x, ws[0], adapters[0])) * matmul(x, ws[1], adapters[1])
    return matmul(h, ws[2], adapters[2])

  flat = [w for stack in stacks for w in stack]
  y_NxD = (_tiled(x_NxD, flat_N[order_N], sizes_E, flat, swiglu) if impl == "tiles"
           else swiglu(x_NxD, *flat))
  y_MxKxD = jnp.zeros_like(y_NxD).at[order_N].set(y_NxD).reshape(m, k, d)
  return jnp.einsum("mkd,mk->md", y_MxKxD.astype(jnp.float32), weights_MxK)


class MoE(nnx.Module):
  """Router + `num_experts` SwiGLU experts (stacked kernels, grouped matmuls) + optional shared
  experts (one SwiGLU of `moe_intermediate_size * num_shared_experts`), and optional LoRA
  adapters on the routed experts' projections."""

  def __init__(self, cfg, *, rngs: nnx.Rngs, shared_mlp=None):
    e, d, f = cfg.num_experts, cfg.d_model, cfg.moe_intermediate_size
    init = nnx.initializers.normal(0.02)
    pd = cfg.param_dtype
    self.k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
    self.scaling, self.impl = cfg.routed_scaling_factor, cfg.moe_impl
    self.router = RouterParam(init(rngs.params(), (d, e), jnp.float32))
    self.expert_bias = RouterParam(jnp.zeros((e,), jnp.float32))
    self.gate_kernel = nnx.Param(init(rngs.params(), (e, d, f), pd))
    self.up_kernel = nnx.Param(init(rngs.params(), (e, d, f), pd))
    self.down_kernel = nnx.Param(init(rngs.params(), (e, f, d), pd))
    # LoRA on every routed expert's projection (`lora.apply` attaches a `lora.ExpertAdapter`).
    self.gate_adapter = self.up_adapter = self.down_adapter = nnx.data(None)
    self.shared_experts = shared_mlp

  def route(self, y_MxD: Array, forced_MxK: Array | None = None) -> tuple[Array, Array]:
    logits_MxE = jnp.dot(y_MxD.astype(jnp.float32), self.router[...].astype(jnp.float32))
    return route_experts(logits_MxE, self.expert_bias[...], k=self.k, n_group=self.n_group,
                         topk_group=self.topk_group, scaling=self.scaling, forced_MxK=forced_MxK)

  def routed(self, y_MxD: Array, forced_MxK: Array | None = None) -> tuple[Array, Array]:
    """`(Σ_k weight_k · expert_k(y) [M, D] float32, the chosen experts [M, k])` of these rows."""
    experts_MxK, weights_MxK = self.route(y_MxD, forced_MxK)
    return grouped_swiglu(y_MxD, experts_MxK, weights_MxK, self.gate_kernel[...],
                          self.up_kernel[...], self.down_kernel[...], self.impl,
                          (self.gate_adapter, self.up_adapter, self.down_adapter)), experts_MxK

  def __call__(self, y_MxD: Array, forced_MxK: Array | None = None) -> tuple[Array, Array]:
    """`(output [M, D] in y's dtype, the chosen experts [M, k])`. On a mesh whose batch axes
    divide the rows, each device routes, sorts and multiplies its own rows (`local_rows`)."""
    out_MxD, experts_MxK = local_rows(self, y_MxD, forced_MxK)
    out_MxD = out_MxD.astype(y_MxD.dtype)
    if self.shared_experts is not None:
      out_MxD = out_MxD + self.shared_experts(y_MxD)
    return out_MxD, experts_MxK


def local_rows(layer: MoE, y_MxD: Array, forced_MxK: Array | None) -> tuple[Array, Array]:
  """`layer.routed` with the rows split over the mesh's batch axes (`weights.BATCH_AXES`, where
  they divide M): each device routes and sorts its own rows and runs them through every expert's
  weights, gathered whole for the layer (`jax.shard_map`; `tensor` stays with the compiler).
  Left to the compiler, the sort by expert gathered every device's rows onto every device (the
  step's temporaries hardly shrank with more devices). Adapter dropout draws each device's masks
  from its own key (the shared key folded with the device's index)."""
  mesh = jax.typeof(layer.gate_kernel[...]).sharding.mesh
  axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
  ways = int(np.prod([mesh.shape[a] for a in axes]))
  if ways == 1 or y_MxD.shape[0] % ways:
    return layer.routed(y_MxD, forced_MxK)
  graphdef, state = nnx.split(layer)
  rows = jax.sharding.PartitionSpec(axes)

  def local(state, y, forced):
    shard = nnx.merge(graphdef, state)
    for adapter in (shard.gate_adapter, shard.up_adapter, shard.down_adapter):
      if adapter is not None and adapter.dropout_key is not None:
        adapter.dropout_key[...] = jax.random.fold_in(adapter.dropout_key[...],
                                                      jax.lax.axis_index(axes))
    return shard.routed(y, forced)
  whole = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state)
  return jax.shard_map(local, mesh=mesh, in_specs=(whole, rows, rows), out_specs=(rows, rows),
                       axis_names=set(axes))(state, y_MxD, forced_MxK)
