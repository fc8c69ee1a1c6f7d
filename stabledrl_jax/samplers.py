"""Rollouts from diffusion LMs: LLaDA semi-autoregressive decoding, SDAR block decoding (and
LLaDA2.0's `generate`, its variant) and Dream's `diffusion_generate`.

All compile to one jitted program per shape: every loop is `lax` control flow over static
shapes, so no step goes back to the host. docs/method.md §5 is the reference algorithm.

The layouts, the settings and the `Rollout` they return are `rollouts`'. `generate` is the one
entry point: it picks the family's sampler (the fast decoder of `fast_decoding` when LLaDA's or
Dream's settings ask for it) and places the batch on the model's mesh.

LLaDA and SDAR never choose the mask token (its logit is set to -inf before the choice). Dream's
released sampler does not exclude it: a slot that draws it stays masked and is drawn again.

Random numbers. Row `b`'s draw for decoding step `s` comes from
`jax.random.fold_in(jax.random.fold_in(key, b), s)`, shaped like the row's current block of
logits `[block, V]` (its first half for the token choice, see `decoding.uniforms`), so a reference
loop can reproduce every draw, and a row decodes the same tokens in any batch at the same row
index: `sampler.chunk` decodes a batch a chunk of rows at a time with exactly the tokens of one
call. LLaDA's and Dream's steps count from 0 across all blocks; SDAR's step `i` of block `j` is
`s = j * steps + i` (its blocks end when their rows do, so a running count would depend on the
batch). Dream's block is the whole generated region `[gen_length, V]`; the first entry of the
second half along the vocabulary, `[gen_length]`, is its per-slot draw (`origin`'s commit test,
the Gumbel keys of `alg_temp`).
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import decoding, fast_decoding, rollouts, sharding
from stabledrl_jax.rollouts import (DreamSampling, LLaDA2Sampling, LLaDASampling, Rollout,
                                    SDARSampling)

Array = jax.Array


def generate(model: nnx.Module, prompt_ids_BxP, prompt_mask_BxP, key: Array, sampling, *,
             rows: int | None = None, start: int = 0, rollout_mesh=None) -> Rollout:
  """Rollouts for a batch of prompts with the family's sampler (`sampling`'s type), the batch
  split over the model's mesh (if any). With several processes the host arrays are rows
  `[start, ...)` of a `rows`-row global batch.

  With a `rollout_mesh`, the weights and prompts are resharded onto it for decoding and the
  rollout comes back on the model's mesh.
  """
  fn = sampler_of(sampling)
  mesh = sharding.model_mesh(model)
  ids, mask = sharding.shard_batch((np.asarray(prompt_ids_BxP), np.asarray(prompt_mask_BxP)), mesh,
                                   rows=rows, start=start)
  if rollout_mesh is None:
    return fn(model, jnp.asarray(ids), jnp.asarray(mask), key, sampling)
  decoder = sharding.resharded(model, rollout_mesh)
  ids, mask = sharding.shard_batch((ids, mask), rollout_mesh)
  return sharding.shard_batch(fn(decoder, ids, mask, key, sampling), mesh)


def sampler_of(sampling):
  """The family's sampler function for `sampling`'s type (`rollouts.SAMPLINGS`), decoding
  `sampling.chunk` rows at a time where that is set (`decode_in_chunks`)."""
  if isinstance(sampling, LLaDASampling):
    fn = llada_generate
  elif isinstance(sampling, DreamSampling):
    fn = dream_generate
  else:
    fn = sdar_generate  # SDAR's block decoding, or LLaDA2.0's variant of it
  return functools.partial(decode_in_chunks, fn) if sampling.chunk else fn


@nnx.jit(static_argnames=("fn", "sampling"))
def decode_in_chunks(fn, model, prompt_BxP, prompt_valid_BxP, key, sampling) -> Rollout:
  """`fn`'s rollouts decoded `sampling.chunk` rows at a time in a `lax.scan`: one chunk's memory,
  and the tokens of one call (each row's draws come from its own key, `decoding.row_keys`).
  Chunk `i` of `n` holds rows `i, i + n, i + 2n, ...` (the batch padded with copies of its first
  row to a multiple of the chunk), so that each chunk is spread over the devices as the batch is.
  The forwards a row is counted are its chunk's."""
  b, c = prompt_BxP.shape[0], sampling.chunk
  if b <= c:
    return fn(model, prompt_BxP, prompt_valid_BxP, key, sampling)
  n = -(-b // c)
  mesh = jax.typeof(prompt_BxP).sharding.mesh  # abstract inside jit

  def split(x_B):  # [B, ...] -> [n, c, ...]; chunk i is rows i, i + n, ...
    x_B = jnp.concatenate([x_B, jnp.broadcast_to(x_B[:1], (n * c - b, *x_B.shape[1:]))])
    return jnp.swapaxes(x_B.reshape(c, n, *x_B.shape[1:]), 0, 1)

  graphdef, state = nnx.split(model)

  def one(state, chunk):  # the weights ride in the carry: the model is built in the loop's trace
    ids_CxP, valid_CxP, keys_C = sharding.constrain_batch(chunk, mesh)
    return state, fn(nnx.merge(graphdef, state), ids_CxP, valid_CxP, keys_C, sampling)

  _, out = jax.lax.scan(one, state, (split(prompt_BxP), split(prompt_valid_BxP),
                                     split(decoding.row_keys(key, b))))
  return jax.tree.map(lambda y: jnp.swapaxes(y, 0, 1).reshape(n * c, *y.shape[2:])[:b], out)


@jax.jit
def _rollout_sums(forwards_B, forward_tokens_B, lengths_B):
  # One program: op by op, each jnp call on a multi-process array is its own SPMD program.
  return (jnp.mean(forwards_B.astype(jnp.float32)), jnp.mean(forward_tokens_B.astype(jnp.float32)),
          jnp.sum(lengths_B))


def rollout_record(sampling, rollout: Rollout, started: float) -> dict:
  """The rollout phase's step log (waits for the rollout): sampler, forwards per rollout, tokens
  forwarded per rollout, seconds since `started` (`time.perf_counter()`), generated tokens/s."""
  jax.block_until_ready(rollout.lengths_B)
  seconds = max(time.perf_counter() - started, 1e-9)
  forwards, forward_tokens, tokens = _rollout_sums(rollout.forwards_B, rollout.forward_tokens_B,
                                                   rollout.lengths_B)
  return {"rollout_sampler": sampling.label, "rollout_forwards": float(forwards),
          "rollout_forward_tokens": float(forward_tokens), "rollout_s": seconds,
          "rollout_tokens_per_s": float(tokens) / seconds}


# ----------------------------------------------------------------------------- LLaDA


def llada_generate(model: nnx.Module, prompt_BxP: Array, prompt_valid_BxP: Array, key: Array,
                   sampling: LLaDASampling) -> Rollout:
  """Semi-autoregressive LLaDA decoding (docs/method.md §5) of left-padded prompts; returns a `Rollout`.

  `steps` are split evenly over the `gen_length / block_length` blocks; each step runs one
  forward (two with classifier-free guidance: the unconditional copy has its prompt masked),
  picks `x̂ = argmax` of the Gumbel-perturbed logits, scores it by its softmax probability
  (`low_confidence`) or at random (`random`), and commits the scheduled number of the most
  confident still-masked tokens of the current block (`order=left_to_right`: the leftmost, one a
  step).

  With `cache` other than `none` or a `threshold` (`sampling.fast`), decoding is the approximate
  fast algorithm of `fast_decoding` instead (not the model's exact sampling distribution).
  """
  if sampling.fast:
    return fast_decoding.generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)
  return _llada_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)


