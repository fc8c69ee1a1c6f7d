"""Per-step stability diagnostics of rollouts and updates (docs/method.md §8): pure functions of arrays.

Every function is safe under `jax.jit` (integer arguments such as `group_size` and `n` are
static). Shapes are in the argument names' suffixes: `B` rows (= `num_groups * group_size`, groups
contiguous), `L` completion positions, `V` vocabulary. `mask_BxL` marks the completion tokens that
count (up to and including the first end-of-sequence token, `estimators.counted_until_eos`).

The importance-weight metrics (clip fraction, log10 ratio max/mean, ESS and entropy of `α`) come
with the loss (`losses.snis_clip_loss`); this module holds the rest. `step_diagnostics` gathers
them into one flat dict of float32 scalars; `to_floats` turns such a dict into Python floats on
the host, so the step itself never waits for a device-to-host copy.
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

# The masked means and group reshapes of the losses, so both count rows and groups alike.
from stabledrl_jax.losses import grouped, masked_mean, valid_or_ones

Array = jax.Array


# ----------------------------------------------------------------------------- token entropy


def token_entropies(logits_BxLxV: Array, temperature: float = 1.0) -> Array:
  """Entropy in nats of `softmax(logits / temperature)` at every position, `[B, L]` float32.

  Rollouts sample from `softmax(logits/τ)` (Gumbel-max with scale τ), so pass the rollout τ to
  measure the distribution actually sampled. `-inf` logits (banned tokens) contribute 0.
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32) / temperature, axis=-1)
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)


def token_entropy(logits_BxLxV: Array, mask_BxL: Array, temperature: float = 1.0) -> Array:
  """Mean over counted completion tokens of the per-token entropy `-Σ_v p_v log p_v` (nats)."""
  return masked_mean(token_entropies(logits_BxLxV, temperature), mask_BxL)


# ----------------------------------------------------------------------------- repetition


