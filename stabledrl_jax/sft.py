"""One SFT step, top to bottom: demonstrations -> the sampler's layout -> masked-diffusion loss ->
optimiser update (`step`), with the compiled update next to the loss it wraps.

`random_t` is LLaDA's pretraining/SFT objective; `block_t` with the staircase is SDAR's
block-diffusion objective (each block's noisy copy conditioned on the clean prefix).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import flops, likelihood, losses, metrics, optim, sharding
from stabledrl_jax.tasks import sudoku

Array = jax.Array


def sft_loss(model, seqs: likelihood.Sequences, key: Array, *, scheme: str, staircase: bool,
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
  def loss_fn(m):
    return sft_loss(m, seqs, key, scheme=scheme, staircase=staircase, block_size=block_size)
  (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  return {"loss": loss, **optim.apply(model, optimizer, grads)}


def targets(c, task, examples, step: int, start: int) -> list[str]:
  """The SFT completions of `examples` (global rows `start`...): the task's references, or for
  Sudoku with `task.sft_unfilled` > 0 a weaker demonstrator's answers. Each row's draw depends only
  on (seed, step, global row), so resumed runs and any process count train on the same targets."""
  if c.task.name == "sudoku" and c.task.sft_unfilled:
    return [sudoku.unfilled_demonstration(ex, c.task.sft_unfilled,
                                          np.random.default_rng([c.seed, step, start + i]))
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


def step(c, s, data, model, optimizer, key, index: int) -> metrics.StepResult:
  """SFT step `index` of the run configured by `c` (`s = config_lib.settings(c)`) on this
  process's next batch of `data.sft`."""
  batch = next(data.sft)
  texts = targets(c, data.task, batch["examples"], index, data.sft_rows[0])
  completions = encode_completions(data.tokenizer, texts, c.sampler.gen_length)
  seqs = likelihood.teacher_forced(
      jnp.asarray(batch["prompt_ids_BxP"]), jnp.asarray(batch["prompt_mask_BxP"]),
      jnp.asarray(completions), family=c.family, block_size=c.model.block_size,
      mask_id=model.config.mask_token_id)
  seqs = sharding.shard_batch(seqs, sharding.model_mesh(model), rows=c.sft.batch_size,
                              start=data.sft_rows[0])
  out = update(model, optimizer, seqs, key, scheme=c.sft.scheme, staircase=s.staircase,
               block_size=s.block_size)
  rows, length = seqs.tokens_BxL.shape
  step_flops = {"update": 3.0 * flops.forward_flops(model.config, rows,
                                                    length * (2 if s.staircase else 1))}
  return metrics.StepResult({k: float(v) for k, v in out.items()},
                            c.sft.batch_size * c.sampler.gen_length, step_flops)
