"""The Dream family (Dream-v0-7B, DiffuCoder-7B) on tiny checkpoints in its released format.

`write_dream_checkpoint` lays a directory out as Dream-org/Dream-v0-Instruct-7B ships: its
config.json keys (model_type "Dream", `auto_map` to the remote code), generation_config.json,
a tokenizer as vocab.json + merges.txt with its special tokens in tokenizer_config.json's
`added_tokens_decoder` and the Qwen chat template, and the Qwen2 tensor names with q/k/v biases.

References, both independent of the model code: a float64 NumPy forward written from the
definition (reading the checkpoint's tensors by their Hugging Face names), and, in the slow
tier, transformers' `Qwen2ForCausalLM` run with a non-causal mask. The shift that maps the
trunk's next-token states to the project's contract (logits at i predict token i) is applied
to both as `shift_to_targets` documents.
"""
import functools
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from stabledrl_jax import likelihood, models
from stabledrl_jax.models import hf_config

# Dream-v0-Instruct-7B's added tokens (added_tokens.json), in order from <|endoftext|> = 151643;
# the tiny tokenizer places them from BASE_VOCAB on, in the same order.
RELEASED_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<|beginoftext|>", True), ("<|mask|>", True)]
BASE_VOCAB = 100
VOCAB = 128  # the embedding is larger than the tokenizer, as Dream's 152064 > 151667
IDS = {token: BASE_VOCAB + i for i, (token, _) in enumerate(RELEASED_ADDED)}
# The released chat template without its tool branch (what the end-of-turn lookup renders).
DREAM_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
REMOTE_CODE = ("modeling_dream.py", "configuration_dream.py", "generation_utils.py",
               "tokenization_dream.py")
# Dream-v0-Instruct-7B's config.json, as released (the 7b preset and the loader are checked
# against it).
RELEASED_CONFIG = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                 "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "mask_token_id": 151666,
    "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "Dream",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "pad_token_id": 151643, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.46.2", "use_cache": True, "use_mrope": False,
    "use_sliding_window": False, "vocab_size": 152064}
RELEASED_GENERATION_CONFIG = {
    "_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": 151643,
    "eos_token_id": 151643, "eps": 0.001, "mask_token_id": None, "output_history": False,
    "pad_token_id": 151643, "steps": 512, "temperature": 0.0, "top_k": None, "top_p": None,
    "transformers_version": "4.46.2"}
RELEASED_BYTES_BF16 = 15231233024  # model.safetensors.index.json's total_size


def dream_shapes(d: int, heads: int, kv: int, mlp: int, layers: int, vocab: int) -> dict:
  """Every tensor of a Dream checkpoint by its released name (torch Linear: [out, in])."""
  h = d // heads
  shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,),
            "lm_head.weight": (vocab, d)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (heads * h, d), p + "self_attn.q_proj.bias": (heads * h,),
        p + "self_attn.k_proj.weight": (kv * h, d), p + "self_attn.k_proj.bias": (kv * h,),
        p + "self_attn.v_proj.weight": (kv * h, d), p + "self_attn.v_proj.bias": (kv * h,),
        p + "self_attn.o_proj.weight": (d, heads * h), p + "mlp.gate_proj.weight": (mlp, d),
        p + "mlp.up_proj.weight": (mlp, d), p + "mlp.down_proj.weight": (d, mlp)})
  return shapes


