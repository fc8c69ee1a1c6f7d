"""LoRA adapters on the transformer's linear layers, chosen, named and stored as PEFT does.

An adapter adds to a frozen linear map `W` (kernel [D_in, D_out]) a low-rank update,

    y = x W + (α / r) · dropout(x) A B,     A [D_in, r],  B [r, D_out],  B = 0 at the start,

so an adapted model starts as its base model. The adapter is flax's `nnx.LoRA` layer (A and B
are `nnx.LoRAParam`, a subclass of `nnx.Param`), with PEFT's scale and input dropout, attached to
a `models.transformer.Linear` (its `adapter` slot): the base kernel keeps its path, its dtype (a
bfloat16 base stays bfloat16) and its sharding, while A and B are float32 and computed in the
model's compute dtype. `ADAPTER` filters the adapters' parameters (the optimiser's `wrt`, the
gradient's `DiffState`, what a LoRA run checkpoints).

Modules are chosen by the names of the family's official checkpoint, as PEFT chooses them: a
name in `targets` selects every module whose dotted name is it or ends with "." + it (a single
string is a regular expression the whole name must match; "all-linear" is every linear layer but
the head). A mixture of experts' routed experts are modules too, as in the released code
(`model.layers.L.mlp.experts.E.gate_proj`): their adapters are stacked like their kernels
(`ExpertAdapter`), so a layer's experts are adapted all or none. LLaDA's modules are `q_proj`,
`k_proj`, `v_proj`, `attn_out`, `ff_proj`, `up_proj`, `ff_out`, and its head is
`model.transformer.ff_out`, so `ff_out` selects the head too; the Qwen-style families (SDAR,
Dream) name theirs `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`
and `lm_head`.

PEFT's adapter directory (adapter_config.json, adapter_model.safetensors) is `peft_format`'s.
In a training run (`build.lora_config`: `config.model.lora`, `config.model.lora_init`)
`build.model` attaches the adapters, the optimiser and the updates train only them (`trainable`),
the checkpoints hold only them (the base is rebuilt from `model.checkpoint` or the seed), and the
export writes the merged model and the adapters alone (`export.export`).
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from stabledrl_jax.models import weights
from stabledrl_jax.models.config import ModelConfig
from stabledrl_jax.models.moe import RouterParam
from stabledrl_jax.models.transformer import Linear

ADAPTER = nnx.LoRAParam  # the adapters' parameters: nnx.Optimizer(model, tx, wrt=ADAPTER)
ALL_LINEAR = "all-linear"


# `config.model.lora.targets=""`: the family's attention and MLP projections in every block, not
# the head. LLaDA's blocks' MLP output `ff_out` shares its name with the head
# (`model.transformer.ff_out`), so LLaDA's is a regular expression over the blocks' modules.
DEFAULT_TARGETS = {
    "llada": r"model\.transformer\.blocks\.\d+\.(q_proj|k_proj|v_proj|attn_out|ff_proj|up_proj|ff_out)",
    "sdar": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "dream": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    # LLaDA2.0: attention, the dense layers' MLP and the shared experts, not the routed experts
    # (PEFT's list ["gate_proj", ...] would adapt every one of them: 256 adapters per layer).
    "llada2": (r"model\.layers\.\d+\.(attention\.(query_key_value|dense)"
               r"|mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj))"),
}
# The adapters' dropout masks in an update come from `fold_in(step key, DROPOUT_STREAM)`: a stream
# of their own, apart from the masking draws of the same key.
DROPOUT_STREAM = 0x1D0


class AdapterError(ValueError):
  """An adapter (config or file) that does not fit the model: names the key or tensor."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Rank r, alpha α (the update is scaled by α / r), dropout on the adapters' input, and the
  PEFT target names (a tuple of names matched as suffixes, or one regular expression). The
  targets have no default here: a run's come from `config.model.lora.targets` ("" = the family's
  `DEFAULT_TARGETS`, `build.lora_targets`)."""

  rank: int
  alpha: float
  dropout: float = 0.0
  targets: tuple[str, ...] | str = dataclasses.field(kw_only=True)

  def __post_init__(self):
    if self.rank < 1:
      raise AdapterError(f"lora rank={self.rank} must be >= 1")
    if not 0.0 <= self.dropout < 1.0:
      raise AdapterError(f"lora dropout={self.dropout} must be in [0, 1)")
    if not self.targets:
      raise AdapterError("lora targets are empty: name at least one module")
    if not isinstance(self.targets, str):
      object.__setattr__(self, "targets", tuple(self.targets))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


class Adapter(nnx.LoRA):
  """`nnx.LoRA` (x A B, A [D_in, r] and B [r, D_out] as `nnx.LoRAParam`) scaled by α / r, with
  dropout on its input while a key is set (`set_dropout_key`), and none otherwise.

  A starts as PEFT's (torch's Linear default, uniform in ±1/sqrt(D_in)), B at zero. The
  parameters are float32 whatever the base's dtype; the products run in `dtype`, the model's
  compute dtype, as the base's do.
  """

  def __init__(self, d_in: int, d_out: int, *, rank: int, alpha: float, dropout: float,
               dtype, rngs: nnx.Rngs):
    super().__init__(d_in, rank, d_out, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                     a_initializer=nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform"))
    self.rank, self.alpha, self.dropout = rank, alpha, dropout
    self.dropout_key = nnx.data(None)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def dropped(self, x: jax.Array) -> jax.Array:
    """The adapter's input after its dropout (x itself while no key is set)."""
    if not self.dropout or self.dropout_key is None:
      return x
    keep = jax.random.bernoulli(self.dropout_key[...], 1.0 - self.dropout, x.shape)
    return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)

  def __call__(self, x_MxI: jax.Array) -> jax.Array:
    return super().__call__(self.dropped(x_MxI)) * self.scale


