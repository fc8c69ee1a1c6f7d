"""config.json <-> `ModelConfig`, per family: LLaDA, SDAR and Qwen3, Dream (model_type "Dream",
DreamConfig's defaults where a key is absent) and LLaDA2.0 (model_type "llada2_moe",
LLaDA2MoeConfig's); and the generation_config.json an export needs where the family's own code
reads one. `huggingface` reads and writes the files.
"""
from stabledrl_jax.models.config import ModelConfig

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


def _get(c: dict, *keys, default=None):
  for key in keys:
    if c.get(key) is not None:
      return c[key]
  return default


def _first(token):
  return token[0] if isinstance(token, (list, tuple)) else token


def first_set(*values):
  return next((v for v in values if v is not None), None)


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
      n_kv_heads=first_set(dflt["num_key_value_heads"], heads), head_dim=d // heads,
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
