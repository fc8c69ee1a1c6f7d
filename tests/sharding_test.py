"""Tests for stabledrl_jax.sharding on the 8 fake CPU devices of conftest: meshes, parameter
placement, and one RL training step (behaviour pass, then the update) that gives the same numbers
on every mesh as on one device."""
import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import (build, config_lib, models, objectives, rl, rollouts, samplers, sharding,
                           train)


def test_mesh_shape_resolves_minus_one_and_names_bad_axes():
  assert sharding.mesh_shape({"data": -1, "tensor": 2}, 8) == {"data": 4, "fsdp": 1, "tensor": 2,
                                                               "expert": 1}
  assert sharding.mesh_shape({"fsdp": 8}, 8) == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}
  for sizes, named in (({"data": -1, "fsdp": -1}, "all -1"), ({"data": 3}, "3 devices"),
                       ({"data": -1, "tensor": 3}, "mesh.data=-1"), ({"pipeline": 2}, "pipeline"),
                       ({"tensor": 0}, "mesh.tensor=0")):
    with pytest.raises(ValueError, match=named):
      sharding.mesh_shape(sizes, 8)


def test_parameters_are_created_sharded_by_their_logical_axes():
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  cfg = models.tiny()
  model = sharding.create_model(cfg, 0, mesh)
  q = model.blocks[0].attn.q_proj.kernel.get_value()  # (embed, heads) -> (fsdp, tensor)
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert q.addressable_shards[0].data.shape == (q.shape[0] // 4, q.shape[1] // 2)
  eager = models.create(cfg, 0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               nnx.to_pure_dict(nnx.state(model, nnx.Param)),
               nnx.to_pure_dict(nnx.state(eager, nnx.Param)))
  assert sharding.model_mesh(model) is mesh and sharding.model_mesh(eager) is None


def test_batches_go_to_the_data_and_fsdp_devices_and_back():
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert sharding.process_rows(mesh, 16) == (0, 16) and sharding.process_rows(None, 5) == (0, 5)
  x = np.arange(16 * 3).reshape(16, 3)
  g = sharding.shard_batch(x, mesh)
  assert g.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"), None)
  assert sorted(s.index[0].start for s in g.addressable_shards) == [0, 0, 4, 4, 8, 8, 12, 12]
  np.testing.assert_array_equal(sharding.to_host(g), x)
  odd = sharding.shard_batch(x[:6], mesh)  # 6 rows do not split 4 ways: replicated
  assert odd.sharding.is_fully_replicated
  # A host holding only rows [4, 8) of 16 cannot fill the devices that need the others.
  with pytest.raises(ValueError, match=r"holds rows \[4, 8\) of the batch, but its devices need rows \[0, 4\)"):
    sharding.shard_batch(x[4:8], mesh, rows=16, start=4)


def test_optimizer_counts_are_replicated_on_the_model_mesh():
  mesh = sharding.make_mesh({"fsdp": 8})
  model = sharding.create_model(models.tiny(), 0, mesh)
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  leaves = jax.tree.leaves(nnx.state(opt))
  assert any(not isinstance(x.sharding, jax.sharding.NamedSharding) for x in leaves)
  sharding.replicate_rest(opt, mesh)
  leaves = jax.tree.leaves(nnx.state(opt))
  assert all(isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh
             for x in leaves)
  assert int(opt.step.get_value()) == 0


def test_rollouts_on_another_mesh_decode_the_same_and_come_back_on_the_training_mesh():
  c = config_lib.base_config("sdar")
  config_lib.apply_preset(c, "smoke")
  c.rollout_mesh.data, c.rollout_mesh.fsdp, c.rollout_mesh.tensor = 1, 1, -1
  mesh = build.mesh(c)  # data=8
  decode_mesh = build.rollout_mesh(c, mesh)
  assert dict(decode_mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 8, "expert": 1}
  tok = build.tokenizer(c)
  model = build.model(c, tok, mesh)
  rng = np.random.default_rng(0)
  ids = rng.integers(5, tok.vocab_size, size=(8, 6)).astype(np.int32)
  sampling = rollouts.sampling_from_config(c, temperature=1.0)
  plain = samplers.generate(model, ids, np.ones_like(ids, bool), jax.random.key(3), sampling)
  other = samplers.generate(model, ids, np.ones_like(ids, bool), jax.random.key(3), sampling,
                         rollout_mesh=decode_mesh)
  np.testing.assert_array_equal(other.tokens_BxL, plain.tokens_BxL)
  assert other.tokens_BxL.sharding.mesh == mesh
  assert sharding.model_mesh(model) is mesh  # the model itself stays where it was
  c.rollout_mesh.tensor = 0
  with pytest.raises(ValueError, match=r"config.rollout_mesh=.*give every axis a size"):
    build.rollout_mesh(c, mesh)


def _tiny_setup():
  c = config_lib.base_config("sdar")  # the tiny preset's model
  tok = build.tokenizer(c)
  model = build.model(c, tok)  # one device
  rng = np.random.default_rng(0)
  b, p, g = 16, 8, c.sampler.gen_length
  prompts = jnp.asarray(rng.integers(5, tok.vocab_size, size=(b, p)), jnp.int32)
  completions = jnp.asarray(rng.integers(5, tok.vocab_size, size=(b, g)), jnp.int32)
  seqs = rollouts.teacher_forced(prompts, jnp.ones((b, p), bool), completions, family="sdar",
                                 block_size=c.sampler.block_length, mask_id=tok.mask_id)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  return c, model, seqs, adv


def _one_step(c, model, seqs, adv, mesh):
  model = train.copy_module(model)
  if mesh is not None:
    sharding.shard_model(model, mesh)
    seqs, adv = sharding.shard_batch((seqs, adv), mesh)
  # Plain SGD: the update is linear in the gradient, so parameters compare to float tolerance
  # (Adam's first step, g/|g|, would turn rounding in near-zero gradients into whole steps).
  opt = nnx.Optimizer(model, optax.chain(optax.sgd(1.0)), wrt=nnx.Param)
  obj = objectives.Objective.from_config(c)
  obj = dataclasses.replace(obj, group_size=8, scheme="block_t", num_samples=2)
  batch, _ = rl.behaviour_pass(model, None, seqs, adv, jax.random.key(1), obj)
  out = rl.update(model, opt, batch, jax.random.key(2), obj=obj, accumulation=2)
  params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  elbo_old = float(jnp.sum(batch.logp_old_BxMxL * batch.weight_old_BxMxL))
  return elbo_old, float(out["loss"]), float(out["grad_norm"]), params


@pytest.mark.slow
def test_one_training_step_matches_a_single_device_on_every_mesh():
  c, model, seqs, adv = _tiny_setup()
  want = _one_step(c, model, seqs, adv, None)
  for sizes in ({"tensor": 8}, {"data": 2, "fsdp": 2, "tensor": 2}):  # every axis, and 8 ways
    got = _one_step(c, model, seqs, adv, sharding.make_mesh(sizes))
    np.testing.assert_allclose(got[:3], want[:3], rtol=2e-5, atol=1e-6, err_msg=str(sizes))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                                         err_msg=str(sizes)), got[3], want[3])


