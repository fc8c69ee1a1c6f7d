"""The `8b_official` preset against the official StableDRL GSM8K training run, setting by setting.

The expected values are the official code's (its GSM8K config, training loop and loader), written
here independently of `config_lib`.
"""
import importlib.util
from pathlib import Path

import pytest

from stabledrl_jax import config_lib, objectives

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


# Dream's `7b`: key -> (value, where it comes from); DiffuCoder = apple/ml-diffucoder's coupled-GRPO
# (recipes/config_coupled_code.yaml, src/open_r1/coupled_grpo.py), dLLM-RL = Gen-Verse/dLLM-RL
# configs/rl_dream.yaml.
DREAM_7B = {
    "model.preset": "dream_7b",
    "sampler.gen_length": 256,     # DiffuCoder max_completion_length
    "sampler.steps": 256,          # DiffuCoder diffusion_steps
    "sampler.temperature": 1.0,    # DiffuCoder generation_temperature
    "sampler.top_p": 0.95,         # DiffuCoder's diffusion_generate call
    "sampler.top_k": 0,
    "sampler.alg": "entropy",      # DiffuCoder's diffusion_generate call
    "sampler.alg_temp": 0.0,
    "sampler.eps": 1e-3,           # Dream's released default
    "rl.group_size": 10,           # DiffuCoder num_generations
    "rl.updates_per_batch": 2,     # DiffuCoder num_iterations
    "rl.prompts_per_step": 8,      # DiffuCoder 8 processes x 5 x 2 accumulation / 10
    "rl.accumulation": 2,          # DiffuCoder gradient_accumulation_steps
    "rl.lr": 1e-6,                 # DiffuCoder learning_rate (and dLLM-RL's)
    "rl.p_mask_prompt": 0.0,       # DiffuCoder p_mask_prompt
    "rl.ppo_epsilon": 0.5,         # DiffuCoder epsilon
    "optim.b1": 0.9, "optim.b2": 0.99, "optim.weight_decay": 0.1,  # DiffuCoder adam
    "optim.grad_clip": 0.2,        # DiffuCoder max_grad_norm
    "task.max_prompt_len": 512,    # dLLM-RL training.max_prompt_len
    "task.name": "gsm8k", "task.chat": True, "model.compute_dtype": "bfloat16",
}


@pytest.mark.parametrize("key", sorted(DREAM_7B))
def test_dream_7b_takes_the_published_dream_rl_settings(key):
  assert _get(_config("dream", "7b"), key) == DREAM_7B[key]


def test_dream_7b_validates_and_the_checkpoint_presets_belong_to_their_family(tmp_path):
  c = _config("dream", "7b")
  c.model.checkpoint = str(tmp_path)
  c.task.source_dir = str(tmp_path)
  config_lib.validate(c)
  for preset in ("tiny", "smoke", "sudoku"):
    config_lib.validate(_config("dream", preset))
  assert _config("dream", "smoke").sampler.steps == _config("llada", "smoke").sampler.steps
  for family, preset, want in (("dream", "8b", "'7b'"), ("dream", "8b_official", "'7b'"),
                               ("llada", "7b", "'8b'"), ("sdar", "7b", "'8b'")):
    with pytest.raises(ValueError, match=f"preset '{preset}' with family='{family}'.*{want}"):
      _config(family, preset)


# d1's diffu-GRPO LoRA (dllm-reasoning/d1: its peft LoraConfig and train.yaml), written here apart
# from the preset.
D1_LORA = {"model.lora.rank": 128, "model.lora.alpha": 64.0, "model.lora.dropout": 0.05,
           "model.lora.targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
           "rl.lr": 3e-6}


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_8b_lora_is_the_8b_run_with_d1s_lora(family, tmp_path):
  from stabledrl_jax import run_record
  lora_run, full = _config(family, "8b_lora"), _config(family, "8b")
  changed = {k: b for k, a, b in run_record.changes(full.to_dict(), lora_run.to_dict())}
  assert changed == {**D1_LORA, "model.param_dtype": "bfloat16"}  # a bf16 frozen base (d1: 4-bit)
  lora_run.model.checkpoint = str(tmp_path)
  lora_run.task.source_dir = str(tmp_path)
  config_lib.validate(lora_run)
  with pytest.raises(ValueError, match="preset '8b_lora' with family='dream'.*'7b'"):
    _config("dream", "8b_lora")


