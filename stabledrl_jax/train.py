"""The training run: masked-diffusion SFT, then RL (StableDRL or a baseline), with held-out
evaluation, metrics and preemption-safe checkpoints. `main.py` is the command-line face of `run`.

One global step counter covers both stages (SFT steps first), so a checkpoint's step says where
a resumed run continues. Every random draw of step `s` comes from `fold_in(key(seed), s)`, and
the data iterators are checkpointed, so a resumed run repeats an uninterrupted one exactly.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from stabledrl_jax import (checkpointing, config_lib, controls, diagnostics, distributed, flops,
                           likelihood, losses, metrics, models, rl, run_record, samplers,
                           sharding)
from stabledrl_jax import llada_cached
from stabledrl_jax import tasks
from stabledrl_jax.tasks import datasets, get_task, pipeline, sudoku
from stabledrl_jax.tasks.tokenizer import CharTokenizer, HFTokenizer


# ----------------------------------------------------------------------------- building blocks


def build_tokenizer(c: ml_collections.ConfigDict):
  if c.model.tokenizer == "char":
    return CharTokenizer()
  return HFTokenizer(c.model.tokenizer if os.path.isdir(c.model.tokenizer) else c.model.checkpoint)


def build_mesh(c: ml_collections.ConfigDict):
  """The device mesh of `config.mesh` (`data`, `fsdp`, `tensor`; -1 = the rest)."""
  try:
    return sharding.make_mesh(c.mesh.to_dict())
  except ValueError as e:
    raise ValueError(f"config.mesh={c.mesh.to_dict()}: {e}") from e


def build_rollout_mesh(c: ml_collections.ConfigDict, mesh):
  """The mesh of `config.rollout_mesh` over `mesh`'s devices, or None (roll out on `mesh`)."""
  sizes = c.rollout_mesh.to_dict()
  if not any(sizes.values()):
    return None
  if not all(sizes.values()):
    raise ValueError(f"config.rollout_mesh={sizes}: give every axis a size (-1 for the rest), "
                     "or leave all 0 to roll out on the training mesh")
  try:
    return sharding.make_mesh(sizes, mesh.devices.flat)
  except ValueError as e:
    raise ValueError(f"config.rollout_mesh={sizes}: {e}") from e


def build_model(c: ml_collections.ConfigDict, tokenizer, mesh=None) -> nnx.Module:
  """A random tiny model sized by the config, or a pretrained checkpoint, sharded on `mesh`."""
  if c.model.checkpoint:
    model, _ = models.load_pretrained(c.model.checkpoint, dtype=c.model.compute_dtype,
                                      mesh=mesh if mesh is not None and mesh.size > 1 else None,
                                      options=models.runtime_options(c.model))
    return model
  sdar = c.family == "sdar"
  cfg = models.preset(
      c.model.preset, family=c.family, model_type=c.family, vocab_size=tokenizer.vocab_size,
      d_model=c.model.d_model, n_layers=c.model.n_layers, n_heads=c.model.n_heads,
      n_kv_heads=c.model.n_kv_heads, head_dim=c.model.d_model // c.model.n_heads,
      mlp_dim=c.model.mlp_dim, qk_norm=sdar, mask_token_id=tokenizer.mask_id,
      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
      stop_token_ids=(tokenizer.eos_id,), block_size=c.model.block_size if sdar else None,
      compute_dtype=c.model.compute_dtype, **models.runtime_options(c.model))
  if mesh is not None and mesh.size > 1:
    return sharding.create_model(cfg, c.seed, mesh)
  return models.create(cfg, seed=c.seed)


