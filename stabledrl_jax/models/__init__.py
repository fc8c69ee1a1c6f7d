"""Models: one NNX transformer for LLaDA, SDAR, Dream and LLaDA2.0 (MoE), attention masks, Hugging Face checkpoints."""
from stabledrl_jax.models.attention import (attention_mask, block_causal_mask, block_ids,
                                            full_mask, staircase_mask)
from stabledrl_jax.models.config import (PRESETS, ModelConfig, bench_100m, dream_7b,
                                         BLOCK_DIFFUSION, family_options, llada2_flash,
                                         llada2_mini, llada2_tiny, llada_8b, preset, replace,
                                         runtime_options, sdar_1p7b, sdar_4b, sdar_8b, tiny)
from stabledrl_jax.models.transformer import KVCache, Transformer, create, shift_to_targets
from stabledrl_jax.models.hf_config import config_from_hf, config_to_hf
from stabledrl_jax.models.huggingface import (CheckpointError, ExportError, export_pretrained,
                                             load_pretrained)
from stabledrl_jax.models.weights import param_sharding, weight_specs
