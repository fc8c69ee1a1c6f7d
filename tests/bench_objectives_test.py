"""bench/objectives.py: its per-run figures against hand-computed numbers, and (slow) the whole
script at a few steps of a very small model."""
import json
import math
import os
import subprocess
import sys

import pytest

from bench import objectives as bench  # the script, as a module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PATH = bench.__file__
NAN, INF = math.nan, math.inf


def test_an_update_ten_times_the_running_median_is_an_explosion():
  # Medians of the per-step norms so far: 1, 1, 1, 1 (the 20 itself enters the fourth).
  assert bench.explosions([1.0, 1.0, 1.0, 20.0], [1.0, 1.0, 1.0, 20.0]) == [False] * 3 + [True]
  assert bench.explosions([1.0, 1.0, 1.0, 10.0], [1.0, 1.0, 1.0, 10.0]) == [False] * 4  # not above
  # The largest of a step's μ updates against the median of the steps' mean norms.
  assert bench.explosions([5.0, 25.0], [2.0, 2.0]) == [False, True]
  assert bench.explosions([15.0], [1.0]) == [True]  # the first step: its own mean is the median


def test_non_finite_norms_are_explosions_and_left_out_of_the_median():
  norms = [1.0, NAN, INF, 2.0, 25.0]
  assert bench.running_medians(norms)[1:] == [1.0, 1.0, 1.5, 2.0]
  assert bench.explosions(norms, norms) == [False, True, True, False, True]


def test_the_median_runs_with_the_steps():
  # Medians 1, 1.5, 2, 16, 30, 30: 30 explodes against 2 at the third step, not later.
  norms = [1.0, 2.0, 30.0, 30.0, 30.0, 30.0]
  assert bench.running_medians(norms) == [1.0, 1.5, 2.0, 16.0, 30.0, 30.0]
  assert bench.explosions(norms, norms) == [False, False, True, False, False, False]
  # Zero norms (no group with a learning signal) are no evidence of scale: no median, no explosion.
  assert bench.explosions([0.0, 0.0, 1.0], [0.0, 0.0, 1.0]) == [False] * 3
  assert bench.explosions([0.0, 11.0], [0.0, 1.0]) == [False, True]


def test_diff_std_and_the_held_out_curve():
  # Changes 0.2, -0.1, 0.2: mean 0.1, deviations 0.1, -0.2, 0.1, variance 0.06 / 3.
  assert bench.diff_std([0.1, 0.3, 0.2, 0.4]) == pytest.approx(math.sqrt(0.02))
  assert bench.diff_std([0.5, 0.5, 0.5]) == 0.0
  assert math.isnan(bench.diff_std([0.5]))
  evals = [{"tag": "after SFT", "step": 4, "mean_reward": 0.1},
           {"tag": "before RL", "step": 5, "mean_reward": 0.2},
           {"tag": "after 2 RL steps", "step": 6, "mean_reward": 0.3},
           {"tag": "after RL", "step": 8, "mean_reward": 0.5}]
  assert bench.held_out_curve(evals, first_rl_step=5) == [(0, 0.2), (2, 0.3), (4, 0.5)]


def _rows(n, sft=2, **per_step):
  rows = [{"step": s, "stage": "sft", "loss": 1.0} for s in range(sft)]
  for i in range(n):
    row = {"step": sft + i, "stage": "rl", "grad_norm": 1.0, "grad_norm_max": 2.0,
           "reward_mean": i / 10}
    row.update({k: v[i] for k, v in per_step.items() if v[i] is not None})
    rows.append(row)
  return rows


def test_summarise_rows_by_hand():
  events = [["kl_alarm"], None, ["low_entropy_collapse", "kl_alarm"], *[None] * 9]
  top = [2.0, "nan", "inf", *[2.0] * 8, 30.0]  # older runs wrote non-finite norms as strings
  rows = _rows(12, grad_norm_max=top, events=events)
  rows[2 + 1]["grad_norm"] = "nan"
  evals = [{"tag": "before RL", "step": 2, "mean_reward": 0.25},
           {"tag": "after 6 RL steps", "step": 7, "mean_reward": 0.5},
           {"tag": "after RL", "step": 13, "mean_reward": 0.25}]
  s = bench.summarise_rows(rows, evals)
  assert s["steps"] == 12 and s["finished"]
  assert s["explosion_rate"] == pytest.approx(3 / 12)  # nan, inf, and 30 > 10 x median 1
  assert (s["norm_mean"], s["norm_median"], s["norm_max"], s["nonfinite"]) == (1.0, 1.0, 30.0, 2)
  assert s["reward_first"] == pytest.approx(0.45) and s["reward_last"] == pytest.approx(0.65)
  assert s["reward_smoothness"] == pytest.approx(0.0, abs=1e-12)  # rewards rise by 0.1 each step
  assert s["held_out_smoothness"] == pytest.approx(0.25)  # changes +0.25, -0.25
  assert s["events"] == {"kl_alarm": 2, "low_entropy_collapse": 1}
  assert (s["collapses"], s["kl_alarms"]) == (1, 2)
  assert (s["before"], s["after"]) == (0.25, 0.25)
  assert s["held_out_curve"] == [(0, 0.25), (6, 0.5), (12, 0.25)]
  assert s["norm_curve"][0] == (1, 2.0) and math.isnan(s["norm_curve"][1][1])


