"""Tests for the `complementary` mask scheme of stabledrl_jax.estimators: the pair structure, the
ELBO it estimates (against exact expectations computed here in NumPy by enumerating every mask),
its variance against random_t's, and the usual transformations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.polynomial import Polynomial

from stabledrl_jax import estimators

PROMPT = 2


def _rows(lengths, completion_len):
  """`[B, PROMPT + completion_len]`: PROMPT prompt slots, then the completion; row b counts its
  first lengths[b] completion tokens (the rest is post-EOS padding)."""
  pos = np.arange(PROMPT + completion_len)[None, :]
  b = len(lengths)
  completion = np.broadcast_to(pos >= PROMPT, (b, pos.shape[1]))
  counted = completion & (pos < PROMPT + np.asarray(lengths)[:, None])
  return jnp.asarray(completion), jnp.asarray(counted), jnp.asarray(~completion)


def _draws(n_draws, completion, counted, *, scheme, num_samples, min_mask_prob, seed=0, **kw):
  """`n_draws` independent `sample_masks` calls: (noised, weight) as NumPy `[draws, B, M, L]`."""
  f = jax.jit(jax.vmap(lambda k: estimators.sample_masks(
      k, completion, counted_BxL=counted, scheme=scheme, num_samples=num_samples,
      min_mask_prob=min_mask_prob, **kw)))
  s = f(jax.random.split(jax.random.key(seed), n_draws))
  return np.asarray(s.noised_BxMxL), np.asarray(s.weight_BxMxL, np.float64)


def _level_integral(k: int, c: int, lo: float, hi: float) -> float:
  """∫_lo^hi s^(k-1) (1-s)^(c-k) ds, exactly (a polynomial), for k >= 1."""
  poly = Polynomial([0, 1]) ** (k - 1) * Polynomial([1, -1]) ** (c - k)
  anti = poly.integ()
  return float(anti(hi) - anti(lo))


def _exact_elbo(logp_BxSxC, counted_BxC, lo, hi):
  """The ELBO over levels uniform on [lo, hi], per counted token, by enumeration:
  E_s[(1/s) Σ_{i masked, counted} log p(x_i | mask S)] / n, where a completion mask S (a bitmask
  over the C completion slots) has probability s^|S| (1-s)^(C-|S|) at level s."""
  b, n_patterns, c = logp_BxSxC.shape
  out = np.zeros(b)
  for row in range(b):
    n = counted_BxC[row].sum()
    for pattern in range(n_patterns):
      masked = np.array([(pattern >> i) & 1 for i in range(c)], bool)
      k = int(masked.sum())
      hit = masked & counted_BxC[row]
      if not hit.any():
        continue
      out[row] += logp_BxSxC[row, pattern, hit].sum() * _level_integral(k, c, lo, hi) / n
  return out / (hi - lo)


def test_every_completion_token_is_masked_exactly_once_per_pair():
  completion, counted, prompt = _rows([6, 3, 0, 9], completion_len=9)
  s = estimators.sample_masks(jax.random.key(0), completion, counted_BxL=counted, prompt_BxL=prompt,
                              p_mask_prompt=0.3, scheme="complementary", num_samples=8)
  noised = np.asarray(s.noised_BxMxL).reshape(4, 4, 2, PROMPT + 9)  # [B, pairs, 2, L]
  w = np.asarray(s.weight_BxMxL, np.float64).reshape(noised.shape)
  comp = np.asarray(completion)
  times = noised.sum(2)  # how many samples of the pair mask each position
  assert (times[:, :, comp[0]] == 1).all()
  # The prompt is noised on its own, like the other schemes' (never weighted).
  assert noised[:, :, :, ~comp[0]].any() and (w[:, :, :, ~comp[0]] == 0).all()
  cnt = np.broadcast_to(np.asarray(counted)[:, None, None, :], w.shape)
  assert ((w > 0) == (noised & cnt)).all()
  # Weight 1/(level·n), one level per sample: the pair's levels add up to 1, in [ε, 1 - ε].
  n = np.asarray(counted).sum(-1)
  for row in (0, 1, 3):
    for pair in range(4):
      levels = []
      for x in (w[row, pair, 0], w[row, pair, 1]):
        if (x > 0).any():
          assert np.ptp(x[x > 0]) <= 1e-5 * x.max()
          levels.append(1.0 / (x.max() * n[row]))
      assert levels and all(1e-3 - 1e-6 <= lv <= 1 - 1e-3 + 1e-6 for lv in levels)
      if len(levels) == 2:
        assert levels[0] + levels[1] == pytest.approx(1.0, abs=1e-5)
  assert (w[2] == 0).all()  # nothing counted, nothing weighted


@pytest.mark.parametrize("which", ["pairs", "first", "second"])
def test_unbiased_for_the_elbo_of_a_context_dependent_model(which):
  # A model whose log-probs depend on the whole completion mask: a random table over all 2^C masks.
  c, eps = 5, 0.2
  completion, counted, _ = _rows([4, 2, 5], completion_len=c)
  rng = np.random.default_rng(3)
  logp_BxSxC = -rng.gamma(2.0, 1.0, size=(3, 2**c, c))
  noised, w = _draws(60_000, completion, counted, scheme="complementary", num_samples=2,
                     min_mask_prob=eps)
  pattern = (noised[..., PROMPT:] * (2 ** np.arange(c))).sum(-1)  # [draws, B, M]
  lp = logp_BxSxC[np.arange(3)[None, :, None], pattern]           # [draws, B, M, C]
  terms = (w[..., PROMPT:] * lp).sum(-1)                          # [draws, B, M]
  est = {"pairs": terms.mean(-1), "first": terms[..., 0], "second": terms[..., 1]}[which]
  exact = _exact_elbo(logp_BxSxC, np.asarray(counted)[:, PROMPT:], eps, 1 - eps)
  stderr = est.std(0) / np.sqrt(est.shape[0])
  assert np.all(np.abs(est.mean(0) - exact) < 4 * stderr), (est.mean(0), exact, stderr)
  # Teeth: random_t's level range [ε, 1] gives a different ELBO, far outside the error bars.
  other = _exact_elbo(logp_BxSxC, np.asarray(counted)[:, PROMPT:], eps, 1.0)
  assert np.all(np.abs(other - exact) > 10 * stderr), (other, exact, stderr)


def test_unbiased_for_a_context_free_model_at_the_default_level_range():
  # Position i has a fixed log-prob whatever is masked: the ELBO is Σ_i log p_i / n exactly.
  completion, counted, _ = _rows([24, 9, 17], completion_len=28)
  logp_BxL = -np.random.default_rng(0).uniform(0.1, 4.0, size=(3, PROMPT + 28))
  _, w = _draws(8000, completion, counted, scheme="complementary", num_samples=4,
                min_mask_prob=1e-3)
  est = (w * logp_BxL[None, :, None, :]).sum(-1).mean(-1)
  exact = np.where(np.asarray(counted), logp_BxL, 0.0).sum(-1) / np.asarray(counted).sum(-1)
  stderr = est.std(0) / np.sqrt(est.shape[0])
  assert np.all(np.abs(est.mean(0) - exact) < 4 * stderr), (est.mean(0), exact, stderr)
  assert np.all(stderr < 0.03 * np.abs(exact))


def _variance_context_free(ell_L: np.ndarray, n: int, eps: float, m: int) -> tuple[float, float]:
  """Exact variances of the per-token-normalised estimate of Σ ℓ / n for a context-free model with
  M samples: (random_t, complementary), by numerical integration over the level. Given the
  level(s), tokens are independent with the same conditional mean, so the variance is the sum of
  per-token variances averaged over the levels."""
  s = np.linspace(0, 1, 2_000_001)[1:-1]
  q = (1 - eps) * s + eps                                  # random_t: U(ε, 1)
  per_token_rt = np.mean(1 / q - 1)                        # Var(Z/q) = (1 - q)/q, averaged
  p = eps + (1 - 2 * eps) * s                              # complementary: U(ε, 1 - ε)
  per_pair = np.mean(1 / p + 1 / (1 - p) - 4) / 4          # Var((Z/p + (1-Z)/(1-p)) / 2)
  sq = (ell_L**2).sum() / n**2
  return sq * per_token_rt / m, sq * per_pair / (m // 2)


@pytest.mark.parametrize("m", [2, 4])
def test_variance_below_random_t_at_equal_samples(m):
  eps = 0.05
  completion, counted, _ = _rows([16], completion_len=16)
  ell = -np.random.default_rng(1).uniform(0.5, 3.0, size=16)
  logp = np.concatenate([np.zeros(PROMPT), ell])
  want_rt, want_comp = _variance_context_free(ell, 16, eps, m)
  got = {}
  for scheme in ("random_t", "complementary"):
    _, w = _draws(40_000, completion, counted, scheme=scheme, num_samples=m, min_mask_prob=eps,
                  seed=m)
    got[scheme] = (w[:, 0] * logp).sum(-1).mean(-1).var()
  assert got["random_t"] == pytest.approx(want_rt, rel=0.1)
  assert got["complementary"] == pytest.approx(want_comp, rel=0.1)
  assert want_comp < 0.65 * want_rt
  assert got["complementary"] < 0.75 * got["random_t"]


def test_odd_num_samples_and_bad_level_range_are_refused():
  c = jnp.ones((2, 4), bool)
  for m in (1, 3):
    with pytest.raises(ValueError, match="num_samples"):
      estimators.sample_masks(jax.random.key(0), c, scheme="complementary", num_samples=m)
  with pytest.raises(ValueError, match="min_mask_prob"):
    estimators.sample_masks(jax.random.key(0), c, scheme="complementary", num_samples=2,
                            min_mask_prob=0.5)


def test_jit_vmap_and_determinism_per_key():
  completion, counted, prompt = _rows([16, 5, 12, 1], completion_len=16)
  f = lambda k: estimators.sample_masks(k, completion, counted_BxL=counted, prompt_BxL=prompt,
                                        p_mask_prompt=0.1, scheme="complementary", num_samples=4)
  key = jax.random.key(11)
  eager, again, jitted = f(key), f(key), jax.jit(f)(key)
  for other in (again, jitted):
    np.testing.assert_array_equal(eager.noised_BxMxL, other.noised_BxMxL)
    np.testing.assert_allclose(eager.weight_BxMxL, other.weight_BxMxL, rtol=1e-6)
  different = f(jax.random.key(12))
  assert not np.array_equal(eager.noised_BxMxL, different.noised_BxMxL)
  many = jax.vmap(f)(jax.random.split(key, 3))
  assert many.noised_BxMxL.shape == (3, 4, 4, PROMPT + 16)
  np.testing.assert_array_equal(many.noised_BxMxL[0], f(jax.random.split(key, 3)[0]).noised_BxMxL)


def test_coupled_shares_the_pairs_and_independent_draws_new_ones():
  completion, counted, _ = _rows([10, 7], completion_len=10)
  kw = dict(scheme="complementary", num_samples=2, counted_BxL=counted)
  new, old = estimators.sample_old_new_masks(jax.random.key(5), completion, coupling="coupled", **kw)
  np.testing.assert_array_equal(new.noised_BxMxL, old.noised_BxMxL)
  new, old = estimators.sample_old_new_masks(jax.random.key(5), completion, coupling="independent",
                                             **kw)
  assert not np.array_equal(new.noised_BxMxL, old.noised_BxMxL)
  for s in (new, old):  # each side keeps its pairs complementary
    assert (np.asarray(s.noised_BxMxL)[:, :, PROMPT:].sum(1) == 1).all()


def test_dream_elbo_through_the_model_is_exact_with_the_shift():
  """Dream end to end (complementary masks -> `likelihood.masked_logp` -> `losses.mc_elbo`)
  averages to the exact ELBO of a model whose prediction at slot i depends on slot i - 1 alone:
  attention and MLP outputs zeroed, so each slot's state is its own token's (normed) embedding,
  and Dream's shift hands it to the next slot. The exact value enumerates every completion mask,
  with log-probs written here from that definition (the predecessor's token, or the mask token
  when the predecessor is masked). Teeth: without the shift (each slot read from its own, masked,
  state) the ELBO is another number, far outside the error bars."""
  from flax import nnx

  from stabledrl_jax import likelihood, losses, models
  c, eps = 5, 0.2
  cfg = models.tiny(**models.family_options("dream"), n_kv_heads=2, n_layers=1)
  model = models.create(cfg, seed=0)
  for blk in model.blocks:
    blk.attn.o_proj.kernel[...] = jnp.zeros_like(blk.attn.o_proj.kernel[...])
    blk.down_proj.kernel[...] = jnp.zeros_like(blk.down_proj.kernel[...])
  model.head.kernel[...] = 4.0 * model.head.kernel[...]  # log-probs spread out
  completion, counted, prompt = _rows([4, 2, 5], completion_len=c)
  rng = np.random.default_rng(5)
  tokens = rng.integers(2, 120, size=(3, PROMPT + c))
  seqs = likelihood.Sequences(
      tokens_BxL=jnp.asarray(tokens), positions_BxL=jnp.broadcast_to(jnp.arange(PROMPT + c),
                                                                     tokens.shape),
      valid_BxL=jnp.ones(tokens.shape, bool), prompt_BxL=prompt, completion_BxL=completion,
      counted_BxL=counted)

  emb = np.asarray(model.embed.embedding[...], np.float64)
  state = emb / np.sqrt(np.mean(emb**2, -1, keepdims=True) + cfg.norm_eps)
  state = state * np.asarray(model.final_norm.scale[...], np.float64)
  logits = state @ np.asarray(model.head.kernel[...], np.float64)   # [previous token, V]
  lp_next = logits - logits.max(-1, keepdims=True)
  lp_next = lp_next - np.log(np.exp(lp_next).sum(-1, keepdims=True))

  def table(shifted):
    out = np.zeros((3, 2**c, c))
    for b in range(3):
      for pattern in range(2**c):
        masked = [(pattern >> i) & 1 for i in range(c)]
        for i in range(c):
          if shifted:
            before = tokens[b, PROMPT + i - 1]
            prev = cfg.mask_token_id if i > 0 and masked[i - 1] else before
          else:
            prev = cfg.mask_token_id
          out[b, pattern, i] = lp_next[prev, tokens[b, PROMPT + i]]
    return out

  cnt = np.asarray(counted)[:, PROMPT:]
  exact = _exact_elbo(table(True), cnt, eps, 1 - eps)
  unshifted = _exact_elbo(table(False), cnt, eps, 1 - eps)
  graphdef, params = nnx.split(model)

  @jax.jit
  def estimates(params, keys):  # weights as arguments: as jit constants, once gave NaN on CPU
    def one(key):
      s = estimators.sample_masks(key, completion, counted_BxL=counted, scheme="complementary",
                                  num_samples=2, min_mask_prob=eps)
      lp = likelihood.masked_logp(nnx.merge(graphdef, params), seqs, s.noised_BxMxL,
                                  staircase=False)
      return losses.mc_elbo(lp, s.weight_BxMxL)
    return jax.lax.map(jax.vmap(one), keys.reshape(-1, 1000))

  est = np.asarray(estimates(params, jax.random.split(jax.random.key(0), 20_000)),
                   np.float64).reshape(-1, 3)
  stderr = est.std(0) / np.sqrt(est.shape[0])
  assert np.all(np.abs(est.mean(0) - exact) < 4 * stderr), (est.mean(0), exact, stderr)
  assert np.all(np.abs(unshifted - exact) > 10 * stderr), (unshifted, exact, stderr)
