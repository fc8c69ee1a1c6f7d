r"""StableDRL on a block-diffusion (SDAR) model.

  python -m stabledrl_jax.main --config=configs/sdar.py            # tiny: CPU, sorting digits
      # ~4 min on 2 cores; held-out exactly sorted ~0.34 -> ~0.75 (docs/results.md, 3 seeds)
  python -m stabledrl_jax.main --config=configs/sdar.py:smoke      # the same path, < 2 min (Sudoku)
  python -m stabledrl_jax.main --config=configs/sdar.py:sudoku     # 4x4 Sudoku, weaker demonstrator
  python -m stabledrl_jax.main --config=configs/sdar.py:8b \
      --config.model.checkpoint=/path/to/SDAR-8B-Chat --workdir=gs://bucket/runs/sdar8b \
      --config.task.source_dir=/path/to/gsm8k   # train.jsonl, test.jsonl; or --config.task.source=public
  # 8b fits a v5p-8 as it is; on a v6e-8 add (docs/training.md, flags per accelerator):
  #   --config.model.attention_impl=blockwise --config.rl.accumulation=16
  # 8b_lora: the 8b run training LoRA adapters alone (d1's r=128, alpha 64, dropout 0.05,
  # lr 3e-6); it exports WORKDIR/hf (merged) and WORKDIR/hf_adapter (PEFT). It fits a v6e-4 with
  # --config.model.attention_impl=blockwise --config.rl.accumulation=16; not a v5e-8

Override any key with --config.a.b=value (e.g. --config.rl.objective=grpo). The presets are in
`stabledrl_jax/presets.py`, every key's default in `stabledrl_jax/config_lib.py`.
"""
from stabledrl_jax import config_lib


def get_config(preset: str = "tiny"):
  return config_lib.config("sdar", preset)
