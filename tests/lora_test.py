"""LoRA adapters (stabledrl_jax.lora): the forward against float64 NumPy for every targeted
module, zero B is the base model, only adapters train, merge, sharding, PEFT's rules and errors
(fast); PEFT round trips against torch's `peft` on official-format tiny checkpoints (slow). In a
training run: the config keys, the SFT and RL updates, the KL reference, checkpoints, export
(fast), and resumed runs through the entry point (slow)."""
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import orbax.checkpoint as ocp
from flax import nnx
from safetensors.numpy import load_file, save_file

from stabledrl_jax import (build, checkpointing, config_lib, export, lora, models, objectives,
                           optim, peft_format, rl, rollouts, sft, sharding, train)
from stabledrl_jax.models import weights

_REHEARSAL = Path(__file__).resolve().parent / "rehearsal_test.py"
# Every linear layer of the family's official checkpoint, by PEFT name (LLaDA's `ff_out` also
# names the head; the Qwen-style head is `lm_head`).
ALL = {"llada": ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"),
       "sdar": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head")}


def tiny(family: str, **changes) -> models.ModelConfig:
  return models.tiny(**{**models.family_options(family), **changes})


def randomise(model, seed: int = 1, scale: float = 0.3) -> None:
  """Random A and B (a zero B would hide every product with A), where they were placed."""
  state = nnx.state(model, lora.ADAPTER)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  nnx.update(model, jax.tree.unflatten(treedef, [
      jax.device_put(scale * jax.random.normal(k, x.shape, x.dtype), x.sharding)
      for k, x in zip(keys, leaves)]))


def adapted(family: str, *, rank: int = 4, alpha: float = 6.0, seed: int = 0, **changes):
  model = models.create(tiny(family, **changes), seed=seed)
  lora.apply(model, lora.LoraConfig(rank=rank, alpha=alpha, targets=ALL[family]))
  randomise(model)
  return model


def params(model, what) -> dict:
  return {"/".join(map(str, sharding.path_keys(p))): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, what)))}


@functools.partial(nnx.jit, static_argnames=("attention", "block_size"))
def logits(model, ids, attention="full", block_size=None):
  return model.logits(ids, attention=attention, block_size=block_size)


def attention_of(family: str) -> dict:
  return {"attention": "full"} if family == "llada" else {"attention": "block_causal",
                                                          "block_size": 4}


