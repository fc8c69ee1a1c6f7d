"""The user's path end to end, on tiny checkpoints in each family's real on-disk format.

Each family gets a directory laid out like its released chat checkpoint: LLaDA-8B-Instruct's
config.json keys and weight names (model_type "llada"), SDAR-8B-Chat's keys with Qwen3 weight
names (model_type "sdar"), or Dream-v0-Instruct-7B's keys with Qwen2 weight names and q/k/v
biases (model_type "Dream", with its generation_config.json); a byte-level BPE trained here on
GSM8K train text with the family's special tokens placed after the learned vocabulary (as in
the released tokenizers): a tokenizer.json, or for Dream vocab.json + merges.txt with the
special tokens only in tokenizer_config.json's `added_tokens_decoder`; and a
tokenizer_config.json whose chat template writes the released prompt layout. The commands then
run as a user runs them, in processes where importing torch or transformers fails: evaluate,
train with the family's checkpoint preset (`8b`, Dream's `7b`; only sizes and step counts
overridden), generate, export, and two reruns (a shape change is refused in one line; more RL
steps resume).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file
import tokenizers

from stabledrl_jax.tasks.tokenizer import QWEN2_PRETOKENIZE
from tests.models_dream_test import (DREAM_TEMPLATE, RELEASED_ADDED, RELEASED_CONFIG,
                                     RELEASED_GENERATION_CONFIG, REMOTE_CODE, dream_shapes)

REPO = Path(__file__).resolve().parents[1]
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"

LLADA_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>"]
SDAR_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
# The released prompt layouts: LLaDA-8B-Instruct (LLaMA-3 headers) and SDAR-8B-Chat (ChatML).
LLADA_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}")
SDAR_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
BLOCK_TORCH = (  # sitecustomize: the runtime must not lean on the test-only packages
    "import sys\n"
    "class _Blocked:\n"
    "  def find_spec(self, name, path=None, target=None):\n"
    "    if name.split('.')[0] in ('torch', 'transformers'):\n"
    "      raise ModuleNotFoundError(f'No module named {name!r} (blocked by the rehearsal)')\n"
    "sys.meta_path.insert(0, _Blocked())\n")


def _gsm8k_bpe(vocab: int, qwen2: bool = False):
  """A byte-level BPE trained on GSM8K train text (`qwen2`: with Qwen2's pre-tokenization)."""
  texts = []
  with open(GSM8K / "train.jsonl") as f:
    for _, line in zip(range(800), f):
      record = json.loads(line)
      texts += [record["question"], record["answer"]]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  if qwen2:
    tok.normalizer = tokenizers.normalizers.NFC()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
      vocab_size=vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  return tok


def train_tokenizer(out: Path, special: list[str], vocab: int = 1000) -> dict[str, int]:
  tok = _gsm8k_bpe(vocab)
  tok.add_special_tokens(special)
  tok.save(str(out / "tokenizer.json"))
  return {t: tok.token_to_id(t) for t in special}


def _write_weights(out: Path, shapes: dict[str, tuple], seed: int) -> None:
  rng = np.random.default_rng(seed)
  tensors = {n: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.05 * rng.standard_normal(s))
             .astype(np.float32) for n, s in shapes.items()}
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def make_llada(out: Path) -> dict:
  out.mkdir(parents=True)
  ids = train_tokenizer(out, LLADA_SPECIAL)
  vocab = 1024  # the embedding is larger than the tokenizer, as LLaDA's 126464 > 126349
  d, mlp, layers = 32, 64, 2
  config = {  # LLaDA-8B-Instruct's config.json keys at tiny sizes
      "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
      "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
      "attention_layer_norm_with_affine": True,
      "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                   "AutoModel": "modeling_llada.LLaDAModelLM",
                   "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
      "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": d,
      "embedding_dropout": 0.0, "embedding_size": vocab, "eos_token_id": ids["<|endoftext|>"],
      "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
      "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
      "layer_norm_type": "rms", "layer_norm_with_affine": True,
      "mask_token_id": ids["<|mdm_mask|>"], "max_sequence_length": 4096, "mlp_hidden_size": mlp,
      "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 2,
      "n_kv_heads": 2, "n_layers": layers, "pad_token_id": ids["<|endoftext|>"],
      "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05, "rope": True,
      "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
      "torch_dtype": "float32", "transformers_version": "4.46.3", "use_cache": False,
      "vocab_size": vocab, "weight_tying": False}
  (out / "config.json").write_text(json.dumps(config, indent=2))
  (out / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
      "chat_template": LLADA_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
  (out / "modeling_llada.py").write_text("# remote code of the released checkpoint\n")
  p = "model.transformer."
  shapes = {p + "wte.weight": (vocab, d), p + "ln_f.weight": (d,), p + "ff_out.weight": (vocab, d)}
  for i in range(layers):
    b = f"{p}blocks.{i}."
    shapes.update({b + "attn_norm.weight": (d,), b + "ff_norm.weight": (d,),
                   b + "q_proj.weight": (d, d), b + "k_proj.weight": (d, d),
                   b + "v_proj.weight": (d, d), b + "attn_out.weight": (d, d),
                   b + "ff_proj.weight": (mlp, d), b + "up_proj.weight": (mlp, d),
                   b + "ff_out.weight": (d, mlp)})
  _write_weights(out, shapes, 0)
  return {"stops": {ids["<|endoftext|>"], ids["<|eot_id|>"]}, "mask": ids["<|mdm_mask|>"]}


def make_sdar(out: Path) -> dict:
  out.mkdir(parents=True)
  ids = train_tokenizer(out, SDAR_SPECIAL)
  vocab, d, heads, kv, head_dim, mlp, layers = 1024, 32, 2, 1, 16, 64, 2
  config = {  # SDAR-8B-Chat's config.json keys at tiny sizes
      "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
      "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                   "AutoModel": "modeling_sdar.SDARModel",
                   "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
      "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"],
      "head_dim": head_dim, "hidden_act": "silu", "hidden_size": d, "initializer_range": 0.02,
      "intermediate_size": mlp, "max_position_embeddings": 32768, "max_window_layers": layers,
      "model_type": "sdar", "num_attention_heads": heads, "num_hidden_layers": layers,
      "num_key_value_heads": kv, "rms_norm_eps": 1e-06, "rope_scaling": None,
      "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
      "torch_dtype": "float32", "transformers_version": "4.52.4", "use_cache": True,
      "use_sliding_window": False, "vocab_size": vocab}
  (out / "config.json").write_text(json.dumps(config, indent=2))
  (out / "generation_config.json").write_text(json.dumps({
      "bos_token_id": ids["<|endoftext|>"],
      "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
  (out / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
      "mask_token": "<|MASK|>", "chat_template": SDAR_TEMPLATE,
      "tokenizer_class": "Qwen2Tokenizer"}))
  (out / "modeling_sdar.py").write_text("# remote code of the released checkpoint\n")
  shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,),
            "lm_head.weight": (vocab, d)}
  for i in range(layers):
    b = f"model.layers.{i}."
    shapes.update({b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
                   b + "self_attn.q_proj.weight": (heads * head_dim, d),
                   b + "self_attn.k_proj.weight": (kv * head_dim, d),
                   b + "self_attn.v_proj.weight": (kv * head_dim, d),
                   b + "self_attn.o_proj.weight": (d, heads * head_dim),
                   b + "self_attn.q_norm.weight": (head_dim,),
                   b + "self_attn.k_norm.weight": (head_dim,),
                   b + "mlp.gate_proj.weight": (mlp, d), b + "mlp.up_proj.weight": (mlp, d),
                   b + "mlp.down_proj.weight": (d, mlp)})
  _write_weights(out, shapes, 1)
  return {"stops": {ids["<|endoftext|>"], ids["<|im_end|>"]}, "mask": ids["<|MASK|>"]}


