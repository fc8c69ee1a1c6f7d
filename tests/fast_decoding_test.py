"""Cached / threshold decoding (`fast_decoding`) of LLaDA and Dream against float64 NumPy loops
of the Fast-dLLM algorithm and of its Dream variant.

The references are written here from the definitions: their own forward (RMSNorm, RoPE at each
row's positions, GQA attention with Dream's q/k/v biases, SwiGLU), a KV cache stored per slot, the
prefix cache cut at the block start, the dual cache updated in place at the block's slots, and
Fast-dLLM's commit rules: LLaDA's (the most confident token, plus every token at or above the
threshold); Dream's (logits shifted within each forwarded span, the block's first slot committed
by its full forward, then the threshold rule on x̂'s probability or Dream's own step on the block
with timesteps `linspace(1, eps, steps per block + 1)`).
"""
import dataclasses
import time

import jax
import numpy as np
import pytest

from stabledrl_jax import build, config_lib, models, rollouts, samplers
from tests import samplers_test
from tests.samplers_dream_test import choose_slots, most
from tests.samplers_test import left_pad

MASK = 127


def _llada(n_layers=2, seed=3, sharpen=1.0):
  m = models.create(models.tiny(**models.family_options("llada"), n_kv_heads=2,
                                n_layers=n_layers), seed=seed)
  if sharpen != 1.0:  # peaked distributions: confidences spread over (0, 1), thresholds bite
    m.head.kernel[...] = m.head.kernel[...] * sharpen
  return m


@pytest.fixture(scope="module")
def model():
  return _llada(seed=7, sharpen=30.0)


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]

# ----------------------------------------------------------------------------- the reference


def _np(x):
  return np.asarray(x, np.float64)


