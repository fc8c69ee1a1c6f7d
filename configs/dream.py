r"""StableDRL on a Dream model (Dream-v0-Instruct-7B, DiffuCoder-7B): full attention, shifted
prediction, its own sampler (`diffusion_generate`).

  python -m stabledrl_jax.main --config=configs/dream.py           # tiny: CPU, sorting digits
  python -m stabledrl_jax.main --config=configs/dream.py:smoke     # the same path, < 2 min (Sudoku)
  python -m stabledrl_jax.main --config=configs/dream.py:sudoku    # 4x4 Sudoku, weaker demonstrator
  python -m stabledrl_jax.main --config=configs/dream.py:7b \
      --config.model.checkpoint=/path/to/Dream-v0-Instruct-7B --workdir=gs://bucket/runs/dream7b \
      --config.task.source_dir=/path/to/gsm8k   # train.jsonl, test.jsonl; or --config.task.source=public
  # 7b fits a v5p-8 as it is; on a v6e-8 add --config.rl.accumulation=8 (docs/training.md, flags per accelerator)

Override any key with --config.a.b=value (e.g. --config.sampler.alg=maskgit_plus). The presets
are in `stabledrl_jax/presets.py`, every key's default in `stabledrl_jax/config_lib.py`.
"""
from stabledrl_jax import config_lib


def get_config(preset: str = "tiny"):
  return config_lib.config("dream", preset)
