"""Rollouts from diffusion LMs: LLaDA semi-autoregressive decoding and SDAR block decoding.

Both compile to one jitted program per shape: every loop is `lax` control flow over static
shapes, so no step goes back to the host. docs/method.md §5 is the reference algorithm.

Layout. Prompts come left-padded, `[B, P]` ids with a `[B, P]` validity mask. Each row's
positions start at 0 at its first real token, so padding never changes what a row computes.
- LLaDA: `[pads | prompt | gen_length masks]`; the generated region is the same slots for every
  row and is split into blocks of `block_length`.
- SDAR: blocks are `position // block_size`, so a prompt that does not fill its last block shares
  it with the first generated tokens. Rows are shifted by whole blocks so that their first
  generated block falls on the same slots; slots before a row's first token or after its last
  generated token are invalid (never attended to, never written).

The mask token is never a candidate token (its logit is set to -inf before the choice).

Random numbers. The draw for decoding step `s` (counted from 0 across all blocks) comes from
`jax.random.fold_in(key, s)`, shaped like the current block's logits `[B, block, V]` (its first
half for the token choice, see `decoding.uniforms`), so a reference loop can reproduce every draw.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax import decoding

Array = jax.Array


class Rollout(NamedTuple):
  """What a sampler returns. Slots are the sampler's layout (module docstring)."""
  tokens_BxL: Array          # int32 prompt + completion; after the first stop token: pad_id
  positions_BxL: Array       # int32 position of each slot (row's first real token = 0)
  valid_BxL: Array           # bool, real tokens (prompt and generated, before truncation)
  prompt_mask_BxL: Array     # bool, prompt tokens
  completion_mask_BxL: Array  # bool, generated tokens up to and including the first stop token
  completion_BxC: Array      # int32 the generated tokens of each row, left-aligned
  completion_mask_BxC: Array  # bool, same as completion_mask_BxL in that layout
  lengths_B: Array           # int32 completion length (stop token included)
  commit_step_BxL: Array     # int32 decoding step that committed each slot; -1 for the rest
  forwards_B: Array          # int32 model forwards the row took part in (guidance copies count)
  forward_tokens_B: Array    # int32 tokens those forwards processed for the row


def _gather_completion(tokens_BxL, completion_BxL, gen_start_B, gen_length):
  idx_BxC = gen_start_B[:, None] + jnp.arange(gen_length)[None, :]
  idx_BxC = jnp.minimum(idx_BxC, tokens_BxL.shape[1] - 1)
  return (jnp.take_along_axis(tokens_BxL, idx_BxC, axis=1),
          jnp.take_along_axis(completion_BxL, idx_BxC, axis=1))


def finish(tokens, positions, valid, prompt_mask, generated, gen_start_B, gen_length, stop_ids,
           pad_id, commit_step, forwards, forward_tokens) -> Rollout:
  """The `Rollout` of a finished decode: stop truncation, padding, the left-aligned completions."""
  tokens, completion = decoding.truncate_after_stop(tokens, generated, stop_ids, pad_id)
  tokens = jnp.where(valid, tokens, pad_id)
  comp_BxC, comp_mask_BxC = _gather_completion(tokens, completion, gen_start_B, gen_length)
  return Rollout(tokens, positions, valid, prompt_mask, completion, comp_BxC, comp_mask_BxC,
                 jnp.sum(completion, axis=-1).astype(jnp.int32), commit_step,
                 jnp.full(gen_start_B.shape, forwards, jnp.int32),
                 jnp.full(gen_start_B.shape, forward_tokens, jnp.int32))


# ----------------------------------------------------------------------------- LLaDA


