"""The training run: masked-diffusion SFT (`sft.step`), then RL (`rl.step`: StableDRL or a
baseline), with held-out evaluation, stability detectors and controls, metrics and preemption-safe
checkpoints. `main.py` is the command-line face of `run`.

One global step counter covers both stages (SFT steps first), 0-based in the console, in
metrics.jsonl and in the checkpoints alike, so a checkpoint's step says where a resumed run
continues. SFT runs `sft.steps` steps, or fewer with `sft.stop_at_accuracy` (`sft_validation`)
or `sft.patience` (`plateau`: RL then starts from the best-validation weights); the checkpoints
keep where it stopped, and RL's `rl.steps` follow. Every random draw of step `s`
comes from `fold_in(key(seed), s)`, and the data iterators are checkpointed, so a resumed run
repeats an uninterrupted one exactly.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from stabledrl_jax import (build, checkpointing, cli, config_lib, controls, detectors,
                           distributed, evaluate, export, flops, lora, metrics, models, optim,
                           preemption, rl, run_record, sft, storage)


class SetupError(Exception):
  """Bad input found before any training: a config value, a checkpoint path, a data file."""


@dataclasses.dataclass
class Run:
  """What the run loop works on; checkpointed: model, optimiser, data iterators, detectors,
  controls, the skipped-update count and where SFT ended."""
  config: ml_collections.ConfigDict
  settings: build.Settings
  workdir: str
  data: build.Data
  model: nnx.Module
  rollout_mesh: Any
  monitor: detectors.StabilityMonitor
  controls: controls.StepControls
  ckpt: checkpointing.Checkpointer
  sft_end: int  # the first RL step: sft.steps, or where SFT's stop rule stopped it
  optimizer: nnx.Optimizer | None = None
  writer: metrics.MetricsWriter | None = None
  ref_model: nnx.Module | nnx.State | None = None  # `reference_model`
  skipped: int = 0
  # sft.patience: the best validation check so far, {"accuracy", "step", "since"} (checks since)
  sft_best: dict = dataclasses.field(default_factory=dict)
  saved: int | None = None  # the step of the latest checkpoint this process started

  @property
  def total(self) -> int:
    return self.sft_end + self.config.rl.steps

  @property
  def stage_ends(self) -> dict[str, int]:
    return {"sft": self.sft_end, "rl": self.total}


def run(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train as configured in `workdir`, resuming from its latest checkpoint if there is one.

  Raises `SetupError` (one line naming the bad key, path or file and line) when the config, the
  checkpoint or the data is unusable; nothing has been trained or written over by then.
  """
  r = setup(c, workdir)
  try:
    step = resume(r)
  except checkpointing.CheckpointError as e:
    r.ckpt.close()
    raise SetupError(str(e)) from e
  for line in run_record.check(c.to_dict(), workdir, main_process=distributed.is_main(),
                               has_checkpoint=step > 0,
                               defaults=config_lib.base_config(c.family).to_dict()):
    distributed.log(line)  # recorded once the restore succeeded
  r.writer = metrics.MetricsWriter(workdir, total_steps=r.total, resume_step=step - 1 if step else None,
                                   stage_ends=r.stage_ends)
  try:
    with preemption.Listener() as preempt:
      while step < r.total:
        stopped = train_step(r, step)
        step += 1
        if stopped:
          distributed.log(f"stopped after step {step - 1}/{r.total} by {stopped.name} "
                          "(stability.stop_on_event); the checkpoint of this step is kept: change "
                          "the config and rerun the same command to resume")
          return {"stopped": stopped._asdict(), "skipped_updates": r.skipped}
        if preempt.agreed():
          if r.saved != step - 1:
            save(r, step - 1, stage_of(r, step - 1))
          r.ckpt.wait()
          distributed.log(f"preempted at step {step - 1}: saved; rerun the same command to resume")
          return {"preempted": step - 1, "skipped_updates": r.skipped}
    final = final_evaluation(r)
    out = export.export(c, r.model, storage.path(workdir) / "hf", replace=True)
    adapter = (f", its LoRA adapter alone: {export.adapter_dir(out)}"
               if lora.has_adapters(r.model) else "")
    distributed.log(f"policy: {out}{adapter}")
  finally:
    r.ckpt.wait()
    r.ckpt.close()
    r.writer.close()
  return summary(r, final)


