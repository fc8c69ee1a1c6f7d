"""One configurable NNX transformer for every family: LLaDA (LLaMA-like), SDAR (Qwen3), Dream
(Qwen2.5: biases on q/k/v, full attention, shifted prediction) and LLaDA2.0 (fused q/k/v, partial
rotary, mixture-of-experts layers after the first `first_k_dense_replace`: `models.moe`).

Float32 parameters, `config.compute_dtype` activations, float32 logits. Entry points:
`logits` (full / block-causal), `staircase_logits` (dual stream, docs/method.md §4) and `cached_logits`
with a preallocated `KVCache` (SDAR block decoding, docs/method.md §5), `forward_kv` (full
attention against reused keys/values).

One contract for every family: the logits at slot i predict the token at slot i. Dream's trunk
predicts the next token (its state at slot i is a prediction of token i + 1); `shift_to_targets`
moves each state one slot right before the head, so callers never see the difference.
"""
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from stabledrl_jax.models import attention as attn_lib
from stabledrl_jax.models.blockwise_attention import blockwise_attention
from stabledrl_jax.models.config import ModelConfig
from stabledrl_jax.models.moe import MoE

_INIT = nnx.initializers.normal(0.02)


class RMSNorm(nnx.Module):
  """y = x / rms(x) * scale, statistics in float32 whatever the compute dtype."""

  def __init__(self, dim: int, eps: float, *, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(positions_BxL: jax.Array, head_dim: int, theta: float):
  """Rotate-half RoPE tables [B, L, H] in float32."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angle_BxLxH2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq
  angle_BxLxH = jnp.concatenate([angle_BxLxH2, angle_BxLxH2], axis=-1)
  return jnp.cos(angle_BxLxH), jnp.sin(angle_BxLxH)


def apply_rope(x_BxLxNxH: jax.Array, cos_BxLxR: jax.Array, sin_BxLxR: jax.Array) -> jax.Array:
  """Rotate pairs (i, i + R/2) of the first R dims by the position angle (the Hugging Face /
  LLaMA convention); dims from R on pass through (partial rotary, R < H)."""
  r = cos_BxLxR.shape[-1]
  x = x_BxLxNxH.astype(jnp.float32)
  x_rot, x_pass = x[..., :r], x[..., r:]
  x1, x2 = jnp.split(x_rot, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  out = x_rot * cos_BxLxR[:, :, None, :] + rotated * sin_BxLxR[:, :, None, :]
  return jnp.concatenate([out, x_pass], axis=-1).astype(x_BxLxNxH.dtype)


class Linear(nnx.Linear):
  """`nnx.Linear` plus an optional adapter: `y = x W (+ b) + adapter(x)`.

  `adapter` is None until `stabledrl_jax.lora.apply` attaches one (any module mapping the input
  [M, D_in] to a delta [M, D_out], e.g. a LoRA update). The kernel keeps its path, so weight
  names, checkpoints and shardings are the same with or without an adapter.
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.adapter = nnx.data(None)

  def __call__(self, x: jax.Array) -> jax.Array:
    y = super().__call__(x)
    return y if self.adapter is None else y + self.adapter(x).astype(y.dtype)


def _linear(d_in: int, d_out: int, cfg: ModelConfig, rngs: nnx.Rngs,
            bias: bool = False) -> Linear:
  return Linear(d_in, d_out, use_bias=bias, dtype=cfg.compute_dtype,
                param_dtype=cfg.param_dtype, kernel_init=_INIT, rngs=rngs)


class Attention(nnx.Module):
  """MHA / GQA with optional per-head q/k RMS norm before RoPE and optional q/k/v biases."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.attention_tile = cfg.attention_tile
    if cfg.fused_qkv:  # LLaDA2.0's query_key_value: [q heads | k heads | v heads] x head_dim
      self.qkv_proj = _linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim,
                              cfg, rngs)
    else:
      self.q_proj = _linear(cfg.d_model, cfg.n_heads * cfg.head_dim, cfg, rngs, cfg.qkv_bias)
      self.k_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs, cfg.qkv_bias)
      self.v_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs, cfg.qkv_bias)
    self.o_proj = _linear(cfg.n_heads * cfg.head_dim, cfg.d_model, cfg, rngs)
    self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, param_dtype=cfg.param_dtype) if cfg.qk_norm else None
    self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, param_dtype=cfg.param_dtype) if cfg.qk_norm else None

  def __call__(self, x_BxTxD, cos_BxTxH, sin_BxTxH, mask_Bx1xTxS, past_kv=None):
    """Returns (output, (k, v) of these T tokens); keys are `past_kv` (S - T of them) + these."""
    b, t, d = x_BxTxD.shape
    # Projections on [B*T, D]: XLA:CPU then computes weight gradients without transposes.
    x_MxD = x_BxTxD.reshape(b * t, d)
    n, kv = self.n_heads, self.n_kv_heads
    if hasattr(self, "qkv_proj"):
      qkv_BxTxJxH = self.qkv_proj(x_MxD).reshape(b, t, n + 2 * kv, self.head_dim)
      q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = jnp.split(qkv_BxTxJxH, [n, n + kv], axis=2)
    else:
      q_BxTxNxH = self.q_proj(x_MxD).reshape(b, t, n, self.head_dim)
      k_BxTxKxH = self.k_proj(x_MxD).reshape(b, t, kv, self.head_dim)
      v_BxTxKxH = self.v_proj(x_MxD).reshape(b, t, kv, self.head_dim)
    if self.q_norm is not None:
      q_BxTxNxH, k_BxTxKxH = self.q_norm(q_BxTxNxH), self.k_norm(k_BxTxKxH)
    q_BxTxNxH = apply_rope(q_BxTxNxH, cos_BxTxH, sin_BxTxH)
    k_BxTxKxH = apply_rope(k_BxTxKxH, cos_BxTxH, sin_BxTxH)
    new_kv = (k_BxTxKxH, v_BxTxKxH)
    k_BxSxKxH, v_BxSxKxH = k_BxTxKxH, v_BxTxKxH
    if past_kv is not None:
      past_k, past_v = past_kv
      k_BxSxKxH = jnp.concatenate([past_k.astype(k_BxTxKxH.dtype), k_BxTxKxH], axis=1)
      v_BxSxKxH = jnp.concatenate([past_v.astype(v_BxTxKxH.dtype), v_BxTxKxH], axis=1)
    # GQA is native here: K/V with fewer heads are broadcast over each query group.
    if isinstance(mask_Bx1xTxS, attn_lib.MaskParts):  # attention_impl="blockwise"
      out_BxTxNxH = blockwise_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_Bx1xTxS,
                                        self.attention_tile)
    else:
      out_BxTxNxH = jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH,
                                                 mask=mask_Bx1xTxS)
    out_MxD = self.o_proj(out_BxTxNxH.reshape(b * t, self.n_heads * self.head_dim))
    return out_MxD.reshape(b, t, d), new_kv


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, width: int, *, rngs: nnx.Rngs):
    self.gate_proj = _linear(cfg.d_model, width, cfg, rngs)
    self.up_proj = _linear(cfg.d_model, width, cfg, rngs)
    self.down_proj = _linear(width, cfg.d_model, cfg, rngs)

  def __call__(self, y_MxD: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(y_MxD)) * self.up_proj(y_MxD))


class Block(nnx.Module):
  """Pre-norm residual block: attention then a SwiGLU MLP, or a mixture of experts (layer
  `layer` of a config with `is_moe_layer(layer)`)."""

  def __init__(self, cfg: ModelConfig, layer: int = 0, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=cfg.param_dtype)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=cfg.param_dtype)
    if cfg.is_moe_layer(layer):
      shared = (SwiGLU(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts, rngs=rngs)
                if cfg.num_shared_experts else None)
      self.moe = MoE(cfg, rngs=rngs, shared_mlp=shared)
    else:
      self.gate_proj = _linear(cfg.d_model, cfg.mlp_dim, cfg, rngs)
      self.up_proj = _linear(cfg.d_model, cfg.mlp_dim, cfg, rngs)
      self.down_proj = _linear(cfg.mlp_dim, cfg.d_model, cfg, rngs)

  def __call__(self, x_BxTxD, cos_BxTxH, sin_BxTxH, mask_Bx1xTxS, past_kv=None, route_MxK=None):
    """Returns (output, (k, v) of these tokens, the experts each token chose [B*T, k] or None
    for a dense layer); `route_MxK` replays an earlier forward's experts (routing replay)."""
    h_BxTxD, new_kv = self.attn(self.attn_norm(x_BxTxD), cos_BxTxH, sin_BxTxH, mask_Bx1xTxS, past_kv)
    x_BxTxD = x_BxTxD + h_BxTxD
    b, t, d = x_BxTxD.shape
    y_MxD = self.mlp_norm(x_BxTxD).reshape(b * t, d)
    experts_MxK = None
    if hasattr(self, "moe"):
      mlp_MxD, experts_MxK = self.moe(y_MxD, route_MxK)
    else:
      mlp_MxD = self.down_proj(jax.nn.silu(self.gate_proj(y_MxD)) * self.up_proj(y_MxD))
    return x_BxTxD + mlp_MxD.reshape(b, t, d), new_kv, experts_MxK


def _run_block(block: Block, x, cos, sin, mask, past_kv, route):
  return block(x, cos, sin, mask, past_kv, route)


_POLICIES = {"nothing": jax.checkpoint_policies.nothing_saveable,
             "dots": jax.checkpoint_policies.checkpoint_dots,
             "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _run_block_remat(block: Block, x, cos, sin, mask, past_kv, route, policy: str = "nothing"):
  """`_run_block` under `jax.checkpoint` (activations recomputed in the backward pass). The block
  goes in as a pure state, so this also works inside `lax` loops (the samplers), where
  `nnx.remat` cannot update the module from another trace level."""
  graphdef, state = nnx.split(block)

  @functools.partial(jax.checkpoint, policy=_POLICIES[policy])
  def run(state, x, cos, sin, mask, past_kv, route):
    return nnx.merge(graphdef, state)(x, cos, sin, mask, past_kv, route)

  return run(state, x, cos, sin, mask, past_kv, route)


@flax.struct.dataclass
class KVCache:
  """Preallocated keys/values of committed (clean) tokens; slots [0, length) are filled.

  `block_BxS` and `valid_BxS` feed the mask rule, so left-padded rows and block ids derived from
  per-row positions work unchanged. Static shapes: jit compiles once per (batch, max_len).
  """

  k_LxBxSxKxH: jax.Array
  v_LxBxSxKxH: jax.Array
  block_BxS: jax.Array  # int32 block id of each slot
  valid_BxS: jax.Array  # bool, False for empty slots and padding
  length: jax.Array  # int32 scalar: next slot to write

  @property
  def max_len(self) -> int:
    return self.k_LxBxSxKxH.shape[2]


def _positions(positions, batch: int, length: int) -> jax.Array:
  if positions is None:
    positions = jnp.arange(length, dtype=jnp.int32)
  return jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch, length))


