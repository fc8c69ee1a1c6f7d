"""The checkpoint's tensors: each parameter's Hugging Face name, on-disk layout and logical axes,
per family (`weight_specs`), and the logical axes' mesh sharding (`param_sharding`). The one
table `huggingface` (load, export), `lora` (which modules an adapter can target, and their
sharding) and the checkpoints' shardings read.
"""
import dataclasses

from jax.sharding import Mesh, NamedSharding, PartitionSpec

from stabledrl_jax.models.config import ModelConfig

# Logical axis -> mesh axis (issue 7 names: data, fsdp, tensor; expert); unknown mesh axes are
# skipped.
# A batch's leading axis is split over these mesh axes (`sharding`; the MoE layer's rows too).
BATCH_AXES = ("data", "fsdp", "expert")
DEFAULT_RULES = {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor",
                 "expert": "expert"}


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  path: tuple  # attribute path in the NNX model
  hf_name: str
  transpose: bool  # torch Linear stores (out, in); our kernels are (in, out)
  logical_axes: tuple  # of the model-side array
  index: int | None = None  # the model array is stacked: this tensor is its slice [index]


_NORM, _LIN_IN, _LIN_OUT = ("norm",), ("embed", "heads"), ("heads", "embed")
_MLP_IN, _MLP_OUT = ("embed", "mlp"), ("mlp", "embed")
# Per-layer parameter: (attribute path in a Block, transposed on disk, logical axes).
_LAYER_PARAMS = {
    "attn_norm": (("attn_norm", "scale"), False, _NORM),
    "mlp_norm": (("mlp_norm", "scale"), False, _NORM),
    "q_proj": (("attn", "q_proj", "kernel"), True, _LIN_IN),
    "k_proj": (("attn", "k_proj", "kernel"), True, _LIN_IN),
    "v_proj": (("attn", "v_proj", "kernel"), True, _LIN_IN),
    "o_proj": (("attn", "o_proj", "kernel"), True, _LIN_OUT),
    "q_norm": (("attn", "q_norm", "scale"), False, _NORM),
    "k_norm": (("attn", "k_norm", "scale"), False, _NORM),
    "gate_proj": (("gate_proj", "kernel"), True, _MLP_IN),
    "up_proj": (("up_proj", "kernel"), True, _MLP_IN),
    "down_proj": (("down_proj", "kernel"), True, _MLP_OUT),
    "q_bias": (("attn", "q_proj", "bias"), False, ("heads",)),
    "k_bias": (("attn", "k_proj", "bias"), False, ("heads",)),
    "v_bias": (("attn", "v_proj", "bias"), False, ("heads",)),
}
_LLADA_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ff_norm.weight", "q_proj": "q_proj.weight",
    "k_proj": "k_proj.weight", "v_proj": "v_proj.weight", "o_proj": "attn_out.weight",
    "gate_proj": "ff_proj.weight", "up_proj": "up_proj.weight", "down_proj": "ff_out.weight"}
# Qwen2 / Qwen3 names: SDAR, Qwen3 and Dream (whose DreamModel holds `model` and `lm_head`).
_QWEN_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight", "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias"}


_LLADA2_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "o_proj": "attention.dense.weight", "q_norm": "attention.query_layernorm.weight",
    "k_norm": "attention.key_layernorm.weight", "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight"}
_EXPERT_AXES = {"gate": ("expert", "embed", "mlp"), "up": ("expert", "embed", "mlp"),
                "down": ("expert", "mlp", "embed")}