# ----------------------------------------------------------------------------- the forward


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_every_targeted_module_computes_wx_plus_scaled_bax_float64(family):
  model = adapted(family, rank=4, alpha=6.0)
  found = lora.adapters(model)
  n_layers = model.config.n_layers
  assert len(found) == 7 * n_layers + 1  # every block's seven projections and the head
  head = "model.transformer.ff_out" if family == "llada" else "lm_head"
  assert head in found  # LLaDA: `ff_out` selects the head as PEFT's suffix rule does
  rng = np.random.default_rng(0)
  for name, path in lora.linear_modules(model.config).items():
    linear = weights.variable(model, path)
    w = np.asarray(linear.kernel[...], np.float64)  # [D_in, D_out]
    a = np.asarray(found[name].lora_a[...], np.float64)  # [D_in, r]
    b = np.asarray(found[name].lora_b[...], np.float64)  # [r, D_out]
    x = rng.standard_normal((6, w.shape[0]))
    want = x @ w + (6.0 / 4) * (x @ a) @ b  # (W x + (α/r) B A x), rows as vectors
    if path == ("head",):
      got = model.head_logits(jnp.asarray(x[None], jnp.float32))[0]
    else:
      got = linear(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_zero_b_gives_the_base_model_exactly(family):
  cfg = tiny(family)
  base = models.create(cfg, seed=3)
  model = models.create(cfg, seed=3)
  lora.apply(model, lora.LoraConfig(rank=4, alpha=16, targets=ALL[family]))
  assert lora.num_params(model) > 0
  ids = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
  kw = attention_of(family)
  # Op by op, x W + 0 is x W to the bit; a compiled program may fuse the two differently.
  np.testing.assert_array_equal(np.asarray(model.logits(ids, **kw)),
                                np.asarray(base.logits(ids, **kw)))
  np.testing.assert_allclose(np.asarray(logits(model, ids, **kw)),
                             np.asarray(logits(base, ids, **kw)), rtol=0, atol=1e-6)
  if family == "sdar":
    np.testing.assert_array_equal(np.asarray(model.staircase_logits(ids, ids)),
                                  np.asarray(base.staircase_logits(ids, ids)))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_every_entry_point_sees_the_adapters_and_merge_equals_them(family):
  model = adapted(family)
  ids = jax.random.randint(jax.random.key(1), (2, 8), 0, model.config.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
  merged = lora.merge(nnx.clone(model))
  assert lora.adapters(merged) == {} and merged.blocks[0].attn.q_proj.kernel[...].dtype == jnp.float32
  outs = lambda m: [m.logits(ids, **attention_of(family)),
                    m.head_logits(m.forward_kv(ids, positions_BxT=pos, valid_BxT=pos >= 0)[0])]
  if family == "sdar":
    outs_sdar = outs
    outs = lambda m: outs_sdar(m) + [m.staircase_logits(ids, ids), m.cached_logits(
        ids, m.init_cache(2, 16), positions_BxT=pos, commit=True)[0]]
  base = models.create(model.config, seed=0)
  for got, want, plain in zip(outs(model), outs(merged), outs(base)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    assert np.abs(np.asarray(got) - np.asarray(plain)).max() > 1e-2  # the adapters act


def test_dropout_acts_only_while_a_key_is_set():
  model = models.create(tiny("sdar"), seed=0)
  lora.apply(model, lora.LoraConfig(rank=4, alpha=4, dropout=0.5, targets=("q_proj",)))
  randomise(model)
  q = model.blocks[0].attn.q_proj
  x = jax.random.normal(jax.random.key(2), (16, 64))
  plain = np.asarray(q(x))
  lora.set_dropout_key(model, jax.random.key(5))
  dropped = np.asarray(q(x))
  np.testing.assert_array_equal(dropped, np.asarray(q(x)))  # one key, one mask
  assert np.abs(dropped - plain).max() > 1e-3
  lora.set_dropout_key(model, None)
  np.testing.assert_array_equal(np.asarray(q(x)), plain)


# ----------------------------------------------------------------------------- training


def _optim_config():
  return ml_collections.ConfigDict(dict(decay_steps=0, moment_dtype="float32", b1=0.9, b2=0.999,
                                        weight_decay=0.01, grad_clip=1.0))


@nnx.jit(donate_argnames=("model", "optimizer"))
def _step(model, optimizer, ids):
  def loss_fn(m):
    logp = jax.nn.log_softmax(m.logits(ids, attention="block_causal", block_size=4))
    return -jnp.mean(jnp.take_along_axis(logp, ids[..., None], axis=-1))
  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, lora.ADAPTER))(model)
  return loss, optim.apply(model, optimizer, grads)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_only_adapters_change_and_the_optimiser_holds_only_them(param_dtype):
  model = models.create(tiny("sdar", param_dtype=param_dtype), seed=0)
  lora.apply(model, lora.LoraConfig(rank=4, alpha=8, targets=ALL["sdar"]))
  assert lora.trainable(model) is lora.ADAPTER
  optimizer = nnx.Optimizer(model, optim.make_optimizer(1e-2, 0, 10, _optim_config()),
                            wrt=lora.trainable(model))
  base_before = params(model, nnx.Not(lora.ADAPTER))
  adapters_before = params(model, lora.ADAPTER)
  ids = jax.random.randint(jax.random.key(0), (4, 16), 0, model.config.vocab_size)
  for _ in range(2):
    loss, out = _step(model, optimizer, ids)
  assert np.isfinite(float(loss)) and not bool(out["skipped"])
  base_after, adapters_after = params(model, nnx.Not(lora.ADAPTER)), params(model, lora.ADAPTER)
  assert set(base_after) == set(base_before)
  for name, value in base_before.items():
    np.testing.assert_array_equal(base_after[name], value, err_msg=name)
    if name.endswith("kernel"):
      assert value.dtype == np.dtype(param_dtype)
  assert all(v.dtype == np.float32 for v in adapters_after.values())
  changed = [n for n, v in adapters_before.items() if np.abs(adapters_after[n] - v).max() > 0]
  assert any(n.endswith("lora_b") for n in changed) and any(n.endswith("lora_a") for n in changed)
  # Adam's two moments per adapter parameter; every other leaf of the state is a scalar.
  moments = [x for x in jax.tree.leaves(nnx.state(optimizer, nnx.OptState)) if np.ndim(x)]
  n = lora.num_params(model)
  assert sum(int(np.prod(np.shape(x))) for x in moments) == 2 * n
  assert n == 4 * sum(sum(k.shape) for k in (
      weights.variable(model, p).kernel[...] for p in lora.linear_modules(model.config).values()))


def _assert_split_like_kernels(model) -> None:
  for name, adapter in lora.adapters(model).items():
    kernel = weights.variable(model, lora.linear_modules(model.config)[name]).kernel[...]
    spec = tuple(kernel.sharding.spec) + (None,) * 2
    assert tuple(adapter.lora_a[...].sharding.spec)[:1] in ((spec[0],), ()), name
    assert (tuple(adapter.lora_b[...].sharding.spec) + (None,))[1] == spec[1], name


def test_adapters_are_sharded_like_their_kernel():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  model = sharding.create_model(tiny("llada", n_kv_heads=4), 0, mesh)
  lora.apply(model, lora.LoraConfig(rank=4, alpha=8, targets=ALL["llada"]))
  randomise(model)
  _assert_split_like_kernels(model)
  assert model.blocks[0].attn.q_proj.adapter.lora_b[...].sharding.spec[1] == "tensor"
  copy = sharding.resharded(model, sharding.make_mesh({"fsdp": 8}))  # param_shardings' rules
  _assert_split_like_kernels(copy)
  assert copy.blocks[0].attn.q_proj.adapter.lora_a[...].sharding.spec[0] == "fsdp"
  ids = jax.random.randint(jax.random.key(0), (8, 8), 0, model.config.vocab_size)
  np.testing.assert_allclose(np.asarray(logits(copy, ids)), np.asarray(logits(model, ids)),
                             rtol=1e-4, atol=1e-4)  # another reduction order over the devices


# ----------------------------------------------------------------------------- PEFT's rules


def test_targets_follow_peft_matching():
  cfg = tiny("llada")
  blocks = [f"model.transformer.blocks.{i}.ff_out" for i in range(cfg.n_layers)]
  assert sorted(lora.select(cfg, ("ff_out",))) == sorted(blocks + ["model.transformer.ff_out"])
  assert sorted(lora.select(cfg, r".*blocks\.\d+\.ff_out")) == blocks  # a string: full match
  assert "model.transformer.ff_out" not in lora.select(cfg, "all-linear")
  assert len(lora.select(cfg, "all-linear")) == 7 * cfg.n_layers
  with pytest.raises(lora.AdapterError, match="lora target 'o_proj' selects no module of family "
                     "'llada'"):
    lora.select(cfg, ("q_proj", "o_proj"))
  assert sorted(lora.select(cfg, ("q_proj", "o_proj"), strict=False)) == [
      f"model.transformer.blocks.{i}.q_proj" for i in range(cfg.n_layers)]
  # d1's diffu-GRPO list (Qwen/LLaMA names) on LLaDA: PEFT adapts q, k, v and up_proj only.
  d1 = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj")
  assert {n.rsplit(".", 1)[-1] for n in lora.select(cfg, d1, strict=False)} == {
      "q_proj", "k_proj", "v_proj", "up_proj"}
  model = models.create(cfg)
  lora.apply(model, lora.LoraConfig(rank=2, alpha=4, targets=r".*blocks\.1\.(q_proj|ff_out)"))
  targets = lora.config_of(model).targets  # no list of names selects exactly these
  assert set(lora.select(cfg, targets)) == {"model.transformer.blocks.1.q_proj",
                                            "model.transformer.blocks.1.ff_out"}


def test_peft_config_options_that_change_the_math_are_refused():
  good = peft_format.peft_config(lora.LoraConfig(rank=8, alpha=16, dropout=0.05,
                                          targets=("v_proj", "q_proj")), "org/base")
  assert (good["r"], good["lora_alpha"], good["target_modules"]) == (8, 16, ["q_proj", "v_proj"])
  assert peft_format.config_from_peft(good) == lora.LoraConfig(8, 16.0, 0.05, targets=("q_proj", "v_proj"))
  for key, value in (("use_dora", True), ("use_rslora", True), ("bias", "all"),
                     ("layers_to_transform", [0]), ("rank_pattern", {"q_proj": 4})):
    with pytest.raises(lora.AdapterError, match=f"adapter_config.json {key}=.* is not supported"):
      peft_format.config_from_peft({**good, key: value})
  with pytest.raises(lora.AdapterError, match="peft_type='PREFIX_TUNING'"):
    peft_format.config_from_peft({**good, "peft_type": "PREFIX_TUNING"})


def test_export_load_round_trip_and_errors_name_the_tensor(tmp_path):
  model = adapted("llada", rank=4, alpha=8.0)
  out = str(tmp_path / "adapter")
  peft_format.export_peft(model, out, base_model_name_or_path="GSAI-ML/LLaDA-8B-Instruct")
  config = json.load(open(os.path.join(out, "adapter_config.json")))
  assert config["target_modules"] == sorted(ALL["llada"]) and config["peft_type"] == "LORA"
  tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
  head = "base_model.model.model.transformer.ff_out"
  assert tensors[head + ".lora_A.weight"].shape == (4, 64)
  assert tensors[head + ".lora_B.weight"].shape == (model.config.vocab_size, 4)
  fresh = models.create(model.config, seed=0)
  assert peft_format.load_peft(fresh, out) == lora.config_of(model)
  for name, value in params(model, lora.ADAPTER).items():
    np.testing.assert_array_equal(params(fresh, lora.ADAPTER)[name], value)
  path = os.path.join(out, "adapter_model.safetensors")
  stray = "base_model.model.model.transformer.wte.lora_embedding_A"
  save_file({**tensors, stray: np.zeros((4, 128), np.float32)}, path)
  with pytest.raises(lora.AdapterError, match=f"adapter tensor '{stray}' .* names no adapted "
                     "module or weight"):
    peft_format.load_peft(models.create(model.config), out)
  missing = head + ".lora_B.weight"
  save_file({k: v for k, v in tensors.items() if k != missing}, path)
  with pytest.raises(lora.AdapterError, match=f"adapter tensor '{missing}' is missing"):
    peft_format.load_peft(models.create(model.config), out)
  save_file({**tensors, missing: np.zeros((5, 4), np.float32)}, path)
  with pytest.raises(lora.AdapterError, match=rf"'{missing}' has shape \(5, 4\), expected "
                     rf"\({model.config.vocab_size}, 4\)"):
    peft_format.load_peft(models.create(model.config), out)


# ----------------------------------------------------------------------------- slow: torch peft


def _rehearsal():
  spec = importlib.util.spec_from_file_location("rehearsal_for_lora", _REHEARSAL)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not (module.GSM8K / "train.jsonl").exists():
    pytest.skip(f"public data absent: {module.GSM8K}")
  return module


def _random_lora(peft_model, seed: int) -> None:
  import torch
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if "lora_" in name:
        p.normal_(0.0, 0.2)


def _sdar_torch(ckpt: Path):
  """SDAR's weights as transformers' Qwen3 (its architecture; block size 1 is causal)."""
  from transformers import Qwen3Config, Qwen3ForCausalLM
  hf = json.load(open(ckpt / "config.json"))
  keep = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "auto_map")}
  return Qwen3ForCausalLM.from_pretrained(str(ckpt), config=Qwen3Config(**keep)).eval()


