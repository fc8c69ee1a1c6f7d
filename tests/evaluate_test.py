"""Tests for stabledrl_jax.evaluate: the figures every evaluation reports."""
import pathlib
import subprocess
import sys

import numpy as np

from stabledrl_jax import evaluate


def test_summary_mean_reward_accuracy_and_pass_at_k():
  correct = np.array([[1, 0, 0], [0, 0, 0], [1, 1, 1], [0, 0, 1]], bool)
  rewards = np.where(correct, 1.0, 0.25)
  lengths = np.full((4, 3), 10)
  s = evaluate.summarize(rewards, correct, lengths, wall=2.0)
  assert s["accuracy"] == 5 / 12 and s["pass_at_k"] == 3 / 4 and s["tokens_per_s"] == 60.0
  assert s["mean_reward"] == (5 + 7 * 0.25) / 12


def test_max_examples_below_one_is_one_line():
  out = subprocess.run([sys.executable, "-m", "stabledrl_jax.evaluate", "--config=configs/sdar.py",
                        "--max_examples=0"], cwd=pathlib.Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 1 and out.stderr.strip().splitlines() == [
      "error: --max_examples=0: must be >= 1 (leave it out to evaluate all)"], out.stderr
