"""Hugging Face checkpoints <-> the NNX transformer: LLaDA, SDAR, Qwen3 (docs/method.md §6),
Dream (Dream-org/Dream-v0-Instruct-7B's format: model_type "Dream", Qwen2 tensor names) and
LLaDA2.0 (inclusionAI's format: model_type "llada2_moe", one tensor per expert).

Loading reads `config.json`, builds the model abstractly (no parameter memory), then streams
the safetensors tensor by tensor into (sharded) device arrays: the host holds one tensor (or,
across processes, one slice of it) at a time.
"""
import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stabledrl_jax import storage
from stabledrl_jax.models import safetensors_io
from stabledrl_jax.models.config import ModelConfig
from stabledrl_jax.models.transformer import Transformer

FAMILY_OF_MODEL_TYPE = {"llada": "llada", "sdar": "sdar", "qwen3": "sdar", "Dream": "dream",
                        "llada2_moe": "llada2"}
# DreamConfig's defaults: the released code reads them when config.json omits the key.
DREAM_DEFAULTS = {"mask_token_id": 151666, "pad_token_id": 151643, "num_key_value_heads": 32,
                  "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
DREAM_AUTO_MAP = {"AutoConfig": "configuration_dream.DreamConfig",
                  "AutoModel": "modeling_dream.DreamModel"}
LLADA2_AUTO_MAP = {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                   "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                   "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}
# LLaDA2MoeConfig's defaults that change the architecture, read where config.json omits the key
# (configuration_llada2_moe.py); q/k norm is on where the key is absent (the first remote code
# applied it unconditionally).
LLADA2_DEFAULTS = {"use_qkv_bias": False, "use_bias": True, "use_qk_norm": True,
                   "num_shared_experts": 0, "n_group": 8, "topk_group": 4,
                   "routed_scaling_factor": 2.5, "first_k_dense_replace": 0,
                   "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "max_position_embeddings": 16384, "score_function": "sigmoid",
                   "norm_topk_prob": True, "hidden_act": "silu"}
# Logical axis -> mesh axis (issue 7 names: data, fsdp, tensor; expert); unknown mesh axes are
# skipped.
DEFAULT_RULES = {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor",
                 "expert": "expert"}


class CheckpointError(ValueError):
  """A checkpoint that does not match the model: names the tensor and the shapes."""


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  path: tuple  # attribute path in the NNX model
  hf_name: str
  transpose: bool  # torch Linear stores (out, in); our kernels are (in, out)
  logical_axes: tuple  # of the model-side array
  index: int | None = None  # the model array is stacked: this tensor is its slice [index]


def _get(c: dict, *keys, default=None):
  for key in keys:
    if c.get(key) is not None:
      return c[key]
  return default


def _first(token):
  return token[0] if isinstance(token, (list, tuple)) else token


def _dream_config(hf: dict, dtypes: dict) -> ModelConfig:
  """Dream's config.json (the DreamConfig keys, its defaults where a key is absent). The
  released attention derives head_dim as hidden_size / num_attention_heads and always has q/k/v
  biases and full attention; the mask token is config.json's `mask_token_id`, which the released
  sampler reads (its generation_config.json leaves it null)."""
  rope = hf.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ValueError(f"Dream rope_scaling {rope!r} is not supported")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"Dream hidden_act={hf['hidden_act']!r} is not supported")
  d, heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
  if d % heads:
    raise ValueError(f"Dream hidden_size={d} is not a multiple of num_attention_heads={heads}")
  dflt = {k: hf.get(k, v) for k, v in DREAM_DEFAULTS.items()}
  if "mask_token_id" not in hf and DREAM_DEFAULTS["mask_token_id"] >= vocab:
    dflt["mask_token_id"] = None  # not this vocabulary's: the tokenizer's mask token is used
  eos_all = hf.get("eos_token_id")
  eos_list = [t for t in (eos_all if isinstance(eos_all, (list, tuple)) else [eos_all])
              if t is not None]
  return ModelConfig(
      family="dream", model_type="Dream", vocab_size=vocab, d_model=d,
      n_layers=hf["num_hidden_layers"], n_heads=heads,
      n_kv_heads=_first_set(dflt["num_key_value_heads"], heads), head_dim=d // heads,
      mlp_dim=hf["intermediate_size"], rope_theta=float(dflt["rope_theta"]),
      norm_eps=float(dflt["rms_norm_eps"]), qk_norm=False, mask_token_id=dflt["mask_token_id"],
      eos_token_id=eos_list[0] if eos_list else None, pad_token_id=dflt["pad_token_id"],
      stop_token_ids=tuple(eos_list), block_size=None,
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=dflt["max_position_embeddings"], **dtypes)


