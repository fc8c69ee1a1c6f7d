"""The optimiser of each stage: AdamW after global-norm clipping (its moments in float32, or with
`optim.moment_dtype="bfloat16"` stored in bfloat16), warmup then linear decay, the
rate injected (`optax.inject_hyperparams`) so that it is logged every step and the controls can
scale it, and non-finite updates skipped. With `optim.offload_state` the moments live in host
memory between updates (`offload`); `apply` brings them to the accelerator for the update only.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from stabledrl_jax import lora, sharding


class _ScaledState(NamedTuple):
  count: jax.Array


class _ScaledSchedule:
  """`schedule(count) · lr_scale`, `lr_scale` the traced factor passed to `update` (default 1:
  the drift brake's), as a stateful schedule of `inject_hyperparams`, so the rate in the optimiser
  state is the one applied."""

  def __init__(self, schedule: optax.Schedule):
    self.schedule = schedule

  def init(self) -> _ScaledState:
    return _ScaledState(jnp.zeros([], jnp.int32))

  def update(self, state: _ScaledState, **extra_args) -> _ScaledState:
    del extra_args
    return _ScaledState(optax.safe_increment(state.count))

  def __call__(self, state: _ScaledState, *, lr_scale=1.0, **extra_args):
    del extra_args
    lr = self.schedule(state.count)
    return lr * jnp.asarray(lr_scale, lr.dtype)


def make_optimizer(lr: float, warmup: int, total: int, o) -> optax.GradientTransformation:
  """AdamW after global-norm clipping, warmup then linear decay to 0 over `o.decay_steps` (0: the
  rest of the stage); `o` is `config.optim`. `update(..., lr_scale=s)` scales the rate by `s`."""
  decay = optax.linear_schedule(lr, 0.0, o.decay_steps or max(total - warmup, 1))
  schedule = decay if not warmup else optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), decay], [warmup])

  moment_dtype = o.get("moment_dtype", "float32")
  if moment_dtype not in ("float32", "bfloat16"):
    raise ValueError(f"config.optim.moment_dtype={moment_dtype!r}: expected float32 or bfloat16")

  def adamw(learning_rate):
    if moment_dtype == "float32":
      adam = optax.adamw(learning_rate, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    else:  # optax.adamw's chain, its moments stored in bfloat16 (updated in float32)
      adam = optax.chain(stored_as(optax.scale_by_adam(b1=o.b1, b2=o.b2), jnp.bfloat16),
                         optax.add_decayed_weights(o.weight_decay),
                         optax.scale_by_learning_rate(learning_rate))
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adam)

  # float32 rates whatever the parameters (and abstract parameters need no dtype look-up).
  inner = optax.inject_hyperparams(adamw, hyperparam_dtype=jnp.float32)(
      learning_rate=_ScaledSchedule(schedule))
  # The parameters and moments stay as they were when a gradient is not finite.
  return optax.apply_if_finite(inner, max_consecutive_errors=1_000_000)


def stored_as(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`inner` with its floating-point state kept in `dtype` between updates and computed on in
  float32 (e.g. bfloat16 Adam moments: half their memory, rounded every step)."""
  def cast(tree, to):
    return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def init(params):
    return cast(inner.init(params), dtype)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)

  return optax.GradientTransformation(init, update)


def stage_optimizer(model, c, stage: str) -> nnx.Optimizer:
  """A fresh optimiser for `stage` ("sft" or "rl") of the run configured by `c`, over the model's
  trainable parameters (`lora.trainable`: its adapters alone when it has any, so the moments are
  the adapters' size)."""
  if stage == "sft":
    tx = make_optimizer(c.sft.lr, c.sft.warmup_steps, c.sft.steps, c.optim)
  else:
    tx = make_optimizer(c.rl.lr, c.rl.warmup_steps, c.rl.steps * c.rl.updates_per_batch, c.optim)
  optimizer = nnx.Optimizer(model, tx, wrt=lora.trainable(model))
  sharding.replicate_rest(optimizer, sharding.model_mesh(model))
  if c.optim.get("offload_state", False):
    offload(optimizer)
  return optimizer


def offloadable(x) -> bool:  # the moments: floating arrays shaped like parameters, not counters
  return jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1


