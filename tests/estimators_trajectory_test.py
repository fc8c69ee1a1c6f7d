"""Tests for the trajectory likelihood (`estimators.trajectory_masks`, `likelihood.trajectory`,
`rl.scheme=trajectory`) and `sampler.order=left_to_right`, against float64 NumPy loops written
here from the definition: forward j sees every completion token committed at a step >= j*s
masked and scores the tokens committed at steps in [j*s, (j+1)*s); SDAR counts the steps from
each block's first and sees every block after its clean prefix, as block decoding does."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import (config_lib, estimators, generate, likelihood, losses, models,
                           objectives, optim, rl, rollouts, samplers)
from tests.samplers_test import left_pad

MASK = 127
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


@pytest.fixture(scope="module")
def family_models():
  return {f: models.create(models.tiny(**models.family_options(f), n_kv_heads=2), seed=i)
          for i, f in enumerate(("llada", "sdar", "dream"))}


def _sampling(family, temperature=0.8, **changes):
  c = config_lib.base_config(family)
  sampling = rollouts.sampling_from_config(c, temperature)
  return dataclasses.replace(sampling, **{"stop_ids": (1000,), **changes})


_ROLLOUTS = {}  # (model, sampling) -> rollout: the tests below share their decodes


def _rollout_with_stops(model, sampling, key=jax.random.key(0)):
  """A rollout in which some rows stop early: the stop token is one the model emits mid-row."""
  if (id(model), sampling) not in _ROLLOUTS:
    _ROLLOUTS[id(model), sampling] = _decode_with_stops(model, sampling, key)
  return _ROLLOUTS[id(model), sampling]


def _decode_with_stops(model, sampling, key):
  ids, valid = left_pad(PROMPTS)
  free = samplers.generate(model, ids, valid, key, sampling)
  stop = int(np.asarray(free.completion_BxC)[0, 2])
  out = samplers.generate(model, ids, valid, key, dataclasses.replace(sampling, stop_ids=(stop,),
                                                                      pad_id=0))
  assert int(np.min(out.lengths_B)) < sampling.gen_length  # post-stop padding is exercised
  return out


def _in_position_order(step_L, block_L):
  """Whether the steps rise one at a time within each block and keep rising across blocks (SDAR's
  global step skips the steps other rows of the batch spent on a block)."""
  rise = np.diff(step_L)
  same_block = np.diff(block_L) == 0
  return bool(np.all(rise[same_block] == 1) and np.all(rise > 0))


def _log_softmax(logits):
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@nnx.jit(static_argnames=("block_size",))
def _logits(model, x_1xL, pos_1xL, valid_1xL, block_size=None):
  attention = "block_causal" if block_size else "full"
  return model.logits(x_1xL, attention=attention, block_size=block_size, positions=pos_1xL,
                      valid_BxL=valid_1xL)


def _forward(model, x_L, pos_L, valid_L, block_size=None):
  """float64 log-probs `[L, V]` of one row: full attention, or block-causal with `block_size`."""
  logits = _logits(model, jnp.asarray(x_L)[None], jnp.asarray(pos_L)[None],
                   jnp.asarray(valid_L)[None], block_size=block_size)
  return _log_softmax(logits[0])


def reference_trajectory(model, seqs, num_forwards, shrink, block_size=None):
  """`[B]` float64: the definition, one forward per row, block and state (per-step states)."""
  tokens, pos, valid, comp, counted, step = (np.asarray(x) for x in (
      seqs.tokens_BxL, seqs.positions_BxL, seqs.valid_BxL, seqs.completion_BxL, seqs.counted_BxL,
      seqs.commit_step_BxL))
  total = np.zeros(tokens.shape[0])
  for b in range(tokens.shape[0]):
    blocks = pos[b] // block_size if block_size else np.zeros_like(pos[b])
    for blk in np.unique(blocks[comp[b]]):
      in_blk = comp[b] & (blocks == blk)
      done = in_blk & (step[b] >= 0)
      if not done.any():
        continue
      local = step[b] - (step[b][done].min() if block_size else 0)
      for j in range(num_forwards):
        lo, hi = j * shrink, (j + 1) * shrink
        x = tokens[b].copy()
        x[comp[b] & (blocks > blk)] = MASK  # later blocks: not decoded yet
        x[in_blk & ((step[b] < 0) | (local >= lo))] = MASK
        logp = _forward(model, x, pos[b], valid[b], block_size)
        scored = counted[b] & in_blk & (step[b] >= 0) & (local >= lo) & (local < hi)
        total[b] += logp[np.nonzero(scored)[0], tokens[b][scored]].sum()
  return total


def trajectory_logp(model, seqs, num_forwards, shrink, staircase):
  """The package's estimate `[B]`: `likelihood.trajectory` masks through `masked_logp`."""
  bs = 4 if staircase else None
  masks = likelihood.trajectory(seqs, num_forwards=num_forwards, shrink=shrink, block_size=bs)
  logp = likelihood.masked_logp(model, seqs, masks.noised_BxMxL, staircase=staircase,
                                block_size=bs)
  return np.asarray(losses.mc_elbo(logp, masks.weight_BxMxL), np.float64)


