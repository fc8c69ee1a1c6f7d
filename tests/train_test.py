"""The trainer through its real entry point: smoke runs, kill -9 and resume, NaN skipping, bad input."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import (build, checkpointing, config_lib, evaluate, models, objectives, optim,
                           rl, rollouts, train)
from stabledrl_jax.tasks import sudoku

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMING = {"step_s", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_s_per_device", "mfu", "rollout_s",
          "rollout_tokens_per_s", "score_s", "behaviour_s", "update_s", "wall_s"}  # wall-clock dependent
REQUIRED = {"step", "loss", "grad_norm", "tokens_per_s", "skipped_updates"}
RL_REQUIRED = REQUIRED | {"reward_mean", "clip_fraction", "ess", "log10_ratio_max", "rollout_s",
                          "score_s", "behaviour_s", "update_s"}


def main_cmd(config, workdir, *overrides):
  return [sys.executable, "-m", "stabledrl_jax.main", f"--config={config}", f"--workdir={workdir}",
          *overrides]


def run_main(config, workdir, *overrides, timeout=600):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  return subprocess.run(main_cmd(config, workdir, *overrides), cwd=REPO, capture_output=True,
                        text=True, timeout=timeout, env=env)


def kill_once_written(cmd, path, timeout=300):
  """Run `cmd` (a main command) until `path` (a checkpoint) exists, then SIGKILL it."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + timeout
  while not path.exists() and time.time() < deadline and proc.poll() is None:
    time.sleep(0.05)
  assert path.exists(), f"the run never wrote {path}"
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()


def read_jsonl(path):
  return [json.loads(line) for line in open(path) if line.strip()]


def strip_timing(rows):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/sdar.py:smoke"])  # LLaDA's: rehearsal_test.py
def test_smoke_preset_trains_end_to_end(config, tmp_path):
  out = run_main(config, tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(12))
  assert all(REQUIRED <= set(r) for r in rows)
  assert [r["stage"] for r in rows] == ["sft"] * 6 + ["rl"] * 6
  assert all(RL_REQUIRED <= set(r) for r in rows[6:])
  assert rows[5]["loss"] < rows[0]["loss"] * 1.5 and np.isfinite([r["loss"] for r in rows]).all()
  tags = [e["tag"] for e in read_jsonl(tmp_path / "eval.jsonl")]
  assert tags[0] == "before RL" and tags[-1] == "after RL"
  assert "held-out before RL -> after RL: mean reward" in out.stdout
  assert (tmp_path / "curves.png").stat().st_size > 1000
  assert any((tmp_path / "tb").iterdir())
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [7, 11]


@pytest.mark.slow
def test_kill_9_mid_rl_then_rerun_matches_an_uninterrupted_run_and_keeps_the_kl_reference(tmp_path):
  # SIGKILL once step 7's checkpoint exists (RL: steps 6-11), rerun: it resumes at step 8. With a
  # KL term the resumed steps match only if the reference is still the RL-start model, reloaded
  # from disk, not the resumed one. On the mixture of experts (LLaDA2.0), with routing replay and
  # its frozen router: the other families' resumes are storage_test's, distributed_test's and
  # lora_test's.
  config = "configs/llada2.py:smoke"
  kl = ("--config.rl.objective=grpo", "--config.rl.kl_coef=0.5", "--config.rl.routing_replay=true")
  straight = tmp_path / "straight"
  out = run_main(config, straight, *kl)
  assert out.returncode == 0, out.stderr[-3000:]
  want = strip_timing(read_jsonl(straight / "metrics.jsonl"))
  assert any(abs(r.get("kl", 0.0)) > 0 for r in want[8:]), "the KL term never moved"

  killed = tmp_path / "killed"
  kill_once_written(main_cmd(config, killed, *kl), killed / "checkpoints" / "7")
  assert read_jsonl(killed / "metrics.jsonl")[-1]["step"] < 11, "killed too late to test resumption"
  out = run_main(config, killed, *kl)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "resumed from" in out.stdout and "step 8/12" in out.stdout
  assert strip_timing(read_jsonl(killed / "metrics.jsonl")) == want
  assert (strip_timing(read_jsonl(killed / "eval.jsonl"))[-1]
          == strip_timing(read_jsonl(straight / "eval.jsonl"))[-1])


