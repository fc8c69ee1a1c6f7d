"""Blockwise attention equals the dense masked attention of `jax.nn.dot_product_attention`
(staircase, block-causal, full, padded rows; forward and gradients), and the transformer's
`attention_impl="blockwise"` equals its dense path."""
import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

from stabledrl_jax import models
from stabledrl_jax.models import attention as attn_lib
from stabledrl_jax.models.blockwise_attention import blockwise_attention


def _inputs(b, t, n, kh, h, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h))
  k = jax.random.normal(ks[1], (b, t, kh, h))
  v = jax.random.normal(ks[2], (b, t, kh, h))
  w = jax.random.normal(ks[3], (b, t, n, h))  # a random cotangent for the gradients
  return q, k, v, w


def _left_padded(b, length, pads):
  return jnp.asarray([[i >= p for i in range(length)] for p in pads[:b]])


N_BLOCK, BLOCK = 10, 4
CASES = {
    "staircase": lambda v: attn_lib.staircase_parts(jnp.arange(N_BLOCK), BLOCK, v),
    "block_causal": lambda v: attn_lib.block_causal_parts(jnp.arange(2 * N_BLOCK), BLOCK, v),
    "causal": lambda v: attn_lib.block_causal_parts(jnp.arange(2 * N_BLOCK), 1, v),
    "full": lambda v: attn_lib.full_parts(2 * N_BLOCK, v),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("padded", [False, True])
def test_equals_dense_forward_and_gradient(case, padded, tile=3):  # tiles that do not divide S
  b, t, n, kh, h = 2, 2 * N_BLOCK, 4, 2, 8
  valid = None
  if padded:  # left padding; in the staircase both halves are padded, and row 1 has whole
    # padding blocks, so some of its query rows see no key at all
    valid = _left_padded(b, N_BLOCK if case == "staircase" else t, [3, 9])
  parts = CASES[case](valid)
  q, k, v, w = _inputs(b, t, n, kh, h)
  mask = parts.mask()
  if padded and case != "full":
    assert not bool(mask.any(-1).all())  # the fully masked rows are really there

  def dense(q, k, v):
    return jnp.sum(jax.nn.dot_product_attention(q, k, v, mask=mask) * w)

  def blockwise(q, k, v):
    return jnp.sum(blockwise_attention(q, k, v, parts, tile) * w)

  want = jax.nn.dot_product_attention(q, k, v, mask=mask)
  got = jax.jit(blockwise_attention, static_argnums=4)(q, k, v, parts, tile)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  for g_got, g_want in zip(jax.jit(jax.grad(blockwise, (0, 1, 2)))(q, k, v),
                           jax.grad(dense, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(np.asarray(g_got), np.asarray(g_want), rtol=1e-4, atol=1e-5)


def test_the_staircase_mask_is_not_materialised():
  q, k, v, _ = _inputs(1, 2 * N_BLOCK, 4, 2, 8)
  parts = attn_lib.staircase_parts(jnp.arange(N_BLOCK), BLOCK)
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: blockwise_attention(q, k, v, parts, 4))(q, k, v))
  t = 2 * N_BLOCK
  assert f"{t},{t}]" not in jaxpr.replace(" ", "")  # no [.., T, S] score or mask array


def test_transformer_blockwise_equals_dense():
  ids = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 4, 100)
  valid = _left_padded(2, 12, [0, 5])
  for family in ("llada", "sdar"):
    extra = dict(family="llada", qk_norm=False, block_size=None) if family == "llada" else {}
    dense = models.create(models.tiny(compute_dtype="float32", **extra), seed=2)
    tiled = models.create(models.tiny(compute_dtype="float32", attention_impl="blockwise",
                                      attention_tile=5, **extra), seed=2)
    runs = [lambda m: m.logits(ids, attention="full", valid_BxL=valid)]
    if family == "sdar":
      runs += [lambda m: m.logits(ids, attention="block_causal", valid_BxL=valid),
               lambda m: m.staircase_logits(ids, ids[:, ::-1], valid_BxN=valid)]
    for run in runs:
      np.testing.assert_allclose(np.asarray(run(tiled)), np.asarray(run(dense)), rtol=1e-5,
                                 atol=1e-5)


def test_gradient_memory_does_not_grow_with_the_number_of_tiles():
  # XLA's temporaries for the gradient at S = 2048: dense holds [heads, S, S] float32 scores
  # (64 MiB) and more; the tiled backward recomputes each tile's probabilities, so with 64 tiles
  # of 32 keys it needs q, k, v, the output and one tile's scores. Storing a per-tile
  # accumulator for the backward (a checkpointed scan) would take 64 x [heads, S, H] float32.
  b, t, n, kh, h = 1, 2048, 4, 2, 32
  q, k, v = jnp.zeros((b, t, n, h)), jnp.zeros((b, t, kh, h)), jnp.zeros((b, t, kh, h))
  parts = attn_lib.staircase_parts(jnp.arange(t // 2), 16)
  mask = parts.mask()

  def temporaries(attend):
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), (0, 1, 2)))
    return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

  dense = temporaries(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask))
  tiled = temporaries(lambda q, k, v: blockwise_attention(q, k, v, parts, 32))
  assert dense > 4 * n * t * t  # the dense scores are there
  assert tiled < 0.05 * dense, (tiled, dense)


def _scan_carry_producers(jaxpr):
  """For every scan in `jaxpr` (nested ones too): the primitive names that produce its initial
  carry, "literal" for a literal and "input" for a value from outside that jaxpr."""
  found, producer = [], {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      consts, carries = eqn.params["num_consts"], eqn.params["num_carry"]
      found.append(["literal" if isinstance(v, jex_core.Literal) else
                    producer[v].primitive.name if v in producer else "input"
                    for v in eqn.invars[consts:consts + carries]])
    for sub in jex_core.jaxprs_in_params(eqn.params):
      found += _scan_carry_producers(sub)
    for v in eqn.outvars:
      producer[v] = eqn
  return found


def test_no_tile_loop_starts_from_a_constant():
  # A loop whose initial carry is a constant (jnp.zeros) gets that carry as a buffer the TPU
  # and GPU schedulers may allocate at the start of the program, so every layer's float32
  # accumulator was live at once (3 GiB per SDAR-8B layer on v5p). The first tile is computed
  # outside the loop, so each loop's carry comes from the data.
  q, k, v, w = _inputs(2, 2 * N_BLOCK, 4, 2, 8)
  parts = attn_lib.staircase_parts(jnp.arange(N_BLOCK), BLOCK)
  loss = lambda q, k, v: jnp.sum(blockwise_attention(q, k, v, parts, 3) * w)
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr
  carries = _scan_carry_producers(jaxpr)
  assert len(carries) == 2  # the forward's loop and the backward's
  for producers in carries:
    assert not {"literal", "broadcast_in_dim"} & set(producers), carries
