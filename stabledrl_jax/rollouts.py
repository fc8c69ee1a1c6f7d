"""The rollout layer every sampler and every consumer of rollouts builds on: the samplers'
settings (`LLaDASampling`, `SDARSampling`, `DreamSampling`, from `config.sampler`), the sequence
layouts, the `Rollout` a sampler returns (`finish`) and the `Sequences` the likelihood scores.

Layout. Prompts come left-padded, `[B, P]` ids with a `[B, P]` validity mask. Each row's
positions start at 0 at its first real token, so padding never changes what a row computes.
- LLaDA and Dream (full attention): `[pads | prompt | gen_length masks]`; the generated region
  is the same slots for every row (LLaDA splits it into blocks of `block_length`).
- SDAR: blocks are `position // block_length`, so a prompt that does not fill its last block
  shares it with the first generated tokens. Rows are shifted by whole blocks so that their first
  generated block falls on the same slots; slots before a row's first token or after its last
  generated token are invalid (never attended to, never written).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from stabledrl_jax import decoding
from stabledrl_jax.models.config import BLOCK_DIFFUSION

Array = jax.Array


# ----------------------------------------------------------------------------- settings


def _check(ok: bool, key: str, value, why: str) -> None:
  if not ok:
    raise ValueError(f"config.sampler.{key}={value!r}: {why}")


@dataclasses.dataclass(frozen=True)
class LLaDASampling:
  """LLaDA semi-autoregressive decoding (docs/method.md §5). The fields are `config.sampler`'s
  keys and have no defaults of their own: build it with every field or with `from_config`.
  `cache` or a `threshold` selects the approximate fast decoder (`fast_decoding`)."""
  gen_length: int
  block_length: int
  steps: int
  temperature: float
  remasking: str    # low_confidence | random
  cfg_scale: float  # classifier-free guidance scale; 0 = none
  cache: str        # none | prefix | dual
  threshold: float  # commit every masked token at least this confident; 0 = off
  order: str        # decoding.ORDERS: confidence (remasking's) | left_to_right
  chunk: int  # rows decoded at once (`samplers.sampler_of`); 0 = the whole batch
  stop_ids: tuple[int, ...] = ()  # () = the model config's stop tokens
  pad_id: int | None = None       # None = the model config's pad (else eos) token

  def __post_init__(self):
    _check(self.chunk >= 0, "chunk", self.chunk, "must be >= 0 (0 = the whole batch at once)")
    _check(self.gen_length >= 1, "gen_length", self.gen_length, "must be >= 1")
    _check(self.block_length >= 1 and self.gen_length % self.block_length == 0, "block_length",
           self.block_length, f"must divide sampler.gen_length={self.gen_length}")
    blocks = self.gen_length // self.block_length
    _check(self.steps >= blocks and self.steps % blocks == 0, "steps", self.steps,
           f"must be a positive multiple of the number of blocks ({blocks} = gen_length / "
           "block_length)")
    _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
    _check(self.remasking in ("low_confidence", "random"), "remasking", self.remasking,
           "expected low_confidence or random")
    _check(self.cfg_scale >= 0, "cfg_scale", self.cfg_scale, "must be >= 0 (0 = no guidance)")
    _check(self.cache in ("none", "prefix", "dual"), "cache", self.cache,
           "expected none, prefix or dual")
    _check(0 <= self.threshold <= 1, "threshold", self.threshold, "must lie in [0, 1] (0 = off)")
    _check(self.order in decoding.ORDERS, "order", self.order,
           f"expected one of {', '.join(decoding.ORDERS)}")
    if self.order == "left_to_right":  # one token a step, in position order
      _check(self.steps == self.gen_length, "steps", self.steps,
             f"sampler.order=left_to_right commits one token a step: set it to sampler.gen_length "
             f"({self.gen_length})")
      _check(not self.threshold, "threshold", self.threshold,
             "sampler.order=left_to_right commits one token a step, not by threshold (set 0)")
      _check(self.remasking == "low_confidence", "remasking", self.remasking,
             "sampler.order=left_to_right fixes the order that remasking=random would draw "
             "(set low_confidence)")

  @classmethod
  def from_config(cls, sampler: ml_collections.ConfigDict, temperature: float) -> LLaDASampling:
    _check(not sampler.top_k, "top_k", sampler.top_k, "the LLaDA sampler has no top-k (set 0)")
    _check(sampler.top_p == 1, "top_p", sampler.top_p, "the LLaDA sampler has no top-p (set 1)")
    return cls(gen_length=sampler.gen_length, block_length=sampler.block_length,
               steps=sampler.steps, temperature=temperature, remasking=sampler.remasking,
               cfg_scale=sampler.cfg_scale, cache=sampler.cache, threshold=sampler.threshold,
               order=sampler.order, chunk=sampler.chunk)

  @property
  def fast(self) -> bool:
    """Whether decoding is the approximate fast algorithm (not the model's exact distribution)."""
    return self.cache != "none" or self.threshold > 0

  def exact(self) -> LLaDASampling:
    return dataclasses.replace(self, cache="none", threshold=0.0)

  @property
  def head_slots(self) -> int:
    """Slots a decoding forward runs the vocabulary head on (the current block)."""
    return self.block_length

  @property
  def label(self) -> str:
    """Which sampler this is, for logs and records."""
    order = " left_to_right" if self.order == "left_to_right" else ""
    if not self.fast:
      return "llada exact" + order
    return f"llada cache={self.cache} threshold={self.threshold}" + order


def _block_decoding_keys(sampler: ml_collections.ConfigDict, family: str) -> None:
  """The LLaDA-only keys a block-diffusion sampler refuses."""
  _check(sampler.cache == "none", "cache", sampler.cache,
         f"{family} decodes with its own KV cache; the block-wise cache is LLaDA's (set none)")
  _check(not sampler.cfg_scale, "cfg_scale", sampler.cfg_scale,
         f"the {family} sampler has no classifier-free guidance (set 0)")


@dataclasses.dataclass(frozen=True)
class SDARSampling:
  """SDAR block decoding (docs/method.md §5). The fields are `config.sampler`'s keys and have no
  defaults of their own: build it with every field or with `from_config`."""
  gen_length: int
  block_length: int  # the diffusion block
  steps: int         # denoising forwards per block, at most
  strategy: str      # low_confidence_static | low_confidence_dynamic
  threshold: float   # low_confidence_dynamic: commit every token above it; 0 = off (static)
  temperature: float
  top_k: int         # 0 = all tokens
  top_p: float       # 1 = all tokens
  order: str         # decoding.ORDERS: confidence (strategy's) | left_to_right
  chunk: int  # rows decoded at once (`samplers.sampler_of`); 0 = the whole batch
  stop_ids: tuple[int, ...] = ()  # () = the model config's stop tokens
  pad_id: int | None = None       # None = the model config's pad (else eos) token
  use_cache: bool = True  # False recomputes the whole prefix every step (the reference path)

  def __post_init__(self):
    _check(self.chunk >= 0, "chunk", self.chunk, "must be >= 0 (0 = the whole batch at once)")
    _check(self.gen_length >= 1, "gen_length", self.gen_length, "must be >= 1")
    _check(self.block_length >= 1, "block_length", self.block_length, "must be >= 1")
    _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
    _check(self.strategy in ("low_confidence_static", "low_confidence_dynamic"), "strategy",
           self.strategy, "expected low_confidence_static or low_confidence_dynamic")
    if self.strategy == "low_confidence_dynamic":
      _check(0 < self.threshold <= 1, "threshold", self.threshold,
             "sampler.strategy=low_confidence_dynamic commits every token above it: set it in (0, 1]")
    else:
      _check(self.threshold == 0, "threshold", self.threshold,
             "only sampler.strategy=low_confidence_dynamic commits by threshold (0 = off)")
    _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
    _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 = all tokens)")
    _check(0 < self.top_p <= 1, "top_p", self.top_p, "must lie in (0, 1]")
    _check(self.order in decoding.ORDERS, "order", self.order,
           f"expected one of {', '.join(decoding.ORDERS)}")
    if self.order == "left_to_right":  # one token a step, in position order, block by block
      _check(self.steps == self.block_length, "steps", self.steps,
             f"sampler.order=left_to_right commits one token a step: set it to "
             f"sampler.block_length ({self.block_length}), the steps per block")
      _check(self.strategy == "low_confidence_static", "strategy", self.strategy,
             "sampler.order=left_to_right commits one token a step, not by threshold (set "
             "low_confidence_static)")

  @classmethod
  def from_config(cls, sampler: ml_collections.ConfigDict, temperature: float) -> SDARSampling:
    _block_decoding_keys(sampler, "SDAR")
    return cls(gen_length=sampler.gen_length, block_length=sampler.block_length,
               steps=sampler.steps, strategy=sampler.strategy, threshold=sampler.threshold,
               temperature=temperature, top_k=sampler.top_k, top_p=sampler.top_p,
               order=sampler.order, chunk=sampler.chunk)

  @property
  def fast(self) -> bool:
    """Whether more than the scheduled tokens can be committed per step (threshold commits)."""
    return self.strategy == "low_confidence_dynamic"

  def exact(self) -> SDARSampling:
    return dataclasses.replace(self, strategy="low_confidence_static", threshold=0.0)

  @property
  def head_slots(self) -> int:
    """Slots a decoding forward runs the vocabulary head on (the current block)."""
    return self.block_length

  @property
  def label(self) -> str:
    if self.fast:
      return f"sdar {self.strategy} threshold={self.threshold}"
    return f"sdar {self.strategy}" + (" left_to_right" if self.order == "left_to_right" else "")


