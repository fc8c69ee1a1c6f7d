"""Tests for stabledrl_jax.aot on the 8 fake CPU devices (TPU topologies need libtpu)."""
import subprocess
import sys

import jax
import pytest

from flax import nnx

from stabledrl_jax import aot, config_lib, models, optim, sharding


def _smoke(**mesh):
  c = config_lib.base_config("sdar")
  config_lib.apply_preset(c, "smoke")
  for axis, size in mesh.items():
    c.mesh[axis] = size
  return c


@pytest.mark.slow
def test_memory_reflects_parameter_sharding():
  devices = jax.devices("cpu")[:8]
  replicated = aot.check(_smoke(), devices, hbm_gib=1.0)  # data=8: every chip holds everything
  n = replicated["params"]
  # Parameters and Adam's two moments in float32 on every chip, plus the batch.
  assert replicated["rl_step"]["arguments"] >= 3 * 4 * n
  fsdp = _smoke(data=1, fsdp=8)
  fsdp.rollout_mesh.data, fsdp.rollout_mesh.fsdp, fsdp.rollout_mesh.tensor = 1, 1, -1
  sharded = aot.check(fsdp, devices, hbm_gib=1.0)  # FSDP update, tensor-parallel sampler
  assert sharded["rl_step"]["arguments"] < replicated["rl_step"]["arguments"] - 4 * n
  assert sharded["rollout_mesh"] == {"data": 1, "fsdp": 1, "tensor": 8, "expert": 1}
  assert "(sampler: {'data': 1, 'fsdp': 1, 'tensor': 8, 'expert': 1})" in aot.report(sharded)
  assert replicated["fits"] and replicated["sampler"]["total"] > 0
  assert "| rl_step |" in aot.report(replicated)
  tiny_hbm = aot.check(_smoke(), devices, hbm_gib=1e-4)
  assert not tiny_hbm["fits"]
  fast = config_lib.base_config("llada")
  config_lib.apply_preset(fast, "smoke")
  fast.sampler.cache = "dual"  # one program: the fast sampler alone
  only = aot.check(fast, devices, hbm_gib=1.0, programs=("sampler",))
  assert "rl_step" not in only and only["sampler"]["total"] > 0 and only["fits"]
  assert "| sampler |" in aot.report(only) and "| rl_step |" not in aot.report(only)


def test_lora_holds_moments_for_the_adapters_alone():
  devices = jax.devices("cpu")[:1]
  full = aot.check(_smoke(), devices, hbm_gib=1.0, programs=("rl_step",))
  c = _smoke()
  c.model.lora.rank = 4
  adapted = aot.check(c, devices, hbm_gib=1.0, programs=("rl_step",))
  n = full["params"]
  # Full fine-tuning: parameters and Adam's two moments; LoRA: the frozen parameters, and the
  # adapters with their moments (a few percent of n at rank 4).
  assert full["rl_step"]["arguments"] >= 3 * 4 * n
  assert 4 * n <= adapted["rl_step"]["arguments"] < 1.5 * 4 * n
  c.model.param_dtype = "bfloat16"  # the frozen base in half the bytes, the adapters still float32
  half = aot.check(c, devices, hbm_gib=1.0, programs=("rl_step",))
  assert half["rl_step"]["arguments"] <= adapted["rl_step"]["arguments"] - 2 * n


def test_unknown_topology_is_a_one_line_error():
  out = subprocess.run([sys.executable, "-m", "stabledrl_jax.aot", "--config=configs/sdar.py:smoke",
                        "--topology=cpu:64"], capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1].startswith("error: --topology=cpu:64")


def test_unknown_program_is_named():
  with pytest.raises(ValueError, match="--programs=rl_stepp: expected some of rl_step, sampler"):
    aot.check(_smoke(), jax.devices("cpu")[:1], programs=("rl_stepp",))


def test_offloaded_moments_are_abstract_host_arrays_and_compile():
  # (XLA:CPU counts no separate host memory: the TPU figures are in docs/scaling.md.)
  devices = jax.devices("cpu")[:8]
  c = _smoke(data=1, fsdp=8)
  c.optim.offload_state = True
  mesh = sharding.make_mesh(c.mesh.to_dict(), devices)
  model = aot.abstract_model(aot.model_config(c), mesh)
  tx = optim.make_optimizer(1e-3, 0, 10, c.optim)
  leaves = jax.tree.leaves(nnx.state(aot.abstract_optimizer(model, tx, mesh, offload=True)))
  kinds = {(x.ndim > 0, x.sharding.memory_kind) for x in leaves}
  assert kinds == {(True, "pinned_host"), (False, "device")}  # moments; counters and rates
  assert aot.check(c, devices, hbm_gib=1.0, programs=("rl_step",))["fits"]


def test_dream_compiles_its_step_and_sampler_and_its_7b_shapes_are_the_release():
  c = config_lib.base_config("dream")
  config_lib.apply_preset(c, "smoke")
  c.mesh.data, c.mesh.fsdp = 1, 8
  result = aot.check(c, jax.devices("cpu")[:8], hbm_gib=1.0)
  assert result["fits"] and result["rl_step"]["total"] > 0 and result["sampler"]["total"] > 0
  big = config_lib.config("dream", "7b")  # a checkpoint path not on this host: the preset's shapes
  assert aot.model_config(big) == models.dream_7b(compute_dtype="bfloat16", remat=True)


def test_a_sampler_chunk_bounds_the_samplers_memory():
  c = config_lib.base_config("llada")
  config_lib.apply_preset(c, "smoke")  # 16 rollouts
  whole = aot.check(c, jax.devices("cpu")[:1], programs=("sampler",))
  c.sampler.chunk = 4
  chunked = aot.check(c, jax.devices("cpu")[:1], programs=("sampler",))
  # The decode's buffers are of 4 rows, not 16; what stays is the weights and the 16 rows' output.
  assert chunked["sampler"]["temporaries"] < 0.5 * whole["sampler"]["temporaries"]
  assert "sampler: 16 rollouts in chunks of 4" in aot.report(chunked)
