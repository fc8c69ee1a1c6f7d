"""Test setup: 8 fake CPU devices, so sharded code is exercised on one host; one compilation cache
for the processes the tests start; the compiled programs a worker holds kept under the kernel's
limit on memory mappings; a test whose worker process crashes runs once more on a new worker."""
import collections
import dataclasses
import gc
import os
import shutil
import sys
import tempfile

import pytest

_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
if "STABLEDRL_TEST_JAX_CACHE" in os.environ:  # an xdist worker: the cache is not for this process
  for _var in _CACHE_VARS:
    os.environ.pop(_var, None)
# XLA's CPU backend without its expensive LLVM optimisations: the tests' programs are tiny, so
# compiling them is most of their cost (a test file of many small programs: 149 s -> 113 s).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests import the package from the checkout without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from stabledrl_jax import config_lib, objectives, rollouts  # noqa: E402

# The processes the tests start (the main job and the commands, most of them on the smoke presets)
# share one persistent compilation cache for the run, as a user's reruns do: a later process
# loads the programs an earlier one compiled (the smoke run: 28 s cold, 13 s warm). Made by the
# first pytest process, inherited by xdist's workers, removed at the end. The test processes
# themselves do not use it (jax read its settings at the import above).
_CACHE_OWNER = "STABLEDRL_TEST_JAX_CACHE" not in os.environ
if _CACHE_OWNER:
  os.environ["STABLEDRL_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="stabledrl_jax_test_cache_")
os.environ.update(zip(_CACHE_VARS, (os.environ["STABLEDRL_TEST_JAX_CACHE"], "0", "-1")))


def pytest_unconfigure(config):  # pylint: disable=unused-argument
  if _CACHE_OWNER:
    shutil.rmtree(os.environ["STABLEDRL_TEST_JAX_CACHE"], ignore_errors=True)


@pytest.fixture
def jax_cache_env() -> dict:
  """The cache's settings, for a test that starts a process with an environment of its own."""
  return {var: os.environ[var] for var in _CACHE_VARS}

# Every program XLA compiles for the CPU maps its machine code into the process, three memory
# mappings or more, and keeps them while the program is cached; a worker that has run a few
# hundred tests holds 40,000+ mappings, and at Linux's limit (vm.max_map_count, 65,530 by
# default) the next compile crashes (a segfault or an abort inside `backend_compile_and_load`:
# 4 runs of the suite on 2026-12-07 lost a worker that way, each late in the run, each in a
# different test). So after a test file, once the worker holds more than half the limit, the
# compiled programs are dropped (`jax.clear_caches`); the next file recompiles what it needs.
MAX_MAPPINGS = 30_000


@pytest.fixture(autouse=True, scope="module")
def _bounded_compiled_code():
  yield
  if not os.path.exists("/proc/self/maps"):  # not Linux: no such limit to keep under
    return
  with open("/proc/self/maps") as f:
    if sum(1 for _ in f) > MAX_MAPPINGS:
      jax.clear_caches()
      gc.collect()


# Should a worker still crash, pytest-xdist gives its unfinished tests to a new worker, the
# crashed one included. Two changes make that a rerun instead of a failed or hung suite:
# - the first crash of a test counts as a rerun, not a failure (a second one fails the suite);
# - xdist 3.8's file scheduler also hands the crashed worker's finished files back out, as work
#   units with no test left to run: the worker given one waits for tests that never come and
#   the suite hangs. Here such units are dropped, and once no work is left to hand out every
#   worker is told so (each runs the tests it holds, then exits).
_CRASHES = collections.Counter()


def pytest_handlecrashitem(crashitem, report, sched):  # pylint: disable=unused-argument
  _CRASHES[crashitem] += 1
  if _CRASHES[crashitem] == 1:
    report.outcome = "rerun"
    report.longrepr = f"{report.longrepr}: rerun once on a new worker"


def pytest_xdist_make_scheduler(config, log):
  if config.getvalue("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=import-outside-toplevel

  class Scheduling(LoadFileScheduling):
    def _reschedule(self, node):
      for scope in [s for s, tests in self.workqueue.items() if all(tests.values())]:
        del self.workqueue[scope]
      super()._reschedule(node)
      if not self.workqueue:
        for other in self.nodes:
          if not other.shutting_down:
            other.shutdown()

  return Scheduling(config, log)


def pytest_report_teststatus(report):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


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
  """`objectives.Objective.from_config` of a default config (`family`, SDAR unless given) with
  config keys changed, e.g. `objective(**{"rl.objective": "grpo"})`, then fields replaced by
  keyword."""
  def make(family: str = "sdar", config: dict | None = None, **fields) -> objectives.Objective:
    obj = objectives.Objective.from_config(_config(family, config or {}))
    return dataclasses.replace(obj, **fields)
  return make