@dataclasses.dataclass(frozen=True)
class LLaDA2Sampling:
  """LLaDA2.0's released `generate` (modeling_llada2_moe.py), batched over left-padded prompts.
  The fields are `config.sampler`'s keys and have no defaults of their own.

  Blocks of `block_length` counted from position 0; each block runs up to
  `min(steps, gen_length // minimal_topk)` forwards, step s scheduled to commit
  ⌊block_length / steps⌋ (+1 for the first block_length mod steps steps) of its masked slots,
  or every masked slot whose probability exceeds `threshold` when they are more. The last
  block's slots after `gen_length` are denoised with the rest and cut after. Tokens: greedy at
  temperature 0 without top-k/top-p; otherwise drawn from softmax(logits / temperature, top-k,
  then top-p keeping the token that crosses p) (temperature 0 with a filter: temperature 1, as
  released). The mask token is not excluded. `threshold` 0 turns the threshold off (the released
  routine's default is 0.95)."""
  gen_length: int
  block_length: int
  steps: int         # denoising forwards per block, at most (before the minimal_topk cap)
  minimal_topk: int  # steps <= gen_length // minimal_topk
  threshold: float   # 0 = off
  temperature: float
  top_k: int         # 0 = all tokens
  top_p: float       # 1 = all tokens
  chunk: int  # rows decoded at once (`samplers.sampler_of`); 0 = the whole batch
  stop_ids: tuple[int, ...] = ()  # () = the model config's stop tokens
  pad_id: int | None = None       # None = the model config's pad (else eos) token
  use_cache: bool = True  # False recomputes the whole prefix every step (as released)

  def __post_init__(self):
    _check(self.chunk >= 0, "chunk", self.chunk, "must be >= 0 (0 = the whole batch at once)")
    _check(self.gen_length >= 1, "gen_length", self.gen_length, "must be >= 1")
    _check(self.block_length >= 1, "block_length", self.block_length, "must be >= 1")
    _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
    _check(1 <= self.minimal_topk <= self.gen_length, "minimal_topk", self.minimal_topk,
           f"must lie in [1, gen_length={self.gen_length}] (steps <= gen_length // it)")
    _check(0 <= self.threshold <= 1, "threshold", self.threshold, "must lie in [0, 1] (0 = off)")
    _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
    _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 = all tokens)")
    _check(0 < self.top_p <= 1, "top_p", self.top_p, "must lie in (0, 1]")

  @classmethod
  def from_config(cls, sampler: ml_collections.ConfigDict, temperature: float) -> LLaDA2Sampling:
    _block_decoding_keys(sampler, "LLaDA2.0")
    _check(sampler.order == "confidence", "order", sampler.order,
           "LLaDA2.0's generate commits by confidence (set confidence)")
    return cls(gen_length=sampler.gen_length, block_length=sampler.block_length,
               steps=sampler.steps, minimal_topk=sampler.minimal_topk,
               threshold=sampler.threshold, temperature=temperature, top_k=sampler.top_k,
               top_p=sampler.top_p, chunk=sampler.chunk)

  @property
  def steps_per_block(self) -> int:
    return min(self.steps, self.gen_length // self.minimal_topk)

  @property
  def fast(self) -> bool:
    """Whether more than the scheduled tokens can be committed per step (threshold commits)."""
    return self.threshold > 0

  def exact(self) -> LLaDA2Sampling:
    return dataclasses.replace(self, threshold=0.0)

  @property
  def head_slots(self) -> int:
    """Slots a decoding forward runs the vocabulary head on (the current block)."""
    return self.block_length

  @property
  def label(self) -> str:
    return f"llada2 threshold={self.threshold}" if self.fast else "llada2"


@dataclasses.dataclass(frozen=True)
class DreamSampling:
  """Dream's `diffusion_generate` (docs/method.md §5): `steps` full forwards over the whole
  generated region, step i committing the fraction `1 - s/t` of the masked slots (t, s: timesteps
  i, i + 1 of `linspace(1, eps, steps + 1)`; the last step commits the rest), chosen by `alg`.
  `cache` or a `threshold` selects Fast-dLLM's Dream decoder instead (`fast_decoding`: blocks of
  `block_length`, approximate), which the exact sampler's `block_length` does not affect.
  The fields are `config.sampler`'s keys and have no defaults of their own: build it with every
  field or with `from_config`."""
  gen_length: int
  steps: int
  alg: str           # decoding.DREAM_ALGS: origin | maskgit_plus | topk_margin | entropy
  alg_temp: float    # > 0: commit positions drawn from softmax(confidence / alg_temp); 0 = top
  eps: float         # the last timestep
  temperature: float
  top_k: int         # 0 = all tokens
  top_p: float       # 1 = all tokens
  block_length: int  # the fast decoder's blocks
  cache: str         # none | prefix | dual
  threshold: float   # commit every masked token of the block at least this probable; 0 = off
  chunk: int  # rows decoded at once (`samplers.sampler_of`); 0 = the whole batch
  stop_ids: tuple[int, ...] = ()  # () = the model config's stop tokens
  pad_id: int | None = None       # None = the model config's pad (else eos) token

  def __post_init__(self):
    _check(self.chunk >= 0, "chunk", self.chunk, "must be >= 0 (0 = the whole batch at once)")
    _check(self.gen_length >= 1, "gen_length", self.gen_length, "must be >= 1")
    _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
    _check(self.alg in decoding.DREAM_ALGS, "alg", self.alg,
           f"expected one of {', '.join(decoding.DREAM_ALGS)}")
    _check(self.alg_temp >= 0, "alg_temp", self.alg_temp, "must be >= 0 (0 = the most confident)")
    _check(not (self.alg == "origin" and self.alg_temp), "alg_temp", self.alg_temp,
           "sampler.alg=origin commits at random; alg_temp is for the confidence algorithms "
           "(set 0)")
    _check(0 < self.eps < 1, "eps", self.eps, "must lie in (0, 1)")
    _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
    _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 = all tokens)")
    _check(0 < self.top_p <= 1, "top_p", self.top_p, "must lie in (0, 1]")
    _check(self.cache in ("none", "prefix", "dual"), "cache", self.cache,
           "expected none, prefix or dual")
    _check(0 <= self.threshold <= 1, "threshold", self.threshold, "must lie in [0, 1] (0 = off)")
    if not self.fast:
      return
    _check(self.block_length >= 1 and self.gen_length % self.block_length == 0, "block_length",
           self.block_length, f"must divide sampler.gen_length={self.gen_length}")
    blocks = self.gen_length // self.block_length
    _check(self.steps >= 2 * blocks and self.steps % blocks == 0, "steps", self.steps,
           f"Dream's fast decoder needs a multiple of the number of blocks ({blocks} = gen_length "
           "/ block_length) with at least 2 steps a block (the first commits only the block's "
           "first slot)")
    if self.threshold:
      _check(self.alg == "maskgit_plus", "alg", self.alg,
             "the threshold compares x̂'s probability, which is maskgit_plus's confidence "
             "(Fast-dLLM's confidence_threshold): set sampler.alg=maskgit_plus")
      _check(not self.alg_temp, "alg_temp", self.alg_temp,
             "threshold decoding commits the most probable tokens, not a draw (set 0)")

  @classmethod
  def from_config(cls, sampler: ml_collections.ConfigDict, temperature: float) -> DreamSampling:
    _check(not sampler.cfg_scale, "cfg_scale", sampler.cfg_scale,
           "the Dream sampler has no classifier-free guidance (set 0)")
    _check(sampler.order == "confidence", "order", sampler.order,
           "the Dream sampler's order is sampler.alg's (set confidence)")
    return cls(gen_length=sampler.gen_length, steps=sampler.steps, alg=sampler.alg,
               alg_temp=sampler.alg_temp, eps=sampler.eps, temperature=temperature,
               top_k=sampler.top_k, top_p=sampler.top_p, block_length=sampler.block_length,
               cache=sampler.cache, threshold=sampler.threshold, chunk=sampler.chunk)

  @property
  def fast(self) -> bool:
    """Whether decoding is Fast-dLLM's approximate Dream decoder (not the released sampler)."""
    return self.cache != "none" or self.threshold > 0

  def exact(self) -> DreamSampling:
    return dataclasses.replace(self, cache="none", threshold=0.0)

  @property
  def head_slots(self) -> int:
    """Slots a decoding forward runs the vocabulary head on: the whole generated region, or the
    fast decoder's block."""
    return self.block_length if self.fast else self.gen_length

  @property
  def label(self) -> str:
    alg = f"dream {self.alg}" + (f" alg_temp={self.alg_temp}" if self.alg_temp else "")
    if not self.fast:
      return alg
    return f"{alg} block={self.block_length} cache={self.cache} threshold={self.threshold}"


