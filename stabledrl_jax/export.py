r"""Export a training run's policy as a Hugging Face directory:

  python -m stabledrl_jax.export --workdir=runs/llada_8b [--step=N] --out=DIR [--dtype=bfloat16]

The result is in the format of the checkpoint the run started from (its config.json keys, weight
names, tokenizer and other files, e.g. remote code), or in the family's format (LLaDA or SDAR) for
a model trained from scratch. A finished run exports itself to WORKDIR/hf (`train.run`).
"""
from __future__ import annotations

import os

from absl import flags

from stabledrl_jax import cli, distributed, models

MAX_SHARD_BYTES = 5 * 2**30


def default_dtype(c) -> str | None:
  """The source checkpoint's stored dtype (its own format), else None (the parameter dtype)."""
  if not c.model.checkpoint:
    return None
  hf = models.huggingface.read_hf_config(c.model.checkpoint)
  dtype = hf.get("torch_dtype") or hf.get("dtype")
  return dtype if dtype in ("float32", "bfloat16", "float16") else None


def export(c, model, out_dir: str, *, dtype: str | None = None, replace: bool = False,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
  """Write `model` to `out_dir` in the run's source format; returns `out_dir`."""
  models.export_pretrained(model, out_dir, dtype=dtype or default_dtype(c),
                           max_shard_bytes=max_shard_bytes,
                           source_dir=c.model.checkpoint or None, replace=replace)
  return out_dir


def main(argv):
  c, workdir = cli.setup(argv, "workdir")
  f = flags.FLAGS
  if not workdir or not f.out:
    cli.fail("give --workdir=W (a training run) and --out=DIR")
  try:
    if os.path.isdir(f.out) and os.listdir(f.out):  # refused before anything is loaded
      raise models.huggingface.ExportError(f"export target {f.out} exists and is not empty")
    model, _, step = cli.load_policy(c, workdir, f.step)
    export(c, model, f.out, dtype=f.dtype)
  except (cli.PolicyError, models.huggingface.ExportError, OSError, ValueError) as e:
    cli.fail(str(e))
  distributed.log(f"exported step {step} of {workdir} to {f.out}")


if __name__ == "__main__":
  cli.define_policy_flags("workdir")
  flags.DEFINE_string("out", None, "The Hugging Face directory to write (must not hold files).")
  flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"], "Stored dtype (default: "
                    "the source checkpoint's, or the parameters').")
  cli.start(main, "workdir")
