"""The NNX transformer: a NumPy reference forward, the staircase, the KV cache, dtypes, remat."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stabledrl_jax import models, samplers

B_SIZE = 4  # block size used throughout


@functools.partial(nnx.jit, static_argnames=("attention", "block_size"))
def logits(model, ids, attention="full", block_size=None, valid=None):
  # Jitted once per shape: eager dispatch of the tiny model is ~10x slower on 2 cores.
  return model.logits(ids, attention=attention, block_size=block_size, valid_BxL=valid)


@functools.partial(nnx.jit, static_argnames=("block_size",))
def staircase(model, noisy, clean, block_size):
  return model.staircase_logits(noisy, clean, block_size=block_size)


def _np(x):
  return np.asarray(x, np.float64)


def reference_logits(model, ids_BxL, allowed_LxL):
  """The same architecture in float64 NumPy with an explicit softmax."""
  cfg = model.config

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * _np(w)

  def rope(x_BxLxNxH):
    h = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, h, 2) / h)
    ang = np.arange(x_BxLxNxH.shape[1])[:, None] * inv
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    x1, x2 = x_BxLxNxH[..., : h // 2], x_BxLxNxH[..., h // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

  b, l = ids_BxL.shape
  x = _np(model.embed.embedding[...])[ids_BxL]
  for blk in model.blocks:
    a = blk.attn
    y = norm(x, blk.attn_norm.scale[...])
    q = (y @ _np(a.q_proj.kernel[...])).reshape(b, l, cfg.n_heads, cfg.head_dim)
    k = (y @ _np(a.k_proj.kernel[...])).reshape(b, l, cfg.n_kv_heads, cfg.head_dim)
    v = (y @ _np(a.v_proj.kernel[...])).reshape(b, l, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = norm(q, a.q_norm.scale[...]), norm(k, a.k_norm.scale[...])
    q, k = rope(q), rope(k)
    group = cfg.n_heads // cfg.n_kv_heads
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(cfg.head_dim)
    s = np.where(allowed_LxL, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bnqk,bknh->bqnh", p, v).reshape(b, l, -1)
    x = x + o @ _np(a.o_proj.kernel[...])
    y = norm(x, blk.mlp_norm.scale[...])
    g, u = y @ _np(blk.gate_proj.kernel[...]), y @ _np(blk.up_proj.kernel[...])
    x = x + (g / (1 + np.exp(-g)) * u) @ _np(blk.down_proj.kernel[...])
  return norm(x, model.final_norm.scale[...]) @ _np(model.head.kernel[...])


@pytest.fixture(scope="module")
def sdar():
  return models.create(models.tiny(), seed=1)


@pytest.fixture(scope="module")
def llada():
  cfg = models.tiny(**models.family_options("llada"), n_kv_heads=4, rope_theta=500000.0,
                    norm_eps=1e-5)
  return models.create(cfg, seed=2)


def _ids(key, shape, vocab=127):
  return jax.random.randint(jax.random.PRNGKey(key), shape, 0, vocab)


def test_full_attention_matches_numpy_reference(llada):
  ids = np.asarray(_ids(0, (2, 10)))
  got = np.asarray(logits(llada, jnp.asarray(ids), attention="full"))
  assert got.dtype == np.float32 and got.shape == (2, 10, 128)
  np.testing.assert_allclose(got, reference_logits(llada, ids, np.ones((10, 10), bool)),
                             atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block", [1, 3])
def test_block_causal_gqa_qk_norm_matches_numpy_reference(sdar, block):
  ids = np.asarray(_ids(1, (2, 9)))
  pos = np.arange(9)
  allowed = pos[None, :] // block <= pos[:, None] // block
  got = np.asarray(logits(sdar, jnp.asarray(ids), attention="block_causal", block_size=block))
  np.testing.assert_allclose(got, reference_logits(sdar, ids, allowed), atol=2e-5, rtol=1e-4)


def test_key_padding_hides_padded_tokens(llada):
  ids = _ids(2, (1, 8))
  valid = jnp.array([[True] * 6 + [False] * 2])
  other = ids.at[:, 6:].set(5)
  a = logits(llada, ids, valid=valid)[:, :6]
  b = logits(llada, other, valid=valid)[:, :6]
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  c = logits(llada, other)[:, :6]  # without the padding mask the change is seen
  assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-4


def _staircase_case(n_blocks=4):
  n = n_blocks * B_SIZE
  clean = _ids(3, (2, n))
  noisy = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(4), 0.5, (2, n)), 127, clean)
  return noisy, clean


def test_staircase_equals_one_forward_per_block(sdar):
  noisy, clean = _staircase_case()
  one_pass = np.asarray(staircase(sdar, noisy, clean, block_size=B_SIZE))
  for b in range(noisy.shape[1] // B_SIZE):
    lo, hi = b * B_SIZE, (b + 1) * B_SIZE
    seq = jnp.concatenate([clean[:, :lo], noisy[:, lo:hi]], axis=1)
    per_block = logits(sdar, seq, attention="block_causal", block_size=B_SIZE)[:, lo:hi]
    np.testing.assert_allclose(one_pass[:, lo:hi], np.asarray(per_block), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b", [0, 1, 2])
def test_staircase_no_leakage_from_clean_tokens_at_or_after_block(sdar, b):
  noisy, clean = _staircase_case()
  lo, hi = b * B_SIZE, (b + 1) * B_SIZE
  base = np.asarray(staircase(sdar, noisy, clean, block_size=B_SIZE))
  changed_clean = clean.at[:, lo:].set((clean[:, lo:] + 7) % 127)
  after = np.asarray(staircase(sdar, noisy, changed_clean, block_size=B_SIZE))
  np.testing.assert_allclose(after[:, lo:hi], base[:, lo:hi], atol=1e-6)
  # Noisy tokens of other blocks are not seen either.
  changed_noisy = noisy.at[:, hi:].set(3)
  after = np.asarray(staircase(sdar, changed_noisy, clean, block_size=B_SIZE))
  np.testing.assert_allclose(after[:, lo:hi], base[:, lo:hi], atol=1e-6)
  # The clean prefix before block b is seen (the test can fail).
  if b > 0:
    prefix_changed = clean.at[:, :lo].set((clean[:, :lo] + 7) % 127)
    after = np.asarray(staircase(sdar, noisy, prefix_changed, block_size=B_SIZE))
    assert np.abs(after[:, lo:hi] - base[:, lo:hi]).max() > 1e-4


def test_kv_cache_block_decoding_matches_full_recompute(sdar):
  noisy, clean = _staircase_case(n_blocks=3)
  cache = sdar.init_cache(batch=2, max_len=16)
  step = nnx.jit(lambda m, ids, c, pos, commit: m.cached_logits(ids, c, positions_BxT=pos,
                                                                 commit=commit),
                 static_argnums=(4,))
  # Prefill two clean blocks block-causally, as SDAR does with the prompt.
  prefill_logits, cache = step(sdar, clean[:, :8], cache, jnp.arange(8), True)
  np.testing.assert_allclose(
      np.asarray(prefill_logits),
      np.asarray(logits(sdar, clean[:, :8], attention="block_causal", block_size=B_SIZE)),
      atol=1e-5)
  assert int(cache.length) == 8
  # Denoise block 2: it sees the cache and itself; the cache is unchanged.
  denoise_logits, same_cache = step(sdar, noisy[:, 8:12], cache, jnp.arange(8, 12), False)
  seq = jnp.concatenate([clean[:, :8], noisy[:, 8:12]], axis=1)
  expected = logits(sdar, seq, attention="block_causal", block_size=B_SIZE)[:, 8:12]
  np.testing.assert_allclose(np.asarray(denoise_logits), np.asarray(expected), atol=1e-5)
  assert int(same_cache.length) == 8
  # Commit the finished block, then denoise the next one against all three cached blocks.
  _, cache = step(sdar, clean[:, 8:12], cache, jnp.arange(8, 12), True)
  next_noisy = jnp.full((2, 4), 127)
  got, _ = step(sdar, next_noisy, cache, jnp.arange(12, 16), False)
  seq = jnp.concatenate([clean[:, :12], next_noisy], axis=1)
  expected = logits(sdar, seq, attention="block_causal", block_size=B_SIZE)[:, 12:16]
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  cfg = models.tiny(compute_dtype="bfloat16")
  model16, model32 = models.create(cfg, seed=1), models.create(models.tiny(), seed=1)
  assert model16.head.kernel[...].dtype == jnp.float32
  ids = _ids(5, (2, 8))
  lg16 = logits(model16, ids, attention="block_causal", block_size=B_SIZE)
  lg32 = logits(model32, ids, attention="block_causal", block_size=B_SIZE)
  assert lg16.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(lg16), np.asarray(lg32), atol=3e-2)


def test_remat_gives_the_same_gradients():
  ids = _ids(6, (2, 8))

  def loss(m):
    return jnp.mean(jax.nn.log_softmax(m.staircase_logits(ids, ids, block_size=B_SIZE))[..., 0])

  g_plain = nnx.jit(nnx.grad(loss))(models.create(models.tiny(), seed=3))
  g_remat = nnx.jit(nnx.grad(loss))(models.create(models.tiny(remat=True), seed=3))
  for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_remat_models_sample_like_plain_ones(sdar_sampling, llada_sampling):
  # The 8B presets remat; their samplers run the model inside lax loops.
  prompt, valid = _ids(7, (2, 6)), jnp.ones((2, 6), bool)
  for sampling, gen in ((sdar_sampling(gen_length=8, steps=2), samplers.sdar_generate),
                        (llada_sampling(gen_length=8, block_length=4, steps=4),
                         samplers.llada_generate)):
    outs = [gen(models.create(models.tiny(remat=r), seed=3), prompt, valid, jax.random.key(0),
                sampling).tokens_BxL for r in (False, True)]
    np.testing.assert_array_equal(outs[0], outs[1])


def test_presets_have_published_shapes():
  llada, sdar8 = models.llada_8b(), models.sdar_8b()
  assert (llada.n_layers, llada.d_model, llada.mlp_dim, llada.n_heads, llada.n_kv_heads) == (
      32, 4096, 12288, 32, 32)
  assert (llada.vocab_size, llada.mask_token_id, llada.eos_token_id) == (126464, 126336, 126081)
  assert (sdar8.n_layers, sdar8.d_model, sdar8.n_kv_heads, sdar8.mask_token_id) == (
      36, 4096, 8, 151669)
  assert 7.9e9 < llada.num_params < 8.1e9 and 8.1e9 < sdar8.num_params < 8.3e9
  assert 0.9e8 < models.bench_100m().num_params < 1.1e8