class ExpertAdapter(nnx.Module):
  """LoRA on one projection of every routed expert of a mixture-of-experts layer, as PEFT puts
  one adapter on each expert's module (`mlp.experts.E.gate_proj`): A [E, D_in, r] and
  B [E, r, D_out] (`nnx.LoRAParam`, float32) stacked like the experts' kernels; the rows routed
  to expert e get scale · dropped(x) A_e B_e (`models.moe.grouped_swiglu`). Initialised as
  `Adapter` (A uniform in ±1/sqrt(D_in), B = 0)."""

  def __init__(self, experts: int, d_in: int, d_out: int, *, rank: int, alpha: float,
               dropout: float, rngs: nnx.Rngs):
    init = nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=-2,
                                             out_axis=-1, batch_axis=(0,))
    self.lora_a = nnx.LoRAParam(init(rngs.params(), (experts, d_in, rank), jnp.float32))
    self.lora_b = nnx.LoRAParam(jnp.zeros((experts, rank, d_out), jnp.float32))
    self.in_features, self.out_features = d_in, d_out
    self.rank, self.alpha, self.dropout = rank, alpha, dropout
    self.dropout_key = nnx.data(None)

  scale = Adapter.scale
  dropped = Adapter.dropped


class DropoutKey(nnx.Variable):
  """The PRNG key of an adapter's dropout mask (state, not a parameter: never differentiated)."""


# ----------------------------------------------------------------------------- choosing modules


def linear_modules(cfg: ModelConfig) -> dict[str, tuple]:
  """Every linear layer as {its module name in the official checkpoint: its path in the model}
  (the weight name without ".weight"), in checkpoint order, the head included."""
  return {spec.hf_name.removesuffix(".weight"): spec.path[:-1]
          for spec in weights.weight_specs(cfg) if spec.path[-1] == "kernel"}


def expert_modules(cfg: ModelConfig) -> dict[str, tuple[tuple, int]]:
  """Every routed expert's projection as {its module name in the official checkpoint
  (`model.layers.L.mlp.experts.E.gate_proj`): (the path of its stacked kernel, E)}; none for a
  dense family."""
  return {spec.hf_name.removesuffix(".weight"): (spec.path, spec.index)
          for spec in weights.weight_specs(cfg) if spec.index is not None}


