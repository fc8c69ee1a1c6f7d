"""What a run is built from, each from the config: the typed settings of every module
(`settings`), the task, tokenizer, device meshes, model and this process's data iterators
(`train.run` calls them once, before anything is trained or written; the commands too).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, NamedTuple

import jax
import ml_collections
from flax import nnx
from jax.experimental import multihost_utils

from stabledrl_jax import (config_lib, controls, detectors, distributed, lora, models, peft_format,
                           rl, rollouts, sft, sharding, storage, tasks)
from stabledrl_jax.rollouts import DreamSampling, LLaDASampling, SDARSampling
from stabledrl_jax.tasks import base, datasets, pipeline
from stabledrl_jax.tasks.tokenizer import CharTokenizer, HFTokenizer


class Settings(NamedTuple):
  """The config as the typed settings the run's modules take (`settings`)."""
  sft: sft.Settings
  rl: rl.Settings
  eval_sampling: LLaDASampling | SDARSampling | DreamSampling  # greedy; exact unless eval.fast
  monitor: detectors.MonitorConfig
  controls: controls.ControlConfig
  lora: lora.LoraConfig | None  # the adapters (`lora_config`); None: full fine-tuning


def settings(c: ml_collections.ConfigDict) -> Settings:
  """`config_lib.validate`, then every section's settings class (each checks its own keys); the
  first bad key raises `ValueError` naming it."""
  config_lib.validate(c)
  reward_fn(c, task(c))
  rl_settings = rl.Settings.from_config(c)
  return Settings(sft.Settings.from_config(c), rl_settings, eval_sampling(c),
                  detectors.MonitorConfig.from_config(c.stability),
                  controls.ControlConfig.from_config(c, rl_settings.objective), lora_config(c))


def eval_sampling(c: ml_collections.ConfigDict, temperature: float = 0.0):
  """The held-out evaluation's sampler: the config's at `temperature`, exact unless `eval.fast`."""
  sampling = rollouts.sampling_from_config(c, temperature)
  return sampling if c.eval.fast else sampling.exact()


def task(c: ml_collections.ConfigDict) -> tasks.Task:
  """The config's task (`tasks.from_config`), with errors naming `config.task.name`."""
  try:
    t = tasks.from_config(c.task)
  except KeyError as e:
    raise ValueError(f"config.task.name={c.task.name!r}: {e.args[0]}") from e
  if c.sft.steps and t.reference_completion is None and t.demonstrate is None:
    raise ValueError(f"config.sft.steps={c.sft.steps}: task {c.task.name!r} has no "
                     "reference_completion to train on; set 0")
  return t


def reward_fn(c: ml_collections.ConfigDict, t: tasks.Task) -> base.WeightedReward:
  """The config's weighted reward (`task.reward_weights`, `task.invalid_reward`), checked where
  computed (`base.WeightedReward`)."""
  try:
    return t.reward_fn(dict(c.task.reward_weights), c.task.invalid_reward)
  except KeyError as e:
    raise ValueError(f"config.task.reward_weights: {e.args[0]}") from e


def check_reward(t: tasks.Task, fn: base.WeightedReward, examples: list) -> None:
  """`base.check_reward` on a few examples before anything runs (a reward that raises or returns
  a non-number stops here); a warning when no reference completion is graded correct."""
  correct, graded = base.check_reward(t, fn, examples)
  if graded and not correct:
    distributed.log(f"warning: task {t.name!r}: none of {graded} reference completions is graded "
                    "correct (check the task's checker and answer field)")


def tokenizer(c: ml_collections.ConfigDict):
  if c.model.tokenizer == "char":
    return CharTokenizer()
  return HFTokenizer(c.model.tokenizer if storage.path(c.model.tokenizer).is_dir()
                     else c.model.checkpoint)


def mesh(c: ml_collections.ConfigDict):
  """The device mesh of `config.mesh` (`data`, `fsdp`, `tensor`; -1 = the rest)."""
  try:
    return sharding.make_mesh(c.mesh.to_dict())
  except ValueError as e:
    raise ValueError(f"config.mesh={c.mesh.to_dict()}: {e}") from e


def rollout_mesh(c: ml_collections.ConfigDict, mesh):
  """The mesh of `config.rollout_mesh` over `mesh`'s devices, or None (roll out on `mesh`)."""
  sizes = c.rollout_mesh.to_dict()
  if not any(sizes.values()):
    return None
  if not all(sizes.values()):
    raise ValueError(f"config.rollout_mesh={sizes}: give every axis a size (-1 for the rest), "
                     "or leave all 0 to roll out on the training mesh")
  try:
    return sharding.make_mesh(sizes, mesh.devices.flat)
  except ValueError as e:
    raise ValueError(f"config.rollout_mesh={sizes}: {e}") from e


