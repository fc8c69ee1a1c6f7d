"""One RL step, top to bottom: rollouts -> rewards -> group advantages -> the behaviour policy's
masks and log-probs -> μ optimiser updates -> rollout diagnostics (`step`), with the compiled
pieces (`behaviour_pass`, `update`) next to the objectives they wrap (`policy_loss`).

Each objective maps (model, a batch of scored rollouts, the behaviour policy's log-probs under
the batch's masks) to `(loss, metrics)`. The behaviour policy's log-probs are computed once per
rollout batch and reused for all `μ` optimiser steps. The pure math is in `losses`, the model side
of the ELBO in `likelihood`, the mask draws in `estimators`.

Shapes: `B` rollouts (groups of `G` contiguous), `M` Monte Carlo masks, `L` sequence slots, `C`
generated tokens, `P` prompt tokens.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import (diagnostics, estimators, flops, likelihood, losses, lora, metrics,
                           models, optim, rollouts, samplers, sharding)
from stabledrl_jax.rollouts import DreamSampling, LLaDASampling, Rollout, SDARSampling, Sequences
from stabledrl_jax.tasks import pipeline

Array = jax.Array


class Spec(NamedTuple):
  """An objective's static properties (`OBJECTIVES`)."""
  loss: Callable      # (Scored, Objective, clip ε) -> (loss, metrics)
  clip: str | None    # "log_ratio": rl.epsilon / rl.max_ratio; "ppo": rl.ppo_epsilon; None
  token_level: bool   # per-token ratios: its clip fraction already counts tokens
  surrogate: str      # the policy term: "elbo" or "spg" (SPG's EUBO/ELBO mix)
  clip_higher: bool = False  # an upper clip of its own (rl.epsilon_high)
  # What `RLBatch.advantages_B` holds: group advantages (`rl.advantage`), or "correct": 1 for the
  # rollouts whose reward reaches rl.rft_min_reward, else 0 (rejection-sampling fine-tuning)
  weights: str = "advantage"


# Filled below the loss functions: objective name -> `Spec`.
OBJECTIVES: dict[str, Spec] = {}


