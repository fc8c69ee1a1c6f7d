"""LoRA on LLaDA2.0's routed experts (stabledrl_jax.lora.ExpertAdapter): PEFT's module names
select them, the forward equals the base with W_e + (α / r) A_e B_e merged in NumPy, the PEFT
file holds one adapter per expert as torch's `peft` names and applies it, gradients reach them,
and a layer's experts are adapted all or none."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from stabledrl_jax import lora, models, peft_format
from stabledrl_jax.models import weights
from tests.lora_test import randomise
from tests.models_llada2_test import _randomise

TARGETS = ("query_key_value", "dense", "gate_proj", "up_proj", "down_proj")  # PEFT's list
RANK, ALPHA = 4, 6.0


def adapted(seed: int = 0, **changes):
  model = _randomise(models.create(models.llada2_tiny(**changes), seed=seed), seed=3)
  lora.apply(model, lora.LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
  randomise(model, seed=5, scale=0.2)
  return model


def test_peft_names_select_every_routed_expert_and_the_default_none():
  cfg = models.llada2_tiny()
  chosen = lora.select(cfg, ("gate_proj",))
  experts = [f"model.layers.1.mlp.experts.{e}.gate_proj" for e in range(cfg.num_experts)]
  assert sorted(chosen) == sorted(["model.layers.0.mlp.gate_proj",
                                   "model.layers.1.mlp.shared_experts.gate_proj", *experts])
  assert not any(".experts." in name for name in lora.select(cfg, lora.DEFAULT_TARGETS["llada2"]))
  assert sum(".experts." in n for n in lora.select(cfg, "all-linear")) == 3 * cfg.num_experts


@pytest.mark.parametrize("impl", ["tiles", "ragged_dot"])
def test_forward_equals_the_kernels_merged_in_numpy(impl):
  model = adapted(moe_impl=impl)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 120, size=(2, 12)))
  got = np.asarray(model.logits(ids))
  # Reference: the same base with every adapted kernel replaced by W + (α / r) A B (float64).
  ref = _randomise(models.create(models.llada2_tiny(moe_impl=impl), seed=0), seed=3)
  scale = ALPHA / RANK
  for name, path in lora.linear_modules(ref.config).items():
    adapter = getattr(weights.variable(model, path), "adapter", None)
    if adapter is not None:
      w = np.asarray(weights.variable(ref, path).kernel[...], np.float64)
      a, b = (np.asarray(x[...], np.float64) for x in (adapter.lora_a, adapter.lora_b))
      weights.variable(ref, path).kernel.set_value(jnp.asarray(w + scale * a @ b, jnp.float32))
  stacked = lora.expert_adapters(model)
  assert len(stacked) == 3  # gate, up, down of the one MoE layer
  for path, adapter in stacked.items():
    w = np.asarray(weights.variable(ref, path)[...], np.float64)
    a, b = (np.asarray(x[...], np.float64) for x in (adapter.lora_a, adapter.lora_b))
    merged = w + scale * np.einsum("eir,ero->eio", a, b)
    weights.variable(ref, path).set_value(jnp.asarray(merged, jnp.float32))
  want = np.asarray(ref.logits(ids))
  base = _randomise(models.create(models.llada2_tiny(moe_impl=impl), seed=0), seed=3)
  assert np.abs(want - np.asarray(base.logits(ids))).max() > 1e-2  # the adapters matter
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(lora.merge(model).logits(ids)), want, rtol=1e-4, atol=1e-4)
  assert not lora.has_adapters(model)


def test_gradients_reach_the_expert_adapters():
  model = adapted()
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 120, size=(2, 8)))
  graphdef, params, rest = nnx.split(model, lora.trainable(model), ...)
  grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest).logits(ids) ** 2))(params)
  for path in lora.expert_adapters(model):
    attr = path[:-1] + (path[-1].replace("_kernel", "_adapter"),)
    node = grads
    for key in attr:
      node = node[key]
    assert np.abs(np.asarray(node["lora_a"][...])).max() > 0, attr
    assert np.abs(np.asarray(node["lora_b"][...])).max() > 0, attr
  axes = lora.logical_axes(model)
  assert axes[("blocks", 1, "moe", "gate_adapter", "lora_a")] == ("expert", "embed", None)
  assert axes[("blocks", 1, "moe", "down_adapter", "lora_b")] == ("expert", None, "embed")


def test_some_experts_of_a_layer_are_refused_naming_one_left_out():
  model = models.create(models.llada2_tiny())
  some = r"model\.layers\.1\.mlp\.experts\.[0-3]\.up_proj"
  with pytest.raises(lora.AdapterError, match="'model.layers.1.mlp.experts.4.up_proj'"):
    lora.apply(model, lora.LoraConfig(rank=2, alpha=4.0, targets=some))


def test_peft_file_one_adapter_per_expert_round_trip_and_errors(tmp_path):
  model = adapted()
  out = str(tmp_path / "adapter")
  peft_format.export_peft(model, out, base_model_name_or_path="inclusionAI/LLaDA2.0-mini")
  assert json.load(open(os.path.join(out, "adapter_config.json")))["target_modules"] == sorted(
      TARGETS)
  tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
  cfg = model.config
  name = "base_model.model.model.layers.1.mlp.experts.5.down_proj"
  assert tensors[name + ".lora_A.weight"].shape == (RANK, cfg.moe_intermediate_size)
  assert tensors[name + ".lora_B.weight"].shape == (cfg.d_model, RANK)
  np.testing.assert_array_equal(  # expert 5's slice, transposed to torch's [out, in]
      tensors[name + ".lora_B.weight"],
      np.asarray(model.blocks[1].moe.down_adapter.lora_b[...])[5].T)
  fresh = _randomise(models.create(cfg, seed=0), seed=3)
  peft_format.load_peft(fresh, out)
  ids = jnp.asarray(np.random.default_rng(2).integers(0, 120, size=(1, 10)))
  np.testing.assert_array_equal(np.asarray(fresh.logits(ids)), np.asarray(model.logits(ids)))
  missing = name + ".lora_B.weight"
  path = os.path.join(out, "adapter_model.safetensors")
  save_file({k: v for k, v in tensors.items() if k != missing}, path)
  with pytest.raises(lora.AdapterError, match=f"adapter tensor '{missing}' is missing"):
    peft_format.load_peft(models.create(cfg), out)


def test_torch_peft_applies_our_file_to_the_released_module_names(tmp_path):
  # The released layout's modules for one MoE layer (`mlp.experts.E.{gate,up,down}_proj`, torch
  # Linear [out, in]); torch's `peft` injects LoRA by the same target names and loads our file.
  import peft
  from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
  model = adapted()
  cfg = model.config
  out = str(tmp_path / "adapter")
  peft_format.export_peft(model, out)
  d, f = cfg.d_model, cfg.moe_intermediate_size
  moe = model.blocks[1].moe

  def expert(e):
    m = torch.nn.Module()
    for proj, (i, o) in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d))):
      linear = torch.nn.Linear(i, o, bias=False, dtype=torch.float64)
      linear.weight.data = torch.tensor(np.asarray(getattr(moe, f"{proj}_kernel")[...])[e].T,
                                        dtype=torch.float64)
      setattr(m, f"{proj}_proj", linear)
    return m

  root = torch.nn.Module()
  root.model = torch.nn.Module()
  root.model.layers = torch.nn.ModuleList([torch.nn.Module(), torch.nn.Module()])
  root.model.layers[1].mlp = torch.nn.Module()
  root.model.layers[1].mlp.experts = torch.nn.ModuleList(
      [expert(e) for e in range(cfg.num_experts)])
  config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["gate_proj", "up_proj",
                                                                     "down_proj"])
  root = peft.inject_adapter_in_model(config, root)
  ours = {k.removeprefix("base_model.model."): torch.tensor(v, dtype=torch.float64)
          for k, v in load_file(os.path.join(out, "adapter_model.safetensors")).items()
          if ".experts." in k}
  theirs = get_peft_model_state_dict(root)
  assert set(theirs) == set(ours)
  result = set_peft_model_state_dict(root, ours)
  assert not result.unexpected_keys
  x = np.random.default_rng(3).standard_normal((5, d))
  for e in (0, 6):
    for proj in ("gate", "up"):
      got = getattr(root.model.layers[1].mlp.experts[e], f"{proj}_proj")(torch.tensor(x))
      w = np.asarray(getattr(moe, f"{proj}_kernel")[...], np.float64)[e]
      adapter = getattr(moe, f"{proj}_adapter")
      a = np.asarray(adapter.lora_a[...], np.float64)[e]
      b = np.asarray(adapter.lora_b[...], np.float64)[e]
      np.testing.assert_allclose(got.detach().numpy(), x @ w + ALPHA / RANK * x @ a @ b,
                                 rtol=1e-6, atol=1e-9)
