"""Tests for stabledrl_jax.losses against NumPy references written here."""
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax import losses


# ----------------------------------------------------------------------------- NumPy references


def np_snis(log_ratio, adv, sur, group_size, lo, hi, valid):
  """Loss, d loss / d surrogate, and weights, written loop by loop from docs/method.md §2."""
  n_groups = len(log_ratio) // group_size
  grad = np.zeros(len(sur))
  alphas = np.zeros(len(sur))
  group_values = []
  for g in range(n_groups):
    idx = [g * group_size + j for j in range(group_size) if valid[g * group_size + j]]
    if not idx:
      continue
    clipped = np.array([min(max(float(log_ratio[i]), lo), hi) for i in idx])
    w = np.exp(clipped - clipped.max())
    w /= w.sum()
    for i, a in zip(idx, w):
      alphas[i] = a
    group_values.append(sum(alphas[i] * adv[i] * sur[i] for i in idx))
  n = len(group_values)
  for i in range(len(sur)):
    grad[i] = -alphas[i] * adv[i] / n
  return -sum(group_values) / n, grad, alphas


def random_case(rng, n_groups, group_size, scale):
  b = n_groups * group_size
  log_ratio = rng.normal(size=b) * scale
  adv = rng.normal(size=b)
  sur = rng.normal(size=b) - 3.0
  valid = rng.random(b) > 0.25
  return log_ratio, adv, sur, valid


@pytest.mark.parametrize("n_groups,group_size", [(3, 4), (5, 1), (2, 8)])
@pytest.mark.parametrize("scale", [0.5, 30.0, 1e4])
@pytest.mark.parametrize("clip", [dict(epsilon=5.0), dict(epsilon=0.2), dict(max_ratio=5.0)])
def test_snis_clip_loss_matches_numpy_value_and_gradient(n_groups, group_size, scale, clip):
  rng = np.random.default_rng(n_groups * 100 + group_size + int(scale))
  log_ratio, adv, sur, valid = random_case(rng, n_groups, group_size, scale)
  valid[:group_size] = True  # at least one group with rows
  if "max_ratio" in clip:
    lo, hi = -math.inf, math.log(clip["max_ratio"])
  else:
    eps = clip["epsilon"]
    lo, hi = (math.log(1 - eps) if eps < 1 else -math.inf), math.log(1 + eps)
  want_loss, want_grad, alphas = np_snis(log_ratio, adv, sur, group_size, lo, hi, valid)

  lengths = rng.integers(1, 30, size=len(log_ratio))
  f = lambda s: losses.snis_clip_loss(jnp.asarray(log_ratio, jnp.float32), jnp.asarray(adv, jnp.float32),
                                      s, group_size=group_size, valid=jnp.asarray(valid),
                                      lengths=jnp.asarray(lengths), **clip)
  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(sur, jnp.float32))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)

  v = valid
  outside = ((log_ratio < lo) | (log_ratio > hi))[v]
  np.testing.assert_allclose(metrics["clip_fraction"], outside.mean(), atol=1e-6)
  np.testing.assert_allclose(metrics["clipped_token_fraction"],
                             (outside * lengths[v]).sum() / lengths[v].sum(), atol=1e-6)
  lr10 = log_ratio[v] / math.log(10)
  np.testing.assert_allclose(metrics["log10_ratio_max"], lr10.max(), rtol=1e-5)
  lmean = np.logaddexp.reduce(log_ratio[v]) - math.log(v.sum())
  np.testing.assert_allclose(metrics["log10_ratio_mean"], lmean / math.log(10), rtol=1e-4, atol=1e-5)
  a = alphas.reshape(n_groups, group_size)
  live = a.sum(1) > 0
  ess = (1 / (a[live] ** 2).sum(1)).mean()
  ent = np.mean([-(r[r > 0] * np.log(r[r > 0])).sum() for r in a[live]])
  np.testing.assert_allclose(metrics["ess"], ess, rtol=1e-5)
  np.testing.assert_allclose(metrics["weight_entropy"], ent, rtol=1e-4, atol=1e-6)