def test_started_from_the_sft_checkpoint():
  rl = [r for r in _rows(3, sft=4) if r["stage"] == "rl"]
  before = [{"tag": "before RL", "step": 4, "mean_reward": 0.0}]
  assert bench.started_from(rl, before, sft_steps=4) is None
  assert "SFT steps" in bench.started_from(_rows(3, sft=4), before, sft_steps=4)
  assert "first RL step is 4" in bench.started_from(rl, before, sft_steps=2)
  assert "before RL" in bench.started_from(rl, [], sft_steps=4)


def test_spread_and_mean_curve():
  assert bench.spread([1.0, 3.0, NAN]) == (2.0, 2.0)
  assert all(math.isnan(v) for v in bench.spread([NAN]))
  assert bench.mean_curve([[(1, 1.0), (2, NAN)], [(1, 3.0), (2, 4.0)]]) == [
      (1, 2.0, False), (2, 4.0, True)]


def test_plan_and_regimes():
  published, family = bench.published_settings("configs/sdar.py")
  assert family == "sdar"
  assert published == {"rl.scheme": "block_t", "rl.num_samples": 2, "rl.coupling": "coupled",
                       "rl.updates_per_batch": 2, "rl.epsilon": 5.0, "rl.max_ratio": 5.0,
                       "rl.ppo_epsilon": 0.5}
  settings = bench.regimes(published, 1e-4, ["published", "noisy"], [], family)
  assert settings["noisy"] == {"rl.num_samples": 1, "rl.coupling": "independent",
                               "rl.updates_per_batch": 4, "optim.grad_clip": 0.2, "rl.lr": 1e-4}
  runs = bench.plan(list(bench.OBJECTIVES), settings, [], [0, 1, 2])
  assert len(runs) == 2 * 4 * 3
  assert runs[0] == bench.Run("published", "stabledrl", 0, {**published,
                                                             "rl.objective": "stabledrl"})
  runs = bench.plan(["grpo"], settings, ["eps_sweep", "wd1"], [0])
  assert [(r.regime, r.variant) for r in runs] == [
      ("published", "grpo"), ("published", "wd1"), ("noisy", "grpo"), ("noisy", "wd1"),
      ("noisy", "stabledrl"), ("noisy", "stabledrl_eps100"), ("noisy", "stabledrl_eps1000"),
      ("noisy", "stabledrl_max_ratio5")]
  assert runs[-1].overrides["rl.max_ratio"] == 5.0 and runs[-1].overrides["rl.lr"] == 1e-4
  with pytest.raises(ValueError, match="LLaDA"):
    bench.regimes(published, 1e-4, ["noisy"], ["dual"], family)
  noclip = bench.regimes(published, 1e-4, ["noisy"], ["noclip"], family)["noisy_noclip"]
  assert noclip["optim.grad_clip"] == 1e9 and noclip["rl.num_samples"] == 1
  more = bench.regimes(published, 1e-4, [], [], family,
                       ["mu2:rl.updates_per_batch=2,optim.grad_clip=1e9"], [3e-4, 1e-3])
  assert list(more) == ["noisy_lr0.0003", "noisy_lr0.001", "mu2"]
  assert more["noisy_lr0.001"] == {**settings["noisy"], "rl.lr": 1e-3}
  assert more["mu2"] == {**settings["noisy"], "rl.updates_per_batch": "2", "optim.grad_clip": "1e9"}
  for bad in ("mu2", "mu2:", "mu2:rl.lr", "noisy:rl.lr=1"):
    with pytest.raises(ValueError, match="--regime="):
      bench.regimes(published, 1e-4, ["noisy"], [], family, [bad])


# The smallest run of the whole path (tests/custom_task_test.py's TINY, on the Sudoku default).
TINY = ("--config.model.n_layers=1", "--config.model.d_model=32", "--config.model.n_heads=2",
        "--config.model.n_kv_heads=2", "--config.model.mlp_dim=64", "--config.sft.steps=2",
        "--config.sft.batch_size=8", "--config.rl.prompts_per_step=2", "--config.rl.group_size=2",
        "--config.sampler.steps=2", "--config.task.num_train=16", "--config.task.num_test=4",
        "--config.eval.num_examples=4", "--config.eval.every=1", "--config.eval.batch_size=4")