@pytest.mark.slow
def test_peft_round_trip_sdar_official_format(tmp_path):
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  ckpt = tmp_path / "tiny-sdar"
  _rehearsal().make_sdar(ckpt)
  config = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=0.05, task_type="CAUSAL_LM",
                           target_modules=list(ALL["sdar"]))
  made = peft.get_peft_model(_sdar_torch(ckpt), config)
  _random_lora(made, 0)
  made.save_pretrained(str(tmp_path / "theirs"))
  ids = np.random.default_rng(0).integers(0, 1000, (2, 11))
  with torch.no_grad():
    want = made.eval()(torch.tensor(ids)).logits.numpy()
  model, _ = models.load_pretrained(str(ckpt), dtype="float32")
  assert set(peft_format.load_peft(model, str(tmp_path / "theirs")).targets) == set(ALL["sdar"])
  assert len(lora.adapters(model)) == 7 * model.config.n_layers + 1
  got = np.asarray(logits(model, jnp.asarray(ids), attention="block_causal", block_size=1))
  assert np.abs(got - want).max() < 1e-4
  peft_format.export_peft(model, str(tmp_path / "ours"), base_model_name_or_path=str(ckpt))
  ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
  theirs = load_file(str(tmp_path / "theirs" / "adapter_model.safetensors"))
  assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
  assert "base_model.model.lm_head.base_layer.weight" in ours  # PEFT saves a targeted head whole
  served = peft.PeftModel.from_pretrained(_sdar_torch(ckpt), str(tmp_path / "ours")).eval()
  with torch.no_grad():
    back = served(torch.tensor(ids)).logits.numpy()
  assert np.abs(back - want).max() < 1e-5