def setup(c: ml_collections.ConfigDict, workdir: str) -> Run:
  """Settings, meshes, tokenizer, data, model, detectors, controls and the checkpointer."""
  try:
    s = build.settings(c)
    storage.check_bucket(workdir)
    storage.makedirs(storage.path(workdir))
    # A change the saved run cannot follow stops here; the record is written after the restore.
    run_record.check(c.to_dict(), workdir, main_process=False,
                     has_checkpoint=run_record.has_checkpoint(workdir),
                     defaults=config_lib.base_config(c.family).to_dict())
    mesh = build.mesh(c)
    rollout_mesh = build.rollout_mesh(c, mesh) if mesh.size > 1 else None
    tokenizer = build.tokenizer(c)
    data = build.data(c, tokenizer, workdir, mesh)
    model = build.model(c, tokenizer, mesh)
    build.check_positions(c, model)
  except (ValueError, KeyError, OSError) as e:
    raise SetupError(cli.error_text(e)) from e
  # The tuning guidance is for pretrained checkpoints, not the tiny from-scratch runs.
  for warning in controls.config_warnings(
      lr=c.rl.lr, group_size=c.rl.group_size, epsilon=c.rl.epsilon,
      max_ratio=c.rl.max_ratio or None, block_length=c.sampler.block_length,
      block_diffusion=c.family in models.BLOCK_DIFFUSION) if c.model.checkpoint else ():
    distributed.log(f"warning: {warning}")
  return Run(c, s, workdir, data, model, rollout_mesh, detectors.StabilityMonitor(s.monitor),
             controls.StepControls(s.controls, total=c.rl.steps, epsilon=s.rl.objective.epsilon),
             checkpointing.Checkpointer(storage.path(workdir) / "checkpoints", keep=c.checkpoint.keep),
             c.sft.steps)


def resume(r: Run) -> int:
  """The first step to run: 0, or the one after the latest checkpoint, restored into `r`."""
  def restore(step: int) -> tuple[dict, nnx.Optimizer]:
    meta = r.ckpt.read_meta(step)
    optimizer = optim.stage_optimizer(r.model, r.config, meta["stage"])
    return r.ckpt.restore(step, r.model, optimizer), optimizer

  found = r.ckpt.restore_latest(restore, fallback=r.config.checkpoint.fallback, set_aside=True,
                                log=distributed.log)
  if found is None:
    r.optimizer = optim.stage_optimizer(r.model, r.config, "sft" if r.config.sft.steps else "rl")
    return 0
  start, (meta, r.optimizer) = found
  r.data.sft.set_state(meta["sft_iterator"])
  r.data.rl.set_state(meta["rl_iterator"])
  r.skipped = meta["skipped_updates"]
  r.sft_end = meta.get("sft_end", r.config.sft.steps)
  r.sft_best = meta.get("sft_best", {})
  r.monitor.load_state_dict(meta.get("monitor") or r.monitor.state_dict())
  r.controls.load_state_dict(meta.get("controls") or {})
  distributed.log(f"resumed from {r.ckpt.directory} at step {start + 1}/{r.total}")
  return start + 1


def train_step(r: Run, step: int) -> detectors.Event | None:
  """Step `step` (SFT or RL), its metrics, and the evaluation and checkpoint due after it; the
  event that stops the run, if any."""
  c = r.config
  key = jax.random.fold_in(jax.random.key(c.seed), step)
  t0 = time.time()
  stopped = None
  if step < r.sft_end:
    stage = "sft"
    result = sft.step(r.settings.sft, r.data, r.model, r.optimizer, key, step)
    record = result.record
    record.update(sft_validation(r, step))
    stop = record.get("validation_accuracy", -1.0) >= c.sft.stop_at_accuracy > 0
    if c.sft.patience and "validation_accuracy" in record:
      stop = plateau(r, step, record["validation_accuracy"])
      if stop or step == r.sft_end - 1:
        record.update(sft_best_step=r.sft_best["step"], sft_best_accuracy=r.sft_best["accuracy"])
    if stop:
      r.sft_end = step + 1
      r.writer.total, r.writer.stage_ends = r.total, r.stage_ends
    sft_ends = step == r.sft_end - 1
    if sft_ends:  # checkpointed (the SFT policy); RL starts with a fresh optimiser
      r.optimizer = optim.stage_optimizer(r.model, c, "rl")
  else:
    sft_ends = False
    stage = "rl"
    result, events = rl_step(r, step, key)
    record = result.record
    stopped = events[0] if events and r.monitor.should_stop(events) else None
  r.skipped += int(record.pop("skipped", 0))
  record.update(stage=stage, skipped_updates=r.skipped,
                **metrics.throughput(result.flops, result.tokens, max(time.time() - t0, 1e-9),
                                     flops.peak_flops(jax.devices()[0].device_kind)))
  r.writer.write(step, record)
  if step % c.log_every == 0 or step == r.total - 1:
    r.writer.progress(step, stage, record)
  rl_index = step - r.sft_end + 1
  if stage == "rl" and rl_index % c.eval.every == 0 and step != r.total - 1:
    log_eval(r, step, f"after {rl_index} RL steps")
  if (step + 1) % c.checkpoint.every == 0 or step == r.total - 1 or stopped or sft_ends:
    save(r, step, stage_of(r, step))
  return stopped


