"""Tests for stabledrl_jax.diagnostics against NumPy / plain-Python references written here."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax import diagnostics


# ----------------------------------------------------------------------------- references


def np_entropy(logits, temperature):
  x = logits.astype(np.float64) / temperature
  x = x - x.max(-1, keepdims=True)
  p = np.exp(x)
  p /= p.sum(-1, keepdims=True)
  with np.errstate(divide="ignore", invalid="ignore"):
    return -np.where(p > 0, p * np.log(p), 0.0).sum(-1)


def py_repetition(tokens, mask, n):
  rates = []
  for toks, m in zip(tokens.tolist(), mask.tolist()):
    seen, repeated, total = set(), 0, 0
    for i in range(len(toks) - n + 1):
      if not all(m[i:i + n]):
        continue
      gram = tuple(toks[i:i + n])
      total += 1
      repeated += gram in seen
      seen.add(gram)
    if total:
      rates.append(repeated / total)
  return np.mean(rates) if rates else 0.0


def py_longest_run(tokens, mask):
  fracs = []
  for toks, m in zip(tokens.tolist(), mask.tolist()):
    best = run = 0
    prev = None
    for t, ok in zip(toks, m):
      if not ok:
        run, prev = 0, None
        continue
      run = run + 1 if t == prev else 1
      prev = t
      best = max(best, run)
    if sum(m):
      fracs.append(best / sum(m))
  return np.mean(fracs)


def prefix_mask(rng, b, length):
  lengths = rng.integers(0, length + 1, size=b)
  return np.arange(length)[None, :] < lengths[:, None]


# ----------------------------------------------------------------------------- entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_matches_numpy(temperature):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)) * 3
  logits[0, 0, :4] = -np.inf  # banned tokens must not turn the entropy into nan
  mask = rng.random((3, 5)) > 0.3
  ent = np_entropy(logits, temperature)
  got_bxl = diagnostics.token_entropies(jnp.asarray(logits, jnp.float32), temperature)
  np.testing.assert_allclose(got_bxl, ent, rtol=1e-5, atol=1e-5)
  got = diagnostics.token_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(mask), temperature)
  np.testing.assert_allclose(got, ent[mask].mean(), rtol=1e-5)


def test_token_entropy_limits_uniform_and_one_hot():
  v = 7
  uniform = jnp.zeros((1, 2, v))
  one_hot = jnp.full((1, 2, v), -1e9).at[..., 3].set(0.0)
  mask = jnp.ones((1, 2), bool)
  np.testing.assert_allclose(diagnostics.token_entropy(uniform, mask), np.log(v), rtol=1e-6)
  np.testing.assert_allclose(diagnostics.token_entropy(one_hot, mask), 0.0, atol=1e-6)


# ----------------------------------------------------------------------------- repetition


@pytest.mark.parametrize("n", [1, 2, 4])
def test_repetition_rate_matches_python_loop(n):
  rng = np.random.default_rng(n)
  tokens = rng.integers(0, 3, size=(6, 12))  # small vocabulary: repeats are common
  mask = prefix_mask(rng, 6, 12)
  mask[1, 4] = False  # a hole, not only prefixes
  got = diagnostics.repetition_rate(jnp.asarray(tokens), jnp.asarray(mask), n)
  np.testing.assert_allclose(got, py_repetition(tokens, mask, n), rtol=1e-6)


def test_repetition_rate_of_a_constant_and_of_distinct_tokens():
  m, n = 10, 4
  const = jnp.zeros((1, m), jnp.int32)
  distinct = jnp.arange(m)[None]
  mask = jnp.ones((1, m), bool)
  np.testing.assert_allclose(diagnostics.repetition_rate(const, mask, n), (m - n) / (m - n + 1))
  assert float(diagnostics.repetition_rate(distinct, mask, n)) == 0.0


def test_longest_run_fraction_matches_python_loop():
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 2, size=(7, 15))
  mask = prefix_mask(rng, 7, 15)
  mask[0] = True
  mask[2, 6] = False
  got = diagnostics.longest_run_fraction(jnp.asarray(tokens), jnp.asarray(mask))
  np.testing.assert_allclose(got, py_longest_run(tokens, mask), rtol=1e-6)


# ----------------------------------------------------------------------------- KL


def test_kl_estimates_match_numpy_formulas():
  rng = np.random.default_rng(4)
  lr = rng.normal(size=(4, 9)) * 0.5
  mask = rng.random((4, 9)) > 0.4
  got = diagnostics.kl_estimates(jnp.asarray(lr, jnp.float32), jnp.asarray(mask))
  np.testing.assert_allclose(got["kl_k1"], (-lr)[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(got["kl_k3"], (np.exp(lr) - 1 - lr)[mask].mean(), rtol=1e-5)


def test_kl_estimates_recover_the_kl_of_two_gaussians():
  # x ~ old = N(0, 1), new = N(mu, 1): KL(old‖new) = mu²/2, and log new/old = mu·x - mu²/2.
  mu = 0.6
  x = np.random.default_rng(5).normal(size=200_000)
  got = diagnostics.kl_estimates(jnp.asarray(mu * x - mu**2 / 2, jnp.float32))
  assert abs(float(got["kl_k1"]) - mu**2 / 2) < 0.01
  assert abs(float(got["kl_k3"]) - mu**2 / 2) < 0.01


# ----------------------------------------------------------------------------- rewards, lengths


def test_zero_advantage_fraction_matches_numpy():
  r = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, 0, 0, 0, 1], np.float32)
  valid = np.ones(16, bool)
  valid[15] = False  # the last group has equal rewards among its valid rows
  groups = [r[i:i + 4][valid[i:i + 4]] for i in range(0, 16, 4)]
  want = np.mean([np.ptp(g) == 0 for g in groups])
  got = diagnostics.zero_advantage_fraction(jnp.asarray(r), 4, jnp.asarray(valid))
  np.testing.assert_allclose(got, want)
  assert want == 0.75


def test_reward_and_length_stats_match_numpy():
  rng = np.random.default_rng(6)
  r = rng.random(12).astype(np.float32)
  valid = rng.random(12) > 0.3
  valid[:3] = True
  got = diagnostics.reward_stats(jnp.asarray(r), 3, jnp.asarray(valid))
  v = r[valid]
  np.testing.assert_allclose(got["reward_mean"], v.mean(), rtol=1e-5)
  np.testing.assert_allclose(got["reward_std"], v.std(), rtol=1e-5)
  np.testing.assert_allclose(got["reward_min"], v.min())
  np.testing.assert_allclose(got["reward_max"], v.max())
  gstd = [r[i:i + 3][valid[i:i + 3]].std() for i in range(0, 12, 3) if valid[i:i + 3].any()]
  np.testing.assert_allclose(got["reward_group_std"], np.mean(gstd), rtol=1e-5)

  lengths = rng.integers(1, 9, size=12)
  got = diagnostics.length_stats(jnp.asarray(lengths), jnp.asarray(valid), max_length=8)
  np.testing.assert_allclose(got["length_mean"], lengths[valid].mean(), rtol=1e-6)
  np.testing.assert_allclose(got["length_min"], lengths[valid].min())
  np.testing.assert_allclose(got["length_max"], lengths[valid].max())
  np.testing.assert_allclose(got["truncated_fraction"], (lengths[valid] >= 8).mean())


# ----------------------------------------------------------------------------- per step


def _step_inputs(rng, groups=3, g=4, length=10, vocab=5):
  b = groups * g
  return dict(
      rewards_B=jnp.asarray(rng.integers(0, 2, size=b), jnp.float32),
      mask_BxL=jnp.asarray(prefix_mask(rng, b, length)),
      tokens_BxL=jnp.asarray(rng.integers(0, vocab, size=(b, length))),
      entropy_BxL=jnp.asarray(rng.random((b, length)), jnp.float32),
      log_ratio=jnp.asarray(rng.normal(size=b) * 0.3, jnp.float32),
  )


def test_step_diagnostics_is_jittable_and_agrees_with_the_parts():
  rng = np.random.default_rng(7)
  x = _step_inputs(rng)
  eager = diagnostics.step_diagnostics(group_size=4, ngram=2, **x)
  jitted = jax.jit(functools.partial(diagnostics.step_diagnostics, group_size=4, ngram=2))(**x)
  assert set(eager) == set(jitted)
  for k in eager:
    assert eager[k].shape == () and eager[k].dtype == jnp.float32, k
    np.testing.assert_allclose(jitted[k], eager[k], rtol=1e-6, err_msg=k)
  tokens, mask = np.asarray(x["tokens_BxL"]), np.asarray(x["mask_BxL"])
  np.testing.assert_allclose(eager["repetition_rate"], py_repetition(tokens, mask, 2), rtol=1e-6)
  np.testing.assert_allclose(eager["token_entropy"],
                             np.asarray(x["entropy_BxL"])[mask].mean(), rtol=1e-6)
  np.testing.assert_allclose(eager["length_mean"], mask.sum(-1).mean(), rtol=1e-6)
  floats = diagnostics.to_floats(eager)
  assert all(type(v) is float for v in floats.values())
  assert set(floats) >= {"zero_adv_fraction", "reward_mean", "reward_std", "length_mean",
                         "truncated_fraction", "repetition_rate", "longest_run_fraction",
                         "token_entropy", "kl_k1", "kl_k3"}


def test_step_diagnostics_without_optional_inputs_has_only_rollout_metrics():
  rng = np.random.default_rng(8)
  x = _step_inputs(rng)
  out = diagnostics.step_diagnostics(rewards_B=x["rewards_B"], group_size=4, mask_BxL=x["mask_BxL"])
  assert not {"repetition_rate", "token_entropy", "kl_k3"} & set(out)
