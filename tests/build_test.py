"""Tests for stabledrl_jax.build's settings: every section's settings class built from the config,
each bad value a one-line error naming its key."""
import types

import pytest

from stabledrl_jax import build, config_lib, rollouts


def config(family="sdar", **edits):
  c = config_lib.base_config(family)
  for key, value in edits.items():
    group, name = key.split("__")
    c[group][name] = value
  return c


@pytest.mark.parametrize("family,edits,named", [
    ("llada", {"sampler__top_k": 5}, "sampler.top_k"),
    ("sdar", {"sampler__top_p": 0.0}, "sampler.top_p"),
    ("sdar", {"sampler__cfg_scale": 1.0}, "sampler.cfg_scale"),
    ("sdar", {"rl__epsilon_high": 0.3}, "rl.epsilon_high"),  # stabledrl has no upper PPO clip
    ("sdar", {"stability__kl_consecutive": 0}, "stability.kl_consecutive"),
    ("sdar", {"stability__kl_metric": "kl_k2"}, "stability.kl_metric"),
    ("sdar", {"model__d_model": 0}, "model.d_model"),
    ("llada", {"model__mlp_dim": 0}, "model.mlp_dim"),
    ("sdar", {"model__n_layers": 0}, "model.n_layers"),
    ("sdar", {"model__n_heads": 0}, "model.n_heads"),
    ("sdar", {"model__n_heads": 3}, "model.d_model"),  # 128 is no multiple of 3
    ("sdar", {"rl__group_size": 1}, "rl.group_size"),  # every advantage would be 0
    ("sdar", {"task__invalid_reward": "skip"}, "task.invalid_reward"),
])
def test_new_keys_are_checked_and_named(family, edits, named):
  with pytest.raises(ValueError, match="^config." + named.replace(".", r"\.") + "="):
    build.settings(config(family, **edits))


def test_settings_carry_the_config_values():
  c = config("sdar", rl__objective="grpo", rl__epsilon_high=0.28, sampler__top_k=3,
             stability__kl_consecutive=5, stability__kl_metric="kl_k1")
  s = build.settings(c)
  obj = s.rl.objective
  assert obj.epsilon_high == 0.28 and obj.block_size == 4 and obj.staircase
  assert obj.epsilon == c.rl.ppo_epsilon  # GRPO clips at the PPO ε
  assert s.rl.sampling.top_k == 3 and s.rl.sampling.temperature == 0.7
  assert s.eval_sampling.temperature == 0
  assert (s.monitor.kl_consecutive, s.monitor.kl_metric, s.monitor.entropy_band) == (5, "kl_k1", True)
  assert not s.controls.moves_epsilon
  assert (s.controls.clip_low, s.controls.clip_high) == (c.stability.clip_low, c.stability.clip_high)
  llada = build.settings(config("llada"))
  assert llada.rl.objective.block_size == 4 and not llada.rl.objective.staircase
  assert llada.rl.objective.epsilon_high is None and llada.rl.objective.epsilon == 5.0


def test_sdar_dynamic_strategy_needs_its_threshold_and_evaluation_decodes_exactly():
  c = config("sdar", sampler__strategy="low_confidence_dynamic")
  with pytest.raises(ValueError, match=r"^config\.sampler\.threshold=0\.0: .*low_confidence_dynamic"):
    build.settings(c)  # 0 is off everywhere: no silent default takes its place
  c.sampler.threshold = 0.9
  s = build.settings(c)
  assert (s.rl.sampling.strategy, s.rl.sampling.threshold) == ("low_confidence_dynamic", 0.9)
  assert (s.eval_sampling.strategy, s.eval_sampling.threshold) == ("low_confidence_static", 0.0)
  c.eval.fast = True
  assert build.settings(c).eval_sampling.threshold == 0.9