def test_snis_clip_loss_stops_gradient_through_log_ratio():
  adv = jnp.array([1.0, -1.0, 0.5, 2.0])
  sur = jnp.array([-1.0, -2.0, -3.0, -4.0])
  g = jax.grad(lambda lr: losses.snis_clip_loss(lr, adv, sur, group_size=2)[0])(jnp.zeros(4))
  np.testing.assert_array_equal(g, np.zeros(4))


def test_fully_padded_group_is_left_out_of_the_mean():
  lr = jnp.zeros(4)
  adv = jnp.array([1.0, -1.0, 5.0, 5.0])
  sur = jnp.array([-1.0, -3.0, jnp.nan, jnp.inf])  # padding rows may hold garbage
  loss, m = losses.snis_clip_loss(lr, adv, sur, group_size=2, valid=jnp.array([True, True, False, False]))
  np.testing.assert_allclose(loss, -(0.5 * -1.0 + 0.5 * 3.0))
  np.testing.assert_allclose(m["ess"], 2.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("value", [1e4, -1e4, 88.0, -200.0])
def test_snis_clip_loss_is_finite_for_extreme_ratios(dtype, value):
  lr = jnp.array([value, 0.0, -value, value, value, value], dtype)
  adv = jnp.array([1.0, -2.0, 0.5, -1.0, 1.0, 3.0], dtype)
  sur = jnp.array([-10.0, -20.0, -5.0, -1.0, -2.0, -3.0], dtype)
  for kw in (dict(epsilon=5.0), dict(epsilon=0.2), dict(max_ratio=5.0)):
    (loss, metrics), (g_lr, g_sur) = jax.value_and_grad(
        lambda a, b: losses.snis_clip_loss(a, adv, b, group_size=3, **kw), argnums=(0, 1), has_aux=True)(lr, sur)
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(np.asarray(g_sur, np.float32)))
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_bad_group_size_names_the_value():
  with pytest.raises(ValueError, match="group_size=4"):
    losses.snis_clip_loss(jnp.zeros(6), jnp.zeros(6), jnp.zeros(6), group_size=4)
  with pytest.raises(ValueError, match="epsilon"):
    losses.snis_clip_loss(jnp.zeros(4), jnp.zeros(4), jnp.zeros(4), group_size=2, epsilon=-1.0)


def test_clip_bounds():
  assert losses.clip_bounds(5.0) == (-math.inf, math.log(6.0))
  lo, hi = losses.clip_bounds(0.2)
  np.testing.assert_allclose([lo, hi], [math.log(0.8), math.log(1.2)])
  assert losses.clip_bounds(0.2, max_ratio=5.0) == (-math.inf, math.log(5.0))


@pytest.mark.parametrize("eps", [0.0, 0.2, 1.0, 5.0])
def test_traced_epsilon_gives_the_same_loss_as_a_python_one(eps):
  rng = np.random.default_rng(3)
  lr, adv, sur = (jnp.asarray(rng.normal(size=8) * s, jnp.float32) for s in (2.0, 1.0, 3.0))
  static = losses.snis_clip_loss(lr, adv, sur, group_size=4, epsilon=eps)
  traced = jax.jit(lambda e: losses.snis_clip_loss(lr, adv, sur, group_size=4, epsilon=e))(
      jnp.float32(eps))
  np.testing.assert_allclose(traced[0], static[0], rtol=1e-6)
  np.testing.assert_allclose(traced[1]["clip_fraction"], static[1]["clip_fraction"])


def test_importance_weighted_loss_matches_numpy_and_grows_with_the_ratio():
  rng = np.random.default_rng(4)
  lr = rng.normal(size=8) * 2
  adv, sur = rng.normal(size=8), rng.normal(size=8)
  valid = np.array([1, 1, 1, 0, 1, 1, 1, 1], bool)
  groups = []
  for g in range(2):
    idx = [i for i in range(4 * g, 4 * g + 4) if valid[i]]
    groups.append(sum(math.exp(lr[i]) / len(idx) * adv[i] * sur[i] for i in idx))
  loss, m = losses.importance_weighted_loss(jnp.asarray(lr), jnp.asarray(adv), jnp.asarray(sur),
                                            group_size=4, valid=jnp.asarray(valid))
  np.testing.assert_allclose(loss, -np.mean(groups), rtol=1e-5)
  np.testing.assert_allclose(m["log10_ratio_max"], lr[valid].max() / math.log(10), rtol=1e-5)
  # d loss / d surrogate_j = -ρ_j A_j / (G · groups): linear in ρ, no bound.
  g = jax.grad(lambda s: losses.importance_weighted_loss(
      jnp.asarray(lr), jnp.asarray(adv), s, group_size=4, valid=jnp.asarray(valid))[0])(jnp.asarray(sur))
  expected = np.where(valid, -np.exp(lr) * adv / np.where(np.arange(8) < 4, 3, 4) / 2, 0.0)
  np.testing.assert_allclose(g, expected, rtol=1e-5)


