"""Tests for stabledrl_jax.optim: the logged learning rate is the one applied."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import optim

O = ml_collections.ConfigDict(dict(b1=0.9, b2=0.99, weight_decay=0.0, grad_clip=1e9, decay_steps=0))


def test_logged_rate_follows_warmup_then_decay_and_the_lr_scale():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optim.make_optimizer(1e-2, 2, 6, O), wrt=nnx.Param)
  grads = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))  # not the parameters themselves
  # Warmup 0 -> 1e-2 over 2 updates, then linear decay to 0 over the remaining 4.
  want = [0.0, 5e-3, 1e-2, 7.5e-3, 5e-3, 2.5e-3]
  got = []
  for i in range(6):
    scale = 0.5 if i == 4 else 1.0
    before = np.asarray(model.kernel[...])
    out = optim.apply(model, opt, grads, lr_scale=scale)
    got.append(float(out["lr"]))
    step = np.abs(np.asarray(model.kernel[...]) - before).max()
    # The first Adam step moves every weight by the rate (m/sqrt(v) = ±1 up to eps).
    if i == 1:
      assert step == pytest.approx(5e-3, rel=1e-3)
  want[4] *= 0.5
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_another_transformation_has_no_logged_rate():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  norm = float(np.sqrt(sum(np.sum(np.asarray(x) ** 2) for x in (model.kernel[...], model.bias[...]))))
  out = optim.apply(model, opt, jax.tree.map(jnp.copy, nnx.state(model, nnx.Param)))
  assert "lr" not in out and not bool(out["skipped"])
  assert float(out["grad_norm"]) == pytest.approx(norm, rel=1e-6)
