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


def test_bfloat16_moments_are_stored_in_bfloat16_and_track_float32_adam():
  # Reference: Adam written out in NumPy float64 from its definition (no weight decay, no clip).
  lr, b1, b2, eps = 1e-2, O.b1, O.b2, 1e-8
  x0 = np.array([1.0, -2.0, 0.5, 3.0])
  grad = lambda x: 2 * x * np.array([1.0, 0.3, 2.0, 0.1])  # noqa: E731
  x, m, v = x0.copy(), np.zeros(4), np.zeros(4)
  for t in range(1, 6):
    g = grad(x)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    rate = lr * (1 - (t - 1) / 1000)  # the linear decay over the 1000 steps of the stage
    x = x - rate * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
  for dtype, tol in (("float32", 1e-5), ("bfloat16", 2e-3)):
    tx = optim.make_optimizer(lr, 0, 1000, ml_collections.ConfigDict({**O, "moment_dtype": dtype}))
    params = jnp.asarray(x0, jnp.float32)
    state = tx.init(params)
    floats = [l for l in jax.tree.leaves(state) if l.ndim == 1]
    assert floats and all(l.dtype == jnp.dtype(dtype) for l in floats), dtype
    for _ in range(5):
      updates, state = tx.update(jnp.asarray(grad(np.asarray(params)), jnp.float32), state, params)
      params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.asarray(params), x, rtol=0, atol=tol * lr * 5)


def test_unknown_moment_dtype_is_named():
  with pytest.raises(ValueError, match="config.optim.moment_dtype='float16'"):
    optim.make_optimizer(1e-3, 0, 10, ml_collections.ConfigDict({**O, "moment_dtype": "float16"}))


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.Linear(3, 3, rngs=rngs)


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Linear(2, 3, rngs=rngs)
    self.blocks = nnx.List([_Block(rngs), _Block(rngs)])


def test_update_norms_per_group_match_adam_written_out():
  # Reference: two Adam updates in NumPy float64 from the definition (no decay, no clip, rate
  # constant over the 1000-step stage's first two steps up to the decay, taken into account).
  lr, b1, b2, eps = 1e-2, O.b1, O.b2, 1e-8
  model = _Net(nnx.Rngs(0))
  opt = nnx.Optimizer(model, optim.make_optimizer(lr, 0, 1000, O), wrt=nnx.Param)
  names = {"embed": [("embed", "kernel"), ("embed", "bias")],
           "attn": [("blocks", i, "attn", p) for i in (0, 1) for p in ("kernel", "bias")]}
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  def get(tree, path):
    return tree[path[0]] if len(path) == 1 else get(tree[path[0]], path[1:])
  x = {p: np.asarray(get(pure, p), np.float64) for g in names.values() for p in g}
  m = {p: np.zeros_like(v) for p, v in x.items()}
  v2 = {p: np.zeros_like(v) for p, v in x.items()}
  rng = np.random.default_rng(0)
  for t in (1, 2):
    g = {p: rng.normal(size=v.shape) for p, v in x.items()}
    grads = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    for p, val in g.items():
      get(grads, p)[...] = jnp.asarray(val, jnp.float32)
    out = optim.apply(model, opt, grads, norms=True)
    rate = lr * (1 - (t - 1) / 1000)
    delta = {}
    for p in x:
      m[p] = b1 * m[p] + (1 - b1) * g[p]
      v2[p] = b2 * v2[p] + (1 - b2) * g[p] ** 2
      delta[p] = -rate * (m[p] / (1 - b1**t)) / (np.sqrt(v2[p] / (1 - b2**t)) + eps)
      x[p] = x[p] + delta[p]
    norm = lambda d, ps: np.sqrt(sum(np.sum(d[p] ** 2) for p in ps))  # noqa: E731
    every = [p for ps in names.values() for p in ps]
    for key, tree in (("update_norm", delta), ("param_norm", x), ("adam_mu_norm", m),
                      ("adam_nu_norm", v2)):
      assert float(out[key]) == pytest.approx(norm(tree, every), rel=1e-4), (key, t)
      for group, ps in names.items():
        assert float(out[f"{key}/{group}"]) == pytest.approx(norm(tree, ps), rel=1e-4), (key, group)
    assert sorted(k for k in out if k.startswith("update_norm")) == [
        "update_norm", "update_norm/attn", "update_norm/embed"]
  assert "update_norm" not in optim.apply(model, opt, grads)  # off by default