def repeated_ngrams(tokens_BxL: Array, mask_BxL: Array, n: int = 4) -> tuple[Array, Array]:
  """Per completion: `(repeated, total)` counts of counted n-grams, both `[B]` int32.

  An n-gram starting at `i` counts when all its `n` tokens are counted; it is *repeated* when the
  same n tokens already start at some counted `j < i` of the same completion. Cost `O(B·L²·n)`.
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  b, length = tokens_BxL.shape
  w = length - n + 1
  if w < 1:
    zeros = jnp.zeros((b,), jnp.int32)
    return zeros, zeros
  mask_BxL = mask_BxL.astype(bool)
  same_BxWxW = jnp.ones((b, w, w), bool)
  ok_BxW = jnp.ones((b, w), bool)
  for k in range(n):
    t_BxW = tokens_BxL[:, k:k + w]
    same_BxWxW &= t_BxW[:, :, None] == t_BxW[:, None, :]
    ok_BxW &= mask_BxL[:, k:k + w]
  earlier_WxW = jnp.tril(jnp.ones((w, w), bool), k=-1)  # [i, j]: j < i
  seen_before_BxW = jnp.any(same_BxWxW & earlier_WxW & ok_BxW[:, None, :], axis=-1)
  repeated_B = jnp.sum(seen_before_BxW & ok_BxW, axis=-1, dtype=jnp.int32)
  return repeated_B, jnp.sum(ok_BxW, axis=-1, dtype=jnp.int32)


def repetition_rate(tokens_BxL: Array, mask_BxL: Array, n: int = 4) -> Array:
  """Mean over completions of `repeated n-grams / counted n-grams` (`repeated_ngrams`).

  0 for a completion without a repeated n-gram; `(m-n)/(m-n+1)` for `m` copies of one token
  ("0000…"), i.e. close to 1. Completions shorter than `n` drop out of the mean.
  """
  repeated_B, total_B = repeated_ngrams(tokens_BxL, mask_BxL, n)
  rate_B = repeated_B / jnp.maximum(total_B, 1)
  return masked_mean(rate_B, total_B > 0)


def longest_run_fraction(tokens_BxL: Array, mask_BxL: Array) -> Array:
  """Mean over completions of `longest run of one repeated token / counted length`.

  A run is a stretch of consecutive counted positions holding the same token; an uncounted
  position ends it. 1.0 for "0000…", `1/m` for `m` all-distinct tokens. Empty completions drop out.
  """
  mask_BxL = mask_BxL.astype(bool)
  b, length = tokens_BxL.shape
  same_as_prev = jnp.concatenate(
      [jnp.zeros((b, 1), bool),
       (tokens_BxL[:, 1:] == tokens_BxL[:, :-1]) & mask_BxL[:, :-1]], axis=1)
  pos_BxL = jnp.broadcast_to(jnp.arange(length), (b, length))
  run_start_BxL = jax.lax.cummax(jnp.where(same_as_prev, 0, pos_BxL), axis=1)
  run_BxL = jnp.where(mask_BxL, pos_BxL - run_start_BxL + 1, 0)
  count_B = jnp.sum(mask_BxL, axis=-1)
  frac_B = jnp.max(run_BxL, axis=-1) / jnp.maximum(count_B, 1)
  return masked_mean(frac_B, count_B > 0)


# ----------------------------------------------------------------------------- KL(θ_old‖θ)


def kl_estimates(log_ratio: Array, mask: Array | None = None) -> dict[str, Array]:
  """KL(π_old‖π_θ) from samples of `π_old` (the rollouts), given `ℓ = log π_θ - log π_old`.

  With `r = exp(ℓ)`: `kl_k1 = mean(-ℓ)` (unbiased, can go negative) and
  `kl_k3 = mean(r - 1 - ℓ)` (unbiased, never negative, lower variance when `π_θ ≈ π_old`).
  `log_ratio` is per token `[B, L]` or per sequence `[B]` (then it is an estimate itself, and
  mask noise biases `kl_k3` upwards; divide by the length for a per-token scale). The mean runs
  over `mask`.
  """
  lr = log_ratio.astype(jnp.float32)
  mask = valid_or_ones(mask, lr)
  lr = jnp.where(mask, lr, 0.0)
  return {
      "kl_k1": masked_mean(-lr, mask),
      "kl_k3": masked_mean(jnp.expm1(lr) - lr, mask),
  }


# ----------------------------------------------------------------------------- rewards, lengths


def zero_advantage_fraction(
    rewards_B: Array, group_size: int, valid_B: Array | None = None, atol: float = 1e-6
) -> Array:
  """Fraction of groups whose valid rewards are all equal (within `atol`): no learning signal.

  Group-relative advantages vanish in such a group whatever the objective. A group with one
  valid row counts as equal; a group with none drops out.
  """
  r_NxG = grouped(rewards_B.astype(jnp.float32), group_size)
  v_NxG = grouped(valid_or_ones(valid_B, rewards_B), group_size)
  hi_N = jnp.max(jnp.where(v_NxG, r_NxG, -jnp.inf), axis=-1)
  lo_N = jnp.min(jnp.where(v_NxG, r_NxG, jnp.inf), axis=-1)
  has_rows_N = jnp.any(v_NxG, axis=-1)
  flat_N = jnp.where(has_rows_N, hi_N - lo_N <= atol, False)
  return masked_mean(flat_N, has_rows_N)


def reward_stats(
    rewards_B: Array, group_size: int, valid_B: Array | None = None
) -> dict[str, Array]:
  """Mean, population std, min and max over valid rows; `reward_group_std`: mean within-group std.

  The within-group std is the spread the advantages `r_j - mean_k r_k` are made of.
  """
  r_B = rewards_B.astype(jnp.float32)
  v_B = valid_or_ones(valid_B, r_B)
  mean = masked_mean(r_B, v_B)
  var = masked_mean((r_B - mean) ** 2, v_B)
  r_NxG, v_NxG = grouped(r_B, group_size), grouped(v_B, group_size)
  n_N = jnp.sum(v_NxG, axis=-1)
  gmean_N1 = (jnp.sum(jnp.where(v_NxG, r_NxG, 0.0), axis=-1) / jnp.maximum(n_N, 1))[:, None]
  gvar_N = jnp.sum(jnp.where(v_NxG, (r_NxG - gmean_N1) ** 2, 0.0), axis=-1) / jnp.maximum(n_N, 1)
  any_valid = jnp.any(v_B)
  return {
      "reward_mean": mean,
      "reward_std": jnp.sqrt(var),
      "reward_min": jnp.where(any_valid, jnp.min(jnp.where(v_B, r_B, jnp.inf)), 0.0),
      "reward_max": jnp.where(any_valid, jnp.max(jnp.where(v_B, r_B, -jnp.inf)), 0.0),
      "reward_group_std": masked_mean(jnp.sqrt(gvar_N), n_N > 0),
  }


def length_stats(
    lengths_B: Array, valid_B: Array | None = None, max_length: int | None = None
) -> dict[str, Array]:
  """Completion length mean/min/max over valid rows; with `max_length`, `truncated_fraction`.

  A completion that fills `max_length` never emitted end-of-sequence within the budget.
  """
  n_B = lengths_B.astype(jnp.float32)
  v_B = valid_or_ones(valid_B, n_B)
  any_valid = jnp.any(v_B)
  out = {
      "length_mean": masked_mean(n_B, v_B),
      "length_min": jnp.where(any_valid, jnp.min(jnp.where(v_B, n_B, jnp.inf)), 0.0),
      "length_max": jnp.where(any_valid, jnp.max(jnp.where(v_B, n_B, -jnp.inf)), 0.0),
  }
  if max_length is not None:
    out["truncated_fraction"] = masked_mean(n_B >= max_length, v_B)
  return out


# ----------------------------------------------------------------------------- per step


def step_diagnostics(
    *,
    rewards_B: Array,
    group_size: int,
    mask_BxL: Array,
    tokens_BxL: Array | None = None,
    entropy_BxL: Array | None = None,
    log_ratio: Array | None = None,
    log_ratio_mask: Array | None = None,
    valid_B: Array | None = None,
    ngram: int = 4,
) -> dict[str, Array]:
  """Rollout and drift diagnostics of one step as a flat dict of float32 scalars.

  Always: `zero_adv_fraction`, `reward_*` (`reward_stats`), `length_*` (lengths are
  `sum(mask_BxL)`, `truncated_fraction` against `mask_BxL.shape[1]`). With `tokens_BxL`:
  `repetition_rate` (`ngram`-grams) and `longest_run_fraction`. With `entropy_BxL`
  (`token_entropies` of the rollout logits, kept at sampling time so `[B, L, V]` need not live
  on): `token_entropy`. With `log_ratio` (`ℓ = log π_θ - log π_old`): `kl_k1`, `kl_k3`.
  Merge with the loss metrics (`losses.snis_clip_loss`) and the gradient norm for the log.
  """
  mask_BxL = mask_BxL.astype(bool)
  valid_B = valid_or_ones(valid_B, rewards_B)
  out = {"zero_adv_fraction": zero_advantage_fraction(rewards_B, group_size, valid_B)}
  out.update(reward_stats(rewards_B, group_size, valid_B))
  out.update(length_stats(jnp.sum(mask_BxL, axis=-1), valid_B, mask_BxL.shape[1]))
  rows_BxL = mask_BxL & valid_B[:, None]
  if tokens_BxL is not None:
    out["repetition_rate"] = repetition_rate(tokens_BxL, rows_BxL, ngram)
    out["longest_run_fraction"] = longest_run_fraction(tokens_BxL, rows_BxL)
  if entropy_BxL is not None:
    out["token_entropy"] = masked_mean(entropy_BxL.astype(jnp.float32), rows_BxL)
  if log_ratio is not None:
    out.update(kl_estimates(log_ratio, log_ratio_mask))
  return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def to_floats(metrics: Mapping[str, Array | float]) -> dict[str, float]:
  """Host-side: one device-to-host copy of a metrics dict, as plain Python floats."""
  host = jax.device_get(dict(metrics))
  return {k: float(np.asarray(v)) for k, v in host.items()}
