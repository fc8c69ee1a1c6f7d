"""RL on a mixture of experts (LLaDA2.0): routing replay makes the ratio blind to a routing flip,
and the update leaves the router as it was unless `model.train_router`."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import config_lib, models, objectives, optim, rl, rollouts
from tests.models_llada2_test import _randomise

B, PROMPT, N = 4, 4, 8


def _batch():
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 100, size=(B, PROMPT + N))
  t = PROMPT + N
  completion = np.broadcast_to(np.arange(t) >= PROMPT, (B, t))
  return rollouts.Sequences(jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.arange(t), (B, t)),
                            jnp.ones((B, t), bool), jnp.asarray(~completion),
                            jnp.asarray(completion), jnp.asarray(completion))


def test_routing_replay_ratio_ignores_a_routing_flip_and_the_router_stays_frozen(objective):
  model = _randomise(models.create(models.llada2_tiny(), seed=0))
  seqs, adv = _batch(), jnp.asarray([1.0, -1.0, 0.5, -0.5])
  replay = objective("llada2", {"rl.routing_replay": True}, group_size=4, num_samples=2)
  plain = dataclasses.replace(replay, routing_replay=False)
  batch, _ = rl.behaviour_pass(model, None, seqs, adv, jax.random.key(1), replay)
  assert batch.routes_old.shape == (B, 2, 1, 2 * (PROMPT + N), 2)  # [B, M, MoE layers, 2L, k]

  @nnx.jit
  def log_ratios(model, batch):  # KL k1 of the ratio, without and with replay
    return [objectives.policy_loss(model, batch, jax.random.key(0), obj)[1]["kl_k1"]
            for obj in (plain, replay)]

  assert [float(x) for x in log_ratios(model, batch)] == [0.0, 0.0]
  # The bias only moves the choice: sending every token to experts 6 and 7 changes the
  # likelihood only through the routing, which replay holds fixed.
  model.blocks[1].moe.expert_bias.set_value(jnp.asarray([0.0] * 6 + [5.0, 5.0]))
  without, with_replay = log_ratios(model, batch)
  assert abs(float(without)) > 1e-4
  np.testing.assert_allclose(float(with_replay), 0.0, atol=1e-7)



def _trained_names(model):
  """The parameters the RL optimiser keeps moments for (what `rl.update` differentiates)."""
  optimizer = optim.stage_optimizer(model, config_lib.config("llada2"), "rl")
  paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(optimizer, nnx.OptState))]
  return {p.split("/mu/", 1)[1] for p in paths if "/mu/" in p}


def test_the_router_is_frozen_unless_train_router():
  cfg = models.llada2_tiny()
  frozen = _trained_names(models.create(cfg))
  assert "blocks/1/moe/gate_kernel" in frozen and "blocks/0/gate_proj/kernel" in frozen
  assert not any(n.endswith(("router", "expert_bias")) for n in frozen)
  trained = _trained_names(models.create(models.replace(cfg, train_router=True)))
  assert trained - frozen == {"blocks/1/moe/router", "blocks/1/moe/expert_bias"}


def test_routing_replay_refused_with_independent_masks(objective):
  import pytest
  with pytest.raises(ValueError, match="coupling='independent'"):
    objective("llada2", {"rl.routing_replay": True, "rl.coupling": "independent"})
