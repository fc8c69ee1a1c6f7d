"""Policy objectives for RL on diffusion LMs: StableDRL and its baselines.

Pure functions of arrays: no model, no optimiser, no framework beyond `jax`. Every function is
safe under `jax.jit`, `jax.grad` and `jax.vmap`. Shapes are in the argument names' suffixes:
`B` rows (= `num_groups * group_size`, groups contiguous), `L` token positions, `M` Monte Carlo
samples. Each loss returns `(loss, metrics)`, `metrics` a dict of float32 scalars.

Importing this module pulls in nothing but `jax` (no flax, optax, orbax, grain or tfds).
"""
from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
_LN10 = math.log(10.0)


# ----------------------------------------------------------------------------- helpers


def grouped(x_B: Array, group_size: int) -> Array:
  """`[B]` -> `[B / G, G]`: rows as their groups (an error names a batch of partial groups)."""
  if x_B.ndim != 1:
    raise ValueError(f"expected a [B] array, got shape {x_B.shape}")
  if group_size < 1 or x_B.shape[0] % group_size:
    raise ValueError(f"batch of {x_B.shape[0]} rows is not a whole number of groups of "
                     f"group_size={group_size}")
  return x_B.reshape(-1, group_size)


def valid_or_ones(valid: Array | None, like_B: Array) -> Array:
  """The row mask `valid` (checked against `like_B`'s shape), or every row when None."""
  if valid is None:
    return jnp.ones(like_B.shape, bool)
  if valid.shape != like_B.shape:
    raise ValueError(f"valid has shape {valid.shape}, expected {like_B.shape}")
  return valid.astype(bool)


