"""LoRA adapters as PEFT stores them: an adapter directory holds `adapter_config.json`
(`peft_type` "LORA", `r`, `lora_alpha`, `lora_dropout`, `target_modules`,
`base_model_name_or_path`, ...) and `adapter_model.safetensors` with
`base_model.model.<module>.lora_A.weight` [r, D_in] and `....lora_B.weight` [D_out, r] (torch's
[out, in] layout: our A and B transposed); a mixture of experts' routed expert E has its own
(`...mlp.experts.E.gate_proj.lora_A.weight`), a slice of our stacked `lora.ExpertAdapter`.
`export_peft` writes a model's adapters so that `peft.PeftModel.from_pretrained` loads them;
`load_peft` applies every tensor such a directory holds, and one it cannot place is an error
naming it. The adapters themselves are `lora`'s.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save as save_safetensors

from stabledrl_jax import lora, storage
from stabledrl_jax.models import weights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
PEFT_EMBEDDING_NAMES = ("embed_tokens", "lm_head")  # PEFT saves these whole when targeted
# adapter_config.json options that change what a LoRA adapter computes; any other value than
# these (PEFT's defaults) is refused, naming the key.
_PEFT_DEFAULTS = {"use_dora": False, "use_rslora": False, "bias": "none", "lora_bias": False,
                  "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {},
                  "layers_to_transform": None, "exclude_modules": None, "modules_to_save": None,
                  "target_parameters": None, "trainable_token_indices": None,
                  "alora_invocation_tokens": None, "use_qalora": False, "use_bdlora": None,
                  "layer_replication": None}
# PEFT reads these with their defaults where absent; written so the file reads as PEFT's own.
_PEFT_WRITTEN = {"bias": "none", "fan_in_fan_out": False, "inference_mode": True,
                 "init_lora_weights": True, "layers_pattern": None, "layers_to_transform": None,
                 "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
                 "revision": None, "use_dora": False, "use_rslora": False}


def peft_config(lc: lora.LoraConfig, base_model_name_or_path: str | None = None,
                task_type: str = "CAUSAL_LM") -> dict:
  """adapter_config.json for `lc`: PEFT's keys for a plain LoRA adapter."""
  targets = lc.targets if isinstance(lc.targets, str) else sorted(lc.targets)
  alpha = int(lc.alpha) if float(lc.alpha).is_integer() else lc.alpha
  return {**_PEFT_WRITTEN, "base_model_name_or_path": base_model_name_or_path,
          "lora_alpha": alpha, "lora_dropout": lc.dropout, "peft_type": "LORA", "r": lc.rank,
          "target_modules": targets, "task_type": task_type}


def config_from_peft(peft: dict) -> lora.LoraConfig:
  """The lora.LoraConfig of a PEFT adapter_config.json dict; an option that changes what the adapter
  computes and that this project does not implement (DoRA, rsLoRA, biases, per-module ranks,
  layer subsets, ...) is refused, naming it."""
  if peft.get("peft_type") != "LORA":
    raise lora.AdapterError(f"adapter_config.json peft_type={peft.get('peft_type')!r}: only 'LORA' "
                       "adapters are supported")
  for key, default in _PEFT_DEFAULTS.items():
    value = peft.get(key, default)
    if value != default and not (default is None and value in ([], {}, "")):
      raise lora.AdapterError(f"adapter_config.json {key}={value!r} is not supported (expected "
                         f"{default!r})")
  targets = peft.get("target_modules")
  if not targets:
    raise lora.AdapterError(f"adapter_config.json target_modules={targets!r}: name the modules")
  return lora.LoraConfig(rank=int(peft["r"]), alpha=float(peft.get("lora_alpha", 8)),
                    dropout=float(peft.get("lora_dropout", 0.0)),
                    targets=targets if isinstance(targets, str) else tuple(targets))


def read_peft_config(adapter_dir: str | storage.Path) -> dict:
  path = storage.path(adapter_dir) / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(f"missing {path}")
  return json.loads(path.read_text())


