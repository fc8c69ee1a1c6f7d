"""Decoding steps against their definitions, restated here."""
import jax.numpy as jnp
import numpy as np

from stabledrl_jax import decoding
from tests.samplers_test import schedule


def test_commit_schedule_matches_formula():
  n = jnp.array([0, 1, 7, 32, 33])
  got = np.asarray(decoding.commit_schedule(n, 4))
  np.testing.assert_array_equal(got, [schedule(int(v), 4) for v in n])
  assert (got.sum(1) == np.asarray(n)).all()


def test_filter_logits_top_p_keeps_smallest_prefix_reaching_mass():
  logits = jnp.log(jnp.array([[[0.5, 0.3, 0.15, 0.05]]]))
  kept = np.isfinite(np.asarray(decoding.filter_logits(logits, top_p=0.7)))[0, 0]
  np.testing.assert_array_equal(kept, [True, True, False, False])
  kept = np.isfinite(np.asarray(decoding.filter_logits(logits, top_k=3)))[0, 0]
  np.testing.assert_array_equal(kept, [True, True, True, False])


def test_confident_commit_is_top_k_plus_threshold():
  conf = jnp.asarray([[0.1, 0.5, 0.3, 0.9], [0.2, 0.2, 0.2, 0.2]])
  ok = jnp.asarray([[True, True, True, False], [True, True, True, True]])
  got = decoding.confident_commit(conf, ok, jnp.asarray([1, 1]), 0.3)
  np.testing.assert_array_equal(got, [[False, True, True, False], [True, False, False, False]])
  strict = decoding.confident_commit(conf, ok, jnp.asarray([1, 0]), 0.3, strict=True)
  np.testing.assert_array_equal(strict, [[False, True, False, False], [False] * 4])
  np.testing.assert_array_equal(decoding.min_commits(jnp.asarray([5, 3, 1, 0]), 2), [3, 2, 1, 0])