def _llada2_config(hf: dict, dtypes: dict) -> ModelConfig:
  """LLaDA2.0's config.json (`LLADA2_DEFAULTS` where a key is absent). Refused: what the released
  code computes and this model does not (biases, other router scores, unnormalised weights)."""
  c = {k: hf.get(k, v) for k, v in LLADA2_DEFAULTS.items()}
  for key, ok in (("use_qkv_bias", False), ("use_bias", False), ("score_function", "sigmoid"),
                  ("norm_topk_prob", True), ("hidden_act", "silu")):
    if c[key] != ok:
      raise ValueError(f"LLaDA2 config {key}={c[key]!r} is not supported (only {ok!r})")
  rope = hf.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ValueError(f"LLaDA2 rope_scaling {rope!r} is not supported")
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  eos = hf.get("eos_token_id", hf.get("pad_token_id"))
  eos_list = [t for t in (eos if isinstance(eos, (list, tuple)) else [eos]) if t is not None]
  experts = hf.get("num_experts") or 0
  return ModelConfig(
      family="llada2", model_type="llada2_moe", vocab_size=hf["vocab_size"], d_model=d,
      n_layers=hf["num_hidden_layers"], n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or d // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=float(c["rope_theta"]), norm_eps=float(c["rms_norm_eps"]),
      qk_norm=bool(c["use_qk_norm"]), mask_token_id=hf.get("mask_token_id", 156895),
      eos_token_id=eos_list[0] if eos_list else None, pad_token_id=hf.get("pad_token_id"),
      stop_token_ids=tuple(eos_list), block_size=hf.get("block_size", 32),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=c["max_position_embeddings"], num_experts=experts,
      num_experts_per_tok=hf.get("num_experts_per_tok", 0) if experts else 0,
      n_group=c["n_group"] if experts else 1, topk_group=c["topk_group"] if experts else 1,
      moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
      num_shared_experts=c["num_shared_experts"] or 0,
      first_k_dense_replace=c["first_k_dense_replace"],
      routed_scaling_factor=float(c["routed_scaling_factor"]),
      partial_rotary_factor=float(c["partial_rotary_factor"]), **dtypes)


