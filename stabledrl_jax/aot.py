"""Ahead-of-time fit check on a CPU host: does a config's RL step fit a TPU topology?

  python -m stabledrl_jax.aot --config=configs/sdar.py:8b --topology=v5p:4x4x4

Compiles, for the topology's chips and the config's mesh, the full RL train step (`rl.update`:
`μ`-step gradient with accumulation and the optimiser update) and the sampler (one `generate` call
for a rollout batch; with `sampler.chunk`, a loop over chunks of it, whose memory is one chunk's),
with abstract, sharded parameters: no weights are read and no TPU is needed, only `libtpu`
(`pip install "jax[tpu]"`). Prints per-chip memory (arguments, outputs, temporaries,
total against the chip's HBM) and XLA's cost estimate, and exits 1 when either program does not fit.
With LoRA (`model.lora`, e.g. the `8b_lora` presets) the model carries the config's adapters and the
optimiser holds their moments alone, as in training.
`--topology=cpu:N` compiles for N local CPU devices instead (for tests; HBM from `--hbm_gib`).

The model shapes come from `model.checkpoint`'s config.json when that directory exists, else (a
path not on this host, as in the `8b` / `7b` / `mini` / `flash` presets) from the config's
`model.preset` (`models.llada_8b`, `models.sdar_8b`, `models.dream_7b`, `models.llada2_mini`,
`models.llada2_flash`), else from the config's own tiny model.
"""
from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from stabledrl_jax import (build, cli, lora, models, objectives, optim, rl, rollouts, samplers,
                           sharding, storage)

cli.define_flags("configs/sdar.py:8b", "Training config file.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x1", "TPU topology (e.g. v5p:4x4x4, "
                                "v6e:4x4) or cpu:N for N local CPU devices.")
_HBM_GIB = flags.DEFINE_float("hbm_gib", None, "Per-chip memory in GiB (default: by chip kind).")
_PROGRAMS = flags.DEFINE_list("programs", "rl_step,sampler", "Which programs to compile: rl_step, "
                              "sampler (e.g. only the sampler, with --config.sampler.cache=dual).")
PROGRAMS = ("rl_step", "sampler")

# Per-chip HBM in GiB by device kind (public TPU specifications).
HBM_GIB = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5e": 16, "TPU v5": 95, "TPU v5p": 95,
           "TPU v6 lite": 32, "TPU v6e": 32, "TPU7x": 192}
GIB = 2**30


def topology_devices(name: str) -> list:
  """The devices of a TPU topology name libtpu knows, or `cpu:N` local CPU devices."""
  if name.startswith("cpu:"):
    n = int(name.split(":")[1])
    devices = jax.devices("cpu")
    if len(devices) < n:
      raise ValueError(f"--topology={name}: only {len(devices)} CPU devices (set XLA_FLAGS="
                       f"--xla_force_host_platform_device_count={n})")
    return devices[:n]
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(name, "tpu").devices)
  except Exception as e:  # libtpu missing or a name it does not know
    raise ValueError(f"--topology={name}: {e}") from e


def model_config(c) -> models.ModelConfig:
  if c.model.checkpoint and storage.path(c.model.checkpoint).is_dir():
    cfg = models.config_from_hf(models.huggingface.read_hf_config(c.model.checkpoint),
                                compute_dtype=c.model.compute_dtype, param_dtype=c.model.param_dtype)
    return models.replace(cfg, **models.runtime_options(c.model))
  if c.model.checkpoint:  # a checkpoint preset, with a checkpoint path that is not on this host
    return models.preset(c.model.preset, compute_dtype=c.model.compute_dtype,
                         param_dtype=c.model.param_dtype, **models.runtime_options(c.model))
  return nnx.eval_shape(lambda: build.model(c, build.tokenizer(c))).config


def abstract_model(cfg: models.ModelConfig, mesh, adapters: lora.LoraConfig | None = None) -> nnx.Module:
  """The model (with `adapters`, the config's LoRA: `build.lora_config`) with `ShapeDtypeStruct`
  parameters carrying their shardings on `mesh`."""
  model = nnx.eval_shape(lambda: lora.apply(models.create(cfg, 0), adapters, strict=False)
                         if adapters else models.create(cfg, 0))
  shardings = sharding.param_shardings(model, mesh)
  state = nnx.state(model, nnx.Param)
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          nnx.to_pure_dict(state), shardings)
  nnx.replace_by_pure_dict(state, abstract)
  nnx.update(model, state)
  return model


