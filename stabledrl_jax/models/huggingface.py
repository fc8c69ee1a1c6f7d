"""Hugging Face checkpoints <-> the NNX transformer: LLaDA, SDAR, Qwen3 (docs/method.md §6),
Dream (Dream-org/Dream-v0-Instruct-7B's format: model_type "Dream", Qwen2 tensor names) and
LLaDA2.0 (inclusionAI's format: model_type "llada2_moe", one tensor per expert).

The family's config.json keys are `hf_config`'s, the tensors' names and layouts `weights`', the
tokenizer's special tokens `hf_tokenizer`'s. Loading reads `config.json`, builds the model abstractly (no parameter memory), then streams
the safetensors tensor by tensor into (sharded) device arrays: the host holds one tensor (or,
across processes, one slice of it) at a time.
"""
import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from stabledrl_jax import storage
from stabledrl_jax.models import hf_config, hf_tokenizer, safetensors_io
from stabledrl_jax.models.config import ModelConfig
from stabledrl_jax.models.transformer import Transformer
from stabledrl_jax.models.weights import param_sharding, variable, weight_specs


class CheckpointError(ValueError):
  """A checkpoint that does not match the model: names the tensor and the shapes."""


def read_hf_config(hf_dir: str | storage.Path) -> dict:
  """The parsed config.json of a checkpoint directory (refused if half-written)."""
  hf_dir = storage.path(hf_dir)
  storage.check_complete(hf_dir)
  path = hf_dir / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"missing {path}")
  return json.loads(path.read_text())


def load_pretrained(hf_dir: str, *, dtype: str = "bfloat16", param_dtype: str = "float32",
                    mesh: Mesh | None = None, rules: dict | None = None,
                    options: dict | None = None) -> tuple[Transformer, ModelConfig]:
  """Load a LLaDA / SDAR / Qwen3 / Dream checkpoint; `dtype` is the compute dtype, `options` the
  execution options of the model config (remat, remat_policy, attention_impl, attention_tile).

  With a mesh, each tensor goes straight to its NamedSharding and each process reads from disk
  only its share of every tensor (`safetensors_io.read_sharded`), so no full copy of the model
  ever sits in host memory and the bytes each process reads fall with the number of processes.
  """
  hf = read_hf_config(hf_dir)
  cfg = hf_config.config_from_hf(hf, compute_dtype=dtype, param_dtype=param_dtype)
  cfg = dataclasses.replace(cfg, stop_token_ids=hf_tokenizer.stop_token_ids(hf_dir, hf) or cfg.stop_token_ids,
                            mask_token_id=hf_config.first_set(cfg.mask_token_id,
                                                              hf_tokenizer.mask_token_id(hf_dir)))
  cfg = dataclasses.replace(cfg, **(options or {}))
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  reader = safetensors_io.Reader(hf_dir)
  specs = weight_specs(cfg)
  stacked = {}  # path -> its per-slice specs (LLaDA2.0's experts)
  for spec in specs:
    if spec.index is not None:
      stacked.setdefault(spec.path, []).append(spec)
  for path, parts in stacked.items():
    target = variable(model, path)
    shape = tuple(target.get_value().shape)
    for spec in parts:
      _check(reader, spec.hf_name, shape[1:][::-1] if spec.transpose else shape[1:], hf_dir)
    if mesh is None:
      host = np.empty(shape, param_dtype)
      for spec in parts:
        raw = reader.read(spec.hf_name)
        host[spec.index] = (raw.T if spec.transpose else raw).astype(param_dtype)
      value = jax.device_put(host)
    else:  # each device's experts and part of each, read slice by slice
      value = safetensors_io.read_stacked(
          reader, [spec.hf_name for spec in sorted(parts, key=lambda p: p.index)],
          transpose=parts[0].transpose, dtype=param_dtype,
          sharding=param_sharding(mesh, parts[0].logical_axes, shape, rules))
    target.set_value(value)
  for spec in specs:
    if spec.index is not None:
      continue
    target = variable(model, spec.path)
    shape = tuple(target.get_value().shape)
    hf_name = spec.hf_name
    if hf_name not in reader and spec.path == ("head", "kernel") and cfg.tie_word_embeddings:
      hf_name = weight_specs(cfg)[0].hf_name  # tied checkpoints store the head as the embedding
    _check(reader, hf_name, shape[::-1] if spec.transpose else shape, hf_dir)
    if mesh is None:
      host = reader.read(hf_name)
      value = jax.device_put((host.T if spec.transpose else host).astype(param_dtype))
    else:
      value = safetensors_io.read_sharded(
          reader, hf_name, transpose=spec.transpose, dtype=param_dtype,
          sharding=param_sharding(mesh, spec.logical_axes, shape, rules))
    target.set_value(value)
  return model, cfg


def _check(reader, name: str, want: tuple, hf_dir: str) -> None:
  """The checkpoint holds tensor `name` with the on-disk shape `want`."""
  if name not in reader:
    raise CheckpointError(f"missing tensor {name!r} in {hf_dir}")
  if reader.shape(name) != want:
    raise CheckpointError(f"tensor {name!r} has shape {reader.shape(name)}, expected {want}")


