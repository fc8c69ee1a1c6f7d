"""Hugging Face checkpoints: round trips, sharding, errors (fast); torch parity and streaming
memory (slow)."""
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from stabledrl_jax import models
from stabledrl_jax.models import hf_config, hf_tokenizer, weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.partial(nnx.jit, static_argnames=("attention", "block_size"))
def logits(model, ids, attention="full", block_size=None):
  return model.logits(ids, attention=attention, block_size=block_size)


def _params(model) -> dict:
  return {spec.hf_name: np.asarray(weights.variable(model, spec.path)[...])
          for spec in weights.weight_specs(model.config)}


@pytest.fixture(scope="module", params=["sdar", "llada"])
def exported(request, tmp_path_factory):
  if request.param == "sdar":
    cfg = models.tiny()
  else:
    cfg = models.tiny(**models.family_options("llada"), n_kv_heads=4)
  model = models.create(cfg, seed=4)
  out = str(tmp_path_factory.mktemp(request.param))
  models.export_pretrained(model, out)
  return model, out


def test_export_is_read_by_the_safetensors_library(exported):
  model, out = exported
  with safe_open(os.path.join(out, "model.safetensors"), framework="numpy") as f:
    names = set(f.keys())
    for spec in weights.weight_specs(model.config):
      ours = np.asarray(weights.variable(model, spec.path)[...])
      np.testing.assert_array_equal(f.get_tensor(spec.hf_name), ours.T if spec.transpose else ours)
  assert names == {s.hf_name for s in weights.weight_specs(model.config)}


def test_round_trip_is_lossless(exported):
  model, out = exported
  loaded, cfg = models.load_pretrained(out, dtype="float32")
  assert cfg.family == model.config.family
  assert dataclasses_equal(cfg, model.config)
  before, after = _params(model), _params(loaded)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def dataclasses_equal(a, b) -> bool:
  keys = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
          "mlp_dim", "rope_theta", "norm_eps", "qk_norm", "mask_token_id", "eos_token_id")
  return all(getattr(a, k) == getattr(b, k) for k in keys)


def test_sharded_export_and_bfloat16(tmp_path):
  model = models.create(models.tiny(), seed=5)
  models.export_pretrained(model, str(tmp_path / "f32"), max_shard_bytes=60_000)
  index = json.load(open(tmp_path / "f32" / "model.safetensors.index.json"))
  assert len(set(index["weight_map"].values())) > 2
  loaded, _ = models.load_pretrained(str(tmp_path / "f32"), dtype="float32")
  for name, value in _params(model).items():
    np.testing.assert_array_equal(_params(loaded)[name], value)
  models.export_pretrained(model, str(tmp_path / "bf16"), dtype="bfloat16")
  with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="flax") as f:
    emb = np.asarray(f.get_tensor("model.embed_tokens.weight"))
  assert emb.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(emb, _params(model)["model.embed_tokens.weight"].astype(emb.dtype))
  loaded16, _ = models.load_pretrained(str(tmp_path / "bf16"), dtype="float32")
  np.testing.assert_allclose(_params(loaded16)["lm_head.weight"],
                             _params(model)["lm_head.weight"], rtol=1e-2, atol=1e-3)


def test_reader_slices_library_and_own_files_bfloat16_included(tmp_path):
  rng = np.random.RandomState(0)
  tensors = {"a": rng.randn(6, 5).astype(np.float32), "b": rng.randn(7).astype(np.float16),
             "c": np.arange(6, dtype=np.int64).reshape(2, 3),
             "d": rng.randn(4, 8).astype(ml_dtypes.bfloat16)}
  save_file(tensors, str(tmp_path / "model.safetensors"))
  from stabledrl_jax.models import safetensors_io
  reader = safetensors_io.Reader(str(tmp_path))
  for name, value in tensors.items():
    assert reader.shape(name) == value.shape
    got = reader.read(name)
    assert got.dtype == value.dtype
    np.testing.assert_array_equal(got, value)
  np.testing.assert_array_equal(reader.read("a", (slice(2, 4), slice(1, 5))), tensors["a"][2:4, 1:5])
  np.testing.assert_array_equal(reader.read("d", (slice(0, 4), slice(4, 8))), tensors["d"][:, 4:])
  own = tmp_path / "own"
  safetensors_io.write_checkpoint(str(own), [(k, v.shape, v.dtype) for k, v in tensors.items()],
                                  tensors.__getitem__, max_shard_bytes=100)
  assert (own / "model.safetensors.index.json").exists()
  reader = safetensors_io.Reader(str(own))
  for name, value in tensors.items():
    np.testing.assert_array_equal(reader.read(name), value)
  second = sorted(f for f in os.listdir(own) if f.endswith(".safetensors"))[1]
  os.remove(own / second)
  with pytest.raises(FileNotFoundError, match=second):
    safetensors_io.Reader(str(own))


def test_load_onto_a_mesh_shards_parameters(exported):
  model, out = exported
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  sharded, cfg = models.load_pretrained(out, dtype="float32", mesh=mesh)
  q = sharded.blocks[0].attn.q_proj.kernel[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (32, 16)
  ids = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 127)
  np.testing.assert_allclose(np.asarray(logits(sharded, ids)), np.asarray(logits(model, ids)),
                             atol=1e-5)


