"""Dream's sampler (`samplers.dream_generate`) against a NumPy loop written here from the released
`diffusion_generate` algorithm (docs/method.md §5, Dream), with the same random draws.

The definition, restated: timesteps `t_i = linspace(1, eps, steps + 1)`; at step i (t, s = t_i,
t_{i+1}) one full forward; every generated slot gets `x̂` and a confidence from its logits (divided
by the temperature when > 0, top-p of the whole distribution then top-k, the mask token a
candidate); `origin` commits each masked slot with probability `1 - s/t`, the other algorithms the
`int(m (1 - s/t))` most confident of the `m` masked slots (drawn with `alg_temp`), and the last
step every masked slot.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import config_lib, decoding, models, rollouts, samplers
from tests.samplers_test import draws, left_pad

MASK = 127


@pytest.fixture(scope="module")
def model():
  return models.create(models.tiny(**models.family_options("dream"), n_kv_heads=2), seed=5)


@pytest.fixture
def sampling():
  """`rollouts.DreamSampling` of the default Dream config (greedy), fields changed by keyword."""
  base = rollouts.DreamSampling.from_config(config_lib.base_config("dream").sampler, 0.0)
  return lambda **changes: dataclasses.replace(base, **{"stop_ids": (1000,), **changes})


def np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def filtered(logits, top_k, top_p):
  """Top-p as released (drop a token once the mass before it exceeds top_p), then top-k."""
  out = logits.copy()
  if top_p < 1:
    order = np.argsort(-out, kind="stable")
    probs = np_softmax(out[order])
    before = np.cumsum(probs) - probs
    out[order[before > top_p]] = -np.inf
  if top_k:
    kth = np.sort(out)[-top_k]
    out[out < kth] = -np.inf
  return out


def most(scores, eligible, k):
  """The k highest eligible scores (ties: the lower slot)."""
  order = np.argsort(np.where(eligible, -scores, np.inf), kind="stable")
  chosen = np.zeros_like(eligible)
  chosen[order[:k]] = True
  return chosen & eligible


def choose_slots(logits_GxV, u_GxV, *, alg, temperature, top_k, top_p):
  """Dream's `sample_tokens` for one row's slots: (x̂, confidence) per slot."""
  x0 = np.zeros(len(logits_GxV), np.int64)
  conf = np.zeros(len(logits_GxV))
  for j, logits in enumerate(logits_GxV):
    lj = filtered(logits / temperature if temperature > 0 else logits, top_k, top_p)
    probs = np_softmax(lj)
    x0[j] = (lj - np.log(-np.log(u_GxV[j]))).argmax() if temperature > 0 else lj.argmax()
    if alg == "topk_margin":
      top = np.sort(probs)[::-1]
      conf[j] = top[0] - top[1]
    elif alg == "entropy":
      conf[j] = np.sum(probs * np.log(probs + 1e-10))
    else:
      conf[j] = probs[x0[j]]
  return x0, conf


@nnx.jit
def forward(model, ids, positions, valid):
  return model.logits(ids, attention="full", positions=positions, valid_BxL=valid)


def dream_reference(model, ids, valid, key, *, gen_length, steps, alg, alg_temp=0.0, eps=1e-3,
                    temperature=0.0, top_k=0, top_p=1.0):
  """The released loop, row by row, in float64 (timesteps included)."""
  b, p = ids.shape
  x = np.concatenate([np.asarray(ids), np.full((b, gen_length), MASK, np.int32)], 1)
  full_valid = np.concatenate([np.asarray(valid), np.ones((b, gen_length), bool)], 1)
  pos = np.maximum(np.cumsum(full_valid, 1) - 1, 0)
  timesteps = np.linspace(1, eps, steps + 1)
  for i in range(steps):
    t, s = timesteps[i], timesteps[i + 1]
    logits = np.asarray(forward(model, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(full_valid)),
                        np.float64)[:, p:]
    u_choice, u_slot = draws(key, i, logits.shape)
    for r in range(b):
      gen = x[r, p:]
      masked = gen == MASK
      x0, conf = choose_slots(logits[r], u_choice[r], alg=alg, temperature=temperature,
                              top_k=top_k, top_p=top_p)
      if alg == "origin":
        commit = masked & (u_slot[r, :, 0] < (1 - s / t if i < steps - 1 else 1.0))
      else:
        m = int(masked.sum())
        k = int(m * (1 - s / t)) if i < steps - 1 else m
        keys = conf / alg_temp - np.log(-np.log(u_slot[r, :, 0])) if alg_temp else conf
        commit = most(keys, masked, k)
      x[r, p:] = np.where(commit, x0, gen)
  return x[:, p:]


CASES = [  # alg, gen_length, steps, temperature, top_k, top_p, alg_temp
    ("origin", 12, 12, 0.0, 0, 1.0, 0.0),
    ("origin", 10, 4, 0.8, 20, 0.9, 0.0),
    ("maskgit_plus", 12, 12, 0.0, 0, 1.0, 0.0),
    ("maskgit_plus", 10, 3, 0.9, 0, 0.8, 0.0),
    ("topk_margin", 12, 6, 0.0, 0, 0.9, 0.0),
    ("topk_margin", 9, 9, 1.0, 10, 1.0, 0.5),
    ("entropy", 12, 12, 0.0, 0, 1.0, 0.0),
    ("entropy", 11, 5, 0.7, 30, 0.95, 0.0),
    ("entropy", 8, 8, 0.0, 0, 1.0, 0.2),
    ("maskgit_plus", 6, 1, 0.0, 5, 1.0, 0.0),
]


@pytest.mark.parametrize("alg,gen_length,steps,temperature,top_k,top_p,alg_temp", CASES)
def test_matches_the_released_loop_with_the_same_draws(model, sampling, alg, gen_length, steps,
                                                       temperature, top_k, top_p, alg_temp):
  ids, valid = left_pad([[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]])
  kw = dict(gen_length=gen_length, steps=steps, alg=alg, alg_temp=alg_temp,
            temperature=temperature, top_k=top_k, top_p=top_p)
  key = jax.random.key(7)
  got = samplers.generate(model, ids, valid, key, sampling(**kw))
  want = dream_reference(model, ids, valid, key, **kw)
  np.testing.assert_array_equal(got.completion_BxC, want)
  # Every decoded slot records the step that committed it; a slot left holding the mask token (its
  # last step drew it) records none.
  when = np.asarray(got.commit_step_BxL)[:, ids.shape[1]:]
  assert (want != MASK).mean() > 0.9 and ((when >= 0) & (when < steps) == (want != MASK)).all()


def test_the_cases_are_not_vacuous(model, sampling):
  """The algorithms decode differently, and sampling differs from greedy decoding."""
  ids, valid = left_pad([[5, 6, 7], [8, 9, 10, 11, 12]])
  outs = {(alg, temp): np.asarray(samplers.generate(
      model, ids, valid, jax.random.key(7),
      sampling(gen_length=12, steps=6, alg=alg, temperature=temp)).completion_BxC).tolist()
          for alg in decoding.DREAM_ALGS for temp in (0.0, 0.9)}
  assert len({str(v) for v in outs.values()}) == len(outs)


def test_commit_counts_follow_the_schedule(model, sampling):
  """`int(m (1 - s/t))` of the m masked slots per step, the rest at the last step; with
  steps == gen_length the first step commits none."""
  ids, valid = left_pad([[5, 6, 7], [8, 9]])
  for gen_length, steps in ((12, 12), (16, 5), (7, 3), (5, 1)):
    r = samplers.generate(model, ids, valid, jax.random.key(2),
                          sampling(gen_length=gen_length, steps=steps, alg="maskgit_plus"))
    when = np.asarray(r.commit_step_BxL)[:, ids.shape[1]:]
    timesteps = np.linspace(1, 1e-3, steps + 1)
    m, want = gen_length, []
    for i in range(steps):
      k = int(m * (1 - timesteps[i + 1] / timesteps[i])) if i < steps - 1 else m
      want.append(k)
      m -= k
    assert sum(want) == gen_length
    if steps == gen_length:
      assert want[0] == 0 and want[-1] == 2 and set(want[1:-1]) == {1}
    for row in when:
      assert [int((row == i).sum()) for i in range(steps)] == want


def test_fractions_round_as_the_released_float32_arithmetic():
  """`decoding.dream_fractions` and `dream_commit_count` against torch's own float32 arithmetic
  (`linspace`, `1 - s / t`, `int(m * ...)`) over many step counts, lengths and eps."""
  torch = pytest.importorskip("torch")
  ms = torch.arange(0, 1200)
  fractions, want = [], []
  for eps in (1e-3, 1e-2, 0.05):
    for steps in list(range(1, 70)) + [128, 255, 256, 500, 512, 1024]:
      timesteps = torch.linspace(1, eps, steps + 1)
      released = (1 - timesteps[1:] / timesteps[:-1])[:-1]  # the last step commits the rest
      ours = decoding.dream_fractions(steps, eps)
      np.testing.assert_array_equal(ours[:-1], released.numpy(), err_msg=f"{eps} {steps}")
      assert ours[-1] == 1.0
      fractions.append(ours[:-1])
      want.append((ms[None, :] / 1 * released[:, None]).to(torch.int64).numpy())  # int(float32)
  got = decoding.dream_commit_count(jnp.asarray(ms.numpy())[None, :],
                                    jnp.asarray(np.concatenate(fractions))[:, None])
  np.testing.assert_array_equal(np.asarray(got), np.concatenate(want))


@pytest.mark.parametrize("alg,temperature", [("origin", 0.8), ("entropy", 0.0),
                                             ("topk_margin", 1.0)])
def test_padding_changes_nothing(model, sampling, alg, temperature):
  """More left padding (the draws are shaped by the generated region, so they are the same):
  the same tokens, for every algorithm, sampled or greedy."""
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 3, 4], [13]]
  s = sampling(gen_length=10, steps=5, alg=alg, temperature=temperature)
  narrow = samplers.generate(model, *left_pad(prompts), jax.random.key(3), s)
  wide = samplers.generate(model, *left_pad(prompts, width=11), jax.random.key(3), s)
  np.testing.assert_array_equal(narrow.completion_BxC, wide.completion_BxC)


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin"])
def test_row_alone_equals_row_in_padded_batch(model, sampling, alg):
  """Greedy, so the draws (shaped by the batch) do not matter. Not `entropy`: this random model
  gives many masked slots nearly the same entropy, and a batch of another size rounds the
  forward differently, which reorders such near ties (more padding does not:
  `test_padding_changes_nothing`)."""
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 3, 4], [13]]
  s = sampling(gen_length=12, steps=6, alg=alg)
  batch = samplers.generate(model, *left_pad(prompts), jax.random.key(0), s)
  for i, pr in enumerate(prompts):
    alone = samplers.generate(model, *left_pad([pr]), jax.random.key(0), s)
    np.testing.assert_array_equal(alone.completion_BxC[0], batch.completion_BxC[i])


class MaskPreferring(models.Transformer):
  """A model whose logits always prefer the mask token."""

  def head_logits(self, h_BxTxD):
    return super().head_logits(h_BxTxD).at[..., MASK].add(1e4)


def test_the_mask_token_is_a_candidate(model, sampling):
  """Every step draws the mask token: nothing is decoded and no slot records a commit (LLaDA's
  and SDAR's samplers forbid it; Dream's does not)."""
  masky = MaskPreferring(model.config, rngs=nnx.Rngs(5))
  ids, valid = left_pad([[5, 6, 7], [8, 9]])
  for alg in decoding.DREAM_ALGS:
    r = samplers.generate(masky, ids, valid, jax.random.key(0),
                          sampling(gen_length=8, steps=4, alg=alg))
    assert (np.asarray(r.completion_BxC) == MASK).all()
    assert (np.asarray(r.commit_step_BxL) == -1).all()


def test_stop_truncation_and_forward_counts(model, sampling):
  ids, valid = left_pad([[5, 6, 7], [8, 9, 10]])
  s = sampling(gen_length=12, steps=6)
  free = samplers.generate(model, ids, valid, jax.random.key(0), s)
  assert (np.asarray(free.forwards_B) == 6).all()
  assert (np.asarray(free.forward_tokens_B) == 6 * (3 + 12)).all()
  row0 = np.asarray(free.completion_BxC)[0]
  stop = int(row0[4])  # a token this model really emits mid-completion
  r = samplers.generate(model, ids, valid, jax.random.key(0),
                        sampling(gen_length=12, steps=6, stop_ids=(stop,), pad_id=0))
  for row_free, row, n in zip(np.asarray(free.completion_BxC), np.asarray(r.completion_BxC),
                              np.asarray(r.lengths_B)):
    cut = next((i + 1 for i, t in enumerate(row_free) if t == stop), len(row_free))
    assert n == cut
    np.testing.assert_array_equal(row[:cut], row_free[:cut])
    assert (row[cut:] == 0).all()
  assert int(r.lengths_B[0]) <= 5


def test_runs_sharded_over_the_batch(model, sampling):
  prompts = [[5 + i, 6, 7 + i % 3][: 1 + i % 3] for i in range(8)]
  ids, valid = left_pad(prompts)
  s = sampling(gen_length=8, steps=4, alg="origin", temperature=0.9)
  plain = samplers.generate(model, ids, valid, jax.random.key(0), s)
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  sharded = samplers.dream_generate(model, jax.device_put(ids, rows), jax.device_put(valid, rows),
                                    jax.random.key(0), s)
  np.testing.assert_array_equal(sharded.tokens_BxL, plain.tokens_BxL)


def test_the_config_picks_dream_sampling_and_bad_values_are_named():
  c = config_lib.base_config("dream")
  s = rollouts.sampling_from_config(c, 0.5)
  assert isinstance(s, rollouts.DreamSampling) and samplers.sampler_of(s) is samplers.dream_generate
  assert (s.alg, s.alg_temp, s.eps, s.temperature, s.steps) == ("entropy", 0.0, 1e-3, 0.5, 12)
  assert not s.fast and s.exact() == s and s.label == "dream entropy"
  assert s.head_slots == s.gen_length == 12
  assert dataclasses.replace(s, alg_temp=0.3).label == "dream entropy alg_temp=0.3"
  for key, value, match in [("alg", "low_confidence", "sampler.alg='low_confidence': expected"),
                            ("alg_temp", -1.0, "sampler.alg_temp=-1.0"),
                            ("eps", 0.0, "sampler.eps=0.0"), ("top_p", 0.0, "sampler.top_p=0.0"),
                            ("cache", "bogus", "sampler.cache='bogus'"),
                            ("threshold", 1.5, "sampler.threshold=1.5"),
                            ("cfg_scale", 1.0, "sampler.cfg_scale=1.0")]:
    bad = config_lib.base_config("dream")
    bad.sampler[key] = value
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(".", r"\.")):
      rollouts.sampling_from_config(bad, 0.0)
  with pytest.raises(ValueError, match=r"config\.sampler\.alg_temp=0\.5: sampler\.alg=origin"):
    dataclasses.replace(s, alg="origin", alg_temp=0.5)


def test_teacher_forced_sequences_use_the_full_attention_layout():
  prompt, valid = left_pad([[5, 6], [7, 8, 9]])
  completion = jnp.asarray([[1, 2, 3], [4, 5, 6]])
  dream = rollouts.teacher_forced(prompt, valid, completion, family="dream", block_size=4,
                                  mask_id=MASK)
  llada = rollouts.teacher_forced(prompt, valid, completion, family="llada", block_size=4,
                                  mask_id=MASK)
  for a, b in zip(dream, llada):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(dream.tokens_BxL[:, 3:], completion)