def shift_to_targets(h_BxTxD: jax.Array, valid_BxT=None) -> jax.Array:
  """Next-token states -> states aligned with their targets: slot i takes the state of slot
  i - 1 (the one that predicts token i), within the tokens of this forward.

  A slot with no real predecessor keeps its own state: the first slot of the forward, and the
  first real slot after padding (`valid_BxT` False before it). Its state predicts the *next*
  token, as position 0 keeps its own logits in Dream's sampler: it is never a prediction of
  the slot's own token, and such a slot is a prompt token (left padding, or the first token of
  the sequence), never scored or sampled. So padding never feeds a real slot, and a left-padded
  row gives the same logits as the unpadded row at every real slot. A forward of a block alone
  (`forward_kv`) has no predecessor for its first slot: include the token before the block when
  that slot's prediction is needed.
  """
  b, t = h_BxTxD.shape[:2]
  previous_BxTxD = jnp.concatenate([h_BxTxD[:, :1], h_BxTxD[:, :-1]], axis=1)
  if valid_BxT is None:
    return previous_BxTxD
  valid_BxT = jnp.broadcast_to(jnp.atleast_2d(jnp.asarray(valid_BxT, bool)), (b, t))
  has_previous_BxT = jnp.concatenate([jnp.zeros((b, 1), bool), valid_BxT[:, :-1]], axis=1)
  return jnp.where(has_previous_BxT[..., None], previous_BxTxD, h_BxTxD)