def stage_of(r: Run, step: int) -> str:
  """The stage a checkpoint of step `step` resumes in (SFT's last step resumes in RL)."""
  return "sft" if step < r.sft_end - 1 else "rl"


def sft_validation(r: Run, step: int) -> dict[str, float]:
  """The SFT stop rule's check after SFT step `step`, when one is due: greedy accuracy and mean
  reward on the validation examples (training examples, never held-out ones), for the step's
  record. Greedy decoding of the same weights: a resumed run decides alike. Every
  `sft.check_every` steps; `sft.patience` checks the last SFT step too (it may be the best)."""
  c = r.config
  last = step == r.sft_end - 1
  if not (c.sft.stop_at_accuracy or c.sft.patience) or (last and not c.sft.patience) or (
      (step + 1) % c.sft.check_every and not last):
    return {}
  result, _ = evaluate.evaluate(c, r.model, r.data.tokenizer, r.data.task, r.data.validation,
                                rollout_mesh=r.rollout_mesh)
  reached = result["accuracy"] >= c.sft.stop_at_accuracy > 0
  distributed.log(f"validation after {step + 1} SFT steps: accuracy {result['accuracy']:.3f} on "
                  f"{result['num_examples']} training examples"
                  + (f"{', SFT stops here' if reached else ''} (sft.stop_at_accuracy="
                     f"{c.sft.stop_at_accuracy})" if c.sft.stop_at_accuracy else ""))
  return {"validation_accuracy": result["accuracy"], "validation_mean_reward": result["mean_reward"]}


def plateau(r: Run, step: int, accuracy: float) -> bool:
  """`sft.patience` after the check of SFT step `step`: the best weights so far are kept in
  WORKDIR/sft_best; whether SFT stops (`sft.patience` checks without a better accuracy, or its
  last step), then with the best weights put back into the model. Checks before the first
  non-zero accuracy do not count: a model that has not started to solve is not at a plateau."""
  c, best = r.config, r.sft_best
  path = storage.path(r.workdir) / "sft_best"
  if accuracy > best.get("accuracy", -1.0):
    checkpointing.save_params(path, r.model)
    r.sft_best = {"accuracy": accuracy, "step": step, "since": 0}
  else:
    r.sft_best = {**best, "since": best["since"] + (best["accuracy"] > 0)}
  stop = r.sft_best["since"] >= c.sft.patience
  if stop or step == r.sft_end - 1:
    checkpointing.restore_params(path, r.model)
    distributed.log(f"SFT stops after step {step}: its best validation accuracy "
                    f"{r.sft_best['accuracy']:.3f} was after step {r.sft_best['step']} (sft.patience="
                    f"{c.sft.patience} checks); RL starts from those weights")
  return stop


def rl_step(r: Run, step: int, key) -> tuple[metrics.StepResult, list[detectors.Event]]:
  """The RL step under the controls' ε and learning-rate factor, fed to the detectors."""
  c, sft_end = r.config, r.sft_end
  if step == sft_end or (r.ref_model is None and c.rl.kl_coef):
    if step == sft_end:
      log_eval(r, step, "before RL")
    if c.rl.kl_coef:  # frozen RL-start weights, kept only with a KL term
      r.ref_model = reference_model(r.model, storage.path(r.workdir) / "reference",
                                    fresh=step == sft_end)
  eps, lr_scale = r.controls.settings(step - sft_end)
  moves = r.settings.controls.moves_epsilon
  invalid = getattr(r.data.reward_fn, "invalid", 0)
  result = rl.step(r.settings.rl, r.data, r.model, r.ref_model, r.optimizer, key,
                   eps if moves else None, lr_scale, r.rollout_mesh)
  record = result.record
  record["invalid_rewards"] = getattr(r.data.reward_fn, "invalid", 0) - invalid
  r.controls.update(record)
  if moves:
    record.update(epsilon=eps, lr_scale=lr_scale)
  events = r.monitor.update(step, record)
  if events:
    record["events"] = [e.name for e in events]
    for e in events:
      distributed.log(f"stability event at step {step}: {e.message}")
  notes = {"invalid_rewards": f"{record['invalid_rewards']} rewards were NaN, infinite or outside "
                              "[0, 1], clipped (task.invalid_reward='clip')",
           "skipped": f"{record.get('skipped', 0)} of {c.rl.updates_per_batch} updates skipped "
                      "(a non-finite loss or gradient)"}
  for name, message in notes.items():
    if record.get(name):
      record.setdefault("events", []).append(name)
      distributed.log(f"event at step {step}: {message}")
  return result, events