LLADA_TO_LLAMA = [("model.transformer.wte.", "model.embed_tokens."),
                  ("model.transformer.ln_f.", "model.norm."),
                  ("model.transformer.ff_out.", "lm_head."),
                  ("model.transformer.blocks.", "model.layers."),
                  ("attn_norm", "input_layernorm"), ("ff_norm", "post_attention_layernorm"),
                  ("attn_out", "self_attn.o_proj"), ("q_proj", "self_attn.q_proj"),
                  ("k_proj", "self_attn.k_proj"), ("v_proj", "self_attn.v_proj"),
                  ("ff_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj"),
                  ("ff_out", "mlp.down_proj")]


def _llada_modules(hf: dict):
  """A torch module tree with LLaDA-8B-Instruct's module names (LLaDAModelLM.model.transformer:
  wte, blocks.i.{q,k,v}_proj, attn_out, ff_proj, up_proj, ff_out, the norms, ln_f, ff_out): what
  PEFT walks on the official model; its forward is not needed (the math is checked through
  LLaMA below)."""
  import torch
  d, mlp, vocab = hf["d_model"], hf["mlp_hidden_size"], hf["embedding_size"]
  kv = d // hf["n_heads"] * hf["n_kv_heads"]

  def block():
    b = torch.nn.Module()
    for name, (i, o) in dict(q_proj=(d, d), k_proj=(d, kv), v_proj=(d, kv), attn_out=(d, d),
                             ff_proj=(d, mlp), up_proj=(d, mlp), ff_out=(mlp, d)).items():
      setattr(b, name, torch.nn.Linear(i, o, bias=False))
    b.attn_norm, b.ff_norm = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
    return b

  root = torch.nn.Module()
  root.prepare_inputs_for_generation = None  # PEFT's CAUSAL_LM wrapper looks it up
  root.model = torch.nn.Module()
  root.model.transformer = torch.nn.ModuleDict(dict(
      wte=torch.nn.Embedding(vocab, d), blocks=torch.nn.ModuleList(
          [block() for _ in range(hf["n_layers"])]),
      ln_f=torch.nn.RMSNorm(d), ff_out=torch.nn.Linear(d, vocab, bias=False)))
  return root