def offload(optimizer: nnx.Optimizer) -> None:
  """Move the optimiser's moments to host memory (`pinned_host`, same sharding), in place: an
  accelerator then holds them only during `apply`. Costs two host<->device copies of the moments
  per update (16 bytes per parameter with float32 moments, spread over the devices)."""
  state = nnx.state(optimizer)
  nnx.update(optimizer, jax.tree.map(
      lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
      if offloadable(x) else x, state))


def _on_host(x) -> bool:
  return jax.typeof(x).memory_space == jax.memory.Space.Host


def learning_rate(optimizer: nnx.Optimizer) -> jax.Array | None:
  """The rate of the last update of a `make_optimizer` optimiser (0 before the first; unchanged by
  a skipped one); None for another optax transformation."""
  hyperparams = getattr(getattr(optimizer.opt_state, "inner_state", None), "hyperparams", None)
  if hyperparams is None:
    return None
  lr = hyperparams["learning_rate"]
  return lr[...] if isinstance(lr, nnx.Variable) else lr


def all_finite(tree) -> jax.Array:
  return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def group(path) -> str:
  """A parameter's group for `update_norms`: its module's name below the layer stack, the layer
  index dropped (`blocks/3/attn/q_proj/kernel` -> `attn`, `embed/embedding` -> `embed`)."""
  names = [str(getattr(k, "key", k)) for k in path]
  return next(n for n in names if not n.isdigit() and n not in ("blocks", "layers"))


def _norms(tree, prefix: str) -> dict[str, jax.Array]:
  """`prefix` -> the L2 norm of `tree` (a pure dict of arrays), `prefix/<group>` -> each group's."""
  squares: dict[str, jax.Array] = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    g = group(path)
    squares[g] = squares.get(g, 0.0) + jnp.sum(jnp.square(x.astype(jnp.float32)))
  out = {f"{prefix}/{g}": jnp.sqrt(s) for g, s in sorted(squares.items())}
  return {prefix: jnp.sqrt(sum(squares.values())), **out}


def update_norms(before, after, optimizer: nnx.Optimizer) -> dict[str, jax.Array]:
  """Diagnostics of one update (`optim.update_norms`): the L2 norm of the parameters' change
  (`update_norm`), of the parameters (`param_norm`) and of Adam's two moments (`adam_mu_norm`,
  `adam_nu_norm`), each also per parameter group (`group`). `before`, `after`: the trainable
  parameters as pure dicts (`nnx.to_pure_dict`)."""
  delta = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), after, before)
  adam = [x for x in jax.tree.leaves(optimizer.opt_state,
                                     is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(x, optax.ScaleByAdamState)]
  out = {**_norms(delta, "update_norm"), **_norms(after, "param_norm")}
  if len(adam) == 1:  # make_optimizer's (a custom optax transformation may have none)
    out.update(_norms(nnx.to_pure_dict(adam[0].mu), "adam_mu_norm"))
    out.update(_norms(nnx.to_pure_dict(adam[0].nu), "adam_nu_norm"))
  return out


def apply(model, optimizer: nnx.Optimizer, grads, *, norms: bool = False,
          **extra_args) -> dict[str, jax.Array]:
  """One optimiser update; the step's `grad_norm`, `skipped` (non-finite gradient) and `lr` (the
  rate applied, where `learning_rate` knows it), and with `norms` the `update_norms` diagnostics
  (they hold the old parameters until the new ones exist: the trainable parameters' size more
  memory). Moments in host memory (`offload`) are copied to the accelerator for the update and
  back after it."""
  on_host = jax.tree.map(_on_host, nnx.state(optimizer))
  moved = lambda space: jax.tree.map(
      lambda x, h: jax.device_put(x, space) if h else x, nnx.state(optimizer), on_host)
  nnx.update(optimizer, moved(jax.memory.Space.Device))
  before = nnx.to_pure_dict(nnx.state(model, optimizer.wrt)) if norms else None
  optimizer.update(model, grads, **extra_args)
  out = {"grad_norm": optax.tree.norm(grads), "skipped": ~all_finite(grads)}
  if norms:
    out.update(update_norms(before, nnx.to_pure_dict(nnx.state(model, optimizer.wrt)), optimizer))
  nnx.update(optimizer, moved(jax.memory.Space.Host))
  lr = learning_rate(optimizer)
  return out if lr is None else {**out, "lr": lr}