def _rewrite(out: str, edit) -> None:
  path = os.path.join(out, "model.safetensors")
  with safe_open(path, framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  edit(tensors)
  save_file(tensors, path)


def test_errors_name_what_is_wrong(tmp_path):
  model = models.create(models.tiny(), seed=6)
  out = str(tmp_path / "m")
  models.export_pretrained(model, out)
  with pytest.raises(FileNotFoundError, match="config.json"):
    models.load_pretrained(str(tmp_path))
  cfg_path = os.path.join(out, "config.json")
  good = json.load(open(cfg_path))
  json.dump({**good, "model_type": "gpt2"}, open(cfg_path, "w"))
  with pytest.raises(ValueError, match="unknown model_type 'gpt2'"):
    models.load_pretrained(out)
  json.dump(good, open(cfg_path, "w"))
  _rewrite(out, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(models.CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj"):
    models.load_pretrained(out)
  _rewrite(out, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((128, 65), np.float32)}))
  with pytest.raises(models.CheckpointError,
                     match=r"'model.layers.1.mlp.up_proj.weight' has shape \(128, 65\), expected \(128, 64\)"):
    models.load_pretrained(out)
  os.remove(os.path.join(out, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    models.load_pretrained(out)
  json.dump({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}},
            open(os.path.join(out, "model.safetensors.index.json"), "w"))
  with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
    models.load_pretrained(out)


# ---------------------------------------------------------------- slow: torch parity, memory


def _qwen3_dir(tmp_path, tie=False):
  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  torch.manual_seed(0)
  cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
                    rms_norm_eps=1e-6, tie_word_embeddings=tie)
  model = Qwen3ForCausalLM(cfg).eval()
  # Random norm weights, so a skipped or misplaced norm cannot pass.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.3 * torch.randn_like(p))
  model.save_pretrained(str(tmp_path))
  return model


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_parity_block_causal_b1_is_causal_torch(tmp_path, tie):
  import torch
  torch_model = _qwen3_dir(tmp_path, tie)
  ids = np.random.RandomState(1).randint(0, 96, (2, 13))
  with torch.no_grad():
    expected = torch_model(torch.tensor(ids)).logits.numpy()
  model, cfg = models.load_pretrained(str(tmp_path), dtype="float32")
  assert cfg.family == "sdar" and cfg.qk_norm
  got = np.asarray(logits(model, jnp.asarray(ids), attention="block_causal", block_size=1))
  assert np.abs(got - expected).max() < 1e-4


@pytest.mark.slow
def test_export_is_served_by_transformers(tmp_path):
  import torch
  from transformers import Qwen3ForCausalLM
  torch_model = _qwen3_dir(tmp_path / "src")
  model, _ = models.load_pretrained(str(tmp_path / "src"), dtype="float32")
  models.export_pretrained(model, str(tmp_path / "out"), source_dir=str(tmp_path / "src"),
                           max_shard_bytes=100_000)
  served = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
  ids = torch.tensor(np.random.RandomState(2).randint(0, 96, (1, 9)))
  with torch.no_grad():
    np.testing.assert_array_equal(served(ids).logits.numpy(), torch_model(ids).logits.numpy())


LLAMA_TO_LLADA = [("model.embed_tokens.", "model.transformer.wte."),
                  ("model.norm.", "model.transformer.ln_f."),
                  ("lm_head.", "model.transformer.ff_out."), ("model.layers.", "model.transformer.blocks."),
                  ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ff_norm"),
                  ("self_attn.o_proj", "attn_out"), ("self_attn.", ""), ("mlp.gate_proj", "ff_proj"),
                  ("mlp.up_proj", "up_proj"), ("mlp.down_proj", "ff_out")]


@pytest.mark.slow
def test_llada_parity_against_bidirectional_torch_llama(tmp_path):
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(1)
  lcfg = LlamaConfig(vocab_size=112, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, rope_theta=500000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=False)
  torch_model = LlamaForCausalLM(lcfg).eval()
  tensors = {}
  for name, value in torch_model.state_dict().items():
    for old, new in LLAMA_TO_LLADA:
      name = name.replace(old, new)
    tensors[name] = value.numpy()
  save_file(tensors, str(tmp_path / "model.safetensors"))
  # The field names of GSAI-ML/LLaDA-8B-Instruct's config.json, at tiny sizes.
  llada_config = {
      "activation_type": "silu", "alibi": False, "architectures": ["LLaDAModelLM"],
      "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                   "AutoModel": "modeling_llada.LLaDAModelLM"},
      "block_type": "llama", "d_model": 64, "embedding_size": 112, "eos_token_id": 100,
      "include_bias": False, "include_qkv_bias": False, "layer_norm_type": "rms",
      "mask_token_id": 111, "max_sequence_length": 4096, "mlp_hidden_size": 96, "mlp_ratio": 4,
      "model_type": "llada", "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "pad_token_id": 100,
      "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
      "vocab_size": 112, "weight_tying": False, "use_cache": False}
  json.dump(llada_config, open(tmp_path / "config.json", "w"))
  ids = np.random.RandomState(3).randint(0, 112, (2, 11))
  visible = torch.zeros(2, 1, 11, 11)  # additive 4-D mask of zeros: every token sees every token
  with torch.no_grad():
    expected = torch_model(torch.tensor(ids), attention_mask=visible).logits.numpy()
    causal = torch_model(torch.tensor(ids)).logits.numpy()
  assert np.abs(expected - causal).max() > 1e-2  # the torch reference really is bidirectional
  model, cfg = models.load_pretrained(str(tmp_path), dtype="float32")
  assert (cfg.family, cfg.mask_token_id, cfg.qk_norm) == ("llada", 111, False)
  got = np.asarray(logits(model, jnp.asarray(ids), attention="full"))
  assert np.abs(got - expected).max() < 1e-4


MEMORY_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])
    import jax, jax.numpy as jnp
    from stabledrl_jax import models

    def status(key):
      for line in open("/proc/self/status"):
        if line.startswith(key):
          return int(line.split()[1]) * 1024
    jax.device_put(jnp.ones(4)).block_until_ready()  # backend up before the baseline
    base = status("VmRSS")
    model, cfg = models.load_pretrained(sys.argv[1], dtype="float32")
    jax.block_until_ready(model.head.kernel[...])
    print(base, status("VmHWM"))