# ----------------------------------------------------------------------------- the masks


def test_masks_group_steps_and_score_each_counted_token_once():
  # Slots 2..7 generated: steps 0 3 1 2 5 4; slot 7 after the stop (not counted); slot 8 never
  # committed (-1, e.g. Dream's mask token).
  step = jnp.asarray([[-1, -1, 0, 3, 1, 2, 5, 4, -1]])
  comp = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 1, 1]], bool)
  counted = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 0, 1]], bool)
  got = estimators.trajectory_masks(step, comp, counted, num_forwards=3, shrink=2)
  noised = np.asarray(got.noised_BxMxL[0], int)
  np.testing.assert_array_equal(noised, [[0, 0, 1, 1, 1, 1, 1, 1, 1],   # steps >= 0
                                         [0, 0, 0, 1, 0, 1, 1, 1, 1],   # steps >= 2
                                         [0, 0, 0, 0, 0, 0, 1, 1, 1]])  # steps >= 4
  np.testing.assert_array_equal(np.asarray(got.weight_BxMxL[0]),
                                3.0 * np.array([[0, 0, 1, 0, 1, 0, 0, 0, 0],
                                                [0, 0, 0, 1, 0, 1, 0, 0, 0],
                                                [0, 0, 0, 0, 0, 0, 1, 0, 0]]))
  # A context-free model: the estimate is the sum of the scored tokens' log-probs.
  logp = jnp.broadcast_to(-jnp.arange(1.0, 10.0), (1, 3, 9))
  assert float(losses.mc_elbo(logp, got.weight_BxMxL)[0]) == -(3 + 4 + 5 + 6 + 7)


def test_block_steps_count_from_each_blocks_first_step():
  # Two blocks of 3 slots: global steps 0 1 2 | 3 5 4; per block 0 1 2 | 0 2 1.
  step = jnp.asarray([[0, 1, 2, 3, 5, 4]])
  comp = jnp.ones((1, 6), bool)
  got = estimators.trajectory_masks(step, comp, num_forwards=3, shrink=1,
                                    block_BxL=jnp.asarray([[0, 0, 0, 1, 1, 1]]))
  np.testing.assert_array_equal(np.asarray(got.weight_BxMxL[0] != 0, int),
                                [[1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 0, 1], [0, 0, 1, 0, 1, 0]])
  np.testing.assert_array_equal(np.asarray(got.noised_BxMxL[0], int),
                                [[1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1], [0, 0, 1, 0, 1, 0]])


def test_bad_arguments_are_refused():
  step = jnp.zeros((1, 4), jnp.int32)
  comp = jnp.ones((1, 4), bool)
  with pytest.raises(ValueError, match="shrink must be >= 1, got 0"):
    estimators.trajectory_masks(step, comp, num_forwards=2, shrink=0)
  with pytest.raises(ValueError, match="num_forwards must be >= 1, got 0"):
    estimators.trajectory_masks(step, comp, num_forwards=0)
  seqs = rollouts.Sequences(step, step, comp, ~comp, comp, comp)  # no commit steps
  with pytest.raises(ValueError, match="needs the rollouts' commit steps"):
    likelihood.trajectory(seqs, num_forwards=2, shrink=1)