@pytest.mark.slow
def test_the_script_runs_rl_from_one_sft_checkpoint(tmp_path, jax_cache_env):
  env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", **jax_cache_env}
  out = subprocess.run([sys.executable, _PATH, f"--root={tmp_path}", "--seeds=0",
                        "--objectives=stabledrl,grpo", "--regimes=noisy", "--rl_steps=2",
                        f"--record={tmp_path / 'record.json'}", "--parallel=2", "--", *TINY],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  text = (tmp_path / "objectives.md").read_text()
  assert "| noisy | StableDRL | 1/1 |" in text and "| noisy | GRPO (d1) | 1/1 |" in text
  record = json.loads((tmp_path / "record.json").read_text())
  assert [row[:2] for row in record["rows"]] == [["noisy", "StableDRL"], ["noisy", "GRPO (d1)"]]
  assert all(row[2].startswith("0: ") and len(row) == len(record["columns"])
             for row in record["rows"])
  assert (tmp_path / "objectives.png").stat().st_size > 0
  for obj in ("stabledrl", "grpo"):
    workdir = tmp_path / "noisy" / f"{obj}_seed0"
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["stage"]) for r in rows] == [(2, "rl"), (3, "rl")]  # no SFT of its own
    tags = [(e["tag"], e["step"]) for e in map(json.loads, (workdir / "eval.jsonl").open())]
    assert tags == [("before RL", 2), ("after 1 RL steps", 2), ("after RL", 3)]
    assert json.loads((workdir / "config.json").read_text())["rl"]["objective"] == obj


def _finished(seed, before, after, solved_before, solved_after, rate=0.0):
  return {"seed": seed, "finished": True, "before": before, "after": after,
          "solved_before": solved_before, "solved_after": solved_after, "explosion_rate": rate}


def test_the_frontier_cells_and_the_largest_rate_improving_on_every_seed(tmp_path):
  results = {  # StableDRL improves on both seeds at 1e-4, on one at 1e-3; ESPO collapses at 1e-3
      ("noisy_lr0.0001", "stabledrl"): [_finished(0, 0.6, 0.8, 0.4, 0.7, 0.1),
                                        _finished(1, 0.5, 0.7, 0.3, 0.5, 0.3)],
      ("noisy_lr0.001", "stabledrl"): [_finished(0, 0.6, 0.2, 0.4, 0.1),
                                       _finished(1, 0.5, 0.6, 0.3, 0.4)],
      ("noisy_lr0.001", "espo"): [_finished(0, 0.6, 0.29, 0.4, 0.0),
                                  {**_finished(1, 0.5, 0.3, 0.3, 0.9), "finished": False}],
      ("noisy", "espo"): [_finished(0, 0.6, 0.9, 0.4, 0.9)],  # not a frontier regime
  }
  cells = bench.frontier_cells(results, [1e-4, 1e-3])
  assert list(cells) == [("stabledrl", 1e-4), ("stabledrl", 1e-3), ("espo", 1e-3)]
  c = cells[("stabledrl", 1e-4)]
  assert (c["seeds"], c["accuracy"], c["reward"]) == ([0, 1], [0.7, 0.5], [0.8, 0.7])
  assert (c["improved"], c["collapsed"]) == (2, 0)
  assert c["explosion_rate"] == pytest.approx(0.2)
  assert (c["accuracy_before"], c["reward_before"]) == (pytest.approx(0.35), pytest.approx(0.55))
  assert (cells[("stabledrl", 1e-3)]["improved"], cells[("stabledrl", 1e-3)]["collapsed"]) == (1, 1)
  espo = cells[("espo", 1e-3)]  # the unfinished seed is left out; 0.29 < 0.5 x 0.6
  assert (espo["seeds"], espo["collapsed"], espo["improved"]) == ([0], 1, 0)
  assert bench.largest_improving_lr(cells, "stabledrl", seeds=2) == 1e-4
  assert bench.largest_improving_lr(cells, "espo", seeds=2) is None
  args = bench.argparse.Namespace(rl_steps=300)
  record = bench.frontier_record(cells, 2, args)
  assert record["rows"][0] == ["StableDRL", "0.0001", "0: 0.700, 1: 0.500", "0.600 (0.200)",
                               "0.750 (0.100)", "2/2", "0/2", "0.200"]
  assert all(len(row) == len(record["columns"]) for row in record["rows"])
  assert "StableDRL: 0.0001; ESPO: no rate run on all 2 seeds" in record["notes"]
  espo_done = {**cells, ("espo", 1e-4): {**cells[("espo", 1e-3)], "seeds": [0, 1]}}
  assert "ESPO: none" in bench.frontier_record(espo_done, 2, args)["notes"]
  bench.plot_frontier(cells, str(tmp_path / "frontier.png"))
  assert (tmp_path / "frontier.png").stat().st_size > 0