# ----------------------------------------------------------------------------- the core claim


def _linear_model_case(seed, n_groups=4, group_size=8, dim=16, adversarial_log10=8.0):
  """Surrogate L_j(θ) = θ·φ_j: per-sample gradients are φ_j, known exactly."""
  rng = np.random.default_rng(seed)
  b = n_groups * group_size
  phi = rng.normal(size=(b, dim)) * rng.uniform(0.5, 3.0, size=(b, 1))
  adv = rng.normal(size=b)
  log_ratio = rng.normal(size=b) * 0.1
  boosted = rng.random(b) < 0.7
  log_ratio[boosted] = adversarial_log10 * math.log(10)
  return jnp.asarray(phi, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(log_ratio, jnp.float32)


def _hull_bound(phi, adv, group_size):
  """Mean over groups of max_j |A_j| ‖∇L_j‖: the bound on ‖∇J‖ for a convex combination."""
  norms = np.linalg.norm(np.asarray(phi), axis=1) * np.abs(np.asarray(adv))
  return norms.reshape(-1, group_size).max(1).mean()


@pytest.mark.parametrize("seed", range(5))
def test_stabledrl_gradient_never_exceeds_convex_hull_bound(seed):
  group_size = 8
  phi, adv, log_ratio = _linear_model_case(seed, group_size=group_size)
  bound = _hull_bound(phi, adv, group_size)
  for kw in (dict(epsilon=5.0), dict(max_ratio=5.0), dict(epsilon=1e6)):
    def loss(theta):
      return losses.snis_clip_loss(log_ratio, adv, phi @ theta, group_size=group_size, **kw)[0]
    g = jax.grad(loss)(jnp.zeros(phi.shape[1]))
    assert np.linalg.norm(g) <= bound * (1 + 1e-5), (kw, float(np.linalg.norm(g)), bound)


def test_grpo_gradient_grows_linearly_with_ratio_on_negative_advantages():
  group_size = 8
  phi, adv, _ = _linear_model_case(0, group_size=group_size)
  bound = _hull_bound(phi, adv, group_size)
  norms = []
  exponents = [2.0, 4.0, 6.0, 8.0]
  for e in exponents:
    _, _, log_ratio = _linear_model_case(0, group_size=group_size, adversarial_log10=e)

    def loss(theta):
      new_logp = phi @ theta
      # Ratio value ρ from the estimate, gradient ∇log π = φ: log ρ = θ·φ - sg(θ·φ) + ℓ.
      lr = new_logp - jax.lax.stop_gradient(new_logp) + log_ratio
      return losses.grpo_clip_loss(lr, adv, epsilon=0.5)[0]
    norms.append(float(np.linalg.norm(jax.grad(loss)(jnp.zeros(phi.shape[1])))))
  slopes = np.diff(np.log10(norms)) / np.diff(exponents)
  np.testing.assert_allclose(slopes, 1.0, atol=0.02)  # ‖g‖ ∝ ρ
  assert norms[-1] > 1e4 * bound
  # ... and StableDRL on the very same inputs stays under the bound.
  g = jax.grad(lambda t: losses.snis_clip_loss(log_ratio, adv, phi @ t, group_size=group_size)[0])(
      jnp.zeros(phi.shape[1]))
  assert np.linalg.norm(g) <= bound * (1 + 1e-5)


# ----------------------------------------------------------------------------- elbo_ratio


def test_elbo_ratio_matches_numpy_and_keeps_gradient_only_in_elbo_new():
  rng = np.random.default_rng(1)
  lp_new = rng.normal(size=(3, 2, 5)) - 2
  lp_old = rng.normal(size=(3, 2, 5)) - 2
  w_new = rng.random((3, 2, 5)) * (rng.random((3, 2, 5)) > 0.4)
  w_old = rng.random((3, 2, 5)) * (rng.random((3, 2, 5)) > 0.4)
  lp_old[w_old == 0] = -np.inf  # uncounted positions may be -inf
  want_new = (w_new * lp_new).sum(-1).mean(-1)
  want_old = np.where(w_old > 0, w_old * lp_old, 0).sum(-1).mean(-1)
  lr, elbo = losses.elbo_ratio(jnp.asarray(lp_new), jnp.asarray(w_new), jnp.asarray(lp_old), jnp.asarray(w_old))
  np.testing.assert_allclose(elbo, want_new, rtol=1e-5)
  np.testing.assert_allclose(lr, want_new - want_old, rtol=1e-5)
  # Coupled: weight_old=None reuses weight_new.
  lr_c, _ = losses.elbo_ratio(jnp.asarray(lp_new), jnp.asarray(w_new), jnp.asarray(lp_new))
  np.testing.assert_array_equal(lr_c, np.zeros(3))

  def f(lp):
    lr, e = losses.elbo_ratio(lp, jnp.asarray(w_new), jnp.asarray(lp_old), jnp.asarray(w_old))
    return jnp.sum(lr), jnp.sum(e)
  g_lr = jax.grad(lambda lp: f(lp)[0])(jnp.asarray(lp_new))
  g_e = jax.grad(lambda lp: f(lp)[1])(jnp.asarray(lp_new))
  np.testing.assert_array_equal(g_lr, np.zeros_like(lp_new))
  np.testing.assert_allclose(g_e, w_new / 2, rtol=1e-6)


# ----------------------------------------------------------------------------- advantages


def test_group_advantages_modes_match_numpy():
  rng = np.random.default_rng(2)
  r = rng.random(12)
  g = r.reshape(3, 4)
  mean = g - g.mean(1, keepdims=True)
  np.testing.assert_allclose(losses.group_advantages(jnp.asarray(r), group_size=4), mean.reshape(-1), rtol=1e-5, atol=1e-6)
  std = mean / (g.std(1, keepdims=True) + 1e-4)
  np.testing.assert_allclose(losses.group_advantages(jnp.asarray(r), group_size=4, mode="mean_std"), std.reshape(-1), rtol=1e-4)
  loo = np.array([[row[j] - np.delete(row, j).mean() for j in range(4)] for row in g])
  np.testing.assert_allclose(losses.group_advantages(jnp.asarray(r), group_size=4, mode="leave_one_out"), loo.reshape(-1), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(losses.group_advantages(jnp.asarray(r[:3]), group_size=1, mode="leave_one_out"), np.zeros(3))
  valid = np.array([True, True, False, True] * 3)
  got = losses.group_advantages(jnp.asarray(r), group_size=4, valid=jnp.asarray(valid))
  want = np.concatenate([[x - row[v].mean() if vv else 0.0 for x, vv in zip(row, v)]
                         for row, v in zip(g, valid.reshape(3, 4))])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="bogus"):
    losses.group_advantages(jnp.asarray(r), group_size=4, mode="bogus")


# ----------------------------------------------------------------------------- baselines


def test_grpo_clip_loss_token_level_with_kl_matches_numpy():
  rng = np.random.default_rng(3)
  lr = rng.normal(size=(4, 6)) * 0.8
  adv = rng.normal(size=4)
  ref = rng.normal(size=(4, 6)) * 0.3
  mask = rng.random((4, 6)) > 0.3
  mask[:, 0] = True
  eps, beta = 0.5, 0.04
  rho = np.exp(lr)
  obj = np.minimum(rho * adv[:, None], np.clip(rho, 1 - eps, 1 + eps) * adv[:, None])
  k3 = np.exp(ref) - ref - 1
  per_tok = -obj + beta * k3
  want = np.mean([(per_tok[i][mask[i]]).mean() for i in range(4)])
  loss, m = losses.grpo_clip_loss(jnp.asarray(lr), jnp.asarray(adv), epsilon=eps, mask=jnp.asarray(mask),
                                  ref_log_ratio=jnp.asarray(ref), kl_coef=beta)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  zeroed = (np.clip(rho, 1 - eps, 1 + eps) * adv[:, None] < rho * adv[:, None])
  np.testing.assert_allclose(m["clip_fraction"], zeroed[mask].mean(), rtol=1e-6)
  np.testing.assert_allclose(m["kl"], k3[mask].mean(), rtol=1e-5)
  # Gradient w.r.t. the log ratio: ρA where unclipped, 0 where the clip is active.
  g = jax.grad(lambda x: losses.grpo_clip_loss(x, jnp.asarray(adv), epsilon=eps, mask=jnp.asarray(mask))[0])(jnp.asarray(lr))
  want_g = np.where(zeroed, 0.0, -rho * adv[:, None]) * mask / mask.sum(1, keepdims=True) / 4
  np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-7)