class Transformer(nnx.Module):
  """Token ids -> float32 logits; the logit at slot i predicts the token at slot i, for every
  family (a shifted trunk, `config.shifted`, is shifted back by `shift_to_targets`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.config = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype,
                           param_dtype=cfg.param_dtype, embedding_init=_INIT, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=cfg.param_dtype)
    self.head = Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype,
                       param_dtype=cfg.param_dtype, kernel_init=_INIT, rngs=rngs)

  def _trunk(self, ids_BxT, positions_BxT, mask_Bx1xTxS, past=None, routes=None):
    """Final-normed hidden states, the per-layer (k, v) of these tokens and the experts every
    token chose in each mixture-of-experts layer, `[B, MoE layers, T, k]` (None without such
    layers); `routes` of that shape replays them (routing replay)."""
    cfg = self.config
    b, t = ids_BxT.shape
    x_BxTxD = self.embed(ids_BxT)
    cos, sin = rope_cos_sin(positions_BxT, cfg.rotary_dim, cfg.rope_theta)
    run = (functools.partial(_run_block_remat, policy=cfg.remat_policy) if cfg.remat
           else _run_block)
    new_kvs, chosen = [], []
    for i, block in enumerate(self.blocks):
      past_kv = None if past is None else past[i]
      route = None
      if routes is not None and hasattr(block, "moe"):
        route = routes[:, len(chosen)].reshape(b * t, -1)
      x_BxTxD, kv, experts_MxK = run(block, x_BxTxD, cos, sin, mask_Bx1xTxS, past_kv, route)
      new_kvs.append(kv)
      if experts_MxK is not None:
        chosen.append(experts_MxK.reshape(b, t, -1))
    chosen_BxExTxK = jnp.stack(chosen, axis=1) if chosen else None
    return self.final_norm(x_BxTxD), new_kvs, chosen_BxExTxK

  def _targets(self, h_BxTxD: jax.Array, valid_BxT=None) -> jax.Array:
    """The trunk's final-normed states aligned with the tokens they predict (the identity for
    the families whose trunk predicts each slot's own token)."""
    return shift_to_targets(h_BxTxD, valid_BxT) if self.config.shifted else h_BxTxD

  def _refuse_shifted(self, what: str) -> None:
    if self.config.shifted:
      raise ValueError(f"{what} is block diffusion (SDAR); family {self.config.family!r} predicts "
                       "the next slot's token with full attention, which has no block-diffusion "
                       "form: use `logits` or `forward_kv`")

  def _mask(self, parts: attn_lib.MaskParts):
    """The dense mask, or with `attention_impl="blockwise"` its parts (tiles built on the fly)."""
    return parts if self.config.attention_impl == "blockwise" else parts.mask()

  def _head(self, h_BxTxD: jax.Array) -> jax.Array:
    kernel_DxV = self.head.kernel[...]
    dtype = jnp.dtype(self.config.compute_dtype)
    b, t, d = h_BxTxD.shape
    h_MxD = h_BxTxD.reshape(b * t, d).astype(dtype)
    logits_MxV = jnp.dot(h_MxD, kernel_DxV.astype(dtype), preferred_element_type=jnp.float32)
    if self.head.adapter is not None:  # e.g. LoRA on LLaDA's `ff_out`, which names the head too
      logits_MxV = logits_MxV + self.head.adapter(h_MxD).astype(jnp.float32)
    return logits_MxV.reshape(b, t, -1)

  def head_logits(self, h_BxTxD: jax.Array) -> jax.Array:
    """float32 logits of the states `logits(..., head=False)` / `forward_kv` return. Those are
    already aligned with their targets (shifted for Dream), so any slice of them maps to the
    logits of the same slots: no shift happens here."""
    return self._head(h_BxTxD)

  def logits(self, input_ids_BxL: jax.Array, *, attention: str = "full",
             block_size: int | None = None, positions=None, valid_BxL=None,
             head: bool = True, routes=None, with_routes: bool = False) -> jax.Array:
    """Plain forward: `attention="full"` (bidirectional, LLaDA) or `"block_causal"` (SDAR).

    `positions` ([L] or [B, L]) default to 0..L-1; `valid_BxL` marks real (non-padding) keys.
    `head=False` returns the final-normed hidden states `[B, L, D]` instead, aligned with their
    targets like the logits (`head_logits` maps them to logits, e.g. a chunk at a time). For a
    shifted family the first real slot of each row has no prediction of its own: see
    `shift_to_targets`. `"block_causal"` with `block_size=1` is then the autoregressive forward
    of the model the family was initialised from. Mixture of experts: `with_routes=True` returns
    `(out, experts [B, MoE layers, L, k])`, and `routes` replays such experts (`_trunk`).
    """
    b, l = input_ids_BxL.shape
    positions_BxL = _positions(positions, b, l)
    if attention == "full":
      mask = self._mask(attn_lib.full_parts(l, valid_BxL))
    elif attention == "block_causal":
      block_size = block_size or self.config.block_size
      if block_size is None:
        raise ValueError("attention='block_causal' needs block_size (config has none)")
      mask = self._mask(attn_lib.block_causal_parts(positions_BxL, block_size, valid_BxL))
    else:
      raise ValueError(f"unknown attention {attention!r}; expected 'full' or 'block_causal'")
    h_BxLxD, _, chosen = self._trunk(input_ids_BxL, positions_BxL, mask, routes=routes)
    h_BxLxD = self._targets(h_BxLxD, valid_BxL)
    out = self._head(h_BxLxD) if head else h_BxLxD
    return (out, chosen) if with_routes else out

  def staircase_logits(self, noisy_ids_BxN: jax.Array, clean_ids_BxN: jax.Array, *,
                       block_size: int | None = None, positions=None,
                       valid_BxN=None, head: bool = True, routes=None,
                       with_routes: bool = False) -> jax.Array:
    """Logits [B, N, V] of the noisy stream, each block conditioned on its clean prefix only.

    One forward over `[x_t ; x_0]` (length 2N, shared positions) replaces one forward per block.
    `head=False` returns the noisy stream's hidden states `[B, N, D]` instead. Refused for a
    shifted family (Dream), which is not a block-diffusion model. `routes` / `with_routes` as in
    `logits`, over both streams (`[B, MoE layers, 2N, k]`).
    """
    self._refuse_shifted("staircase attention")
    block_size = block_size or self.config.block_size
    if block_size is None:
      raise ValueError("staircase attention needs block_size (config has none)")
    b, n = noisy_ids_BxN.shape
    positions_BxN = _positions(positions, b, n)
    mask = self._mask(attn_lib.staircase_parts(positions_BxN, block_size, valid_BxN))
    ids_Bx2N = jnp.concatenate([noisy_ids_BxN, clean_ids_BxN], axis=1)
    positions_Bx2N = jnp.concatenate([positions_BxN, positions_BxN], axis=1)
    h_Bx2NxD, _, chosen = self._trunk(ids_Bx2N, positions_Bx2N, mask, routes=routes)
    out = self._head(h_Bx2NxD[:, :n]) if head else h_Bx2NxD[:, :n]
    return (out, chosen) if with_routes else out

  def forward_kv(self, ids_BxT: jax.Array, *, positions_BxT: jax.Array, valid_BxT: jax.Array,
                 past=None, past_valid_BxS=None):
    """Full-attention forward of T tokens that also attends to reused keys/values (block-wise
    caching of LLaDA decoding). Returns (final-normed hidden states [B, T, D], the per-layer
    (k, v) of these T tokens, each [B, T, K, H]).

    `past` is a per-layer list of (k, v) [B, S, K, H] (rotated at their own positions); every
    valid past key (`past_valid_BxS`) and every valid new key (`valid_BxT`) is attended to.
    The states are aligned with their targets like `logits(..., head=False)`; for a shifted
    family the shift stays within these T tokens (a past key has no state), so the first of
    them keeps its own next-token state: forward from the slot before a block to predict the
    block's first token (`shift_to_targets`). The keys/values are each token's own.
    """
    b, t = ids_BxT.shape
    k_valid_BxS = jnp.asarray(valid_BxT, bool)
    if past is not None:
      k_valid_BxS = jnp.concatenate([jnp.asarray(past_valid_BxS, bool), k_valid_BxS], axis=1)
    mask = attn_lib.attention_mask(jnp.zeros((b, t), jnp.int32),
                                   jnp.zeros(k_valid_BxS.shape, jnp.int32), k_valid_BxS=k_valid_BxS)
    h_BxTxD, new_kvs, _ = self._trunk(ids_BxT, _positions(positions_BxT, b, t), mask, past)
    return self._targets(h_BxTxD, valid_BxT), new_kvs

  def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of `max_len` slots (dtype defaults to the compute dtype)."""
    cfg = self.config
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.compute_dtype
    return KVCache(k_LxBxSxKxH=jnp.zeros(shape, dtype), v_LxBxSxKxH=jnp.zeros(shape, dtype),
                   block_BxS=jnp.zeros((batch, max_len), jnp.int32),
                   valid_BxS=jnp.zeros((batch, max_len), bool),
                   length=jnp.zeros((), jnp.int32))

  def cached_logits(self, ids_BxT: jax.Array, cache: KVCache, *, positions_BxT: jax.Array,
                    commit: bool, block_size: int | None = None, valid_BxT=None):
    """Forward T new tokens against the cache: returns (logits [B, T, V], cache).

    `commit=False` (denoising step): the tokens are the noisy current block; they see every
    cached token of an earlier block and each other, and the cache is returned unchanged.
    `commit=True` (prefill, or caching a finished block): the tokens are clean, attend
    block-causally to the cache and themselves, and are written at slots [length, length + T).
    The caller keeps length + T <= max_len (out-of-range writes are clamped by XLA).
    Refused for a shifted family (Dream): it has no block-causal decoding (`forward_kv` is its
    cached forward).
    """
    self._refuse_shifted("cached block decoding")
    block_size = block_size or self.config.block_size
    if block_size is None:
      raise ValueError("cached decoding needs block_size (config has none)")
    b, t = ids_BxT.shape
    positions_BxT = _positions(positions_BxT, b, t)
    new_block_BxT = attn_lib.block_ids(positions_BxT, block_size)
    new_valid_BxT = jnp.ones((b, t), bool) if valid_BxT is None else jnp.asarray(valid_BxT, bool)
    noisy = not commit
    mask = attn_lib.attention_mask(
        new_block_BxT,
        jnp.concatenate([cache.block_BxS, new_block_BxT], axis=1),
        q_noisy_BxT=jnp.full((b, t), noisy),
        k_noisy_BxS=jnp.concatenate(
            [jnp.zeros(cache.block_BxS.shape, bool), jnp.full((b, t), noisy)], axis=1),
        k_valid_BxS=jnp.concatenate([cache.valid_BxS, new_valid_BxT], axis=1))
    past = [(cache.k_LxBxSxKxH[i], cache.v_LxBxSxKxH[i]) for i in range(self.config.n_layers)]
    h_BxTxD, new_kvs, _ = self._trunk(ids_BxT, positions_BxT, mask, past)
    logits_BxTxV = self._head(h_BxTxD)
    if commit:
      k_new = jnp.stack([k for k, _ in new_kvs]).astype(cache.k_LxBxSxKxH.dtype)
      v_new = jnp.stack([v for _, v in new_kvs]).astype(cache.v_LxBxSxKxH.dtype)
      start = (0, 0, cache.length, 0, 0)
      cache = KVCache(
          k_LxBxSxKxH=jax.lax.dynamic_update_slice(cache.k_LxBxSxKxH, k_new, start),
          v_LxBxSxKxH=jax.lax.dynamic_update_slice(cache.v_LxBxSxKxH, v_new, start),
          block_BxS=jax.lax.dynamic_update_slice(cache.block_BxS, new_block_BxT, (0, cache.length)),
          valid_BxS=jax.lax.dynamic_update_slice(cache.valid_BxS, new_valid_BxT, (0, cache.length)),
          length=cache.length + t)
    return logits_BxTxV, cache


def create(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised model."""
  return Transformer(cfg, rngs=nnx.Rngs(seed))