# JustGRPO (arXiv 2601.15165; its code, LeapLabTHU/JustGRPO: train.py's TrainConfig and AdamW,
# grpo.py, the README's GSM8K command), written here apart from the preset: what `8b_ar` changes
# in the `8b` run.
JUST_GRPO = {
    "rl.objective": "grpo",            # plain GRPO, token-level PPO clip
    "rl.ppo_epsilon": 0.2,             # logprob_loss eps
    "rl.advantage": "mean_std",        # (r - mean) / (std + 1e-4)
    "rl.scheme": "trajectory",         # one forward per decoded token: the AR likelihood
    "rl.copies_per_pass": 1,           # one forward at a time (theirs: one backward per token)
    "rl.updates_per_batch": 1,         # μ = 1 (ratio against the detached same-step log-probs)
    "rl.prompts_per_step": 64,         # README: global batch 64 = 8 processes x grad_accum 8
    "rl.accumulation": 8,              # grad_accum
    "rl.steps": 125,                   # total_steps
    "rl.lr": 5e-6,                     # learning_rate
    "optim.b2": 0.999,                 # AdamW betas (0.9, 0.999)
    "optim.weight_decay": 0.0,
    "optim.grad_clip": 1.0,            # max_grad_norm
    "optim.decay_steps": 10**6,        # a constant rate (no scheduler), as linear decay nears it
    "sampler.order": "left_to_right",  # block_length 1: one token a step, in position order
    "sampler.steps": 256,              # gen_steps = gen_length = 256
    "sampler.temperature": 1.0,        # sample()'s default
    "seed": 1234,
}
# The same as the `8b` run's already: G = 16 (8 generations x 2 repeats), no KL term, no warmup,
# 256 tokens, s = 1, bf16 compute with whole-layer remat.
JUST_GRPO_SAME = {"rl.group_size": 16, "rl.kl_coef": 0.0, "rl.warmup_steps": 0,
                  "rl.trajectory_shrink": 1, "sampler.gen_length": 256, "optim.b1": 0.9,
                  "model.compute_dtype": "bfloat16", "model.remat": True,
                  "model.preset": "llada_8b", "task.name": "gsm8k", "task.chat": True}


def test_8b_ar_is_the_8b_run_with_just_grpos_settings(tmp_path):
  from stabledrl_jax import rl, run_record
  ar_run, full = _config("llada", "8b_ar"), _config("llada", "8b")
  changed = {k: b for k, a, b in run_record.changes(full.to_dict(), ar_run.to_dict())}
  # The project's own (not JustGRPO's): its 1024 rollouts decoded 256 at a time, the same tokens.
  assert changed == {**JUST_GRPO, "sampler.chunk": 256}
  for key, value in JUST_GRPO_SAME.items():
    assert _get(ar_run, key) == value, key
  assert ar_run.sampler.steps == ar_run.sampler.gen_length  # LLaDA's left to right needs it
  ar_run.model.checkpoint = str(tmp_path)
  ar_run.task.source_dir = str(tmp_path)
  config_lib.validate(ar_run)
  obj = objectives.Objective.from_config(ar_run)
  assert (obj.name, obj.scheme, obj.trajectory_shrink) == ("grpo", "trajectory", 1)
  assert obj.num_samples == ar_run.sampler.gen_length  # one forward per generated token
  assert obj.epsilon == 0.2 and obj.kl_coef == 0.0
  settings = rl.Settings.from_config(ar_run)  # the rollouts' sampler accepts it too
  assert settings.sampling.order == "left_to_right"
  assert "8b_ar" in config_lib.PRESETS


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_8b_ar_is_llada_only(family):
  with pytest.raises(ValueError, match=f"^config preset '8b_ar' with family='{family}': ") as e:
    _config(family, "8b_ar")
  assert "\n" not in str(e.value)