def make_optimizer(lr: float, warmup: int, total: int, o: ml_collections.ConfigDict):
  """AdamW after global-norm clipping, warmup then linear decay; non-finite updates skipped."""
  decay = optax.linear_schedule(lr, 0.0, o.decay_steps or max(total - warmup, 1))
  schedule = decay if not warmup else optax.join_schedules(
      [optax.linear_schedule(0.0, lr, warmup), decay], [warmup])
  inner = optax.chain(optax.clip_by_global_norm(o.grad_clip),
                      optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay),
                      _scale_by_lr_scale())
  # The parameters and moments stay as they were when a gradient is not finite.
  return optax.apply_if_finite(inner, max_consecutive_errors=1_000_000)


def _scale_by_lr_scale() -> optax.GradientTransformationExtraArgs:
  """Multiplies the updates by the `lr_scale` passed to `update` (default 1): a traced
  learning-rate factor (the drift brake) that needs no recompile and no optimiser state."""
  def update(updates, state, params=None, *, lr_scale=1.0, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda u: u * jnp.asarray(lr_scale, u.dtype), updates), state
  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def sampling_settings(c: ml_collections.ConfigDict, temperature: float, rollout: bool = True):
  """Decoding settings; `sampler.cache` / `sampler.threshold` apply to rollouts only (evaluation
  passes `rollout=False` and keeps the exact sampler)."""
  s = c.sampler
  fast = {"cache": s.cache, "threshold": s.threshold or None} if rollout else {}
  if c.family == "llada":
    return samplers.LLaDASampling(gen_length=s.gen_length, block_length=s.block_length,
                                  steps=s.steps, temperature=temperature, remasking=s.remasking,
                                  **fast)
  threshold = {"threshold": s.threshold} if rollout and s.threshold else {}
  return samplers.SDARSampling(gen_length=s.gen_length, steps=s.steps, strategy=s.strategy,
                               temperature=temperature, block_size=c.model.block_size, **threshold)


def generate(model, prompt_ids, prompt_mask, key, sampling, *, rows: int | None = None,
             start: int = 0, rollout_mesh=None) -> samplers.Rollout:
  """Rollouts for a batch of prompts, the batch split over the model's mesh (if any). With
  several processes the host arrays are rows `[start, ...)` of a `rows`-row global batch.

  With a `rollout_mesh`, the weights and prompts are resharded onto it for decoding and the
  rollout comes back on the model's mesh.
  """
  fn = samplers.llada_generate if isinstance(sampling, samplers.LLaDASampling) else samplers.sdar_generate
  mesh = sharding.model_mesh(model)
  ids, mask = sharding.shard_batch((np.asarray(prompt_ids), np.asarray(prompt_mask)), mesh,
                                   rows=rows, start=start)
  if rollout_mesh is None:
    return fn(model, jnp.asarray(ids), jnp.asarray(mask), key, sampling)
  decoder = sharding.resharded(model, rollout_mesh)
  ids, mask = sharding.shard_batch((ids, mask), rollout_mesh)
  return sharding.shard_batch(fn(decoder, ids, mask, key, sampling), mesh)


def objective_settings(c: ml_collections.ConfigDict) -> rl.Objective:
  return rl.Objective(
      name=c.rl.objective, group_size=c.rl.group_size, scheme=c.rl.scheme,
      num_samples=c.rl.num_samples, p_mask_prompt=c.rl.p_mask_prompt,
      block_size=c.model.block_size if c.family == "sdar" else c.sampler.block_length,
      staircase=c.family == "sdar", coupling=c.rl.coupling, epsilon=c.rl.epsilon,
      max_ratio=c.rl.max_ratio or None, ppo_epsilon=c.rl.ppo_epsilon, kl_coef=c.rl.kl_coef,
      spg_omega=c.rl.spg_omega, spg_beta=c.rl.spg_beta, adversarial=c.rl.adversarial)


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


# ----------------------------------------------------------------------------- jitted steps


def copy_module(module):
  """A copy of `module` with its own buffers (`nnx.clone` shares them, and the steps donate theirs)."""
  copy = nnx.clone(module)
  nnx.update(copy, jax.tree.map(jnp.copy, nnx.state(copy)))
  return copy