def abstract_optimizer(model: nnx.Module, tx, mesh, offload: bool = False) -> nnx.Optimizer:
  """The optimiser state, abstract: moments (of the adapters alone with LoRA, `lora.trainable`)
  sharded like their parameters (in host memory with `offload`, as `optim.offload` puts them),
  the rest replicated."""
  opt = nnx.eval_shape(lambda: nnx.Optimizer(model, tx, wrt=lora.trainable(model)))
  by_path = {}
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    by_path[sharding.path_keys(path)] = leaf
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def place(path, x):
    keys = sharding.path_keys(path)
    for i in range(len(keys)):
      p = by_path.get(keys[i:])
      if p is not None and p.shape == x.shape:
        kind = "pinned_host" if offload and optim.offloadable(x) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding.with_memory_kind(kind))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)

  state = nnx.state(opt)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(place, nnx.to_pure_dict(state)))
  nnx.update(opt, state)
  return opt


def _batched(shape, dtype, mesh):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape), shape[0]))


def rl_batch_shapes(c, cfg: models.ModelConfig, mesh) -> objectives.RLBatch:
  """An abstract rollout batch of the config's sizes (prompt + completion layout of the family)."""
  b = c.rl.prompts_per_step * c.rl.group_size
  # M: rl.num_samples, or the trajectory scheme's forwards (`objectives.Objective.from_config`).
  p, g = c.task.max_prompt_len, c.sampler.gen_length
  m = objectives.Objective.from_config(c).num_samples
  seqs = jax.eval_shape(
      lambda pr, pv, co: rollouts.teacher_forced(pr, pv, co, family=cfg.family,
                                                 block_size=c.sampler.block_length,
                                                 mask_id=cfg.mask_token_id),
      jax.ShapeDtypeStruct((b, p), jnp.int32), jax.ShapeDtypeStruct((b, p), bool),
      jax.ShapeDtypeStruct((b, g), jnp.int32))
  seqs = jax.tree.map(lambda x: _batched(x.shape, x.dtype, mesh), seqs)
  t = seqs.tokens_BxL.shape[1]
  return objectives.RLBatch(seqs, _batched((b,), jnp.float32, mesh),
                            _batched((b, m, t), bool, mesh),
                    *(_batched((b, m, t), jnp.float32, mesh) for _ in range(3)))


def memory(compiled) -> dict[str, int]:
  m = compiled.memory_analysis()
  out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
         "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
         "code": m.generated_code_size_in_bytes, "host_arguments": m.host_argument_size_in_bytes}
  out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
  return out


def cost(compiled) -> dict[str, float]:
  ca = compiled.cost_analysis()
  if isinstance(ca, (list, tuple)):
    ca = ca[0] if ca else {}
  return {k: float(ca[k]) for k in ("flops", "bytes accessed") if k in (ca or {})}


