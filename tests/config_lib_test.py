"""Tests for stabledrl_jax.config_lib: one check per value, typed settings from the config."""
import pytest

from stabledrl_jax import config_lib


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
])
def test_new_keys_are_checked_and_named(family, edits, named):
  with pytest.raises(ValueError, match=named.replace(".", r"\.")):
    config_lib.validate(config(family, **edits))


def test_settings_carry_the_config_values():
  c = config("sdar", rl__objective="grpo", rl__epsilon_high=0.28, sampler__top_k=3,
             stability__kl_consecutive=5, stability__kl_metric="kl_k1")
  config_lib.validate(c)
  s = config_lib.settings(c)
  assert s.objective.epsilon_high == 0.28 and s.objective.block_size == 4 and s.staircase
  assert s.sampling.top_k == 3 and s.sampling.temperature == 0.7 and s.eval_sampling.temperature == 0
  assert (s.monitor.kl_consecutive, s.monitor.kl_metric, s.monitor.entropy_band) == (5, "kl_k1", True)
  assert not s.controls.moves_epsilon
  llada = config_lib.settings(config("llada"))
  assert llada.block_size == 4 and not llada.staircase and llada.objective.epsilon_high is None