@nnx.jit(static_argnames=("sampling",))
def _llada_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling: LLaDASampling) -> Rollout:
  cfg = model.config
  mask_id = cfg.mask_token_id
  stop_ids, pad_id = decoding.stop_and_pad_ids(cfg, sampling)
  b, p = prompt_BxP.shape
  keys_B = decoding.row_keys(key, b)
  g, bl = sampling.gen_length, sampling.block_length
  steps_per_block = sampling.steps // (g // bl)
  tokens, positions, valid, prompt_mask = rollouts.llada_layout(prompt_BxP, prompt_valid_BxP, g, mask_id)

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
    x0_BxK, conf_BxK = decoding.choose_tokens(logits_BxKxV, keys_B, s, sampling.temperature,
                                              sampling.remasking)
    k_B = schedule_BxS[:, s % steps_per_block]
    commit = decoding.select_top_k(decoding.order_scores(conf_BxK, sampling.order), still_masked,
                                   k_B)
    block_BxK = jnp.where(commit, x0_BxK, block_BxK)
    when_BxK = jnp.where(commit, s, jax.lax.dynamic_slice_in_dim(when_BxL, start, bl, axis=1))
    return (jax.lax.dynamic_update_slice_in_dim(x_BxL, block_BxK, start, axis=1), schedule_BxS,
            jax.lax.dynamic_update_slice_in_dim(when_BxL, when_BxK, start, axis=1))

  schedule0 = jnp.zeros((b, steps_per_block), jnp.int32)
  when0 = jnp.full(tokens.shape, -1, jnp.int32)
  tokens, _, when = jax.lax.fori_loop(0, sampling.steps, step, (tokens, schedule0, when0))
  generated = jnp.zeros_like(valid).at[:, p:].set(True)
  copies = 2 if sampling.cfg_scale > 0 else 1
  return rollouts.finish(tokens, positions, valid, prompt_mask, generated, jnp.full((b,), p, jnp.int32),
                g, stop_ids, pad_id, when, sampling.steps * copies,
                sampling.steps * copies * tokens.shape[1])


