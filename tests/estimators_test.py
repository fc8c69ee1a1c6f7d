"""Tests for stabledrl_jax.estimators: unbiasedness, mask structure, coupling, transformations."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax import estimators, losses

MASK_ID = 99


def _rows(lengths, total, prompt_len):
  """Completion region after `prompt_len` prompt tokens; `lengths` counted tokens per row."""
  b = len(lengths)
  pos = np.arange(total)[None, :]
  completion = np.broadcast_to(pos >= prompt_len, (b, total))
  counted = completion & (pos < prompt_len + np.asarray(lengths)[:, None])
  prompt = np.broadcast_to(pos < prompt_len, (b, total))
  return jnp.asarray(completion), jnp.asarray(counted), jnp.asarray(prompt)


@pytest.mark.parametrize("scheme,normalised", [("random_t", True), ("stratified_l", False), ("block_t", True)])
def test_estimates_average_to_exact_log_likelihood_of_a_context_free_model(scheme, normalised):
  # A context-free toy: position i has a fixed log-prob, whatever is masked elsewhere.
  rng = np.random.default_rng(0)
  lengths = [24, 9, 17]
  completion, counted, _ = _rows(lengths, total=30, prompt_len=4)
  logp_BxL = jnp.asarray(-rng.uniform(0.1, 4.0, size=(3, 30)), jnp.float32)
  n_draws, m = 4000, 4
  sample = jax.jit(lambda k: estimators.sample_masks(k, completion, counted_BxL=counted, scheme=scheme,
                                                     num_samples=m, block_size=8))
  keys = jax.random.split(jax.random.key(1), n_draws)
  est = jax.vmap(lambda k: losses.mc_elbo(jnp.broadcast_to(logp_BxL[:, None], (3, m, 30)),
                                          sample(k).weight_BxMxL))(keys)
  est = np.asarray(est)  # [draws, B]
  exact = np.asarray(jnp.sum(jnp.where(counted, logp_BxL, 0.0), -1))
  if normalised:
    exact = exact / np.asarray(lengths)
  stderr = est.std(0) / np.sqrt(n_draws)
  assert np.all(np.abs(est.mean(0) - exact) < 4 * stderr + 1e-6), (est.mean(0), exact, stderr)
  # The check has teeth: MC error is small next to the quantity itself.
  assert np.all(stderr < 0.02 * np.abs(exact))


def test_stratified_l_masks_exactly_l_and_spreads_l_over_strata():
  completion, counted, _ = _rows([20, 20], total=24, prompt_len=4)
  s = estimators.sample_masks(jax.random.key(3), completion, scheme="stratified_l", num_samples=4)
  n_masked = np.asarray(s.noised_BxMxL.sum(-1))  # [B, M]
  assert n_masked.min() >= 1 and n_masked.max() <= 20
  # One per stratum: sample m masks l in ((m)·R/M, (m+1)·R/M].
  for row in n_masked:
    for mi, l in enumerate(row):
      assert mi * 5 < l <= (mi + 1) * 5
  w = np.asarray(s.weight_BxMxL)
  np.testing.assert_allclose(w[np.asarray(s.noised_BxMxL)], np.repeat(20 / n_masked.reshape(-1), n_masked.reshape(-1)))


def test_block_random_structure():
  bs = 4
  lengths = [10, 16, 3]
  completion, counted, prompt = _rows(lengths, total=20, prompt_len=4)
  s = estimators.sample_masks(jax.random.key(5), completion, counted_BxL=counted, scheme="block_random",
                              num_samples=64, block_size=bs)
  noised = np.asarray(s.noised_BxMxL)
  w = np.asarray(s.weight_BxMxL)
  for b, n in enumerate(lengths):
    live_blocks = -(-n // bs)
    seen_blocks = set()
    for m in range(64):
      comp = noised[b, m, 4:]
      blocks = comp.reshape(-1, bs)
      first = int(np.argmax(blocks.any(1)))
      seen_blocks.add(first)
      assert first < live_blocks
      assert not blocks[:first].any()                     # earlier blocks clean
      assert blocks[first + 1:].all()                     # later blocks fully masked
      in_block = np.asarray(counted)[b, 4:].reshape(-1, bs)[first]
      assert 1 <= (blocks[first] & in_block).sum() <= in_block.sum()  # k of its counted tokens
      assert blocks[first][~in_block].all()               # its post-EOS positions: masked
      assert not noised[b, m, :4].any()                   # no prompt masking asked for
      hit = comp & np.asarray(counted)[b, 4:]
      np.testing.assert_allclose(w[b, m, 4:][hit], 1.0 / hit.sum())  # per-token mean
      assert (w[b, m, 4:][~hit] == 0).all()
    assert seen_blocks == set(range(live_blocks))


def test_nothing_after_eos_and_no_prompt_token_is_ever_weighted():
  tokens = jnp.array([[5, 6, 7, 1, 2, 0, 3, 0], [5, 6, 1, 2, 3, 4, 5, 6]])
  completion = jnp.arange(8)[None, :] >= 2
  completion = jnp.broadcast_to(completion, (2, 8))
  counted = estimators.counted_until_eos(tokens, completion, eos_id=0)
  np.testing.assert_array_equal(counted, [[0, 0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(estimators.counted_until_eos(tokens, completion, eos_id=jnp.array([0, 2])),
                                [[0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0]])
  prompt = ~completion
  for scheme in estimators.SCHEMES:
    s = estimators.sample_masks(jax.random.key(0), completion, counted_BxL=counted, prompt_BxL=prompt,
                                p_mask_prompt=0.5, scheme=scheme, num_samples=8, block_size=2)
    w = np.asarray(s.weight_BxMxL)
    assert (w[~np.broadcast_to(np.asarray(counted)[:, None], w.shape)] == 0).all(), scheme
    assert (w >= 0).all() and w.sum() > 0, scheme


def test_prompt_masking_rate():
  completion, counted, prompt = _rows([8] * 4, total=264, prompt_len=256)
  s = estimators.sample_masks(jax.random.key(2), completion, prompt_BxL=prompt, p_mask_prompt=0.15,
                              scheme="mean_field", num_samples=8)
  rate = float(np.asarray(s.noised_BxMxL)[:, :, :256].mean())
  assert abs(rate - 0.15) < 0.01
  assert np.asarray(s.noised_BxMxL)[:, :, 256:].all()  # mean-field: whole completion masked


def _toy_context_model(params, noisy_BxMxL, targets_BxL):
  """Log-probs that depend on which tokens are visible (a bag-of-tokens context)."""
  emb = params["emb"][noisy_BxMxL]                       # [B, M, L, D]
  ctx = jnp.mean(emb, axis=2, keepdims=True)
  logits = (emb + ctx) @ params["out"]                   # [B, M, L, V]
  return estimators.token_logp(logits, jnp.broadcast_to(targets_BxL[:, None], noisy_BxMxL.shape))


@pytest.mark.parametrize("scheme", estimators.SCHEMES)
def test_coupled_masks_give_exactly_zero_log_ratio_at_equal_parameters(scheme):
  rng = np.random.default_rng(0)
  params = {"emb": jnp.asarray(rng.normal(size=(100, 8)), jnp.float32),
            "out": jnp.asarray(rng.normal(size=(8, 100)), jnp.float32)}
  tokens = jnp.asarray(rng.integers(0, 90, size=(4, 52)))
  completion, counted, prompt = _rows([30, 12, 36, 20], total=52, prompt_len=16)
  kw = dict(scheme=scheme, num_samples=2, counted_BxL=counted, prompt_BxL=prompt, p_mask_prompt=0.15,
            block_size=8)
  ratios = {}
  for coupling in ("coupled", "independent"):
    new, old = estimators.sample_old_new_masks(jax.random.key(7), completion, coupling=coupling, **kw)
    lp_new = _toy_context_model(params, estimators.apply_masks(tokens, new.noised_BxMxL, MASK_ID), tokens)
    lp_old = _toy_context_model(params, estimators.apply_masks(tokens, old.noised_BxMxL, MASK_ID), tokens)
    weight_old = None if coupling == "coupled" else old.weight_BxMxL
    ratios[coupling], _ = losses.elbo_ratio(lp_new, new.weight_BxMxL, lp_old, weight_old)
  np.testing.assert_array_equal(ratios["coupled"], np.zeros(4))
  assert np.all(np.abs(np.asarray(ratios["independent"])) > 1e-4)


def test_token_logp_matches_numpy():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 3, 5)) * 3
  tgt = rng.integers(0, 5, size=(2, 3))
  ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.take_along_axis(ref, tgt[..., None], -1)[..., 0]
  np.testing.assert_allclose(estimators.token_logp(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32), jnp.asarray(tgt)),
                             np.take_along_axis(ref, tgt[..., None], -1)[..., 0], rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(estimators.token_logp(jnp.asarray(logits), jnp.asarray(tgt)), want, rtol=1e-5)


def test_apply_masks():
  tokens = jnp.array([[1, 2, 3]])
  noised = jnp.array([[[True, False, True], [False, False, False]]])
  np.testing.assert_array_equal(estimators.apply_masks(tokens, noised, MASK_ID), [[[MASK_ID, 2, MASK_ID], [1, 2, 3]]])


def test_bad_arguments_name_the_value():
  c = jnp.ones((2, 4), bool)
  with pytest.raises(ValueError, match="bogus"):
    estimators.sample_masks(jax.random.key(0), c, scheme="bogus", num_samples=1)
  with pytest.raises(ValueError, match="num_samples"):
    estimators.sample_masks(jax.random.key(0), c, scheme="random_t", num_samples=0)
  with pytest.raises(ValueError, match="sideways"):
    estimators.sample_old_new_masks(jax.random.key(0), c, coupling="sideways", scheme="random_t", num_samples=1)


@pytest.mark.parametrize("scheme", estimators.SCHEMES)
def test_estimators_jit_vmap_and_sharded_batch(scheme):
  completion, counted, prompt = _rows([16, 5, 12, 16, 1, 9, 16, 3], total=20, prompt_len=4)
  f = lambda k, c, n, p: estimators.sample_masks(k, c, counted_BxL=n, prompt_BxL=p, p_mask_prompt=0.1,
                                                 scheme=scheme, num_samples=2, block_size=4)
  key = jax.random.key(11)
  eager = f(key, completion, counted, prompt)
  jitted = jax.jit(f)(key, completion, counted, prompt)
  np.testing.assert_array_equal(eager.noised_BxMxL, jitted.noised_BxMxL)
  np.testing.assert_allclose(eager.weight_BxMxL, jitted.weight_BxMxL, rtol=1e-6)
  many = jax.vmap(f, in_axes=(0, None, None, None))(jax.random.split(key, 3), completion, counted, prompt)
  assert many.weight_BxMxL.shape == (3, 8, 2, 20)
  mesh = jax.make_mesh((8,), ("data",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sharded = jax.jit(f)(key, *(jax.device_put(x, rows) for x in (completion, counted, prompt)))
  np.testing.assert_array_equal(sharded.noised_BxMxL, eager.noised_BxMxL)


def test_adversarial_masks_easy_at_the_end_hard_everywhere():
  lengths = [8, 3, 20]
  completion, counted, _ = _rows(lengths, total=26, prompt_len=4)
  rows, easy, hard = estimators.adversarial_masks(jax.random.key(0), completion, counted,
                                                  num_samples=2, fraction=0.7, easy_fraction=0.1)
  assert easy.noised_BxMxL.shape == hard.weight_BxMxL.shape == (3, 2, 26)
  for b, n in enumerate(lengths):
    k = max(1, int(np.ceil(0.1 * n)))
    want_easy = np.zeros(26, bool)
    want_easy[4 + n - k:4 + n] = True  # the last k counted tokens
    for m in range(2):
      np.testing.assert_array_equal(easy.noised_BxMxL[b, m], want_easy)
      np.testing.assert_allclose(easy.weight_BxMxL[b, m], np.where(want_easy, n / k, 0.0))
      np.testing.assert_array_equal(hard.noised_BxMxL[b, m], np.asarray(completion[b]))
      np.testing.assert_allclose(hard.weight_BxMxL[b, m], np.asarray(counted[b], np.float32))
  # The chosen rows are a Bernoulli(fraction) draw.
  many = estimators.adversarial_masks(jax.random.key(1), jnp.ones((4000, 4), bool),
                                      num_samples=1, fraction=0.7)[0]
  assert abs(float(jnp.mean(many)) - 0.7) < 0.03
  with pytest.raises(ValueError, match="fraction"):
    estimators.adversarial_masks(jax.random.key(0), completion, counted, num_samples=1, fraction=1.5)


def _block_random_weights_by_definition(noised_BxMxL, counted_BxL):
  """The block-random ELBO weight, token by token: 1/n on each of the n masked counted tokens of a
  sample (whatever masked them: the chosen block, a later block or the `p_mask_prompt` noise)."""
  noised, counted = np.asarray(noised_BxMxL), np.asarray(counted_BxL)
  b, m, l = noised.shape
  want = np.zeros((b, m, l))
  for i in range(b):
    for j in range(m):
      hits = [t for t in range(l) if noised[i, j, t] and counted[i, t]]
      for t in hits:
        want[i, j, t] = 1.0 / len(hits)
  return want


def test_block_random_weighs_every_masked_counted_token_including_noised_earlier_blocks():
  # The smallest case: all of the completion counted, every earlier-block token noised.
  s = estimators.sample_masks(jax.random.key(0), jnp.ones((1, 8), bool), scheme="block_random",
                              num_samples=1, block_size=2, p_mask_prompt=1.0)
  noised = np.asarray(s.noised_BxMxL)
  np.testing.assert_allclose(s.weight_BxMxL, noised / noised.sum())
  # Random rows, prompts and lengths, the official noise rate.
  completion, counted, prompt = _rows([16, 5, 12, 9], total=24, prompt_len=4)
  for seed in range(3):
    s = estimators.sample_masks(jax.random.key(seed), completion, counted_BxL=counted,
                                prompt_BxL=prompt, scheme="block_random", num_samples=4,
                                block_size=4, p_mask_prompt=0.5)
    np.testing.assert_allclose(s.weight_BxMxL,
                               _block_random_weights_by_definition(s.noised_BxMxL, counted),
                               rtol=1e-6)


def _chosen_blocks(n_rows, n_live, *, n_blocks=8, bs=2, num_samples=2, seed=0):
  """The block each `block_random` sample chose, read off its mask: the first noised block."""
  completion, counted, _ = _rows([n_live * bs - 1] * n_rows, total=n_blocks * bs, prompt_len=0)
  s = estimators.sample_masks(jax.random.key(seed), completion, counted_BxL=counted,
                              scheme="block_random", num_samples=num_samples, block_size=bs)
  noised = np.asarray(s.noised_BxMxL).reshape(n_rows, num_samples, n_blocks, bs)
  return noised.any(-1).argmax(-1)  # [rows, M]


def test_block_random_chooses_blocks_as_the_official_permutation_modulo_live_blocks():
  # Exact law, by enumeration: the two samples take two distinct entries (i, i') of a uniform
  # permutation of the 8 blocks, each reduced modulo the number of live blocks.
  n_rows = 20000
  for n_live in (3, 8):
    pairs = [(i % n_live, k % n_live) for i in range(8) for k in range(8) if i != k]
    joint = np.zeros((n_live, n_live))
    for a, c in pairs:
      joint[a, c] += 1 / len(pairs)
    chosen = _chosen_blocks(n_rows, n_live)
    got = np.zeros((n_live, n_live))
    np.add.at(got, (chosen[:, 0], chosen[:, 1]), 1 / n_rows)
    tol = 4 * np.sqrt(joint * (1 - joint) / n_rows) + 1e-12
    assert np.all(np.abs(got - joint) <= tol), (n_live, got, joint)
    for m in range(2):
      marginal = np.bincount(chosen[:, m], minlength=n_live) / n_rows
      np.testing.assert_allclose(marginal, joint.sum(1), atol=4 * np.sqrt(0.25 / n_rows))
    if n_live == 3:
      np.testing.assert_allclose(joint.sum(1), [.375, .375, .25])  # the law, not uniform
  assert not np.any(chosen[:, 0] == chosen[:, 1])  # 8 live of 8: never the same block