def test_espo_loss_matches_numpy():
  rng = np.random.default_rng(4)
  e_new, e_old, e_ref = (rng.normal(size=6) * 5 - 40 for _ in range(3))
  adv = rng.normal(size=6)
  length = rng.integers(5, 30, size=6).astype(float)
  eps, beta = 0.2, 0.1
  rho = np.exp((e_new - e_old) / length)
  ppo = -np.minimum(rho * adv, np.clip(rho, 1 - eps, 1 + eps) * adv).mean()
  k2 = (0.5 * ((e_new - e_ref) / length) ** 2).mean()
  loss, _ = losses.espo_loss(*(jnp.asarray(x) for x in (e_new, e_old, adv, length)), epsilon=eps,
                             kl_coef=beta, elbo_ref=jnp.asarray(e_ref))
  np.testing.assert_allclose(loss, ppo + beta * k2, rtol=1e-5)


def test_eubo_matches_numpy_and_upper_bounds_elbo_on_a_toy():
  rng = np.random.default_rng(5)
  b, m, l, beta = 2, 3, 7, 1.5
  logp = -rng.random((b, m, l)) * 3
  masked = rng.random((b, m, l)) > 0.5
  counted = np.ones((b, l), bool)
  counted[1, 5:] = False
  want = []
  for i in range(b):
    mk = masked[i] & counted[i]
    t_hat = mk.sum(-1) / counted[i].sum()
    vals = []
    for j in range(l):
      if not mk[:, j].any():
        continue
      inner = np.mean([np.exp(beta * logp[i, s, j]) / t_hat[s] if mk[s, j] else 0.0 for s in range(m)])
      vals.append(np.log(inner))
    want.append(np.mean(vals) / beta)
  got = losses.eubo(jnp.asarray(logp), jnp.asarray(masked), jnp.asarray(counted), beta=beta)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  g = jax.grad(lambda x: jnp.sum(losses.eubo(x, jnp.asarray(masked), jnp.asarray(counted))))(jnp.asarray(logp))
  assert np.all(np.isfinite(g))


