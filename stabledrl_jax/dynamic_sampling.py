"""DAPO's dynamic sampling (`rl.filter_zero_advantage`): draw further prompt batches until enough
groups have rewards that differ, and assemble the step's batch from them without recompiling;
and the host side every step shares: a prompt batch repeated into its groups, rollouts scored.

Shapes: `B` rollouts (groups of `G` contiguous), `N` groups of a draw, `D` draws, `C` generated
tokens, `P` prompt tokens.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from stabledrl_jax import samplers, sharding
from stabledrl_jax.rollouts import Rollout
from stabledrl_jax.tasks import pipeline

if TYPE_CHECKING:
  from stabledrl_jax import rl


def score(tokenizer, rollout: Rollout, examples, reward_fn, start: int = 0) -> np.ndarray:
  """Rewards of the rollouts `[start, start + len(examples))` (this process's), on the host."""
  completions = sharding.to_host(rollout.completion_BxC)[start:start + len(examples)]
  texts = pipeline.decode_completions(tokenizer, completions)
  return np.array([reward_fn(t, ex) for t, ex in zip(texts, examples)], np.float32)


class Sampled(NamedTuple):
  """A step's rollouts under `rl.filter_zero_advantage` (`dynamic_sample`)."""
  rollout: Rollout  # the step's B rollouts (`select_groups`), one draw's shape
  rewards_B: np.ndarray      # their rewards, on the host
  logs: list                 # each draw's `samplers.rollout_record`
  tokens: int                # completion tokens generated over all the draws
  record: dict               # groups_drawn, groups_kept, prompt_draws


def has_signal(rewards_B: np.ndarray, group_size: int) -> np.ndarray:
  """`[N]`: whether each group's rewards differ (max > min, exactly). Only those groups have a
  non-zero advantage, whatever `rl.advantage`; a group with a NaN reward counts as without."""
  r_NxG = np.asarray(rewards_B, np.float32).reshape(-1, group_size)
  return r_NxG.max(axis=1) > r_NxG.min(axis=1)


def select_groups(signal_DxN: list[np.ndarray], want: int) -> list[tuple[int, int]]:
  """The step's `want` groups as (draw, group) pairs, in draw order: the first `want` drawn groups
  with signal and, when fewer have it, the earliest drawn groups without it to fill the batch."""
  drawn = [(d, n) for d, signal_N in enumerate(signal_DxN) for n in range(len(signal_N))]
  kept = [(d, n) for d, n in drawn if signal_DxN[d][n]][:want]
  fill = [(d, n) for d, n in drawn if not signal_DxN[d][n]][:want - len(kept)]
  return sorted(kept + fill)


@jax.jit
def _take_rows(base, source, pick_B, rows_B):
  """`base` with its row `b` replaced by `source`'s row `rows_B[b]` where `pick_B[b]`: one
  program for every draw, whatever it contributes."""
  def take(x, y):
    return jnp.where(pick_B.reshape(-1, *(1,) * (x.ndim - 1)), jnp.take(y, rows_B, axis=0), x)
  return jax.tree.map(take, base, source)


def merged_log(logs: list[dict]) -> dict:
  """One rollout log for all the draws: seconds summed, forwards and forward tokens per rollout
  averaged over every drawn rollout (the draws are the same size), generated tokens/s overall."""
  if len(logs) == 1:
    return logs[0]
  seconds = sum(log["rollout_s"] for log in logs)
  tokens = sum(log["rollout_tokens_per_s"] * log["rollout_s"] for log in logs)
  mean = lambda k: float(np.mean([log[k] for log in logs]))
  return {**logs[0], "rollout_forwards": mean("rollout_forwards"),
          "rollout_forward_tokens": mean("rollout_forward_tokens"), "rollout_s": seconds,
          "rollout_tokens_per_s": tokens / seconds}


def dynamic_sample(s: rl.Settings, data, model, batch, key, rollout_mesh=None) -> Sampled:
  """DAPO's dynamic sampling (`rl.filter_zero_advantage`), on one process.

  Rolls out and scores the step's prompts `batch` with `key` (as the plain step does), then further
  batches of `data.rl`, the d-th with `fold_in(key, d)`, until `rl.prompts_per_step` groups have
  rewards that differ (`has_signal`) or `rl.max_prompt_draws` batches are drawn. The step's batch
  (`select_groups`) has one draw's shape, so nothing recompiles; filler groups carry zero
  advantage and add nothing to the gradient. When the first draw's groups all have signal this
  is the plain step's batch, bit for bit.
  """
  group, want = s.objective.group_size, s.prompts_per_step
  drawn, rewards, signal, logs = [], [], [], []
  for d in range(s.max_prompt_draws):
    if d:
      batch = next(data.rl)
    ids, mask, examples = repeat_groups(batch, group)
    t = time.perf_counter()
    drawn.append(samplers.generate(model, ids, mask, jax.random.fold_in(key, d) if d else key,
                                   s.sampling, rows=want * group, rollout_mesh=rollout_mesh))
    logs.append(samplers.rollout_record(s.sampling, drawn[-1], t))
    rewards.append(score(data.tokenizer, drawn[-1], examples, data.reward_fn))
    signal.append(has_signal(rewards[-1], group))
    if sum(int(np.sum(x)) for x in signal) >= want:
      break
  picks = select_groups(signal, want)
  rows_B = np.array([n * group + g for _, n in picks for g in range(group)], np.int32)
  rewards_B = np.concatenate([rewards[d][n * group:(n + 1) * group] for d, n in picks])
  rollout = drawn[0]
  if picks != [(0, n) for n in range(want)]:
    draw_B = np.repeat([d for d, _ in picks], group)
    for d, source in enumerate(drawn):
      if np.any(draw_B == d):
        rollout = _take_rows(rollout, source, draw_B == d, rows_B)
    rollout = sharding.shard_batch(rollout, sharding.model_mesh(model))
  tokens = sum(int(jnp.sum(r.lengths_B)) for r in drawn)
  kept = sum(int(signal[d][n]) for d, n in picks)
  record = {"groups_drawn": want * len(drawn), "groups_kept": kept, "prompt_draws": len(drawn)}
  return Sampled(rollout, rewards_B, logs, tokens, record)


def repeat_groups(batch, group: int):
  """A prompt batch's ids, mask and examples, each prompt repeated `group` times (its group)."""
  return (np.repeat(batch["prompt_ids_BxP"], group, axis=0),
          np.repeat(batch["prompt_mask_BxP"], group, axis=0),
          [ex for ex in batch["examples"] for _ in range(group)])