def test_settings_name_bad_values():
  for family, edits, named in (
      ("sdar", {"rl.accumulation": 3}, "rl.accumulation"),
      ("sdar", {"rl.p_mask_prompt": 0.15}, "rl.p_mask_prompt"),
      ("llada", {"sampler.steps": 7}, "sampler.steps"),
      ("sdar", {"rl.adversarial": 1.5}, "rl.adversarial"),
      ("sdar", {"controls.drift": True, "rl.objective": "wd1"}, "controls.drift"),
      ("sdar", {"controls.adaptive_epsilon": True, "rl.max_ratio": 5.0}, "controls.adaptive_epsilon"),
      ("sdar", {"controls.adaptive_epsilon": True, "controls.epsilon_schedule": True},
       "controls.adaptive_epsilon"),
      ("sdar", {"stability.clip_low": 0.2}, "stability.clip_high"),
      ("sdar", {"controls.drift_metric": "kl"}, "controls.drift_metric"),
      ("sdar", {"sampler.strategy": "low_confidence_dynamic"}, "sampler.threshold"),
      ("sdar", {"sampler.threshold": 0.9}, "sampler.threshold"),
      ("sdar", {"rl.objective": "bogus"}, "rl.objective"),
      ("sdar", {"task.name": "bogus"}, "task.name"),
      ("llada", {"rl.scheme": "complementary", "rl.num_samples": 3}, "rl.num_samples"),
      ("llada", {"sft.scheme": "complementary"}, "sft.scheme"),
      ("llada", {"rl.scheme": "complementary", "rl.min_mask_prob": 0.5}, "rl.min_mask_prob")):
    c = config_lib.base_config(family)
    for key, value in edits.items():
      section, name = key.split(".")
      c[section][name] = value
    with pytest.raises(ValueError, match=f"^config.{named}="):
      build.settings(c)
  with pytest.raises(ValueError, match="bogus"):
    config_lib.apply_preset(config_lib.base_config("llada"), "bogus")


def test_dream_builds_its_sampler_settings_and_a_tiny_dream_model():
  c = config("dream", sampler__alg="topk_margin")
  s = build.settings(c)
  assert isinstance(s.rl.sampling, rollouts.DreamSampling) and s.rl.sampling.alg == "topk_margin"
  assert s.eval_sampling.temperature == 0 and s.eval_sampling.alg == "topk_margin"
  assert not s.rl.objective.staircase and s.rl.objective.block_size == 4
  tok = build.tokenizer(c)
  cfg = build.model(c, tok).config
  assert (cfg.family, cfg.model_type, cfg.qkv_bias, cfg.shifted, cfg.qk_norm, cfg.block_size) == (
      "dream", "Dream", True, True, False, None)
  assert (cfg.vocab_size, cfg.mask_token_id, cfg.d_model, cfg.n_layers) == (
      tok.vocab_size, tok.mask_id, c.model.d_model, c.model.n_layers)
  for family, block in (("llada", None), ("sdar", 4)):  # the other families as before
    cfg = build.model(config(family), tok).config
    assert (cfg.family, cfg.model_type, cfg.block_size, cfg.qkv_bias) == (
        family, family, block, False)


def test_rft_learns_from_single_rollouts_and_positions_are_checked():
  build.settings(config("sdar", rl__objective="rft", rl__group_size=1))
  model = types.SimpleNamespace(config=types.SimpleNamespace(max_seq_len=256))
  build.check_positions(config("sdar", task__max_prompt_len=244, sampler__gen_length=12), model)
  with pytest.raises(ValueError, match=r"^config\.task\.max_prompt_len=245 \+ config\.sampler\."
                     r"gen_length=12 = 257 positions exceed the model's 256$"):
    build.check_positions(config("sdar", task__max_prompt_len=245, sampler__gen_length=12), model)


def test_an_sft_target_longer_than_the_completion_fails_before_the_first_step(tmp_path):
  from stabledrl_jax.tasks.tokenizer import CharTokenizer
  c = config("sdar", sampler__gen_length=8, task__num_train=16, task__num_test=4,
             eval__num_examples=4)
  with pytest.raises(ValueError, match=r"^SFT completion of 1\d tokens does not fit "
                     r"sampler\.gen_length=8"):
    build.data(c, CharTokenizer(), str(tmp_path), build.mesh(c))