def _adapter_attr(kernel_path: tuple) -> tuple:
  """The path of the `ExpertAdapter` of a stacked expert kernel (`.../moe/gate_kernel` ->
  `.../moe/gate_adapter`)."""
  return kernel_path[:-1] + (kernel_path[-1].replace("_kernel", "_adapter"),)


def head_module(cfg: ModelConfig) -> str:
  """The head's module name (LLaDA's `model.transformer.ff_out`, the others' `lm_head`)."""
  return next(name for name, path in linear_modules(cfg).items() if path == ("head",))


def matches(name: str, targets: tuple[str, ...] | str) -> bool:
  """PEFT's rule: a regular expression matches the whole module name; a name in a list matches
  the module of that name or any whose name ends with "." + it."""
  if isinstance(targets, str):
    return re.fullmatch(targets, name) is not None
  return any(name == t or name.endswith("." + t) for t in targets)


def unmatched(cfg: ModelConfig, targets: tuple[str, ...] | str) -> list[str]:
  """The names of a target list that select no module of `cfg`'s family (PEFT skips them; none
  for a regular expression or "all-linear")."""
  if isinstance(targets, str):
    return []
  modules = {**linear_modules(cfg), **expert_modules(cfg)}
  return [t for t in targets if not any(matches(name, (t,)) for name in modules)]


def select(cfg: ModelConfig, targets: tuple[str, ...] | str, *,
           strict: bool = True) -> dict[str, tuple]:
  """The targeted linear layers {module name: model path}, routed experts' projections included
  as {name: (path of the stacked kernel, expert)}. `strict`: every name of a list must select a
  module (PEFT itself only needs one of them to, as `strict=False` does)."""
  modules = {**linear_modules(cfg), **expert_modules(cfg)}
  if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
    head = head_module(cfg)
    return {name: path for name, path in modules.items() if name != head}
  chosen = {name: path for name, path in modules.items() if matches(name, targets)}
  unused = unmatched(cfg, targets)
  if not chosen or (strict and unused):
    bad = targets if not chosen else unused[0]
    names = sorted({name.rsplit(".", 1)[-1] for name in modules})
    raise AdapterError(f"lora target {bad!r} selects no module of family {cfg.family!r}; its "
                       f"modules are {names}")
  return chosen


def _module(model, path: tuple):
  return weights.variable(model, path)


def _placed(value: jax.Array, kernel, spec: tuple) -> jax.Array:
  """`value` on the kernel's mesh, dimension i split like the kernel's dimension `spec[i]`
  (None: replicated); as is for an unsharded kernel or under tracing (abstract models)."""
  sharding = getattr(kernel, "sharding", None)
  if not isinstance(kernel, jax.Array) or not isinstance(sharding, NamedSharding):
    return value
  kernel_spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
  pspec = PartitionSpec(*(None if i is None else kernel_spec[i] for i in spec))
  return jax.device_put(value, NamedSharding(sharding.mesh, pspec))


