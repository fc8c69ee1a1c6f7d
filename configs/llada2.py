r"""StableDRL on LLaDA2.0 (inclusionAI's block-diffusion mixture of experts, docs/llada2.md).

  python -m stabledrl_jax.main --config=configs/llada2.py            # tiny: CPU, sorting digits
  python -m stabledrl_jax.main --config=configs/llada2.py:smoke      # the same path in minutes
  python -m stabledrl_jax.main --config=configs/llada2.py:mini \
      --config.model.checkpoint=/path/to/LLaDA2.0-mini --workdir=gs://bucket/runs/llada2mini \
      --config.task.source_dir=/path/to/gsm8k   # train.jsonl, test.jsonl; or --config.task.source=public
  # flash: the same with --config.model.checkpoint=/path/to/LLaDA2.0-flash. Ahead of time
  # (docs/llada2.md): mini with LoRA fits a v6e-8, flash with LoRA a v5p-16, mini's full
  # fine-tuning a v5p-16 (not a v5p-8).

tiny: 4 layers of D=128 (the first dense), 8 experts of width 64 in 4 groups (2 kept), 2 active
and 1 shared (`models.llada2_tiny`), block diffusion with SDAR's defaults. The router is frozen
unless --config.model.train_router=True. Expert parallelism: --config.mesh.expert=N.

Override any key with --config.a.b=value. The presets are in `stabledrl_jax/presets.py`, every
key's default in `stabledrl_jax/config_lib.py`.
"""
from stabledrl_jax import config_lib


def get_config(preset: str = "tiny"):
  return config_lib.config("llada2", preset)
