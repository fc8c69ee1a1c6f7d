"""Test setup: 8 fake CPU devices, so sharded code is exercised on one host."""
import dataclasses
import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests import the package from the checkout without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stabledrl_jax import config_lib, rl, rollouts  # noqa: E402


def _config(family: str, changes: dict):
  c = config_lib.base_config(family)
  for key, value in changes.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


@pytest.fixture
def llada_sampling():
  """`rollouts.LLaDASampling` of the default config (greedy), with fields changed by keyword."""
  base = rollouts.LLaDASampling.from_config(config_lib.base_config("llada").sampler, 0.0)
  return lambda **changes: dataclasses.replace(base, **changes)


@pytest.fixture
def sdar_sampling():
  """`rollouts.SDARSampling` of the default config (greedy), with fields changed by keyword."""
  base = rollouts.SDARSampling.from_config(config_lib.base_config("sdar").sampler, 0.0)
  return lambda **changes: dataclasses.replace(base, **changes)


@pytest.fixture
def objective():
  """`rl.Objective.from_config` of a default config (`family`, SDAR unless given) with config
  keys changed, e.g. `objective(**{"rl.objective": "grpo"})`, then fields replaced by keyword."""
  def make(family: str = "sdar", config: dict | None = None, **fields) -> rl.Objective:
    return dataclasses.replace(rl.Objective.from_config(_config(family, config or {})), **fields)
  return make
