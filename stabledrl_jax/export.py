r"""Export a training run's policy as a Hugging Face directory:

  python -m stabledrl_jax.export --workdir=runs/llada_8b [--step=N] --out=DIR [--dtype=bfloat16]

The result is in the format of the checkpoint the run started from (its config.json keys, weight
names, tokenizer and other files, e.g. remote code), or in the family's format (LLaDA or SDAR) for
a model trained from scratch. A finished run exports itself to WORKDIR/hf (`train.run`).

A LoRA run (`config.model.lora`) writes DIR with the adapters merged into the weights, and beside it
DIR_adapter (`adapter_dir`; a finished run's WORKDIR/hf_adapter) with the adapters alone in PEFT's
format (`adapter_config.json` naming `model.checkpoint` as `base_model_name_or_path`,
`adapter_model.safetensors`), which `peft.PeftModel.from_pretrained(base, DIR_adapter)` and
`--config.model.lora_init=DIR_adapter` load.
"""
from __future__ import annotations

import os

from absl import flags
from flax import nnx

from stabledrl_jax import build, cli, distributed, lora, models, peft_format, storage

MAX_SHARD_BYTES = 5 * 2**30


def default_dtype(c) -> str | None:
  """The source checkpoint's stored dtype (its own format), else None (the parameter dtype)."""
  if not c.model.checkpoint:
    return None
  hf = models.huggingface.read_hf_config(c.model.checkpoint)
  dtype = hf.get("torch_dtype") or hf.get("dtype")
  return dtype if dtype in ("float32", "bfloat16", "float16") else None


def adapter_dir(out_dir: str | os.PathLike) -> str:
  """Where the export to `out_dir` writes a LoRA model's adapters alone: `out_dir` + "_adapter"."""
  return os.fspath(out_dir).rstrip("/") + "_adapter"


def export(c, model, out_dir: str | os.PathLike, *, dtype: str | None = None, replace: bool = False,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
  """Write `model` to `out_dir` in the run's source format; returns `out_dir`. A model with LoRA
  adapters is written merged (`lora.merge` of a clone: `model` keeps them), and its adapters
  alone to `adapter_dir(out_dir)` in PEFT's format."""
  adapted = lora.has_adapters(model)
  merged = lora.merge(nnx.clone(model)) if adapted else model  # new kernels, the rest shared
  models.export_pretrained(merged, out_dir, dtype=dtype or default_dtype(c),
                           max_shard_bytes=max_shard_bytes,
                           source_dir=c.model.checkpoint or None, replace=replace)
  if adapted:
    peft_format.export_peft(model, adapter_dir(out_dir),
                            base_model_name_or_path=c.model.checkpoint or None)
  return out_dir


def main(argv):
  c, workdir = cli.setup(argv, "workdir")
  f = flags.FLAGS
  if not workdir or not f.out:
    cli.fail("give --workdir=W (a training run) and --out=DIR")
  try:
    targets = [f.out] + ([adapter_dir(f.out)] if build.lora_config(c) else [])
    for target in targets:  # refused before anything is loaded
      if storage.path(target).is_dir() and any(storage.path(target).iterdir()):
        raise models.huggingface.ExportError(f"export target {target} exists and is not empty")
    model, _, step = cli.load_policy(c, workdir, f.step)
    export(c, model, f.out, dtype=f.dtype)
  except (cli.PolicyError, models.huggingface.ExportError, OSError, ValueError) as e:
    cli.fail(str(e))
  distributed.log(f"exported step {step} of {workdir} to {' and '.join(targets)}")


if __name__ == "__main__":
  cli.define_policy_flags("workdir")
  flags.DEFINE_string("out", None, "The Hugging Face directory to write (must not hold files); a "
                      "LoRA run's adapters alone go to OUT_adapter.")
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Stored dtype (default: "
                    "the source checkpoint's, or the parameters').")
  cli.start(main, "workdir")
