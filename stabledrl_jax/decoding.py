"""The decoding steps both samplers share: token choice, commit rules, stop handling.

The random-number contract they follow is in `samplers`' module docstring (`uniforms` draws it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def commit_schedule(num_masked_B: Array, steps: int) -> Array:
  """Tokens to commit at each of `steps` steps, `[B, steps]`: ⌊n/steps⌋, +1 for the first n mod steps."""
  n = num_masked_B.astype(jnp.int32)[:, None]
  s = jnp.arange(steps, dtype=jnp.int32)[None, :]
  return n // steps + (s < n % steps).astype(jnp.int32)


def uniforms(key: Array, step: Array, shape: tuple[int, ...]) -> tuple[Array, Array]:
  """Two independent U(0,1) draws of `shape` for decoding step `step` (token choice, confidence)."""
  u = jax.random.uniform(jax.random.fold_in(key, step), (2, *shape), jnp.float32,
                         minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
  return u[0], u[1]


def gumbel_argmax(logits_BxLxV: Array, temperature: float, u_BxLxV: Array) -> Array:
  """LLaDA's `argmax(exp(logits) / (-log u)^τ)`, in log space: `argmax(logits - τ log(-log u))`.

  The log form picks the same token without overflowing `exp` in float32; `τ = 0` is greedy.
  """
  logits = logits_BxLxV.astype(jnp.float32)
  if temperature > 0:
    logits = logits - temperature * jnp.log(-jnp.log(u_BxLxV))
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def filter_logits(logits_BxLxV: Array, *, top_k: int = 0, top_p: float = 1.0) -> Array:
  """Top-k then top-p (nucleus) filtering: filtered entries become -inf."""
  logits = logits_BxLxV.astype(jnp.float32)
  if top_k > 0:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
    kept = jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_desc, jnp.maximum(kept - 1, 0), axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return logits


def forbid(logits_BxLxV: Array, token_id: int) -> Array:
  # A committed mask token would read as still masked: it is never a candidate.
  return logits_BxLxV.astype(jnp.float32).at[..., token_id].set(-jnp.inf)


def select_top_k(confidence_BxL: Array, eligible_BxL: Array, k_B: Array) -> Array:
  """The `k` most confident eligible positions per row (ties: the lower index first)."""
  conf = jnp.where(eligible_BxL, confidence_BxL, -jnp.inf)
  rank = jnp.argsort(jnp.argsort(-conf, axis=-1, stable=True), axis=-1, stable=True)
  return eligible_BxL & (rank < k_B[:, None])


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


def choose_tokens(logits_BxKxV: Array, key: Array, step, temperature: float,
                  remasking: str) -> tuple[Array, Array]:
  """LLaDA's step: `(x̂, confidence)` from the block's (mask-forbidden) logits and step's draws."""
  u_choice, u_conf = uniforms(key, step, logits_BxKxV.shape)
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
