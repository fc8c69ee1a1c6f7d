"""Model shapes and special token ids: one dataclass, one preset per published checkpoint."""
import dataclasses
from typing import Callable

# "llada": LLaMA-like, full attention. "sdar": Qwen3, block diffusion. "dream": Qwen2.5-like
# (biases on q/k/v), full attention, shifted prediction (Dream-v0-7B, DiffuCoder-7B).
FAMILIES = ("llada", "sdar", "dream")


# What a rematerialised block saves for the backward pass (`jax.checkpoint_policies`): nothing
# (the whole block is recomputed), every matmul output, or the matmuls without batch dimensions
# (the projections, not the attention scores).
REMAT_POLICIES = ("nothing", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("dense", "blockwise")
RUNTIME_OPTIONS = {"remat": False, "remat_policy": "nothing", "attention_impl": "dense",
                   "attention_tile": 512}


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
  compute_dtype: str = "bfloat16"
  remat: bool = False  # rematerialise each block in the backward pass
  remat_policy: str = "nothing"  # with remat, what a block keeps: REMAT_POLICIES
  attention_impl: str = "dense"  # "dense" (one masked softmax) or "blockwise" (key tiles)
  attention_tile: int = 512  # key positions per tile of the blockwise attention

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
    if self.family == "dream" and self.qk_norm:
      raise ValueError("family 'dream' has no q/k norm (Qwen2.5 attention); set qk_norm=False")
    if self.family == "dream" and self.head_dim * self.n_heads != self.d_model:
      raise ValueError(f"family 'dream' derives head_dim from d_model / n_heads: head_dim="
                       f"{self.head_dim} x n_heads={self.n_heads} != d_model={self.d_model}")

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
  def num_params(self) -> int:
    """Parameter count of the (untied) model."""
    d, h = self.d_model, self.head_dim
    attn = d * h * (2 * self.n_heads + 2 * self.n_kv_heads) + (2 * h if self.qk_norm else 0)
    attn += h * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
    block = attn + 3 * d * self.mlp_dim + 2 * d
    return 2 * self.vocab_size * d + self.n_layers * block + d


def replace(config: ModelConfig, **changes) -> ModelConfig:
  """A copy of `config` with fields changed (e.g. compute_dtype, remat)."""
  return dataclasses.replace(config, **changes)


def tiny(**changes) -> ModelConfig:
  """CPU tests and demos: 2 layers, D=64, GQA and q/k-norm on (SDAR family)."""
  base = ModelConfig(
      family="sdar", model_type="sdar", vocab_size=128, d_model=64, n_layers=2, n_heads=4,
      n_kv_heads=2, head_dim=16, mlp_dim=128, rope_theta=10000.0, norm_eps=1e-6, qk_norm=True,
      mask_token_id=127, eos_token_id=1, pad_token_id=0, stop_token_ids=(1,), block_size=4,
      max_seq_len=256, compute_dtype="float32")
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


def family_options(family: str) -> dict:
  """The architecture fields a family fixes, for building a config of another preset's shapes
  (e.g. `tiny(**family_options("dream"))`): model_type, q/k norm, and no block for the full
  attention families (SDAR keeps the preset's block size)."""
  if family not in FAMILIES:
    raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
  return {"llada": dict(family="llada", model_type="llada", qk_norm=False, block_size=None),
          "sdar": dict(family="sdar", model_type="sdar", qk_norm=True),
          "dream": dict(family="dream", model_type="Dream", qk_norm=False, block_size=None),
          }[family]


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "tiny": tiny, "bench_100m": bench_100m, "llada_8b": llada_8b,
    "sdar_1p7b": sdar_1p7b, "sdar_4b": sdar_4b, "sdar_8b": sdar_8b, "dream_7b": dream_7b,
}


def preset(name: str, **changes) -> ModelConfig:
  """Look up a preset by name, with optional field overrides."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
  return PRESETS[name](**changes)
