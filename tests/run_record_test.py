"""WORKDIR/config.json: change listing, refusal of non-resumable changes, recording safe ones."""
import json
import os

import pytest

from stabledrl_jax import run_record

BASE = {"seed": 0, "model": {"d_model": 64, "n_layers": 2}, "rl": {"steps": 4, "group_size": 8},
        "eval": {"every": 10}, "stability": {"clip_band": False},
        "sampler": {"cache": "none", "threshold": 0.0, "steps": 10}}


def _with(**changes):
  out = json.loads(json.dumps(BASE))
  for key, value in changes.items():
    section, name = key.split("__") if "__" in key else (None, key)
    (out[section] if section else out)[name] = value
  return out


def test_first_run_records_the_config(tmp_path):
  assert run_record.check(BASE, str(tmp_path), has_checkpoint=False) == []
  assert json.load(open(tmp_path / "config.json")) == BASE


def test_safe_changes_resume_and_are_recorded(tmp_path):
  run_record.check(BASE, str(tmp_path), has_checkpoint=True)
  new = _with(rl__steps=6, eval__every=2, stability__clip_band=True, sampler__cache="dual",
              sampler__threshold=0.9)
  lines = run_record.check(new, str(tmp_path), has_checkpoint=True)
  assert lines == ["config changed since the last run: eval.every: 10 -> 2",
                   "config changed since the last run: rl.steps: 4 -> 6",
                   "config changed since the last run: sampler.cache: 'none' -> 'dual'",
                   "config changed since the last run: sampler.threshold: 0.0 -> 0.9",
                   "config changed since the last run: stability.clip_band: False -> True"]
  assert json.load(open(tmp_path / "config.json")) == new
  (record,) = [json.loads(l) for l in open(tmp_path / "config_changes.jsonl")]
  assert record["changes"][1] == ["rl.steps", 4, 6]


@pytest.mark.parametrize("key,value", [("model__d_model", 96), ("seed", 1),
                                       ("rl__group_size", 4), ("sampler__steps", 20)])
def test_unsafe_change_is_refused_in_one_line_and_nothing_written(tmp_path, key, value):
  run_record.check(BASE, str(tmp_path), has_checkpoint=True)
  with pytest.raises(run_record.ConfigChangeError) as e:
    run_record.check(_with(**{key: value}, rl__steps=9), str(tmp_path), has_checkpoint=True)
  message = str(e.value)
  assert "\n" not in message and key.replace("__", ".") in message and "rl.steps" not in message
  assert json.load(open(tmp_path / "config.json")) == BASE
  assert not os.path.exists(tmp_path / "config_changes.jsonl")


def test_without_a_checkpoint_any_change_is_taken(tmp_path):
  run_record.check(BASE, str(tmp_path), has_checkpoint=False)
  lines = run_record.check(_with(seed=3), str(tmp_path), has_checkpoint=False)
  assert lines == ["config changed since the last run: seed: 0 -> 3"]


def test_has_checkpoint_reads_step_directories(tmp_path):
  assert not run_record.has_checkpoint(str(tmp_path))
  os.makedirs(tmp_path / "checkpoints" / "7")
  assert run_record.has_checkpoint(str(tmp_path))



def test_a_key_added_since_the_run_resumes_at_its_default_only(tmp_path):
  run_record.check(BASE, str(tmp_path), has_checkpoint=True)  # recorded before the key existed
  defaults = {"optim": {"moment_dtype": "float32"}}
  lines = run_record.check(_with(optim={"moment_dtype": "float32"}), str(tmp_path),
                           has_checkpoint=True, defaults=defaults)
  assert lines == ["config changed since the last run: optim.moment_dtype: None -> 'float32'"]
  run_record.write(str(tmp_path), BASE)
  with pytest.raises(run_record.ConfigChangeError, match="optim.moment_dtype: None -> 'bfloat16'"):
    run_record.check(_with(optim={"moment_dtype": "bfloat16"}), str(tmp_path), has_checkpoint=True,
                     defaults=defaults)