def _llama_logits(state: dict, hf: dict, ids: np.ndarray) -> np.ndarray:
  """Bidirectional LLaMA logits (LLaDA's architecture) of LLaDA-named weights."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  renamed = {}
  for name, value in state.items():
    for old, new in LLADA_TO_LLAMA:
      name = name.replace(old, new)
    renamed[name] = value
  llama = LlamaForCausalLM(LlamaConfig(
      vocab_size=hf["embedding_size"], hidden_size=hf["d_model"],
      intermediate_size=hf["mlp_hidden_size"], num_hidden_layers=hf["n_layers"],
      num_attention_heads=hf["n_heads"], num_key_value_heads=hf["n_kv_heads"],
      rope_theta=hf["rope_theta"], rms_norm_eps=hf["rms_norm_eps"],
      tie_word_embeddings=False)).eval()
  llama.load_state_dict(renamed, strict=True)
  visible = torch.zeros(ids.shape[0], 1, ids.shape[1], ids.shape[1])
  with torch.no_grad():
    return llama(torch.tensor(ids), attention_mask=visible).logits.numpy()


def _merged_state(peft_model) -> dict:
  import torch
  with torch.no_grad():
    return {k: v.clone() for k, v in peft_model.merge_and_unload().state_dict().items()}


@pytest.mark.slow
def test_peft_round_trip_llada_official_format(tmp_path):
  import torch
  peft = pytest.importorskip("peft")
  ckpt = tmp_path / "tiny-llada"
  _rehearsal().make_llada(ckpt)
  hf = json.load(open(ckpt / "config.json"))
  base = {k: torch.tensor(v) for k, v in load_file(str(ckpt / "model.safetensors")).items()}

  def official():
    tree = _llada_modules(hf)
    tree.load_state_dict(base, strict=True)  # the tree's names are the checkpoint's
    return tree

  made = peft.get_peft_model(official(), peft.LoraConfig(
      r=4, lora_alpha=8, lora_dropout=0.05, target_modules=list(ALL["llada"])))
  _random_lora(made, 1)
  made.save_pretrained(str(tmp_path / "theirs"))
  theirs = load_file(str(tmp_path / "theirs" / "adapter_model.safetensors"))
  assert "base_model.model.model.transformer.ff_out.lora_B.weight" in theirs  # the head too
  ids = np.random.default_rng(1).integers(0, 1000, (2, 11))
  want = _llama_logits(_merged_state(made), hf, ids)

  model, _ = models.load_pretrained(str(ckpt), dtype="float32")
  peft_format.load_peft(model, str(tmp_path / "theirs"))
  got = np.asarray(logits(model, jnp.asarray(ids), attention="full"))
  assert np.abs(got - want).max() < 1e-4
  peft_format.export_peft(model, str(tmp_path / "ours"), base_model_name_or_path=str(ckpt))
  ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
  assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
  served = peft.PeftModel.from_pretrained(official(), str(tmp_path / "ours"))
  back = _llama_logits(_merged_state(served), hf, ids)
  assert np.abs(back - want).max() < 1e-5


def test_whole_weights_peft_saves_beside_the_adapters_replace_the_models(tmp_path):
  model = adapted("sdar", rank=2, alpha=2.0)
  out = str(tmp_path / "adapter")
  peft_format.export_peft(model, out)
  path = os.path.join(out, "adapter_model.safetensors")
  tensors = load_file(path)
  head = "base_model.model.lm_head.base_layer.weight"
  np.testing.assert_array_equal(tensors[head], np.asarray(model.head.kernel[...]).T)
  tensors[head] = tensors[head] + 1.0
  save_file(tensors, path)
  fresh = models.create(model.config, seed=0)
  peft_format.load_peft(fresh, out)
  np.testing.assert_array_equal(np.asarray(fresh.head.kernel[...]), tensors[head].T)
  resized = "base_model.model.model.embed_tokens.weight"  # a vocabulary grown in training
  save_file({**tensors, resized: np.zeros((130, 64), np.float32)}, path)
  with pytest.raises(lora.AdapterError, match=rf"'{resized}' has shape \(130, 64\), expected "
                     r"\(128, 64\)"):
    peft_format.load_peft(models.create(model.config), out)


# ----------------------------------------------------------------------------- in a training run


def run_config(family: str, **lora_keys) -> ml_collections.ConfigDict:
  """The family's smoke config with `model.lora` keys set."""
  c = config_lib.base_config(family)
  config_lib.apply_preset(c, "smoke")
  for key, value in lora_keys.items():
    c.model.lora[key] = value
  return c


def _seqs(c, model, rows: int = 4):
  """Teacher-forced sequences of random prompts and completions in the family's layout."""
  rng = np.random.default_rng(0)
  vocab = model.config.vocab_size
  prompts = jnp.asarray(rng.integers(4, vocab, size=(rows, 4)), jnp.int32)
  completions = jnp.asarray(rng.integers(4, vocab, size=(rows, 8)), jnp.int32)
  return rollouts.teacher_forced(prompts, jnp.ones((rows, 4), bool), completions, family=c.family,
                                 block_size=c.sampler.block_length, mask_id=model.config.mask_token_id)


def _objective(c) -> objectives.Objective:
  return dataclasses.replace(objectives.Objective.from_config(c), group_size=2)