# The steps donate the model and optimiser buffers: XLA updates them in place, so the old and the
# new weights and moments never coexist (for 8B that is the difference between fitting or not).
@nnx.jit(static_argnames=("scheme", "staircase", "block_size"),
         donate_argnames=("model", "optimizer"))
def sft_step(model, optimizer, seqs, key, *, scheme, staircase, block_size):
  def loss_fn(m):
    return rl.sft_loss(m, seqs, key, scheme=scheme, staircase=staircase, block_size=block_size)
  (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return {"loss": loss, "grad_norm": optax.tree.norm(grads), "skipped": ~_all_finite(grads)}


@nnx.jit(static_argnames=("obj",))
def behaviour_pass(model, ref_model, seqs, advantages_B, key, obj: rl.Objective):
  """The behaviour policy's masks and log-probs (and the reference's, with a KL term) for a
  rollout batch: `(RLBatch, token_entropy)`."""
  masks, logp_old, adversarial, entropy = rl.behaviour_logp(model, seqs, key, obj)
  logp_ref = (rl.logp(ref_model, seqs, masks.noised_BxMxL, obj) if ref_model is not None
              else jnp.zeros_like(logp_old))
  batch = rl.RLBatch(seqs, advantages_B, masks.noised_BxMxL, masks.weight_BxMxL, logp_old,
                     jax.lax.stop_gradient(logp_ref), adversarial)
  return batch, entropy


@nnx.jit(static_argnames=("obj", "accumulation"), donate_argnames=("model", "optimizer"))
def rl_step(model, optimizer, batch: rl.RLBatch, key, clip_epsilon=None, lr_scale=1.0, *,
            obj: rl.Objective, accumulation: int):
  """One optimiser step over `accumulation` micro-batches of whole groups.

  `clip_epsilon` (None: the objective's own) and `lr_scale` are traced, so the controls can move
  them every step without a recompile.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(p, micro, k):
    return rl.policy_loss(nnx.merge(graphdef, p, rest), micro, k, obj, clip_epsilon)

  def micro_step(grads, xs):  # one micro-batch; lax.scan compiles it once for all of them
    micro, k = xs
    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params, micro, k)
    return jax.tree.map(jnp.add, grads, g), (loss, m)

  micro_batches = jax.tree.map(lambda x: x.reshape(accumulation, -1, *x.shape[1:]), batch)
  keys = jax.vmap(lambda a: jax.random.fold_in(key, a))(jnp.arange(accumulation))
  grads, (losses_A, metrics_A) = jax.lax.scan(
      micro_step, jax.tree.map(jnp.zeros_like, params), (micro_batches, keys))
  grads = jax.tree.map(lambda g: g / accumulation, grads)
  optimizer.update(model, grads, lr_scale=lr_scale)
  out = {k: jnp.mean(v) for k, v in metrics_A.items()}
  out.update(loss=jnp.mean(losses_A), grad_norm=optax.tree.norm(grads),
             skipped=~_all_finite(grads))
  return out


# ----------------------------------------------------------------------------- data


@dataclasses.dataclass
class Data:
  task: Any
  tokenizer: Any
  sft: Any        # grain iterators (checkpointed) of this process's rows of each global batch
  rl: Any
  test: list      # held-out examples (all of them, on every process)
  reward_fn: Any
  sft_rows: tuple[int, int]  # this process's rows [start, stop) of an SFT batch
  rl_rows: tuple[int, int]   # ... of the RL prompts of a step (each repeated group_size times)


def process_rows(c: ml_collections.ConfigDict, mesh) -> tuple[tuple[int, int], tuple[int, int]]:
  """This process's rows of an SFT batch and of an RL step's prompts (whole groups)."""
  group = c.rl.group_size
  lo, hi = sharding.process_rows(mesh, c.rl.prompts_per_step * group)
  if lo % group or hi % group:
    raise ValueError(f"rl.prompts_per_step={c.rl.prompts_per_step}: process {jax.process_index()} "
                     f"holds rollouts [{lo}, {hi}), which splits a group of rl.group_size={group}; "
                     "make rl.prompts_per_step a multiple of the number of processes")
  return sharding.process_rows(mesh, c.sft.batch_size), (lo // group, hi // group)


def build_data(c: ml_collections.ConfigDict, tokenizer, workdir: str, mesh=None) -> Data:
  """Tasks and this process's data iterators (`mesh`: the run's, which decides the rows)."""
  sft_rows, rl_rows = process_rows(c, mesh)
  task = tasks.from_config(c.task)
  reward_fn = task.reward_fn(dict(c.task.reward_weights))
  kwargs: dict[str, Any] = dict(data_dir=c.task.data_dir or os.path.join(workdir, "data"),
                                source=c.task.source)
  if c.task.source == "local":
    kwargs["source_dir"] = c.task.source_dir
  elif c.task.source == "generated":
    kwargs.update(num_train=c.task.num_train, num_test=c.task.num_test, seed=c.seed)
  sft_kwargs = dict(kwargs)
  if c.task.source == "generated" and c.task.name == "sudoku":
    kwargs["blanks"] = c.task.blanks
    sft_kwargs["blanks"] = c.task.sft_blanks or c.task.blanks
  # Process 0 prepares the on-disk data (a shared workdir must not be written by all at once).
  several = jax.process_count() > 1
  if several and not distributed.is_main():
    multihost_utils.sync_global_devices("stabledrl_jax: data prepared")
  train = datasets.load_source(task, "train", **kwargs)
  test = datasets.load_source(task, "test", **kwargs)
  sft_train = train if sft_kwargs == kwargs else datasets.load_source(task, "train", **sft_kwargs)
  if several and distributed.is_main():
    multihost_utils.sync_global_devices("stabledrl_jax: data prepared")
  common = dict(max_prompt_len=c.task.max_prompt_len, style=c.task.prompt_style, chat=c.task.chat,
                num_threads=1)
  sft = iter(pipeline.prompt_batches(task, sft_train, tokenizer, batch_size=c.sft.batch_size,
                                     seed=c.seed, rows=sft_rows, **common))
  rl_it = iter(pipeline.prompt_batches(task, train, tokenizer, batch_size=c.rl.prompts_per_step,
                                       seed=c.seed + 1, rows=rl_rows, **common))
  return Data(task, tokenizer, sft, rl_it, [test[i] for i in range(min(len(test), c.eval.num_examples))],
              reward_fn, sft_rows, rl_rows)


def sft_targets(c: ml_collections.ConfigDict, task, examples, step: int, start: int) -> list[str]:
  """The SFT completions of `examples` (global rows `start`...): the task's references, or for
  Sudoku with `task.sft_unfilled` > 0 a weaker demonstrator's answers. Each row's draw depends only
  on (seed, step, global row), so resumed runs and any process count train on the same targets."""
  if c.task.name == "sudoku" and c.task.sft_unfilled:
    return [sudoku.unfilled_demonstration(ex, c.task.sft_unfilled,
                                          np.random.default_rng([c.seed, step, start + i]))
            for i, ex in enumerate(examples)]
  return [task.reference_completion(ex) for ex in examples]


def encode_completions(tokenizer, texts: list[str], gen_length: int) -> np.ndarray:
  """Completions, each ending in a stop token and padded with it to `gen_length`."""
  out = np.full((len(texts), gen_length), tokenizer.eos_id, np.int32)
  for i, text in enumerate(texts):
    ids = tokenizer.encode(text)
    if len(ids) >= gen_length:
      raise ValueError(f"SFT completion of {len(ids)} tokens does not fit "
                       f"sampler.gen_length={gen_length} (one slot is needed for the stop token)")
    out[i, :len(ids)] = ids
  return out


def score(data: Data, rollout: samplers.Rollout, examples, reward_fn, start: int = 0) -> np.ndarray:
  """Rewards of the rollouts `[start, start + len(examples))` (this process's), on the host."""
  completions = sharding.to_host(rollout.completion_BxG)[start:start + len(examples)]
  texts = pipeline.decode_completions(data.tokenizer, completions)
  return np.array([reward_fn(t, ex) for t, ex in zip(texts, examples)], np.float32)


def evaluate(c, data: Data, model, rollout_mesh=None) -> dict[str, float]:
  """Greedy decoding on the held-out examples: mean task score (`accuracy`) and solve rate.
  Every process decodes its share and grades all of them, so all get the same result."""
  sampling = sampling_settings(c, temperature=0.0, rollout=False)
  scores, solved = [], []
  for lo in range(0, len(data.test), c.eval.batch_size):
    exs = data.test[lo:lo + c.eval.batch_size]
    enc = pipeline.encode_prompts(data.task, exs, data.tokenizer, max_prompt_len=c.task.max_prompt_len,
                                  style=c.task.prompt_style, chat=c.task.chat)
    r = generate(model, enc["prompt_ids_BxL"], enc["prompt_mask_BxL"], jax.random.key(0), sampling,
                 rollout_mesh=rollout_mesh)
    texts = pipeline.decode_completions(data.tokenizer, sharding.to_host(r.completion_BxG))
    scores += [data.task.correctness(t, ex) for t, ex in zip(texts, exs)]
    solved += [data.task.is_correct(t, ex) for t, ex in zip(texts, exs)]
  return {"accuracy": float(np.mean(scores)), "solve_rate": float(np.mean(solved)),
          "num_examples": len(scores)}


# ----------------------------------------------------------------------------- the run


class SetupError(Exception):
  """Bad input found before any training: a config value, a checkpoint path, a data file."""


def run(c: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Train as configured in `workdir`, resuming from its latest checkpoint if there is one.

  Raises `SetupError` (one line naming the bad key, path or file and line) when the config, the
  checkpoint or the data is unusable; nothing has been trained or written over by then.
  """
  try:
    config_lib.validate(c)
    os.makedirs(workdir, exist_ok=True)
    for line in run_record.check(c.to_dict(), workdir, has_checkpoint=run_record.has_checkpoint(
        workdir), main_process=distributed.is_main()):
      distributed.log(line)
    mesh = build_mesh(c)
    rollout_mesh = build_rollout_mesh(c, mesh) if mesh.size > 1 else None
    tokenizer = build_tokenizer(c)
    data = build_data(c, tokenizer, workdir, mesh)
    model = build_model(c, tokenizer, mesh)
  except (ValueError, KeyError, OSError) as e:
    raise SetupError(str(e).strip("'\"") or repr(e)) from e
  sft_total, total = c.sft.steps, c.sft.steps + c.rl.steps
  obj = objective_settings(c)
  group = c.rl.group_size
  staircase = c.family == "sdar"
  sft_block = c.model.block_size if staircase else c.sampler.block_length

  def new_optimizer(stage: str) -> nnx.Optimizer:
    if stage == "sft":
      tx = make_optimizer(c.sft.lr, c.sft.warmup_steps, sft_total, c.optim)
    else:
      tx = make_optimizer(c.rl.lr, c.rl.warmup_steps, c.rl.steps * c.rl.updates_per_batch, c.optim)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    sharding.replicate_rest(optimizer, sharding.model_mesh(model))
    return optimizer

  # The tuning guidance is for pretrained checkpoints, not the tiny from-scratch runs.
  for warning in controls.config_warnings(
      lr=c.rl.lr, group_size=group, epsilon=c.rl.epsilon, max_ratio=c.rl.max_ratio or None,
      block_length=c.model.block_size if staircase else c.sampler.block_length,
      block_diffusion=staircase) if c.model.checkpoint else ():
    distributed.log(f"warning: {warning}")
  monitor = controls.StabilityMonitor(controls.MonitorConfig(**c.stability.to_dict()))
  step_controls = controls.StepControls(
      controls.ControlConfig(**c.controls.to_dict()), total=c.rl.steps,
      epsilon=c.rl.ppo_epsilon if c.rl.objective in ("grpo", "espo") else c.rl.epsilon)
  controlled = c.controls.epsilon_schedule or c.controls.adaptive_epsilon or c.controls.drift
  ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.checkpoint.keep)
  start = ckpt.latest_step()
  skipped_total = 0
  if start is None:
    step = 0
    optimizer = new_optimizer("sft" if sft_total else "rl")
  else:
    meta = ckpt.read_meta(start)
    optimizer = new_optimizer(meta["stage"])
    ckpt.restore(start, model, optimizer)
    data.sft.set_state(meta["sft_iterator"])
    data.rl.set_state(meta["rl_iterator"])
    skipped_total = meta["skipped_updates"]
    monitor.load_state_dict(meta.get("monitor") or monitor.state_dict())
    step_controls.load_state_dict(meta.get("controls") or {})
    step = start + 1
    distributed.log(f"resumed from {ckpt.directory} at step {start + 1}/{total}")
  writer = metrics.MetricsWriter(workdir, total_steps=total, resume_step=start)
  peak = flops.peak_flops(jax.devices()[0].device_kind)
  base_key = jax.random.key(c.seed)
  ref_model = None

  def save(at: int, stage: str):
    writer.flush()  # a checkpoint never gets ahead of the metrics a resumed run keeps
    ckpt.save(at, model, optimizer, {
        "stage": stage, "sft_iterator": data.sft.get_state(), "rl_iterator": data.rl.get_state(),
        "skipped_updates": skipped_total, "seed": c.seed, "monitor": monitor.state_dict(),
        "controls": step_controls.state_dict(),
        "rng_key": np.asarray(jax.random.key_data(base_key)).tolist()})

  def log_eval(at: int, tag: str):
    result = evaluate(c, data, model, rollout_mesh)
    writer.write(at, {"tag": tag, **result}, eval_record=True)
    distributed.log(f"held-out {tag}: accuracy {result['accuracy']:.3f}, solve rate "
                    f"{result['solve_rate']:.3f} ({result['num_examples']} examples)")
    return result

  stopped = None
  try:
    while step < total:
      key = jax.random.fold_in(base_key, step)
      t0 = time.time()
      if step < sft_total:
        stage = "sft"
        batch = next(data.sft)
        targets = sft_targets(c, data.task, batch["examples"], step, data.sft_rows[0])
        completions = encode_completions(data.tokenizer, targets, c.sampler.gen_length)
        seqs = likelihood.teacher_forced(
            jnp.asarray(batch["prompt_ids_BxL"]), jnp.asarray(batch["prompt_mask_BxL"]),
            jnp.asarray(completions), family=c.family, block_size=c.model.block_size,
            mask_id=model.config.mask_token_id)
        seqs = sharding.shard_batch(seqs, sharding.model_mesh(model), rows=c.sft.batch_size,
                                    start=data.sft_rows[0])
        out = sft_step(model, optimizer, seqs, key, scheme=c.sft.scheme, staircase=staircase,
                       block_size=sft_block)
        record = {k: float(v) for k, v in out.items()}
        tokens = c.sft.batch_size * c.sampler.gen_length
        rows, length = seqs.tokens_BxT.shape
        step_flops = {"update": 3.0 * flops.forward_flops(model.config, rows,
                                                          length * (2 if staircase else 1))}
        if step == sft_total - 1:  # the stage ends: RL starts with a fresh optimiser
          optimizer = new_optimizer("rl")
          next_stage = "rl"
        else:
          next_stage = "sft"
      else:
        stage = next_stage = "rl"
        if step == sft_total or (ref_model is None and c.rl.kl_coef):
          if step == sft_total:
            log_eval(step, "before RL")
          if c.rl.kl_coef:  # frozen RL-start weights, kept only with a KL term
            ref_model = reference_model(model, os.path.join(workdir, "reference"),
                                        fresh=step == sft_total)
        eps, lr_scale = step_controls.settings(step - sft_total)
        record = rl_iteration(c, data, model, ref_model, optimizer, key, obj, group,
                              eps if controlled else None, lr_scale, rollout_mesh)
        tokens = record.pop("_tokens")
        step_flops = record.pop("_flops")
        step_controls.update(record)
        if controlled:
          record.update(epsilon=eps, lr_scale=lr_scale)
        events = monitor.update(step, record)
        if events:
          record["events"] = [e.name for e in events]
          for e in events:
            distributed.log(f"stability event at step {step + 1}: {e.message}")
          if monitor.should_stop(events):
            stopped = events[0]
      skipped_total += int(record.pop("skipped", 0))
      wall = max(time.time() - t0, 1e-9)
      record.update(stage=stage, skipped_updates=skipped_total,
                    **throughput(step_flops, tokens, wall, peak))
      writer.write(step, record)
      if step % c.log_every == 0 or step == total - 1:
        writer.progress(step, stage, record)
      rl_index = step - sft_total + 1
      if stage == "rl" and rl_index % c.eval.every == 0 and step != total - 1:
        log_eval(step, f"after {rl_index} RL steps")
      if (step + 1) % c.checkpoint.every == 0 or step == total - 1 or stopped:
        save(step, next_stage)
      step += 1
      if stopped:
        distributed.log(f"stopped after step {step}/{total} by {stopped.name} "
                        "(stability.stop_on_event); the checkpoint of this step is kept: change the "
                        "config and rerun the same command to resume")
        return {"stopped": stopped._asdict(), "skipped_updates": skipped_total}
    final_tag = "after RL" if c.rl.steps else "after SFT"
    writer.flush()
    done = [e for e in metrics.read_jsonl(writer.eval_path)  # of this total (rl.steps may grow)
            if e["tag"] == final_tag and e["step"] == total - 1]
    if jax.process_count() > 1:  # process 0 wrote the file: all follow its answer together
      done = done if multihost_utils.broadcast_one_to_all(bool(done)) else []
    final = done[-1] if done else log_eval(total - 1, final_tag)  # a finished run is not redone
    from stabledrl_jax import export  # noqa: PLC0415 (export's command line imports train)
    distributed.log(f"policy: {export.export(c, model, os.path.join(workdir, 'hf'), replace=True)}")
  finally:
    ckpt.wait()
    ckpt.close()
    writer.close()
  if not distributed.is_main():
    return {"after": final, "skipped_updates": skipped_total}
  evals = metrics.read_jsonl(os.path.join(workdir, "eval.jsonl"))
  before = next((e for e in evals if e["tag"] == "before RL"), None)
  if before is not None and c.rl.steps:
    print(f"held-out accuracy before RL {before['accuracy']:.3f} -> after RL {final['accuracy']:.3f}",
          flush=True)
  png = metrics.plot_curves(workdir)
  if png:
    print(f"curves: {png}", flush=True)
  return {"before": before, "after": final, "skipped_updates": skipped_total}


def reference_model(model, path: str, *, fresh: bool) -> nnx.Module:
  """The KL reference: the weights at the start of RL, saved once there and reloaded on resume."""
  ref = copy_module(model)
  if fresh or not os.path.exists(path):
    if not fresh:
      distributed.log(f"warning: no KL reference at {path}; using the resumed weights")
    checkpointing.save_params(path, ref)  # a rerun from RL's first step replaces an old one
  else:
    checkpointing.restore_params(path, ref)
  return ref


# Op by op, every jnp call on a multi-process array is its own SPMD program; dozens of small ones in
# flight deadlocked a 2-process CPU (gloo) run once, each process blocked in a different op. So a
# step's rollout statistics are one compiled program each.
_advantages = jax.jit(losses.group_advantages, static_argnames=("group_size", "mode"))
_step_diagnostics = jax.jit(diagnostics.step_diagnostics, static_argnames=("group_size", "ngram"))


def rl_iteration(c, data: Data, model, ref_model, optimizer, key, obj: rl.Objective, group: int,
                 clip_epsilon: float | None = None, lr_scale: float = 1.0, rollout_mesh=None):
  """Rollouts -> rewards -> advantages -> behaviour log-probs -> μ optimiser steps."""
  k_roll, k_mask, k_update = jax.random.split(key, 3)
  batch = next(data.rl)  # this process's prompts: rows [start, ...) of the step's B rollouts
  ids = np.repeat(batch["prompt_ids_BxL"], group, axis=0)
  mask = np.repeat(batch["prompt_mask_BxL"], group, axis=0)
  examples = [ex for ex in batch["examples"] for _ in range(group)]
  rows, start = c.rl.prompts_per_step * group, data.rl_rows[0] * group
  sampling = sampling_settings(c, c.sampler.temperature)
  t_rollout = time.perf_counter()
  rollout = generate(model, ids, mask, k_roll, sampling, rows=rows, start=start,
                     rollout_mesh=rollout_mesh)
  rollout_log = llada_cached.rollout_record(sampling, rollout, t_rollout)
  rewards = sharding.shard_batch(score(data, rollout, examples, data.reward_fn, start),
                                 sharding.model_mesh(model), rows=rows, start=start)
  adv = _advantages(rewards, group_size=group, mode=c.rl.advantage)
  rl_batch, entropy = behaviour_pass(model, ref_model, likelihood.from_rollout(rollout), adv,
                                     k_mask, obj)
  eps = None if clip_epsilon is None else jnp.float32(clip_epsilon)
  outs = [rl_step(model, optimizer, rl_batch, jax.random.fold_in(k_update, u), eps,
                  jnp.float32(lr_scale), obj=obj, accumulation=c.rl.accumulation)
          for u in range(c.rl.updates_per_batch)]
  record = {k: float(np.mean([float(o[k]) for o in outs])) for k in outs[0] if k != "skipped"}
  record["skipped"] = int(sum(int(o["skipped"]) for o in outs))
  record["grad_norm_max"] = float(np.max([float(o["grad_norm"]) for o in outs]))  # nan if any is
  record["token_entropy"] = float(entropy)
  record.update(diagnostics.to_floats(_step_diagnostics(
      rewards_B=rewards, group_size=group, mask_BxL=rollout.completion_mask_BxG,
      tokens_BxL=rollout.completion_BxG)))
  record["_tokens"] = int(jnp.sum(rollout.lengths_B))
  record.update(rollout_log)
  seqs = rl_batch.seqs
  record["_flops"] = flops.rl_step_flops(model.config, flops.StepShape(
      rows=seqs.tokens_BxT.shape[0], prompt=ids.shape[1], gen=c.sampler.gen_length,
      total=seqs.tokens_BxT.shape[1], samples=obj.num_samples, updates=c.rl.updates_per_batch,
      sampler_steps=c.sampler.steps, block=obj.block_size, staircase=obj.staircase,
      reference=ref_model is not None))
  return record


def throughput(step_flops: dict[str, float], tokens: int, wall: float,
               peak: float | None = None) -> dict[str, float]:
  """Tokens/s (in all and per device), the analytic FLOPs of each phase (`flops_<phase>`), the
  achieved TFLOP/s per device over the step's wall time, and MFU against the device's bf16 `peak`
  FLOP/s where it is known (`flops.peak_flops`; not on CPU)."""
  n = jax.device_count()
  total = sum(step_flops.values())
  out = {"tokens_per_s": tokens / wall, "tokens_per_s_per_device": tokens / wall / n,
         **{f"flops_{k}": v for k, v in step_flops.items()},
         "tflops_per_s_per_device": total / wall / n / 1e12}
  if peak:
    out["mfu"] = total / wall / n / peak
  return out
