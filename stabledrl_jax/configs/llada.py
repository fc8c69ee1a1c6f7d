r"""StableDRL on a full-attention masked diffusion (LLaDA) model.

  python -m stabledrl_jax.main --config=configs/llada.py           # tiny: CPU, sorting digits
  python -m stabledrl_jax.main --config=configs/llada.py:smoke     # the same path, < 2 min (Sudoku)
  python -m stabledrl_jax.main --config=configs/llada.py:sudoku    # 4x4 Sudoku, weaker demonstrator
  python -m stabledrl_jax.main --config=configs/llada.py:8b \
      --config.model.checkpoint=/path/to/LLaDA-8B-Instruct --workdir=gs://bucket/runs/llada8b \
      --config.task.source_dir=/path/to/gsm8k   # train.jsonl, test.jsonl; or --config.task.source=public
  # 8b and 8b_official fit a v5p-8 as they are; on a v6e-8 add --config.rl.accumulation=8
  # (8b_official: 16) (BUILD.md, ahead-of-time fit check)

Override any key with --config.a.b=value (e.g. --config.rl.objective=grpo).
"""
from stabledrl_jax import config_lib


def get_config(preset: str = "tiny"):
  c = config_lib.base_config("llada")
  config_lib.apply_preset(c, preset)
  if preset in ("8b", "8b_official"):
    c.model.preset = "llada_8b"
    c.sampler.block_length = 32
    c.sampler.steps = 128  # rollouts: gen 256, block 32, 128 steps (docs/method.md §6)
  if preset == "8b":  # rollouts with the block-wise KV cache (README: Fast LLaDA rollouts)
    c.sampler.cache = "dual"
  c.lock()
  return c