def _check(ok: bool, key: str, value, why: str) -> None:
  if not ok:
    raise ValueError(f"config.rl.{key}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class Objective:
  """`config.rl` as the objective's static settings (`from_config`; the defaults are the
  config's). Hashable: part of the compiled step's signature."""
  name: str                 # `OBJECTIVES`
  group_size: int           # G
  scheme: str               # estimators.SCHEMES or estimators.TRAJECTORY
  num_samples: int          # M (trajectory: its forwards J = ceil(sampler.steps / trajectory_shrink))
  p_mask_prompt: float
  min_mask_prob: float      # ε: masking levels from [ε, 1] ([ε, 1 - ε] for complementary pairs)
  block_size: int           # sampler.block_length: the family's block
  staircase: bool           # SDAR's block-causal likelihood
  coupling: str             # "coupled" or "independent" old/new masks
  epsilon: float            # the objective's clip ε (`Spec.clip`), decided once by `from_config`
  max_ratio: float | None   # StableDRL: clip the ratio at this value from above only
  epsilon_high: float | None  # GRPO's upper clip (None: epsilon)
  kl_coef: float
  spg_omega: float
  spg_beta: float
  adversarial: float        # > 0: docs/method.md §8's ratio explosion on this fraction of the rollouts
  trajectory_shrink: int    # trajectory: decoding steps per forward (TraceRL's s)
  copies_per_pass: int      # C: the M masked copies go through the model C at a time (0: all)
  rft_min_reward: float     # rft: the reward a rollout must reach to be trained on
  routing_replay: bool      # mixture of experts: the new policy reuses the behaviour pass's experts

  def __post_init__(self):
    _check(self.name in OBJECTIVES, "objective", self.name, f"expected one of {tuple(OBJECTIVES)}")
    _check(self.scheme in (*estimators.SCHEMES, estimators.TRAJECTORY), "scheme", self.scheme,
           f"expected one of {(*estimators.SCHEMES, estimators.TRAJECTORY)}")
    _check(self.trajectory_shrink >= 1, "trajectory_shrink", self.trajectory_shrink, "must be >= 1")
    _check(self.copies_per_pass >= 0, "copies_per_pass", self.copies_per_pass,
           "must be >= 0 (0: every copy in one pass)")
    if self.scheme == estimators.TRAJECTORY:
      _check(self.spec.surrogate == "elbo", "objective", self.name,
             "SPG's upper bound needs random masks; rl.scheme=trajectory has none (use stabledrl, "
             "grpo, espo or wd1)")
      _check(not self.adversarial, "adversarial", self.adversarial,
             "the adversarial mode swaps random masks; rl.scheme=trajectory has none (set 0)")
    _check(self.coupling in ("coupled", "independent"), "coupling", self.coupling,
           "expected 'coupled' or 'independent'")
    _check(self.group_size >= (2 if self.spec.weights == "advantage" else 1), "group_size",
           self.group_size, "must be >= 1" if self.spec.weights != "advantage" else
           f"must be >= 2: {self.name}'s advantages compare the rollouts of a group (one alone "
           "has advantage 0 and nothing to learn)")
    _check(self.num_samples >= 1, "num_samples", self.num_samples, "must be >= 1")
    _check(self.scheme != "complementary" or self.num_samples % 2 == 0, "num_samples",
           self.num_samples, "rl.scheme=complementary draws masks in pairs: make it even")
    _check(self.epsilon >= 0, "epsilon", self.epsilon, "must be >= 0")
    _check(self.max_ratio is None or self.max_ratio > 0, "max_ratio", self.max_ratio,
           "must be > 0 (0 in the config = use epsilon)")
    _check(self.epsilon_high is None or (self.epsilon_high > 0 and self.spec.clip_higher),
           "epsilon_high", self.epsilon_high,
           f"rl.objective={self.name!r} has no upper clip of its own (GRPO has)")
    _check(0 <= self.p_mask_prompt <= 1, "p_mask_prompt", self.p_mask_prompt, "must lie in [0, 1]")
    _check(0 <= self.min_mask_prob < (0.5 if self.scheme == "complementary" else 1), "min_mask_prob",
           self.min_mask_prob, "must lie in [0, 1), and below 0.5 for rl.scheme=complementary")
    _check(not (self.staircase and self.p_mask_prompt), "p_mask_prompt", self.p_mask_prompt,
           "block diffusion never noises the prompt; set 0")
    _check(0 <= self.adversarial <= 1, "adversarial", self.adversarial,
           "must lie in [0, 1] (the fraction of rollouts; docs/method.md §8 uses 0.7)")
    if self.routing_replay:  # the replayed experts are those of the same tokens under the same masks
      _check(self.coupling == "coupled", "coupling", self.coupling,
             "rl.routing_replay reuses the behaviour pass's experts, which needs its masks: set coupled")
      _check(not self.adversarial, "adversarial", self.adversarial,
             "the adversarial mode swaps the new policy's masks; rl.routing_replay needs the "
             "behaviour pass's (set 0)")
      _check(self.copies_per_pass == 0, "copies_per_pass", self.copies_per_pass,
             "rl.routing_replay runs every copy in one pass (set 0)")

  @property
  def spec(self) -> Spec:
    return OBJECTIVES[self.name]

  @classmethod
  def from_config(cls, c) -> Objective:
    r = c.rl
    if r.objective not in OBJECTIVES:
      raise ValueError(f"config.rl.objective={r.objective!r}: expected one of {tuple(OBJECTIVES)}")
    if r.epsilon < 0 or r.max_ratio < 0:
      key = "epsilon" if r.epsilon < 0 else "max_ratio"
      raise ValueError(f"config.rl.{key}={r[key]!r}: must be >= 0")
    ppo = OBJECTIVES[r.objective].clip == "ppo"
    # The trajectory's masks are the rollout's: one forward per s steps (SDAR: per block), never
    # the prompt, the same for the old and the new policy; the mask keys do not apply to it.
    trajectory = r.scheme == estimators.TRAJECTORY
    forwards = -(-c.sampler.steps // max(r.trajectory_shrink, 1))
    return cls(name=r.objective, group_size=r.group_size, scheme=r.scheme,
               num_samples=forwards if trajectory else r.num_samples,
               p_mask_prompt=0.0 if trajectory else r.p_mask_prompt,
               min_mask_prob=r.min_mask_prob, block_size=c.sampler.block_length, staircase=c.family in models.BLOCK_DIFFUSION,
               coupling="coupled" if trajectory else r.coupling,
               epsilon=r.ppo_epsilon if ppo else r.epsilon,
               max_ratio=r.max_ratio or None, epsilon_high=r.epsilon_high or None,
               kl_coef=r.kl_coef, spg_omega=r.spg_omega, spg_beta=r.spg_beta,
               adversarial=r.adversarial, trajectory_shrink=r.trajectory_shrink,
               copies_per_pass=r.copies_per_pass, rft_min_reward=r.rft_min_reward,
               routing_replay=r.routing_replay)


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

  def __post_init__(self):
    for key in ("prompts_per_step", "updates_per_batch", "accumulation", "max_prompt_draws"):
      _check(getattr(self, key) >= 1, key, getattr(self, key), "must be >= 1")
    _check(self.prompts_per_step % self.accumulation == 0, "accumulation", self.accumulation,
           f"must divide rl.prompts_per_step={self.prompts_per_step} (micro-batches hold whole groups)")
    _check(self.advantage in ("mean", "mean_std", "leave_one_out"), "advantage", self.advantage,
           "expected mean, mean_std or leave_one_out")
    _check(isinstance(self.filter_zero_advantage, bool), "filter_zero_advantage",
           self.filter_zero_advantage, "expected True or False")

  @classmethod
  def from_config(cls, c) -> Settings:
    r = c.rl
    return cls(Objective.from_config(c), rollouts.sampling_from_config(c, c.sampler.temperature),
               prompts_per_step=r.prompts_per_step, updates_per_batch=r.updates_per_batch,
               accumulation=r.accumulation, advantage=r.advantage,
               filter_zero_advantage=r.filter_zero_advantage, max_prompt_draws=r.max_prompt_draws)


class Adversarial(NamedTuple):
  """The rows under the adversarial mode and their "easy" masks for the new policy's ELBO (the
  behaviour policy saw the "hard" ones): `estimators.adversarial_masks`."""
  rows_B: Array
  noised_BxMxL: Array
  weight_BxMxL: Array


class RLBatch(NamedTuple):
  seqs: Sequences
  advantages_B: Array
  noised_old_BxMxL: Array  # the behaviour policy's masks (also the new policy's when coupled)
  weight_old_BxMxL: Array
  logp_old_BxMxL: Array
  logp_ref_BxMxL: Array    # frozen reference model under the same masks; zeros when kl_coef = 0
  adversarial: Adversarial | None = None
  # rl.routing_replay: the experts the behaviour pass chose, [B, M, MoE layers, T, k]
  routes_old: Array | None = None


# ----------------------------------------------------------------------------- rollouts


def score(tokenizer, rollout: Rollout, examples, reward_fn, start: int = 0) -> np.ndarray:
  """Rewards of the rollouts `[start, start + len(examples))` (this process's), on the host."""
  completions = sharding.to_host(rollout.completion_BxC)[start:start + len(examples)]
  texts = pipeline.decode_completions(tokenizer, completions)
  return np.array([reward_fn(t, ex) for t, ex in zip(texts, examples)], np.float32)


# ----------------------------------------------------------------------------- objectives


def behaviour_logp(model, seqs: Sequences, key: Array, obj: Objective):
  """The old policy's masks and log-probs for a fresh rollout batch (no gradient):
  `(masks, logp_old_BxMxL, adversarial, token_entropy)`.

  `adversarial` is `None` unless `obj.adversarial > 0`; then the chosen rows' old masks are the
  "hard" ones. `token_entropy` is the mean entropy (nats) of the old policy's predictions at the
  masked counted positions of the rollouts, from the same forward pass.
  """
  masks = _draw_masks(key, seqs, obj)
  adversarial = None
  if obj.adversarial > 0:
    rows_B, easy, hard = estimators.adversarial_masks(
        jax.random.fold_in(key, 1), seqs.completion_BxL, seqs.counted_BxL,
        num_samples=obj.num_samples, fraction=obj.adversarial)
    masks = _where_rows(rows_B, hard, masks)
    adversarial = Adversarial(rows_B, easy.noised_BxMxL, easy.weight_BxMxL)
  out = likelihood.masked_logp(model, seqs, masks.noised_BxMxL, staircase=obj.staircase,
                               block_size=obj.block_size, with_entropy=True,
                               copies_per_pass=obj.copies_per_pass, with_routes=obj.routing_replay)
  (lp, ent), routes = out if obj.routing_replay else (out, None)
  seen = masks.weight_BxMxL != 0  # the masked counted positions (trajectory: each token once)
  entropy = jnp.sum(jnp.where(seen, ent, 0.0)) / jnp.maximum(jnp.sum(seen), 1)
  return masks, jax.lax.stop_gradient(lp), adversarial, jax.lax.stop_gradient(entropy), routes


def _draw_masks(key: Array, seqs: Sequences, obj: Objective) -> estimators.MaskSample:
  if obj.scheme == estimators.TRAJECTORY:  # no draw: the rollout's own steps
    return likelihood.trajectory(seqs, num_forwards=obj.num_samples, shrink=obj.trajectory_shrink,
                                 block_size=obj.block_size if obj.staircase else None)
  return likelihood.sample(key, seqs, scheme=obj.scheme, num_samples=obj.num_samples,
                           p_mask_prompt=obj.p_mask_prompt, block_size=obj.block_size,
                           min_mask_prob=obj.min_mask_prob)


def _where_rows(rows_B: Array, on: estimators.MaskSample,
                off: estimators.MaskSample) -> estimators.MaskSample:
  pick = rows_B[:, None, None]
  return estimators.MaskSample(jnp.where(pick, on.noised_BxMxL, off.noised_BxMxL),
                               jnp.where(pick, on.weight_BxMxL, off.weight_BxMxL))


def _per_token(logp_BxMxL: Array, noised_BxMxL: Array) -> tuple[Array, Array]:
  """Mean log-prob of each token over the samples in which it was masked, and 'ever masked'."""
  n = jnp.sum(noised_BxMxL, axis=1)
  total = jnp.sum(jnp.where(noised_BxMxL, logp_BxMxL, 0.0), axis=1)
  return total / jnp.maximum(n, 1), n > 0


class Scored(NamedTuple):
  """What every objective's loss reads: the batch and the new policy's log-probs under its masks."""
  batch: RLBatch
  logp_BxMxL: Array      # the new policy's per-token log-probs
  noised_BxMxL: Array    # the masks they were computed under
  log_ratio_B: Array     # ELBO log ratio new / old per sequence
  elbo_B: Array          # the new policy's ELBO per sequence
  lengths_B: Array       # counted completion tokens


def policy_loss(model, batch: RLBatch, key: Array, obj: Objective,
                clip_epsilon: Array | float | None = None) -> tuple[Array, dict[str, Array]]:
  """The configured objective's loss on one (micro-)batch of whole groups, and its metrics plus
  `kl_k1`/`kl_k3`: KL(π_old‖π_θ) per token, from the length-normalised ELBO log ratio, and (clipped
  objectives) `clipped_token_fraction`: the fraction of completion tokens whose weight was clipped.

  `clip_epsilon` (may be traced) replaces `obj.epsilon`, so adaptive or scheduled ε does not
  recompile the step.
  """
  if obj.coupling == "coupled":
    masks = estimators.MaskSample(batch.noised_old_BxMxL, batch.weight_old_BxMxL)
  else:
    masks = _draw_masks(key, batch.seqs, obj)
  if batch.adversarial is not None:
    adv = batch.adversarial
    masks = _where_rows(adv.rows_B, estimators.MaskSample(adv.noised_BxMxL, adv.weight_BxMxL), masks)
  noised, weight = masks
  logp_new = likelihood.masked_logp(model, batch.seqs, noised, staircase=obj.staircase,
                                    block_size=obj.block_size, copies_per_pass=obj.copies_per_pass,
                                    routes=batch.routes_old if obj.routing_replay else None)
  log_ratio, elbo_new = losses.elbo_ratio(logp_new, weight, batch.logp_old_BxMxL,
                                          batch.weight_old_BxMxL)
  lengths = jnp.sum(batch.seqs.counted_BxL, axis=-1)
  scored = Scored(batch, logp_new, noised, log_ratio, elbo_new, lengths)
  eps = obj.epsilon if clip_epsilon is None else clip_epsilon
  loss, metrics = obj.spec.loss(scored, obj, eps)
  if obj.spec.token_level and "clip_fraction" in metrics:  # it already counts tokens
    metrics["clipped_token_fraction"] = metrics["clip_fraction"]
  return loss, {**metrics, **diagnostics.kl_estimates(log_ratio / jnp.maximum(lengths, 1))}


def _surrogate(x: Scored, obj: Objective) -> Array:
  """The policy term each sequence's weight multiplies: its ELBO, or SPG's EUBO/ELBO mix."""
  if obj.spec.surrogate == "elbo":
    return x.elbo_B
  upper = losses.eubo(x.logp_BxMxL, x.noised_BxMxL, x.batch.seqs.counted_BxL, beta=obj.spg_beta)
  return losses.spg_surrogate(x.batch.advantages_B, x.elbo_B, upper, omega=obj.spg_omega)


def _stabledrl(x: Scored, obj: Objective, eps):
  return losses.snis_clip_loss(x.log_ratio_B, x.batch.advantages_B, _surrogate(x, obj),
                               group_size=obj.group_size, epsilon=eps, max_ratio=obj.max_ratio,
                               lengths=x.lengths_B)


def _grpo(x: Scored, obj: Objective, eps):
  b = x.batch
  new_at, old_at = x.noised_BxMxL, b.noised_old_BxMxL
  if obj.scheme == estimators.TRAJECTORY:  # a token counts in the one forward that committed it
    new_at = old_at = b.weight_old_BxMxL != 0
  lp_new, seen = _per_token(x.logp_BxMxL, new_at)
  lp_old, _ = _per_token(b.logp_old_BxMxL, old_at)
  lp_ref, _ = _per_token(b.logp_ref_BxMxL, old_at)
  return losses.grpo_clip_loss(lp_new - lp_old, b.advantages_B, epsilon=eps,
                               mask=b.seqs.counted_BxL & seen, epsilon_high=obj.epsilon_high,
                               ref_log_ratio=lp_ref - lp_new, kl_coef=obj.kl_coef)


def _espo(x: Scored, obj: Objective, eps):
  b = x.batch
  elbo_old = losses.mc_elbo(b.logp_old_BxMxL, b.weight_old_BxMxL)
  elbo_ref = losses.mc_elbo(b.logp_ref_BxMxL, b.weight_old_BxMxL)
  return losses.espo_loss(x.elbo_B, elbo_old, b.advantages_B, x.lengths_B, epsilon=eps,
                          kl_coef=obj.kl_coef, elbo_ref=elbo_ref)


def _spg(x: Scored, obj: Objective, eps):
  return losses.spg_loss(x.batch.advantages_B, _surrogate(x, obj), x.lengths_B)


def _spg_is(x: Scored, obj: Objective, eps):
  return losses.importance_weighted_loss(x.log_ratio_B, x.batch.advantages_B, _surrogate(x, obj),
                                         group_size=obj.group_size)


def _rft(x: Scored, obj: Objective, eps):
  return losses.rejection_sampling_loss(x.batch.advantages_B, x.elbo_B)


def _wd1(x: Scored, obj: Objective, eps):
  return losses.wd1_loss(x.batch.advantages_B, x.elbo_B, group_size=obj.group_size)


OBJECTIVES.update(
    stabledrl=Spec(_stabledrl, clip="log_ratio", token_level=False, surrogate="elbo"),
    stabledrl_spg=Spec(_stabledrl, clip="log_ratio", token_level=False, surrogate="spg"),
    grpo=Spec(_grpo, clip="ppo", token_level=True, surrogate="elbo", clip_higher=True),
    espo=Spec(_espo, clip="ppo", token_level=False, surrogate="elbo"),
    spg=Spec(_spg, clip=None, token_level=False, surrogate="spg"),
    wd1=Spec(_wd1, clip=None, token_level=False, surrogate="elbo"),
    spg_is=Spec(_spg_is, clip=None, token_level=False, surrogate="spg"),
    rft=Spec(_rft, clip=None, token_level=False, surrogate="elbo", weights="correct"),
)


# ----------------------------------------------------------------------------- compiled pieces


@nnx.jit(static_argnames=("obj",))
def behaviour_pass(model, ref_model, seqs, advantages_B, key, obj: Objective):
  """The behaviour policy's masks and log-probs (and the reference's, with a KL term) for a
  rollout batch: `(RLBatch, token_entropy)`. `ref_model`: a model, or (LoRA) the reference's
  adapters alone as an `nnx.State`, put on the policy's frozen base (`lora.with_adapters`)."""
  if isinstance(ref_model, nnx.State):
    ref_model = lora.with_adapters(model, ref_model)
  masks, logp_old, adversarial, entropy, routes = behaviour_logp(model, seqs, key, obj)
  logp_ref = (likelihood.masked_logp(ref_model, seqs, masks.noised_BxMxL, staircase=obj.staircase,
                                     block_size=obj.block_size, copies_per_pass=obj.copies_per_pass)
              if ref_model is not None else jnp.zeros_like(logp_old))
  batch = RLBatch(seqs, advantages_B, masks.noised_BxMxL, masks.weight_BxMxL, logp_old,
                  jax.lax.stop_gradient(logp_ref), adversarial, routes)
  return batch, entropy


# The update donates the model and optimiser buffers: XLA updates them in place, so the old and
# the new weights and moments never coexist (for 8B that is the difference between fitting or not).
@nnx.jit(static_argnames=("obj", "accumulation"), donate_argnames=("model", "optimizer"))
def update(model, optimizer, batch: RLBatch, key, clip_epsilon=None, lr_scale=1.0, *,
           obj: Objective, accumulation: int):
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
    return policy_loss(policy, micro, k, obj, clip_epsilon)

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
  return {**out, **optim.apply(model, optimizer, grads, lr_scale=lr_scale)}


# Op by op, every jnp call on a multi-process array is its own SPMD program; dozens of small ones in
# flight deadlocked a 2-process CPU (gloo) run once, each process blocked in a different op. So a
# step's rollout statistics are one compiled program each.
_advantages = jax.jit(losses.group_advantages, static_argnames=("group_size", "mode"))
_step_diagnostics = jax.jit(diagnostics.step_diagnostics, static_argnames=("group_size", "ngram"))


# ----------------------------------------------------------------------------- dynamic sampling


class Sampled(NamedTuple):
  """A step's rollouts under `rl.filter_zero_advantage` (`dynamic_sample`)."""
  rollout: Rollout  # the step's B rollouts (`select_groups`), one draw's shape
  rewards_B: np.ndarray      # their rewards, on the host
  logs: list                 # each draw's `samplers.rollout_record`
  tokens: int                # completion tokens generated over all the draws
  record: dict               # groups_drawn, groups_kept, prompt_draws


def has_signal(rewards_B: np.ndarray, group_size: int) -> np.ndarray:
  """`[N]`: whether each group's rewards differ (max > min, exactly). Only those groups have a
  non-zero advantage, whatever `rl.advantage`; a group with a NaN reward counts as without."""
  r_NxG = np.asarray(rewards_B, np.float32).reshape(-1, group_size)
  return r_NxG.max(axis=1) > r_NxG.min(axis=1)


def select_groups(signal_DxN: list[np.ndarray], want: int) -> list[tuple[int, int]]:
  """The step's `want` groups as (draw, group) pairs, in draw order: the first `want` drawn groups
  with signal and, when fewer have it, the earliest drawn groups without it to fill the batch."""
  drawn = [(d, n) for d, signal_N in enumerate(signal_DxN) for n in range(len(signal_N))]
  kept = [(d, n) for d, n in drawn if signal_DxN[d][n]][:want]
  fill = [(d, n) for d, n in drawn if not signal_DxN[d][n]][:want - len(kept)]
  return sorted(kept + fill)


@jax.jit
def _take_rows(base, source, pick_B, rows_B):
  """`base` with its row `b` replaced by `source`'s row `rows_B[b]` where `pick_B[b]`: one
  program for every draw, whatever it contributes."""
  def take(x, y):
    return jnp.where(pick_B.reshape(-1, *(1,) * (x.ndim - 1)), jnp.take(y, rows_B, axis=0), x)
  return jax.tree.map(take, base, source)


def _merged_log(logs: list[dict]) -> dict:
  """One rollout log for all the draws: seconds summed, forwards and forward tokens per rollout
  averaged over every drawn rollout (the draws are the same size), generated tokens/s overall."""
  if len(logs) == 1:
    return logs[0]
  seconds = sum(log["rollout_s"] for log in logs)
  tokens = sum(log["rollout_tokens_per_s"] * log["rollout_s"] for log in logs)
  mean = lambda k: float(np.mean([log[k] for log in logs]))
  return {**logs[0], "rollout_forwards": mean("rollout_forwards"),
          "rollout_forward_tokens": mean("rollout_forward_tokens"), "rollout_s": seconds,
          "rollout_tokens_per_s": tokens / seconds}


def dynamic_sample(s: Settings, data, model, batch, key, rollout_mesh=None) -> Sampled:
  """DAPO's dynamic sampling (`rl.filter_zero_advantage`), on one process.

  Rolls out and scores the step's prompts `batch` with `key` (as the plain step does), then further
  batches of `data.rl`, the d-th with `fold_in(key, d)`, until `rl.prompts_per_step` groups have
  rewards that differ (`has_signal`) or `rl.max_prompt_draws` batches are drawn. The step's batch
  (`select_groups`) has one draw's shape, so nothing recompiles; filler groups carry zero
  advantage and add nothing to the gradient. When the first draw's groups all have signal this
  is the plain step's batch, bit for bit.
  """
  group, want = s.objective.group_size, s.prompts_per_step
  drawn, rewards, signal, logs = [], [], [], []
  for d in range(s.max_prompt_draws):
    if d:
      batch = next(data.rl)
    ids, mask, examples = _repeat_groups(batch, group)
    t = time.perf_counter()
    drawn.append(samplers.generate(model, ids, mask, jax.random.fold_in(key, d) if d else key,
                                   s.sampling, rows=want * group, rollout_mesh=rollout_mesh))
    logs.append(samplers.rollout_record(s.sampling, drawn[-1], t))
    rewards.append(score(data.tokenizer, drawn[-1], examples, data.reward_fn))
    signal.append(has_signal(rewards[-1], group))
    if sum(int(np.sum(x)) for x in signal) >= want:
      break
  picks = select_groups(signal, want)
  rows_B = np.array([n * group + g for _, n in picks for g in range(group)], np.int32)
  rewards_B = np.concatenate([rewards[d][n * group:(n + 1) * group] for d, n in picks])
  rollout = drawn[0]
  if picks != [(0, n) for n in range(want)]:
    draw_B = np.repeat([d for d, _ in picks], group)
    for d, source in enumerate(drawn):
      if np.any(draw_B == d):
        rollout = _take_rows(rollout, source, draw_B == d, rows_B)
    rollout = sharding.shard_batch(rollout, sharding.model_mesh(model))
  tokens = sum(int(jnp.sum(r.lengths_B)) for r in drawn)
  kept = sum(int(signal[d][n]) for d, n in picks)
  record = {"groups_drawn": want * len(drawn), "groups_kept": kept, "prompt_draws": len(drawn)}
  return Sampled(rollout, rewards_B, logs, tokens, record)


def _repeat_groups(batch, group: int):
  """A prompt batch's ids, mask and examples, each prompt repeated `group` times (its group)."""
  return (np.repeat(batch["prompt_ids_BxP"], group, axis=0),
          np.repeat(batch["prompt_mask_BxP"], group, axis=0),
          [ex for ex in batch["examples"] for _ in range(group)])


# ----------------------------------------------------------------------------- the step


def step(s: Settings, data, model, ref_model, optimizer, key, clip_epsilon: float | None = None,
         lr_scale: float = 1.0, rollout_mesh=None) -> metrics.StepResult:
  """One RL step (`s = Settings.from_config(config)`) on this process's
  next prompts of `data.rl`: rollouts -> rewards -> advantages -> behaviour log-probs -> μ
  optimiser updates -> diagnostics. With `rl.filter_zero_advantage` the rollouts are
  `dynamic_sample`'s and the record adds its `groups_drawn`, `groups_kept`, `prompt_draws`."""
  obj, group = s.objective, s.objective.group_size
  dynamic = s.filter_zero_advantage
  if dynamic and jax.process_count() > 1:
    raise ValueError(f"config.rl.filter_zero_advantage=True: supported on one process only, not "
                     f"{jax.process_count()}")
  k_roll, k_mask, k_update = jax.random.split(key, 3)
  batch = next(data.rl)  # this process's prompts: rows [start, ...) of the step's B rollouts
  ids, mask, examples = _repeat_groups(batch, group)
  rows, start = s.prompts_per_step * group, data.rl_rows[0] * group

  t_rollout = time.perf_counter()
  sampled = None
  if dynamic:  # more prompt batches until enough groups have signal (`dynamic_sample`)
    sampled = dynamic_sample(s, data, model, batch, k_roll, rollout_mesh)
    rollout, host_rewards = sampled.rollout, sampled.rewards_B
    rollout_log = _merged_log(sampled.logs)
  else:
    rollout = samplers.generate(model, ids, mask, k_roll, s.sampling, rows=rows, start=start,
                                rollout_mesh=rollout_mesh)
    rollout_log = samplers.rollout_record(s.sampling, rollout, t_rollout)
    host_rewards = score(data.tokenizer, rollout, examples, data.reward_fn, start)
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
             jnp.float32(lr_scale), obj=obj, accumulation=s.accumulation)
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
