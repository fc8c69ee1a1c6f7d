"""The decoding steps the samplers share (token choice, filtering, commit rules, stop handling),
and Dream's own step (`dream_*`: its filtering order, confidences and commit counts).

The random-number contract they follow is in `samplers`' module docstring (`uniforms` draws it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def commit_schedule(num_masked_B: Array, steps: int) -> Array:
  """Tokens to commit at each of `steps` steps, `[B, steps]`: ⌊n/steps⌋, +1 for the first n mod steps."""
  n = num_masked_B.astype(jnp.int32)[:, None]
  s = jnp.arange(steps, dtype=jnp.int32)[None, :]
  return n // steps + (s < n % steps).astype(jnp.int32)


def row_keys(key: Array, rows: int) -> Array:
  """One key per row, `[rows]`: row b's is `fold_in(key, b)`. Keys already given per row (a
  `[rows]` key array, as a chunk of a batch is decoded) are returned as they are."""
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):  # raw uint32 (`jax.random.PRNGKey`)
    key = jax.random.wrap_key_data(key)
  if key.ndim:
    return key
  return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(rows))


def uniforms(keys_B: Array, step: Array, shape: tuple[int, ...]) -> tuple[Array, Array]:
  """Two independent U(0,1) draws of `shape` (`[B, ...]`) for decoding step `step` (token choice,
  confidence): row b's from `fold_in(keys_B[b], step)`, so that no row's draws depend on the
  batch it is decoded in."""
  def row(k):
    return jax.random.uniform(jax.random.fold_in(k, step), (2, *shape[1:]), jnp.float32,
                              minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
  u = jax.vmap(row)(keys_B)
  return u[:, 0], u[:, 1]


def gumbel_argmax(logits_BxLxV: Array, temperature: float, u_BxLxV: Array) -> Array:
  """LLaDA's `argmax(exp(logits) / (-log u)^τ)`, in log space: `argmax(logits - τ log(-log u))`.

  The log form picks the same token without overflowing `exp` in float32; `τ = 0` is greedy.
  """
  logits = logits_BxLxV.astype(jnp.float32)
  if temperature > 0:
    logits = logits - temperature * jnp.log(-jnp.log(u_BxLxV))
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def top_k_filter(logits_BxLxV: Array, top_k: int) -> Array:
  """Entries below the k-th largest become -inf (`top_k` 0: none)."""
  logits = logits_BxLxV.astype(jnp.float32)
  if top_k <= 0:
    return logits
  kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
  return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits_BxLxV: Array, top_p: float, *, inclusive: bool = False) -> Array:
  """Nucleus filtering: keep the most likely tokens while the mass before each is below `top_p`
  (`inclusive`: at most `top_p`), so the token that crosses it is kept; the rest become -inf."""
  logits = logits_BxLxV.astype(jnp.float32)
  if top_p >= 1.0:
    return logits
  sorted_desc = -jnp.sort(-logits, axis=-1)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  kept = jnp.sum((before <= top_p) if inclusive else (before < top_p), axis=-1, keepdims=True)
  cutoff = jnp.take_along_axis(sorted_desc, jnp.maximum(kept - 1, 0), axis=-1)
  return jnp.where(logits < cutoff, -jnp.inf, logits)


def filter_logits(logits_BxLxV: Array, *, top_k: int = 0, top_p: float = 1.0) -> Array:
  """SDAR's filtering: top-k, then top-p of what is left. Filtered entries become -inf."""
  return top_p_filter(top_k_filter(logits_BxLxV, top_k), top_p)


def forbid(logits_BxLxV: Array, token_id: int) -> Array:
  # A committed mask token would read as still masked: it is never a candidate.
  return logits_BxLxV.astype(jnp.float32).at[..., token_id].set(-jnp.inf)


def select_top_k(confidence_BxL: Array, eligible_BxL: Array, k_B: Array) -> Array:
  """The `k` most confident eligible positions per row (ties: the lower index first)."""
  conf = jnp.where(eligible_BxL, confidence_BxL, -jnp.inf)
  rank = jnp.argsort(jnp.argsort(-conf, axis=-1, stable=True), axis=-1, stable=True)
  return eligible_BxL & (rank < k_B[:, None])


# `sampler.order`: which masked tokens a LLaDA or SDAR step commits. confidence: the sampler's
# own rule (remasking, strategy); left_to_right: the leftmost ones, one a step (the
# autoregressive order: the trajectory likelihood is then the chain rule).
ORDERS = ("confidence", "left_to_right")


