"""Orbax checkpoints: round trip, keep-N, restoring into a differently sharded mesh, and a
damaged latest step."""
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from stabledrl_jax import checkpointing, models, optim


def _model_and_opt(seed):
  model = models.create(models.tiny(), seed=seed)
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_round_trip_restores_model_optimizer_and_meta(tmp_path):
  model, opt = _model_and_opt(0)
  grads = jax.tree.map(lambda p: np.ones_like(p) * 0.1, nnx.state(model, nnx.Param))
  opt.update(model, grads)  # non-trivial optimiser state
  ck = checkpointing.Checkpointer(str(tmp_path), keep=2)
  for step in (3, 7, 11):
    ck.save(step, model, opt, {"stage": "rl", "step": step, "iterator": {"pos": step * 2}})
  ck.wait()
  assert ck.latest_step() == 11
  assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [7, 11]

  other, other_opt = _model_and_opt(1)
  assert not np.allclose(_params(other)["embed"]["embedding"], _params(model)["embed"]["embedding"])
  meta = ck.restore(11, other, other_opt)
  assert meta == {"stage": "rl", "step": 11, "iterator": {"pos": 22}}
  jax.tree.map(np.testing.assert_array_equal, _params(model), _params(other))
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(opt))),
               jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(other_opt))))
  ck.close()


def test_restore_into_a_differently_sharded_model(tmp_path):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  model, opt = _model_and_opt(0)
  ck = checkpointing.Checkpointer(str(tmp_path), keep=1)
  ck.save(0, model, opt, {"stage": "sft"})  # saved replicated on one device
  ck.wait()

  target, target_opt = _model_and_opt(5)
  # Shard every 2-D parameter's first axis over 8 devices (where it divides).
  state = nnx.state(target, nnx.Param)
  def shard(x):
    spec = ("fsdp",) if x.ndim >= 1 and x.shape[0] % 8 == 0 else ()
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  nnx.update(target, jax.tree.map(shard, state))
  ck.restore(0, target, target_opt)
  restored = nnx.state(target, nnx.Param)
  emb = restored["embed"]["embedding"][...]
  assert len(emb.sharding.device_set) == 8  # landed in the new sharding
  jax.tree.map(np.testing.assert_array_equal, _params(model), _params(target))
  ck.close()


def test_round_trip_of_moments_in_host_memory(tmp_path):
  # optim.offload_state: Orbax saves the moments from host memory and restores them there.
  model, opt = _model_and_opt(0)
  grads = jax.tree.map(lambda p: np.ones_like(p) * 0.1, nnx.state(model, nnx.Param))
  opt.update(model, grads)
  optim.offload(opt)
  ck = checkpointing.Checkpointer(str(tmp_path), keep=1)
  ck.save(1, model, opt, {"stage": "rl"})
  ck.wait()
  other, other_opt = _model_and_opt(1)
  optim.offload(other_opt)
  ck.restore(1, other, other_opt)
  moments = [x for x in jax.tree.leaves(nnx.state(other_opt)) if x.ndim]
  assert moments and {x.sharding.memory_kind for x in moments} == {"pinned_host"}
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(opt))),
               jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(other_opt))))
  ck.close()


def _damaged(tmp_path, damage):
  """Steps 1 and 2 of a model, then `damage(step 2's folder)`; a killed save's tmp folder."""
  model, opt = _model_and_opt(0)
  ck = checkpointing.Checkpointer(str(tmp_path), keep=3)
  for step in (1, 2):
    ck.save(step, model, opt, {"stage": "rl", "step": step})
  ck.close()
  damage(tmp_path / "2")
  (tmp_path / "3.orbax-checkpoint-tmp-1").mkdir()
  return checkpointing.Checkpointer(str(tmp_path), keep=3), model, opt


def _truncate_a_model_file(step_dir):
  with open(sorted((step_dir / "model" / "d").iterdir())[0], "r+b") as f:
    f.truncate(10)


def _empty_meta(step_dir):
  (step_dir / "meta" / "metadata").write_text("")


@pytest.mark.parametrize("damage, named", [
    (_truncate_a_model_file, r"ValueError: .*Requested byte range \[0, \d+\) is not valid for "
                             r"value of size 10\)"),
    (_empty_meta, r"JSONDecodeError: Expecting value: line 1 column 1 \(char 0\)\)")])
def test_a_damaged_latest_step_falls_back_to_the_previous_one(tmp_path, damage, named):
  ck, model, opt = _damaged(tmp_path, damage)
  assert not (tmp_path / "3.orbax-checkpoint-tmp-1").exists()  # cleaned at start
  lines = []

  def restore(step):
    ck.read_meta(step)
    return ck.restore(step, model, opt)

  with pytest.raises(checkpointing.CheckpointError, match=(
      rf"^{tmp_path}/2: cannot restore \({named}; set checkpoint.fallback=True to resume from "
      r"the previous step$")):
    ck.restore_latest(restore, fallback=False)
  assert ck.all_steps() == [1, 2]  # nothing moved
  step, meta = ck.restore_latest(restore, set_aside=True, log=lines.append)
  assert (step, meta) == (1, {"stage": "rl", "step": 1})
  (aside,) = [p.name for p in tmp_path.iterdir() if p.name.startswith("2.unreadable-")]
  assert len(lines) == 1 and re.fullmatch(
      rf"{tmp_path}/2: cannot restore \({named}; moved to {tmp_path}/{aside}; falling back to "
      r"step 1", lines[0])
  assert ck.all_steps() == [1]
  ck.close()
