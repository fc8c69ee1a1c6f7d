"""Scarce demonstrations (issue 42): SFT on N demonstrations alone, SFT to its plateau with
patience, rejection-sampling fine-tuning, and bench/scarce_demos.py's committed table."""
import importlib.util
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import build, config_lib, losses, models, objectives, train
from stabledrl_jax.tasks import datasets

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_sft_trains_on_the_first_n_examples_and_validates_outside_them(tmp_path):
  c = config_lib.base_config("sdar")
  c.task.num_train, c.task.num_test, c.eval.num_examples = 200, 16, 16
  c.sft.num_demonstrations, c.sft.batch_size, c.sft.validation_examples = 24, 8, 32
  c.sft.stop_at_accuracy, c.sft.patience = 0.0, 3
  data = build.data(c, build.tokenizer(c), str(tmp_path))
  source = datasets.load_source(build.task(c), "train",
                                **build.source_kwargs(c, str(tmp_path / "data")))
  train_digits = [source[i]["digits"] for i in range(len(source))]
  seen = {ex["digits"] for _ in range(12) for ex in next(data.sft)["examples"]}  # 4 epochs
  assert seen == set(train_digits[:24])
  rl_prompts = {ex["digits"] for _ in range(4) for ex in next(data.rl)["examples"]}
  assert rl_prompts - set(train_digits[:24])  # RL's prompts are the whole training split
  assert [ex["digits"] for ex in data.validation] == train_digits[-32:]
  c.sft.num_demonstrations = 190  # + 32 validation examples > 200
  with pytest.raises(ValueError, match=r"^config\.sft\.num_demonstrations=190: "):
    config_lib.validate(c)
  c.sft.num_demonstrations, c.sft.stop_at_accuracy = 24, 0.3
  with pytest.raises(ValueError, match=r"^config\.sft\.patience=3: excludes"):
    config_lib.validate(c)


def _set_params(model, value: float) -> None:
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: jnp.full_like(x, value), state))


def _params(model) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_plateau_keeps_the_best_checks_weights_and_stops_after_patience(tmp_path):
  model = models.create(models.tiny(n_layers=1, d_model=16, n_heads=2, n_kv_heads=2, head_dim=8,
                                    mlp_dim=16), seed=0)
  c = config_lib.base_config("sdar")
  c.sft.patience = 2
  r = types.SimpleNamespace(config=c, workdir=str(tmp_path), model=model, sft_best={}, sft_end=100)
  stops = []
  for step, accuracy in enumerate([0.1, 0.3, 0.3, 0.2]):
    _set_params(model, float(step))  # the weights "after step `step`"
    stops.append(train.plateau(r, step, accuracy))
  # 0.3 again is no improvement: the 2nd check after the best (step 3) stops SFT ...
  assert stops == [False, False, False, True]
  assert all(np.all(x == 1.0) for x in _params(model))  # ... with step 1's weights back
  assert r.sft_best == {"accuracy": 0.3, "step": 1, "since": 2}
  # SFT's last step ends it whatever patience is left, with the best weights
  r.sft_best, r.sft_end = {}, 2
  _set_params(model, 5.0)
  assert not train.plateau(r, 0, 0.4)
  _set_params(model, 6.0)
  assert not train.plateau(r, 1, 0.1)
  assert all(np.all(x == 5.0) for x in _params(model))
  # Checks at zero accuracy before the first success are not a plateau (LLaDA's first 50 steps)
  r.sft_best, r.sft_end = {}, 100
  assert [train.plateau(r, s, a) for s, a in enumerate([0, 0, 0, 0, 0.1, 0.05, 0.1])] == [
      False] * 6 + [True]
  assert r.sft_best == {"accuracy": 0.1, "step": 4, "since": 2}


def test_rejection_sampling_loss_is_sft_on_the_correct_rollouts():
  keep = np.array([1.0, 0.0, 1.0, 0.0])
  elbo = np.array([-2.0, -7.0, -4.0, -1.0])
  loss, m = losses.rejection_sampling_loss(jnp.asarray(keep), jnp.asarray(elbo))
  assert float(loss) == pytest.approx(3.0) and float(m["kept_fraction"]) == 0.5
  jax_grad = jax.grad(lambda e: losses.rejection_sampling_loss(jnp.asarray(keep), e)[0])(
      jnp.asarray(elbo))
  np.testing.assert_allclose(jax_grad, [-0.5, 0.0, -0.5, 0.0])  # d(-mean of kept ELBOs)
  zero, _ = losses.rejection_sampling_loss(jnp.zeros(4), jnp.asarray(elbo))
  assert float(zero) == 0.0


def test_rft_objective_weights_the_rollouts_that_reach_the_reward():
  c = config_lib.base_config("sdar")
  c.rl.objective, c.rl.rft_min_reward = "rft", 0.75
  obj = objectives.Objective.from_config(c)
  assert obj.spec.weights == "correct" and obj.rft_min_reward == 0.75
  assert objectives.OBJECTIVES["stabledrl"].weights == "advantage"


def _bench():
  spec = importlib.util.spec_from_file_location("scarce_demos", REPO / "bench" / "scarce_demos.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_committed_table_is_the_one_the_committed_results_give():
  bench = _bench()
  page = (REPO / "docs" / "results" / "scarce_demos.md").read_text()
  committed = page.partition(bench.BEGIN)[2].partition(bench.END)[0].strip()
  assert committed == bench.table().strip()


def test_verdict_needs_three_seeds_each_gaining_010_and_over_3x_the_plateau_spread():
  bench = _bench()
  assert bench.verdict("sdar", 128, [0.20, 0.15, 0.12], [0.30, 0.32, 0.33]).endswith("is met.")
  assert "NOT met" in bench.verdict("sdar", 128, [0.20, 0.15], [0.30, 0.32])  # two seeds
  assert "NOT met" in bench.verdict("sdar", 128, [0.20, 0.15, 0.09], [0.30, 0.32, 0.33])
  assert "NOT met" in bench.verdict("sdar", 128, [0.20, 0.15, 0.12], [0.30, 0.32, 0.34])  # 3x 0.04
