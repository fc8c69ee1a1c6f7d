"""Tests for stabledrl_jax.rl on a real (tiny, briefly trained) model: the adversarial mode."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import likelihood, losses, models, objectives, rl, rollouts, sft

V, PROMPT, N = 24, 2, 10


def _counting_batch(rng, b):
  """Completions count up from a random start: a token is easy given its neighbours and
  unpredictable alone, so "easy" and "hard" masks give very different ELBOs."""
  start = rng.integers(4, V, size=(b, 1))
  completion_tokens = 4 + (start - 4 + np.arange(N)[None]) % (V - 4)
  tokens = np.concatenate([rng.integers(4, V, size=(b, PROMPT)), completion_tokens], 1)
  t = PROMPT + N
  completion = np.broadcast_to(np.arange(t) >= PROMPT, (b, t))
  return rollouts.Sequences(jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.arange(t), (b, t)),
                              jnp.ones((b, t), bool), jnp.asarray(~completion),
                              jnp.asarray(completion), jnp.asarray(completion))


@pytest.fixture(scope="module")
def counting_model():
  model = models.create(models.tiny(vocab_size=V, mask_token_id=3, eos_token_id=2, pad_token_id=0,
                                    stop_token_ids=(2,)), seed=0)
  opt = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, seqs, key):
    loss_fn = lambda m: sft.sft_loss(m, seqs, key, scheme="random_t", staircase=False, block_size=N)[0]
    opt.update(model, nnx.grad(loss_fn)(model))

  rng = np.random.default_rng(0)
  for i in range(200):
    step(model, opt, _counting_batch(rng, 32), jax.random.key(i))
  return model


@pytest.mark.slow
def test_adversarial_mode_stabledrl_stays_in_the_convex_hull_bound_grpo_explodes(counting_model,
                                                                                 objective):
  model = counting_model
  seqs = _counting_batch(np.random.default_rng(1), 8)
  adv = jnp.array([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.3, 0.3])
  obj = objective(name="stabledrl", group_size=4, scheme="block_random", num_samples=1,
                  block_size=N, staircase=False, adversarial=1.0)
  batch, _ = rl.behaviour_pass(model, None, seqs, adv, jax.random.key(5), obj)

  def grad_norm(loss_fn):
    return float(optax.tree.norm(nnx.grad(loss_fn)(model)))

  (_, metrics), grads = nnx.value_and_grad(
      lambda m: objectives.policy_loss(m, batch, jax.random.key(0), obj), has_aux=True)(model)
  assert float(metrics["log10_ratio_max"]) >= 8.0  # the mode did drive ρ to 1e8 and beyond

  # Convex-hull bound max_j |A_j| ‖∇L_j‖, each L_j's gradient taken on its own.
  easy = batch.adversarial

  def elbo_j(m, j):
    lp = likelihood.masked_logp(m, seqs, easy.noised_BxMxL, staircase=obj.staircase,
                                block_size=obj.block_size)
    return losses.mc_elbo(lp, easy.weight_BxMxL)[j]

  per_sample = [grad_norm(lambda m, j=j: elbo_j(m, j)) for j in range(8)]
  bound = float(jnp.max(jnp.abs(adv))) * max(per_sample)
  stable = float(optax.tree.norm(grads))
  assert 0 < stable <= bound * (1 + 1e-5)

  # GRPO-style: the same estimated sequence ratio under PPO's conditional clip.
  def grpo(m):
    lp = likelihood.masked_logp(m, seqs, easy.noised_BxMxL, staircase=obj.staircase,
                                block_size=obj.block_size)
    elbo_new = losses.mc_elbo(lp, easy.weight_BxMxL)
    elbo_old = losses.mc_elbo(batch.logp_old_BxMxL, batch.weight_old_BxMxL)
    return losses.grpo_clip_loss(elbo_new - elbo_old, adv, epsilon=0.2)[0]

  assert grad_norm(grpo) > 1e4 * bound
  # Plain importance weights (the SPG surrogate weighted by ρ/G) explode as well.
  plain = objectives.Objective(**{**obj.__dict__, "name": "spg_is"})
  norm = grad_norm(lambda m: objectives.policy_loss(m, batch, jax.random.key(0), plain)[0])
  assert norm > 1e4 * bound


def test_adversarial_rows_use_hard_old_and_easy_new_masks(counting_model, objective):
  seqs = _counting_batch(np.random.default_rng(2), 8)
  obj = objective(name="stabledrl", group_size=4, scheme="block_random", num_samples=2,
                  block_size=N, staircase=False, adversarial=0.5)
  batch, entropy = rl.behaviour_pass(counting_model, None, seqs, jnp.zeros(8),
                                        jax.random.key(3), obj)
  rows = np.asarray(batch.adversarial.rows_B)
  assert 0 < rows.sum() < 8
  completion = np.asarray(seqs.completion_BxL)
  for b in range(8):  # hard: all masked, each token weighted 1 (block_random would give 1/10)
    hard = (np.all(np.asarray(batch.noised_old_BxMxL[b]) == completion[b])
            and np.all(np.asarray(batch.weight_old_BxMxL[b]) == completion[b]))
    assert hard == rows[b]
  assert 0 < float(entropy) < np.log(V)
  plain = objectives.Objective(**{**obj.__dict__, "adversarial": 0.0})
  assert rl.behaviour_pass(counting_model, None, seqs, jnp.zeros(8), jax.random.key(3),
                              plain)[0].adversarial is None


def test_the_masking_level_range_reaches_the_masks(objective):
  """rl.min_mask_prob = 0.2 with complementary pairs: every level lies in [0.2, 0.8], read back
  from the weights (1 / (p n) on a pair's first mask, n the completion length)."""
  seqs = _counting_batch(np.random.default_rng(4), 4)
  obj = objective("llada", {"rl.scheme": "complementary", "rl.min_mask_prob": 0.2,
                            "rl.num_samples": 4})
  masks = objectives._draw_masks(jax.random.key(0), seqs, obj)
  n = np.asarray(seqs.completion_BxL).sum(-1)[:, None]
  w = np.asarray(masks.weight_BxMxL)
  first = np.asarray(masks.noised_BxMxL)[:, 0::2] & np.asarray(seqs.counted_BxL)[:, None]
  p = 1.0 / (w[:, 0::2] * n[..., None])[first]
  assert p.size and (p >= 0.2 - 1e-6).all() and (p <= 0.8 + 1e-6).all()