def _moment_size(optimizer) -> int:
  return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(nnx.state(optimizer, nnx.OptState))
             if np.ndim(x))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_sft_and_rl_updates_change_only_the_adapters_with_dropout_in_the_update_alone(family):
  c = run_config(family, rank=4, dropout=0.25)
  c.sft.warmup_steps = 0  # a first step that moves
  model = build.model(c, build.tokenizer(c))
  seqs, adv_B = _seqs(c, model), jnp.array([1.0, -1.0, 0.5, -0.5])
  base = params(model, nnx.Not(lora.ADAPTER))
  s, obj = sft.Settings.from_config(c), _objective(c)
  for stage in ("sft", "rl"):
    optimizer = optim.stage_optimizer(model, c, stage)
    assert _moment_size(optimizer) == 2 * lora.num_params(model)  # Adam's two moments, adapters'
    before = params(model, lora.ADAPTER)
    if stage == "sft":
      args = dict(scheme=s.scheme, staircase=s.staircase, block_size=s.block_size)
      step = lambda m, o: sft.update(m, o, seqs, jax.random.key(1), **args)
    else:
      batch, _ = rl.behaviour_pass(model, None, seqs, adv_B, jax.random.key(2), obj)
      step = lambda m, o: rl.update(m, o, batch, jax.random.key(3), obj=obj, accumulation=2)
    undropped = train.copy_module(model), train.copy_module(optimizer)
    for adapter in lora.adapters(undropped[0]).values():
      adapter.dropout = 0.0
    out, plain = step(model, optimizer), step(*undropped)
    assert np.isfinite(float(out["loss"])) and not bool(out["skipped"]) and out["grad_norm"] > 0
    assert float(out["grad_norm"]) != float(plain["grad_norm"])  # the update's policy pass drops
    after = params(model, lora.ADAPTER)
    assert any(np.abs(after[n] - before[n]).max() > 0 for n in after if n.endswith("lora_b"))
    for name, value in params(model, nnx.Not(lora.ADAPTER)).items():
      np.testing.assert_array_equal(value, base[name], err_msg=name)  # the base, bit for bit
    assert all(a.dropout_key is None for a in lora.adapters(model).values())  # no dropout outside


def test_a_sharded_lora_run_trains_as_an_unsharded_one():
  c = run_config("sdar", rank=4)
  c.sft.warmup_steps = 0
  s = sft.Settings.from_config(c)
  out = {}
  for sizes in (None, {"fsdp": 4, "tensor": 2}):
    mesh = None if sizes is None else sharding.make_mesh(sizes)
    model = build.model(c, build.tokenizer(c), mesh)
    optimizer = optim.stage_optimizer(model, c, "sft")
    seqs = _seqs(c, model, rows=8)
    if mesh is not None:
      seqs = sharding.shard_batch(seqs, mesh)
      a = model.blocks[0].up_proj.adapter.lora_b[...]
      assert a.sharding.spec[1] == "tensor" and len(a.sharding.device_set) == 8
    for k in range(2):
      sft.update(model, optimizer, seqs, jax.random.key(k), scheme=s.scheme,
                 staircase=s.staircase, block_size=s.block_size)
    out[str(sizes)] = params(model, lora.ADAPTER)
  want, got = out.values()
  for name, value in want.items():  # the sharded base is initialised to float rounding
    np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_kl_reference_is_the_rl_start_adapters_on_the_shared_frozen_base(tmp_path):
  c = run_config("sdar", rank=4)
  model = build.model(c, build.tokenizer(c))
  randomise(model, scale=0.05)
  seqs, adv_B, obj = _seqs(c, model), jnp.array([1.0, -1.0, 0.5, -0.5]), _objective(c)
  ref = train.reference_model(model, str(tmp_path / "reference"), fresh=True)
  assert isinstance(ref, nnx.State)  # the adapters alone: no second copy of the base
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ref)) == lora.num_params(model)
  start, _ = rl.behaviour_pass(model, train.copy_module(model), seqs, adv_B, jax.random.key(1), obj)
  shared, _ = rl.behaviour_pass(model, ref, seqs, adv_B, jax.random.key(1), obj)
  np.testing.assert_array_equal(np.asarray(shared.logp_ref_BxMxL), np.asarray(start.logp_old_BxMxL))
  optimizer = optim.stage_optimizer(model, c, "rl")
  for k in range(2):  # the updates donate the model's buffers, base included
    rl.update(model, optimizer, shared, jax.random.key(2 + k), obj=obj, accumulation=1)
  moved, _ = rl.behaviour_pass(model, ref, seqs, adv_B, jax.random.key(1), obj)
  np.testing.assert_allclose(np.asarray(moved.logp_ref_BxMxL), np.asarray(start.logp_old_BxMxL),
                             rtol=0, atol=1e-6)  # still the RL-start policy
  assert np.abs(np.asarray(moved.logp_old_BxMxL - start.logp_old_BxMxL)).max() > 1e-4
  resumed = train.reference_model(model, str(tmp_path / "reference"), fresh=False)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(resumed), nnx.to_pure_dict(ref))


