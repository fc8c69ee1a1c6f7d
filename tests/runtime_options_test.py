"""Execution options (remat policies, blockwise attention, optimiser state in host memory) leave
one RL step's loss and parameters equal to the default's, and bfloat16 Adam moments change them by
rounding only, on the tiny model sharded over 8 fake CPU devices."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import config_lib, models, objectives, optim, rl, rollouts, sharding

OPTIONS = {
    "remat_dots": dict(remat=True, remat_policy="dots"),
    "remat_dots_no_batch": dict(remat=True, remat_policy="dots_no_batch"),
    "blockwise": dict(attention_impl="blockwise", attention_tile=5),  # 5 does not divide 2N = 24
}


def one_rl_step(tx=None, offload=False, **options):
  assert len(jax.devices()) == 8
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  cfg = models.tiny(vocab_size=40, mask_token_id=3, eos_token_id=2, pad_token_id=0,
                    stop_token_ids=(2,), compute_dtype="float32", **options)
  model = sharding.create_model(cfg, 0, mesh)
  # Plain SGD at lr 1: the parameter change is the gradient (Adam's first step, ~lr * sign(g),
  # would turn float noise in a near-zero gradient entry into a whole step).
  opt = nnx.Optimizer(model, tx or optax.chain(optax.sgd(1.0)), wrt=nnx.Param)
  if offload:
    optim.offload(opt)
  obj = dataclasses.replace(objectives.Objective.from_config(config_lib.base_config("sdar")),
                            group_size=2, scheme="block_t", num_samples=2, block_size=4,
                            staircase=True)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(4, 40, size=(4, 12)), jnp.int32)
  completion = jnp.broadcast_to(jnp.arange(12) >= 4, (4, 12))
  valid = jnp.asarray(np.arange(12)[None] >= np.array([[0], [0], [2], [3]]))  # left padding
  seqs = rollouts.Sequences(tokens, jnp.broadcast_to(jnp.arange(12), (4, 12)), valid,
                              ~completion & valid, completion, completion)
  seqs = sharding.shard_batch(seqs, mesh)
  batch, _ = rl.behaviour_pass(model, None, seqs, jnp.array([1.0, -1.0, 0.5, -0.5]),
                                  jax.random.key(1), obj)
  out = rl.update(model, opt, batch, jax.random.key(2), obj=obj, accumulation=2)
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  if offload:
    return float(out["loss"]), float(out["grad_norm"]), params, opt
  return float(out["loss"]), float(out["grad_norm"]), params


@pytest.fixture(scope="module")
def default_step():
  return one_rl_step()


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_leaves_one_rl_step_unchanged(name, default_step):
  loss, grad_norm, params = one_rl_step(**OPTIONS[name])
  want_loss, want_norm, want_params = default_step
  assert want_norm > 0
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad_norm, want_norm, rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params,
               want_params)


def test_unknown_options_are_named():
  with pytest.raises(ValueError, match="remat_policy 'everything'"):
    models.tiny(remat_policy="everything")
  with pytest.raises(ValueError, match="attention_impl 'flash'"):
    models.tiny(attention_impl="flash")
  with pytest.raises(ValueError, match="attention_tile=0"):
    models.tiny(attention_tile=0)


def test_bfloat16_moments_change_one_adamw_step_by_rounding_only():
  lr = 1e-3

  def adamw(moment_dtype):
    return optim.make_optimizer(lr, 0, 10, ml_collections.ConfigDict(dict(
        b1=0.9, b2=0.99, weight_decay=0.1, grad_clip=1.0, decay_steps=0, moment_dtype=moment_dtype)))

  loss32, norm32, params32 = one_rl_step(tx=adamw("float32"))
  loss16, norm16, params16 = one_rl_step(tx=adamw("bfloat16"))
  assert (loss16, norm16) == (loss32, norm32)  # the same gradient; only the update differs
  # Adam's first step is lr * m / (sqrt(v) + eps) per entry; bfloat16 moments round m and v to
  # 8 significant bits, so the step moves by at most ~1% of lr more or less.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=0.01 * lr), params16,
               params32)


def test_offloaded_optimizer_state_leaves_one_adamw_step_unchanged():
  tx = optim.make_optimizer(1e-3, 0, 10, ml_collections.ConfigDict(dict(
      b1=0.9, b2=0.99, weight_decay=0.1, grad_clip=1.0, decay_steps=0, moment_dtype="float32")))
  want = one_rl_step(tx=tx)
  loss, grad_norm, params, opt = one_rl_step(tx=tx, offload=True)
  assert (loss, grad_norm) == want[:2]
  jax.tree.map(np.testing.assert_array_equal, params, want[2])
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(opt)) if x.ndim}
  assert kinds == {"pinned_host"}  # the updated moments went back to host memory