def write_dream_checkpoint(out, *, d: int = 32, heads: int = 4, kv: int = 2, mlp: int = 64,
                           layers: int = 2, seed: int = 0) -> dict:
  """A tiny checkpoint in Dream-v0-Instruct-7B's layout; returns its float32 tensors."""
  os.makedirs(out)
  eot = IDS["<|endoftext|>"]
  config = {**RELEASED_CONFIG, "_name_or_path": "Dream-org/Dream-v0-Instruct-7B",
            "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
            "mask_token_id": IDS["<|mask|>"], "hidden_size": d, "intermediate_size": mlp,
            "max_window_layers": layers, "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "torch_dtype": "float32", "vocab_size": VOCAB}
  generation = {**RELEASED_GENERATION_CONFIG, "bos_token_id": eot, "eos_token_id": eot,
                "pad_token_id": eot}
  tokenizer_config = {
      "add_bos_token": False, "add_prefix_space": False,
      "added_tokens_decoder": {str(IDS[t]): {"content": t, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": s}
                               for t, s in RELEASED_ADDED},
      "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
      "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
      "bos_token": "<|beginoftext|>", "chat_template": DREAM_TEMPLATE,
      "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>", "errors": "replace",
      "mask_token": "<|mask|>", "model_max_length": 131072, "pad_token": "<|endoftext|>",
      "split_special_tokens": False, "tokenizer_class": "DreamTokenizer", "unk_token": None}
  files = {"config.json": config, "generation_config.json": generation,
           "tokenizer_config.json": tokenizer_config,
           "added_tokens.json": {t: IDS[t] for t, _ in RELEASED_ADDED},
           "special_tokens_map.json": {"bos_token": "<|beginoftext|>",
                                       "eos_token": "<|endoftext|>", "mask_token": "<|mask|>",
                                       "pad_token": "<|endoftext|>"},
           "vocab.json": {chr(0x21 + i): i for i in range(BASE_VOCAB)}}
  for name, content in files.items():
    with open(os.path.join(out, name), "w") as f:
      json.dump(content, f, indent=2)
  with open(os.path.join(out, "merges.txt"), "w") as f:
    f.write("#version: 0.2\n")
  for name in REMOTE_CODE:
    with open(os.path.join(out, name), "w") as f:
      f.write("# remote code of the released checkpoint\n")
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, shape in dream_shapes(d, heads, kv, mlp, layers, VOCAB).items():
    if name.endswith("norm.weight"):
      value = 1 + 0.3 * rng.standard_normal(shape)  # random, so a misplaced norm cannot pass
    elif name.endswith(".bias"):
      value = 0.5 * rng.standard_normal(shape)
    else:
      value = 0.2 * rng.standard_normal(shape)
    tensors[name] = value.astype(np.float32)
  save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  return tensors


def numpy_forward(tensors: dict, config: dict, ids_BxL, positions_BxL, valid_BxL):
  """Dream's forward in float64 from the definition: the trunk's next-token logits, unshifted.

  Pre-norm blocks; attention with q/k/v biases, GQA, rotate-half RoPE at each slot's position
  and full (bidirectional) attention over the valid keys; SwiGLU MLP; final RMS norm; untied
  head. Torch Linear weights are [out, in]: y = x W^T + b.
  """
  t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
  d, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
  hd, eps, theta = d // heads, config["rms_norm_eps"], config["rope_theta"]

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

  inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
  ang = np.asarray(positions_BxL, np.float64)[..., None] * inv  # [B, L, H/2]
  cos = np.cos(np.concatenate([ang, ang], -1))[:, :, None]
  sin = np.sin(np.concatenate([ang, ang], -1))[:, :, None]

  def rope(x):
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

  b, l = ids_BxL.shape
  x = t["model.embed_tokens.weight"][np.asarray(ids_BxL)]
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    y = norm(x, t[p + "input_layernorm.weight"])

    def proj(name, n):
      w, bias = t[p + f"self_attn.{name}.weight"], t[p + f"self_attn.{name}.bias"]
      return (y @ w.T + bias).reshape(b, l, n, hd)
    q, k, v = rope(proj("q_proj", heads)), rope(proj("k_proj", kv)), proj("v_proj", kv)
    k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(hd)
    s = np.where(np.asarray(valid_BxL, bool)[:, None, None, :], s, -np.inf)
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", prob, v).reshape(b, l, d)
    x = x + o @ t[p + "self_attn.o_proj.weight"].T
    y = norm(x, t[p + "post_attention_layernorm.weight"])
    g, u = y @ t[p + "mlp.gate_proj.weight"].T, y @ t[p + "mlp.up_proj.weight"].T
    x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "mlp.down_proj.weight"].T
  return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def shift_numpy(next_BxLxV, valid_BxL):
  """The project's contract on next-token logits: slot i takes slot i - 1's when that slot is
  real; the first real slot of a row keeps its own (`shift_to_targets`)."""
  out = np.array(next_BxLxV)
  valid = np.asarray(valid_BxL, bool)
  for row in range(out.shape[0]):
    for i in range(1, out.shape[1]):
      if valid[row, i - 1]:
        out[row, i] = next_BxLxV[row, i - 1]
  return out


def released_sampler_shift(next_BxLxV):
  """What Dream's `_sample` does to the model's logits: `cat([logits[:, :1], logits[:, :-1]])`."""
  return np.concatenate([next_BxLxV[:, :1], next_BxLxV[:, :-1]], axis=1)


def left_padded_batch(seed: int = 0, length: int = 12, pads=(0, 3, 5)):
  """Rows `[pads | tokens]` with the sampler layout's positions (0 at the first real slot)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, VOCAB, (len(pads), length))
  valid = np.arange(length)[None, :] >= np.asarray(pads)[:, None]
  ids = np.where(valid, ids, IDS["<|endoftext|>"])
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  return ids, positions, valid


@functools.partial(nnx.jit, static_argnames=("head",))
def forward(model, ids, positions, valid, head=True):
  return model.logits(ids, attention="full", positions=positions, valid_BxL=valid, head=head)


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("dream") / "Dream-v0-Instruct-7B-tiny")
  tensors = write_dream_checkpoint(out)
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  return out, tensors, config


@pytest.fixture(scope="module")
def loaded(dream_dir):
  out, _, _ = dream_dir
  return models.load_pretrained(out, dtype="float32")


def test_the_released_format_loads_with_its_own_special_tokens(loaded):
  model, cfg = loaded
  assert (cfg.family, cfg.model_type, cfg.qk_norm, cfg.qkv_bias, cfg.shifted) == (
      "dream", "Dream", False, True, True)
  assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim) == (32, 4, 2, 8, 64)
  assert (cfg.vocab_size, cfg.block_size, cfg.tie_word_embeddings) == (VOCAB, None, False)
  assert cfg.mask_token_id == IDS["<|mask|>"]
  assert cfg.eos_token_id == cfg.pad_token_id == IDS["<|endoftext|>"]
  # config.json's end of text, then the chat template's end of turn, found with the special
  # tokens of tokenizer_config.json (Dream ships no tokenizer.json).
  assert cfg.stop_token_ids == (IDS["<|endoftext|>"], IDS["<|im_end|>"])
  assert model.blocks[1].attn.k_proj.bias[...].shape == (16,)
  assert model.blocks[0].attn.q_norm is None


def test_the_7b_preset_is_the_released_config():
  got = hf_config.config_from_hf(RELEASED_CONFIG)
  want = models.dream_7b(compute_dtype="bfloat16")
  assert got == models.replace(want, stop_token_ids=(151643,))  # + <|im_end|> from the tokenizer
  assert want.stop_token_ids == (151643, 151645)
  assert want.num_params * 2 == RELEASED_BYTES_BF16  # every tensor of the release, bf16
  assert models.preset("dream_7b").family == "dream"


def test_logits_match_the_float64_numpy_forward_with_the_shift_padded_rows_included(dream_dir,
                                                                                   loaded):
  _, tensors, config = dream_dir
  model, _ = loaded
  ids, positions, valid = left_padded_batch()
  got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(valid)))
  next_logits = numpy_forward(tensors, config, ids, positions, valid)
  want = shift_numpy(next_logits, valid)
  assert np.abs(got - want)[valid].max() < 1e-4
  # The contract: at slot i the prediction of token i comes from slot i - 1's state.
  np.testing.assert_allclose(got[0, 1:], next_logits[0, :-1], atol=1e-4)
  # Position 0 (the first real slot) keeps its own next-token logits, as the released sampler
  # leaves position 0; the released shift and ours agree everywhere else on real slots.
  released = released_sampler_shift(next_logits)
  first_real = np.argmax(valid, axis=1)
  for row in range(ids.shape[0]):
    np.testing.assert_allclose(got[row, first_real[row]], next_logits[row, first_real[row]],
                               atol=1e-4)
    later = slice(first_real[row] + 1, None)
    np.testing.assert_allclose(got[row, later], released[row, later], atol=1e-4)
  # Padding never reaches a real slot: a padded row equals its tokens forwarded alone.
  for row in (1, 2):
    p = first_real[row]
    alone = forward(model, jnp.asarray(ids[row:row + 1, p:]),
                    jnp.asarray(positions[row:row + 1, p:]), jnp.ones((1, ids.shape[1] - p), bool))
    np.testing.assert_allclose(got[row, p:], np.asarray(alone)[0], atol=1e-5)


def test_every_entry_point_keeps_the_contract(dream_dir, loaded):
  _, tensors, config = dream_dir
  model, cfg = loaded
  ids, positions, valid = (jnp.asarray(x) for x in left_padded_batch(seed=1, length=16))
  full = np.asarray(forward(model, ids, positions, valid))
  # The head on a block of `logits(head=False)` states: the block's logits.
  h = forward(model, ids, positions, valid, head=False)
  np.testing.assert_allclose(np.asarray(model.head_logits(h[:, 9:13])), full[:, 9:13], atol=1e-5)
  # forward_kv over everything: the same states.
  h_kv, kv = model.forward_kv(ids, positions_BxT=positions, valid_BxT=valid)
  np.testing.assert_allclose(np.asarray(model.head_logits(h_kv)), full, atol=1e-5)
  # A prefix cache (the suffix from slot s against cached keys): the shift stays within the
  # forwarded tokens, so slot s keeps its own next-token state and the rest agree ...
  s = 9
  past = [(k[:, :s], v[:, :s]) for k, v in kv]
  h_s, _ = model.forward_kv(ids[:, s:], positions_BxT=positions[:, s:], valid_BxT=valid[:, s:],
                            past=past, past_valid_BxS=valid[:, :s])
  next_logits = numpy_forward(tensors, config, *(np.asarray(x) for x in (ids, positions, valid)))
  np.testing.assert_allclose(np.asarray(model.head_logits(h_s[:, :1])), next_logits[:, s:s + 1],
                             atol=1e-4)
  np.testing.assert_allclose(np.asarray(model.head_logits(h_s[:, 1:])), full[:, s + 1:], atol=1e-5)
  # ... and forwarding from the slot before the block predicts every slot of it.
  past = [(k[:, :s - 1], v[:, :s - 1]) for k, v in kv]
  h_s1, _ = model.forward_kv(ids[:, s - 1:], positions_BxT=positions[:, s - 1:],
                             valid_BxT=valid[:, s - 1:], past=past, past_valid_BxS=valid[:, :s - 1])
  np.testing.assert_allclose(np.asarray(model.head_logits(h_s1[:, 1:])), full[:, s:], atol=1e-5)
  # The blockwise attention implementation gives the same logits.
  tiled = models.Transformer(models.replace(cfg, attention_impl="blockwise", attention_tile=5),
                             rngs=nnx.Rngs(0))
  nnx.update(tiled, nnx.state(model))
  np.testing.assert_allclose(np.asarray(forward(tiled, ids, positions, valid)), full, atol=1e-5)
  # Block-causal with blocks of one is the autoregressive forward: slot i sees slots < i only.
  ar = np.asarray(model.logits(ids[:1], attention="block_causal", block_size=1))
  ar_prefix = np.asarray(model.logits(ids[:1, :7], attention="block_causal", block_size=1))
  np.testing.assert_allclose(ar[:, :7], ar_prefix, atol=1e-5)


def test_block_diffusion_entry_points_are_refused(loaded):
  model, _ = loaded
  ids = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="block diffusion"):
    model.staircase_logits(ids, ids, block_size=4)
  with pytest.raises(ValueError, match="block diffusion"):
    model.cached_logits(ids, model.init_cache(1, 8), positions_BxT=jnp.arange(8)[None],
                        commit=True, block_size=4)


def test_masked_logp_needs_no_family_case(dream_dir, loaded):
  """`likelihood.masked_logp` on a Dream model equals log-softmax of the shifted float64
  reference on the corrupted sequence, at every real slot."""
  _, tensors, config = dream_dir
  model, cfg = loaded
  ids, positions, valid = left_padded_batch(seed=2, length=14, pads=(0, 4))
  prompt = valid & (positions < 5)
  completion = valid & ~prompt
  noised = completion & (np.random.default_rng(3).random(ids.shape) < 0.6)
  noised[:, -1] = True  # at least one masked slot per row
  seqs = likelihood.Sequences(
      tokens_BxL=jnp.asarray(ids), positions_BxL=jnp.asarray(positions),
      valid_BxL=jnp.asarray(valid), prompt_BxL=jnp.asarray(prompt),
      completion_BxL=jnp.asarray(completion), counted_BxL=jnp.asarray(completion))
  got = np.asarray(likelihood.masked_logp(model, seqs, jnp.asarray(noised)[:, None],
                                          staircase=False))[:, 0]
  noisy = np.where(noised, cfg.mask_token_id, ids)
  logits = shift_numpy(numpy_forward(tensors, config, noisy, positions, valid), valid)
  logits = logits - logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.take_along_axis(logp, ids[..., None], -1)[..., 0]
  assert np.abs(got - want)[valid].max() < 1e-4


def _hf_names(path: str) -> dict:
  with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


def test_export_keeps_the_released_format_and_reloads_equal(dream_dir, loaded, tmp_path):
  src, tensors, config = dream_dir
  model, _ = loaded
  out = str(tmp_path / "export")
  models.export_pretrained(model, out, source_dir=src)
  with open(os.path.join(out, "config.json")) as f:
    exported = json.load(f)
  assert exported == config  # every key and value of the source config.json
  for name in ["generation_config.json", "tokenizer_config.json", "added_tokens.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", *REMOTE_CODE]:
    with open(os.path.join(src, name)) as a, open(os.path.join(out, name)) as b:
      assert a.read() == b.read(), name
  written = _hf_names(out)
  assert set(written) == set(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)
  reloaded, cfg = models.load_pretrained(out, dtype="float32")
  assert cfg == models.load_pretrained(src, dtype="float32")[1]
  ids, positions, valid = (jnp.asarray(x) for x in left_padded_batch(seed=4))
  np.testing.assert_array_equal(np.asarray(forward(reloaded, ids, positions, valid)),
                                np.asarray(forward(model, ids, positions, valid)))


def test_export_without_a_source_writes_dreams_config_and_generation_config(tmp_path):
  cfg = models.tiny(**models.family_options("dream"), mask_token_id=127, eos_token_id=1,
                    pad_token_id=1, stop_token_ids=(1,))
  model = models.create(cfg, seed=3)
  for block in model.blocks:  # non-zero biases, so a dropped bias cannot pass
    for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
      proj.bias[...] = 0.1 * jnp.arange(proj.bias[...].shape[0], dtype=jnp.float32)
  out = str(tmp_path / "fresh")
  models.export_pretrained(model, out, max_shard_bytes=40_000)
  with open(os.path.join(out, "config.json")) as f:
    hf = json.load(f)
  assert set(hf) == set(RELEASED_CONFIG) - {"bos_token_id", "transformers_version"}
  assert (hf["model_type"], hf["architectures"], hf["auto_map"]) == (
      "Dream", ["DreamModel"], RELEASED_CONFIG["auto_map"])
  assert (hf["mask_token_id"], hf["eos_token_id"], hf["torch_dtype"]) == (127, 1, "float32")
  with open(os.path.join(out, "generation_config.json")) as f:
    generation = json.load(f)
  assert set(generation) == set(RELEASED_GENERATION_CONFIG) - {"bos_token_id",
                                                                "transformers_version"}
  index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
  assert set(index["weight_map"]) == set(dream_shapes(64, 4, 2, 128, 2, 128))
  reloaded, got = models.load_pretrained(out, dtype="float32")
  assert got == models.replace(cfg, compute_dtype="float32")
  ids = jnp.asarray(np.random.default_rng(5).integers(0, 128, (2, 9)))
  np.testing.assert_array_equal(np.asarray(reloaded.logits(ids)), np.asarray(model.logits(ids)))


def test_a_bad_tensor_or_config_is_refused_in_one_line(dream_dir, tmp_path):
  src, tensors, _ = dream_dir
  bad = str(tmp_path / "bad")
  shutil.copytree(src, bad)
  path = os.path.join(bad, "model.safetensors")
  renamed = dict(tensors)
  renamed["model.layers.1.self_attn.k_proj.biases"] = renamed.pop(
      "model.layers.1.self_attn.k_proj.bias")
  save_file(renamed, path)
  with pytest.raises(models.CheckpointError) as e:
    models.load_pretrained(bad)
  assert str(e.value) == f"missing tensor 'model.layers.1.self_attn.k_proj.bias' in {bad}"
  save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(31, np.float32)}, path)
  with pytest.raises(models.CheckpointError) as e:
    models.load_pretrained(bad)
  assert str(e.value) == ("tensor 'model.layers.0.self_attn.q_proj.bias' has shape (31,), "
                          "expected (32,)")
  config = {**RELEASED_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
  with pytest.raises(ValueError, match="Dream rope_scaling .* is not supported"):
    hf_config.config_from_hf(config)
  with pytest.raises(ValueError, match="no q/k norm"):
    models.tiny(family="dream", block_size=None)
  with pytest.raises(ValueError, match="derives head_dim"):
    models.tiny(**models.family_options("dream"), head_dim=8)  # 4 heads x 8 != 64


# ---------------------------------------------------------------- slow: torch parity


@pytest.mark.slow
def test_matches_transformers_qwen2_run_bidirectionally(tmp_path):
  """Against transformers' Qwen2ForCausalLM with a non-causal mask, saved in Dream's format.

  Equivalent to the released remote code of Dream-v0-Instruct-7B: its DreamModel holds
  `model` (embed_tokens, layers, norm) and `lm_head`, so its tensor names are
  Qwen2ForCausalLM's; DreamAttention has q/k/v biases and none on o_proj, head_dim =
  hidden_size / num_attention_heads, GQA by repeated k/v heads, default RoPE with
  config.rope_theta, scale 1/sqrt(head_dim), and calls SDPA with `is_causal=False` and the
  given mask (none for "full"); DreamRMSNorm, DreamMLP (SwiGLU) and the pre-norm decoder layer
  are Qwen2's. The one difference, Qwen2's causal mask, is replaced here by an additive mask
  that hides padding keys only (for a real query, the released query-and-key padding mask is
  the same); the released sampler then shifts the logits one slot right.
  """
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  qcfg = transformers.Qwen2Config(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
      tie_word_embeddings=False, attn_implementation="eager")
  qwen = transformers.Qwen2ForCausalLM(qcfg).eval()
  with torch.no_grad():
    for name, p in qwen.named_parameters():
      p.copy_((1 + 0.3 * torch.randn_like(p)) if "norm" in name else 0.2 * torch.randn_like(p))
  tensors = {k: v.numpy() for k, v in qwen.state_dict().items()}
  assert set(tensors) == set(dream_shapes(32, 4, 2, 64, 2, VOCAB))  # Dream's names exactly
  out = tmp_path / "dream"
  config = {**RELEASED_CONFIG, "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
            "max_window_layers": 2, "vocab_size": VOCAB, "mask_token_id": IDS["<|mask|>"],
            "eos_token_id": 100, "pad_token_id": 100, "bos_token_id": 100}
  out.mkdir()
  save_file(tensors, str(out / "model.safetensors"))
  (out / "config.json").write_text(json.dumps(config))
  ids, positions, valid = left_padded_batch(seed=6)
  additive = np.where(valid[:, None, None, :], 0.0, np.finfo(np.float32).min).astype(np.float32)
  additive = np.broadcast_to(additive, (ids.shape[0], 1, ids.shape[1], ids.shape[1]))
  with torch.no_grad():
    bidirectional = qwen(torch.tensor(ids), attention_mask=torch.tensor(additive.copy()),
                         position_ids=torch.tensor(positions)).logits.numpy()
    causal = qwen(torch.tensor(ids[:1])).logits.numpy()
  assert np.abs(bidirectional[:1] - causal).max() > 1e-2  # the reference really is bidirectional
  model, cfg = models.load_pretrained(str(out), dtype="float32")
  assert cfg.family == "dream"
  got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(valid)))
  assert np.abs(got - shift_numpy(bidirectional, valid))[valid].max() < 1e-4
  assert np.abs(got[0] - released_sampler_shift(bidirectional)[0]).max() < 1e-4