def model(c: ml_collections.ConfigDict, tokenizer, mesh=None) -> nnx.Module:
  """A random tiny model sized by the config, or a pretrained checkpoint, sharded on `mesh`, with
  the config's LoRA adapters (`adapt`)."""
  return adapt(c, base_model(c, tokenizer, mesh))


def base_model(c: ml_collections.ConfigDict, tokenizer, mesh=None) -> nnx.Module:
  """A random tiny model sized by the config (seed `config.seed`), or a pretrained checkpoint,
  sharded on `mesh`."""
  if c.model.checkpoint:
    model, _ = models.load_pretrained(c.model.checkpoint, dtype=c.model.compute_dtype,
                                      param_dtype=c.model.param_dtype, mesh=mesh if mesh is not None and mesh.size > 1 else None,
                                      options=models.runtime_options(c.model))
    return model
  family = models.family_options(c.family)  # model_type, q/k norm, no block for full attention
  if c.family in models.BLOCK_DIFFUSION:
    family["block_size"] = c.sampler.block_length
  cfg = models.preset(
      c.model.preset, vocab_size=tokenizer.vocab_size,
      d_model=c.model.d_model, n_layers=c.model.n_layers, n_heads=c.model.n_heads,
      n_kv_heads=c.model.n_kv_heads, head_dim=c.model.d_model // c.model.n_heads,
      mlp_dim=c.model.mlp_dim, mask_token_id=tokenizer.mask_id,
      eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
      stop_token_ids=(tokenizer.eos_id,), compute_dtype=c.model.compute_dtype,
      param_dtype=c.model.param_dtype, **family, **models.runtime_options(c.model))
  if mesh is not None and mesh.size > 1:
    return sharding.create_model(cfg, c.seed, mesh)
  return models.create(cfg, seed=c.seed)


def check_positions(c: ml_collections.ConfigDict, model: nnx.Module) -> None:
  """A prompt and its completion must fit the model's positions (`max_seq_len`)."""
  need, have = c.task.max_prompt_len + c.sampler.gen_length, model.config.max_seq_len
  if need > have:
    raise ValueError(f"config.task.max_prompt_len={c.task.max_prompt_len} + "
                     f"config.sampler.gen_length={c.sampler.gen_length} = {need} positions exceed "
                     f"the model's {have}")


def _bad_lora(key: str, value, why: str) -> ValueError:
  return ValueError(f"config.model.{key}={value!r}: {why}")


def lora_targets(family: str, text: str) -> tuple[str, ...] | str:
  """`config.model.lora.targets` as `lora.LoraConfig.targets`: "" the family's
  `lora.DEFAULT_TARGETS`,
  "all-linear" as it is, else its comma-separated PEFT names (matched as PEFT matches them)."""
  if not text:
    return lora.DEFAULT_TARGETS[family]
  if text.strip().lower() == lora.ALL_LINEAR:
    return lora.ALL_LINEAR
  names = tuple(t.strip() for t in text.split(","))
  bad = next((t for t in names if not re.fullmatch(r"[\w.]+", t)), None)
  if bad is not None:
    raise _bad_lora("lora.targets", text, f"{bad!r} is not a module name; expected comma-separated "
               "PEFT target names (e.g. q_proj,v_proj), all-linear, or \"\" (the family's)")
  return names


def _disagrees(key: str, value, init: str, peft_key: str, theirs) -> ValueError:
  return ValueError(f"config.model.{key}={value!r} disagrees with config.model.lora_init={init!r} "
                    f"({peft_key}={theirs!r} in its {peft_format.CONFIG_FILE}): set "
                    "config.model.lora.rank=0 "
                    "to take the adapter's settings")


def _same_targets(a: tuple[str, ...] | str, b: tuple[str, ...] | str) -> bool:
  return (a == b) if isinstance(a, str) or isinstance(b, str) else set(a) == set(b)