def test_a_checkpoint_holds_the_adapters_alone_and_restores_onto_the_rebuilt_base(tmp_path):
  c = run_config("llada", rank=4)
  model = build.model(c, build.tokenizer(c))
  randomise(model)
  optimizer = optim.stage_optimizer(model, c, "rl")
  optimizer.update(model, jax.tree.map(lambda p: jnp.full_like(p, 0.1), nnx.state(model, lora.ADAPTER)))
  ckpt = checkpointing.Checkpointer(str(tmp_path), keep=1)
  ckpt.save(3, model, optimizer, {"stage": "rl"})
  ckpt.wait()
  for item in ("model", "optimizer"):
    saved = ocp.StandardCheckpointer().restore(str(tmp_path / "3" / item))
    arrays = ["/".join(map(str, sharding.path_keys(p))) for p, x in
              jax.tree_util.tree_leaves_with_path(saved) if np.ndim(x)]
    assert arrays and all(a.endswith(("lora_a", "lora_b")) for a in arrays), (item, arrays)
  assert len(arrays) == 2 * 2 * len(lora.adapters(model))  # Adam's mu and nu of each A and B
  rebuilt = build.model(c, build.tokenizer(c))  # base from the seed, fresh adapters
  rebuilt_optimizer = optim.stage_optimizer(rebuilt, c, "rl")
  ckpt.restore(3, rebuilt, rebuilt_optimizer)
  ckpt.close()
  want, got = params(model, nnx.Param), params(rebuilt, nnx.Param)
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(optimizer)),
               nnx.to_pure_dict(nnx.state(rebuilt_optimizer)))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_export_writes_the_merged_model_and_the_adapter_alone(family, tmp_path):
  c = run_config(family, rank=4)
  tokenizer = build.tokenizer(c)
  model = build.model(c, tokenizer)
  randomise(model, scale=0.05)
  out = export.export(c, model, str(tmp_path / "hf"))
  assert lora.adapters(model)  # the model keeps its adapters
  ids = jax.random.randint(jax.random.key(0), (2, 12), 0, model.config.vocab_size)
  kw = attention_of(family)
  want = np.asarray(logits(model, ids, **kw))
  merged, _ = models.load_pretrained(out, dtype="float32")
  assert not lora.adapters(merged)
  np.testing.assert_allclose(np.asarray(logits(merged, ids, **kw)), want, rtol=1e-5, atol=1e-5)
  adapter_dir = export.adapter_dir(out)
  assert adapter_dir == str(tmp_path / "hf_adapter")
  peft = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
  assert (peft["r"], peft["lora_alpha"], peft["base_model_name_or_path"]) == (4, 16, None)
  base = build.base_model(c, tokenizer)
  assert set(lora.select(base.config, peft_format.load_peft(base, adapter_dir).targets)) == set(
      lora.adapters(model))
  np.testing.assert_allclose(np.asarray(logits(base, ids, **kw)), want, rtol=1e-6, atol=1e-6)


def test_export_pretrained_refuses_adapters_and_writes_them_merged(tmp_path):
  model = adapted("sdar")
  ids = jax.random.randint(jax.random.key(0), (2, 12), 0, model.config.vocab_size)
  kw = attention_of("sdar")
  base = np.asarray(logits(models.create(tiny("sdar"), seed=0), ids, **kw))
  want = np.asarray(logits(model, ids, **kw))
  assert np.abs(want - base).max() > 0.1  # the adapters matter far above the tolerance below
  with pytest.raises(models.ExportError, match="LoRA adapters"):  # never the base alone
    models.export_pretrained(model, str(tmp_path / "hf"))
  assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
  models.export_pretrained(lora.merge(nnx.clone(model)), str(tmp_path / "hf"))
  assert lora.adapters(model)  # the caller's model keeps them
  loaded, _ = models.load_pretrained(str(tmp_path / "hf"), dtype="float32")
  np.testing.assert_allclose(np.asarray(logits(loaded, ids, **kw)), want, rtol=1e-4, atol=1e-4)


def test_lora_init_starts_from_a_peft_adapter_and_a_disagreeing_rank_is_named(tmp_path):
  c = run_config("llada", rank=4, alpha=8.0, targets="q_proj,v_proj")
  model = build.model(c, build.tokenizer(c))
  randomise(model)
  adapter = str(tmp_path / "adapter")
  peft_format.export_peft(model, adapter)
  started = run_config("llada")
  started.model.lora_init = adapter  # rank 0: the adapter's settings
  assert build.settings(started).lora == lora.LoraConfig(4, 8.0, 0.0, targets=("q_proj", "v_proj"))
  got, want = params(build.model(started, build.tokenizer(c)), nnx.Param), params(model, nnx.Param)
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  for key, value, peft_key in (("rank", 8, "r=4"), ("alpha", 16.0, "lora_alpha=8.0"),
                               ("targets", "q_proj", "target_modules=('q_proj', 'v_proj')")):
    bad = run_config("llada", rank=4, alpha=8.0)
    bad.model.lora[key], bad.model.lora_init = value, adapter
    with pytest.raises(ValueError, match=rf"^config\.model\.lora\.{key}={value!r} disagrees with "
                       rf"config\.model\.lora_init='{adapter}' \({re.escape(peft_key)} in its "
                       r"adapter_config\.json\)"):
      build.settings(bad)