# ----------------------------------------------------------------------------- against the loop


@pytest.mark.parametrize("family,changes,shrink", [
    ("llada", dict(gen_length=8, block_length=4, steps=8), 1),
    ("llada", dict(gen_length=8, block_length=4, steps=8), 3),
    ("llada", dict(gen_length=8, block_length=4, steps=4, cache="dual", threshold=0.05), 2),
    ("dream", dict(gen_length=8, steps=6), 2),
])
def test_full_attention_trajectory_matches_the_numpy_loop(family_models, family, changes, shrink):
  model = family_models[family]
  sampling = _sampling(family, **changes)
  seqs = rollouts.from_rollout(_rollout_with_stops(model, sampling))
  j = -(-sampling.steps // shrink)
  want = reference_trajectory(model, seqs, j, shrink)
  got = trajectory_logp(model, seqs, j, shrink, staircase=False)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("changes,shrink", [
    (dict(gen_length=10, steps=4), 1),
    (dict(gen_length=10, steps=4), 3),
    (dict(gen_length=10, steps=2, strategy="low_confidence_dynamic", threshold=0.05), 1),
])
def test_sdar_trajectory_matches_the_numpy_loop(family_models, changes, shrink):
  model = family_models["sdar"]
  sampling = _sampling("sdar", **changes)
  seqs = rollouts.from_rollout(_rollout_with_stops(model, sampling))
  j = -(-sampling.steps // shrink)
  want = reference_trajectory(model, seqs, j, shrink, block_size=4)
  got = trajectory_logp(model, seqs, j, shrink, staircase=True)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_left_to_right_with_one_step_per_forward_is_the_chain_rule(family_models, family):
  """`order=left_to_right`, s = 1: the estimate is Σ_k log p(x_k | x_<k), one forward per
  position with every later completion slot masked (SDAR: block-causal)."""
  model = family_models[family]
  bs = 4 if family == "sdar" else None
  steps = 8 if family == "llada" else 4
  sampling = _sampling(family, gen_length=8, block_length=4, steps=steps, order="left_to_right")
  ids, valid = left_pad(PROMPTS)
  r = samplers.generate(model, ids, valid, jax.random.key(3), sampling)
  seqs = rollouts.from_rollout(r)
  tokens, pos, val, comp, step = (np.asarray(x) for x in (
      seqs.tokens_BxL, seqs.positions_BxL, seqs.valid_BxL, seqs.completion_BxL,
      seqs.commit_step_BxL))
  chain = np.zeros(len(PROMPTS))
  for b in range(len(PROMPTS)):
    slots = np.nonzero(comp[b])[0]
    assert _in_position_order(step[b][slots], pos[b][slots] // 4)  # one token a step
    for k in slots:
      x = tokens[b].copy()
      x[comp[b] & (np.arange(len(x)) >= k)] = MASK
      chain[b] += _forward(model, x, pos[b], val[b], bs)[k, tokens[b][k]]
  got = trajectory_logp(model, seqs, sampling.steps, 1, staircase=family == "sdar")
  np.testing.assert_allclose(got, chain, rtol=2e-5, atol=1e-4)


# ----------------------------------------------------------------------------- the commit steps


class _Tokenizer:
  def decode(self, ids, skip_special=False):
    return str(ids[0])


@pytest.mark.parametrize("family,changes", [
    ("llada", dict(gen_length=8, block_length=4, steps=8)),
    ("llada", dict(gen_length=8, block_length=4, steps=8, cache="prefix")),
    ("llada", dict(gen_length=8, block_length=4, steps=4, cache="dual", threshold=0.05)),
    ("llada", dict(gen_length=8, block_length=4, steps=8, cache="dual", order="left_to_right")),
    ("sdar", dict(gen_length=10, steps=4)),
    ("sdar", dict(gen_length=10, steps=4, order="left_to_right")),
    ("sdar", dict(gen_length=10, steps=2, strategy="low_confidence_dynamic", threshold=0.05)),
    ("dream", dict(gen_length=8, steps=6)),
])
def test_every_counted_token_has_one_step_within_the_budget(family_models, family, changes):
  sampling = _sampling(family, **changes)
  r = _rollout_with_stops(family_models[family], sampling)
  seqs = rollouts.from_rollout(r)
  step, counted = np.asarray(seqs.commit_step_BxL), np.asarray(seqs.counted_BxL)
  np.testing.assert_array_equal(step, np.asarray(r.commit_step_BxL))
  assert np.all(step[~np.asarray(seqs.completion_BxL)] == -1)  # the prompt: never committed
  assert np.all(step[counted] >= 0)
  if family == "sdar":  # per block: within the block's own steps
    block = np.asarray(seqs.positions_BxL) // 4
    for b in range(step.shape[0]):
      for blk in np.unique(block[b][counted[b]]):
        here = step[b][counted[b] & (block[b] == blk)]
        assert here.max() - here.min() < sampling.steps
  else:
    assert np.all(step[counted] < sampling.steps)
  if changes.get("order") == "left_to_right":  # one token a step, in position order
    block = np.asarray(seqs.positions_BxL) // 4
    for b in range(step.shape[0]):
      assert _in_position_order(step[b][counted[b]], block[b][counted[b]])
  # `generate --show_order` prints the same steps, in position order.
  for b in range(step.shape[0]):
    shown = [int(part.rsplit("@", 1)[1]) for part in generate.commit_order(_Tokenizer(), r, b).split()]
    np.testing.assert_array_equal(shown, step[b][np.asarray(r.completion_mask_BxL)[b]])


# ----------------------------------------------------------------------------- the RL step


def _trajectory_config(family, objective, **rl_changes):
  c = config_lib.base_config(family)
  c.rl.scheme, c.rl.objective, c.rl.group_size = "trajectory", objective, 3
  c.sampler.gen_length, c.sampler.block_length = 8, 4
  c.sampler.steps = 4 if family == "sdar" else 8
  for key, value in rl_changes.items():
    c.rl[key] = value
  return c


@pytest.mark.parametrize("family,objective", [("llada", "stabledrl"), ("llada", "grpo"),
                                              ("sdar", "stabledrl"), ("sdar", "grpo")])
def test_one_rl_update_with_the_trajectory_scheme(family_models, family, objective):
  c = _trajectory_config(family, objective, trajectory_shrink=3)
  obj = objectives.Objective.from_config(c)
  assert obj.num_samples == -(-c.sampler.steps // 3)
  model = models.create(models.tiny(**models.family_options(family), n_kv_heads=2), seed=1)
  opt = nnx.Optimizer(model, optim.make_optimizer(1e-2, 0, 10, c.optim), wrt=nnx.Param)
  r = _rollout_with_stops(model, rollouts.sampling_from_config(c, 0.8))
  seqs = rollouts.from_rollout(r)
  adv = jnp.asarray([1.0, -0.5, -0.5])
  batch, entropy = rl.behaviour_pass(model, None, seqs, adv, jax.random.key(1), obj)
  assert np.isfinite(float(entropy))
  # The behaviour pass's estimate is the trajectory log-likelihood.
  want = trajectory_logp(model, seqs, obj.num_samples, 3, staircase=family == "sdar")
  np.testing.assert_allclose(losses.mc_elbo(batch.logp_old_BxMxL, batch.weight_old_BxMxL), want,
                             rtol=1e-5, atol=1e-4)
  out = rl.update(model, opt, batch, jax.random.key(2), obj=obj, accumulation=1)
  assert np.isfinite(float(out["loss"])) and not bool(out["skipped"])
  assert abs(float(out["kl_k1"])) < 1e-5  # θ = θ_old: the deterministic masks give ratio 1
  out = rl.update(model, opt, batch, jax.random.key(3), obj=obj, accumulation=1)
  assert np.isfinite(float(out["loss"])) and float(out["kl_k3"]) > 0


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_copies_in_passes_give_the_same_logp_and_gradient(family_models, family):
  """`copies_per_pass`: M = 6 forwards 4 at a time (two passes, the second padded) is the same
  computation as all 6 at once, values and parameter gradients."""
  model = family_models[family]
  sampling = _sampling(family, gen_length=10 if family == "sdar" else 8, steps=6 if family == "llada" else 4)
  seqs = rollouts.from_rollout(_rollout_with_stops(model, sampling))
  bs = 4 if family == "sdar" else None
  masks = likelihood.trajectory(seqs, num_forwards=sampling.steps, shrink=1, block_size=bs)
  graphdef, params = nnx.split(model)

  def total(p, copies):
    lp = likelihood.masked_logp(nnx.merge(graphdef, p), seqs, masks.noised_BxMxL,
                                staircase=bs is not None, block_size=bs, copies_per_pass=copies)
    return jnp.sum(losses.mc_elbo(lp, masks.weight_BxMxL)), lp

  (v_all, lp_all), g_all = jax.value_and_grad(total, has_aux=True)(params, 0)
  (v_passes, lp_passes), g_passes = jax.value_and_grad(total, has_aux=True)(params, 3)
  np.testing.assert_allclose(lp_passes, lp_all, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(v_passes, v_all, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_passes), jax.tree.leaves(g_all)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- the config


def test_trajectory_ignores_the_mask_keys():
  c = _trajectory_config("llada", "stabledrl", trajectory_shrink=3, num_samples=5,
                         coupling="independent", p_mask_prompt=0.15)
  obj = objectives.Objective.from_config(c)
  assert (obj.num_samples, obj.coupling, obj.p_mask_prompt) == (3, "coupled", 0.0)


@pytest.mark.parametrize("family,section,changes,match", [
    ("llada", "rl", {"trajectory_shrink": 0}, r"^config\.rl\.trajectory_shrink=0: must be >= 1$"),
    ("sdar", "rl", {"objective": "spg"}, r"^config\.rl\.objective='spg': SPG's upper bound"),
    ("llada", "rl", {"adversarial": 0.7}, r"^config\.rl\.adversarial=0\.7: the adversarial mode"),
    ("llada", "sampler", {"order": "bad"},
     r"^config\.sampler\.order='bad': expected one of confidence, left_to_right$"),
    ("sdar", "sampler", {"order": "bad"}, r"^config\.sampler\.order='bad'"),
    ("llada", "sampler", {"order": "left_to_right", "steps": 4},
     r"^config\.sampler\.steps=4: sampler\.order=left_to_right commits one token a step: set it to "
     r"sampler\.gen_length \(8\)$"),
    ("llada", "sampler", {"order": "left_to_right", "cache": "dual", "threshold": 0.9},
     r"^config\.sampler\.threshold=0\.9"),
    ("llada", "sampler", {"order": "left_to_right", "remasking": "random"},
     r"^config\.sampler\.remasking='random'"),
    ("sdar", "sampler", {"order": "left_to_right", "steps": 2}, r"^config\.sampler\.steps=2: .* "
     r"sampler\.block_length \(4\)"),
    ("sdar", "sampler", {"order": "left_to_right", "strategy": "low_confidence_dynamic",
                         "threshold": 0.9}, r"^config\.sampler\.strategy="),
    ("dream", "sampler", {"order": "left_to_right"}, r"^config\.sampler\.order='left_to_right'"),
])
def test_config_errors_name_the_key(family, section, changes, match):
  c = _trajectory_config(family, "grpo")
  for key, value in changes.items():
    c[section][key] = value
  with pytest.raises(ValueError, match=match):
    rl.Settings.from_config(c)


def test_left_to_right_is_labelled():
  c = _trajectory_config("llada", "grpo")
  c.sampler.order = "left_to_right"
  assert rollouts.sampling_from_config(c, 0.0).label == "llada exact left_to_right"
