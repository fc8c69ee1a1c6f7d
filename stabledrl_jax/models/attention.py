"""The one attention-mask rule: full, block-causal, staircase dual-stream and cached decoding.

Every position carries a block id and a stream (clean or noisy). Query q may attend key k when
  clean -> clean: block(k) <= block(q)   (block-causal; one block = full attention, B = 1 = causal)
  noisy -> noisy: block(k) == block(q)   (bidirectional inside the block being denoised)
  noisy -> clean: block(k) <  block(q)   (the clean prefix, never the target's own clean block)
  clean -> noisy: never
and k is a valid (non-padding) key. docs/method.md §4. The KV cache of block decoding is the clean stream.
"""
import flax.struct
import jax
import jax.numpy as jnp


def block_ids(positions: jax.Array, block_size: int | None) -> jax.Array:
  """Block index of each position; `block_size=None` puts everything in block 0 (full attention)."""
  positions = jnp.asarray(positions, jnp.int32)
  if block_size is None:
    return jnp.zeros_like(positions)
  return positions // block_size


def attention_mask(
    q_block_BxT: jax.Array,
    k_block_BxS: jax.Array,
    *,
    q_noisy_BxT: jax.Array | None = None,
    k_noisy_BxS: jax.Array | None = None,
    k_valid_BxS: jax.Array | None = None,
) -> jax.Array:
  """Boolean mask [B, 1, T, S] (True = attend) for `jax.nn.dot_product_attention`.

  Leading batch dims may be absent ([T], [S]); streams default to clean, keys to valid.
  """
  q_block_BxT = jnp.atleast_2d(q_block_BxT)
  k_block_BxS = jnp.atleast_2d(k_block_BxS)
  qb_BxTx1 = q_block_BxT[:, :, None]
  kb_Bx1xS = k_block_BxS[:, None, :]
  qn_BxTx1 = (jnp.zeros(q_block_BxT.shape, bool) if q_noisy_BxT is None
              else jnp.atleast_2d(q_noisy_BxT))[:, :, None]
  kn_Bx1xS = (jnp.zeros(k_block_BxS.shape, bool) if k_noisy_BxS is None
              else jnp.atleast_2d(k_noisy_BxS))[:, None, :]
  clean_clean = ~qn_BxTx1 & ~kn_Bx1xS & (kb_Bx1xS <= qb_BxTx1)
  noisy_noisy = qn_BxTx1 & kn_Bx1xS & (kb_Bx1xS == qb_BxTx1)
  noisy_clean = qn_BxTx1 & ~kn_Bx1xS & (kb_Bx1xS < qb_BxTx1)
  allowed_BxTxS = clean_clean | noisy_noisy | noisy_clean
  if k_valid_BxS is not None:
    allowed_BxTxS = allowed_BxTxS & jnp.atleast_2d(k_valid_BxS)[:, None, :]
  return allowed_BxTxS[:, None, :, :]


@flax.struct.dataclass
class MaskParts:
  """The per-position inputs of `attention_mask`: what a blockwise attention needs to build the
  mask one tile at a time instead of holding [B, 1, T, S]."""

  q_block_BxT: jax.Array
  k_block_BxS: jax.Array
  q_noisy_BxT: jax.Array | None = None
  k_noisy_BxS: jax.Array | None = None
  k_valid_BxS: jax.Array | None = None

  def mask(self) -> jax.Array:
    """The dense [B, 1, T, S] mask."""
    return attention_mask(self.q_block_BxT, self.k_block_BxS, q_noisy_BxT=self.q_noisy_BxT,
                          k_noisy_BxS=self.k_noisy_BxS, k_valid_BxS=self.k_valid_BxS)


def full_parts(length: int, valid_BxL: jax.Array | None = None) -> MaskParts:
  ids_L = jnp.zeros((length,), jnp.int32)
  return MaskParts(ids_L, ids_L, k_valid_BxS=valid_BxL)


def block_causal_parts(positions_BxL: jax.Array, block_size: int,
                       valid_BxL: jax.Array | None = None) -> MaskParts:
  ids_BxL = block_ids(positions_BxL, block_size)
  return MaskParts(ids_BxL, ids_BxL, k_valid_BxS=valid_BxL)


def staircase_parts(positions_BxN: jax.Array, block_size: int,
                    valid_BxN: jax.Array | None = None) -> MaskParts:
  ids_BxN = jnp.atleast_2d(block_ids(positions_BxN, block_size))
  ids_Bx2N = jnp.concatenate([ids_BxN, ids_BxN], axis=1)
  noisy_BxN = jnp.ones(ids_BxN.shape, bool)
  noisy_Bx2N = jnp.concatenate([noisy_BxN, ~noisy_BxN], axis=1)
  valid_Bx2N = None
  if valid_BxN is not None:
    valid_BxN = jnp.atleast_2d(valid_BxN)
    valid_Bx2N = jnp.concatenate([valid_BxN, valid_BxN], axis=1)
  return MaskParts(ids_Bx2N, ids_Bx2N, q_noisy_BxT=noisy_Bx2N, k_noisy_BxS=noisy_Bx2N,
                   k_valid_BxS=valid_Bx2N)


def full_mask(length: int, valid_BxL: jax.Array | None = None) -> jax.Array:
  """Bidirectional attention over `length` tokens with optional key padding (LLaDA)."""
  return full_parts(length, valid_BxL).mask()


def block_causal_mask(positions_BxL: jax.Array, block_size: int,
                      valid_BxL: jax.Array | None = None) -> jax.Array:
  """Block-causal attention (SDAR prefill/training); `block_size=1` is causal."""
  return block_causal_parts(positions_BxL, block_size, valid_BxL).mask()


def staircase_mask(positions_BxN: jax.Array, block_size: int,
                   valid_BxN: jax.Array | None = None) -> jax.Array:
  """Mask [B, 1, 2N, 2N] for the dual stream `[x_t ; x_0]`, both halves at the same positions."""
  return staircase_parts(positions_BxN, block_size, valid_BxN).mask()