def masked_mean(x: Array, mask: Array) -> Array:
  """The mean of `x` over `mask` (0 when the mask is empty)."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _masked_log10_ratio_stats(log_ratio: Array, mask: Array) -> dict[str, Array]:
  """log10 of the largest and of the mean ratio over `mask`, computed in log space."""
  mask = mask.astype(bool)
  lr = jnp.where(mask, log_ratio.astype(jnp.float32), -jnp.inf)
  count = jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)
  lmax = jnp.max(lr)
  lmean = jax.nn.logsumexp(lr) - jnp.log(count)
  finite = jnp.any(mask)
  return {
      "log10_ratio_max": jnp.where(finite, lmax / _LN10, 0.0),
      "log10_ratio_mean": jnp.where(finite, lmean / _LN10, 0.0),
  }


def clip_bounds(epsilon: float | Array | None,
                max_ratio: float | None = None) -> tuple[float | Array, float | Array]:
  """Log-space clip bounds: `[log(max(1-ε, 0)), log(1+ε)]`, or `(-inf, log max_ratio]`.

  `log 0 = -inf`, so with the paper's `ε = 5` only the upper bound `log 6` is active. Giving
  `max_ratio` (the official code uses 5) replaces both bounds and ignores `epsilon`. A traced
  `epsilon` (a JAX array, e.g. adaptive ε fed to a jitted step) gives array bounds; checking
  its value is then the caller's job.
  """
  if max_ratio is not None:
    if not max_ratio > 0:
      raise ValueError(f"max_ratio must be > 0, got {max_ratio}")
    return -math.inf, math.log(max_ratio)
  if isinstance(epsilon, jax.Array):
    eps = epsilon.astype(jnp.float32)
    return jnp.log(jnp.maximum(1.0 - eps, 0.0)), jnp.log1p(eps)
  if epsilon is None or not epsilon >= 0:
    raise ValueError(f"epsilon must be >= 0, got {epsilon}")
  low = 1.0 - epsilon
  return (math.log(low) if low > 0 else -math.inf), math.log1p(epsilon)


def group_softmax(logits_NxG: Array, valid_NxG: Array) -> Array:
  """Softmax over the last axis restricted to `valid`; all-invalid rows give all-zero weights."""
  x = jnp.where(valid_NxG, logits_NxG, -jnp.inf)
  m = jnp.max(x, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(valid_NxG, jnp.exp(x - m), 0.0)
  s = jnp.sum(e, axis=-1, keepdims=True)
  return e / jnp.where(s > 0, s, 1.0)


# ----------------------------------------------------------------------------- StableDRL


def snis_clip_loss(
    log_ratio: Array,
    advantages: Array,
    surrogate: Array,
    *,
    group_size: int,
    epsilon: float | Array | None = 5.0,
    max_ratio: float | None = None,
    valid: Array | None = None,
    lengths: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """StableDRL: unconditionally clipped, self-normalised importance weights per group.

  With `ℓ_j` the estimated log ratio `L_θ(x_j) - L_old(x_j)` (gradient stopped whatever the
  caller passes), `ℓ̃_j = clip(ℓ_j, lo, hi)` with bounds from `clip_bounds(epsilon, max_ratio)`,
  and, within each group of `group_size` contiguous rows, `α_j = exp(ℓ̃_j - logsumexp_k ℓ̃_k)`
  (no gradient), the loss is `-mean_groups Σ_j α_j A_j surrogate_j`. Its gradient
  `-Σ_j α_j A_j ∇surrogate_j` is a convex combination per group, so its norm never exceeds
  `max_j |A_j| ‖∇surrogate_j‖` for any ratios. Inputs are `[B]`; rows where `valid` is False
  drop out of the softmax and the loss, and groups with no valid row out of the mean. All math is
  float32 whatever the input dtype; the loss is finite for any finite `log_ratio`. (The official
  StableDRL code normalises over a process's whole micro-batch instead; with one prompt per
  micro-batch, as its config sets, that is the group.)

  Metrics: `clip_fraction` (valid rows whose log ratio lay outside the bounds),
  `log10_ratio_max`, `log10_ratio_mean` (log10 of the largest / mean unclipped ratio),
  `ess` (mean over groups of `1/Σα²`), `weight_entropy` (mean over groups of `-Σ α log α`),
  `weight_max`; with `lengths` (`[B]` tokens per row), `clipped_token_fraction`: the fraction of
  the valid rows' tokens whose (sequence) weight was clipped.
  """
  low, high = clip_bounds(epsilon, max_ratio)
  log_ratio = jax.lax.stop_gradient(log_ratio).astype(jnp.float32)
  valid = valid_or_ones(valid, log_ratio)
  clipped_B = jnp.clip(log_ratio, low, high)

  valid_NxG = grouped(valid, group_size)
  alpha_NxG = jax.lax.stop_gradient(group_softmax(grouped(clipped_B, group_size), valid_NxG))
  adv_NxG = grouped(advantages.astype(jnp.float32), group_size)
  sur_NxG = grouped(surrogate.astype(jnp.float32), group_size)
  # where(), not a product, so a padding row with a non-finite surrogate cannot poison the sum.
  terms_NxG = jnp.where(valid_NxG, alpha_NxG * adv_NxG * sur_NxG, 0.0)
  group_has_rows_N = jnp.any(valid_NxG, axis=-1)
  loss = -masked_mean(jnp.sum(terms_NxG, axis=-1), group_has_rows_N)

  outside_B = (log_ratio < low) | (log_ratio > high)
  safe_log_alpha = jnp.log(jnp.where(alpha_NxG > 0, alpha_NxG, 1.0))
  ess_N = 1.0 / jnp.maximum(jnp.sum(alpha_NxG**2, axis=-1), 1e-30)
  entropy_N = -jnp.sum(alpha_NxG * safe_log_alpha, axis=-1)
  metrics = {
      "clip_fraction": masked_mean(outside_B, valid),
      **_masked_log10_ratio_stats(log_ratio, valid),
      "ess": masked_mean(ess_N, group_has_rows_N),
      "weight_entropy": masked_mean(entropy_N, group_has_rows_N),
      "weight_max": jnp.max(jnp.where(valid_NxG, alpha_NxG, 0.0)),
  }
  if lengths is not None:
    tokens_B = jnp.where(valid, lengths.astype(jnp.float32), 0.0)
    metrics["clipped_token_fraction"] = (jnp.sum(jnp.where(outside_B, tokens_B, 0.0))
                                         / jnp.maximum(jnp.sum(tokens_B), 1.0))
  return loss, metrics


def elbo_ratio(
    logp_new: Array,
    weight_new: Array,
    logp_old: Array,
    weight_old: Array | None = None,
) -> tuple[Array, Array]:
  """Estimated sequence log ratio from Monte Carlo ELBOs: `(log_ratio, elbo_new)`.

  `logp_*` are per-position log-probabilities of the target tokens under the new (θ) and old
  policy, `[B, M, L]` for `M` mask samples; `weight_*` the estimator weights (0 where a position
  does not count, see `estimators`). `ELBO = mean_M Σ_L weight · logp`. `weight_old=None` means
  the old policy saw the same masks (coupled, common random numbers), so the ratio is exactly 1
  when the parameters agree. `log_ratio = ELBO_new - ELBO_old` carries no gradient;
  `elbo_new` keeps it (the StableDRL surrogate). Computed in float32.
  """
  if weight_old is None:
    weight_old = weight_new
  elbo_new = mc_elbo(logp_new, weight_new)
  elbo_old = mc_elbo(jax.lax.stop_gradient(logp_old), weight_old)
  return jax.lax.stop_gradient(elbo_new - elbo_old), elbo_new


def mc_elbo(logp: Array, weight: Array) -> Array:
  """`mean_M Σ_L weight · logp`, `[B]` in float32; zero-weight positions never contribute."""
  if logp.ndim != 3 or logp.shape != weight.shape:
    raise ValueError(f"logp {logp.shape} and weight {weight.shape} must be the "
                     "same [B, M, L] shape")
  w = weight.astype(jnp.float32)
  # where(): a -inf log-prob at an uncounted position would otherwise make 0 * -inf = nan.
  terms = jnp.where(w != 0, w * logp.astype(jnp.float32), 0.0)
  return jnp.mean(jnp.sum(terms, axis=-1), axis=-1)


# ----------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: Array,
    *,
    group_size: int,
    mode: Literal["mean", "mean_std", "leave_one_out"] = "mean",
    std_eps: float = 1e-4,
    valid: Array | None = None,
) -> Array:
  """Group-relative advantages `[B]`.

  `mean`: `A_j = r_j - mean_k r_k` within the group (StableDRL, d1: no std division).
  `mean_std`: `(r_j - mean) / (std + std_eps)` (GRPO). `leave_one_out`:
  `r_j - mean_{k≠j} r_k` (RLOO), zero for a group with one valid row. Means run over the valid
  rows of a group; invalid rows get advantage 0.
  """
  r_NxG = grouped(rewards.astype(jnp.float32), group_size)
  valid_NxG = grouped(valid_or_ones(valid, rewards), group_size)
  v = valid_NxG.astype(jnp.float32)
  n_N1 = jnp.sum(v, axis=-1, keepdims=True)
  mean_N1 = jnp.sum(r_NxG * v, axis=-1, keepdims=True) / jnp.maximum(n_N1, 1.0)
  centred = r_NxG - mean_N1
  if mode == "mean":
    adv = centred
  elif mode == "mean_std":
    var = jnp.sum(centred**2 * v, axis=-1, keepdims=True) / jnp.maximum(n_N1, 1.0)
    adv = centred / (jnp.sqrt(var) + std_eps)
  elif mode == "leave_one_out":
    adv = jnp.where(n_N1 > 1, centred * n_N1 / jnp.maximum(n_N1 - 1.0, 1.0), 0.0)
  else:
    raise ValueError(f"unknown advantage mode {mode!r}: expected mean, mean_std or leave_one_out")
  return jnp.where(valid_NxG, adv, 0.0).reshape(-1)


# ----------------------------------------------------------------------------- baselines


def grpo_clip_loss(
    log_ratio: Array,
    advantages: Array,
    *,
    epsilon: float = 0.5,
    epsilon_high: float | None = None,
    mask: Array | None = None,
    ref_log_ratio: Array | None = None,
    kl_coef: float = 0.0,
) -> tuple[Array, dict[str, Array]]:
  """PPO/GRPO conditional clip: `-min(ρA, clip(ρ, 1-ε, 1+ε_high)A)`, optional k3 KL.

  `log_ratio` is `log π_θ - log π_old`, sequence level `[B]` or token level `[B, L]` (d1's
  diffu-GRPO, with `mask [B, L]` marking counted tokens); unlike `snis_clip_loss` the gradient
  flows through it. `advantages` broadcasts over tokens. Token losses are averaged per sequence
  over `mask`, then over sequences. With `kl_coef > 0`, `ref_log_ratio = log π_ref - log π_θ`
  (same shape) adds `kl_coef · (exp(r) - r - 1)` per token (the k3 estimator).

  When `A < 0` and `ρ > 1+ε` the unclipped branch is kept, so the gradient `ρ A ∇log π` grows
  without bound in `ρ`: the failure mode StableDRL removes. Metrics: `clip_fraction` (tokens whose
  gradient the clip zeroed), `log10_ratio_max`, `log10_ratio_mean`, `kl`.
  """
  epsilon_high = epsilon if epsilon_high is None else epsilon_high
  lr = log_ratio.astype(jnp.float32)
  adv = advantages.astype(jnp.float32)
  if lr.ndim == 2:
    adv = adv[:, None]
  elif lr.ndim != 1:
    raise ValueError(f"log_ratio must be [B] or [B, L], got shape {lr.shape}")
  if mask is None:
    mask = jnp.ones(lr.shape, bool)
  if mask.shape != lr.shape:
    raise ValueError(f"mask has shape {mask.shape}, expected {lr.shape}")
  ratio = jnp.exp(lr)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * adv
  per_token = -jnp.minimum(unclipped, clipped)
  kl = jnp.zeros_like(per_token)
  if kl_coef:
    if ref_log_ratio is None:
      raise ValueError("kl_coef > 0 needs ref_log_ratio (log π_ref - log π_θ)")
    r = ref_log_ratio.astype(jnp.float32)
    kl = jnp.exp(r) - r - 1.0
    per_token = per_token + kl_coef * kl
  loss = _sequence_then_batch_mean(per_token, mask)
  metrics = {
      "clip_fraction": masked_mean(clipped < unclipped, mask),
      **_masked_log10_ratio_stats(lr, mask),
      "kl": masked_mean(kl, mask),
  }
  return loss, metrics


def _sequence_then_batch_mean(x: Array, mask: Array) -> Array:
  if x.ndim == 1:
    return masked_mean(x, mask)
  m = mask.astype(jnp.float32)
  per_seq = jnp.sum(jnp.where(mask, x, 0.0), axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
  return masked_mean(per_seq, jnp.any(mask, axis=-1))


def espo_loss(
    elbo_new: Array,
    elbo_old: Array,
    advantages: Array,
    lengths: Array,
    *,
    epsilon: float = 0.2,
    kl_coef: float = 0.0,
    elbo_ref: Array | None = None,
    valid: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """ESPO: PPO clip on the length-normalised sequence ratio `exp((ELBO_θ - ELBO_old) / L)`.

  `elbo_*_B` are sequence-level ELBO estimates (`elbo_new` differentiable, `elbo_old` not),
  `lengths` the completion lengths `L`. With `kl_coef > 0` adds
  `kl_coef · ½((ELBO_θ - ELBO_ref)/L)²` (the k2 estimator on the same normalised log ratio).
  """
  length = jnp.maximum(lengths.astype(jnp.float32), 1.0)
  log_ratio_B = (elbo_new - jax.lax.stop_gradient(elbo_old)) / length
  valid = valid_or_ones(valid, log_ratio_B)
  loss, metrics = grpo_clip_loss(log_ratio_B, advantages, epsilon=epsilon, mask=valid)
  if kl_coef:
    if elbo_ref is None:
      raise ValueError("kl_coef > 0 needs elbo_ref")
    k2 = 0.5 * ((elbo_new - jax.lax.stop_gradient(elbo_ref)) / length) ** 2
    metrics["kl"] = masked_mean(k2, valid)
    loss = loss + kl_coef * metrics["kl"]
  return loss, metrics


def eubo(
    logp: Array,
    masked: Array,
    counted: Array,
    *,
    beta: float = 1.5,
) -> Array:
  """SPG's Rényi upper bound `(1/β) · mean_tokens log(mean_M [p^β · 1(masked) / t̂])`, `[B]`.

  `t̂` is the fraction of counted completion tokens masked in that sample. Computed in log space;
  the token mean runs over counted positions masked in at least one of the `M` samples (a token
  never masked has no estimate). A token the model finds nearly impossible counts like any other:
  the official code forms `p^β` in float32 and drops tokens where it underflows to 0 (log p below
  about -69 at β = 1.5), which moves the bound up and makes it jump as a token crosses that line;
  here the log-space sum keeps them, as the definition does.
  """
  masked = masked.astype(bool) & counted.astype(bool)[:, None, :]
  n_counted_B1 = jnp.maximum(jnp.sum(counted, axis=-1, keepdims=True), 1).astype(jnp.float32)
  t_hat_BxM = jnp.sum(masked, axis=-1).astype(jnp.float32) / n_counted_B1
  log_terms = beta * logp.astype(jnp.float32) - jnp.log(jnp.maximum(t_hat_BxM, 1e-30))[..., None]
  seen_BxL = jnp.any(masked, axis=1)
  # Unseen tokens get finite dummies: an all -inf logsumexp would give nan gradients.
  log_terms = jnp.where(masked, log_terms, jnp.where(seen_BxL[:, None, :], -jnp.inf, 0.0))
  log_mean_BxL = jax.nn.logsumexp(log_terms, axis=1) - math.log(logp.shape[1])
  per_token = jnp.where(seen_BxL, log_mean_BxL, 0.0)
  return jnp.sum(per_token, axis=-1) / jnp.maximum(jnp.sum(seen_BxL, axis=-1), 1) / beta


def spg_surrogate(advantages: Array, elbo: Array, upper: Array, *, omega: float = 0.5) -> Array:
  """SPG's sandwiched likelihood `[B]`: `elbo` where `A > 0`, `ω·upper + (1-ω)·elbo` where `A ≤ 0`.

  `upper` is the EUBO (`eubo`). Maximising a lower bound on positive samples and pushing down an
  upper bound on negative ones keeps the objective a bound in the right direction for each.
  """
  mixed = omega * upper + (1.0 - omega) * elbo
  return jnp.where(advantages > 0, elbo, mixed)


def spg_loss(
    advantages: Array,
    surrogate: Array,
    lengths: Array,
    *,
    valid: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """SPG policy gradient without importance ratios: `-Σ_j len_j A_j L_j / Σ_j len_j`.

  `surrogate` is the per-token likelihood bound (`spg_surrogate` of per-token ELBO/EUBO),
  weighted by completion length so that every token counts once across the batch.
  """
  valid = valid_or_ones(valid, surrogate)
  w = jnp.where(valid, lengths.astype(jnp.float32), 0.0)
  terms = jnp.where(valid, w * advantages.astype(jnp.float32) * surrogate.astype(jnp.float32), 0.0)
  loss = -jnp.sum(terms) / jnp.maximum(jnp.sum(w), 1.0)
  return loss, {"surrogate_mean": masked_mean(surrogate.astype(jnp.float32), valid)}


def importance_weighted_loss(
    log_ratio: Array,
    advantages: Array,
    surrogate: Array,
    *,
    group_size: int,
    valid: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """Plain importance weights, the ablation StableDRL replaces: `-mean_groups Σ_j (ρ_j/G) A_j L_j`.

  `ρ_j = exp(ℓ_j)` unclipped and not self-normalised (gradient stopped), `G` the number of valid
  rows of the group, `L_j` the surrogate (e.g. `spg_surrogate`). The gradient grows linearly in
  `ρ`, and `exp` of a large estimated log ratio overflows to inf: kept as is on purpose, so
  stability experiments can show what the clip and the self-normalisation prevent.
  """
  log_ratio = jax.lax.stop_gradient(log_ratio).astype(jnp.float32)
  valid = valid_or_ones(valid, log_ratio)
  valid_NxG = grouped(valid, group_size)
  n_N1 = jnp.maximum(jnp.sum(valid_NxG, axis=-1, keepdims=True), 1).astype(jnp.float32)
  w_NxG = jnp.exp(grouped(log_ratio, group_size)) / n_N1
  terms_NxG = jnp.where(valid_NxG, w_NxG * grouped(advantages.astype(jnp.float32), group_size)
                        * grouped(surrogate.astype(jnp.float32), group_size), 0.0)
  loss = -masked_mean(jnp.sum(terms_NxG, axis=-1), jnp.any(valid_NxG, axis=-1))
  return loss, _masked_log10_ratio_stats(log_ratio, valid)


def rejection_sampling_loss(keep_B: Array, elbo_B: Array) -> tuple[Array, dict[str, Array]]:
  """Rejection-sampling fine-tuning (expert iteration): SFT's loss, minus the ELBO, averaged over
  the rollouts kept (`keep_B` 1: those with a correct answer), 0 when none is; no ratio, no
  advantage. Metric `kept_fraction`: the fraction of the rollouts kept."""
  keep = keep_B.astype(jnp.float32)
  loss = -jnp.sum(keep * elbo_B.astype(jnp.float32)) / jnp.maximum(jnp.sum(keep), 1.0)
  return loss, {"kept_fraction": jnp.mean(keep)}


def wd1_loss(
    advantages: Array,
    logp: Array,
    *,
    group_size: int,
    temperature: float = 1.0,
    valid: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  """wd1: ratio-free weighted likelihood, `-Σ_j softmax(A/τ)_j log p_j + Σ_j softmax(-A/τ)_j log p_j`.

  Softmaxes run within each group over valid rows; the result is averaged over groups.
  `logp` is the differentiable sequence log-likelihood proxy.
  """
  valid_NxG = grouped(valid_or_ones(valid, logp), group_size)
  a_NxG = grouped(advantages.astype(jnp.float32), group_size) / temperature
  w_pos = jax.lax.stop_gradient(group_softmax(a_NxG, valid_NxG))
  w_neg = jax.lax.stop_gradient(group_softmax(-a_NxG, valid_NxG))
  lp_NxG = jnp.where(valid_NxG, grouped(logp.astype(jnp.float32), group_size), 0.0)
  per_group = jnp.sum((w_neg - w_pos) * lp_NxG, axis=-1)
  return masked_mean(per_group, jnp.any(valid_NxG, axis=-1)), {}
