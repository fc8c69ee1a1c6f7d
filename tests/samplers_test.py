"""Samplers against slow reference loops written here from docs/method.md §5, one model call per step."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax import config_lib, models, rollouts, samplers

MASK = 127


@pytest.fixture(scope="module")
def llada_model():
  return models.create(models.tiny(**models.family_options("llada"), n_kv_heads=4), seed=3)


@pytest.fixture(scope="module")
def sdar_model():
  return models.create(models.tiny(), seed=4)


def left_pad(prompts, pad=0, width=None):
  """Left-padded ids and validity of `prompts`, `width` columns (default: the longest)."""
  p = width or max(len(x) for x in prompts)
  ids = np.full((len(prompts), p), pad, np.int32)
  valid = np.zeros((len(prompts), p), bool)
  for i, x in enumerate(prompts):
    ids[i, p - len(x):] = x
    valid[i, p - len(x):] = True
  return jnp.asarray(ids), jnp.asarray(valid)


def draws(key, step, shape):
  """The sampler's documented random-number contract, restated: row b's draws of step `step`,
  shaped like its block `shape[1:]`, from `fold_in(fold_in(key, b), step)`."""
  u = np.stack([jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, b), step),
                                   (2, *shape[1:]), jnp.float32, minval=np.finfo(np.float32).tiny,
                                   maxval=1.0) for b in range(shape[0])], axis=1)
  return u[0].astype(np.float64), u[1].astype(np.float64)


def np_softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def schedule(n, steps):
  return [n // steps + (1 if i < n % steps else 0) for i in range(steps)]


def top_k_commit(conf, eligible, k):
  order = np.argsort(np.where(eligible, -conf, np.inf), kind="stable")
  chosen = np.zeros_like(eligible)
  chosen[order[:k]] = True
  return chosen & eligible


def truncate(seq, stops):
  out = list(seq)
  for i, t in enumerate(out):
    if t in stops:
      return out[:i + 1], i + 1
  return out, len(out)


# ----------------------------------------------------------------------------- LLaDA


def llada_reference(model, ids, valid, key, *, gen_length, block_length, steps, temperature,
                    remasking, cfg_scale=0.0):
  b, p = ids.shape
  x = np.concatenate([np.asarray(ids), np.full((b, gen_length), MASK, np.int32)], 1)
  full_valid = np.concatenate([np.asarray(valid), np.ones((b, gen_length), bool)], 1)
  pos = np.maximum(np.cumsum(full_valid, 1) - 1, 0)
  prompt = np.concatenate([np.asarray(valid), np.zeros((b, gen_length), bool)], 1)
  n_blocks = gen_length // block_length
  spb = steps // n_blocks
  for blk in range(n_blocks):
    lo, hi = p + blk * block_length, p + (blk + 1) * block_length
    counts = [schedule(int((x[r, lo:hi] == MASK).sum()), spb) for r in range(b)]
    for i in range(spb):
      s = blk * spb + i
      logits = np.asarray(model.logits(jnp.asarray(x), attention="full", positions=jnp.asarray(pos),
                                       valid_BxL=jnp.asarray(full_valid)), np.float64)
      if cfg_scale > 0:
        un = np.where(prompt, MASK, x)
        ul = np.asarray(model.logits(jnp.asarray(un), attention="full", positions=jnp.asarray(pos),
                                     valid_BxL=jnp.asarray(full_valid)), np.float64)
        logits = ul + (cfg_scale + 1) * (logits - ul)
      lb = logits[:, lo:hi].copy()
      lb[..., MASK] = -np.inf  # the mask token is never a candidate
      u, u_conf = draws(key, s, lb.shape)
      noisy = np.exp(lb) / (-np.log(u)) ** temperature if temperature > 0 else lb
      x0 = noisy.argmax(-1)
      if remasking == "low_confidence":
        conf = np.take_along_axis(np_softmax(lb), x0[..., None], -1)[..., 0]
      else:
        conf = u_conf[..., 0]
      for r in range(b):
        commit = top_k_commit(conf[r], x[r, lo:hi] == MASK, counts[r][i])
        x[r, lo:hi] = np.where(commit, x0[r], x[r, lo:hi])
  return x[:, p:]


@pytest.mark.parametrize("temperature,remasking,cfg", [(0.0, "low_confidence", 0.0),
                                                        (0.9, "low_confidence", 0.0),
                                                        (0.7, "random", 0.0),
                                                        (0.0, "low_confidence", 1.5)])
def test_llada_matches_reference_loop(llada_model, llada_sampling, temperature, remasking, cfg):
  ids, valid = left_pad([[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]])
  kw = dict(gen_length=16, block_length=8, steps=8, temperature=temperature, remasking=remasking)
  key = jax.random.key(1)
  want = llada_reference(llada_model, ids, valid, key, cfg_scale=cfg, **kw)
  got = samplers.llada_generate(llada_model, ids, valid, key,
                                llada_sampling(cfg_scale=cfg, stop_ids=(1000,), **kw))
  np.testing.assert_array_equal(got.completion_BxC, want)
  assert not (np.asarray(got.completion_BxC) == MASK).any()


def test_llada_row_alone_equals_row_in_padded_batch(llada_model, llada_sampling):
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 3, 4], [13]]
  s = llada_sampling(gen_length=16, block_length=4, steps=8)
  batch = samplers.llada_generate(llada_model, *left_pad(prompts), jax.random.key(0), s)
  for i, pr in enumerate(prompts):
    alone = samplers.llada_generate(llada_model, *left_pad([pr]), jax.random.key(0), s)
    np.testing.assert_array_equal(alone.completion_BxC[0], batch.completion_BxC[i])


def test_llada_commit_counts_follow_schedule(llada_model, llada_sampling):
  ids, valid = left_pad([[5, 6, 7], [8, 9]])
  s = llada_sampling(gen_length=24, block_length=12, steps=10, temperature=0.5)
  r = samplers.llada_generate(llada_model, ids, valid, jax.random.key(2), s)
  when = np.asarray(r.commit_step_BxL)[:, ids.shape[1]:]
  want = schedule(12, 5) * 2  # 12 masks per block over 5 steps: 3, 3, 2, 2, 2
  assert want[:5] == [3, 3, 2, 2, 2]
  for row in when:
    np.testing.assert_array_equal([int((row == st).sum()) for st in range(10)], want)
    # Step st only commits inside block st // 5.
    for st in range(10):
      assert np.all(np.nonzero(row == st)[0] // 12 == st // 5)


def test_llada_stop_truncation(llada_model, llada_sampling):
  ids, valid = left_pad([[5, 6, 7], [8, 9, 10]])
  s = llada_sampling(gen_length=16, block_length=8, steps=8, stop_ids=(1000,))
  free = np.asarray(samplers.llada_generate(llada_model, ids, valid, jax.random.key(0), s).completion_BxC)
  stop = int(free[0, 5])  # a token this model really emits mid-completion
  r = samplers.llada_generate(llada_model, ids, valid, jax.random.key(0),
                              llada_sampling(gen_length=16, block_length=8, steps=8,
                                                     stop_ids=(stop,), pad_id=0))
  for row_free, row, n, mask in zip(free, np.asarray(r.completion_BxC), np.asarray(r.lengths_B),
                                    np.asarray(r.completion_mask_BxC)):
    kept, length = truncate(row_free, (stop,))
    assert n == length and mask.sum() == length
    np.testing.assert_array_equal(row[:length], kept)
    assert (row[length:] == 0).all()


def test_llada_bad_settings_name_the_value(llada_sampling):
  with pytest.raises(ValueError, match="block_length=5"):
    llada_sampling(gen_length=16, block_length=5)
  with pytest.raises(ValueError, match="steps=3"):
    llada_sampling(gen_length=16, block_length=4, steps=3)


# ----------------------------------------------------------------------------- SDAR


def sdar_reference_row(model, prompt, *, gen_length, steps, bs, stops, strategy="static",
                       threshold=0.9):
  """One row, no padding, no cache: every step recomputes the whole prefix block-causally."""
  x = list(prompt) + [MASK] * gen_length
  n = len(x)
  plen = len(prompt)
  for j in range(plen // bs, (n - 1) // bs + 1):
    lo, hi = j * bs, min((j + 1) * bs, n)
    counts = schedule(sum(t == MASK for t in x[lo:hi]), steps)
    for i in range(steps):
      masked = np.array([t == MASK for t in x[lo:hi]])
      if not masked.any():
        break
      logits = np.asarray(model.logits(jnp.asarray([x[:hi]]), attention="block_causal",
                                       block_size=bs), np.float64)[0, lo:hi]
      logits[..., MASK] = -np.inf
      x0 = logits.argmax(-1)
      conf = np.take_along_axis(np_softmax(logits), x0[:, None], -1)[:, 0]
      commit = top_k_commit(conf, masked, counts[i])
      if strategy == "dynamic":
        commit |= masked & (conf > threshold)
      x[lo:hi] = list(np.where(commit, x0, x[lo:hi]))
    if any(t in stops for t in x[max(lo, plen):hi]):
      break
  return truncate(x[plen:], stops)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic"])
def test_sdar_greedy_matches_reference_row_by_row_in_a_padded_batch(sdar_model, sdar_sampling,
                                                                    use_cache, strategy):
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21], [22]]
  bs = sdar_model.config.block_size
  threshold = 0.02 if strategy == "low_confidence_dynamic" else 0.0
  kw = dict(gen_length=14, steps=3, strategy=strategy, threshold=threshold, use_cache=use_cache)
  free = samplers.sdar_generate(sdar_model, *left_pad(prompts), jax.random.key(0),
                                sdar_sampling(stop_ids=(1000,), **kw))
  stop = int(np.asarray(free.completion_BxC)[1, 6])  # forces an early stop in some rows
  r = samplers.sdar_generate(sdar_model, *left_pad(prompts), jax.random.key(0),
                             sdar_sampling(stop_ids=(stop,), pad_id=0, **kw))
  stopped_early = 0
  for i, pr in enumerate(prompts):
    want, length = sdar_reference_row(sdar_model, pr, gen_length=14, steps=3, bs=bs, stops=(stop,),
                                      strategy=strategy.split("_")[-1], threshold=0.02)
    assert int(r.lengths_B[i]) == length
    np.testing.assert_array_equal(np.asarray(r.completion_BxC)[i, :length], want)
    assert (np.asarray(r.completion_BxC)[i, length:] == 0).all()
    stopped_early += length < 14
  assert stopped_early >= 1


def test_sdar_cache_and_recompute_agree_when_sampling(sdar_model, sdar_sampling):
  ids, valid = left_pad([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
  outs = []
  for use_cache in (True, False):
    s = sdar_sampling(gen_length=16, steps=4, temperature=1.0, top_k=50, top_p=0.9,
                              use_cache=use_cache, stop_ids=(1000,))
    outs.append(np.asarray(samplers.sdar_generate(sdar_model, ids, valid, jax.random.key(9), s).tokens_BxL))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_sdar_sampling_matches_reference_with_the_same_draws(sdar_model, sdar_sampling):
  ids, valid = left_pad([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
  key, temp, top_k, bs, steps = jax.random.key(5), 0.8, 20, 4, 2
  s = sdar_sampling(gen_length=11, steps=steps, temperature=temp, top_k=top_k, stop_ids=(1000,))
  got = np.asarray(samplers.sdar_generate(sdar_model, ids, valid, key, s).completion_BxC)
  x = np.concatenate([np.asarray(ids), np.full((2, 11), MASK)], 1)
  for j in range(5 // bs, (16 - 1) // bs + 1):
    lo, hi = j * bs, min((j + 1) * bs, 16)
    counts = [schedule(int((x[r, lo:hi] == MASK).sum()), steps) for r in range(2)]
    for i in range(steps):
      if not (x[:, lo:hi] == MASK).any():
        break
      logits = np.asarray(sdar_model.logits(jnp.asarray(x[:, :hi]), attention="block_causal",
                                            block_size=bs), np.float64)[:, lo:hi] / temp
      logits[..., MASK] = -np.inf
      kth = np.sort(logits, -1)[..., -top_k][..., None]
      logits = np.where(logits < kth, -np.inf, logits)
      u, _ = draws(key, j * steps + i, (2, bs, logits.shape[-1]))
      u = u[:, :hi - lo]
      x0 = (logits - np.log(-np.log(u))).argmax(-1)
      conf = np.take_along_axis(np_softmax(logits), x0[..., None], -1)[..., 0]
      for r in range(2):
        commit = top_k_commit(conf[r], x[r, lo:hi] == MASK, counts[r][i])
        x[r, lo:hi] = np.where(commit, x0[r], x[r, lo:hi])
  np.testing.assert_array_equal(got, x[:, 5:])


def test_sdar_commit_counts_follow_schedule(sdar_model, sdar_sampling):
  ids, valid = left_pad([[5, 6, 7, 8], [9, 10, 11, 12]])
  s = sdar_sampling(gen_length=12, steps=3, temperature=1.0, stop_ids=(1000,))
  r = samplers.sdar_generate(sdar_model, ids, valid, jax.random.key(2), s)
  when = np.asarray(r.commit_step_BxL)[:, 4:16]
  for row in when:  # blocks 1-3 (the prompt fills block 0), 4 masks over 3 steps each: 2, 1, 1
    np.testing.assert_array_equal([int((row == st).sum()) for st in range(3, 12)], [2, 1, 1] * 3)


def test_samplers_run_sharded_over_the_batch(sdar_model, sdar_sampling):
  prompts = [[5 + i, 6, 7 + i % 3][: 1 + i % 3] for i in range(8)]
  ids, valid = left_pad(prompts)
  s = sdar_sampling(gen_length=8, steps=2, stop_ids=(1000,))
  plain = samplers.sdar_generate(sdar_model, ids, valid, jax.random.key(0), s)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sharded = samplers.sdar_generate(sdar_model, jax.device_put(ids, rows), jax.device_put(valid, rows),
                                   jax.random.key(0), s)
  np.testing.assert_array_equal(sharded.tokens_BxL, plain.tokens_BxL)


# ----------------------------------------------------------------------------- chunks


@pytest.mark.parametrize("family,changes", [
    ("llada", dict(remasking="random", cfg_scale=1.0)),
    ("llada", dict(cache="dual", threshold=0.2, steps=16)),
    ("sdar", dict(strategy="low_confidence_dynamic", threshold=0.2, top_k=20)),
    ("dream", dict(alg="origin", steps=8)),
    ("dream", dict(alg="maskgit_plus", cache="dual", threshold=0.2, steps=8)),
], ids=["llada", "llada_dual_threshold", "sdar_dynamic", "dream", "dream_dual_threshold"])
def test_chunks_of_rows_decode_the_tokens_of_one_call(family, changes):
  # 7 rows in chunks of 3 (the last padded): every row's tokens and commit steps as in one call,
  # sampling at temperature 0.9, where a row's draws decide its tokens.
  model = models.create(models.tiny(**models.family_options(family)), seed=6)
  config = config_lib.base_config(family)
  config.sampler.gen_length, config.sampler.block_length = 16, 4
  base = rollouts.sampling_from_config(config, 0.9)
  sampling = dataclasses.replace(base, stop_ids=(1000,), **changes)
  ids, valid = left_pad([[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15], [16, 17, 18, 19], [20], [21, 22]])
  key = jax.random.key(7)
  whole = samplers.sampler_of(sampling)(model, ids, valid, key, sampling)
  chunked = dataclasses.replace(sampling, chunk=3)
  parts = samplers.sampler_of(chunked)(model, ids, valid, key, chunked)
  np.testing.assert_array_equal(parts.tokens_BxL, whole.tokens_BxL)
  np.testing.assert_array_equal(parts.commit_step_BxL, whole.commit_step_BxL)
  assert len(np.unique(np.asarray(whole.completion_BxC), axis=0)) == 7  # the draws differ by row