def apply(model, lc: LoraConfig, *, seed: int = 0, strict: bool = True):
  """Attach a fresh adapter (random A, zero B) to every linear layer `lc.targets` selects; the
  model is changed in place and returned. A is split over the mesh like the kernel's input
  dimension, B like its output dimension. Refused on a model that already has adapters."""
  if has_adapters(model):
    raise AdapterError("the model already has LoRA adapters; apply them once")
  cfg = model.config
  rngs = nnx.Rngs(seed)
  experts = expert_modules(cfg)
  stacked: dict[tuple, set[int]] = {}  # stacked expert kernel -> the experts selected
  for name, path in select(cfg, lc.targets, strict=strict).items():
    if name in experts:
      stacked.setdefault(path[0], set()).add(path[1])
      continue
    linear = _module(model, path)
    if not isinstance(linear, Linear):
      raise AdapterError(f"module {name!r} is a {type(linear).__name__}, not an adaptable Linear")
    kernel = linear.kernel.get_value()
    d_in, d_out = kernel.shape
    adapter = Adapter(d_in, d_out, rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout,
                      dtype=cfg.compute_dtype, rngs=rngs)
    adapter.lora_a.set_value(_placed(adapter.lora_a.get_value(), kernel, (0, None)))
    adapter.lora_b.set_value(_placed(adapter.lora_b.get_value(), kernel, (None, 1)))
    linear.adapter = adapter
  for path, chosen in stacked.items():
    kernel = _module(model, path).get_value()
    e, d_in, d_out = kernel.shape
    if len(chosen) != e:
      name = next(n for n, (p, i) in experts.items() if p == path and i not in chosen)
      raise AdapterError(f"lora targets {lc.targets!r} select some routed experts of a layer but "
                         f"not {name!r}: adapt all of a layer's experts or none (one stacked "
                         "kernel)")
    adapter = ExpertAdapter(e, d_in, d_out, rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout,
                            rngs=rngs)
    adapter.lora_a.set_value(_placed(adapter.lora_a.get_value(), kernel, (0, 1, None)))
    adapter.lora_b.set_value(_placed(adapter.lora_b.get_value(), kernel, (0, None, 2)))
    setattr(_module(model, path[:-1]), _adapter_attr(path)[-1], adapter)
  return model


def adapters(model) -> dict[str, Adapter]:
  """The model's adapters {module name: Adapter}, in checkpoint order (empty: none)."""
  out = {}
  for name, path in linear_modules(model.config).items():
    adapter = getattr(_module(model, path), "adapter", None)
    if adapter is not None:
      out[name] = adapter
  return out


def expert_adapters(model) -> dict[tuple, ExpertAdapter]:
  """The routed experts' adapters {path of the stacked kernel: ExpertAdapter} (empty: none)."""
  out = {}
  for path, _ in expert_modules(model.config).values():
    adapter = getattr(_module(model, path[:-1]), _adapter_attr(path)[-1], None)
    if adapter is not None:
      out[path] = adapter
  return out


def all_adapters(model) -> list[Adapter | ExpertAdapter]:
  """Every adapter of the model: `adapters`' then `expert_adapters`'."""
  return [*adapters(model).values(), *expert_adapters(model).values()]


def has_adapters(model) -> bool:
  return bool(jax.tree.leaves(nnx.state(model, ADAPTER)))


def adapted_modules(model) -> list[str]:
  """The names of every adapted module, each routed expert's projection on its own (as PEFT
  names them), in checkpoint order."""
  stacked = expert_adapters(model)
  return [*adapters(model), *(name for name, (path, _) in expert_modules(model.config).items()
                              if path in stacked)]


def trainable(model):
  """The filter of the parameters an optimiser trains: the adapters' when there are any, else
  every parameter (full fine-tuning) but a mixture of experts' router unless
  `config.train_router` (LLaDA2.0: RL leaves the routing as pretrained)."""
  if has_adapters(model):
    return ADAPTER
  if model.config.num_experts and not model.config.train_router:
    return nnx.All(nnx.Param, nnx.Not(RouterParam))
  return nnx.Param


def with_adapters(model, adapter_state: nnx.State):
  """A module of `model`'s graph and its frozen base with `adapter_state` (an
  `nnx.state(..., ADAPTER)` of the same adapters) in place of its own adapters; it shares the
  base's buffers (e.g. the KL reference inside `jit`: no second copy of the base)."""
  graphdef, _, rest = nnx.split(model, ADAPTER, ...)
  return nnx.merge(graphdef, adapter_state, rest)