@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_device_attends_over_its_share_of_a_micro_batch(accumulation):
  # A micro-batch sliced from the sharded batch lived on a few devices, and XLA computed its
  # attention whole (or split 2-4 ways) on every device; rl.update constrains each micro-batch to
  # the batch axes, so every device attends over rows / 8 sequences.
  import re

  from stabledrl_jax import aot, optim
  c = config_lib.base_config("sdar")
  config_lib.apply_preset(c, "smoke")
  c.mesh.data, c.mesh.fsdp, c.rl.accumulation = 1, 8, accumulation
  mesh = sharding.make_mesh(c.mesh.to_dict())
  cfg = aot.model_config(c)
  model = aot.abstract_model(cfg, mesh)
  opt = aot.abstract_optimizer(model, optim.make_optimizer(1e-3, 0, 10, c.optim), mesh)
  batch = aot.rl_batch_shapes(c, cfg, mesh)
  obj = objectives.Objective.from_config(c)
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype)
  hlo = rl.update.lower(model, opt, batch, key, obj=obj, accumulation=accumulation).compile().as_text()
  rows = batch.seqs.tokens_BxL.shape[0] * c.rl.num_samples // accumulation  # sequences per micro-batch
  length = 2 * batch.seqs.tokens_BxL.shape[1]  # the staircase's [x_t ; x_0]
  # [sequences, heads, T, S] scores and their products with values: leading dims per device
  attention = {int(m.group(1)) for m in re.finditer(r"= \w+\[(\d+),\d+,(\d+),(\d+)\]\S* dot\(", hlo)
               if length in (int(m.group(2)), int(m.group(3)))}
  assert attention == {rows // 8}, (sorted(attention), rows)
