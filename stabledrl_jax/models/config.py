"""Model shapes and special token ids: one dataclass, one preset per published checkpoint."""
import dataclasses
from typing import Callable

# "llada": LLaMA-like, full attention. "sdar": Qwen3, block diffusion. "dream": Qwen2.5-like
# (biases on q/k/v), full attention, shifted prediction (Dream-v0-7B, DiffuCoder-7B). "llada2":
# LLaDA2.0 (inclusionAI's llada2_moe), block diffusion, mixture of experts (`models.moe`), fused
# query_key_value, q/k norm, partial rotary.
FAMILIES = ("llada", "sdar", "dream", "llada2")
# The families decoded and scored block by block (block-causal attention, the staircase likelihood).
BLOCK_DIFFUSION = ("sdar", "llada2")


# What a rematerialised block saves for the backward pass (`jax.checkpoint_policies`): nothing
# (the whole block is recomputed), every matmul output, or the matmuls without batch dimensions
# (the projections, not the attention scores).
REMAT_POLICIES = ("nothing", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("dense", "blockwise")
RUNTIME_OPTIONS = {"remat": False, "remat_policy": "nothing", "attention_impl": "dense",
                   "attention_tile": 512, "train_router": False, "moe_impl": "tiles"}


def runtime_options(model_config_dict) -> dict:
  """The execution options (not shapes) of a run config's `model` section, defaults filled in."""
  return {k: model_config_dict.get(k, default) for k, default in RUNTIME_OPTIONS.items()}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything the transformer and the checkpoint mapping need; hashable, so jit can close over it."""

  family: str  # one of FAMILIES; it also fixes `qkv_bias` and `shifted` (properties below)
  vocab_size: int  # rows of the embedding / columns of the head
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float
  norm_eps: float
  qk_norm: bool  # RMS norm per head on q and k before RoPE (Qwen3/SDAR)
  mask_token_id: int | None
  eos_token_id: int | None
  pad_token_id: int | None = None
  stop_token_ids: tuple[int, ...] = ()
  block_size: int | None = None  # SDAR's trained block length; None for full attention models
  model_type: str = ""  # the Hugging Face model_type written on export
  tie_word_embeddings: bool = False  # how the checkpoint stores the head; the model is always untied
  max_seq_len: int = 4096
  param_dtype: str = "float32"
  compute_dtype: str = "float32"  # as config.model.compute_dtype; the checkpoint presets: bfloat16
  remat: bool = False  # rematerialise each block in the backward pass
  remat_policy: str = "nothing"  # with remat, what a block keeps: REMAT_POLICIES
  attention_impl: str = "dense"  # "dense" (one masked softmax) or "blockwise" (key tiles)
  attention_tile: int = 512  # key positions per tile of the blockwise attention
  # Mixture of experts (family llada2, `models.moe`), named as LLaDA2.0's config.json names them.
  # num_experts 0: every layer is the dense SwiGLU of mlp_dim.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  n_group: int = 1  # expert groups; the choice keeps the topk_group best of them
  topk_group: int = 1
  moe_intermediate_size: int = 0  # each expert's MLP width
  num_shared_experts: int = 0  # one always-on SwiGLU of moe_intermediate_size x this
  first_k_dense_replace: int = 0  # layers below this index stay dense (mlp_dim)
  routed_scaling_factor: float = 1.0
  partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim x this) dims of each head
  train_router: bool = False  # RL/SFT update the router (the expert bias never has a gradient)
  moe_impl: str = "tiles"  # the experts' grouped matmuls: "tiles" | "ragged_dot" (models.moe)

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"unknown model family {self.family!r}; expected one of {FAMILIES}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"unknown remat_policy {self.remat_policy!r}; expected one of "
                       f"{REMAT_POLICIES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"unknown attention_impl {self.attention_impl!r}; expected one of "
                       f"{ATTENTION_IMPLS}")
    if self.attention_tile < 1:
      raise ValueError(f"attention_tile={self.attention_tile} must be >= 1")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
    if self.rotary_dim % 2 or self.rotary_dim < 2:
      raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim="
                       f"{self.rotary_dim}; it must be even and >= 2")
    if self.moe_impl not in ("ragged_dot", "tiles"):
      raise ValueError(f"unknown moe_impl {self.moe_impl!r}; expected 'ragged_dot' or 'tiles'")
    self._check_moe()
    if self.family == "dream" and self.qk_norm:
      raise ValueError("family 'dream' has no q/k norm (Qwen2.5 attention); set qk_norm=False")
    if self.family == "dream" and self.head_dim * self.n_heads != self.d_model:
      raise ValueError(f"family 'dream' derives head_dim from d_model / n_heads: head_dim="
                       f"{self.head_dim} x n_heads={self.n_heads} != d_model={self.d_model}")

  def _check_moe(self) -> None:
    if self.num_experts < 0:
      raise ValueError(f"num_experts={self.num_experts} must be >= 0 (0 = dense)")
    if self.num_experts and self.family != "llada2":
      raise ValueError(f"num_experts={self.num_experts}: family {self.family!r} has no mixture "
                       "of experts (family llada2 has)")
    if not self.num_experts:
      return
    e, k = self.num_experts, self.num_experts_per_tok
    if not 1 <= k <= e:
      raise ValueError(f"num_experts_per_tok={k} must lie in [1, num_experts={e}]")
    if self.n_group < 1 or e % self.n_group:
      raise ValueError(f"n_group={self.n_group} must divide num_experts={e}")
    if e // self.n_group < 2:
      raise ValueError(f"n_group={self.n_group} leaves {e // self.n_group} expert per group; a "
                       "group is scored by its two best experts: at most num_experts / 2 groups")
    if not 1 <= self.topk_group <= self.n_group:
      raise ValueError(f"topk_group={self.topk_group} must lie in [1, n_group={self.n_group}]")
    if k > self.topk_group * (e // self.n_group):
      raise ValueError(f"num_experts_per_tok={k} exceeds the {self.topk_group * (e // self.n_group)}"
                       f" experts of the topk_group={self.topk_group} kept groups")
    if self.moe_intermediate_size < 1:
      raise ValueError(f"moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
    if self.num_shared_experts < 0:
      raise ValueError(f"num_shared_experts={self.num_shared_experts} must be >= 0")
    if not 0 <= self.first_k_dense_replace <= self.n_layers:
      raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must lie in "
                       f"[0, n_layers={self.n_layers}]")

  @property
  def rotary_dim(self) -> int:
    """Dimensions of each head RoPE rotates (the first ones; the rest pass through)."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def fused_qkv(self) -> bool:
    """One `query_key_value` projection (LLaDA2.0) instead of q/k/v."""
    return self.family == "llada2"

  def is_moe_layer(self, layer: int) -> bool:
    return self.num_experts > 0 and layer >= self.first_k_dense_replace

  @property
  def qkv_bias(self) -> bool:
    """The q, k and v projections add a bias (Qwen2.5, hence Dream); o_proj has none."""
    return self.family == "dream"

  @property
  def shifted(self) -> bool:
    """The trunk's state at slot i predicts token i + 1, as in the autoregressive model Dream
    was initialised from; the transformer shifts it back so that logits at i predict token i."""
    return self.family == "dream"

  @property
  def active_mlp_params(self) -> int:
    """The MLP weights one token is multiplied by, over all layers: the dense SwiGLU's, or the
    router's plus its chosen and the shared experts' (FLOP counts, `flops.forward_flops`)."""
    d = self.d_model
    moe = (3 * d * self.moe_intermediate_size * (self.num_experts_per_tok + self.num_shared_experts)
           + d * self.num_experts)
    return sum(moe if self.is_moe_layer(i) else 3 * d * self.mlp_dim for i in range(self.n_layers))

  @property
  def num_params(self) -> int:
    """Parameter count of the (untied) model."""
    d, h = self.d_model, self.head_dim
    attn = d * h * (2 * self.n_heads + 2 * self.n_kv_heads) + (2 * h if self.qk_norm else 0)
    attn += h * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
    dense, moe = 3 * d * self.mlp_dim, 0
    if self.num_experts:
      moe = (3 * d * self.moe_intermediate_size * (self.num_experts + self.num_shared_experts)
             + d * self.num_experts + self.num_experts)
    n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
    blocks = self.n_layers * (attn + 2 * d) + (self.n_layers - n_moe) * dense + n_moe * moe
    return 2 * self.vocab_size * d + blocks + d


def replace(config: ModelConfig, **changes) -> ModelConfig:
  """A copy of `config` with fields changed (e.g. compute_dtype, remat)."""
  return dataclasses.replace(config, **changes)


def tiny(**changes) -> ModelConfig:
  """CPU tests and demos: 2 layers, D=64, GQA and q/k-norm on (SDAR family)."""
  base = ModelConfig(
      family="sdar", model_type="sdar", vocab_size=128, d_model=64, n_layers=2, n_heads=4,
      n_kv_heads=2, head_dim=16, mlp_dim=128, rope_theta=10000.0, norm_eps=1e-6, qk_norm=True,
      mask_token_id=127, eos_token_id=1, pad_token_id=0, stop_token_ids=(1,), block_size=4,
      max_seq_len=256)
  return dataclasses.replace(base, **changes)


def bench_100m(**changes) -> ModelConfig:
  """~100M parameters (12 x 768, GQA 12/4, vocab 16384) for CPU/GPU throughput benchmarks."""
  base = ModelConfig(
      family="sdar", model_type="qwen3", vocab_size=16384, d_model=768, n_layers=12, n_heads=12,
      n_kv_heads=4, head_dim=64, mlp_dim=2048, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
      mask_token_id=16383, eos_token_id=1, pad_token_id=0, stop_token_ids=(1,), block_size=4,
      max_seq_len=2048)
  return dataclasses.replace(base, **changes)


def llada_8b(**changes) -> ModelConfig:
  """GSAI-ML/LLaDA-8B-Instruct (docs/method.md §6): LLaMA-like MHA, full attention."""
  base = ModelConfig(
      family="llada", model_type="llada", vocab_size=126464, d_model=4096, n_layers=32,
      n_heads=32, n_kv_heads=32, head_dim=128, mlp_dim=12288, rope_theta=500000.0,
      norm_eps=1e-5, qk_norm=False, mask_token_id=126336, eos_token_id=126081,
      pad_token_id=126081, stop_token_ids=(126081, 126348), block_size=None, max_seq_len=4096)
  return dataclasses.replace(base, **changes)


def _sdar(n_layers, d_model, mlp_dim, n_heads, tied, changes) -> ModelConfig:
  # SDAR keeps the Qwen3 shapes and tokenizer; its mask token <|MASK|> is 151669.
  base = ModelConfig(
      family="sdar", model_type="sdar", vocab_size=151936, d_model=d_model, n_layers=n_layers,
      n_heads=n_heads, n_kv_heads=8, head_dim=128, mlp_dim=mlp_dim, rope_theta=1e6,
      norm_eps=1e-6, qk_norm=True, mask_token_id=151669, eos_token_id=151643,
      pad_token_id=151643, stop_token_ids=(151643, 151645), block_size=4,
      tie_word_embeddings=tied, max_seq_len=32768)
  return dataclasses.replace(base, **changes)


def sdar_1p7b(**changes) -> ModelConfig:
  """JetLM/SDAR-1.7B-Chat: Qwen3-1.7B shapes (28 x 2048, 16/8 heads, MLP 6144, tied embeddings)."""
  return _sdar(28, 2048, 6144, 16, True, changes)


def sdar_4b(**changes) -> ModelConfig:
  """JetLM/SDAR-4B-Chat: Qwen3-4B shapes (36 x 2560, 32/8 heads, MLP 9728, tied embeddings)."""
  return _sdar(36, 2560, 9728, 32, True, changes)


def sdar_8b(**changes) -> ModelConfig:
  """JetLM/SDAR-8B-Chat (docs/method.md §6): 36 x 4096, 32/8 heads, MLP 12288, untied head."""
  return _sdar(36, 4096, 12288, 32, False, changes)


def dream_7b(**changes) -> ModelConfig:
  """Dream-org/Dream-v0-Instruct-7B (its config.json): Qwen2.5-7B shapes (28 x 3584, GQA 28/4,
  head 128, MLP 18944, vocab 152064, untied head), mask <|mask|> 151666, end of text 151643 (also
  pad), and the chat template's end of turn <|im_end|> 151645 as a second stop token."""
  base = ModelConfig(
      family="dream", model_type="Dream", vocab_size=152064, d_model=3584, n_layers=28,
      n_heads=28, n_kv_heads=4, head_dim=128, mlp_dim=18944, rope_theta=1e6, norm_eps=1e-6,
      qk_norm=False, mask_token_id=151666, eos_token_id=151643, pad_token_id=151643,
      stop_token_ids=(151643, 151645), block_size=None, tie_word_embeddings=False,
      max_seq_len=131072)
  return dataclasses.replace(base, **changes)


def llada2_tiny(**changes) -> ModelConfig:
  """CPU tests and the tiny main job of LLaDA2.0's architecture: 2 layers (the first dense),
  8 experts in 4 groups (2 kept), 2 active, 1 shared, partial rotary; block diffusion."""
  base = ModelConfig(
      family="llada2", model_type="llada2_moe", vocab_size=128, d_model=64, n_layers=2,
      n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128, rope_theta=600000.0, norm_eps=1e-6,
      qk_norm=True, mask_token_id=127, eos_token_id=1, pad_token_id=0, stop_token_ids=(1,),
      block_size=4, max_seq_len=256, compute_dtype="float32", num_experts=8,
      num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=64,
      num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
      partial_rotary_factor=0.5)
  return dataclasses.replace(base, **changes)


def _llada2(n_layers, d_model, n_heads, mlp_dim, moe_dim, changes) -> ModelConfig:
  # inclusionAI/LLaDA2.0-mini's config.json (flash's differs in the arguments): head 128, 4 KV
  # heads, 256 experts in 8 groups (4 kept), 8 active, 1 shared, first layer dense, scaling 2.5,
  # sigmoid router, partial rotary 0.5, rope theta 600000, rms eps 1e-6, vocab 157184, 32768
  # positions, untied head; eos = pad = 156892 and mask 156895 (the remote code's `generate`
  # defaults); block 32 (`generate`'s block_length default).
  base = ModelConfig(
      family="llada2", model_type="llada2_moe", vocab_size=157184, d_model=d_model,
      n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, head_dim=128, mlp_dim=mlp_dim,
      rope_theta=600000.0, norm_eps=1e-6, qk_norm=True, mask_token_id=156895,
      eos_token_id=156892, pad_token_id=156892, stop_token_ids=(156892,), block_size=32,
      max_seq_len=32768, num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
      moe_intermediate_size=moe_dim, num_shared_experts=1, first_k_dense_replace=1,
      routed_scaling_factor=2.5, partial_rotary_factor=0.5)
  return dataclasses.replace(base, **changes)


def llada2_mini(**changes) -> ModelConfig:
  """inclusionAI/LLaDA2.0-mini (16B, 1.4B active): 20 x 2048, 16/4 heads, dense MLP 5120,
  expert MLP 512."""
  return _llada2(20, 2048, 16, 5120, 512, changes)


def llada2_flash(**changes) -> ModelConfig:
  """inclusionAI/LLaDA2.0-flash (100B, 6.1B active): 32 x 4096, 32/4 heads, dense MLP 9216,
  expert MLP 1024."""
  return _llada2(32, 4096, 32, 9216, 1024, changes)


def family_options(family: str) -> dict:
  """The architecture fields a family fixes, for building a config of another preset's shapes
  (e.g. `tiny(**family_options("dream"))`): model_type, q/k norm, and no block for the full
  attention families (SDAR keeps the preset's block size)."""
  if family not in FAMILIES:
    raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
  return {"llada": dict(family="llada", model_type="llada", qk_norm=False, block_size=None),
          "sdar": dict(family="sdar", model_type="sdar", qk_norm=True),
          "dream": dict(family="dream", model_type="Dream", qk_norm=False, block_size=None),
          "llada2": dict(family="llada2", model_type="llada2_moe", qk_norm=True),
          }[family]


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": tiny, "bench_100m": bench_100m, "llada_8b": llada_8b,
    "sdar_1p7b": sdar_1p7b, "sdar_4b": sdar_4b, "sdar_8b": sdar_8b, "dream_7b": dream_7b,
    "llada2_tiny": llada2_tiny, "llada2_mini": llada2_mini, "llada2_flash": llada2_flash,
}


def preset(name: str, **changes) -> ModelConfig:
  """Look up a preset by name, with optional field overrides."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
  return PRESETS[name](**changes)