def check(c, devices: list, hbm_gib: float | None = None,
          programs: tuple[str, ...] = PROGRAMS) -> dict[str, Any]:
  """Compile `programs` (the RL train step, the sampler) for `devices`; per-chip memory and
  costs."""
  unknown = [p for p in programs if p not in PROGRAMS]
  if unknown or not programs:
    raise ValueError(f"--programs={','.join(programs)}: expected some of {', '.join(PROGRAMS)}")
  mesh = sharding.make_mesh(c.mesh.to_dict(), devices)
  cfg = model_config(c)
  kind = devices[0].device_kind
  hbm = hbm_gib if hbm_gib is not None else next(
      (v for k, v in sorted(HBM_GIB.items(), key=lambda kv: -len(kv[0])) if kind.startswith(k)), None)
  adapters = build.lora_config(c)
  model = abstract_model(cfg, mesh, adapters)
  obj = objectives.Objective.from_config(c)
  tx = optim.make_optimizer(c.rl.lr, c.rl.warmup_steps, c.rl.steps * c.rl.updates_per_batch, c.optim)
  opt = abstract_optimizer(model, tx, mesh, offload=c.optim.offload_state)
  batch = rl_batch_shapes(c, cfg, mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated)
  results = {"device_kind": kind, "chips": len(devices), "mesh": dict(mesh.shape),
             "hbm_gib": hbm, "params": cfg.num_params}
  if "rl_step" in programs:
    results["rl_step"] = _compile(lambda: rl.update.lower(
        model, opt, batch, key, obj=obj, accumulation=c.rl.accumulation))

  b = c.rl.prompts_per_step * c.rl.group_size
  sampling = rollouts.sampling_from_config(c, c.sampler.temperature)
  gen = samplers.sampler_of(sampling)
  decode_mesh = build.rollout_mesh(c, mesh) or mesh  # config.rollout_mesh, if set
  if decode_mesh is not mesh:
    results["rollout_mesh"] = dict(decode_mesh.shape)
    model = abstract_model(cfg, decode_mesh, adapters)
    key = jax.ShapeDtypeStruct((), key.dtype, sharding=jax.sharding.NamedSharding(
        decode_mesh, jax.sharding.PartitionSpec()))
  prompts = _batched((b, c.task.max_prompt_len), jnp.int32, decode_mesh)
  valid = _batched((b, c.task.max_prompt_len), bool, decode_mesh)
  if "sampler" in programs:  # with sampler.chunk, a loop over chunks: one chunk's memory
    results["sampler"] = _compile(lambda: jax.jit(gen, static_argnums=(4,)).lower(
        model, prompts, valid, key, sampling))
    results["rollouts"], results["chunk"] = b, min(c.sampler.chunk or b, b)
  results["fits"] = all("error" not in results[k] and (hbm is None or results[k]["total"] <= hbm * GIB)
                        for k in programs)
  return results


def _compile(lower) -> dict[str, Any]:
  """Memory and cost of the compiled program, or `{"error": ...}` when the compiler itself
  finds that it cannot fit (TPU compiles fail with RESOURCE_EXHAUSTED)."""
  try:
    compiled = lower().compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return {"error": str(e).strip().splitlines()[0]}
  return {**memory(compiled), **cost(compiled)}


def _size(n: float) -> str:
  return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def report(r: dict[str, Any]) -> str:
  hbm = f"{r['hbm_gib']:g} GiB" if r["hbm_gib"] else "unknown"
  params = f"{r['params'] / 1e9:.2f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.2f}M"
  decode = f" (sampler: {r['rollout_mesh']})" if "rollout_mesh" in r else ""
  if r.get("chunk", 0) < r.get("rollouts", 0):
    decode += f", sampler: {r['rollouts']} rollouts in chunks of {r['chunk']}"
  lines = [f"{r['chips']} x {r['device_kind']}, mesh {r['mesh']}{decode}, {params} parameters, "
           f"HBM per chip {hbm}",
           "| program | arguments | outputs | temporaries | total per chip | fits | TFLOPs (XLA) |",
           "|---|---|---|---|---|---|---|"]
  for name in (p for p in PROGRAMS if p in r):
    m = r[name]
    if "error" in m:
      lines.append(f"| {name} | — | — | — | — | NO | {m['error']} |")
      continue
    fits = "—" if not r["hbm_gib"] else ("yes" if m["total"] <= r["hbm_gib"] * GIB else "NO")
    flops = f"{m['flops'] / 1e12:.3g}" if "flops" in m else "—"
    lines.append(f"| {name} | {_size(m['arguments'])} | {_size(m['outputs'])} | "
                 f"{_size(m['temporaries'])} | {_size(m['total'])} | {fits} | {flops} |")
    if m.get("host_arguments"):
      lines.append(f"({name}: {_size(m['host_arguments'])} of arguments in host memory)")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    devices = topology_devices(_TOPOLOGY.value)
    result = check(flags.FLAGS.config, devices, _HBM_GIB.value, tuple(_PROGRAMS.value))
  except ValueError as e:
    sys.exit(f"error: {e}")
  print(report(result), flush=True)
  if not result["fits"]:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