@dataclasses.dataclass(frozen=True)
class LLaDASampling:
  """LLaDA decoding settings (docs/method.md §5); rollouts in the paper: 256 / 32 / 128 / τ = 0.9."""
  gen_length: int = 256
  block_length: int = 32
  steps: int = 128
  temperature: float = 0.0
  remasking: Literal["low_confidence", "random"] = "low_confidence"
  cfg_scale: float = 0.0
  stop_ids: tuple[int, ...] = ()  # default: the model config's stop tokens
  pad_id: int | None = None       # default: the model config's pad (else eos) token
  # Approximate fast decoding (`llada_cached`): block-wise KV reuse and threshold commits.
  cache: Literal["none", "prefix", "dual"] = "none"
  threshold: float | None = None  # None: the schedule alone

  def __post_init__(self):
    if self.cache not in ("none", "prefix", "dual"):
      raise ValueError(f"unknown cache {self.cache!r}: expected none, prefix or dual")
    if self.threshold is not None and not 0 <= self.threshold <= 1:
      raise ValueError(f"threshold={self.threshold} must lie in [0, 1] (or be None: off)")
    if self.gen_length % self.block_length:
      raise ValueError(f"gen_length={self.gen_length} is not a multiple of "
                       f"block_length={self.block_length}")
    blocks = self.gen_length // self.block_length
    if self.steps % blocks or self.steps < blocks:
      raise ValueError(f"steps={self.steps} must be a positive multiple of the number of blocks "
                       f"({blocks} = gen_length / block_length)")
    if self.remasking not in ("low_confidence", "random"):
      raise ValueError(f"unknown remasking {self.remasking!r}: expected low_confidence or random")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def llada_layout(prompt_BxP: Array, prompt_valid_BxP: Array, gen_length: int, mask_id: int):
  """`(tokens, positions, valid, prompt_mask)` for `[pads | prompt | gen_length masks]`."""
  b, p = prompt_BxP.shape
  valid_prompt = prompt_valid_BxP.astype(bool)
  tokens = jnp.concatenate([prompt_BxP.astype(jnp.int32),
                            jnp.full((b, gen_length), mask_id, jnp.int32)], axis=1)
  valid = jnp.concatenate([valid_prompt, jnp.ones((b, gen_length), bool)], axis=1)
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
  prompt_mask = jnp.concatenate([valid_prompt, jnp.zeros((b, gen_length), bool)], axis=1)
  return tokens, positions, valid, prompt_mask


def llada_generate(model: nnx.Module, prompt_BxP: Array, prompt_valid_BxP: Array, key: Array,
                   sampling: LLaDASampling) -> Rollout:
  """Semi-autoregressive LLaDA decoding (docs/method.md §5) of left-padded prompts; returns a `Rollout`.

  `steps` are split evenly over the `gen_length / block_length` blocks; each step runs one
  forward (two with classifier-free guidance: the unconditional copy has its prompt masked),
  picks `x̂ = argmax` of the Gumbel-perturbed logits, scores it by its softmax probability
  (`low_confidence`) or at random (`random`), and commits the scheduled number of the most
  confident still-masked tokens of the current block.

  With `cache` other than `none` or a `threshold`, decoding is the approximate fast algorithm of
  `llada_cached` instead (not the model's exact sampling distribution).
  """
  if sampling.cache != "none" or sampling.threshold is not None:
    from stabledrl_jax import llada_cached  # it builds on this module
    return llada_cached.generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)
  return _llada_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)