def _tiny_rl_setup(objective):
  cfg = config_lib.base_config("sdar")
  config_lib.apply_preset(cfg, "smoke")
  model = models.create(models.tiny(vocab_size=40, mask_token_id=3, eos_token_id=2, pad_token_id=0,
                                    stop_token_ids=(2,)), seed=0)
  opt = nnx.Optimizer(model, optim.make_optimizer(1e-2, 0, 10, cfg.optim), wrt=nnx.Param)
  obj = objective(group_size=2, scheme="block_t", num_samples=2, block_size=4, staircase=True)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(4, 40, size=(4, 12)), jnp.int32)
  completion = jnp.broadcast_to(jnp.arange(12) >= 4, (4, 12))
  seqs = rollouts.Sequences(tokens, jnp.broadcast_to(jnp.arange(12), (4, 12)), jnp.ones((4, 12), bool),
                              ~completion, completion, completion)
  batch, _ = rl.behaviour_pass(model, None, seqs, jnp.zeros(4), jax.random.key(1), obj)
  return model, opt, obj, batch


def test_nan_gradient_skips_the_update_and_is_counted(objective):
  model, opt, obj, batch = _tiny_rl_setup(objective)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  adv = jnp.array([1.0, -1.0, jnp.nan, 0.5])  # a NaN advantage poisons the gradient
  batch = batch._replace(advantages_B=adv)
  out = rl.update(model, opt, batch, jax.random.key(2), obj=obj, accumulation=1)
  assert bool(out["skipped"]) and not np.isfinite(float(out["grad_norm"]))
  after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  # ... and a finite step right after does update the parameters.
  batch = batch._replace(advantages_B=jnp.array([1.0, -1.0, 0.5, -0.5]))
  out = rl.update(model, opt, batch, jax.random.key(3), obj=obj, accumulation=2)
  assert not bool(out["skipped"])
  changed = jax.tree.map(lambda a, b: bool(np.any(a != np.asarray(b))), before,
                         nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert any(jax.tree.leaves(changed))


def test_coupled_masks_give_unit_ratios_on_the_first_update(objective):
  model, opt, obj, batch = _tiny_rl_setup(objective)
  batch = batch._replace(advantages_B=jnp.array([1.0, -1.0, 0.5, -0.5]))
  out = rl.update(model, opt, batch, jax.random.key(2), obj=obj, accumulation=1)
  # π_θ = π_old, so every ratio is 1 up to float32 rounding: the behaviour pass and the update are
  # different XLA programs (the update's forward is fused with its backward and rematerialised
  # under jax.checkpoint), whose per-token log-probs differ by a few ulp (4.8e-7 measured on CPU,
  # which made the ratio 1 + 2.4e-7 before this tolerance), never bitwise-equal by contract.
  assert abs(float(out["log10_ratio_max"])) < 1e-6 and float(out["ess"]) == pytest.approx(2.0)
  assert float(out["clipped_token_fraction"]) == 0.0
  assert abs(float(out["kl_k1"])) < 1e-6 and abs(float(out["kl_k3"])) < 1e-6  # π_θ = π_old
  out = rl.update(model, opt, batch, jax.random.key(3), obj=obj, accumulation=1)
  assert float(out["kl_k3"]) > 0  # the first update moved the policy


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_traced_epsilon_and_lr_scale(objective):
  model, opt, obj, batch = _tiny_rl_setup(objective)
  batch = batch._replace(advantages_B=jnp.array([1.0, -1.0, 0.5, -0.5]))
  rl.update(model, opt, batch, jax.random.key(2), obj=obj, accumulation=1)  # ratios leave 1
  # A traced ε gives what the same ε as a static setting gives.
  static = objectives.Objective(**{**obj.__dict__, "epsilon": 0.0})
  for o, eps in ((static, None), (obj, jnp.float32(0.0))):
    m, s = train.copy_module(model), train.copy_module(opt)
    out = rl.update(m, s, batch, jax.random.key(3), eps, obj=o, accumulation=1)
    assert float(out["clip_fraction"]) == 1.0 and float(out["clipped_token_fraction"]) == 1.0
    if eps is None:
      want = _params(m)
    else:
      jax.tree.map(np.testing.assert_array_equal, want, _params(m))
  # lr_scale multiplies the applied step (and 0 leaves the parameters as they were).
  start = _params(model)
  deltas = {}
  for scale in (1.0, 0.5, 0.0):
    m, s = train.copy_module(model), train.copy_module(opt)
    rl.update(m, s, batch, jax.random.key(3), None, jnp.float32(scale), obj=obj, accumulation=1)
    deltas[scale] = jax.tree.map(lambda a, b: b - a, start, _params(m))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, 0.5 * b, atol=1e-7), deltas[0.5], deltas[1.0])
  jax.tree.map(lambda a: np.testing.assert_array_equal(a, 0.0), deltas[0.0])
  assert any(np.any(d != 0) for d in jax.tree.leaves(deltas[1.0]))