def np_forward(model, ids_BxN, pos_BxN, attend):
  """Logits [B, N, V] and per-layer (k, v) of these N tokens; `attend(layer, k, v)` returns the
  (keys, values, valid) the N queries attend to."""
  cfg = model.config

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * _np(w)

  def rope(x):
    h = cfg.head_dim
    ang = pos_BxN[..., None] * (1.0 / cfg.rope_theta ** (np.arange(0, h, 2) / h))
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., :h // 2], x[..., h // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

  b, n = ids_BxN.shape
  x = _np(model.embed.embedding[...])[ids_BxN]
  kvs = []
  for layer, blk in enumerate(model.blocks):
    a = blk.attn
    y = norm(x, blk.attn_norm.scale[...])

    def proj(lin):  # Dream's q/k/v carry biases
      return y @ _np(lin.kernel[...]) + (0.0 if lin.bias is None else _np(lin.bias[...]))

    q = rope(proj(a.q_proj).reshape(b, n, cfg.n_heads, cfg.head_dim))
    k = rope(proj(a.k_proj).reshape(b, n, cfg.n_kv_heads, cfg.head_dim))
    v = proj(a.v_proj).reshape(b, n, cfg.n_kv_heads, cfg.head_dim)
    kvs.append((k, v))
    keys, values, ok = attend(layer, k, v)
    g = cfg.n_heads // cfg.n_kv_heads
    keys, values = np.repeat(keys, g, axis=2), np.repeat(values, g, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, keys) / np.sqrt(cfg.head_dim)
    s = np.where(ok[:, None, None, :], s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    x = x + np.einsum("bnqk,bknh->bqnh", pr, values).reshape(b, n, -1) @ _np(a.o_proj.kernel[...])
    y = norm(x, blk.mlp_norm.scale[...])
    gt, up = y @ _np(blk.gate_proj.kernel[...]), y @ _np(blk.up_proj.kernel[...])
    x = x + (gt / (1 + np.exp(-gt)) * up) @ _np(blk.down_proj.kernel[...])
  return norm(x, model.final_norm.scale[...]) @ _np(model.head.kernel[...]), kvs


def draws(key, step, shape):
  return samplers_test.draws(key, step, shape)[0]


def block_logits(model, rows, pos, ok, lo, hi, cache, cached, shift=lambda logits: logits):
  """The block's logits `[R, hi - lo, V]` from the forward Fast-dLLM runs, and the cache after it.
  `cached` None (the block's first step) or `cache="none"`: a full forward, whose keys/values
  become the cache at the first step; `prefix`: the block and everything after it against the
  cache cut at the block start; `dual`: the block alone, its fresh keys/values replacing its slots
  in the cache. `shift` aligns a forward's outputs with their targets within the forwarded span
  (Dream)."""
  if cached is None or cache == "none":
    logits, kv = np_forward(model, rows, pos, lambda l, k, v: (k, v, ok))
    if cached is None:
      cached = [(k.copy(), v.copy()) for k, v in kv]
    return shift(logits)[:, lo:hi], cached
  if cache == "prefix":
    logits, _ = np_forward(model, rows[:, lo:], pos[:, lo:], lambda l, k, v: (
        np.concatenate([cached[l][0][:, :lo], k], 1),
        np.concatenate([cached[l][1][:, :lo], v], 1), ok))
    return shift(logits)[:, :hi - lo], cached

  def replace(l, k, v):
    cached[l][0][:, lo:hi], cached[l][1][:, lo:hi] = k, v
    return cached[l][0], cached[l][1], ok

  logits, _ = np_forward(model, rows[:, lo:hi], pos[:, lo:hi], replace)
  return shift(logits), cached


def fast_dllm_reference(model, ids, valid, key, *, gen_length, block_length, steps, cache,
                        threshold=None, temperature=0.0, cfg_scale=0.0):
  b, p = ids.shape
  x = np.concatenate([np.asarray(ids), np.full((b, gen_length), MASK, np.int32)], 1)
  ok = np.concatenate([np.asarray(valid), np.ones((b, gen_length), bool)], 1)
  pos = np.maximum(np.cumsum(ok, 1) - 1, 0).astype(np.float64)
  prompt = np.concatenate([np.asarray(valid), np.zeros((b, gen_length), bool)], 1)
  if cfg_scale > 0:  # rows b.. are the unconditional copies
    ok, pos = np.concatenate([ok, ok]), np.concatenate([pos, pos])

  def forward_rows(x):
    return x if cfg_scale == 0 else np.concatenate([x, np.where(prompt, MASK, x)])

  def guided(logits):
    if cfg_scale == 0:
      return logits
    return logits[b:] + (cfg_scale + 1) * (logits[:b] - logits[b:])

  spb = steps // (gen_length // block_length)
  forwards = 0
  for blk in range(gen_length // block_length):
    lo, hi = p + blk * block_length, p + (blk + 1) * block_length
    counts = [[(block_length // spb) + (i < block_length % spb) for i in range(spb)]] * b
    i = 0
    cached = None
    while i < spb and (x[:, lo:hi] == MASK).any():
      logits, cached = block_logits(model, forward_rows(x), pos, ok, lo, hi, cache, cached)
      forwards += 1
      lb = guided(logits)
      lb[..., MASK] = -np.inf
      if temperature > 0:
        lb_noisy = lb - temperature * np.log(-np.log(draws(key, blk * spb + i, lb.shape)))
      else:
        lb_noisy = lb
      x0 = lb_noisy.argmax(-1)
      e = np.exp(lb - lb.max(-1, keepdims=True))
      conf = np.take_along_axis(e / e.sum(-1, keepdims=True), x0[..., None], -1)[..., 0]
      for r in range(b):
        masked = x[r, lo:hi] == MASK
        order = [j for j in np.argsort(-np.where(masked, conf[r], -np.inf), kind="stable")
                 if masked[j]]
        if threshold is None:
          chosen = order[:counts[r][i]]
        else:
          chosen = order[:1] + [j for j in order[1:] if conf[r, j] >= threshold]
        chosen = np.asarray(chosen, int)
        x[r, lo + chosen] = x0[r, chosen]
      i += 1
  return x[:, p:], forwards


EXACT = rollouts.LLaDASampling.from_config(config_lib.base_config("llada").sampler, 0.0)


def sampling(**kw) -> rollouts.LLaDASampling:
  """The default config's LLaDA settings (greedy) with `kw`; threshold None = off."""
  return dataclasses.replace(EXACT, **{**kw, "threshold": kw.get("threshold") or 0.0})


def run(model, prompts, key=0, **kw):
  ids, valid = left_pad(prompts)
  s = sampling(stop_ids=(1000,), **kw)
  return samplers.llada_generate(model, ids, valid, jax.random.key(key), s)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("cache,threshold,temperature,cfg", [
    ("prefix", None, 0.0, 0.0), ("dual", None, 0.0, 0.0), ("none", 0.6, 0.0, 0.0),
    ("prefix", 0.6, 0.0, 0.0), ("dual", 0.6, 0.0, 0.0), ("dual", 0.6, 0.8, 0.0),
    ("prefix", None, 0.8, 1.5)])
def test_matches_fast_dllm_reference_on_a_padded_batch(model, cache, threshold, temperature, cfg):
  # steps / blocks == block_length: Fast-dLLM's unbounded threshold loop fits the budget.
  kw = dict(gen_length=12, block_length=4, steps=12, temperature=temperature)
  ids, valid = left_pad(PROMPTS)
  want, forwards = fast_dllm_reference(model, ids, valid, jax.random.key(1), cache=cache,
                                       threshold=threshold, cfg_scale=cfg, **kw)
  got = run(model, PROMPTS, key=1, cache=cache, threshold=threshold, cfg_scale=cfg, **kw)
  np.testing.assert_array_equal(got.completion_BxC, want)
  np.testing.assert_array_equal(got.forwards_B, forwards * (2 if cfg else 1))


def test_the_reference_cases_are_not_vacuous(model):
  """On this model the two caches change the tokens differently and the threshold saves steps."""
  kw = dict(gen_length=12, block_length=4, steps=12)
  exact = np.asarray(run(model, PROMPTS, **kw).completion_BxC)
  prefix = np.asarray(run(model, PROMPTS, cache="prefix", **kw).completion_BxC)
  dual = np.asarray(run(model, PROMPTS, cache="dual", **kw).completion_BxC)
  assert (prefix != exact).any() and (dual != prefix).any()
  assert (np.asarray(run(model, PROMPTS, threshold=0.6, **kw).forwards_B) < 12).all()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_one_layer_model_every_cache_equals_the_exact_sampler(temperature):
  # One layer: a slot's keys/values depend only on its own token and position, which do not
  # change while they are reused, so the cache is exact.
  m = _llada(n_layers=1, seed=5, sharpen=4.0)
  kw = dict(gen_length=12, block_length=4, steps=6, temperature=temperature)
  exact = run(m, PROMPTS, **kw)
  for cache in ("prefix", "dual"):
    got = run(m, PROMPTS, cache=cache, **kw)
    np.testing.assert_array_equal(got.completion_BxC, exact.completion_BxC)
    np.testing.assert_array_equal(got.commit_step_BxL, exact.commit_step_BxL)


def test_threshold_one_is_the_schedule_and_a_tiny_one_commits_a_block_per_step():
  m = _llada()  # unsharpened: no confidence reaches 1
  kw = dict(gen_length=12, block_length=6, steps=8)
  exact = run(m, PROMPTS, **kw)
  assert (np.asarray(exact.forwards_B) == 8).all()
  one = run(m, PROMPTS, threshold=1.0, **kw)
  np.testing.assert_array_equal(one.completion_BxC, exact.completion_BxC)
  np.testing.assert_array_equal(one.commit_step_BxL, exact.commit_step_BxL)
  for cache in ("none", "dual"):
    zero = run(m, PROMPTS, cache=cache, threshold=1e-6, **kw)  # 0 is off
    when = np.asarray(zero.commit_step_BxL)[:, 5:]
    np.testing.assert_array_equal(when, np.repeat([[0] * 6 + [4] * 6], 3, axis=0))
    assert (np.asarray(zero.forwards_B) == 2).all()


def test_never_more_steps_than_the_budget(model):
  # 2 steps per block of 6: the budget binds, ⌈m / r⌉ commits finish every block.
  ids, valid = left_pad(PROMPTS)
  t = ids.shape[1] + 12
  r = run(model, PROMPTS, gen_length=12, block_length=6, steps=4, cache="dual", threshold=0.99)
  assert not (np.asarray(r.completion_BxC) == MASK).any()
  assert (np.asarray(r.forwards_B) <= 4).all()
  when = np.asarray(r.commit_step_BxL)[:, ids.shape[1]:]
  assert set(np.unique(when)) <= {0, 1, 2, 3}
  if (np.asarray(r.forwards_B) == 4).all():
    assert (np.asarray(r.forward_tokens_B) == 2 * (t + 6)).all()


def test_row_alone_equals_row_in_padded_batch(model):
  # Greedy: the draws are shaped like the batch, so only greedy rows can be compared alone.
  kw = dict(gen_length=12, block_length=4, steps=12, cache="dual", threshold=0.6)
  batch = run(model, PROMPTS, **kw)
  for i, pr in enumerate(PROMPTS):
    alone = run(model, [pr], **kw)
    np.testing.assert_array_equal(alone.completion_BxC[0], batch.completion_BxC[i])


def test_forward_counts_of_the_exact_and_prefix_samplers(model):
  ids, _ = left_pad(PROMPTS)
  p = ids.shape[1]
  exact = run(model, PROMPTS, gen_length=8, block_length=4, steps=4)
  np.testing.assert_array_equal(exact.forward_tokens_B, [4 * (p + 8)] * 3)
  pre = run(model, PROMPTS, gen_length=8, block_length=4, steps=4, cache="prefix")
  # Per block: one full forward, then one forward of the block and its suffix.
  np.testing.assert_array_equal(pre.forward_tokens_B, [2 * (p + 8) + 8 + 4] * 3)


def test_bad_settings_name_the_value():
  with pytest.raises(ValueError, match="'bogus'"):
    sampling(gen_length=8, block_length=4, steps=4, cache="bogus")
  with pytest.raises(ValueError, match="threshold=1.5"):
    sampling(gen_length=8, block_length=4, steps=4, threshold=1.5)


def test_config_keys_reach_rollouts_and_evaluation_only_when_asked_and_bad_values_are_named():
  c = config_lib.base_config("llada")
  c.sampler.cache, c.sampler.threshold = "dual", 0.9
  s = build.settings(c)
  assert (s.rl.sampling.cache, s.rl.sampling.threshold) == ("dual", 0.9)
  assert s.rl.sampling.fast and s.rl.sampling.label == "llada cache=dual threshold=0.9"
  assert (s.eval_sampling.cache, s.eval_sampling.threshold) == ("none", 0.0)
  assert s.eval_sampling.label == "llada exact"
  c.eval.fast = True
  assert build.settings(c).eval_sampling.cache == "dual"
  for key, value in (("cache", "bogus"), ("threshold", 1.5)):
    c = config_lib.base_config("llada")
    c.sampler[key] = value
    with pytest.raises(ValueError, match=f"config.sampler.{key}={value!r}"):
      build.settings(c)
  c = config_lib.base_config("sdar")
  c.sampler.cache = "prefix"
  with pytest.raises(ValueError, match="config.sampler.cache='prefix'"):
    build.settings(c)


def test_rollout_record_names_the_sampler_and_counts_forwards(model):
  s = sampling(gen_length=8, block_length=4, steps=4, cache="prefix", stop_ids=(1000,))
  started = time.perf_counter()
  r = samplers.llada_generate(model, *left_pad(PROMPTS), jax.random.key(0), s)
  rec = samplers.rollout_record(s, r, started)
  assert rec["rollout_sampler"] == "llada cache=prefix threshold=0.0"
  assert rec["rollout_forwards"] == float(np.asarray(r.forwards_B)[0])
  assert rec["rollout_tokens_per_s"] > 0
  assert sampling(gen_length=8, block_length=4, steps=4).label == "llada exact"


def test_cached_decoding_runs_sharded_over_the_batch(model):
  ids, valid = left_pad([[5 + i, 6, 7 + i % 3][: 1 + i % 3] for i in range(8)])
  s = sampling(gen_length=8, block_length=4, steps=4, cache="dual", threshold=0.6,
               stop_ids=(1000,))
  over_rows = jax.sharding.NamedSharding(
      jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)),
      jax.sharding.PartitionSpec("data"))
  plain, sharded = (samplers.llada_generate(model, *args, jax.random.key(0), s)
                    for args in ((ids, valid), jax.device_put((ids, valid), over_rows)))
  np.testing.assert_array_equal(sharded.tokens_BxL, plain.tokens_BxL)
  np.testing.assert_array_equal(sharded.forwards_B, plain.forwards_B)


# ----------------------------------------------------------------------------- Dream


def _dream(n_layers=2, seed=5, sharpen=1.0):
  m = models.create(models.tiny(**models.family_options("dream"), n_kv_heads=2,
                                n_layers=n_layers), seed=seed)
  if sharpen != 1.0:
    m.head.kernel[...] = m.head.kernel[...] * sharpen
  return m


@pytest.fixture(scope="module")
def dream():
  return _dream(sharpen=30.0)  # peaked: confidences reach a threshold of 0.3


def _shifted(logits):
  """Dream's sampler: the logits of slot i are the forward's output at slot i - 1; the first slot
  of a forward keeps its own."""
  return np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


def fast_dllm_dream_reference(model, ids, valid, key, *, gen_length, block_length, steps, cache,
                              alg, threshold=None, temperature=0.0, top_k=0, top_p=1.0,
                              alg_temp=0.0, eps=1e-3):
  b, p = ids.shape
  x = np.concatenate([np.asarray(ids), np.full((b, gen_length), MASK, np.int32)], 1)
  ok = np.concatenate([np.asarray(valid), np.ones((b, gen_length), bool)], 1)
  pos = np.maximum(np.cumsum(ok, 1) - 1, 0).astype(np.float64)
  spb = steps // (gen_length // block_length)
  timesteps = np.linspace(1, eps, spb + 1)
  forwards = 0
  for blk in range(gen_length // block_length):
    lo, hi = p + blk * block_length, p + (blk + 1) * block_length
    i = 0
    cached = None
    while i < spb and (x[:, lo:hi] == MASK).any():
      logits, cached = block_logits(model, x, pos, ok, lo, hi, cache, cached, shift=_shifted)
      forwards += 1
      u_choice, u_slot = samplers_test.draws(key, blk * spb + i, logits.shape)
      for r in range(b):
        masked = x[r, lo:hi] == MASK
        x0, conf = choose_slots(logits[r], u_choice[r], alg=alg, temperature=temperature,
                                top_k=top_k, top_p=top_p)
        if i == 0:
          commit = masked & (np.arange(block_length) == 0)
        elif threshold is not None:
          order = [j for j in np.argsort(-np.where(masked, conf, -np.inf), kind="stable")
                   if masked[j]]
          # Fast-dLLM's loop has no step budget; here at least ⌈m / steps left⌉ commit, which
          # is its one while the budget does not bind (it binds only after a step that drew the
          # mask token, which leaves its slot masked).
          least = -(-int(masked.sum()) // (spb - i))
          chosen = order[:least] + [j for j in order[least:] if conf[j] >= threshold]
          commit = np.isin(np.arange(block_length), chosen)
        elif alg == "origin":
          commit = masked & (u_slot[r, :, 0] < (1 - timesteps[i + 1] / timesteps[i]
                                                if i < spb - 1 else 1.0))
        else:
          m = int(masked.sum())
          k = int(m * (1 - timesteps[i + 1] / timesteps[i])) if i < spb - 1 else m
          keys = conf / alg_temp - np.log(-np.log(u_slot[r, :, 0])) if alg_temp else conf
          commit = most(keys, masked, k)
        x[r, lo:hi] = np.where(commit, x0, x[r, lo:hi])
      i += 1
  return x[:, p:], forwards


DREAM_EXACT = rollouts.DreamSampling.from_config(config_lib.base_config("dream").sampler, 0.0)


def dream_run(model, prompts, key=0, **kw):
  s = dataclasses.replace(DREAM_EXACT, stop_ids=(1000,),
                          **{**kw, "threshold": kw.get("threshold") or 0.0})
  return samplers.generate(model, *left_pad(prompts), jax.random.key(key), s)


DREAM_CASES = [  # cache, threshold, alg, temperature, top_p, alg_temp, steps
    ("prefix", None, "entropy", 0.0, 1.0, 0.0, 12), ("dual", None, "entropy", 0.0, 1.0, 0.0, 12),
    ("dual", None, "topk_margin", 0.0, 1.0, 0.0, 6), ("prefix", None, "origin", 0.8, 0.9, 0.0, 6),
    ("dual", None, "maskgit_plus", 0.9, 1.0, 0.3, 12),
    ("none", 0.3, "maskgit_plus", 0.0, 1.0, 0.0, 12),
    ("prefix", 0.3, "maskgit_plus", 0.0, 1.0, 0.0, 12),
    ("dual", 0.3, "maskgit_plus", 0.0, 1.0, 0.0, 12),
    ("dual", 0.3, "maskgit_plus", 0.8, 0.95, 0.0, 12)]


@pytest.mark.parametrize("cache,threshold,alg,temperature,top_p,alg_temp,steps", DREAM_CASES)
def test_dream_matches_fast_dllm_dream_reference_on_a_padded_batch(
    dream, cache, threshold, alg, temperature, top_p, alg_temp, steps):
  kw = dict(gen_length=12, block_length=4, steps=steps, alg=alg, temperature=temperature,
            top_p=top_p, alg_temp=alg_temp)
  ids, valid = left_pad(PROMPTS)
  want, forwards = fast_dllm_dream_reference(dream, ids, valid, jax.random.key(1), cache=cache,
                                             threshold=threshold, **kw)
  got = dream_run(dream, PROMPTS, key=1, cache=cache, threshold=threshold, **kw)
  np.testing.assert_array_equal(got.completion_BxC, want)
  np.testing.assert_array_equal(got.forwards_B, forwards)


def test_dream_reference_cases_are_not_vacuous(dream):
  """The caches change the tokens differently, the threshold saves forwards, and the first
  slot of each block is committed by the block's first (full) forward."""
  kw = dict(gen_length=12, block_length=4, steps=12, alg="entropy")
  outs = {c: dream_run(dream, PROMPTS, cache=c, **kw) for c in ("prefix", "dual")}
  uncached = fast_dllm_dream_reference(dream, *left_pad(PROMPTS), jax.random.key(0),
                                       cache="none", **kw)[0]
  prefix, dual = (np.asarray(outs[c].completion_BxC) for c in ("prefix", "dual"))
  assert (prefix != uncached).any() and (dual != prefix).any()
  exact = np.asarray(dream_run(dream, PROMPTS, **kw).completion_BxC)
  assert (exact != uncached).any()  # blocks and the first-slot rule decode differently
  dual_t = dream_run(dream, PROMPTS, cache="dual", threshold=0.3,
                     **{**kw, "alg": "maskgit_plus"})
  assert (np.asarray(dual_t.forwards_B) < 12).all()
  when = np.asarray(outs["dual"].commit_step_BxL)[:, -12:]
  np.testing.assert_array_equal(when[:, [0, 4, 8]], np.tile([0, 4, 8], (3, 1)))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_dream_one_layer_model_every_cache_equals_full_forwards(temperature):
  # One layer: a slot's keys/values depend only on its own token and position, so the cache is
  # exact, and the span's first slot (whose shifted logits a cached forward lacks) is committed.
  m = _dream(n_layers=1, seed=6, sharpen=30.0)
  kw = dict(gen_length=12, block_length=4, steps=6, temperature=temperature, alg="maskgit_plus")
  uncached = dream_run(m, PROMPTS, cache="none", threshold=0.3, **kw)
  scheduled = fast_dllm_dream_reference(m, *left_pad(PROMPTS), jax.random.key(0), cache="none",
                                        **kw)[0]
  for cache in ("prefix", "dual"):
    got = dream_run(m, PROMPTS, cache=cache, threshold=0.3, **kw)
    np.testing.assert_array_equal(got.completion_BxC, uncached.completion_BxC)
    np.testing.assert_array_equal(got.commit_step_BxL, uncached.commit_step_BxL)
    np.testing.assert_array_equal(dream_run(m, PROMPTS, cache=cache, **kw).completion_BxC,
                                  scheduled)


def test_dream_row_alone_equals_row_in_padded_batch(dream):
  kw = dict(gen_length=12, block_length=4, steps=12, cache="dual", threshold=0.3,
            alg="maskgit_plus")
  batch = dream_run(dream, PROMPTS, **kw)
  for i, pr in enumerate(PROMPTS):
    np.testing.assert_array_equal(dream_run(dream, [pr], **kw).completion_BxC[0],
                                  batch.completion_BxC[i])


def test_dream_fast_settings_are_checked_and_reach_rollouts_only():
  c = config_lib.base_config("dream")
  c.sampler.cache, c.sampler.threshold, c.sampler.alg = "dual", 0.9, "maskgit_plus"
  s = build.settings(c)
  assert s.rl.sampling.fast and s.rl.sampling.head_slots == c.sampler.block_length
  assert s.rl.sampling.label == "dream maskgit_plus block=4 cache=dual threshold=0.9"
  assert not s.eval_sampling.fast and s.eval_sampling.label == "dream maskgit_plus"
  assert s.eval_sampling.head_slots == c.sampler.gen_length
  assert samplers.sampler_of(s.rl.sampling) is samplers.dream_generate
  for changes, match in [
      (dict(alg="entropy"), r"config\.sampler\.alg='entropy': the threshold compares"),
      (dict(alg_temp=0.5), r"config\.sampler\.alg_temp=0\.5: threshold decoding"),
      (dict(steps=3), r"config\.sampler\.steps=3: Dream's fast decoder needs"),
      (dict(block_length=5), r"config\.sampler\.block_length=5: must divide"),
      (dict(cache="bogus"), r"config\.sampler\.cache='bogus'")]:
    bad = config_lib.base_config("dream")
    bad.sampler.cache, bad.sampler.threshold, bad.sampler.alg = "dual", 0.9, "maskgit_plus"
    bad.sampler.update(changes)
    with pytest.raises(ValueError, match=match):
      build.settings(bad)