def lora_config(c) -> lora.LoraConfig | None:
  """The run's adapters from `config.model.lora` and `config.model.lora_init`, or None for full
  fine-tuning (rank 0 and no lora_init). With `lora_init` (a PEFT adapter directory) its
  adapter_config.json gives them; `model.lora.rank` > 0 then asserts them: rank, alpha, dropout
  and (unless "") targets must be the adapter's. The first bad key raises `ValueError` naming it."""
  cl, init = c.model.lora, c.model.lora_init
  if not isinstance(cl.rank, int) or cl.rank < 0:
    raise _bad_lora("lora.rank", cl.rank, "must be >= 0 (0: full fine-tuning)")
  if not isinstance(cl.alpha, (int, float)) or not (cl.alpha > 0 and math.isfinite(cl.alpha)):
    raise _bad_lora("lora.alpha", cl.alpha, "must be a finite number > 0")
  if not isinstance(cl.dropout, (int, float)) or not 0 <= cl.dropout < 1:
    raise _bad_lora("lora.dropout", cl.dropout, "must lie in [0, 1)")
  targets = lora_targets(c.family, cl.targets)
  ours = (lora.LoraConfig(cl.rank, float(cl.alpha), float(cl.dropout), targets=targets)
          if cl.rank else None)
  if not init:
    return ours
  if not storage.path(init).is_dir():
    raise _bad_lora("lora_init", init, "no such directory (expected a PEFT adapter: "
               f"{peft_format.CONFIG_FILE}, {peft_format.WEIGHTS_FILE})")
  if not (storage.path(init) / peft_format.WEIGHTS_FILE).exists():
    raise _bad_lora("lora_init", init, f"missing {storage.path(init) / peft_format.WEIGHTS_FILE}")
  try:
    theirs = peft_format.config_from_peft(peft_format.read_peft_config(init))
  except (lora.AdapterError, OSError, ValueError, KeyError, TypeError) as e:
    raise _bad_lora("lora_init", init, str(e).strip("'\"")) from e
  if ours is None:
    return theirs
  for key, peft_key in (("rank", "r"), ("alpha", "lora_alpha"), ("dropout", "lora_dropout")):
    if getattr(ours, key) != getattr(theirs, key):
      raise _disagrees(f"lora.{key}", getattr(ours, key), init, peft_key, getattr(theirs, key))
  if cl.targets and not _same_targets(ours.targets, theirs.targets):
    raise _disagrees("lora.targets", cl.targets, init, "target_modules", theirs.targets)
  return theirs


def adapt(c: ml_collections.ConfigDict, model: nnx.Module) -> nnx.Module:
  """`model` with the config's LoRA adapters (`lora_config`), in place: read from
  `model.lora_init`, or fresh (A from `config.seed`, B = 0; target names that select no module
  are skipped, as PEFT skips them, and said), each placed like its kernel; as it is for full
  fine-tuning. The base is the same on every (re)start, so a checkpoint needs only the adapters."""
  lc = lora_config(c)
  if lc is None:
    return model
  try:
    if c.model.lora_init:
      peft_format.load_peft(model, c.model.lora_init)
    else:
      lora.apply(model, lc, seed=c.seed, strict=False)
  except (lora.AdapterError, OSError) as e:
    key, value = (("lora_init", c.model.lora_init) if c.model.lora_init else
                  ("lora.targets", c.model.lora.targets))
    raise ValueError(f"config.model.{key}={value!r}: {e}") from e
  skipped = lora.unmatched(model.config, lc.targets)
  if skipped:
    distributed.log(f"LoRA: target names {', '.join(skipped)} select no module of {c.family}; "
                    "skipped, as PEFT skips them")
  distributed.log(f"LoRA: rank {lc.rank}, alpha {lc.alpha:g}, dropout {lc.dropout:g} on "
                  f"{len(lora.adapted_modules(model))} modules, {lora.num_params(model):,} "
                  "trainable parameters")
  return model


@dataclasses.dataclass
class Data:
  task: Any
  tokenizer: Any
  sft: Any        # grain iterators (checkpointed) of this process's rows of each global batch
  rl: Any
  test: list      # held-out examples (all of them, on every process)
  validation: list  # SFT's stop rule's: the last sft.validation_examples training examples
  reward_fn: Any
  sft_rows: tuple[int, int]  # this process's rows [start, stop) of an SFT batch
  rl_rows: tuple[int, int]   # ... of the RL prompts of a step (each repeated group_size times)