@pytest.mark.slow
def test_controls_and_adversarial_mode_run_through_main(tmp_path):
  out = run_main("configs/sdar.py:smoke", tmp_path, "--config.controls.adaptive_epsilon=True",
                 "--config.controls.adaptive_every=2", "--config.controls.drift=True",
                 "--config.controls.drift_threshold=0.0", "--config.rl.adversarial=0.7",
                 "--config.rl.epsilon=0.5")
  assert out.returncode == 0, out.stderr[-3000:]
  rl_rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["stage"] == "rl"]
  assert len(rl_rows) == 6
  assert rl_rows[0]["epsilon"] == 0.5 and len({r["epsilon"] for r in rl_rows}) > 1
  assert all(0 < r["lr_scale"] <= 1 for r in rl_rows) and rl_rows[-1]["lr_scale"] < 1
  assert max(r["log10_ratio_max"] for r in rl_rows) > 1  # coupled masks alone stay near 0
  assert all(r["token_entropy"] > 0 for r in rl_rows)


@pytest.mark.slow
def test_a_stability_event_stops_the_run_and_keeps_its_checkpoint(tmp_path):
  # kl_k3 >= 0 always, so a negative threshold makes the KL alarm fire on its 3rd RL step.
  out = run_main("configs/sdar.py:smoke", tmp_path, "--config.stability.kl_threshold=-1",
                 "--config.stability.stop_on_event=True", "--config.stability.repetition=False",
                 "--config.stability.zero_advantage=False")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "troubleshooting row 'kl_alarm'" in out.stdout and "stopped after step 8/12" in out.stdout
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(9)) and rows[-1]["events"] == ["kl_alarm"]
  assert "EVENT kl_alarm" in out.stdout
  assert 8 in [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]


@pytest.mark.parametrize("override,named", [
    ("--config.rl.bogus=1", "bogus"),
    ("--config.rl.steps=abc", "rl.steps"),
    ("--config.model.checkpoint=/nonexistent/ckpt", "model.checkpoint"),
    ("--config.rl.objective=ppo", "rl.objective"),
    ("--config.sampler.temperature=-1", "sampler.temperature"),
    ("--config.model.lora.rank=-1", "model.lora.rank"),
    ("--config.model.lora_init=/nonexistent/adapter", "model.lora_init"),
])
def test_bad_config_fails_fast_in_one_line_naming_the_key(override, named, tmp_path):
  out = run_main("configs/sdar.py:smoke", tmp_path / "run", override, timeout=120)
  assert out.returncode != 0
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], out.stderr
  assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran


def test_malformed_data_file_names_file_and_line(tmp_path):
  data = tmp_path / "gsm8k"
  data.mkdir()
  (data / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n{not json\n')
  (data / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
  out = run_main("configs/sdar.py:smoke", tmp_path / "run", "--config.task.name=gsm8k",
                 "--config.task.source=local", f"--config.task.source_dir={data}", timeout=120)
  assert out.returncode != 0
  error = out.stderr.strip().splitlines()[-1]  # TFDS announces the preparation on stderr first
  assert error.startswith("error: ") and "train.jsonl, line 2" in error, out.stderr
  assert "Traceback" not in out.stderr


def test_sft_puzzles_can_be_easier_than_rl_and_evaluation_puzzles(tmp_path):
  c = config_lib.base_config("sdar")
  config_lib.apply_preset(c, "sudoku")
  c.task.num_train, c.task.num_test, c.sft.batch_size, c.rl.prompts_per_step = 64, 16, 32, 32
  c.task.sft_blanks, c.task.blanks, c.eval.num_examples = 6, 11, 16
  data = build.data(c, build.tokenizer(c), str(tmp_path))
  train_grids, test_grids = set(sudoku.split_solutions("train")), set(sudoku.split_solutions("test"))
  sft = [ex for _ in range(2) for ex in next(data.sft)["examples"]]
  rl_examples = [ex for _ in range(2) for ex in next(data.rl)["examples"]]
  assert all(ex["solution"] in train_grids and ex["puzzle"].count("0") == 6 for ex in sft)
  assert all(ex["solution"] in train_grids and ex["puzzle"].count("0") == 11 for ex in rl_examples)
  assert all(ex["solution"] in test_grids and ex["puzzle"].count("0") == 11 for ex in data.test)
  c.task.sft_blanks = 13
  with pytest.raises(ValueError, match="task.sft_blanks"):
    config_lib.validate(c)
  c.task.sft_blanks, c.eval.num_examples = 8, 17  # more than the 16 held-out puzzles generated
  with pytest.raises(ValueError, match="eval.num_examples"):
    config_lib.validate(c)


@pytest.mark.slow
def test_sft_stops_at_the_validation_accuracy_and_a_resumed_run_keeps_where(tmp_path, monkeypatch):
  # The validation accuracies are scripted (0.25, then 0.5 against a target of 0.5): SFT stops
  # after its 4th step of at most 20, RL's 6 steps follow it, and a rerun from a checkpoint taken
  # after the stop repeats the uninterrupted run without validating again.
  c = config_lib.base_config("sdar")
  config_lib.apply_preset(c, "smoke")
  c.model.n_layers, c.model.d_model, c.model.mlp_dim = 1, 32, 64
  c.sft.steps, c.sft.stop_at_accuracy, c.sft.check_every, c.sft.validation_examples = 20, 0.5, 2, 8
  config_lib.validate(c)
  scripted, validated, real = iter([0.25, 0.5]), [], evaluate.evaluate

  def scripted_evaluate(config, model, tokenizer, task, examples, **kw):
    figures, rows = real(config, model, tokenizer, task, examples, **kw)
    if len(examples) == c.sft.validation_examples:
      validated.append(examples)
      figures = {**figures, "accuracy": next(scripted)}
    return figures, rows

  monkeypatch.setattr(evaluate, "evaluate", scripted_evaluate)
  train.run(c, str(tmp_path))
  rows = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["stage"] for r in rows] == ["sft"] * 4 + ["rl"] * 6
  assert [r.get("validation_accuracy") for r in rows[:4]] == [None, 0.25, None, 0.5]
  assert not any("validation_accuracy" in r for r in rows[4:])
  train_grids = set(sudoku.split_solutions("train"))
  assert len(validated) == 2 and all(ex["solution"] in train_grids for ex in validated[0])
  evals = [(e["tag"], e["step"]) for e in read_jsonl(tmp_path / "eval.jsonl")]
  assert evals[0] == ("before RL", 4) and evals[-1] == ("after RL", 9)
  ckpt = checkpointing.Checkpointer(str(tmp_path / "checkpoints"))
  assert sorted(ckpt.all_steps()) == [7, 9] and ckpt.read_meta(7)["sft_end"] == 4
  ckpt.close()

  shutil.rmtree(tmp_path / "checkpoints" / "9")
  train.run(c, str(tmp_path))  # a validation now would find the script exhausted
  assert strip_timing(read_jsonl(tmp_path / "metrics.jsonl")) == strip_timing(rows)
  assert len(validated) == 2


def test_an_unrestorable_checkpoint_stops_naming_the_step_before_the_record_changes(tmp_path):
  c = config_lib.base_config("sdar")
  c.model.update(n_layers=1, d_model=16, n_heads=2, n_kv_heads=2, mlp_dim=16)
  c.task.update(num_train=64, num_test=8)
  c.eval.num_examples = 8
  run_record_before = c.to_dict()
  (tmp_path / "config.json").write_text(json.dumps(run_record_before))
  (tmp_path / "checkpoints" / "2" / "meta").mkdir(parents=True)
  (tmp_path / "checkpoints" / "2" / "meta" / "metadata").write_text("")  # a damaged step 2
  c.rl.steps += 1  # a change a resumed run takes, recorded only once the restore succeeded
  c.checkpoint.fallback = False
  with pytest.raises(train.SetupError, match=(
      rf"^{tmp_path}/checkpoints/2: cannot restore \(JSONDecodeError: Expecting value: line 1 "
      r"column 1 \(char 0\)\); set checkpoint.fallback=True")):
    train.run(c, str(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text()) == run_record_before
  assert not (tmp_path / "metrics.jsonl").exists()