def make_dream(out: Path) -> dict:
  """Dream-v0-Instruct-7B's layout: vocab.json + merges.txt (no tokenizer.json), its added tokens
  (the released list, after the learned vocabulary) in tokenizer_config.json."""
  out.mkdir(parents=True)
  tok = _gsm8k_bpe(1000, qwen2=True)
  tok.model.save(str(out))
  n = tok.get_vocab_size()
  ids = {t: n + i for i, (t, _) in enumerate(RELEASED_ADDED)}
  vocab, d, heads, kv, mlp, layers = 1024, 32, 2, 1, 64, 2
  eot = ids["<|endoftext|>"]
  config = {**RELEASED_CONFIG, "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
            "mask_token_id": ids["<|mask|>"], "hidden_size": d, "intermediate_size": mlp,
            "max_window_layers": layers, "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": kv, "torch_dtype": "float32", "vocab_size": vocab}
  (out / "config.json").write_text(json.dumps(config, indent=2))
  (out / "generation_config.json").write_text(json.dumps({
      **RELEASED_GENERATION_CONFIG, "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}))
  (out / "tokenizer_config.json").write_text(json.dumps({
      "add_bos_token": False, "add_prefix_space": False,
      "added_tokens_decoder": {str(ids[t]): {"content": t, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": s}
                               for t, s in RELEASED_ADDED},
      "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
      "bos_token": "<|beginoftext|>", "chat_template": DREAM_TEMPLATE, "eos_token": "<|endoftext|>",
      "mask_token": "<|mask|>", "pad_token": "<|endoftext|>", "tokenizer_class": "DreamTokenizer",
      "unk_token": None}))
  for name in REMOTE_CODE:
    (out / name).write_text("# remote code of the released checkpoint\n")
  _write_weights(out, dream_shapes(d, heads, kv, mlp, layers, vocab), 2)
  return {"stops": {eot, ids["<|im_end|>"]}, "mask": ids["<|mask|>"]}


MAKE = {"llada": make_llada, "sdar": make_sdar, "dream": make_dream}
# The family's checkpoint preset, model_type and tokenizer files.
PRESET = {"llada": "8b", "sdar": "8b", "dream": "7b"}
MODEL_TYPE = {"llada": "llada", "sdar": "sdar", "dream": "Dream"}
TOKENIZER_FILES = {"llada": ("tokenizer.json",), "sdar": ("tokenizer.json",),
                   "dream": ("vocab.json", "merges.txt", "generation_config.json")}


def sizes(family: str) -> list[str]:
  """Overrides of sizes and step counts only: everything else is the 8b preset."""
  # Dream's template writes a default system message: longer prompts.
  prompt_len = 320 if family == "dream" else 256
  common = ["--config.sampler.gen_length=16", f"--config.task.max_prompt_len={prompt_len}",
            "--config.eval.batch_size=8"]
  if family == "llada":
    return common + ["--config.sampler.block_length=8", "--config.sampler.steps=4"]
  return common + ["--config.sampler.steps=2" if family == "sdar" else "--config.sampler.steps=4"]


@pytest.mark.slow
@pytest.mark.skipif(not (GSM8K / "train.jsonl").exists(), reason=f"public data absent: {GSM8K}")
@pytest.mark.parametrize("family", ["llada", "sdar"])  # Dream's commands: models_dream_test.py
def test_rehearsal(tmp_path, family):
  t0 = time.time()
  blocker = tmp_path / "blocker"
  blocker.mkdir()
  (blocker / "sitecustomize.py").write_text(BLOCK_TORCH)
  env = {**os.environ, "PYTHONPATH": str(blocker), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

  def run(module: str, *args: str, ok: bool = True) -> str:
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", f"stabledrl_jax.{module}", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    print(f"{family} {module}: {time.time() - start:.0f}s")
    return out

  ckpt = tmp_path / f"tiny-{family}"
  facts = MAKE[family](ckpt)
  preset = [f"--config=configs/{family}.py:{PRESET[family]}", f"--config.model.checkpoint={ckpt}",
            f"--config.task.source_dir={GSM8K}", f"--config.task.data_dir={tmp_path / 'tfds'}"]
  proc = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
  assert proc.returncode != 0  # the blocker works

  # evaluate the downloaded checkpoint on 16 GSM8K test examples
  out = run("evaluate", *preset, *sizes(family), "--max_examples=16",
            f"--output_dir={tmp_path / 'eval'}")
  rows = [json.loads(l) for l in open(tmp_path / "eval" / f"eval_tiny-{family}.jsonl")]
  assert len(rows) == 16 and set(rows[0]) >= {"prompt", "completions", "answers", "correct"}
  marker = {"llada": "<|startoftext|><|start_header_id|>user", "sdar": "<|im_start|>user\n",
            "dream": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                     "<|im_start|>user\n"}[family]
  assert rows[0]["prompt"].startswith(marker)
  assert "accuracy" in out and "pass@1" in out

  # train with the 8b preset
  work = tmp_path / "run"
  train_args = [*preset, *sizes(family), f"--workdir={work}", "--config.rl.steps=2",
                "--config.rl.prompts_per_step=2", "--config.rl.group_size=2",
                "--config.rl.accumulation=1", "--config.eval.num_examples=8"]
  run("main", *train_args)
  recorded = json.load(open(work / "config.json"))
  assert recorded["model"]["checkpoint"] == str(ckpt) and recorded["rl"]["steps"] == 2
  hf = json.load(open(work / "hf" / "config.json"))
  source = json.load(open(ckpt / "config.json"))
  assert hf["model_type"] == MODEL_TYPE[family] and set(source) <= set(hf)
  assert all((work / "hf" / n).exists() for n in (*TOKENIZER_FILES[family],
                                                  "tokenizer_config.json", f"modeling_{family}.py"))
  assert (work / "curves.png").exists()

  # generate from the trained run, through the chat template
  out = run("generate", f"--from_workdir={work}", "--prompt=What is 3 + 4?",
            "--prompt=Tom has 5 apples and eats 2. How many are left?", "--show_order")
  assert "### prompt 2:" in out and "### commit order 1:" in out

  # export, refuse to overwrite, load back
  run("export", f"--workdir={work}", f"--out={tmp_path / 'export'}")
  out = run("export", f"--workdir={work}", f"--out={tmp_path / 'export'}", ok=False)
  assert out.strip().splitlines()[-1].startswith("error: export target")
  check_export(family, work, tmp_path / "export", facts)

  # reruns: a shape change is refused before anything loads; more RL steps resume
  out = run("main", *train_args, "--config.model.d_model=48", ok=False)
  last = out.strip().splitlines()[-1]
  assert last.startswith("error:") and "model.d_model: 128 -> 48" in last, out[-2000:]
  out = run("main", *(a for a in train_args if a != "--config.rl.steps=2"), "--config.rl.steps=3")
  assert "config changed since the last run: rl.steps: 2 -> 3" in out and "resumed from" in out
  steps = [json.loads(l)["step"] for l in open(work / "metrics.jsonl")]
  assert sorted(set(steps)) == [0, 1, 2], steps
  final = [json.loads(l) for l in open(work / "eval.jsonl")][-1]
  assert (final["tag"], final["step"]) == ("after RL", 2)  # evaluated again after the extra step
  print(f"{family} rehearsal: {time.time() - t0:.0f}s")


def check_export(family: str, work: Path, exported: Path, facts: dict) -> None:
  from stabledrl_jax import cli, models, workdir_config
  c = workdir_config.get_config(str(work))
  c.model.compute_dtype = "float32"
  c.mesh.data, c.mesh.fsdp = -1, 1
  trained, _, _ = cli.load_policy(c, str(work))
  loaded, cfg = models.load_pretrained(str(exported), dtype="float32")
  assert set(cfg.stop_token_ids) == facts["stops"] and cfg.mask_token_id == facts["mask"]
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
  attention, block = ("block_causal", 1) if family == "sdar" else ("full", None)
  want = np.asarray(trained.logits(jnp.asarray(ids), attention=attention, block_size=block))
  got = np.asarray(loaded.logits(jnp.asarray(ids), attention=attention, block_size=block))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  if family == "sdar":  # SDAR's weights under a block size of 1 are Qwen3's causal LM
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    hf = json.load(open(exported / "config.json"))
    qwen = Qwen3ForCausalLM.from_pretrained(str(exported), config=Qwen3Config(**{
        k: v for k, v in hf.items() if k not in ("model_type", "architectures", "auto_map")}))
    with torch.no_grad():
      expected = qwen.eval()(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
