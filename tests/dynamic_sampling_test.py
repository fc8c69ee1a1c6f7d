"""Dynamic sampling (`rl.filter_zero_advantage`, DAPO): groups whose rewards are all equal are
dropped and refilled from further prompt batches, at most `rl.max_prompt_draws` a step; off, the
step is the plain one.

The data is fake and the rewards are scripted (each example says whether its group is flat), so
which groups carry signal does not depend on what the tiny random model writes; the rollouts,
the behaviour pass and the updates are the real ones.
"""
import itertools
import types

import jax
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import build, config_lib, dynamic_sampling, models, optim, rl, samplers, train
from stabledrl_jax.tasks.tokenizer import SPECIAL_TOKENS, CharTokenizer
from tests.train_test import TIMING, _params

P, G, PROMPT = 2, 4, 6  # prompts per step, group size, prompt tokens
NEW_KEYS = {"groups_drawn", "groups_kept", "prompt_draws"}
TOK = CharTokenizer()


def config(**rl_changes):
  c = config_lib.base_config("sdar")
  c.rl.prompts_per_step, c.rl.group_size, c.rl.updates_per_batch = P, G, 1
  c.sampler.gen_length, c.sampler.steps, c.task.max_prompt_len = 8, 2, PROMPT
  c.rl.update(rl_changes)
  build.settings(c)
  return c


def fake_data(flat):
  """`data` for `rl.step`: batch d of `data.rl` holds P random prompts; the reward of prompt i
  is 1.0 for every rollout when `flat(d, i)`, else 0, 1, 0, 1, ... (each group has spread).
  `data.drawn` counts the batches drawn."""
  counter = itertools.count()

  def reward_fn(text, example):
    return 1.0 if example["flat"] else float(next(counter) % 2)

  data = types.SimpleNamespace(tokenizer=TOK, reward_fn=reward_fn, rl_rows=(0, P), drawn=0)

  def batches():
    for d in itertools.count():
      data.drawn += 1
      yield prompts(d, [{"draw": d, "prompt": i, "flat": flat(d, i)} for i in range(P)])

  data.rl = batches()
  return data


def prompts(d, examples):
  ids = np.random.default_rng(d).integers(len(SPECIAL_TOKENS), TOK.vocab_size, size=(P, PROMPT))
  return {"prompt_ids_BxP": ids.astype(np.int32), "prompt_mask_BxP": np.ones((P, PROMPT), bool),
          "examples": examples}


@pytest.fixture(scope="module")
def start():
  """A tiny model (1 layer, d_model 32) and its optimiser; each test steps copies of them."""
  model = models.create(models.tiny(
      vocab_size=TOK.vocab_size, mask_token_id=TOK.mask_id, eos_token_id=TOK.eos_id,
      pad_token_id=TOK.pad_id, stop_token_ids=(TOK.eos_id,), n_layers=1, d_model=32, n_heads=2,
      n_kv_heads=1, head_dim=16, mlp_dim=64), seed=0)
  opt = nnx.Optimizer(model, optim.make_optimizer(1e-2, 0, 10, config().optim), wrt=nnx.Param)
  return model, opt


def run_step(start, c, data, key=jax.random.key(7)):
  model, opt = train.copy_module(start[0]), train.copy_module(start[1])
  result = rl.step(rl.Settings.from_config(c), data, model, None, opt, key)
  return result, _params(model)


def test_select_groups_keeps_signal_first_then_fills_in_draw_order():
  s = lambda *flags: np.array(flags, bool)
  assert dynamic_sampling.select_groups([s(1, 1)], 2) == [(0, 0), (0, 1)]
  assert dynamic_sampling.select_groups([s(0, 1), s(0, 0), s(1, 1)], 2) == [(0, 1), (2, 0)]
  # one with signal, one filler
  assert dynamic_sampling.select_groups([s(0, 0), s(1, 0)], 2) == [(0, 0), (1, 0)]
  assert dynamic_sampling.select_groups([s(0, 0), s(0, 0)], 2) == [(0, 0), (0, 1)]
  np.testing.assert_array_equal(
      dynamic_sampling.has_signal(np.array([1, 1, 1, 1, 0, 0, 0, 1e-9]), 4), [0, 1])