@pytest.mark.parametrize("key,value,why", [
    ("lora.rank", -1, "must be >= 0"), ("lora.alpha", 0.0, "must be a finite number > 0"),
    ("lora.dropout", 1.0, r"must lie in \[0, 1\)"), ("lora.targets", "q_proj;v_proj", ".* is not a module name"),
    ("lora_init", "/nonexistent/adapter", "no such directory"),
])
def test_bad_lora_keys_are_named_in_one_line(key, value, why):
  c = run_config("sdar")
  if key == "lora_init":
    c.model.lora_init = value
  else:
    c.model.lora[key.split(".")[1]] = value
  with pytest.raises(ValueError, match=rf"^config\.model\.{re.escape(key)}={re.escape(repr(value))}: "
                     f"{why}") as e:
    build.settings(c)
  assert "\n" not in str(e.value)
  c = run_config("llada", rank=4, targets="o_proj,gate_proj")  # no module of LLaDA's has these
  with pytest.raises(ValueError, match=r"^config\.model\.lora\.targets='o_proj,gate_proj': lora "
                     "target .* selects no module of family 'llada'"):
    build.model(c, build.tokenizer(c))


def test_default_targets_are_the_projections_without_the_head():
  for family, n in (("llada", 7), ("sdar", 7), ("dream", 7)):
    c = run_config(family, rank=2)
    model = build.model(c, build.tokenizer(c))
    names = set(lora.adapters(model))
    assert len(names) == n * model.config.n_layers and lora.head_module(model.config) not in names
    assert set(lora.select(model.config, lora.config_of(model).targets)) == names
  # d1's target list on LLaDA's names: PEFT adapts q, k, v and up_proj, and skips the rest.
  c = config_lib.config("llada", "8b_lora").unlock()
  targets = build.lora_targets("llada", c.model.lora.targets)
  assert {n.rsplit(".", 1)[-1] for n in lora.select(tiny("llada"), targets, strict=False)} == {
      "q_proj", "k_proj", "v_proj", "up_proj"}
  assert lora.unmatched(tiny("llada"), targets) == ["o_proj", "gate_proj", "down_proj"]


# ----------------------------------------------------------------------------- slow: whole runs


LORA_RUN = ("--config.model.lora.rank=16", "--config.model.lora.alpha=32",
            "--config.model.lora.dropout=0.1", "--config.sft.lr=1e-2", "--config.sft.warmup_steps=0",
            "--config.sft.steps=4", "--config.rl.steps=3", "--config.rl.objective=grpo",
            "--config.rl.kl_coef=0.5", "--config.checkpoint.every=1", "--config.checkpoint.keep=10",
            "--config.eval.every=100", "--config.eval.num_examples=8")


def _tensors(directory: Path) -> dict:
  return {name: value for f in sorted(directory.glob("*.safetensors"))
          for name, value in load_file(str(f)).items()}


@pytest.mark.slow
def test_a_killed_lora_run_resumes_as_an_uninterrupted_one_and_exports_both_ways(tmp_path):
  from tests.train_test import (REPO, kill_once_written, main_cmd, read_jsonl, run_main,
                                strip_timing)
  config = "configs/sdar.py:smoke"
  out = run_main(config, tmp_path, *LORA_RUN)
  assert out.returncode == 0, out.stderr[-3000:]
  straight = strip_timing(read_jsonl(tmp_path / "metrics.jsonl"))
  assert [r["stage"] for r in straight] == ["sft"] * 4 + ["rl"] * 3
  assert all(r["grad_norm"] > 0 for r in straight)  # every step moved the adapters
  assert all(abs(r["kl"]) > 0 for r in straight[5:])  # the KL reference is in play
  for item in ("model", "optimizer"):  # the base is rebuilt on resume, never saved
    saved = ocp.StandardCheckpointer().restore(str(tmp_path / "checkpoints" / "6" / item))
    assert all("/".join(map(str, sharding.path_keys(p))).endswith(("lora_a", "lora_b"))
               for p, x in jax.tree_util.tree_leaves_with_path(saved) if np.ndim(x)), item
  merged, adapter = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf_adapter")
  assert merged and adapter and all(".lora_" in name for name in adapter)

  # The same run killed (SIGKILL) after its first RL step's checkpoint (SFT: steps 0-3), rerun.
  killed = tmp_path / "killed"
  kill_once_written(main_cmd(config, killed, *LORA_RUN), killed / "checkpoints" / "4")
  assert read_jsonl(killed / "metrics.jsonl")[-1]["step"] < 6, "killed too late to test resumption"
  out = run_main(config, killed, *LORA_RUN)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from" in out.stdout
  assert strip_timing(read_jsonl(killed / "metrics.jsonl")) == straight
  for want, got in ((merged, _tensors(killed / "hf")), (adapter, _tensors(killed / "hf_adapter"))):
    assert set(got) == set(want)
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)

  cli = subprocess.run([sys.executable, "-m", "stabledrl_jax.export", f"--workdir={tmp_path}",
                        f"--out={tmp_path / 'cli'}"], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
  assert cli.returncode == 0, cli.stderr[-3000:]
  assert f"to {tmp_path / 'cli'} and {tmp_path / 'cli_adapter'}" in cli.stdout
  for want, got in ((merged, _tensors(tmp_path / "cli")), (adapter, _tensors(tmp_path / "cli_adapter"))):
    for name in want:
      np.testing.assert_array_equal(got[name], want[name], err_msg=name)