def order_scores(confidence_BxK: Array, order: str) -> Array:
  """The scores the commit rule ranks by: the confidence, or for `left_to_right` minus each
  slot's index (the leftmost masked slots rank first)."""
  if order == "left_to_right":
    slots_K = jnp.arange(confidence_BxK.shape[-1], dtype=jnp.float32)
    return jnp.broadcast_to(-slots_K, confidence_BxK.shape)
  return confidence_BxK


def min_commits(num_masked_B: Array, steps_left) -> Array:
  """⌈m / r⌉: the fewest commits per step that still finish `m` masked tokens in `r` steps.

  As the lower bound of threshold decoding it is 1 while the budget is not binding, and at
  threshold 1 it reproduces `commit_schedule` (front-loaded remainder, step by step).
  """
  steps_left = jnp.maximum(jnp.asarray(steps_left, jnp.int32), 1)
  return -(-num_masked_B.astype(jnp.int32) // steps_left)


def confident_commit(confidence_BxL: Array, eligible_BxL: Array, k_B: Array,
                     threshold: float, *, strict: bool = False) -> Array:
  """Commit the `k` most confident eligible positions, and with a threshold (> 0; 0 = off) every
  eligible one whose confidence is at or above it (`strict`: above it). Both families' threshold
  decoding."""
  commit = select_top_k(confidence_BxL, eligible_BxL, k_B)
  if threshold > 0:
    above = confidence_BxL > threshold if strict else confidence_BxL >= threshold
    commit = commit | (eligible_BxL & above)
  return commit


def llada2_choose(logits_BxKxV: Array, u_BxKxV: Array, temperature: float, top_k: int,
                  top_p: float) -> tuple[Array, Array]:
  """LLaDA2.0's token choice `(x̂, its probability)`: greedy at temperature 0 without filters,
  else a draw from softmax(logits / temperature (0: 1), top-k, then top-p keeping the token that
  crosses p) (`rollouts.LLaDA2Sampling`)."""
  logits = logits_BxKxV.astype(jnp.float32)
  sample = temperature > 0 or top_k > 0 or top_p < 1
  if sample:
    logits = top_p_filter(top_k_filter(logits / (temperature or 1.0), top_k), top_p,
                          inclusive=True)
  x0_BxK = gumbel_argmax(logits, 1.0 if sample else 0.0, u_BxKxV)
  probs = jax.nn.softmax(logits, axis=-1)
  return x0_BxK, jnp.take_along_axis(probs, x0_BxK[..., None], axis=-1)[..., 0]


def choose_tokens(logits_BxKxV: Array, keys_B: Array, step, temperature: float,
                  remasking: str) -> tuple[Array, Array]:
  """LLaDA's step: `(x̂, confidence)` from the block's (mask-forbidden) logits and step's draws."""
  u_choice, u_conf = uniforms(keys_B, step, logits_BxKxV.shape)
  x0_BxK = gumbel_argmax(logits_BxKxV, temperature, u_choice)
  if remasking == "low_confidence":
    probs = jax.nn.softmax(logits_BxKxV.astype(jnp.float32), axis=-1)
    return x0_BxK, jnp.take_along_axis(probs, x0_BxK[..., None], axis=-1)[..., 0]
  return x0_BxK, u_conf[..., 0]


def truncate_after_stop(tokens_BxL: Array, generated_BxL: Array, stop_ids: tuple[int, ...],
                        pad_id: int) -> tuple[Array, Array]:
  """`(tokens, completion_mask)`: generated slots after the first stop token become `pad_id`."""
  is_stop = jnp.isin(tokens_BxL, jnp.asarray(stop_ids, jnp.int32)) & generated_BxL
  stops_before = jnp.cumsum(is_stop, axis=-1) - is_stop
  keep = generated_BxL & (stops_before == 0)
  return jnp.where(generated_BxL & ~keep, pad_id, tokens_BxL), keep


def stop_and_pad_ids(config, sampling) -> tuple[tuple[int, ...], int]:
  """The sampling's stop ids (else the model's stop ids, else its eos) and pad id (else the
  model's pad, else the first stop id)."""
  stop_ids = tuple(sampling.stop_ids) or tuple(config.stop_token_ids) or (config.eos_token_id,)
  if any(i is None for i in stop_ids):
    raise ValueError("the model config has no eos/stop token ids; pass stop_ids")
  if sampling.pad_id is not None:
    return stop_ids, sampling.pad_id
  return stop_ids, config.pad_token_id if config.pad_token_id is not None else stop_ids[0]


# ----------------------------------------------------------------------------- Dream

# Dream's remasking rules, named as released: which masked slots a step commits.
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def dream_fractions(steps: int, eps: float) -> np.ndarray:
  """`[steps]` float32: the fraction `1 - s/t` of the masked slots step i commits, with
  `t, s` = timesteps i, i + 1 of `linspace(1, eps, steps + 1)`, and 1 at the last step.

  The arithmetic is the released sampler's, in float32, so that `⌊m · fraction⌋` rounds as it
  does: torch's float32 `linspace` (a float32 step; each value `start + step·i`, in the upper
  half `end - step·(n - 1 - i)`, rounded once), then `1 - s/t` in float32.
  """
  n = steps + 1
  start, end = np.float32(1.0), np.float32(eps)
  step = np.float32(end - start) / np.float32(max(n - 1, 1))
  i = np.arange(n)
  lower = (np.float64(start) + np.float64(step) * i).astype(np.float32)
  upper = (np.float64(end) - np.float64(step) * (n - 1 - i)).astype(np.float32)
  t = np.where(i < n // 2, lower, upper)
  fractions = np.float32(1.0) - (t[1:] / t[:-1]).astype(np.float32)
  fractions[-1] = 1.0
  return fractions.astype(np.float32)


def dream_commit_count(num_masked_B: Array, fraction) -> Array:
  """`⌊m · fraction⌋` in float32, as the released sampler counts (`int(m * (1 - s/t))`)."""
  product = num_masked_B.astype(jnp.float32) * jnp.asarray(fraction, jnp.float32)
  return jnp.floor(product).astype(jnp.int32)


def dream_filter_logits(logits_BxLxV: Array, *, top_k: int = 0, top_p: float = 1.0) -> Array:
  """Dream's filtering, in its order: top-p of the whole distribution (a token is kept while the
  mass before it is at most `top_p`), then top-k."""
  return top_k_filter(top_p_filter(logits_BxLxV, top_p, inclusive=True), top_k)


def dream_choose_tokens(logits_BxGxV: Array, u_choice_BxGxV: Array, *, alg: str,
                        temperature: float, top_k: int, top_p: float) -> tuple[Array, Array]:
  """Dream's `sample_tokens`: `(x̂, confidence)` from the (unforbidden) logits of the generated
  slots. The logits are divided by `temperature` (when > 0) and filtered (`dream_filter_logits`);
  `x̂` is their argmax (greedy) or a draw from them by the Gumbel trick with `u_choice`. The
  confidence, from the filtered probabilities: `x̂`'s probability (`maskgit_plus`, also returned
  for `origin`, which does not use it), top-1 minus top-2 (`topk_margin`), or the negative entropy
  `Σ p log(p + 1e-10)` (`entropy`)."""
  logits = logits_BxGxV.astype(jnp.float32)
  if temperature > 0:
    logits = logits / temperature
  logits = dream_filter_logits(logits, top_k=top_k, top_p=top_p)
  probs = jax.nn.softmax(logits, axis=-1)
  x0_BxG = gumbel_argmax(logits, 1.0 if temperature > 0 else 0.0, u_choice_BxGxV)
  if alg == "topk_margin":
    top2 = jax.lax.top_k(probs, 2)[0]
    return x0_BxG, top2[..., 0] - top2[..., 1]
  if alg == "entropy":
    return x0_BxG, jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
  return x0_BxG, jnp.take_along_axis(probs, x0_BxG[..., None], axis=-1)[..., 0]


def dream_commit(confidence_BxG: Array, masked_BxG: Array, u_BxG: Array, fraction, *, alg: str,
                 alg_temp: float) -> Array:
  """The slots a Dream step commits, among the masked ones (`m` per row). `origin`: each with
  probability `fraction`, independently (`u < fraction`). The others: `⌊m · fraction⌋` of them,
  the most confident, or with `alg_temp > 0` drawn without replacement with probabilities
  `softmax(confidence / alg_temp)` (the Gumbel top-k trick with `u`)."""
  if alg == "origin":
    return masked_BxG & (u_BxG < fraction)
  k_B = dream_commit_count(jnp.sum(masked_BxG, axis=-1), fraction)
  score = confidence_BxG
  if alg_temp > 0:
    score = confidence_BxG / alg_temp - jnp.log(-jnp.log(u_BxG))
  return select_top_k(score, masked_BxG, k_B)