SAMPLINGS = {"llada": LLaDASampling, "sdar": SDARSampling, "dream": DreamSampling,
             "llada2": LLaDA2Sampling}


def sampling_from_config(c: ml_collections.ConfigDict, temperature: float):
  """The family's sampler settings of `config.sampler` at `temperature`."""
  return SAMPLINGS[c.family].from_config(c.sampler, temperature)


# ----------------------------------------------------------------------------- layouts


class Rollout(NamedTuple):
  """What a sampler returns. Slots are the family's layout (module docstring)."""
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


class Sequences(NamedTuple):
  """A batch of prompt + completion in the family's layout: a rollout's (`from_rollout`) or a
  demonstration's (`teacher_forced`)."""
  tokens_BxL: Array
  positions_BxL: Array
  valid_BxL: Array       # real tokens
  prompt_BxL: Array      # prompt tokens
  completion_BxL: Array  # the generated region (noised by estimators)
  counted_BxL: Array     # completion positions that count (up to the first stop token)
  # int32 decoding step that committed each slot, -1 for the rest (the rollout's, for the
  # trajectory likelihood); None for sequences no sampler decoded (`teacher_forced`)
  commit_step_BxL: Array | None = None


def from_rollout(rollout: Rollout) -> Sequences:
  completion = rollout.valid_BxL & ~rollout.prompt_mask_BxL
  return Sequences(rollout.tokens_BxL, rollout.positions_BxL, rollout.valid_BxL,
                   rollout.prompt_mask_BxL, completion, rollout.completion_mask_BxL,
                   rollout.commit_step_BxL)


