"""bench/estimators.py: its statistics and table against hand-computed numbers, the checkpoints it
loads from a run's workdir, and (slow) the whole script on random tiny models (`--smoke`)."""
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from bench import estimators as bench  # the script, as a module
from stabledrl_jax import checkpointing, cli, config_lib, estimators, optim

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATH = bench.__file__


def test_every_scheme_is_one_entry_and_applies_to_both_families():
  assert [e.name for e in bench.ESTIMATORS] == [*estimators.SCHEMES, estimators.TRAJECTORY]
  assert "complementary" in estimators.SCHEMES
  by_name = {e.name: e for e in bench.ESTIMATORS}
  assert all(e.applies(f) for e in bench.ESTIMATORS for f in bench.FAMILIES)
  # Only stratified_l (and the trajectory) estimates log p(x) itself; the others log p(x)/n (or a
  # per-token mean). The trajectory scores another quantity than the ELBO.
  assert [e.name for e in bench.ESTIMATORS if e.per_sequence] == ["stratified_l", "trajectory"]
  assert [e.name for e in bench.ESTIMATORS if not e.elbo] == ["trajectory"]
  assert by_name["complementary"].budget_ok(2) and not by_name["complementary"].budget_ok(3)
  assert by_name["random_t"].budget_ok(3)
  assert set(bench.REFERENCE.values()) <= set(by_name)


def test_mask_cost_counts_the_staircase_twice():
  seqs = type("S", (), {"tokens_BxL": np.zeros((5, 24))})()
  llada = bench.Family("llada", False, 4, 0.15, 12)
  sdar = bench.Family("sdar", True, 4, 0.0, 4)
  assert bench.mask_cost(2, llada, seqs) == (2, 48)
  assert bench.mask_cost(4, sdar, seqs) == (4, 4 * 48)
  # The trajectory: s = ceil(steps / M), its ceil(steps / s) forwards at most M.
  assert bench.trajectory_forwards(5, llada) == (4, 3)
  assert bench.trajectory_cost(5, llada, seqs) == (4, 4 * 24)
  assert bench.trajectory_cost(8, sdar, seqs) == (4, 4 * 48)


def test_variances_by_hand():
  # Two sequences, three draws. Sequence 0: 1, 2, 3 (variance 1); sequence 1: 0, 0, 3 (variance 3).
  old = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 3.0]])
  assert bench.mean_variance(old) == pytest.approx(2.0)
  # θ' adds 0.5 everywhere: the coupled ratio is constant (variance 0); the independent one pairs
  # draw r under θ' with draw r+1 under θ: seq 0: 1.5-2, 2.5-3, 3.5-1 -> -0.5, -0.5, 2.5 (var 3);
  # seq 1: 0.5-0, 0.5-3, 3.5-0 -> 0.5, -2.5, 3.5 (var 9).
  coupled, independent = bench.ratio_variances(old, old + 0.5)
  assert coupled == pytest.approx(0.0) and independent == pytest.approx(6.0)
  np.testing.assert_allclose(bench.per_token(np.array([[10.0, 6.0]]), np.array([5.0, 3.0]), True),
                             [[2.0, 2.0]])
  np.testing.assert_allclose(bench.per_token(np.array([[10.0, 6.0]]), np.array([5.0, 3.0]), False),
                             [[10.0, 6.0]])


def test_cosine_and_mean_stderr():
  assert bench.cosine(np.array([1.0, 0.0]), np.array([0.0, 2.0])) == 0.0
  assert bench.cosine(np.array([1.0, 1.0]), np.array([3.0, 3.0])) == pytest.approx(1.0)
  assert bench.cosine(np.array([1.0, 0.0]), np.array([-1.0, 1.0])) == pytest.approx(-1 / math.sqrt(2))
  assert math.isnan(bench.cosine(np.zeros(2), np.ones(2)))
  mean, err = bench.mean_stderr([0.5, 0.7, math.nan])
  assert mean == pytest.approx(0.6) and err == pytest.approx(0.1)  # stdev 0.1414 / sqrt(2)


def test_reference_agreement_by_hand_and_against_two_independent_means():
  # Chunks [1, 0], [1, 2]: mean [1, 1] (‖ḡ‖² = 2), spread 1 + 1 over K(K-1) = 2: T = 1, ρ = 1/2.
  assert bench.reference_agreement([np.array([1.0, 0.0]), np.array([1.0, 2.0])]) == pytest.approx(0.5)
  assert bench.reference_agreement([np.ones(3)] * 4) == pytest.approx(1.0)
  assert math.isnan(bench.reference_agreement([np.ones(3)]))
  # Gaussian draws around a signal: ρ from one set of 8 predicts the cosine of two independent means.
  rng = np.random.default_rng(0)
  signal = rng.normal(size=20_000)
  draws = lambda: [signal + 2.0 * rng.normal(size=signal.size) for _ in range(8)]
  a, b = draws(), draws()
  measured = bench.cosine(np.mean(a, 0), np.mean(b, 0))
  assert bench.reference_agreement(a) == pytest.approx(measured, abs=0.02)
  assert measured == pytest.approx(1 / (1 + 4 / 8), abs=0.02)  # ‖g‖² / (‖g‖² + T), T = 4/8 per unit


def _row(scheme, m, cos, err, var, checkpoint="SFT", family="llada"):
  return bench.Row(family, checkpoint, scheme, m, -1.0, 0.1, var, 1.0, cos, err, m, 24 * m, 1.0, 2.0)


