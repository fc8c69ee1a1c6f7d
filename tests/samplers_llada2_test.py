"""LLaDA2.0's sampler (`rollouts.LLaDA2Sampling`) against a float64 NumPy loop of the released
`generate` (modeling_llada2_moe.py), one prompt at a time, recomputing the prefix every step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax import decoding, models, rollouts, samplers
from tests.models_llada2_test import _randomise, reference_logits
from tests.samplers_test import left_pad

BS, GEN = 4, 8


def np_generate(model, prompt, key, *, steps, minimal_topk=1, threshold=0.0, temperature=0.0,
                top_k=0, top_p=1.0, eos=None):
  """The released routine for one prompt (threshold 0: off). Draws: `decoding.uniforms` of row 0
  at step `blk * steps + s` (the samplers' contract), used as Gumbel noise."""
  mask = model.config.mask_token_id
  steps = min(steps, GEN // minimal_topk)
  p = len(prompt)
  blocks = -(-(p + GEN) // BS)
  x = np.full(blocks * BS, mask)
  x[:p] = prompt
  schedule = [BS // steps + (i < BS % steps) for i in range(steps)]
  for blk in range(p // BS, blocks):
    end = (blk + 1) * BS
    pos = np.arange(end)
    allowed = (pos[None, :] // BS) <= (pos[:, None] // BS)
    for s in range(steps):
      active = x[end - BS:end] == mask
      if not active.any():
        break
      logits = reference_logits(model, x[None, :end], allowed)[0, -BS:]
      u = np.asarray(decoding.uniforms(decoding.row_keys(key, 1), blk * steps + s,
                                       (1, BS, logits.shape[-1]))[0][0], np.float64)
      if temperature == 0 and not top_k and top_p >= 1:
        x0 = logits.argmax(-1)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
      else:
        logits = logits / (temperature or 1.0)
        if top_k:
          kth = np.sort(logits, -1)[:, -top_k][:, None]
          logits = np.where(logits < kth, -np.inf, logits)
        if top_p < 1:
          for r in range(BS):
            order = np.argsort(-logits[r], kind="stable")
            pr = np.exp(logits[r][order] - logits[r][order[0]])
            cum = np.cumsum(pr / pr.sum())
            drop = np.concatenate([[False], cum[:-1] > top_p])
            logits[r, order[drop]] = -np.inf
        x0 = np.argmax(logits - np.log(-np.log(u)), -1)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      conf = np.where(active, probs[np.arange(BS), x0], -np.inf)
      high = conf > threshold if threshold > 0 else np.zeros(BS, bool)
      if high.sum() >= schedule[s] and threshold > 0:
        transfer = high
      else:
        transfer = np.zeros(BS, bool)
        transfer[np.argsort(-conf, kind="stable")[:min(schedule[s], active.sum())]] = True
      x[end - BS:end] = np.where(transfer, x0, x[end - BS:end])
    if eos is not None and (x[p:end] == eos).any():
      break
  out = x[p:p + GEN]
  stops = np.flatnonzero(out == eos) if eos is not None else []
  return out[:stops[0] + 1] if len(stops) else out


@pytest.fixture(scope="module")
def model():
  m = _randomise(models.create(models.llada2_tiny(), seed=11), seed=4)
  m.head.kernel.set_value(m.head.kernel[...] * 40)  # peaked: some tokens pass the threshold
  return m


def _run(model, prompts, key, **kw):
  ids, valid = left_pad(prompts)
  sampling = rollouts.LLaDA2Sampling(
      gen_length=GEN, block_length=BS, steps=kw.pop("steps"), minimal_topk=kw.pop("minimal_topk", 1),
      threshold=kw.pop("threshold", 0.0), temperature=kw.pop("temperature", 0.0),
      top_k=kw.pop("top_k", 0), top_p=kw.pop("top_p", 1.0), chunk=0,
      stop_ids=kw.pop("stop_ids", (999,)),
      pad_id=0, **kw)
  r = samplers.generate(model, ids, valid, key, sampling)
  return [np.asarray(r.completion_BxC[i][:int(r.lengths_B[i])]) for i in range(len(prompts))]


PROMPTS = [[5, 9, 17, 3, 44, 2], [8, 30, 12]]  # a partial prompt block; the last block has a tail


def test_greedy_batched_left_padded_matches_the_released_loop(model):
  key = jax.random.key(0)
  free = np_generate(model, np.asarray(PROMPTS[0]), key, steps=4, threshold=0.5)
  eos = int(free[4])  # a token of row 0's second generated block ends it there
  got = _run(model, PROMPTS, key, steps=4, threshold=0.5, stop_ids=(eos,))
  for prompt, row in zip(PROMPTS, got):
    want = np_generate(model, np.asarray(prompt), key, steps=4, threshold=0.5, eos=eos)
    np.testing.assert_array_equal(row, want)
  assert len(got[0]) <= 5


def test_sampling_matches_the_released_loop(model):
  kw = dict(steps=8, minimal_topk=4, temperature=0.8, top_k=20, top_p=0.9)  # steps capped at 2
  key = jax.random.key(3)
  got = _run(model, PROMPTS[:1], key, use_cache=False, **dict(kw))
  want = np_generate(model, np.asarray(PROMPTS[0]), key, **kw)
  np.testing.assert_array_equal(got[0], want)


def test_temperature_zero_with_a_filter_draws_at_temperature_one():
  """The released choice samples whenever top-k or top-p is set, dividing by the temperature
  only when it is > 0."""
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, 16)) * 3, jnp.float32)
  u = jax.random.uniform(jax.random.key(1), (1, 3, 16), minval=1e-6)
  x0, conf = decoding.llada2_choose(logits, u, 0.0, 5, 1.0)
  kth = np.sort(np.asarray(logits), -1)[..., -5][..., None]
  filtered = np.where(np.asarray(logits) < kth, -np.inf, np.asarray(logits, np.float64))
  want = np.argmax(filtered - np.log(-np.log(np.asarray(u, np.float64))), -1)
  np.testing.assert_array_equal(np.asarray(x0), want)
  p = np.exp(filtered - filtered.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(conf), np.take_along_axis(p, want[..., None], -1)[..., 0],
                             rtol=1e-5)
  greedy, _ = decoding.llada2_choose(logits, u, 0.0, 0, 1.0)
  np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1))


def test_bad_sampler_settings_name_the_key():
  with pytest.raises(ValueError, match="minimal_topk=9"):
    rollouts.LLaDA2Sampling(gen_length=8, block_length=4, steps=4, minimal_topk=9, threshold=0.0,
                            temperature=0.0, top_k=0, top_p=1.0, chunk=0)
