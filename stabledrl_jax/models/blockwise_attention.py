"""Attention one key tile at a time with a running softmax (the flash-attention recurrence).

Scores exist only as [B, K, G, T, tile] for the current tile, and the mask only as
[B, 1, T, tile] built from the per-position `MaskParts`, so the staircase's [heads, 2N, 2N]
scores and its [2N, 2N] mask are never held. The tile body is rematerialised: the backward pass
keeps the running (max, sum, output) after each tile and recomputes that tile's scores.

Semantics equal `jax.nn.dot_product_attention` with the dense mask: masked scores are replaced
by the same large negative number (a query that sees no key averages every key's value, as
there), probabilities are cast to the value dtype before the product with the values, and query
head n reads key/value head n // G.
"""
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
  g = n // kh
  tiles = -(-s // tile)
  pad = tiles * tile - s

  def keys_BxS(x, default):
    x = jnp.broadcast_to(jnp.atleast_2d(default if x is None else x), (b, s))
    return _pad_keys(x, pad)

  k_block_BxS = keys_BxS(parts.k_block_BxS, None)
  k_noisy_BxS = keys_BxS(parts.k_noisy_BxS, jnp.zeros((s,), bool))
  k_valid_BxS = keys_BxS(parts.k_valid_BxS, jnp.ones((s,), bool))
  real_BxS = _pad_keys(jnp.ones((b, s), bool), pad)  # False only for the tile padding
  q_block_BxT = jnp.broadcast_to(jnp.atleast_2d(parts.q_block_BxT), (b, t))
  q_noisy_BxT = (jnp.zeros((b, t), bool) if parts.q_noisy_BxT is None
                 else jnp.broadcast_to(jnp.atleast_2d(parts.q_noisy_BxT), (b, t)))

  def tiled(x_BxSx):  # [B, S', ...] -> [tiles, B, tile, ...]
    return jnp.moveaxis(x_BxSx.reshape(b, tiles, tile, *x_BxSx.shape[2:]), 1, 0)

  xs = (tiled(_pad_keys(k_BxSxKxH, pad)), tiled(_pad_keys(v_BxSxKxH, pad)), tiled(k_block_BxS),
        tiled(k_noisy_BxS), tiled(k_valid_BxS), tiled(real_BxS))
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, g, h)
  scale = 1.0 / np.sqrt(h)
  precision = (jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q_BxTxNxH.dtype == jnp.bfloat16
               else None)

  @jax.checkpoint
  def step(carry, x):
    m_BxKxGxT, l_BxKxGxT, acc_BxKxGxTxH = carry
    k_BxSxKxH, v_BxSxKxH, kb_BxS, kn_BxS, kv_BxS, real_BxS = x
    scores = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH, precision=precision,
                        preferred_element_type=jnp.float32) * scale
    allowed_Bx1xTxS = attention_mask(q_block_BxT, kb_BxS, q_noisy_BxT=q_noisy_BxT,
                                     k_noisy_BxS=kn_BxS, k_valid_BxS=kv_BxS)
    scores = jnp.where(allowed_Bx1xTxS[:, :, None], scores, _MASKED)
    scores = jnp.where(real_BxS[:, None, None, None, :], scores, -jnp.inf)
    m_new = jnp.maximum(m_BxKxGxT, scores.max(-1))
    p = jnp.exp(scores - m_new[..., None])
    correction = jnp.exp(m_BxKxGxT - m_new)
    l_new = l_BxKxGxT * correction + p.sum(-1)
    pv = jnp.einsum("bkgts,bskh->bkgth", p.astype(v_BxSxKxH.dtype), v_BxSxKxH,
                    preferred_element_type=jnp.float32)
    return (m_new, l_new, acc_BxKxGxTxH * correction[..., None] + pv), None

  init = (jnp.full((b, kh, g, t), _MASKED, jnp.float32), jnp.zeros((b, kh, g, t), jnp.float32),
          jnp.zeros((b, kh, g, t, h), jnp.float32))
  (_, l_BxKxGxT, acc_BxKxGxTxH), _ = jax.lax.scan(step, init, xs)
  out_BxKxGxTxH = acc_BxKxGxTxH / l_BxKxGxT[..., None]
  out_BxTxKxGxH = jnp.transpose(out_BxKxGxTxH, (0, 3, 1, 2, 4))
  return out_BxTxKxGxH.reshape(b, t, n, h).astype(v_BxSxKxH.dtype)