def test_eubo_keeps_tokens_whose_p_beta_underflows_float32():
  # Token 2 has log p = -80: p^1.5 = e^-120 is 0 in float32 (the official code drops such a
  # token), not in float64. The definition keeps it; so does losses.eubo.
  beta = 1.5
  logp = np.array([[[-0.5, -2.0, -80.0, -1.0], [-0.7, -1.5, -80.0, -3.0]]])
  masked = np.array([[[True, False, True, True], [True, True, True, False]]])
  counted = np.ones((1, 4), bool)
  assert np.float32(np.exp(np.float32(beta * -80.0))) == 0.0
  t_hat = masked[0].sum(-1) / 4.0
  per_token = [np.log(np.mean([np.exp(beta * logp[0, s, j]) / t_hat[s] if masked[0, s, j] else 0.0
                               for s in range(2)])) for j in range(4)]
  want = np.mean(per_token) / beta
  dropped = np.mean([v for j, v in enumerate(per_token) if j != 2]) / beta
  got = float(losses.eubo(jnp.asarray(logp, jnp.float32), jnp.asarray(masked), jnp.asarray(counted),
                          beta=beta)[0])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert abs(got - dropped) > 10  # keeping the token matters
  g = jax.grad(lambda x: jnp.sum(losses.eubo(x, jnp.asarray(masked), jnp.asarray(counted))))(
      jnp.asarray(logp, jnp.float32))
  np.testing.assert_allclose(g[0, :, 2], [0.125, 0.125], rtol=1e-5)  # d/dlogp: (1/4 tokens)·share 1/2


