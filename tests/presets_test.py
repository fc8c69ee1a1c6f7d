"""The `8b_official` preset against the official StableDRL GSM8K training run, setting by setting.

The expected values are the official code's (its GSM8K config, training loop and loader), written
here independently of `config_lib`.
"""
import importlib.util
from pathlib import Path

import pytest

from stabledrl_jax import config_lib

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# key -> the official run's value (8 processes x 4 micro-batches x 1 prompt = 32 groups per step).
OFFICIAL = {
    "rl.objective": "stabledrl_spg",      # SPG surrogate
    "rl.spg_beta": 1.5,
    "rl.spg_omega": 0.5,
    "rl.max_ratio": 5.0,                  # ratio clipped at 5 from above
    "rl.coupling": "independent",
    "rl.scheme": "block_random",
    "rl.num_samples": 2,
    "rl.p_mask_prompt": 0.15,
    "rl.group_size": 16,                  # 8 generations repeated twice
    "rl.accumulation": 4,
    "rl.prompts_per_step": 32,
    "rl.updates_per_batch": 2,            # μ
    "rl.steps": 1000,                     # 2000 optimiser steps / μ
    "rl.lr": 2e-6,
    "rl.warmup_steps": 0,
    "rl.advantage": "mean",
    "rl.kl_coef": 0.0,
    "optim.b1": 0.9,
    "optim.b2": 0.99,
    "optim.weight_decay": 0.1,
    "optim.decay_steps": 2000,
    "optim.grad_clip": 0.2,
    "sampler.gen_length": 256,
    "sampler.block_length": 32,
    "sampler.steps": 128,
    "sampler.temperature": 0.9,
    "sampler.remasking": "low_confidence",
    "model.compute_dtype": "bfloat16",
    "model.remat": True,
    "model.preset": "llada_8b",
    "task.name": "gsm8k",
    "task.chat": True,
    "seed": 113,
    "checkpoint.every": 25,
}


def _config(family, preset):
  spec = importlib.util.spec_from_file_location(f"{family}_config", CONFIGS / f"{family}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(preset)


def _get(c, key):
  for part in key.split("."):
    c = c[part]
  return c


@pytest.mark.parametrize("key", sorted(OFFICIAL))
def test_8b_official_matches_the_official_gsm8k_run(key):
  assert _get(_config("llada", "8b_official"), key) == OFFICIAL[key]


def test_8b_official_rewards_are_the_official_correctness_scale():
  # Official: +1 correct, -1 wrong = 2 x (1/0) - 1; mean-centred advantages drop the -1.
  c = _config("llada", "8b_official")
  assert dict(c.task.reward_weights) == {"correctness": 2.0}


def test_8b_official_validates_and_8b_keeps_the_project_defaults(tmp_path):
  for preset in ("8b", "8b_official"):
    c = _config("llada", preset)
    c.model.checkpoint = str(tmp_path)
    c.task.source_dir = str(tmp_path)
    config_lib.validate(c)
  c = _config("llada", "8b")
  assert (c.rl.objective, c.rl.coupling) == ("stabledrl", "coupled")


def test_8b_official_is_llada_only():
  with pytest.raises(ValueError, match="8b_official.*LLaDA only"):
    _config("sdar", "8b_official")
  assert "8b_official" in config_lib.PRESETS
