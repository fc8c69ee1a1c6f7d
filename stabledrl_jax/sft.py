"""One SFT step, top to bottom: demonstrations -> the sampler's layout -> masked-diffusion loss ->
optimiser update (`step`), with the compiled update next to the loss it wraps.

`random_t` is LLaDA's pretraining/SFT objective; `block_t` with the staircase is SDAR's
block-diffusion objective (each block's noisy copy conditioned on the clean prefix).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import (estimators, flops, likelihood, losses, lora, metrics, models, optim,
                           rollouts, sharding)
from stabledrl_jax.rollouts import Sequences

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Settings:
  """`config.sft` and what the SFT step needs of the rest of the config (`from_config`)."""
  scheme: str        # estimators.SCHEMES: random_t (LLaDA's SFT), block_t (SDAR's)
  batch_size: int
  gen_length: int    # sampler.gen_length: every completion is padded with its stop token to it
  family: str        # the layout: llada or sdar
  block_size: int    # sampler.block_length
  seed: int

  def __post_init__(self):
    if self.scheme not in estimators.SCHEMES:
      raise ValueError(f"config.sft.scheme={self.scheme!r}: expected one of {estimators.SCHEMES}")
    if self.scheme == "complementary":  # pairs of masks; SFT draws one mask per example
      raise ValueError("config.sft.scheme='complementary': SFT draws one mask per example, "
                       "the scheme needs pairs; use random_t or block_t")
    if self.batch_size < 1:
      raise ValueError(f"config.sft.batch_size={self.batch_size!r}: must be >= 1")

  @property
  def staircase(self) -> bool:
    return self.family in models.BLOCK_DIFFUSION

  @classmethod
  def from_config(cls, c) -> Settings:
    return cls(scheme=c.sft.scheme, batch_size=c.sft.batch_size, gen_length=c.sampler.gen_length,
               family=c.family, block_size=c.sampler.block_length, seed=c.seed)


def sft_loss(model, seqs: Sequences, key: Array, *, scheme: str, staircase: bool,
             block_size: int) -> tuple[Array, dict[str, Array]]:
  """Masked-diffusion SFT: minus the Monte Carlo ELBO of the reference completions (one mask)."""
  masks = likelihood.sample(key, seqs, scheme=scheme, num_samples=1, p_mask_prompt=0.0,
                            block_size=block_size)
  lp = likelihood.masked_logp(model, seqs, masks.noised_BxMxL, staircase=staircase,
                              block_size=block_size)
  elbo = losses.mc_elbo(lp, masks.weight_BxMxL)
  return -jnp.mean(elbo), {}


# The update donates the model and optimiser buffers (XLA updates them in place).
@nnx.jit(static_argnames=("scheme", "staircase", "block_size"),
         donate_argnames=("model", "optimizer"))
def update(model, optimizer, seqs, key, *, scheme, staircase, block_size):
  """One optimiser step on the trainable parameters (`lora.trainable`: the adapters alone when
  the model has any, with their dropout drawn from `key`)."""
  graphdef, params, rest = nnx.split(model, lora.trainable(model), ...)

  def loss_fn(p):
    policy = nnx.merge(graphdef, p, rest)
    lora.set_dropout_key(policy, jax.random.fold_in(key, lora.DROPOUT_STREAM))
    return sft_loss(policy, seqs, key, scheme=scheme, staircase=staircase, block_size=block_size)
  (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return {"loss": loss, **optim.apply(model, optimizer, grads)}


def targets(s: Settings, task, examples, step: int, start: int) -> list[str]:
  """The SFT completions of `examples` (global rows `start`...): the task's references, or its
  demonstrator's answers where it has one (`Task.demonstrate`). Each row's draw depends only on
  (seed, step, global row), so resumed runs and any process count train on the same targets."""
  if task.demonstrate is not None:
    return [task.demonstrate(ex, np.random.default_rng([s.seed, step, start + i]))
            for i, ex in enumerate(examples)]
  return [task.reference_completion(ex) for ex in examples]


def encode_completions(tokenizer, texts: list[str], gen_length: int) -> np.ndarray:
  """Completions, each ending in a stop token and padded with it to `gen_length`."""
  out = np.full((len(texts), gen_length), tokenizer.eos_id, np.int32)
  for i, text in enumerate(texts):
    ids = tokenizer.encode(text)
    if len(ids) >= gen_length:
      raise ValueError(f"SFT completion of {len(ids)} tokens does not fit "
                       f"sampler.gen_length={gen_length} (one slot is needed for the stop token)")
    out[i, :len(ids)] = ids
  return out


def step(s: Settings, data, model, optimizer, key, index: int) -> metrics.StepResult:
  """SFT step `index` on this process's next batch of `data.sft`."""
  batch = next(data.sft)
  texts = targets(s, data.task, batch["examples"], index, data.sft_rows[0])
  completions = encode_completions(data.tokenizer, texts, s.gen_length)
  seqs = rollouts.teacher_forced(
      jnp.asarray(batch["prompt_ids_BxP"]), jnp.asarray(batch["prompt_mask_BxP"]),
      jnp.asarray(completions), family=s.family, block_size=s.block_size,
      mask_id=model.config.mask_token_id)
  seqs = sharding.shard_batch(seqs, sharding.model_mesh(model), rows=s.batch_size,
                              start=data.sft_rows[0])
  out = update(model, optimizer, seqs, key, scheme=s.scheme, staircase=s.staircase,
               block_size=s.block_size)
  rows, length = seqs.tokens_BxL.shape
  step_flops = {"update": 3.0 * flops.forward_flops(model.config, rows,
                                                    length * (2 if s.staircase else 1))}
  return metrics.StepResult({k: float(v) for k, v in out.items()}, s.batch_size * s.gen_length,
                            step_flops)
