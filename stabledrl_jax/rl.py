"""One RL step, top to bottom: rollouts -> rewards -> group advantages -> the behaviour policy's
masks and log-probs -> μ optimiser updates -> rollout diagnostics (`step`), with its compiled
pieces (`behaviour_pass`, `update`) and its settings (`Settings`). The objectives they run are in
`objectives`, dynamic sampling in `dynamic_sampling`.

Shapes: `B` rollouts (groups of `G` contiguous), `M` Monte Carlo masks, `L` sequence slots, `C`
generated tokens, `P` prompt tokens.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import (diagnostics, dynamic_sampling, flops, likelihood, losses, lora, metrics,
                           objectives, optim, rollouts, samplers, sharding)
from stabledrl_jax.objectives import Objective, RLBatch, check
from stabledrl_jax.rollouts import DreamSampling, LLaDASampling, SDARSampling


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.rl` and the rollouts' `config.sampler` as the RL step's settings (`from_config`)."""
  objective: Objective
  sampling: LLaDASampling | SDARSampling | DreamSampling  # the rollouts'
  prompts_per_step: int
  updates_per_batch: int    # μ
  accumulation: int         # micro-batches per optimiser step
  advantage: str            # losses.group_advantages' mode
  filter_zero_advantage: bool
  max_prompt_draws: int
  update_norms: bool        # config.optim.update_norms: `optim.update_norms` every update

  def __post_init__(self):
    for key in ("prompts_per_step", "updates_per_batch", "accumulation", "max_prompt_draws"):
      check(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
    check(self.prompts_per_step % self.accumulation == 0, "accumulation", self.accumulation,
          f"must divide rl.prompts_per_step={self.prompts_per_step} (micro-batches hold whole groups)")
    check(self.advantage in ("mean", "mean_std", "leave_one_out"), "advantage", self.advantage,
          "expected mean, mean_std or leave_one_out")
    check(isinstance(self.filter_zero_advantage, bool), "filter_zero_advantage",
          self.filter_zero_advantage, "expected True or False")

  @classmethod
  def from_config(cls, c) -> Settings:
    r = c.rl
    return cls(Objective.from_config(c), rollouts.sampling_from_config(c, c.sampler.temperature),
               prompts_per_step=r.prompts_per_step, updates_per_batch=r.updates_per_batch,
               accumulation=r.accumulation, advantage=r.advantage,
               filter_zero_advantage=r.filter_zero_advantage, max_prompt_draws=r.max_prompt_draws,
               update_norms=c.optim.update_norms)


# ----------------------------------------------------------------------------- compiled pieces


@nnx.jit(static_argnames=("obj",))
def behaviour_pass(model, ref_model, seqs, advantages_B, key, obj: Objective):
  """The behaviour policy's masks and log-probs (and the reference's, with a KL term) for a
  rollout batch: `(RLBatch, token_entropy)`. `ref_model`: a model, or (LoRA) the reference's
  adapters alone as an `nnx.State`, put on the policy's frozen base (`lora.with_adapters`)."""
  if isinstance(ref_model, nnx.State):
    ref_model = lora.with_adapters(model, ref_model)
  masks, logp_old, adversarial, entropy, routes = objectives.behaviour_logp(model, seqs, key, obj)
  logp_ref = (likelihood.masked_logp(ref_model, seqs, masks.noised_BxMxL, staircase=obj.staircase,
                                     block_size=obj.block_size, copies_per_pass=obj.copies_per_pass)
              if ref_model is not None else jnp.zeros_like(logp_old))
  batch = RLBatch(seqs, advantages_B, masks.noised_BxMxL, masks.weight_BxMxL, logp_old,
                  jax.lax.stop_gradient(logp_ref), adversarial, routes)
  return batch, entropy


# The update donates the model and optimiser buffers: XLA updates them in place, so the old and
# the new weights and moments never coexist (for 8B that is the difference between fitting or not).
@nnx.jit(static_argnames=("obj", "accumulation", "norms"), donate_argnames=("model", "optimizer"))
def update(model, optimizer, batch: RLBatch, key, clip_epsilon=None, lr_scale=1.0, *,
           obj: Objective, accumulation: int, norms: bool = False):
  """One optimiser step over `accumulation` micro-batches of whole groups, on the trainable
  parameters (`lora.trainable`: the adapters alone when the model has any; with their dropout,
  the policy's passes here draw masks from the micro-batch's key, the behaviour, reference and
  rollout passes none).

  `clip_epsilon` (None: the objective's own) and `lr_scale` are traced, so the controls can move
  them every step without a recompile.
  """
  graphdef, params, rest = nnx.split(model, lora.trainable(model), ...)

  def loss_fn(p, micro, k):
    policy = nnx.merge(graphdef, p, rest)
    lora.set_dropout_key(policy, jax.random.fold_in(k, lora.DROPOUT_STREAM))
    return objectives.policy_loss(policy, micro, k, obj, clip_epsilon)

  mesh = jax.typeof(jax.tree.leaves(params)[0]).sharding.mesh  # abstract inside jit

  def micro_step(grads, xs):  # one micro-batch; lax.scan compiles it once for all of them
    micro, k = xs
    micro = sharding.constrain_batch(micro, mesh)  # each device computes its share of the rows
    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(params, micro, k)
    return jax.tree.map(jnp.add, grads, g), (loss, m)

  micro_batches = jax.tree.map(lambda x: x.reshape(accumulation, -1, *x.shape[1:]), batch)
  keys = jax.vmap(lambda a: jax.random.fold_in(key, a))(jnp.arange(accumulation))
  grads, (losses_A, metrics_A) = jax.lax.scan(
      micro_step, jax.tree.map(jnp.zeros_like, params), (micro_batches, keys))
  grads = jax.tree.map(lambda g: g / accumulation, grads)
  out = {k: jnp.mean(v) for k, v in metrics_A.items()}
  out["loss"] = jnp.mean(losses_A)
  return {**out, **optim.apply(model, optimizer, grads, norms=norms, lr_scale=lr_scale)}


# Op by op, every jnp call on a multi-process array is its own SPMD program; dozens of small ones in
# flight deadlocked a 2-process CPU (gloo) run once, each process blocked in a different op. So a
# step's rollout statistics are one compiled program each.
_advantages = jax.jit(losses.group_advantages, static_argnames=("group_size", "mode"))
_step_diagnostics = jax.jit(diagnostics.step_diagnostics, static_argnames=("group_size", "ngram"))


# ----------------------------------------------------------------------------- the step


def step(s: Settings, data, model, ref_model, optimizer, key, clip_epsilon: float | None = None,
         lr_scale: float = 1.0, rollout_mesh=None) -> metrics.StepResult:
  """One RL step (`s = Settings.from_config(config)`) on this process's
  next prompts of `data.rl`: rollouts -> rewards -> advantages -> behaviour log-probs -> μ
  optimiser updates -> diagnostics. With `rl.filter_zero_advantage` the rollouts are
  `dynamic_sampling.dynamic_sample`'s and the record adds its `groups_drawn`, `groups_kept`,
  `prompt_draws`."""
  obj, group = s.objective, s.objective.group_size
  dynamic = s.filter_zero_advantage
  if dynamic and jax.process_count() > 1:
    raise ValueError(f"config.rl.filter_zero_advantage=True: supported on one process only, not "
                     f"{jax.process_count()}")
  k_roll, k_mask, k_update = jax.random.split(key, 3)
  batch = next(data.rl)  # this process's prompts: rows [start, ...) of the step's B rollouts
  ids, mask, examples = dynamic_sampling.repeat_groups(batch, group)
  rows, start = s.prompts_per_step * group, data.rl_rows[0] * group

  t_rollout = time.perf_counter()
  sampled = None
  if dynamic:  # more prompt batches until enough groups have signal (`dynamic_sampling`)
    sampled = dynamic_sampling.dynamic_sample(s, data, model, batch, k_roll, rollout_mesh)
    rollout, host_rewards = sampled.rollout, sampled.rewards_B
    rollout_log = dynamic_sampling.merged_log(sampled.logs)
  else:
    rollout = samplers.generate(model, ids, mask, k_roll, s.sampling, rows=rows, start=start,
                                rollout_mesh=rollout_mesh)
    rollout_log = samplers.rollout_record(s.sampling, rollout, t_rollout)
    host_rewards = dynamic_sampling.score(data.tokenizer, rollout, examples, data.reward_fn, start)
  rewards = sharding.shard_batch(host_rewards, sharding.model_mesh(model), rows=rows, start=start)
  adv = (_advantages(rewards, group_size=group, mode=s.advantage) if obj.spec.weights == "advantage"
         else (rewards >= obj.rft_min_reward).astype(jnp.float32))
  t_behaviour = time.perf_counter()
  rl_batch, entropy = jax.block_until_ready(behaviour_pass(
      model, ref_model, rollouts.from_rollout(rollout), adv, k_mask, obj))
  t_update = time.perf_counter()
  eps = None if clip_epsilon is None else jnp.float32(clip_epsilon)
  outs = jax.block_until_ready([
      update(model, optimizer, rl_batch, jax.random.fold_in(k_update, u), eps,
             jnp.float32(lr_scale), obj=obj, accumulation=s.accumulation, norms=s.update_norms)
      for u in range(s.updates_per_batch)])
  t_done = time.perf_counter()

  record = {k: float(np.mean([float(o[k]) for o in outs])) for k in outs[0] if k != "skipped"}
  # The step's phases, wall clock (the first step's include compilation): rollout_s (sampler),
  # score_s (rewards and advantages), behaviour_s (old log-probs), update_s (the μ updates).
  record.update(score_s=t_behaviour - t_rollout - rollout_log["rollout_s"],
                behaviour_s=t_update - t_behaviour, update_s=t_done - t_update)
  record["skipped"] = int(sum(int(o["skipped"]) for o in outs))
  record["grad_norm_max"] = float(np.max([float(o["grad_norm"]) for o in outs]))  # nan if any is
  record["token_entropy"] = float(entropy)
  record.update(diagnostics.to_floats(_step_diagnostics(
      rewards_B=rewards, group_size=group, mask_BxL=rollout.completion_mask_BxC,
      tokens_BxL=rollout.completion_BxC)))
  record.update(rollout_log)
  length = rl_batch.seqs.tokens_BxL.shape[1]
  shape = flops.StepShape(
      rows=rl_batch.seqs.tokens_BxL.shape[0], prompt=ids.shape[1], gen=s.sampling.gen_length,
      total=length, samples=obj.num_samples, updates=s.updates_per_batch,
      sampler_steps=s.sampling.steps, staircase=obj.staircase, reference=ref_model is not None,
      block=s.sampling.head_slots,
      forwards=rollout_log["rollout_forwards"], forward_tokens=rollout_log["rollout_forward_tokens"])
  step_flops = flops.rl_step_flops(model.config, shape)
  if sampled is None:
    return metrics.StepResult(record, int(jnp.sum(rollout.lengths_B)), step_flops)
  # Dynamic sampling: the rollout FLOPs and generated tokens of every draw, summed.
  record.update(sampled.record)
  step_flops["rollout"] = sum(
      flops.rl_step_flops(model.config, dataclasses.replace(
          shape, forwards=log["rollout_forwards"], forward_tokens=log["rollout_forward_tokens"]))[
              "rollout"] for log in sampled.logs)
  return metrics.StepResult(record, sampled.tokens, step_flops)
