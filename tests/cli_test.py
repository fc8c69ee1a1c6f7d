"""Tests for stabledrl_jax.cli: a mistyped config key is one readable line naming it."""
import pathlib
import re
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


def test_an_unknown_preset_or_config_file_is_one_line():
  from stabledrl_jax import cli
  with pytest.raises(SystemExit, match=r"^error: --config=configs/nope.py: no such file \(the "
                     r"project's own: (.*)\)$") as e:
    cli.parse_flags(["prog", "--config=configs/nope.py"])
  named = re.search(r"own: (.*)\)$", str(e.value)).group(1).split(", ")
  assert sorted(named) == sorted(f"configs/{p.name}" for p in (ROOT / "configs").glob("*.py")
                                 if p.name != "__init__.py")
  out = subprocess.run([sys.executable, "-m", "stabledrl_jax.main", "--config=configs/sdar.py:smok"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  (line,) = out.stderr.strip().splitlines()
  assert out.returncode != 0 and line.startswith(
      "error: flag --config=configs/sdar.py:smok: Error whilst parsing config file: ValueError: "
      "unknown config preset 'smok': expected one of ('tiny', 'smoke', "), out.stderr


def test_faults_are_one_line_with_the_traceback_in_the_workdir(tmp_path, monkeypatch, capsys):
  import errno
  import os

  from stabledrl_jax import cli

  def orbax_like_disk_full(argv):  # Orbax wraps the OSError of a failed write
    try:
      raise OSError(errno.ENOSPC, "No space left on device", "/w/checkpoints/3/model")
    except OSError as e:
      raise ValueError("RESOURCE_EXHAUSTED: Error writing ... [tensorstore_spec=...]") from e

  def read_only(argv):
    raise OSError(errno.EROFS, "Read-only file system", "/w/checkpoints")

  def interrupted(argv):
    raise KeyboardInterrupt

  monkeypatch.setattr(cli, "log_dir", str(tmp_path))
  monkeypatch.setattr(os, "dup2", lambda *a: None)  # the test's stderr stays pytest's
  for main, code, line in [
      (orbax_like_disk_full, 1, "no space left on device writing /w/checkpoints/3/model; free "
                                "space and rerun the same command to resume"),
      (read_only, 1, "/w/checkpoints: Read-only file system (check the workdir's permissions)"),
      (interrupted, 130, "interrupted (Ctrl-C); rerun the same command to resume (training: from "
                         "its last checkpoint)"),
      (lambda argv: {}["k"], 1, "KeyError: k")]:
    with pytest.raises(SystemExit) as exit_:
      cli.one_line_faults(main)(["prog"])
    assert exit_.value.code == code
    assert capsys.readouterr().err == f"error: {line} (traceback: {tmp_path}/debug.log)\n"
  log = (tmp_path / "debug.log").read_text()
  assert log.count("Traceback (most recent call last)") == 5  # the disk-full one is chained
  assert "in orbax_like_disk_full" in log and "KeyboardInterrupt" in log