@nnx.jit(static_argnames=("sampling",))
def _llada_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling: LLaDASampling) -> Rollout:
  cfg = model.config
  mask_id = cfg.mask_token_id
  stop_ids, pad_id = decoding.stop_and_pad_ids(cfg, sampling)
  b, p = prompt_BxP.shape
  g, bl = sampling.gen_length, sampling.block_length
  steps_per_block = sampling.steps // (g // bl)
  tokens, positions, valid, prompt_mask = llada_layout(prompt_BxP, prompt_valid_BxP, g, mask_id)

  def block_logits(x_BxL, start):
    """Logits of the current block only: the head (vocabulary-sized) runs on its positions."""
    def run(ids, pos, val):
      h = model.logits(ids, attention="full", positions=pos, valid_BxL=val, head=False)
      return model.head_logits(jax.lax.dynamic_slice_in_dim(h, start, bl, axis=1))

    if sampling.cfg_scale > 0:
      uncond = jnp.where(prompt_mask, mask_id, x_BxL)
      both = run(jnp.concatenate([x_BxL, uncond]), jnp.concatenate([positions, positions]),
                 jnp.concatenate([valid, valid]))
      cond, unc = both[:b], both[b:]
      return unc + (sampling.cfg_scale + 1.0) * (cond - unc)
    return run(x_BxL, positions, valid)

  def step(s, carry):
    x_BxL, schedule_BxS, when_BxL = carry
    start = p + (s // steps_per_block) * bl
    block_BxK = jax.lax.dynamic_slice_in_dim(x_BxL, start, bl, axis=1)
    still_masked = block_BxK == mask_id
    # At a block's first step its schedule comes from the masks it holds then.
    schedule_BxS = jnp.where(s % steps_per_block == 0,
                             decoding.commit_schedule(jnp.sum(still_masked, -1), steps_per_block),
                             schedule_BxS)
    logits_BxKxV = decoding.forbid(block_logits(x_BxL, start), mask_id)
    x0_BxK, conf_BxK = decoding.choose_tokens(logits_BxKxV, key, s, sampling.temperature,
                                              sampling.remasking)
    k_B = schedule_BxS[:, s % steps_per_block]
    commit = decoding.select_top_k(conf_BxK, still_masked, k_B)
    block_BxK = jnp.where(commit, x0_BxK, block_BxK)
    when_BxK = jnp.where(commit, s, jax.lax.dynamic_slice_in_dim(when_BxL, start, bl, axis=1))
    return (jax.lax.dynamic_update_slice_in_dim(x_BxL, block_BxK, start, axis=1), schedule_BxS,
            jax.lax.dynamic_update_slice_in_dim(when_BxL, when_BxK, start, axis=1))

  schedule0 = jnp.zeros((b, steps_per_block), jnp.int32)
  when0 = jnp.full(tokens.shape, -1, jnp.int32)
  tokens, _, when = jax.lax.fori_loop(0, sampling.steps, step, (tokens, schedule0, when0))
  generated = jnp.zeros_like(valid).at[:, p:].set(True)
  copies = 2 if sampling.cfg_scale > 0 else 1
  return finish(tokens, positions, valid, prompt_mask, generated, jnp.full((b,), p, jnp.int32),
                g, stop_ids, pad_id, when, sampling.steps * copies,
                sampling.steps * copies * tokens.shape[1])


# ----------------------------------------------------------------------------- SDAR


@dataclasses.dataclass(frozen=True)
class SDARSampling:
  """SDAR block decoding settings (docs/method.md §5)."""
  gen_length: int = 256
  steps: int = 4  # denoising forwards per block, at most
  strategy: Literal["low_confidence_static", "low_confidence_dynamic"] = "low_confidence_static"
  threshold: float = 0.9  # low_confidence_dynamic: commit every token above it
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  use_cache: bool = True  # False recomputes the whole prefix every step (the reference path)
  block_size: int | None = None  # default: the model config's block size
  stop_ids: tuple[int, ...] = ()
  pad_id: int | None = None

  def __post_init__(self):
    if self.strategy not in ("low_confidence_static", "low_confidence_dynamic"):
      raise ValueError(f"unknown strategy {self.strategy!r}: expected low_confidence_static or "
                       "low_confidence_dynamic")
    if self.steps < 1 or self.gen_length < 1:
      raise ValueError(f"steps={self.steps} and gen_length={self.gen_length} must be >= 1")
    if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ValueError(f"bad sampling settings: temperature={self.temperature}, "
                       f"top_k={self.top_k}, top_p={self.top_p}")


def sdar_layout(prompt_BxP: Array, prompt_valid_BxP: Array, gen_length: int, block_size: int,
                mask_id: int):
  """Block-aligned layout; returns `(tokens, positions, valid, prompt_mask, generated,
  first_block, num_blocks)`: the first generated block index (same for all rows) and the total.

  Static sizes come from `P`: rows are shifted right by whole blocks so that the block holding
  their first generated token is block `first_block = ceil((P+1)/B) - 1` (what the longest prompt
  `P` would need).
  """
  b, p = prompt_BxP.shape
  bs = block_size
  valid_prompt = prompt_valid_BxP.astype(bool)
  plen_B = jnp.sum(valid_prompt, axis=1).astype(jnp.int32)
  first_block = p // bs  # block of position P: the worst case over rows
  # A row whose prompt fills r = plen mod B slots of its last block ends (r + C - 1) // B blocks
  # after it; r <= B - 1 bounds every row.
  num_blocks = first_block + (min(bs - 1, p) + gen_length - 1) // bs + 1
  t = num_blocks * bs
  shift_B = (first_block - plen_B // bs) * bs  # slot of position 0, a whole number of blocks
  slot_1xL = jnp.arange(t, dtype=jnp.int32)[None, :]
  pos_BxL = slot_1xL - shift_B[:, None]
  is_prompt = (pos_BxL >= 0) & (pos_BxL < plen_B[:, None])
  generated = (pos_BxL >= plen_B[:, None]) & (pos_BxL < plen_B[:, None] + gen_length)
  # Prompt token at position q sits in column q + (P - plen) of the left-padded input.
  col_BxL = jnp.clip(pos_BxL + (p - plen_B)[:, None], 0, p - 1)
  prompt_tokens = jnp.take_along_axis(prompt_BxP.astype(jnp.int32), col_BxL, axis=1)
  tokens = jnp.where(is_prompt, prompt_tokens, mask_id)
  valid = is_prompt | generated
  return (tokens, jnp.maximum(pos_BxL, 0), valid, is_prompt, generated, first_block, num_blocks)


def sdar_generate(model: nnx.Module, prompt_BxP: Array, prompt_valid_BxP: Array, key: Array,
                  sampling: SDARSampling) -> Rollout:
  """SDAR block decoding (docs/method.md §5) of left-padded prompts; returns a `Rollout`.

  The prompt's complete blocks are prefilled block-causally into a KV cache. Each following block
  is denoised by up to `steps` forwards over the cache plus the block (bidirectional inside it);
  each forward samples `x̂` (temperature / top-k / top-p, Gumbel draws) and commits the scheduled
  number of most confident masked tokens (`low_confidence_static`), or every token whose
  confidence exceeds `threshold` but at least the scheduled number (`low_confidence_dynamic`).
  A finished block costs one more forward that writes its keys and values to the cache. A row
  stops after the block in which it produced a stop token; the loop stops when every row has.
  With `use_cache=False` each forward recomputes the whole sequence block-causally instead.
  """
  return _sdar_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)


@nnx.jit(static_argnames=("sampling",))
def _sdar_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling: SDARSampling) -> Rollout:
  cfg = model.config
  bs = sampling.block_size or cfg.block_size
  if not bs:
    raise ValueError("SDAR decoding needs a block size (sampling.block_size or config.block_size)")
  mask_id = cfg.mask_token_id
  stop_ids, pad_id = decoding.stop_and_pad_ids(cfg, sampling)
  stop_arr = jnp.asarray(stop_ids, jnp.int32)
  b = prompt_BxP.shape[0]
  tokens, positions, valid, prompt_mask, generated, first_block, num_blocks = sdar_layout(
      prompt_BxP, prompt_valid_BxP, sampling.gen_length, bs, mask_id)
  t = tokens.shape[1]

  def slice_block(x, j):
    return jax.lax.dynamic_slice_in_dim(x, j * bs, bs, axis=1)

  cache = None
  if sampling.use_cache:
    cache = model.init_cache(b, t)
  if sampling.use_cache and first_block:  # no complete prompt block: nothing to prefill
    _, cache = model.cached_logits(tokens[:, :first_block * bs], cache,
                                   positions_BxT=positions[:, :first_block * bs], commit=True,
                                   block_size=bs, valid_BxT=valid[:, :first_block * bs])

  def block_logits(x_BxL, j, cache):
    if sampling.use_cache:
      logits, _ = model.cached_logits(slice_block(x_BxL, j), cache,
                                      positions_BxT=slice_block(positions, j), commit=False,
                                      block_size=bs, valid_BxT=slice_block(valid, j))
      return logits
    logits = model.logits(x_BxL, attention="block_causal", block_size=bs, positions=positions,
                          valid_BxL=valid)
    return slice_block(logits, j)

  def denoise_block(j, x_BxL, when_BxL, cache, active_B, step0):
    blk_gen = slice_block(generated, j) & active_B[:, None]
    schedule_BxS = decoding.commit_schedule(
        jnp.sum(slice_block(x_BxL, j) == mask_id, -1) * active_B, sampling.steps)

    def cond(c):
      x, _, s, _ = c
      return (s < sampling.steps) & jnp.any((slice_block(x, j) == mask_id) & blk_gen)

    def body(c):
      x, when, s, n = c
      blk = slice_block(x, j)
      still_masked = (blk == mask_id) & blk_gen
      logits = decoding.forbid(block_logits(x, j, cache), mask_id)
      if sampling.temperature > 0:  # sample from the tempered, filtered distribution
        logits = decoding.filter_logits(logits / sampling.temperature, top_k=sampling.top_k,
                                        top_p=sampling.top_p)
      u_choice, _ = decoding.uniforms(key, step0 + n, logits.shape)
      x0 = decoding.gumbel_argmax(logits, 1.0 if sampling.temperature > 0 else 0.0, u_choice)
      probs = jax.nn.softmax(logits, axis=-1)
      conf = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
      dynamic = sampling.strategy == "low_confidence_dynamic"
      commit = decoding.confident_commit(conf, still_masked, schedule_BxS[:, s],
                                         sampling.threshold if dynamic else None, strict=True)
      blk = jnp.where(commit, x0, blk)
      when_blk = jnp.where(commit, step0 + n, slice_block(when, j))
      return (jax.lax.dynamic_update_slice_in_dim(x, blk, j * bs, axis=1),
              jax.lax.dynamic_update_slice_in_dim(when, when_blk, j * bs, axis=1), s + 1, n + 1)

    x_BxL, when_BxL, _, used = jax.lax.while_loop(
        cond, body, (x_BxL, when_BxL, jnp.int32(0), jnp.int32(0)))
    return x_BxL, when_BxL, used

  def block_step(c):
    x, when, j, cache, active_B, step0 = c
    x, when, used = denoise_block(j, x, when, cache, active_B, step0)
    if sampling.use_cache:
      _, cache = model.cached_logits(slice_block(x, j), cache, positions_BxT=slice_block(positions, j),
                                     commit=True, block_size=bs, valid_BxT=slice_block(valid, j))
    blk = slice_block(x, j)
    stopped = jnp.any(jnp.isin(blk, stop_arr) & slice_block(generated, j), axis=-1)
    return x, when, j + 1, cache, active_B & ~stopped, step0 + used

  def more(c):
    _, _, j, _, active_B, _ = c
    return (j < num_blocks) & jnp.any(active_B)

  init = (tokens, jnp.full(tokens.shape, -1, jnp.int32), jnp.int32(first_block), cache,
          jnp.ones((b,), bool), jnp.int32(0))
  tokens, when, j_end, _, _, denoise_steps = jax.lax.while_loop(more, block_step, init)
  # Forwards: the prompt prefill, each denoising step, each finished block's cache write.
  prefill = int(bool(sampling.use_cache and first_block))
  blocks_done = (j_end - first_block) * int(sampling.use_cache)
  forwards = prefill + denoise_steps + blocks_done
  forward_tokens = (prefill * first_block * bs + blocks_done * bs
                    + denoise_steps * (bs if sampling.use_cache else t))
  # Rows that stopped early keep masks in later blocks: the stop truncation pads them.
  gen_start_B = jnp.argmax(generated, axis=1).astype(jnp.int32)
  return finish(tokens, positions, valid, prompt_mask, generated, gen_start_B,
                sampling.gen_length, stop_ids, pad_id, when, forwards, forward_tokens)
