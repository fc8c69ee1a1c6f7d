r"""StableDRL on a full-attention masked diffusion (LLaDA) model.

  python -m stabledrl_jax.main --config=configs/llada.py           # tiny: CPU, sorting digits
      # ~5 min on one core; held-out exactly sorted ~0.35 -> ~0.76 (docs/results.md, 3 seeds)
  python -m stabledrl_jax.main --config=configs/llada.py:smoke     # the same path, < 2 min (Sudoku)
  python -m stabledrl_jax.main --config=configs/llada.py:sudoku    # 4x4 Sudoku, weaker demonstrator
  python -m stabledrl_jax.main --config=configs/llada.py:8b \
      --config.model.checkpoint=/path/to/LLaDA-8B-Instruct --workdir=gs://bucket/runs/llada8b \
      --config.task.source_dir=/path/to/gsm8k   # train.jsonl, test.jsonl; or --config.task.source=public
  # 8b and 8b_official fit a v5p-8 as they are; on a v6e-8 add --config.rl.accumulation=8
  # (8b_official: 16) (docs/training.md, flags per accelerator)
  # 8b_lora: the 8b run training LoRA adapters alone (d1's r=128, alpha 64, dropout 0.05,
  # lr 3e-6); it exports WORKDIR/hf (merged) and WORKDIR/hf_adapter (PEFT). It fits a v6e-4 with
  # --config.sampler.chunk=128, a v5e-8 with --config.rl.accumulation=16 --config.sampler.chunk=64
  python -m stabledrl_jax.main --config=configs/llada.py:8b_ar ...  # JustGRPO; 8b's flags

Override any key with --config.a.b=value (e.g. --config.rl.objective=grpo). The presets are in
`stabledrl_jax/presets.py`, every key's default in `stabledrl_jax/config_lib.py`.
"""
from stabledrl_jax import config_lib


def get_config(preset: str = "tiny"):
  return config_lib.config("llada", preset)
