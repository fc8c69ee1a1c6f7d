"""Tests for stabledrl_jax.workdir_config: a run's recorded config, with keys added since."""
import json

from stabledrl_jax import config_lib, workdir_config


def test_keys_added_since_the_run_take_their_defaults_and_recorded_values_stay(tmp_path):
  c = config_lib.base_config("llada")
  record = c.to_dict()
  del record["optim"]["moment_dtype"]  # as written before the key existed
  record["rl"]["lr"] = 1e-3
  record["task"]["reward_weights"] = {"correctness": 2.0}  # a map: no default entries join it
  (tmp_path / "config.json").write_text(json.dumps(record))
  got = workdir_config.get_config(str(tmp_path))
  assert got.optim.moment_dtype == "float32" and got.rl.lr == 1e-3
  assert got.task.reward_weights.to_dict() == {"correctness": 2.0}
  assert set(got.to_dict()) == set(c.to_dict())
  config_lib.validate(got)


def test_keys_moved_or_removed_since_are_upgraded(tmp_path):
  record = config_lib.base_config("sdar").to_dict()
  record["model"]["block_size"] = 8          # before sampler.block_length held SDAR's block
  del record["sampler"]["block_length"]
  record["controls"]["clip_low"] = 0.1       # before the one clip band in stability
  (tmp_path / "config.json").write_text(json.dumps(record))
  got = workdir_config.get_config(str(tmp_path))
  assert got.sampler.block_length == 8 and "block_size" not in got.model
  assert "clip_low" not in got.controls
  assert set(got.to_dict()) == set(config_lib.base_config("sdar").to_dict())


def test_a_dream_run_takes_the_dream_defaults(tmp_path):
  record = config_lib.base_config("dream").to_dict()
  del record["sampler"]["alg"], record["sampler"]["eps"]  # a run recorded before the keys
  record["sampler"]["alg_temp"] = 0.3
  (tmp_path / "config.json").write_text(json.dumps(record))
  got = workdir_config.get_config(str(tmp_path))
  assert (got.family, got.sampler.alg, got.sampler.eps, got.sampler.alg_temp) == (
      "dream", "entropy", 1e-3, 0.3)
  config_lib.validate(got)
