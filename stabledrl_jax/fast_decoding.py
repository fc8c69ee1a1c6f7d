"""Fast decoding of the full-attention families (LLaDA, Dream): block-wise approximate KV
caching and confidence-threshold parallel decoding (the Fast-dLLM algorithm, and its Dream
variant), one compiled program per shape.

The layout `[pads | prompt | gen_length masks]`, the settings and the draws are the family's exact
sampler's (`samplers`); what changes is which forwards run and how many tokens a step commits. The
generated region is decoded in blocks of `block_length`, left to right, with `steps / num_blocks`
steps each. Each block starts with one full forward over the whole sequence; its logits serve as
the block's first step and, with a cache, its keys/values are reused for the block's later steps:
- `prefix`: a later step forwards the current block and everything after it, attending to the
  cached keys/values of the prompt and the finished blocks.
- `dual`: a later step forwards only the current block, attending to the cached keys/values of
  everything outside it (prompt, finished blocks and the masked suffix) and to its own fresh ones.
- `none` (with a threshold): every step is a full forward, as in the exact sampler.
The keys/values outside the forwarded span are those of the block's first forward: stale once
tokens they attended to are committed, which is the approximation.

LLaDA's commit rule. Without a threshold, step `i` of a block commits the exact sampler's
scheduled number. With one, it commits every masked token of the block whose confidence is at or
above the threshold, and at least the ⌈m / r⌉ most confident (`min_commits`: m masked, r steps
left of the block's `steps / num_blocks`): 1 while the budget does not bind (always when
`steps / num_blocks >= block_length`, e.g. steps = gen_length), which is Fast-dLLM's rule, and
the schedule itself at threshold 1.

Dream's commit rule (Fast-dLLM's Dream variant). The block's first step (the full forward) commits
its first slot only: Dream's logits are shifted (slot i's come from the state of slot i - 1), and a
later forward that starts at the block has no state before it, so that slot is settled while its
prediction is exact. Steps `i >= 1`: with a threshold (on x̂'s probability, `alg=maskgit_plus`'s
confidence), the rule above; without one, Dream's own step on the block (`decoding.dream_commit`
with `sampler.alg`: Fast-dLLM always ranks by `entropy`) at the fraction `1 - s/t` of timesteps
i, i + 1 of `linspace(1, eps, steps / num_blocks + 1)`, the block's last step committing the rest.
As in Dream's exact sampler the mask token is a candidate and a slot that commits it stays masked.

Either family: a block ends as soon as no row has a masked token left in it, so no forward is
spent on a full block, and step `i` of block `j` uses the exact sampler's draws of step
`j * steps / num_blocks + i` (shaped like the block's logits).

Beyond Fast-dLLM, deliberately: left-padded batches (per-row positions, padding never attended
to), each row its own masked count (Fast-dLLM's Dream code counts over the batch), LLaDA's
classifier-free guidance (the unconditional copy is forwarded and cached as its own rows), and the
step budget (Fast-dLLM's threshold loop runs until the block is full; with
`steps / num_blocks >= block_length` the budget never binds). With greedy decoding the tokens are
Fast-dLLM's on the cases it supports.

Rollouts drawn this way are not the model's exact sampling distribution; likelihoods, ratios and
gradients still come from the exact model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax import decoding, rollouts
from stabledrl_jax.rollouts import DreamSampling, LLaDASampling, Rollout

Array = jax.Array


def generate(model: nnx.Module, prompt_BxP: Array, prompt_valid_BxP: Array, key: Array,
             sampling: LLaDASampling | DreamSampling) -> Rollout:
  """Fast decoding of left-padded prompts (`sampling.cache`, `sampling.threshold`)."""
  return _generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)


def _slice(x, start, size):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _llada_choice(sampling: LLaDASampling, mask_id: int, spb: int):
  """LLaDA's step: `(logits, block, row keys, step s, step of the block i, schedule) -> commit,
  x̂`."""
  def choose(logits_BxKxV, block_BxK, keys_B, s, i, schedule_BxS):
    still_masked = block_BxK == mask_id
    x0_BxK, conf_BxK = decoding.choose_tokens(decoding.forbid(logits_BxKxV, mask_id), keys_B, s,
                                              sampling.temperature, sampling.remasking)
    if not sampling.threshold:
      k_B = schedule_BxS[:, i]
    else:
      k_B = decoding.min_commits(jnp.sum(still_masked, -1), spb - i)
    return decoding.confident_commit(decoding.order_scores(conf_BxK, sampling.order),
                                     still_masked, k_B, sampling.threshold), x0_BxK
  return choose


def _dream_choice(sampling: DreamSampling, mask_id: int, spb: int):
  """Dream's step (module docstring); `i` is the Python int 0 at the block's first step."""
  fractions_S = jnp.asarray(decoding.dream_fractions(spb, sampling.eps))

  def choose(logits_BxKxV, block_BxK, keys_B, s, i, _):
    still_masked = block_BxK == mask_id
    u_choice, u_slot = decoding.uniforms(keys_B, s, logits_BxKxV.shape)
    x0_BxK, conf_BxK = decoding.dream_choose_tokens(
        logits_BxKxV, u_choice, alg=sampling.alg, temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p)
    if isinstance(i, int) and i == 0:
      commit = still_masked & (jnp.arange(block_BxK.shape[1]) == 0)[None, :]
    elif sampling.threshold:
      k_B = decoding.min_commits(jnp.sum(still_masked, -1), spb - i)
      commit = decoding.confident_commit(conf_BxK, still_masked, k_B, sampling.threshold)
    else:
      commit = decoding.dream_commit(conf_BxK, still_masked, u_slot[..., 0], fractions_S[i],
                                     alg=sampling.alg, alg_temp=sampling.alg_temp)
    return commit & (x0_BxK != mask_id), x0_BxK
  return choose


@nnx.jit(static_argnames=("sampling",))
def _generate(model, prompt_BxP, prompt_valid_BxP, key, sampling) -> Rollout:
  cfg = model.config
  mask_id = cfg.mask_token_id
  stop_ids, pad_id = decoding.stop_and_pad_ids(cfg, sampling)
  b, p = prompt_BxP.shape
  keys_B = decoding.row_keys(key, b)
  g, bl = sampling.gen_length, sampling.block_length
  num_blocks = g // bl
  spb = sampling.steps // num_blocks
  dream = isinstance(sampling, DreamSampling)
  choose = (_dream_choice if dream else _llada_choice)(sampling, mask_id, spb)
  tokens, positions, valid, prompt_mask = rollouts.llada_layout(prompt_BxP, prompt_valid_BxP, g, mask_id)
  t = p + g
  # With guidance the forwarded rows are the conditional ones then their unconditional copies.
  copies = 1 if dream or not sampling.cfg_scale else 2
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
    # A slot whose x̂ is the mask token (Dream only) stays masked and keeps no commit step.
    block_BxK = _slice(x_BxL, start, bl)
    commit, x0_BxK = choose(logits_BxKxV, block_BxK, keys_B, s, i, schedule_BxS)
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
