"""The RL objectives: each maps (model, a batch of scored rollouts, the behaviour policy's
log-probs under the batch's masks) to `(loss, metrics)`, registered in `OBJECTIVES` by name with
its static properties (`Spec`); `Objective` is `config.rl` as an objective's settings, checked in
one place. `behaviour_logp` draws the masks and the old policy's log-probs once per rollout batch
(reused by all μ optimiser steps); `policy_loss` is the new policy's side. The pure math is in
`losses`, the model side of the ELBO in `likelihood`, the mask draws in `estimators`; the step
that runs them is `rl`.

Shapes: `B` rollouts (groups of `G` contiguous), `M` Monte Carlo masks, `L` sequence slots.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from stabledrl_jax import diagnostics, estimators, likelihood, losses, models
from stabledrl_jax.rollouts import Sequences

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


def check(ok: bool, key: str, value, why: str) -> None:
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
    check(self.name in OBJECTIVES, "objective", self.name, f"expected one of {tuple(OBJECTIVES)}")
    check(self.scheme in (*estimators.SCHEMES, estimators.TRAJECTORY), "scheme", self.scheme,
          f"expected one of {(*estimators.SCHEMES, estimators.TRAJECTORY)}")
    check(self.trajectory_shrink >= 1, "trajectory_shrink", self.trajectory_shrink, "must be >= 1")
    check(self.copies_per_pass >= 0, "copies_per_pass", self.copies_per_pass,
          "must be >= 0 (0: every copy in one pass)")
    if self.scheme == estimators.TRAJECTORY:
      check(self.spec.surrogate == "elbo", "objective", self.name,
            "SPG's upper bound needs random masks; rl.scheme=trajectory has none (use stabledrl, "
            "grpo, espo or wd1)")
      check(not self.adversarial, "adversarial", self.adversarial,
            "the adversarial mode swaps random masks; rl.scheme=trajectory has none (set 0)")
    check(self.coupling in ("coupled", "independent"), "coupling", self.coupling,
          "expected 'coupled' or 'independent'")
    check(self.group_size >= (2 if self.spec.weights == "advantage" else 1), "group_size",
          self.group_size, "must be >= 1" if self.spec.weights != "advantage" else
          f"must be >= 2: {self.name}'s advantages compare the rollouts of a group (one alone "
          "has advantage 0 and nothing to learn)")
    check(self.num_samples >= 1, "num_samples", self.num_samples, "must be >= 1")
    check(self.scheme != "complementary" or self.num_samples % 2 == 0, "num_samples",
          self.num_samples, "rl.scheme=complementary draws masks in pairs: make it even")
    check(self.epsilon >= 0, "epsilon", self.epsilon, "must be >= 0")
    check(self.max_ratio is None or self.max_ratio > 0, "max_ratio", self.max_ratio,
          "must be > 0 (0 in the config = use epsilon)")
    check(self.epsilon_high is None or (self.epsilon_high > 0 and self.spec.clip_higher),
          "epsilon_high", self.epsilon_high,
          f"rl.objective={self.name!r} has no upper clip of its own (GRPO has)")
    check(0 <= self.p_mask_prompt <= 1, "p_mask_prompt", self.p_mask_prompt, "must lie in [0, 1]")
    check(0 <= self.min_mask_prob < (0.5 if self.scheme == "complementary" else 1), "min_mask_prob",
          self.min_mask_prob, "must lie in [0, 1), and below 0.5 for rl.scheme=complementary")
    check(not (self.staircase and self.p_mask_prompt), "p_mask_prompt", self.p_mask_prompt,
          "block diffusion never noises the prompt; set 0")
    check(0 <= self.adversarial <= 1, "adversarial", self.adversarial,
          "must lie in [0, 1] (the fraction of rollouts; docs/method.md §8 uses 0.7)")
    if self.routing_replay:  # the replayed experts are those of the same tokens under the same masks
      check(self.coupling == "coupled", "coupling", self.coupling,
            "rl.routing_replay reuses the behaviour pass's experts, which needs its masks: set coupled")
      check(not self.adversarial, "adversarial", self.adversarial,
            "the adversarial mode swaps the new policy's masks; rl.routing_replay needs the "
            "behaviour pass's (set 0)")
      check(self.copies_per_pass == 0, "copies_per_pass", self.copies_per_pass,
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


# ----------------------------------------------------------------------------- the objectives


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