def test_kept_groups_have_signal_and_are_the_drawn_rollouts(start):
  # Draw 0: prompt 0 flat, prompt 1 not; draw 1: both flat; draw 2: neither. Two groups with
  # signal are found by draw 2: (0, 1) and (2, 0), and drawing stops there.
  flat = lambda d, i: (d, i) in {(0, 0), (1, 0), (1, 1)}
  c, key = config(filter_zero_advantage=True, max_prompt_draws=4), jax.random.key(3)
  data = fake_data(flat)
  s = rl.Settings.from_config(c)
  sampled = dynamic_sampling.dynamic_sample(s, data, start[0], next(data.rl), key)
  assert data.drawn == 3 and sampled.record == {"groups_drawn": 6, "groups_kept": 2,
                                                "prompt_draws": 3}
  assert np.all(dynamic_sampling.has_signal(sampled.rewards_B, G))
  # Rows 0-3 are draw 0's group 1 and rows 4-7 draw 2's group 0, each under its draw's key.
  for rows, d, group in ((slice(0, G), 0, 1), (slice(G, 2 * G), 2, 0)):
    batch = prompts(d, [None] * P)
    want = samplers.generate(start[0], np.repeat(batch["prompt_ids_BxP"], G, axis=0),
                       np.repeat(batch["prompt_mask_BxP"], G, axis=0),
                       jax.random.fold_in(key, d) if d else key, s.sampling)
    for got_x, want_x in zip(sampled.rollout, want):
      np.testing.assert_array_equal(np.asarray(got_x)[rows],
                                    np.asarray(want_x)[group * G:(group + 1) * G])

  # The whole step on the same draws: the trained batch has no group without signal.
  result, _ = run_step(start, c, fake_data(flat))
  record = result.record
  assert (record["groups_drawn"], record["groups_kept"], record["prompt_draws"]) == (6, 2, 3)
  assert record["zero_adv_fraction"] == 0.0 and record["reward_mean"] == 0.5
  assert result.flops["rollout"] == pytest.approx(
      3 * run_step(start, config(), fake_data(lambda d, i: False))[0].flops["rollout"])


def test_draws_stop_at_the_bound_when_no_group_has_signal(start):
  c = config(filter_zero_advantage=True, max_prompt_draws=3)
  data = fake_data(lambda d, i: True)  # constant reward: every group is flat
  result, _ = run_step(start, c, data)
  record = result.record
  assert data.drawn == 3
  assert (record["groups_drawn"], record["groups_kept"], record["prompt_draws"]) == (6, 0, 3)
  assert record["zero_adv_fraction"] == 1.0 and np.isfinite(record["loss"])
  data = fake_data(lambda d, i: True)
  run_step(start, config(filter_zero_advantage=True, max_prompt_draws=1), data)
  assert data.drawn == 1


def test_off_is_the_plain_step_and_on_with_all_signal_matches_it_bit_for_bit(start):
  every_group_has_signal = lambda d, i: False
  off_data = fake_data(every_group_has_signal)
  off, off_params = run_step(start, config(), off_data)
  on, on_params = run_step(start, config(filter_zero_advantage=True),
                           fake_data(every_group_has_signal))
  assert off_data.drawn == 1 and not NEW_KEYS & set(off.record)
  assert (on.record["groups_kept"], on.record["prompt_draws"]) == (P, 1)
  jax.tree.map(np.testing.assert_array_equal, off_params, on_params)
  strip = lambda r: {k: v for k, v in r.items() if k not in TIMING | NEW_KEYS}
  assert strip(off.record) == strip(on.record)
  assert (off.tokens, off.flops) == (on.tokens, on.flops)
  # Not vacuous: the step moved the parameters.
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(_params(start[0])),
                                            jax.tree.leaves(off_params)))


def test_bad_bound_and_several_processes_are_one_line_errors(monkeypatch):
  with pytest.raises(ValueError, match=r"config\.rl\.max_prompt_draws=0"):
    config(max_prompt_draws=0)
  c, data = config(filter_zero_advantage=True), fake_data(lambda d, i: False)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"config\.rl\.filter_zero_advantage=True: .* one process"):
    rl.step(rl.Settings.from_config(c), data, None, None, None, jax.random.key(0))
  assert data.drawn == 0
