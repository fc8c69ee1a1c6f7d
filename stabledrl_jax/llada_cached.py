"""LLaDA decoding at cached speed: block-wise approximate KV caching and confidence-threshold
parallel decoding (the Fast-dLLM algorithm), one compiled program per shape.

The layout, settings, draws and token choice are the exact sampler's (`samplers.llada_generate`);
what changes is which forwards run and how many tokens a step commits. Each block starts with one
full forward over the whole sequence; its logits serve as the block's first step and, with a
cache, its keys/values are reused for the block's later steps:
- `prefix`: a later step forwards the current block and everything after it, attending to the
  cached keys/values of the prompt and the finished blocks.
- `dual`: a later step forwards only the current block, attending to the cached keys/values of
  everything outside it (prompt, finished blocks and the masked suffix) and to its own fresh ones.
- `none` (with a threshold): every step is a full forward, as in the exact sampler.
The keys/values outside the forwarded span are those of the block's first forward: stale once
tokens they attended to are committed, which is the approximation.

Commit rule. Without a threshold, step `i` of a block commits the exact sampler's scheduled
number. With one, it commits every masked token of the block whose confidence is at or above the
threshold, and at least the ⌈m / r⌉ most confident (`min_commits`: m masked, r steps left of the
block's `steps / num_blocks`): 1 while the budget does not bind (always when
`steps / num_blocks >= block_length`, e.g. steps = gen_length), which is Fast-dLLM's rule, and
the schedule itself at threshold 1. A block ends as soon as no row has a masked token left in
it, so no forward is spent on a full block. Step `i` of block `j` uses the exact sampler's draws
of step `j * steps / num_blocks + i`.

Beyond Fast-dLLM, deliberately: left-padded batches (per-row positions, padding never attended
to), classifier-free guidance (the unconditional copy is forwarded and cached as its own rows),
and the step budget. With greedy decoding the tokens are Fast-dLLM's on the cases it supports.

Rollouts drawn this way are not the model's exact sampling distribution; likelihoods, ratios and
gradients still come from the exact model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax import decoding, rollouts
from stabledrl_jax.rollouts import LLaDASampling, Rollout

Array = jax.Array


def generate(model: nnx.Module, prompt_BxP: Array, prompt_valid_BxP: Array, key: Array,
             sampling: LLaDASampling) -> Rollout:
  """Fast LLaDA decoding of left-padded prompts (`sampling.cache`, `sampling.threshold`)."""
  return _generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)


def _slice(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


@nnx.jit(static_argnames=("sampling",))
def _generate(model, prompt_BxP, prompt_valid_BxP, key, sampling: LLaDASampling) -> Rollout:
  cfg = model.config
  mask_id = cfg.mask_token_id
  stop_ids, pad_id = decoding.stop_and_pad_ids(cfg, sampling)
  b, p = prompt_BxP.shape
  g, bl = sampling.gen_length, sampling.block_length
  num_blocks = g // bl
  spb = sampling.steps // num_blocks
  tokens, positions, valid, prompt_mask = rollouts.llada_layout(prompt_BxP, prompt_valid_BxP, g, mask_id)
  t = p + g
  # With guidance the forwarded rows are the conditional ones then their unconditional copies.
  copies = 2 if sampling.cfg_scale > 0 else 1
  pos_CxL = jnp.tile(positions, (copies, 1))
  valid_CxL = jnp.tile(valid, (copies, 1))

  def rows(x_BxL):
    if copies == 1:
      return x_BxL
    return jnp.concatenate([x_BxL, jnp.where(prompt_mask, mask_id, x_BxL)])

  def guide(logits):
    if copies == 1:
      return logits
    cond, unc = logits[:b], logits[b:]
    return unc + (sampling.cfg_scale + 1.0) * (cond - unc)

  def full_forward(x_BxL, start):
    """The block's logits from a forward over everything, and every slot's keys/values."""
    h, kv = model.forward_kv(rows(x_BxL), positions_BxT=pos_CxL, valid_BxT=valid_CxL)
    return guide(model.head_logits(_slice(h, start, bl))), kv

  def later_forward(x_BxL, start, kv):
    """The block's logits at a later step, and the tokens forwarded per row."""
    if sampling.cache == "none":
      return full_forward(x_BxL, start)[0], t
    if sampling.cache == "prefix":  # `start` is a Python int: the span's length is static
      past = [(k[:, :start], v[:, :start]) for k, v in kv]
      h, _ = model.forward_kv(rows(x_BxL)[:, start:], positions_BxT=pos_CxL[:, start:],
                              valid_BxT=valid_CxL[:, start:], past=past,
                              past_valid_BxS=valid_CxL[:, :start])
      return guide(model.head_logits(h[:, :bl])), t - start
    slot_L = jnp.arange(t)
    outside_CxL = valid_CxL & ((slot_L < start) | (slot_L >= start + bl))[None, :]
    h, _ = model.forward_kv(_slice(rows(x_BxL), start, bl), positions_BxT=_slice(pos_CxL, start, bl),
                            valid_BxT=_slice(valid_CxL, start, bl), past=kv,
                            past_valid_BxS=outside_CxL)
    return guide(model.head_logits(h)), bl

  def decode(logits_BxKxV, x_BxL, when_BxL, start, s, i, schedule_BxS):
    block_BxK = _slice(x_BxL, start, bl)
    still_masked = block_BxK == mask_id
    x0_BxK, conf_BxK = decoding.choose_tokens(decoding.forbid(logits_BxKxV, mask_id), key, s,
                                              sampling.temperature, sampling.remasking)
    if not sampling.threshold:
      k_B = schedule_BxS[:, i]
    else:
      k_B = decoding.min_commits(jnp.sum(still_masked, -1), spb - i)
    commit = decoding.confident_commit(decoding.order_scores(conf_BxK, sampling.order),
                                       still_masked, k_B, sampling.threshold)
    block_BxK = jnp.where(commit, x0_BxK, block_BxK)
    when_BxK = jnp.where(commit, s, _slice(when_BxL, start, bl))
    return (jax.lax.dynamic_update_slice_in_dim(x_BxL, block_BxK, start, axis=1),
            jax.lax.dynamic_update_slice_in_dim(when_BxL, when_BxK, start, axis=1))

  def block(j, carry):
    x, when, forwards, forward_tokens = carry
    start = p + j * bl
    schedule_BxS = decoding.commit_schedule(jnp.sum(_slice(x, start, bl) == mask_id, -1), spb)
    logits, kv = full_forward(x, start)
    x, when = decode(logits, x, when, start, j * spb, 0, schedule_BxS)

    def more(c):
      x, _, i, _, _ = c
      return (i < spb) & jnp.any(_slice(x, start, bl) == mask_id)

    def step(c):
      x, when, i, forwards, forward_tokens = c
      logits, width = later_forward(x, start, kv)
      x, when = decode(logits, x, when, start, j * spb + i, i, schedule_BxS)
      return x, when, i + 1, forwards + copies, forward_tokens + copies * width

    x, when, _, forwards, forward_tokens = jax.lax.while_loop(
        more, step, (x, when, jnp.int32(1), forwards + copies, forward_tokens + copies * t))
    return x, when, forwards, forward_tokens

  carry = (tokens, jnp.full(tokens.shape, -1, jnp.int32), jnp.int32(0), jnp.int32(0))
  if sampling.cache == "prefix":  # one program per block: its forwarded span shrinks
    for j in range(num_blocks):
      carry = block(j, carry)
  else:
    carry = jax.lax.fori_loop(0, num_blocks, block, carry)
  tokens, when, forwards, forward_tokens = carry
  generated = jnp.zeros_like(valid).at[:, p:].set(True)
  return rollouts.finish(tokens, positions, valid, prompt_mask, generated, jnp.full((b,), p, jnp.int32),
                  g, stop_ids, pad_id, when, forwards, forward_tokens)