def peft_names(module: str) -> tuple[str, str]:
  """PEFT's tensor names of the adapter of `module` (A, then B)."""
  return (f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight")


def _host(value: jax.Array) -> np.ndarray:
  if not value.is_fully_addressable:
    value = multihost_utils.process_allgather(value, tiled=True)
  return np.asarray(jax.device_get(value))


def base_layer_name(module: str) -> str:
  """PEFT's name of the frozen weight of an adapted module, saved whole for the embedding
  layers (`embed_tokens`, `lm_head`) when an adapter targets them."""
  return f"{PEFT_PREFIX}{module}.base_layer.weight"


def peft_tensors(model, dtype: str = "float32") -> dict[str, np.ndarray]:
  """Every adapter as PEFT's tensors: {name: A.T [r, D_in] or B.T [D_out, r]}, and, as PEFT
  saves it, the whole weight [D_out, D_in] of an adapted `lm_head` (every process joins the
  gathers of a multi-process model)."""
  out = {}
  paths = lora.linear_modules(model.config)
  for module, adapter in lora.adapters(model).items():
    name_a, name_b = peft_names(module)
    out[name_a] = np.ascontiguousarray(_host(adapter.lora_a.get_value()).T.astype(dtype))
    out[name_b] = np.ascontiguousarray(_host(adapter.lora_b.get_value()).T.astype(dtype))
    if module.rsplit(".", 1)[-1] in PEFT_EMBEDDING_NAMES:
      kernel = weights.variable(model, paths[module]).kernel.get_value()
      out[base_layer_name(module)] = np.ascontiguousarray(_host(kernel).T.astype(dtype))
  stacked = {path: (_host(a.lora_a.get_value()), _host(a.lora_b.get_value()))
             for path, a in lora.expert_adapters(model).items()}
  for module, (path, e) in lora.expert_modules(model.config).items():
    if path in stacked:  # expert e's slices: A [E, D_in, r] -> [r, D_in], B -> [D_out, r]
      name_a, name_b = peft_names(module)
      out[name_a] = np.ascontiguousarray(stacked[path][0][e].T.astype(dtype))
      out[name_b] = np.ascontiguousarray(stacked[path][1][e].T.astype(dtype))
  return out


def export_peft(model, out_dir: str | storage.Path, *, base_model_name_or_path: str | None = None,
                dtype: str = "float32") -> None:
  """Write the adapters alone as a PEFT directory (adapter_config.json,
  adapter_model.safetensors) that `peft.PeftModel.from_pretrained(official_model, out_dir)`
  loads; `base_model_name_or_path` names the base checkpoint (e.g. its hub id)."""
  tensors = peft_tensors(model, dtype)  # every process, before process 0 writes
  if jax.process_index() != 0:
    return
  out_dir = storage.path(out_dir)
  storage.makedirs(out_dir)
  (out_dir / WEIGHTS_FILE).write_bytes(save_safetensors(tensors, metadata={"format": "pt"}))
  (out_dir / CONFIG_FILE).write_text(
      json.dumps(peft_config(lora.config_of(model), base_model_name_or_path), indent=2))


def _set(variable, value: np.ndarray) -> None:
  """Set `variable` to `value`, keeping its dtype and sharding."""
  old = variable.get_value()
  value = jnp.asarray(value.astype(old.dtype))
  sharding = getattr(old, "sharding", None)
  variable.set_value(jax.device_put(value, sharding) if sharding is not None else value)


def _peft_targets(model, lc: lora.LoraConfig) -> dict[str, tuple]:
  """{PEFT tensor name: (variable, shape in the file, transposed, index)} of every tensor a PEFT
  adapter of the model's adapters may hold: A and B of each adapter, and whole weights PEFT
  saves beside them (a targeted embedding layer's `base_layer`, or a weight by its
  checkpoint name, e.g. a resized embedding), which replace the checkpoint's. `index`: the
  tensor is slice [index] of a stacked variable (a routed expert's), else None."""
  out = {}
  for adapter in lora.all_adapters(model):
    if (adapter.rank, adapter.alpha) != (lc.rank, lc.alpha):
      raise lora.AdapterError(f"the model's adapters have rank {adapter.rank}, alpha "
                              f"{adapter.alpha}; the file's r={lc.rank}, lora_alpha={lc.alpha}")
  for module, adapter in lora.adapters(model).items():
    name_a, name_b = peft_names(module)
    out[name_a] = (adapter.lora_a, (lc.rank, adapter.in_features), True, None)
    out[name_b] = (adapter.lora_b, (adapter.out_features, lc.rank), True, None)
  stacked = lora.expert_adapters(model)
  for module, (path, e) in lora.expert_modules(model.config).items():
    if path in stacked:
      a = stacked[path]
      name_a, name_b = peft_names(module)
      out[name_a] = (a.lora_a, (lc.rank, a.in_features), True, e)
      out[name_b] = (a.lora_b, (a.out_features, lc.rank), True, e)
  for spec in weights.weight_specs(model.config):
    variable = weights.variable(model, spec.path)
    shape = tuple(variable.get_value().shape)[spec.index is not None:]
    entry = (variable, shape[::-1] if spec.transpose else shape, spec.transpose, spec.index)
    out[PEFT_PREFIX + spec.hf_name] = entry
    module = spec.hf_name.removesuffix(".weight")
    owner = weights.variable(model, spec.path[:-1])
    if spec.path[-1] == "kernel" and getattr(owner, "adapter", None):
      out[base_layer_name(module)] = entry
  return out


def load_peft(model, adapter_dir: str) -> lora.LoraConfig:
  """Load a PEFT LoRA adapter into `model`: adapters are attached as its adapter_config.json
  says (PEFT's matching: a listed name that selects nothing is skipped, as PEFT skips it), or,
  on a model that has them already, must be exactly those; then every tensor of the file is
  placed (whole weights PEFT saved beside the adapters replace the model's). A tensor that
  names nothing of the model as PEFT names it, or of the wrong shape, is an error naming it; so
  is an adapted module the file has no A or B for."""
  lc = config_from_peft(read_peft_config(adapter_dir))
  chosen = lora.select(model.config, lc.targets, strict=False)
  if not lora.has_adapters(model):
    lora.apply(model, lc, strict=False)
  found = lora.adapted_modules(model)
  if set(found) != set(chosen):
    extra = sorted(set(found) ^ set(chosen))[0]
    raise lora.AdapterError(f"module {extra!r}: the model's adapters differ from {adapter_dir}'s "
                       "target_modules")
  targets = _peft_targets(model, lc)
  path = storage.path(adapter_dir) / WEIGHTS_FILE
  if not path.exists():
    raise FileNotFoundError(f"missing {path}")
  with storage.local_copy(path) as local, safe_open(local, framework="np") as f:
    names = list(f.keys())
    for name in names:
      if name not in targets:
        raise lora.AdapterError(f"adapter tensor {name!r} in {path} names no adapted module or "
                                f"weight of this {model.config.family} model")
    needed = [n for module in found for n in peft_names(module)]
    missing = [name for name in needed if name not in names]
    if missing:
      raise lora.AdapterError(f"adapter tensor {missing[0]!r} is missing from {path}")
    stacks = {}  # id of a stacked variable -> (it, its host copy): one update each, at the end
    for name in names:
      variable, want, transpose, index = targets[name]
      host = f.get_tensor(name)
      if host.shape != want:
        raise lora.AdapterError(f"adapter tensor {name!r} has shape {host.shape}, expected {want}")
      host = host.T if transpose else host
      if index is None:
        _set(variable, host)
      else:
        _, whole = stacks.setdefault(id(variable), (variable, _host(variable.get_value()).copy()))
        whole[index] = host
    for variable, whole in stacks.values():
      _set(variable, whole)
  return lc