# ----------------------------------------------------------------------------- SDAR


def sdar_generate(model: nnx.Module, prompt_BxP: Array, prompt_valid_BxP: Array, key: Array,
                  sampling: SDARSampling | LLaDA2Sampling) -> Rollout:
  """SDAR block decoding (docs/method.md §5) of left-padded prompts; returns a `Rollout`.

  The prompt's complete blocks are prefilled block-causally into a KV cache. Each following block
  is denoised by up to `steps` forwards over the cache plus the block (bidirectional inside it);
  each forward samples `x̂` (temperature / top-k / top-p, Gumbel draws) and commits the scheduled
  number of most confident masked tokens (`low_confidence_static`; `order=left_to_right`: the
  leftmost, one a step), or every token whose confidence exceeds `threshold` but at least the
  scheduled number (`low_confidence_dynamic`).
  A finished block costs one more forward that writes its keys and values to the cache. A row
  stops after the block in which it produced a stop token; the loop stops when every row has.
  With `use_cache=False` each forward recomputes the whole sequence block-causally instead.

  `LLaDA2Sampling` decodes as LLaDA2.0's released `generate` (its docstring): the same loop with
  a per-step schedule of the whole block, the released token choice (mask token allowed), the
  `minimal_topk` cap on the steps, and the last block's slots after `gen_length` denoised too.
  """
  return _sdar_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)