def teacher_forced(prompt_BxP: Array, prompt_valid_BxP: Array, completion_BxC: Array, *,
                   family: str, block_size: int | None, mask_id: int) -> Sequences:
  """Prompts and given completions in the sampler's layout (SFT data), every completion slot
  counted (stop-token padding included, so the model learns to stop)."""
  g = completion_BxC.shape[1]
  if family in BLOCK_DIFFUSION:
    tokens, positions, valid, prompt, generated, _, _ = sdar_layout(
        prompt_BxP, prompt_valid_BxP, g, block_size, mask_id)
    start_B = jnp.argmax(generated, axis=1).astype(jnp.int32)
  else:  # the full-attention families (LLaDA, Dream) share LLaDA's layout
    tokens, positions, valid, prompt = llada_layout(prompt_BxP, prompt_valid_BxP, g, mask_id)
    generated = valid & ~prompt
    start_B = jnp.full((tokens.shape[0],), prompt_BxP.shape[1], jnp.int32)
  offset_BxL = jnp.clip(jnp.arange(tokens.shape[1])[None, :] - start_B[:, None], 0, g - 1)
  filled = jnp.take_along_axis(completion_BxC.astype(jnp.int32), offset_BxL, axis=1)
  tokens = jnp.where(generated, filled, tokens)
  return Sequences(tokens, positions, valid, prompt, generated, generated)