def process_rows(c: ml_collections.ConfigDict, mesh) -> tuple[tuple[int, int], tuple[int, int]]:
  """This process's rows of an SFT batch and of an RL step's prompts (whole groups)."""
  group = c.rl.group_size
  lo, hi = sharding.process_rows(mesh, c.rl.prompts_per_step * group)
  if lo % group or hi % group:
    raise ValueError(f"rl.prompts_per_step={c.rl.prompts_per_step}: process {jax.process_index()} "
                     f"holds rollouts [{lo}, {hi}), which splits a group of rl.group_size={group}; "
                     "make rl.prompts_per_step a multiple of the number of processes")
  return sharding.process_rows(mesh, c.sft.batch_size), (lo // group, hi // group)


def source_kwargs(c: ml_collections.ConfigDict, data_dir: str, *, sft: bool = False) -> dict:
  """`datasets.load_source`'s arguments for the config's task (`sft`: of the SFT examples)."""
  kwargs: dict[str, Any] = dict(data_dir=data_dir, source=c.task.source)
  if c.task.source == "local":
    kwargs["source_dir"] = c.task.source_dir
  elif c.task.source == "generated":
    kwargs.update(num_train=c.task.num_train, num_test=c.task.num_test, seed=c.seed)
    if c.task.name == "sudoku":
      kwargs["blanks"] = (c.task.sft_blanks or c.task.blanks) if sft else c.task.blanks
  return kwargs


def demonstrations(train, n: int) -> list:
  """`sft.num_demonstrations`: the first `n` training examples, all SFT may train on."""
  if n > len(train):
    raise ValueError(f"config.sft.num_demonstrations={n}: the training split has only "
                     f"{len(train)} examples")
  return [train[i] for i in range(n)]


def held_out(c: ml_collections.ConfigDict, t: tasks.Task, data_dir: str) -> list:
  """The config's held-out examples (the task's test split), all of them."""
  source = datasets.load_source(t, "test", **source_kwargs(c, c.task.data_dir or data_dir))
  return [source[i] for i in range(len(source))]


def data_dir(c: ml_collections.ConfigDict, workdir: str) -> str:
  """Where a task's prepared files (TFDS array_record) go: `task.data_dir`, else WORKDIR/data. A
  workdir in a bucket, where array_record cannot write, keeps them on local disk instead, one
  directory per process (each host prepares its own)."""
  if c.task.data_dir:
    return c.task.data_dir
  if storage.is_remote(workdir):
    return os.path.join(os.path.expanduser("~"), ".cache", "stabledrl_jax", "data",
                        os.fspath(workdir).replace("://", "/"), f"process_{jax.process_index()}")
  return os.path.join(workdir, "data")


def data(c: ml_collections.ConfigDict, tokenizer, workdir: str, mesh=None) -> Data:
  """Tasks and this process's data iterators (`mesh`: the run's, which decides the rows)."""
  sft_rows, rl_rows = process_rows(c, mesh)
  t = task(c)
  reward = reward_fn(c, t)
  kwargs = source_kwargs(c, data_dir(c, workdir))
  sft_kwargs = source_kwargs(c, kwargs["data_dir"], sft=True)
  # Process 0 prepares the on-disk data (a shared workdir must not be written by all at once).
  several = jax.process_count() > 1
  if several and not distributed.is_main():
    multihost_utils.sync_global_devices("stabledrl_jax: data prepared")
  train = datasets.load_source(t, "train", **kwargs)
  test = datasets.load_source(t, "test", **kwargs)
  sft_train = train if sft_kwargs == kwargs else datasets.load_source(t, "train", **sft_kwargs)
  if c.sft.num_demonstrations:  # scarce demonstrations: the first N, RL still sees every prompt
    sft_train = demonstrations(sft_train, c.sft.num_demonstrations)
  if several and distributed.is_main():
    multihost_utils.sync_global_devices("stabledrl_jax: data prepared")
  for name, split in (("train", train), ("test", test), ("train (SFT)", sft_train)):
    if not len(split):
      raise ValueError(f"task {c.task.name!r}: the {name} split is empty")
  probe = [split[i] for split in (train, test) for i in range(min(3, len(split)))]
  check_reward(t, reward, probe)
  if c.sft.steps and t.reference_completion is not None:  # a target too long fails now
    sft.encode_completions(tokenizer, [t.reference_completion(ex) for ex in probe],
                           c.sampler.gen_length)
  common = dict(max_prompt_len=c.task.max_prompt_len, style=c.task.prompt_style, chat=c.task.chat,
                num_threads=1)
  sft_it = iter(pipeline.prompt_batches(t, sft_train, tokenizer, batch_size=c.sft.batch_size,
                                        seed=c.seed, rows=sft_rows, **common))
  rl_it = iter(pipeline.prompt_batches(t, train, tokenizer, batch_size=c.rl.prompts_per_step,
                                       seed=c.seed + 1, rows=rl_rows, **common))
  validation = [train[i] for i in range(max(0, len(train) - c.sft.validation_examples), len(train))
                ] if c.sft.stop_at_accuracy or c.sft.patience else []
  return Data(t, tokenizer, sft_it, rl_it, [test[i] for i in range(min(len(test), c.eval.num_examples))],
              validation, reward, sft_rows, rl_rows)