def _llada2_layer_specs(cfg: ModelConfig, i: int) -> list[WeightSpec]:
  """One LLaDA2.0 layer: fused query_key_value; a dense MLP, or the router (gate.weight
  [experts, hidden], its expert_bias buffer), one tensor per expert projection and the shared
  experts."""
  prefix = f"model.layers.{i}."
  keys = ["attn_norm", "mlp_norm", "o_proj"] + (["q_norm", "k_norm"] if cfg.qk_norm else [])
  moe = cfg.is_moe_layer(i)
  keys += [] if moe else ["gate_proj", "up_proj", "down_proj"]
  specs = [WeightSpec(("blocks", i) + _LAYER_PARAMS[k][0], prefix + _LLADA2_LAYER_NAMES[k],
                      _LAYER_PARAMS[k][1], _LAYER_PARAMS[k][2]) for k in keys]
  specs.append(WeightSpec(("blocks", i, "attn", "qkv_proj", "kernel"),
                          prefix + "attention.query_key_value.weight", True, _LIN_IN))
  if not moe:
    return specs
  m = ("blocks", i, "moe")
  specs += [WeightSpec(m + ("router",), prefix + "mlp.gate.weight", True, ("embed", None)),
            WeightSpec(m + ("expert_bias",), prefix + "mlp.gate.expert_bias", False, (None,))]
  for e in range(cfg.num_experts):
    for proj in ("gate", "up", "down"):
      specs.append(WeightSpec(m + (f"{proj}_kernel",),
                              f"{prefix}mlp.experts.{e}.{proj}_proj.weight", True,
                              _EXPERT_AXES[proj], index=e))
  if cfg.num_shared_experts:
    for proj, axes in (("gate_proj", _MLP_IN), ("up_proj", _MLP_IN), ("down_proj", _MLP_OUT)):
      specs.append(WeightSpec(m + ("shared_experts", proj, "kernel"),
                              f"{prefix}mlp.shared_experts.{proj}.weight", True, axes))
  return specs


def _layer_keys(cfg: ModelConfig) -> list[str]:
  """The parameters of one block, in the order they are written."""
  keys = ["attn_norm", "mlp_norm", "q_proj", "k_proj", "v_proj", "o_proj"]
  keys += ["q_norm", "k_norm"] if cfg.qk_norm else []
  keys += ["gate_proj", "up_proj", "down_proj"]
  return keys + (["q_bias", "k_bias", "v_bias"] if cfg.qkv_bias else [])


def weight_specs(cfg: ModelConfig) -> list[WeightSpec]:
  """Every parameter with its Hugging Face name (docs/method.md §6 tables; Dream's are the
  Qwen2 names, with the q/k/v biases)."""
  if cfg.family == "llada2":
    specs = [WeightSpec(("embed", "embedding"), "model.word_embeddings.weight", False,
                        ("vocab", "embed")),
             WeightSpec(("final_norm", "scale"), "model.norm.weight", False, _NORM),
             WeightSpec(("head", "kernel"), "lm_head.weight", True, ("embed", "vocab"))]
    for i in range(cfg.n_layers):
      specs += _llada2_layer_specs(cfg, i)
    return specs
  if cfg.family == "llada":
    p = "model.transformer."
    top = [WeightSpec(("embed", "embedding"), p + "wte.weight", False, ("vocab", "embed")),
           WeightSpec(("final_norm", "scale"), p + "ln_f.weight", False, _NORM),
           WeightSpec(("head", "kernel"), p + "ff_out.weight", True, ("embed", "vocab"))]
    layer_prefix, layer_names = p + "blocks.{}.", _LLADA_LAYER_NAMES
  else:
    top = [WeightSpec(("embed", "embedding"), "model.embed_tokens.weight", False, ("vocab", "embed")),
           WeightSpec(("final_norm", "scale"), "model.norm.weight", False, _NORM),
           WeightSpec(("head", "kernel"), "lm_head.weight", True, ("embed", "vocab"))]
    layer_prefix, layer_names = "model.layers.{}.", _QWEN_LAYER_NAMES
  specs = list(top)
  for i in range(cfg.n_layers):
    for key in _layer_keys(cfg):
      path, transpose, axes = _LAYER_PARAMS[key]
      specs.append(WeightSpec(("blocks", i) + path, layer_prefix.format(i) + layer_names[key],
                              transpose, axes))
  return specs


def param_sharding(mesh: Mesh, logical_axes: tuple, shape: tuple,
                   rules: dict | None = None) -> NamedSharding:
  """NamedSharding for one parameter: a logical axis maps to its mesh axis when that axis
  exists and divides the dimension; otherwise the dimension is replicated."""
  rules = DEFAULT_RULES if rules is None else rules
  spec = []
  for axis, dim in zip(logical_axes, shape):
    mesh_axis = rules.get(axis)
    ok = mesh_axis in mesh.shape and dim % mesh.shape[mesh_axis] == 0
    spec.append(mesh_axis if ok else None)
  return NamedSharding(mesh, PartitionSpec(*spec))


def variable(model, path):
  obj = model
  for key in path:
    obj = obj[key] if isinstance(key, int) else getattr(obj, key)
  return obj