def test_spg_surrogate_and_loss_match_numpy():
  adv = np.array([1.0, -0.5, 0.0, 2.0])
  elbo = np.array([-1.0, -2.0, -3.0, -0.5])
  up = np.array([-0.5, -1.0, -1.0, 0.0])
  sur = np.where(adv > 0, elbo, 0.5 * up + 0.5 * elbo)
  np.testing.assert_allclose(losses.spg_surrogate(jnp.asarray(adv), jnp.asarray(elbo), jnp.asarray(up)), sur)
  length = np.array([10.0, 20.0, 5.0, 1.0])
  loss, _ = losses.spg_loss(jnp.asarray(adv), jnp.asarray(sur), jnp.asarray(length))
  np.testing.assert_allclose(loss, -(length * adv * sur).sum() / length.sum(), rtol=1e-6)


def test_wd1_loss_matches_numpy():
  rng = np.random.default_rng(6)
  adv = rng.normal(size=8)
  logp = rng.normal(size=8) - 5
  want = 0.0
  for a, lp in zip(adv.reshape(2, 4), logp.reshape(2, 4)):
    pos = np.exp(a) / np.exp(a).sum()
    neg = np.exp(-a) / np.exp(-a).sum()
    want += (-(pos * lp).sum() + (neg * lp).sum()) / 2
  loss, _ = losses.wd1_loss(jnp.asarray(adv), jnp.asarray(logp), group_size=4)
  np.testing.assert_allclose(loss, want, rtol=1e-5)


# ----------------------------------------------------------------------------- transformations


def test_snis_clip_loss_under_jit_vmap_and_sharding():
  rng = np.random.default_rng(7)
  lr, adv, sur, _ = random_case(rng, 8, 4, 3.0)
  lr, adv, sur = (jnp.asarray(x, jnp.float32) for x in (lr, adv, sur))
  f = lambda a, b, c: losses.snis_clip_loss(a, b, c, group_size=4)[0]
  eager = f(lr, adv, sur)
  np.testing.assert_allclose(jax.jit(f)(lr, adv, sur), eager, rtol=1e-6)
  # vmap over a leading axis of independent batches = one loss per batch.
  stacked = [x.reshape(2, 16) for x in (lr, adv, sur)]
  per = jax.vmap(f)(*stacked)
  np.testing.assert_allclose(per, [f(*(x[i] for x in stacked)) for i in range(2)], rtol=1e-6)
  np.testing.assert_allclose(per.mean(), eager, rtol=1e-6)

  assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices"
  mesh = jax.make_mesh((8,), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  args = [jax.device_put(x, sharding) for x in (lr, adv, sur)]
  loss_s, grad_s = jax.jit(jax.value_and_grad(f, argnums=2))(*args)
  loss_1, grad_1 = jax.value_and_grad(f, argnums=2)(lr, adv, sur)
  np.testing.assert_allclose(loss_s, loss_1, rtol=1e-6)
  np.testing.assert_allclose(grad_s, grad_1, rtol=1e-6)
  assert len(grad_s.sharding.device_set) == 8


def test_all_losses_jit_and_grad():
  rng = np.random.default_rng(8)
  b = 8
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  x = jnp.asarray(rng.normal(size=b) - 3, jnp.float32)
  fns = {
      "grpo": lambda s: losses.grpo_clip_loss(s - jax.lax.stop_gradient(s), adv, epsilon=0.2)[0],
      "espo": lambda s: losses.espo_loss(s, s + 0.1, adv, jnp.full(b, 4.0))[0],
      "spg": lambda s: losses.spg_loss(adv, s, jnp.full(b, 4.0))[0],
      "wd1": lambda s: losses.wd1_loss(adv, s, group_size=4)[0],
  }
  for name, fn in fns.items():
    g = jax.jit(jax.grad(fn))(x)
    assert g.shape == (b,) and np.all(np.isfinite(g)), name
    assert np.any(g != 0), name


def test_importing_losses_pulls_in_no_framework():
  code = ("import sys, stabledrl_jax.losses, stabledrl_jax.estimators; "
          "bad = [m for m in ('flax', 'optax', 'orbax', 'grain', 'tensorflow_datasets', 'tensorflow') "
          "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
  assert out.returncode == 0, out.stdout + out.stderr
