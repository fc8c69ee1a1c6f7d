"""Tests for stabledrl_jax.likelihood: the chunked head against plain full logits."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stabledrl_jax import diagnostics, estimators, likelihood, models


def test_chunked_head_matches_full_logits_values_and_gradients(monkeypatch):
  cfg = models.tiny(vocab_size=96)
  model = models.create(cfg, seed=0)
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(3, 37, cfg.d_model)), jnp.float32)
  tgt = jnp.asarray(rng.integers(0, 96, size=(3, 37)), jnp.int32)

  def reference(m, h):
    logits = m.head_logits(h)
    return estimators.token_logp(logits, tgt), diagnostics.token_entropies(logits)

  want_lp, want_ent = reference(model, h)
  want_grad = nnx.grad(lambda m: jnp.sum(reference(m, h)[0] ** 2))(model)
  # 5 positions per chunk: 8 chunks, the last one padded.
  monkeypatch.setattr(likelihood, "_CHUNK_ELEMENTS", 5 * 96)
  lp, ent = likelihood.head_logp(model, h, tgt, with_entropy=True)
  np.testing.assert_allclose(lp, want_lp, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ent, want_ent, rtol=1e-5, atol=1e-6)
  grad = nnx.grad(lambda m: jnp.sum(likelihood.head_logp(m, h, tgt) ** 2))(model)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
               nnx.to_pure_dict(nnx.state(grad)), nnx.to_pure_dict(nnx.state(want_grad)))