def config_from_hf(hf: dict, *, compute_dtype: str = "bfloat16",
                   param_dtype: str = "float32") -> ModelConfig:
  """ModelConfig from a Hugging Face config.json dict (LLaDA, SDAR, Qwen3 or Dream keys)."""
  model_type = hf.get("model_type")
  if model_type not in FAMILY_OF_MODEL_TYPE:
    raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILY_OF_MODEL_TYPE)}")
  dtypes = dict(compute_dtype=compute_dtype, param_dtype=param_dtype)
  if model_type == "Dream":
    return _dream_config(hf, dtypes)
  if model_type == "llada2_moe":
    return _llada2_config(hf, dtypes)
  if model_type == "llada":
    for key, ok in (("include_bias", False), ("include_qkv_bias", False),
                    ("attention_layer_norm", False), ("alibi", False)):
      if hf.get(key, ok) != ok:
        raise ValueError(f"LLaDA config {key}={hf[key]!r} is not supported")
    d, heads = hf["d_model"], hf["n_heads"]
    eos = _first(hf.get("eos_token_id"))
    return ModelConfig(
        family="llada", model_type="llada",
        vocab_size=_get(hf, "embedding_size", "vocab_size"), d_model=d, n_layers=hf["n_layers"],
        n_heads=heads, n_kv_heads=_get(hf, "n_kv_heads", default=heads), head_dim=d // heads,
        mlp_dim=_get(hf, "mlp_hidden_size", default=hf.get("mlp_ratio", 4) * d),
        rope_theta=float(hf.get("rope_theta", 10000.0)), norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        qk_norm=False, mask_token_id=hf.get("mask_token_id", 126336), eos_token_id=eos,
        pad_token_id=hf.get("pad_token_id"),
        stop_token_ids=(eos,) if eos is not None else (),
        block_size=None, tie_word_embeddings=bool(hf.get("weight_tying", False)),
        max_seq_len=hf.get("max_sequence_length", 4096), **dtypes)
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ValueError(f"rope scaling {rope!r} is not supported")
  if hf.get("attention_bias") or hf.get("use_sliding_window"):
    raise ValueError("attention_bias / use_sliding_window are not supported")
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  eos_all = hf.get("eos_token_id")
  eos_list = list(eos_all) if isinstance(eos_all, (list, tuple)) else [eos_all]
  vocab = hf["vocab_size"]
  default_mask = 151669 if vocab == 151936 else None  # SDAR's <|MASK|> in the Qwen3 tokenizer
  return ModelConfig(
      family="sdar", model_type=model_type, vocab_size=vocab, d_model=d,
      n_layers=hf["num_hidden_layers"], n_heads=heads,
      n_kv_heads=_get(hf, "num_key_value_heads", default=heads),
      head_dim=_get(hf, "head_dim", default=d // heads), mlp_dim=hf["intermediate_size"],
      rope_theta=float(_get(rope, "rope_theta", default=hf.get("rope_theta", 10000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=True,
      mask_token_id=hf.get("mask_token_id", default_mask), eos_token_id=eos_list[0],
      pad_token_id=hf.get("pad_token_id"),
      stop_token_ids=tuple(t for t in eos_list if t is not None),
      block_size=hf.get("block_size", 4),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=hf.get("max_position_embeddings", 32768), **dtypes)


def _dream_config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  """The keys of Dream-v0-Instruct-7B's config.json (`auto_map` to the remote code that a
  source checkpoint's files carry), without the bookkeeping ones (_name_or_path, versions)."""
  out = {
      "architectures": ["DreamModel"], "attention_dropout": 0.0, "auto_map": dict(DREAM_AUTO_MAP),
      "eos_token_id": cfg.eos_token_id, "hidden_act": "silu", "hidden_size": cfg.d_model,
      "initializer_range": 0.02, "intermediate_size": cfg.mlp_dim,
      "max_position_embeddings": cfg.max_seq_len, "max_window_layers": cfg.n_layers,
      "model_type": "Dream", "num_attention_heads": cfg.n_heads,
      "num_hidden_layers": cfg.n_layers, "num_key_value_heads": cfg.n_kv_heads,
      "pad_token_id": cfg.pad_token_id, "rms_norm_eps": cfg.norm_eps, "rope_scaling": None,
      "rope_theta": cfg.rope_theta, "sliding_window": None, "tie_word_embeddings": False,
      "torch_dtype": dtype, "use_cache": True, "use_mrope": False,
      "use_sliding_window": False, "vocab_size": cfg.vocab_size}
  if cfg.mask_token_id is not None:  # else DreamConfig's default
    out["mask_token_id"] = cfg.mask_token_id
  return out


def _with_mask_and_block(out: dict, cfg: ModelConfig) -> dict:
  """The block-diffusion families' extra keys (mask token, block), where the config has them."""
  if cfg.mask_token_id is not None:
    out["mask_token_id"] = cfg.mask_token_id
  if cfg.block_size is not None:
    out["block_size"] = cfg.block_size
  return out


def _llada2_config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  """The keys of LLaDA2.0-mini's config.json (`auto_map` to the released remote code)."""
  out = {
      "architectures": ["LLaDA2MoeModelLM"], "auto_map": dict(LLADA2_AUTO_MAP),
      "model_type": "llada2_moe", "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "use_qkv_bias": False, "use_bias": False,
      "use_qk_norm": cfg.qk_norm, "rms_norm_eps": cfg.norm_eps, "norm_head": False,
      "tie_word_embeddings": False, "initializer_range": 0.02,
      "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
      "rope_scaling": None, "partial_rotary_factor": cfg.partial_rotary_factor,
      "num_experts": cfg.num_experts or None,
      "num_experts_per_tok": cfg.num_experts_per_tok, "num_shared_experts": cfg.num_shared_experts,
      "n_group": cfg.n_group, "topk_group": cfg.topk_group,
      "moe_intermediate_size": cfg.moe_intermediate_size,
      "first_k_dense_replace": cfg.first_k_dense_replace,
      "routed_scaling_factor": cfg.routed_scaling_factor, "score_function": "sigmoid",
      "norm_topk_prob": True, "moe_router_enable_expert_bias": True, "router_dtype": "fp32",
      "output_router_logits": False, "use_cache": False, "pad_token_id": cfg.pad_token_id,
      "eos_token_id": cfg.eos_token_id, "torch_dtype": dtype, "dtype": dtype}
  return _with_mask_and_block(out, cfg)


def config_to_hf(cfg: ModelConfig) -> dict:
  """config.json dict that `config_from_hf` (and the family's own code) reads back."""
  dtype = {"float32": "float32", "bfloat16": "bfloat16"}.get(cfg.param_dtype, cfg.param_dtype)
  if cfg.family == "dream":
    return _dream_config_to_hf(cfg, dtype)
  if cfg.family == "llada2":
    return _llada2_config_to_hf(cfg, dtype)
  if cfg.family == "llada":
    return {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": cfg.d_model,
        "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
        "mlp_hidden_size": cfg.mlp_dim, "vocab_size": cfg.vocab_size,
        "embedding_size": cfg.vocab_size, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps, "mask_token_id": cfg.mask_token_id,
        "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "max_sequence_length": cfg.max_seq_len, "weight_tying": False, "include_bias": False,
        "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
        "torch_dtype": dtype}
  eos = list(cfg.stop_token_ids) if len(cfg.stop_token_ids) > 1 else cfg.eos_token_id
  out = {
      "model_type": cfg.model_type or "qwen3",
      "architectures": ["SDARForCausalLM" if cfg.model_type == "sdar" else "Qwen3ForCausalLM"],
      "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim, "vocab_size": cfg.vocab_size,
      "rope_theta": cfg.rope_theta,
      "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
      "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": False,
      "tie_word_embeddings": False, "eos_token_id": eos, "pad_token_id": cfg.pad_token_id,
      "max_position_embeddings": cfg.max_seq_len, "torch_dtype": dtype, "dtype": dtype}
  return _with_mask_and_block(out, cfg)


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


def generation_config_to_hf(cfg: ModelConfig) -> dict | None:
  """generation_config.json for an export with no source checkpoint, where the family's own
  code needs one: Dream's loader reads it into its DreamGenerationConfig (the released keys and
  defaults: `origin` remasking, 512 steps, eps 1e-3, greedy); LLaDA2.0's, the ids its
  `generate` reads (eos, pad, mask). None for the other families."""
  if cfg.family == "llada2":
    return {"_from_model_config": True, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id, "mask_token_id": cfg.mask_token_id}
  if cfg.family != "dream":
    return None
  return {"_from_model_config": True, "alg": "origin", "alg_temp": None,
          "eos_token_id": cfg.eos_token_id, "eps": 0.001, "mask_token_id": cfg.mask_token_id,
          "output_history": False, "pad_token_id": cfg.pad_token_id, "steps": 512,
          "temperature": 0.0, "top_k": None, "top_p": None}


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


def _variable(model, path):
  obj = model
  for key in path:
    obj = obj[key] if isinstance(key, int) else getattr(obj, key)
  return obj


def added_tokens(hf_dir: str) -> list[dict]:
  """The added tokens of the checkpoint's tokenizer, each `{"id", "content", "special", ...}`:
  tokenizer.json's `added_tokens`, or, for a tokenizer shipped as vocab.json + merges.txt
  (Dream's), tokenizer_config.json's `added_tokens_decoder` (id -> token)."""
  added = _read_json(storage.path(hf_dir) / "tokenizer.json").get("added_tokens")
  if added:
    return added
  decoder = _read_json(storage.path(hf_dir) / "tokenizer_config.json").get("added_tokens_decoder")
  return [{**entry, "id": int(i)} for i, entry in (decoder or {}).items()]


def _token_text(entry) -> str | None:
  # tokenizer_config.json spells a special token as a string or as {"content": ...}.
  return entry.get("content") if isinstance(entry, dict) else entry


def _raise_template_error(message: str) -> None:
  raise ValueError(f"chat template: {message}")


def _render_chat_template(tokenizer_config: dict, messages: list[dict]) -> str:
  """The conversation as the checkpoint's chat template writes it, rendered in a sandbox (the
  template is data, not trusted code) as `tasks.tokenizer.HFTokenizer` renders it."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.globals["raise_exception"] = _raise_template_error
  return env.from_string(tokenizer_config["chat_template"]).render(
      messages=messages, add_generation_prompt=False,
      bos_token=_token_text(tokenizer_config.get("bos_token")) or "",
      eos_token=_token_text(tokenizer_config.get("eos_token")) or "")


def end_of_turn_token(hf_dir: str) -> str | None:
  """The special token the chat template writes right after an assistant message, if any."""
  tokenizer_config = _read_json(storage.path(hf_dir) / "tokenizer_config.json")
  special = [t["content"] for t in added_tokens(hf_dir) if t.get("special")]
  if not isinstance(tokenizer_config.get("chat_template"), str) or not special:
    return None
  marker = "\u2063end of the answer\u2063"
  text = _render_chat_template(
      tokenizer_config,
      [{"role": "user", "content": "question"}, {"role": "assistant", "content": marker}])
  rest = text.rpartition(marker)[2].lstrip()
  found = [t for t in special if rest.startswith(t)]
  return max(found, key=len) if found else None


# A diffusion padding token that ends the answer: DiffuCoder's tokenizer has it, and its released
# examples cut each generation at the first one.
DIFFUSION_PAD = "<|dlm_pad|>"


def stop_token_ids(hf_dir: str, hf: dict) -> tuple[int, ...]:
  """Generation stops at: config.json's eos, generation_config.json's eos list, the chat
  template's end-of-turn token and `DIFFUSION_PAD` (both looked up in the checkpoint's tokenizer,
  where it has them)."""
  ids = []
  for entry in (hf.get("eos_token_id"), _read_json(
      storage.path(hf_dir) / "generation_config.json").get("eos_token_id")):
    ids += list(entry) if isinstance(entry, (list, tuple)) else [entry]
  eot = end_of_turn_token(hf_dir)
  if eot is not None:
    ids += [added_token_id(hf_dir, eot)]
  ids += [added_token_id(hf_dir, DIFFUSION_PAD)]
  return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def added_token_id(hf_dir: str, content: str) -> int | None:
  """The id of an added token of the checkpoint's tokenizer (None when absent)."""
  return next((t["id"] for t in added_tokens(hf_dir) if t["content"] == content), None)


def mask_token_id(hf_dir: str) -> int | None:
  """The mask token named by tokenizer_config.json (SDAR's `<|MASK|>`, Dream's `<|mask|>`), for
  a config.json that does not give `mask_token_id`."""
  entry = _token_text(_read_json(storage.path(hf_dir) / "tokenizer_config.json").get("mask_token"))
  return added_token_id(hf_dir, entry) if entry else None


def _first_set(*values):
  return next((v for v in values if v is not None), None)


def _read_json(path: storage.Path) -> dict:
  if not path.exists():
    return {}
  return json.loads(path.read_text())


def read_hf_config(hf_dir: str | storage.Path) -> dict:
  """The parsed config.json of a checkpoint directory (refused if half-written)."""
  hf_dir = storage.path(hf_dir)
  storage.check_complete(hf_dir)
  path = hf_dir / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"missing {path}")
  return json.loads(path.read_text())


def load_pretrained(hf_dir: str, *, dtype: str = "bfloat16", param_dtype: str = "float32",
                    mesh: Mesh | None = None, rules: dict | None = None,
                    options: dict | None = None) -> tuple[Transformer, ModelConfig]:
  """Load a LLaDA / SDAR / Qwen3 / Dream checkpoint; `dtype` is the compute dtype, `options` the
  execution options of the model config (remat, remat_policy, attention_impl, attention_tile).

  With a mesh, each tensor goes straight to its NamedSharding and each process reads from disk
  only its share of every tensor (`safetensors_io.read_sharded`), so no full copy of the model
  ever sits in host memory and the bytes each process reads fall with the number of processes.
  """
  hf = read_hf_config(hf_dir)
  cfg = config_from_hf(hf, compute_dtype=dtype, param_dtype=param_dtype)
  cfg = dataclasses.replace(cfg, stop_token_ids=stop_token_ids(hf_dir, hf) or cfg.stop_token_ids,
                            mask_token_id=_first_set(cfg.mask_token_id, mask_token_id(hf_dir)))
  cfg = dataclasses.replace(cfg, **(options or {}))
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  reader = safetensors_io.Reader(hf_dir)
  specs = weight_specs(cfg)
  stacked = {}  # path -> its per-slice specs (LLaDA2.0's experts)
  for spec in specs:
    if spec.index is not None:
      stacked.setdefault(spec.path, []).append(spec)
  for path, parts in stacked.items():
    variable = _variable(model, path)
    shape = tuple(variable.get_value().shape)
    host = np.empty(shape, param_dtype)
    for spec in parts:
      host[spec.index] = _read_checked(reader, spec, shape[1:], hf_dir).astype(param_dtype)
    value = (jax.device_put(host) if mesh is None else jax.device_put(
        host, param_sharding(mesh, parts[0].logical_axes, shape, rules)))
    variable.set_value(value)
  for spec in specs:
    if spec.index is not None:
      continue
    variable = _variable(model, spec.path)
    shape = tuple(variable.get_value().shape)
    hf_name = spec.hf_name
    if hf_name not in reader and spec.path == ("head", "kernel") and cfg.tie_word_embeddings:
      hf_name = weight_specs(cfg)[0].hf_name  # tied checkpoints store the head as the embedding
    if hf_name not in reader:
      raise CheckpointError(f"missing tensor {hf_name!r} in {hf_dir}")
    want = shape[::-1] if spec.transpose else shape
    if reader.shape(hf_name) != want:
      raise CheckpointError(f"tensor {hf_name!r} has shape {reader.shape(hf_name)}, "
                            f"expected {want}")
    if mesh is None:
      host = reader.read(hf_name)
      value = jax.device_put((host.T if spec.transpose else host).astype(param_dtype))
    else:
      value = safetensors_io.read_sharded(
          reader, hf_name, transpose=spec.transpose, dtype=param_dtype,
          sharding=param_sharding(mesh, spec.logical_axes, shape, rules))
    variable.set_value(value)
  return model, cfg


def _read_checked(reader, spec: WeightSpec, shape: tuple, hf_dir: str) -> np.ndarray:
  """One tensor in the model's layout (transposed where the spec says), its shape checked."""
  if spec.hf_name not in reader:
    raise CheckpointError(f"missing tensor {spec.hf_name!r} in {hf_dir}")
  want = shape[::-1] if spec.transpose else shape
  if reader.shape(spec.hf_name) != want:
    raise CheckpointError(f"tensor {spec.hf_name!r} has shape {reader.shape(spec.hf_name)}, "
                          f"expected {want}")
  host = reader.read(spec.hf_name)
  return host.T if spec.transpose else host


class ExportError(ValueError):
  """An export target that would lose data (exists and is not empty)."""


def export_pretrained(model: Transformer, out_dir: str | storage.Path, *, dtype: str | None = None,
                      max_shard_bytes: int = 5 * 2**30, source_dir: str | None = None,
                      replace: bool = False) -> None:
  """Write `model` as a Hugging Face directory: safetensors (sharded with an index above
  `max_shard_bytes`, one tensor on the host at a time) + config.json, the head always untied.

  `dtype` defaults to the parameter dtype (lossless). With `source_dir` (the checkpoint the run
  started from) the result keeps that checkpoint's format: its config.json keys and every other
  file (tokenizer, generation config, remote code) are carried over. Everything is written into
  `out_dir + ".partial"`, renamed to `out_dir` at the end, so a killed export never looks complete;
  a bucket has no rename, so there `out_dir` holds `storage.IN_PROGRESS` from the first write to
  the last, and readers (`read_hf_config`) refuse it meanwhile. A non-empty `out_dir` is refused
  unless `replace` (then it is swapped out only at the end; in a bucket, overwritten).
  A model with LoRA adapters is written with them merged into the weights (`lora.merge` of a
  clone: `model` keeps its adapters); `export.export` also writes the adapters alone.
  """
  out_dir = storage.path(out_dir)
  if out_dir.is_dir() and any(out_dir.iterdir()) and not replace:
    raise ExportError(f"export target {out_dir} exists and is not empty")
  if out_dir.exists() and not out_dir.is_dir():
    raise ExportError(f"export target {out_dir} exists and is not a directory")
  if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
    from stabledrl_jax import lora  # lora imports this module
    model = lora.merge(nnx.clone(model))  # new merged kernels, the rest shared
  cfg = model.config
  dtype = np.dtype(dtype or cfg.param_dtype)
  specs = {s.hf_name: s for s in weight_specs(cfg)}
  tensors = []
  for name, spec in specs.items():
    shape = tuple(_variable(model, spec.path).get_value().shape)
    shape = shape[1:] if spec.index is not None else shape
    tensors.append((name, shape[::-1] if spec.transpose else shape, dtype))

  def fetch(name: str) -> np.ndarray:
    spec = specs[name]
    value = _variable(model, spec.path).get_value()
    if spec.index is not None:
      value = value[spec.index]
    if not value.is_fully_addressable:
      from jax.experimental import multihost_utils
      value = multihost_utils.process_allgather(value, tiled=True)
    host = np.asarray(jax.device_get(value))
    return host.T if spec.transpose else host

  if jax.process_index() != 0:
    for name, _, _ in tensors:  # every process joins the gathers
      fetch(name)
    return
  remote = storage.is_remote(out_dir)
  partial = out_dir if remote else out_dir.with_name(out_dir.name + ".partial")
  if remote:
    (out_dir / storage.IN_PROGRESS).write_text("")
  else:
    if partial.exists():  # an earlier export killed half way
      partial.rmtree()
    partial.mkdir(parents=True)
  written = {storage.IN_PROGRESS}
  hf_config = config_to_hf(cfg)
  hf_config["torch_dtype"] = str(dtype)
  if "dtype" in hf_config:  # the newer transformers key, where the family's format has it
    hf_config["dtype"] = str(dtype)
  if source_dir is not None:
    for src in storage.path(source_dir).iterdir():
      if (src.is_file() and not src.name.endswith(".safetensors")
          and src.name not in (safetensors_io.INDEX_FILE, "config.json", storage.IN_PROGRESS)):
        src.copy(partial / src.name, overwrite=True)
        written.add(src.name)
    source = read_hf_config(source_dir)
    hf_config = {**source, **hf_config, "eos_token_id": source.get("eos_token_id")}
    if cfg.family == "llada":
      hf_config["weight_tying"] = False
    else:
      hf_config["tie_word_embeddings"] = False
  written.update(safetensors_io.write_checkpoint(partial, tensors, fetch, max_shard_bytes))
  (partial / "config.json").write_text(json.dumps(hf_config, indent=2))
  written.update((safetensors_io.INDEX_FILE, "config.json"))
  generation_config = generation_config_to_hf(cfg)
  generation_path = partial / "generation_config.json"
  if generation_config is not None and "generation_config.json" not in written:
    generation_path.write_text(json.dumps(generation_config, indent=2))
    written.add(generation_path.name)
  if remote:
    for stale in out_dir.iterdir():  # an earlier export's files
      if stale.name not in written:
        stale.rmtree() if stale.is_dir() else stale.unlink()
    (out_dir / storage.IN_PROGRESS).unlink()
  elif out_dir.exists():
    old = out_dir.with_name(out_dir.name + ".old")
    if old.exists():
      old.rmtree()
    os.replace(out_dir, old)
    os.replace(partial, out_dir)
    old.rmtree()
  else:
    os.replace(partial, out_dir)