""")


@pytest.mark.slow
def test_streaming_load_peak_memory_below_1p5x_disk(tmp_path):
  cfg = models.tiny(vocab_size=16384, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=16,
                    head_dim=64, mlp_dim=4096)
  assert 2.9e8 < cfg.num_params < 3.2e8
  # Written with the safetensors library, one shard in memory at a time, four shards + index.
  specs = weights.weight_specs(cfg)
  abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
  shards = [specs[i::4] for i in range(4)]
  weight_map = {}
  for i, shard in enumerate(shards):
    file_name = f"model-{i + 1:05d}-of-00004.safetensors"
    tensors = {}
    for spec in shard:
      shape = tuple(weights.variable(abstract, spec.path).get_value().shape)
      tensors[spec.hf_name] = np.full(shape[::-1] if spec.transpose else shape, 0.01, np.float32)
      weight_map[spec.hf_name] = file_name
    save_file(tensors, str(tmp_path / file_name))
    del tensors
  json.dump({"metadata": {}, "weight_map": weight_map},
            open(tmp_path / "model.safetensors.index.json", "w"))
  json.dump(hf_config.config_to_hf(cfg), open(tmp_path / "config.json", "w"))
  disk = sum(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path))
  result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path), REPO],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
  base, peak = map(int, result.stdout.split()[-2:])
  ratio = (peak - base) / disk
  print(f"disk {disk / 2**20:.0f} MiB, peak RSS increase {(peak - base) / 2**20:.0f} MiB, "
        f"ratio {ratio:.2f}")
  assert ratio < 1.5


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _tokenizer_dir(path, special, template, generation_eos=None):
  from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
  vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz \n?")}
  vocab["[UNK]"] = len(vocab)
  tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  tok.add_special_tokens(special)
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  json.dump({"eos_token": special[0], "chat_template": template},
            open(os.path.join(path, "tokenizer_config.json"), "w"))
  if generation_eos is not None:
    json.dump({"eos_token_id": generation_eos},
              open(os.path.join(path, "generation_config.json"), "w"))
  return {t: len(vocab) + i for i, t in enumerate(special)}


def test_stop_ids_come_from_the_template_and_generation_config(tmp_path):
  ids = _tokenizer_dir(str(tmp_path), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], CHATML,
                       generation_eos=[7, 3])
  assert hf_tokenizer.end_of_turn_token(str(tmp_path)) == "<|im_end|>"
  got = hf_tokenizer.stop_token_ids(str(tmp_path), {"eos_token_id": ids["<|endoftext|>"]})
  assert got == (ids["<|endoftext|>"], 7, 3, ids["<|im_end|>"])


def test_llada_end_of_turn_is_found_after_the_assistant_message(tmp_path):
  template = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
              "\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
              "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}")
  ids = _tokenizer_dir(str(tmp_path), ["<|endoftext|>", "<|start_header_id|>",
                                       "<|end_header_id|>", "<|eot_id|>"], template)
  assert hf_tokenizer.stop_token_ids(str(tmp_path), {"eos_token_id": 5}) == (5, ids["<|eot_id|>"])


def test_diffucoders_padding_token_ends_the_answer(tmp_path):
  # DiffuCoder's examples split each generation at the first <|dlm_pad|>: it is a stop token
  # where the tokenizer has it, and absent from the others' stop tokens (the test above).
  ids = _tokenizer_dir(str(tmp_path), ["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                       "<|dlm_pad|>"], CHATML)
  got = hf_tokenizer.stop_token_ids(str(tmp_path), {"eos_token_id": ids["<|endoftext|>"]})
  assert got == (ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|dlm_pad|>"])
