"""Tests for stabledrl_jax.config_lib: one default per key, none in the settings classes."""
import dataclasses
import pathlib
import re

import pytest

from stabledrl_jax import config_lib, controls, detectors, objectives, rl, rollouts, sft

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _flat(tree: dict, prefix: str = "") -> list[str]:
  out = []
  for key, value in tree.items():
    if isinstance(value, dict) and key != "reward_weights":
      out += _flat(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


def test_each_config_key_has_its_default_in_one_place():
  """Every key of the config tree is assigned once in `base_config` (the `c.a.b = ...` lines of
  config_lib.py), and no settings class gives a config key a default of its own."""
  assigned = []
  for line in (ROOT / "stabledrl_jax" / "config_lib.py").read_text().splitlines():
    target = re.match(r"^\s*(c\.[\w.]+(?:\s*,\s*c\.[\w.]+)*)\s*=[^=]", line)
    if target:
      assigned += [t.strip()[2:] for t in target.group(1).split(",")]
  for family in config_lib.FAMILIES:
    for key in _flat(config_lib.base_config(family).to_dict()):
      assert assigned.count(key) == 1, (key, assigned.count(key))
  keys = {name for section in config_lib.base_config("sdar").values() if hasattr(section, "keys")
          for name in section.keys()}
  for cls in (objectives.Objective, rl.Settings, rollouts.LLaDASampling, rollouts.SDARSampling,
              rollouts.DreamSampling, sft.Settings, detectors.MonitorConfig, controls.ControlConfig):
    defaulted = [f.name for f in dataclasses.fields(cls)
                 if f.name in keys and f.default is not dataclasses.MISSING]
    assert not defaulted, (cls.__name__, defaulted)


def test_the_library_classes_defaults_are_the_configs():
  """`models.ModelConfig` and `lora.LoraConfig` serve library users too, so they keep defaults;
  each one that names a config key equals that key's default (LoRA's targets have none)."""
  from stabledrl_jax import lora, models

  c = config_lib.base_config("sdar")
  for cls, section in ((models.ModelConfig, c.model), (lora.LoraConfig, c.model.lora)):
    for f in dataclasses.fields(cls):
      if f.name in section and f.default is not dataclasses.MISSING:
        assert f.default == section[f.name], (cls.__name__, f.name, f.default, section[f.name])
  assert dataclasses.fields(lora.LoraConfig)[-1].default is dataclasses.MISSING  # targets
  assert models.ModelConfig.compute_dtype == "float32"  # the check above ran on it


def test_the_family_is_checked_and_named():
  c = config_lib.base_config("dream")
  config_lib.validate(c)
  c.family = "qwen"
  with pytest.raises(ValueError,
                     match=r"^config\.family='qwen': expected one of llada, sdar, dream, llada2$"):
    config_lib.validate(c)


def test_llada2_takes_the_block_diffusion_defaults():
  """Wherever LLaDA's and SDAR's defaults differ, LLaDA2.0 (block diffusion) takes SDAR's; its
  model preset is its own."""
  llada, sdar, llada2 = (config_lib.base_config(f) for f in ("llada", "sdar", "llada2"))
  differ = [key for key in _flat(llada2.to_dict())
            if key not in ("family", "model.preset") and llada[key] != sdar[key]]
  assert "rl.scheme" in differ
  for key in differ:
    assert llada2[key] == sdar[key], key
  assert llada2.model.preset == "llada2_tiny"


def test_dream_takes_the_full_attention_defaults():
  """Wherever LLaDA's and SDAR's defaults differ, Dream (full attention) takes LLaDA's."""
  llada, sdar, dream = (config_lib.base_config(f) for f in ("llada", "sdar", "dream"))
  differ = [key for key in _flat(dream.to_dict())
            if key != "family" and llada[key] != sdar[key]]
  assert "rl.scheme" in differ and "rl.p_mask_prompt" in differ
  for key in differ:
    assert dream[key] == llada[key], key


@pytest.mark.parametrize("key,value,why", [
    ("stop_at_accuracy", 1.5, r"must be an accuracy in \(0, 1\], or 0 to run all sft\.steps$"),
    ("stop_at_accuracy", -0.1, r"must be an accuracy"),
    ("check_every", 0, r"must be >= 1$"),
    ("validation_examples", 0, r"must be >= 1$"),
])
def test_bad_sft_stop_settings_are_named(key, value, why):
  c = config_lib.base_config("sdar")
  c.sft[key] = value
  with pytest.raises(ValueError, match=rf"^config\.sft\.{key}={value!r}: {why}"):
    config_lib.validate(c)
