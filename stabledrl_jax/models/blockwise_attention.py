"""Attention one key tile at a time with a running softmax (the flash-attention recurrence), with
a backward pass that recomputes each tile's probabilities instead of storing them.

Scores exist only as [B, K, G, T, tile] for the current tile, and the mask only as
[B, 1, T, tile] built from the per-position `MaskParts`, so the staircase's [heads, 2N, 2N]
scores and its [2N, 2N] mask are never held, in either pass. The forward keeps q, k, v, the
output and each query's softmax max m and sum l; the backward walks the tiles again: with
P = exp(S - m) / l and D = rowsum(dO ∘ O), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - D), dQ = dS K / √H,
dK = dSᵀ Q / √H (masked scores are constants: their dS is zero).

Semantics equal `jax.nn.dot_product_attention` with the dense mask: masked scores are replaced
by the same large negative number (a query that sees no key averages every key's value, as
there), probabilities are cast to the value dtype before the product with the values, and query
head n reads key/value head n // G.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from stabledrl_jax.models.attention import MaskParts, attention_mask

_MASKED = -0.7 * float(np.finfo(np.float32).max)  # what the dense path writes over masked scores


def _pad_keys(x_BxSx, pad: int, value=0):
  return jnp.pad(x_BxSx, [(0, 0), (0, pad)] + [(0, 0)] * (x_BxSx.ndim - 2), constant_values=value)


def blockwise_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array,
                        parts: MaskParts, tile: int) -> jax.Array:
  """Masked softmax attention [B, T, N, H], key tiles of `tile` positions (the last one padded)."""
  b, t, n, h = q_BxTxNxH.shape
  s, kh = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  tiles = -(-s // tile)
  pad = tiles * tile - s

  def keys_BxS(x, default):
    x = jnp.broadcast_to(jnp.atleast_2d(default if x is None else x), (b, s))
    return _pad_keys(x, pad)

  key_masks = (keys_BxS(parts.k_block_BxS, None),
               keys_BxS(parts.k_noisy_BxS, jnp.zeros((s,), bool)),
               keys_BxS(parts.k_valid_BxS, jnp.ones((s,), bool)),
               _pad_keys(jnp.ones((b, s), bool), pad))  # real: False only for the tile padding
  query_masks = (jnp.broadcast_to(jnp.atleast_2d(parts.q_block_BxT), (b, t)),
                 jnp.zeros((b, t), bool) if parts.q_noisy_BxT is None
                 else jnp.broadcast_to(jnp.atleast_2d(parts.q_noisy_BxT), (b, t)))
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, n // kh, h)
  out_BxTxKxGxH = _attend(q_BxTxKxGxH, _pad_keys(k_BxSxKxH, pad), _pad_keys(v_BxSxKxH, pad),
                          query_masks, key_masks, tile)
  return out_BxTxKxGxH.reshape(b, t, n, h)


def _tiled(x_BxSx, tile: int):  # [B, S', ...] -> [tiles, B, tile, ...]
  b, s = x_BxSx.shape[:2]
  return jnp.moveaxis(x_BxSx.reshape(b, s // tile, tile, *x_BxSx.shape[2:]), 1, 0)


def _untiled(x_ZxBxCx):  # [tiles, B, tile, ...] -> [B, S', ...]
  z, b, c = x_ZxBxCx.shape[:3]
  return jnp.moveaxis(x_ZxBxCx, 0, 1).reshape(b, z * c, *x_ZxBxCx.shape[3:])


def _scan_peeled(step, init, xs):
  """`lax.scan(step, init, xs)` with the first tile taken out of the loop, so that the loop's
  carry is computed from the data. A loop whose initial carry is a constant (zeros) gets it as a
  buffer that the TPU and GPU schedulers are free to allocate at the start of the program: every
  layer's float32 accumulators were then live at once (measured: 3 GiB per layer at SDAR-8B's
  micro-batch on v5p, against 0.6 GiB for the dense path)."""
  carry, y_first = step(init, jax.tree.map(lambda x: x[0], xs))
  carry, ys = jax.lax.scan(step, carry, jax.tree.map(lambda x: x[1:], xs))
  return carry, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), y_first, ys)


def _precision(dtype):
  return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if dtype == jnp.bfloat16 else None


def _scores(q_BxTxKxGxH, k_BxCxKxH, query_masks, key_masks_tile):
  """float32 scores [B, K, G, T, C] of one key tile, masked as the dense path masks them, and
  where the mask let them through."""
  q_block_BxT, q_noisy_BxT = query_masks
  kb_BxC, kn_BxC, kv_BxC, real_BxC = key_masks_tile
  scale = 1.0 / np.sqrt(q_BxTxKxGxH.shape[-1])
  scores = jnp.einsum("btkgh,bckh->bkgtc", q_BxTxKxGxH, k_BxCxKxH,
                      precision=_precision(q_BxTxKxGxH.dtype),
                      preferred_element_type=jnp.float32) * scale
  allowed_Bx1xTxC = attention_mask(q_block_BxT, kb_BxC, q_noisy_BxT=q_noisy_BxT,
                                   k_noisy_BxS=kn_BxC, k_valid_BxS=kv_BxC)
  scores = jnp.where(allowed_Bx1xTxC[:, :, None], scores, _MASKED)
  scores = jnp.where(real_BxC[:, None, None, None, :], scores, -jnp.inf)
  return scores, allowed_Bx1xTxC[:, :, None] & real_BxC[:, None, None, None, :]


def _forward(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, query_masks, key_masks, tile):
  b, t, kh, g, h = q_BxTxKxGxH.shape

  def step(carry, x):
    m_BxKxGxT, l_BxKxGxT, acc_BxKxGxTxH = carry
    k_BxCxKxH, v_BxCxKxH, *key_masks_tile = x
    scores, _ = _scores(q_BxTxKxGxH, k_BxCxKxH, query_masks, key_masks_tile)
    m_new = jnp.maximum(m_BxKxGxT, scores.max(-1))
    p = jnp.exp(scores - m_new[..., None])
    correction = jnp.exp(m_BxKxGxT - m_new)
    l_new = l_BxKxGxT * correction + p.sum(-1)
    pv = jnp.einsum("bkgtc,bckh->bkgth", p.astype(v_BxCxKxH.dtype), v_BxCxKxH,
                    preferred_element_type=jnp.float32)
    return (m_new, l_new, acc_BxKxGxTxH * correction[..., None] + pv), None

  init = (jnp.full((b, kh, g, t), _MASKED, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
          jnp.zeros((b, kh, g, t, h), jnp.float32))
  xs = (_tiled(k_BxSxKxH, tile), _tiled(v_BxSxKxH, tile), *(_tiled(m, tile) for m in key_masks))
  (m_BxKxGxT, l_BxKxGxT, acc_BxKxGxTxH), _ = _scan_peeled(step, init, xs)
  out_BxKxGxTxH = acc_BxKxGxTxH / l_BxKxGxT[..., None]
  out_BxTxKxGxH = jnp.transpose(out_BxKxGxTxH, (0, 3, 1, 2, 4)).astype(v_BxSxKxH.dtype)
  return out_BxTxKxGxH, (m_BxKxGxT, l_BxKxGxT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, query_masks, key_masks, tile):
  return _forward(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, query_masks, key_masks, tile)[0]


def _attend_fwd(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, query_masks, key_masks, tile):
  out_BxTxKxGxH, softmax_stats = _forward(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, query_masks,
                                        key_masks, tile)
  return out_BxTxKxGxH, (q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, query_masks, key_masks,
                         out_BxTxKxGxH, softmax_stats)


def _attend_bwd(tile, residuals, dout_BxTxKxGxH):
  q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, query_masks, key_masks, out_BxTxKxGxH, stats = residuals
  m_BxKxGxT, l_BxKxGxT = stats  # (not folded into one log-sum-exp: a row that sees no key has
  # m = the masked score, next to which log(l) vanishes in float32)
  dtype, scale = v_BxSxKxH.dtype, 1.0 / np.sqrt(q_BxTxKxGxH.shape[-1])
  do_BxKxGxTxH = jnp.transpose(dout_BxTxKxGxH, (0, 2, 3, 1, 4))
  d_BxKxGxT = jnp.einsum("btkgh,btkgh->bkgt", dout_BxTxKxGxH.astype(jnp.float32),
                         out_BxTxKxGxH.astype(jnp.float32))

  def step(dq_BxKxGxTxH, x):
    k_BxCxKxH, v_BxCxKxH, *key_masks_tile = x
    scores, kept = _scores(q_BxTxKxGxH, k_BxCxKxH, query_masks, key_masks_tile)
    p = jnp.exp(scores - m_BxKxGxT[..., None]) / l_BxKxGxT[..., None]
    dv_BxCxKxH = jnp.einsum("bkgtc,bkgth->bckh", p.astype(dtype), do_BxKxGxTxH.astype(dtype),
                            preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgth,bckh->bkgtc", do_BxKxGxTxH.astype(dtype), v_BxCxKxH,
                    preferred_element_type=jnp.float32)
    ds = jnp.where(kept, p * (dp - d_BxKxGxT[..., None]), 0.0).astype(dtype)
    dq_BxKxGxTxH = dq_BxKxGxTxH + jnp.einsum("bkgtc,bckh->bkgth", ds, k_BxCxKxH,
                                             preferred_element_type=jnp.float32)
    dk_BxCxKxH = jnp.einsum("bkgtc,btkgh->bckh", ds, q_BxTxKxGxH,
                            preferred_element_type=jnp.float32)
    return dq_BxKxGxTxH, (dk_BxCxKxH * scale, dv_BxCxKxH)

  b, t, kh, g, h = q_BxTxKxGxH.shape
  xs = (_tiled(k_BxSxKxH, tile), _tiled(v_BxSxKxH, tile), *(_tiled(m, tile) for m in key_masks))
  dq_BxKxGxTxH, (dk_ZxBxCxKxH, dv_ZxBxCxKxH) = _scan_peeled(
      step, jnp.zeros((b, kh, g, t, h), jnp.float32), xs)
  dq_BxTxKxGxH = jnp.transpose(dq_BxKxGxTxH * scale, (0, 3, 1, 2, 4))
  no_grad = jax.tree.map(lambda _: None, (query_masks, key_masks))
  return (dq_BxTxKxGxH.astype(q_BxTxKxGxH.dtype), _untiled(dk_ZxBxCxKxH).astype(k_BxSxKxH.dtype),
          _untiled(dv_ZxBxCxKxH).astype(dtype), *no_grad)


_attend.defvjp(_attend_fwd, _attend_bwd)