def save(r: Run, at: int, stage: str) -> None:
  r.writer.flush()  # a checkpoint never gets ahead of the metrics a resumed run keeps
  r.ckpt.save(at, r.model, r.optimizer, {
      "stage": stage, "sft_iterator": r.data.sft.get_state(), "rl_iterator": r.data.rl.get_state(),
      "skipped_updates": r.skipped, "sft_end": r.sft_end, "sft_best": r.sft_best,
      "seed": r.config.seed, "monitor": r.monitor.state_dict(),
      "controls": r.controls.state_dict(),
      "rng_key": np.asarray(jax.random.key_data(jax.random.key(r.config.seed))).tolist()})
  r.saved = at


def log_eval(r: Run, at: int, tag: str) -> dict[str, float]:
  """The held-out evaluation (`evaluate.evaluate`, greedy) after step `at`, recorded and printed."""
  result, _ = evaluate.evaluate(r.config, r.model, r.data.tokenizer, r.data.task, r.data.test,
                                rollout_mesh=r.rollout_mesh)
  r.writer.write(at, {"tag": tag, **result}, eval_record=True)
  distributed.log(f"held-out {tag}: mean reward {result['mean_reward']:.3f}, accuracy "
                  f"{result['accuracy']:.3f} ({result['num_examples']} examples, {result['sampler']})")
  return result


def final_evaluation(r: Run) -> dict[str, float]:
  """The closing evaluation, unless a finished run already logged it (a rerun does not redo it)."""
  final_tag = "after RL" if r.config.rl.steps else "after SFT"
  r.writer.flush()
  done = [e for e in metrics.read_jsonl(r.writer.eval_path)  # of this total (rl.steps may grow)
          if e["tag"] == final_tag and e["step"] == r.total - 1]
  if jax.process_count() > 1:  # process 0 wrote the file: all follow its answer together
    done = done if multihost_utils.broadcast_one_to_all(bool(done)) else []
  return done[-1] if done else log_eval(r, r.total - 1, final_tag)


def summary(r: Run, final: dict[str, float]) -> dict[str, Any]:
  """Before/after accuracy on the console and the curves' PNG (process 0)."""
  if not distributed.is_main():
    return {"after": final, "skipped_updates": r.skipped}
  evals = metrics.read_jsonl(storage.path(r.workdir) / "eval.jsonl")
  before = next((e for e in evals if e["tag"] == "before RL"), None)
  if before is not None and r.config.rl.steps:
    f = metrics.number
    print(f"held-out before RL -> after RL: mean reward {f(before['mean_reward'])} -> "
          f"{f(final['mean_reward'])}, accuracy {f(before['accuracy'])} -> {f(final['accuracy'])}",
          flush=True)
  png = metrics.plot_curves(r.workdir)
  if png:
    print(f"curves: {png}", flush=True)
  return {"before": before, "after": final, "skipped_updates": r.skipped}


def copy_module(module, what=...):
  """A copy of `module` with its own buffers for the state `what` selects (default: all of it) and
  the rest shared (`nnx.clone` shares them all, and the steps donate theirs)."""
  copy = nnx.clone(module)
  nnx.update(copy, jax.tree.map(jnp.copy, nnx.state(copy, what)))
  return copy


def reference_model(model, path: str | storage.Path, *, fresh: bool) -> nnx.Module | nnx.State:
  """The KL reference: the weights at the start of RL, saved once there and reloaded on resume.
  A copy of the model; with LoRA adapters, the adapters' parameters alone (an `nnx.State` that
  `rl.behaviour_pass` puts on the policy's frozen base), so the base is never held twice."""
  adapted = lora.has_adapters(model)
  ref = copy_module(model, lora.ADAPTER if adapted else ...)
  if fresh or not storage.path(path).exists():
    if not fresh:
      distributed.log(f"warning: no KL reference at {path}; using the resumed weights")
    checkpointing.save_params(path, ref)  # a rerun from RL's first step replaces an old one
  else:
    checkpointing.restore_params(path, ref)
  # The copy shares the policy's base buffers, which the next update donates: keep its adapters.
  return nnx.state(ref, lora.ADAPTER) if adapted else ref