@nnx.jit(static_argnames=("sampling",))
def _sdar_generate(model, prompt_BxP, prompt_valid_BxP, key,
                   sampling: SDARSampling | LLaDA2Sampling) -> Rollout:
  cfg = model.config
  bs = sampling.block_length
  released = isinstance(sampling, LLaDA2Sampling)
  steps = sampling.steps_per_block if released else sampling.steps
  mask_id = cfg.mask_token_id
  stop_ids, pad_id = decoding.stop_and_pad_ids(cfg, sampling)
  stop_arr = jnp.asarray(stop_ids, jnp.int32)
  b = prompt_BxP.shape[0]
  keys_B = decoding.row_keys(key, b)
  tokens, positions, valid, prompt_mask, generated, first_block, num_blocks = rollouts.sdar_layout(
      prompt_BxP, prompt_valid_BxP, sampling.gen_length, bs, mask_id)
  t = tokens.shape[1]
  denoised, attended = generated, valid
  if released:  # the last block's slots after gen_length: denoised and attended, cut at the end
    end_B = jnp.sum(prompt_valid_BxP, axis=1).astype(jnp.int32) + sampling.gen_length
    tail = (positions >= end_B[:, None]) & (positions // bs == ((end_B - 1) // bs)[:, None])
    denoised, attended = generated | tail, valid | tail

  def slice_block(x, j):
    return jax.lax.dynamic_slice_in_dim(x, j * bs, bs, axis=1)

  cache = None
  if sampling.use_cache:
    cache = model.init_cache(b, t)
  if sampling.use_cache and first_block:  # no complete prompt block: nothing to prefill
    _, cache = model.cached_logits(tokens[:, :first_block * bs], cache,
                                   positions_BxT=positions[:, :first_block * bs], commit=True,
                                   block_size=bs, valid_BxT=attended[:, :first_block * bs])

  def block_logits(x_BxL, j, cache):
    if sampling.use_cache:
      logits, _ = model.cached_logits(slice_block(x_BxL, j), cache,
                                      positions_BxT=slice_block(positions, j), commit=False,
                                      block_size=bs, valid_BxT=slice_block(attended, j))
      return logits
    logits = model.logits(x_BxL, attention="block_causal", block_size=bs, positions=positions,
                          valid_BxL=attended)
    return slice_block(logits, j)

  def choose(logits, u_choice):
    if released:
      return decoding.llada2_choose(logits, u_choice, sampling.temperature, sampling.top_k,
                                    sampling.top_p)
    logits = decoding.forbid(logits, mask_id)
    if sampling.temperature > 0:  # sample from the tempered, filtered distribution
      logits = decoding.filter_logits(logits / sampling.temperature, top_k=sampling.top_k,
                                      top_p=sampling.top_p)
    x0 = decoding.gumbel_argmax(logits, 1.0 if sampling.temperature > 0 else 0.0, u_choice)
    probs = jax.nn.softmax(logits, axis=-1)
    return x0, jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]

  def denoise_block(j, x_BxL, when_BxL, cache, active_B):
    blk_gen = slice_block(denoised, j) & active_B[:, None]
    # LLaDA2.0 schedules the whole block; SDAR its masked slots.
    to_commit_B = (jnp.where(active_B, bs, 0) if released
                   else jnp.sum(slice_block(x_BxL, j) == mask_id, -1) * active_B)
    schedule_BxS = decoding.commit_schedule(to_commit_B, steps)

    def cond(c):
      x, _, s, _ = c
      return (s < steps) & jnp.any((slice_block(x, j) == mask_id) & blk_gen)

    def body(c):
      x, when, s, n = c
      blk = slice_block(x, j)
      still_masked = (blk == mask_id) & blk_gen
      logits = block_logits(x, j, cache)
      u_choice, _ = decoding.uniforms(keys_B, j * steps + s, logits.shape)
      x0, conf = choose(logits, u_choice)
      order = "confidence" if released else sampling.order
      commit = decoding.confident_commit(decoding.order_scores(conf, order), still_masked,
                                         schedule_BxS[:, s], sampling.threshold, strict=True)
      blk = jnp.where(commit, x0, blk)
      when_blk = jnp.where(commit, j * steps + s, slice_block(when, j))
      return (jax.lax.dynamic_update_slice_in_dim(x, blk, j * bs, axis=1),
              jax.lax.dynamic_update_slice_in_dim(when, when_blk, j * bs, axis=1), s + 1, n + 1)

    x_BxL, when_BxL, _, used = jax.lax.while_loop(
        cond, body, (x_BxL, when_BxL, jnp.int32(0), jnp.int32(0)))
    return x_BxL, when_BxL, used

  def block_step(c):
    x, when, j, cache, active_B, step0 = c
    x, when, used = denoise_block(j, x, when, cache, active_B)
    if sampling.use_cache:
      _, cache = model.cached_logits(slice_block(x, j), cache, positions_BxT=slice_block(positions, j),
                                     commit=True, block_size=bs, valid_BxT=slice_block(attended, j))
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
  return rollouts.finish(tokens, positions, valid, prompt_mask, generated, gen_start_B,
                sampling.gen_length, stop_ids, pad_id, when, forwards, forward_tokens)