def num_params(model) -> int:
  """Parameters of the adapters (A and B of each)."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, ADAPTER)))


def logical_axes(model) -> dict[tuple, tuple]:
  """{path of each adapter parameter: its logical axes}: A [D_in, r] takes the kernel's input
  axis, B [r, D_out] its output axis, the rank is never split (the sharding rules' input)."""
  axes_of = {spec.path: spec.logical_axes for spec in weights.weight_specs(model.config)}
  out = {}
  for path in (p for p in linear_modules(model.config).values()
               if getattr(_module(model, p), "adapter", None) is not None):
    kernel_axes = axes_of[path + ("kernel",)]
    out[path + ("adapter", "lora_a")] = (kernel_axes[0], None)
    out[path + ("adapter", "lora_b")] = (None, kernel_axes[1])
  for path in expert_adapters(model):  # [E, D_in, r] and [E, r, D_out]
    expert, d_in, d_out = axes_of[path]
    out[_adapter_attr(path) + ("lora_a",)] = (expert, d_in, None)
    out[_adapter_attr(path) + ("lora_b",)] = (expert, None, d_out)
  return out


def set_dropout_key(model, key: jax.Array | None) -> None:
  """Turn the adapters' dropout on with masks drawn from `key` (one stream per adapter), or off
  with None. Meant for the copy of the model a loss function works on inside `jit` (after
  `nnx.merge`), so rollouts, behaviour and reference passes stay deterministic; every call of an
  adapter with the same key and input shape draws the same mask."""
  for i, adapter in enumerate(all_adapters(model)):
    adapter.dropout_key = nnx.data(None) if key is None else DropoutKey(jax.random.fold_in(key, i))


@jax.jit
def _merged(kernel, a, b, scale):
  delta = scale * jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
  return (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)


def merge(model):
  """Fold every adapter into its kernel (W + (α / r) A B, summed in float32, stored in the
  kernel's dtype and sharding) and remove it; in place, returned. With a bfloat16 base the sum
  is rounded to bfloat16, which loses updates far below the weights' magnitude: merge a float32
  copy (`models.load_pretrained(..., param_dtype="float32")`) for an exact export."""
  for name, path in linear_modules(model.config).items():
    linear = _module(model, path)
    adapter = getattr(linear, "adapter", None)
    if adapter is None:
      continue
    linear.kernel.set_value(_merged(linear.kernel.get_value(), adapter.lora_a.get_value(),
                                    adapter.lora_b.get_value(), adapter.scale))
    linear.adapter = nnx.data(None)
  for path, adapter in expert_adapters(model).items():
    kernel = _module(model, path)
    kernel.set_value(jax.vmap(_merged, in_axes=(0, 0, 0, None))(
        kernel.get_value(), adapter.lora_a.get_value(), adapter.lora_b.get_value(), adapter.scale))
    setattr(_module(model, path[:-1]), _adapter_attr(path)[-1], nnx.data(None))
  return model


def config_of(model) -> LoraConfig:
  """The LoraConfig of the model's adapters; `targets` the shortest PEFT list of names that
  selects exactly the adapted modules (their last name components), or an anchored regular
  expression of their names where no such list exists."""
  found = adapted_modules(model)
  if not found:
    raise AdapterError("the model has no LoRA adapters")
  shapes = {(a.rank, a.alpha, a.dropout) for a in all_adapters(model)}
  if len(shapes) > 1:
    raise AdapterError(f"adapters with different (rank, alpha, dropout) {sorted(shapes)}: PEFT's "
                       "file has one of each")
  rank, alpha, dropout = shapes.pop()
  suffixes = tuple(sorted({name.rsplit(".", 1)[-1] for name in found}))
  layers = _layer_pattern(list(found))
  if set(select(model.config, suffixes)) == set(found):
    targets = suffixes
  elif layers and set(select(model.config, layers)) == set(found):
    targets = layers
  else:
    targets = "|".join(re.escape(name) for name in found)
  return LoraConfig(rank=rank, alpha=alpha, dropout=dropout, targets=targets)


def _layer_pattern(names: list[str]) -> str:
  r"""One regular expression for module names `<prefix><layer>.<rest>` that share the prefix, any
  layer and each rest, e.g. `model\.transformer\.blocks\.\d+\.(ff_out|q_proj)`; "" when the
  names do not have that form."""
  parts = [re.fullmatch(r"(.*?\.)(\d+)\.(.+)", name) for name in names]
  if not all(parts) or len({p.group(1) for p in parts}) != 1:
    return ""
  rests = sorted({p.group(3) for p in parts})
  return re.escape(parts[0].group(1)) + r"\d+\.(" + "|".join(map(re.escape, rests)) + ")"
