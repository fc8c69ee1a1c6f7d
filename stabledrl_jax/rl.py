"""RL and SFT objectives on a model: the glue between `likelihood` and the pure `losses`.

Each objective maps (model, a batch of scored rollouts, the behaviour policy's log-probs under
the batch's masks) to `(loss, metrics)`. The behaviour policy's log-probs are computed once per
rollout batch (`behaviour_logp`) and reused for all `μ` optimiser steps.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from stabledrl_jax import diagnostics, estimators, likelihood, losses

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Objective:
  """Static settings of the policy objective (hashable: part of the jitted step's signature)."""
  name: str = "stabledrl"
  group_size: int = 8
  scheme: str = "block_random"
  num_samples: int = 2
  p_mask_prompt: float = 0.0
  block_size: int = 32
  staircase: bool = False
  coupling: str = "coupled"
  epsilon: float = 5.0
  max_ratio: float | None = None
  ppo_epsilon: float = 0.5
  kl_coef: float = 0.0
  spg_omega: float = 0.5
  spg_beta: float = 1.5
  adversarial: float = 0.0  # > 0: docs/method.md §8's ratio explosion on this fraction of the rollouts


class Adversarial(NamedTuple):
  """The rows under the adversarial mode and their "easy" masks for the new policy's ELBO (the
  behaviour policy saw the "hard" ones): `estimators.adversarial_masks`."""
  rows_B: Array
  noised_BxMxL: Array
  weight_BxMxL: Array


class RLBatch(NamedTuple):
  seqs: likelihood.Sequences
  advantages_B: Array
  noised_old_BxMxL: Array  # the behaviour policy's masks (also the new policy's when coupled)
  weight_old_BxMxL: Array
  logp_old_BxMxL: Array
  logp_ref_BxMxL: Array    # frozen reference model under the same masks; zeros when kl_coef = 0
  adversarial: Adversarial | None = None


def draw_masks(key: Array, seqs: likelihood.Sequences, obj: Objective) -> estimators.MaskSample:
  return likelihood.sample(key, seqs, scheme=obj.scheme, num_samples=obj.num_samples,
                           p_mask_prompt=obj.p_mask_prompt, block_size=obj.block_size)


def logp(model, seqs: likelihood.Sequences, noised_BxMxL: Array, obj: Objective) -> Array:
  return likelihood.masked_logp(model, seqs, noised_BxMxL, staircase=obj.staircase,
                                block_size=obj.block_size)


def behaviour_logp(model, seqs: likelihood.Sequences, key: Array, obj: Objective):
  """The old policy's masks and log-probs for a fresh rollout batch (no gradient):
  `(masks, logp_old_BxMxL, adversarial, token_entropy)`.

  `adversarial` is `None` unless `obj.adversarial > 0`; then the chosen rows' old masks are the
  "hard" ones. `token_entropy` is the mean entropy (nats) of the old policy's predictions at the
  masked counted positions of the rollouts, from the same forward pass.
  """
  masks = draw_masks(key, seqs, obj)
  adversarial = None
  if obj.adversarial > 0:
    rows_B, easy, hard = estimators.adversarial_masks(
        jax.random.fold_in(key, 1), seqs.completion_BxL, seqs.counted_BxL,
        num_samples=obj.num_samples, fraction=obj.adversarial)
    masks = _where_rows(rows_B, hard, masks)
    adversarial = Adversarial(rows_B, easy.noised_BxMxL, easy.weight_BxMxL)
  lp, ent = likelihood.masked_logp(model, seqs, masks.noised_BxMxL, staircase=obj.staircase,
                                   block_size=obj.block_size, with_entropy=True)
  seen = masks.noised_BxMxL & seqs.counted_BxL[:, None, :]
  entropy = jnp.sum(jnp.where(seen, ent, 0.0)) / jnp.maximum(jnp.sum(seen), 1)
  return masks, jax.lax.stop_gradient(lp), adversarial, jax.lax.stop_gradient(entropy)


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


def policy_loss(model, batch: RLBatch, key: Array, obj: Objective,
                clip_epsilon: Array | float | None = None) -> tuple[Array, dict[str, Array]]:
  """The configured objective's loss on one (micro-)batch of whole groups, and its metrics plus
  `kl_k1`/`kl_k3`: KL(π_old‖π_θ) per token, from the length-normalised ELBO log ratio, and (clipped
  objectives) `clipped_token_fraction`: the fraction of completion tokens whose weight was clipped.

  `clip_epsilon` (may be traced) replaces the objective's clip ε — `obj.epsilon` for StableDRL,
  `obj.ppo_epsilon` for GRPO/ESPO — so adaptive or scheduled ε does not recompile the step.
  """
  if obj.coupling == "coupled":
    masks = estimators.MaskSample(batch.noised_old_BxMxL, batch.weight_old_BxMxL)
  else:
    masks = draw_masks(key, batch.seqs, obj)
  if batch.adversarial is not None:
    adv = batch.adversarial
    masks = _where_rows(adv.rows_B, estimators.MaskSample(adv.noised_BxMxL, adv.weight_BxMxL), masks)
  noised, weight = masks
  logp_new = logp(model, batch.seqs, noised, obj)
  log_ratio, elbo_new = losses.elbo_ratio(logp_new, weight, batch.logp_old_BxMxL,
                                          batch.weight_old_BxMxL)
  lengths = jnp.sum(batch.seqs.counted_BxL, axis=-1)
  loss, metrics = _objective(batch, logp_new, noised, log_ratio, elbo_new, lengths, obj,
                             clip_epsilon)
  if obj.name == "grpo":  # token-level ratios: the clip fraction already counts tokens
    metrics["clipped_token_fraction"] = metrics["clip_fraction"]
  return loss, {**metrics, **diagnostics.kl_estimates(log_ratio / jnp.maximum(lengths, 1))}


def _objective(batch: RLBatch, logp_new: Array, noised: Array, log_ratio: Array, elbo_new: Array,
               lengths: Array, obj: Objective, clip_epsilon: Array | float | None = None):
  seqs = batch.seqs
  adv = batch.advantages_B
  name = obj.name
  eps = obj.epsilon if clip_epsilon is None else clip_epsilon
  ppo_eps = obj.ppo_epsilon if clip_epsilon is None else clip_epsilon

  if name in ("stabledrl", "stabledrl_spg"):
    surrogate = elbo_new
    if name == "stabledrl_spg":
      upper = losses.eubo(logp_new, noised, seqs.counted_BxL, beta=obj.spg_beta)
      surrogate = losses.spg_surrogate(adv, elbo_new, upper, omega=obj.spg_omega)
    return losses.snis_clip_loss(log_ratio, adv, surrogate, group_size=obj.group_size,
                                 epsilon=eps, max_ratio=obj.max_ratio, lengths=lengths)
  if name == "grpo":
    lp_new, seen = _per_token(logp_new, noised)
    lp_old, _ = _per_token(batch.logp_old_BxMxL, batch.noised_old_BxMxL)
    lp_ref, _ = _per_token(batch.logp_ref_BxMxL, batch.noised_old_BxMxL)
    mask = seqs.counted_BxL & seen
    return losses.grpo_clip_loss(lp_new - lp_old, adv, epsilon=ppo_eps, mask=mask,
                                 ref_log_ratio=lp_ref - lp_new, kl_coef=obj.kl_coef)
  if name == "espo":
    elbo_old = losses.mc_elbo(batch.logp_old_BxMxL, batch.weight_old_BxMxL)
    elbo_ref = losses.mc_elbo(batch.logp_ref_BxMxL, batch.weight_old_BxMxL)
    return losses.espo_loss(elbo_new, elbo_old, adv, lengths, epsilon=ppo_eps,
                            kl_coef=obj.kl_coef, elbo_ref=elbo_ref)
  if name in ("spg", "spg_is"):
    upper = losses.eubo(logp_new, noised, seqs.counted_BxL, beta=obj.spg_beta)
    surrogate = losses.spg_surrogate(adv, elbo_new, upper, omega=obj.spg_omega)
    if name == "spg_is":
      return losses.importance_weighted_loss(log_ratio, adv, surrogate, group_size=obj.group_size)
    return losses.spg_loss(adv, surrogate, lengths)
  if name == "wd1":
    return losses.wd1_loss(adv, elbo_new, group_size=obj.group_size)
  raise ValueError(f"unknown objective {name!r}")


def sft_loss(model, seqs: likelihood.Sequences, key: Array, *, scheme: str, staircase: bool,
             block_size: int) -> tuple[Array, dict[str, Array]]:
  """Masked-diffusion SFT: minus the Monte Carlo ELBO of the reference completions (one mask).

  `random_t` is LLaDA's pretraining/SFT objective; `block_t` with the staircase is SDAR's
  block-diffusion objective (each block's noisy copy conditioned on the clean prefix).
  """
  masks = likelihood.sample(key, seqs, scheme=scheme, num_samples=1, p_mask_prompt=0.0,
                            block_size=block_size)
  lp = likelihood.masked_logp(model, seqs, masks.noised_BxMxL, staircase=staircase,
                              block_size=block_size)
  elbo = losses.mc_elbo(lp, masks.weight_BxMxL)
  return -jnp.mean(elbo), {}
