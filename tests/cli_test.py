"""Tests for stabledrl_jax.cli: a mistyped config key is one readable line naming it."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override,line", [
    ("--config.rl.lrr=1e-5", "error: unknown config key rl.lrr (did you mean rl.lr?)"),
    ("--config.sampler.treshold=0.5",
     "error: unknown config key sampler.treshold (did you mean sampler.threshold?)"),
    ("--config.nope=1", "error: unknown config key nope"),
])
def test_a_mistyped_key_is_one_line_naming_it(override, line):
  out = subprocess.run([sys.executable, "-m", "stabledrl_jax.main", "--config=configs/sdar.py",
                        override], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0 and out.stderr.strip().splitlines()[-1] == line, out.stderr


def test_a_policy_of_another_family_or_without_checkpoints_is_one_line(tmp_path):
  from stabledrl_jax import cli, config_lib, run_record
  run_record.write(str(tmp_path), config_lib.config("sdar").to_dict())
  with pytest.raises(cli.PolicyError, match=rf"^family mismatch: {tmp_path} trained a sdar model; "
                     "the config is llada"):
    cli.load_policy(config_lib.config("llada"), str(tmp_path))
  with pytest.raises(cli.PolicyError, match=rf"^{tmp_path} holds no checkpoint yet"):
    cli.load_policy(config_lib.config("sdar"), str(tmp_path))