# ----------------------------------------------------------------------------- Dream


def dream_generate(model: nnx.Module, prompt_BxP: Array, prompt_valid_BxP: Array, key: Array,
                   sampling: DreamSampling) -> Rollout:
  """Dream's `diffusion_generate` (docs/method.md §5) of left-padded prompts; returns a `Rollout`.

  LLaDA's layout `[pads | prompt | gen_length masks]`, no blocks. Each of the `steps` steps runs
  one full forward (the model shifts Dream's next-token logits onto their slots) and takes, for
  every generated slot, `(x̂, confidence)` from its logits (`decoding.dream_choose_tokens`: the
  mask token is a candidate). It then commits masked slots (`decoding.dream_commit`): `origin`
  each with probability `1 - s/t`; the others the `⌊m (1 - s/t)⌋` most confident of the `m`
  masked (sampled with `alg_temp`); the last step commits every masked slot. A slot that commits
  the mask token stays masked. Every step runs (no early stop); stop tokens are truncated after.

  The released code counts `m` over the batch (the mean number of masked slots per row); here
  it is each row's own, which is the same while no row has committed a mask token (and the
  released rule, with unequal rows, could write a mask over a decoded token).

  With a `cache` or a `threshold` (`sampling.fast`), decoding is Fast-dLLM's approximate Dream
  decoder of `fast_decoding` instead (blocks of `block_length`).
  """
  if sampling.fast:
    return fast_decoding.generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)
  return _dream_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling)


@nnx.jit(static_argnames=("sampling",))
def _dream_generate(model, prompt_BxP, prompt_valid_BxP, key, sampling: DreamSampling) -> Rollout:
  cfg = model.config
  mask_id = cfg.mask_token_id
  stop_ids, pad_id = decoding.stop_and_pad_ids(cfg, sampling)
  b, p = prompt_BxP.shape
  keys_B = decoding.row_keys(key, b)
  g = sampling.gen_length
  tokens, positions, valid, prompt_mask = rollouts.llada_layout(prompt_BxP, prompt_valid_BxP, g,
                                                                mask_id)
  fractions_S = jnp.asarray(decoding.dream_fractions(sampling.steps, sampling.eps))

  def step(s, carry):
    x_BxL, when_BxL = carry
    h = model.logits(x_BxL, attention="full", positions=positions, valid_BxL=valid, head=False)
    logits_BxGxV = model.head_logits(h[:, p:])  # the head on the generated slots only
    gen_BxG, when_BxG = x_BxL[:, p:], when_BxL[:, p:]
    masked_BxG = gen_BxG == mask_id
    u_choice, u_slot = decoding.uniforms(keys_B, s, logits_BxGxV.shape)
    x0_BxG, conf_BxG = decoding.dream_choose_tokens(
        logits_BxGxV, u_choice, alg=sampling.alg, temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p)
    commit = decoding.dream_commit(conf_BxG, masked_BxG, u_slot[..., 0], fractions_S[s],
                                   alg=sampling.alg, alg_temp=sampling.alg_temp)
    gen_BxG = jnp.where(commit, x0_BxG, gen_BxG)
    when_BxG = jnp.where(commit & (x0_BxG != mask_id), s, when_BxG)
    return (jnp.concatenate([x_BxL[:, :p], gen_BxG], axis=1),
            jnp.concatenate([when_BxL[:, :p], when_BxG], axis=1))

  when0 = jnp.full(tokens.shape, -1, jnp.int32)
  tokens, when = jax.lax.fori_loop(0, sampling.steps, step, (tokens, when0))
  generated = jnp.zeros_like(valid).at[:, p:].set(True)
  return rollouts.finish(tokens, positions, valid, prompt_mask, generated,
                         jnp.full((b,), p, jnp.int32), g, stop_ids, pad_id, when, sampling.steps,
                         sampling.steps * tokens.shape[1])