def test_recommendation_takes_the_best_cosine_then_the_lowest_ratio_variance():
  rows = [_row("block_random", 2, 0.50, 0.01, 1e-3), _row("block_random", 2, 0.60, 0.01, 1e-3, "RL"),
          _row("random_t", 2, 0.80, 0.01, 5e-3), _row("random_t", 2, 0.80, 0.01, 5e-3, "RL"),
          # within two standard errors of random_t's 0.80, and a lower ratio variance: chosen
          _row("complementary", 2, 0.79, 0.01, 2e-3), _row("complementary", 2, 0.79, 0.01, 2e-3, "RL"),
          _row("mean_field", 2, 0.60, 0.0, 0.0), _row("mean_field", 2, 0.60, 0.0, 0.0, "RL")]
  line = bench.recommendation(rows, "llada", "block_random")
  assert line.startswith("- **LLaDA**: use `rl.scheme=complementary`: its gradient agrees")
  # Standard errors of the means over two checkpoints: sqrt(2 · 0.01²) / 2 = 0.007.
  assert "M=2: complementary cos 0.790 ± 0.007, Var[log ratio] 0.002; the default block_random " \
         "0.550 ± 0.007, 0.001" in line
  assert bench.recommendation(rows, "sdar", "block_t") == ""


def test_recommendation_keeps_the_default_within_the_noise():
  rows = [_row("random_t", 2, 0.80, 0.10, 5e-3), _row("block_random", 2, 0.70, 0.10, 1e-3),
          _row("random_t", 4, 0.90, 0.01, 5e-3), _row("block_random", 4, 0.70, 0.01, 1e-3)]
  line = bench.recommendation(rows, "llada", "block_random")
  # M=2: 0.80 - 0.70 < 2·hypot(0.1, 0.1); M=4 a clear win: not every budget, so no switch.
  assert "no single scheme beats `rl.scheme=block_random` at every budget; random_t beats it at " \
         "M=4" in line
  rows = rows[:2]
  assert bench.recommendation(rows, "llada", "block_random").startswith(
      "- **LLaDA**: keep `rl.scheme=block_random`: no scheme's gradient")
  rows = [_row("mean_field", 2, 0.9, 0.0, 0.0, family="sdar")._replace(var_elbo=0.0),
          _row("block_t", 2, 0.6, 0.05, 1e-3, family="sdar")]
  line = bench.recommendation(rows, "sdar", "block_t")
  assert "use `rl.scheme=mean_field`" in line and "deterministic" in line
  # The trajectory scores another quantity: never recommended, whatever its cosine.
  line = bench.recommendation(rows + [_row("trajectory", 2, 0.99, 0.0, 0.0, family="sdar")],
                              "sdar", "block_t")
  assert "trajectory" not in line and "use `rl.scheme=mean_field`" in line


def test_table_has_one_line_per_row():
  rows = [_row("random_t", 2, 0.8, 0.01, 5e-3), _row("complementary", 4, math.nan, math.nan, 1e-3)]
  text = bench.table(rows).splitlines()
  assert len(text) == 2 + len(rows)
  assert text[2].startswith("| LLaDA | SFT | random_t | 2 | -1.0000 | 0.1 | 0.005 | 1 | 0.800 ± 0.010 | 2 | 48 |")
  assert "| — ± — |" in text[3]
  with pytest.raises(ValueError, match="budgets"):
    bench.parse_budgets("2,0")


SMALL = {"model.n_layers": 1, "model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 2,
         "model.mlp_dim": 64, "task.num_train": 64, "task.num_test": 8, "eval.num_examples": 8,
         "sft.steps": 3}


def _workdir(tmp_path, steps):
  """A run's workdir by hand: config.json and checkpoints at `steps`, each with other weights."""
  c = config_lib.base_config("sdar")
  for key, value in SMALL.items():
    section, name = key.split(".")
    c[section][name] = value
  (tmp_path / "config.json").write_text(json.dumps(c.to_dict()))
  model, _, _ = cli.load_policy(c)
  ckpt = checkpointing.Checkpointer(str(tmp_path / "checkpoints"), keep=10, async_save=False)
  saved = {}
  for step in steps:
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x + 0.01 * (step + 1), params))
    ckpt.save(step, model, optim.stage_optimizer(model, c, "sft"), {"stage": "sft"})
    saved[step] = np.asarray(jax.tree.leaves(nnx.state(model, nnx.Param))[0])
  ckpt.close()
  return saved


def test_load_run_takes_the_sft_step_and_the_last_one(tmp_path):
  saved = _workdir(tmp_path, [2, 4, 6])
  policy = bench.load_run(str(tmp_path))
  assert [label for label, _ in policy.checkpoints] == ["SFT (step 2)", "after RL (step 6)"]
  for (_, model), step in zip(policy.checkpoints, (2, 6)):
    np.testing.assert_array_equal(jax.tree.leaves(nnx.state(model, nnx.Param))[0], saved[step])
  assert policy.family == bench.Family("sdar", True, 4, 0.0, 4)


def test_load_run_names_a_missing_sft_step(tmp_path):
  _workdir(tmp_path, [4, 6])
  with pytest.raises(cli.PolicyError, match=r"not the SFT stage's last step 2: train with"):
    bench.load_run(str(tmp_path))


@pytest.mark.slow
def test_the_script_measures_every_scheme_on_random_tiny_models(tmp_path, jax_cache_env):
  env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", **jax_cache_env}
  out = subprocess.run([sys.executable, _PATH, "--smoke", f"--root={tmp_path}", "--prompts=1",
                        "--budgets=2", "--draws=3", "--grad_draws=2", "--reference_samples=8",
                        "--repeats=1"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  text = (tmp_path / "estimators.md").read_text()
  for family in ("LLaDA", "SDAR"):
    for scheme in (*estimators.SCHEMES, estimators.TRAJECTORY):
      assert f"| {family} | random init | {scheme} | 2 |" in text
    assert f"- **{family}**: use `rl.scheme=" in text
  assert "--smoke" in text  # the exact command