class ExportError(ValueError):
  """An export that would lose data: a target that exists and is not empty, or adapters."""


def export_pretrained(model: Transformer, out_dir: str | storage.Path, *, dtype: str | None = None,
                      max_shard_bytes: int = 5 * 2**30, source_dir: str | None = None,
                      replace: bool = False) -> None:
  """Write `model` as a Hugging Face directory: safetensors (sharded with an index above
  `max_shard_bytes`, one tensor on the host at a time) + config.json, the head always untied.

  `dtype` defaults to the parameter dtype (lossless). With `source_dir` (the checkpoint the run
  started from) the result keeps that checkpoint's format: its config.json keys and every other
  file (tokenizer, generation config, remote code) are carried over. Everything is written into
  `out_dir + ".partial"`, renamed to `out_dir` at the end, so a killed export never looks complete;
  a bucket has no rename, so there `out_dir` holds `storage.IN_PROGRESS` from the first write to
  the last, and readers (`read_hf_config`) refuse it meanwhile. A non-empty `out_dir` is refused
  unless `replace` (then it is swapped out only at the end; in a bucket, overwritten).
  A model with LoRA adapters is refused: merge them first (`lora.merge`), as `export.export`
  does, which also writes the adapters alone.
  """
  out_dir = storage.path(out_dir)
  if out_dir.is_dir() and any(out_dir.iterdir()) and not replace:
    raise ExportError(f"export target {out_dir} exists and is not empty")
  if out_dir.exists() and not out_dir.is_dir():
    raise ExportError(f"export target {out_dir} exists and is not a directory")
  if jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
    raise ExportError("the model has LoRA adapters, which this format cannot hold: export "
                      "lora.merge(nnx.clone(model)), or use export.export (it writes both)")
  cfg = model.config
  dtype = np.dtype(dtype or cfg.param_dtype)
  specs = {s.hf_name: s for s in weight_specs(cfg)}
  tensors = []
  for name, spec in specs.items():
    shape = tuple(variable(model, spec.path).get_value().shape)
    shape = shape[1:] if spec.index is not None else shape
    tensors.append((name, shape[::-1] if spec.transpose else shape, dtype))

  def fetch(name: str) -> np.ndarray:
    spec = specs[name]
    value = variable(model, spec.path).get_value()
    if spec.index is not None:
      value = value[spec.index]
    if not value.is_fully_addressable:
      from jax.experimental import multihost_utils
      value = multihost_utils.process_allgather(value, tiled=True)
    host = np.asarray(jax.device_get(value))
    return host.T if spec.transpose else host

  if jax.process_index() != 0:
    for name, _, _ in tensors:  # every process joins the gathers
      fetch(name)
    return
  remote = storage.is_remote(out_dir)
  partial = out_dir if remote else out_dir.with_name(out_dir.name + ".partial")
  if remote:
    (out_dir / storage.IN_PROGRESS).write_text("")
  else:
    if partial.exists():  # an earlier export killed half way
      partial.rmtree()
    partial.mkdir(parents=True)
  written = {storage.IN_PROGRESS}
  hf_json = hf_config.config_to_hf(cfg)
  hf_json["torch_dtype"] = str(dtype)
  if "dtype" in hf_json:  # the newer transformers key, where the family's format has it
    hf_json["dtype"] = str(dtype)
  if source_dir is not None:
    for src in storage.path(source_dir).iterdir():
      if (src.is_file() and not src.name.endswith(".safetensors")
          and src.name not in (safetensors_io.INDEX_FILE, "config.json", storage.IN_PROGRESS)):
        src.copy(partial / src.name, overwrite=True)
        written.add(src.name)
    source = read_hf_config(source_dir)
    hf_json = {**source, **hf_json, "eos_token_id": source.get("eos_token_id")}
    if cfg.family == "llada":
      hf_json["weight_tying"] = False
    else:
      hf_json["tie_word_embeddings"] = False
  written.update(safetensors_io.write_checkpoint(partial, tensors, fetch, max_shard_bytes))
  (partial / "config.json").write_text(json.dumps(hf_json, indent=2))
  written.update((safetensors_io.INDEX_FILE, "config.json"))
  generation_config = hf_config.generation_config_to_hf(cfg)
  generation_path = partial / "generation_config.json"
  if generation_config is not None and "generation_config.json" not in written:
    generation_path.write_text(json.dumps(generation_config, indent=2))
    written.add(generation_path.name)
  if remote:
    for stale in out_dir.iterdir():  # an earlier export's files
      if stale.name not in written:
        stale.rmtree() if stale.is_dir() else stale.unlink()
    (out_dir / storage.IN_PROGRESS).unlink()
  elif out_dir.exists():
    old = out_dir.with_name(out_dir.name + ".old")
    if old.exists():
      old.rmtree()
    os.replace(out_dir, old)
    os.replace(partial, out_dir)
    old.rmtree()
  else:
    os.replace(partial, out_dir)
