"""The documents: the losses quickstart runs and gives the NumPy loss, and every file, config
key, preset, command and flag that README.md, CONTRIBUTING.md and docs/ name exists."""
import functools
import importlib
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from stabledrl_jax import config_lib, estimators, presets

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
SECTIONS = ("model", "task", "sft", "rl", "optim", "sampler", "eval", "stability", "controls",
            "mesh", "rollout_mesh", "checkpoint")
FILE_SUFFIX = r"\.(py|md|json|jsonl|csv|png|txt|sh|toml|sbatch|safetensors)$"
TOP = ("stabledrl_jax", "configs", "bench", "tests", "docs", "launch", "examples", ".ci")


def config_keys() -> set[str]:
  keys = set()

  def walk(d, prefix):
    for k, v in d.items():
      keys.add(prefix + k)
      if isinstance(v, dict) and k != "reward_weights":
        walk(v, f"{prefix}{k}.")

  for family in config_lib.FAMILIES:
    walk(config_lib.base_config(family).to_dict(), "")
  return keys


def python_block(page: Path, heading: str) -> str:
  text = page.read_text().split(heading, 1)[1]
  return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_losses_quickstart_runs_and_gives_the_numpy_loss():
  scope = {}
  exec(python_block(ROOT / "docs" / "losses.md", "## Quickstart"), scope)  # noqa: S102 (our doc)
  table = np.asarray(scope["params"]["table"], np.float64)
  logsoftmax = table - np.log(np.exp(table).sum(-1, keepdims=True))
  tokens = np.asarray(scope["tokens_BxL"])
  draw = jax.jit(functools.partial(estimators.sample_masks, scheme="random_t", num_samples=2))
  masks = draw(jax.random.key(2), ~scope["prompt_BxL"])  # the block's (coupled: one draw)
  noisy = np.where(np.asarray(masks.noised_BxMxL), scope["MASK"], tokens[:, None])
  weight = np.asarray(masks.weight_BxMxL, np.float64)
  logp = logsoftmax[noisy, np.broadcast_to(tokens[:, None], noisy.shape)]
  elbo = (weight * logp).sum(-1).mean(-1)
  g = scope["G"]
  rewards = np.asarray(scope["rewards_B"]).reshape(-1, g)
  adv = rewards - rewards.mean(-1, keepdims=True)
  # coupled masks at θ = θ_old: every ratio 1, so α = 1/G
  want = -np.mean(np.sum(adv / g * elbo.reshape(-1, g), -1))
  np.testing.assert_allclose(float(scope["loss"]), want, rtol=1e-5)
  assert float(scope["metrics"]["clip_fraction"]) == 0.0
  assert np.abs(np.asarray(scope["grads"]["table"])).max() > 0


def _backticked(text: str) -> list[str]:
  return re.findall(r"`([^`\n]+)`", text)


def _named_paths(page: Path, text: str) -> list[tuple[str, Path]]:
  """(as written, the path it names) for repository paths in backticks and relative links."""
  found = []
  for token in _backticked(text) + re.findall(r"(?:^|\s)((?:" + "|".join(map(re.escape, TOP))
                                             + r")/[\w./{},*-]+)", text, re.M):
    for word in token.split():
      word = word.split("=", 1)[-1].split(":", 1)[0].split("[", 1)[0].rstrip(".,;)")
      if re.search(r"\b[A-Z]{2,}\b", word):
        continue  # a placeholder (configs/FAMILY.py)
      if word.split("/", 1)[0] in TOP and "/" in word:
        found.append((word, ROOT / word))
      elif word in ("README.md", "BUILD.md", "CONTRIBUTING.md", "LICENSE", "pyproject.toml",
                    "requirements.txt", "requirements-test.txt"):
        found.append((word, ROOT / word))
  for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
    if not re.match(r"\w+:", link):
      found.append((link, (page.parent / link).resolve()))
  return found


def _expand(pattern: str) -> list[str]:
  """`configs/{llada,sdar}.py` -> both paths."""
  m = re.search(r"\{([^{}]*)\}", pattern)
  if not m:
    return [pattern]
  return [x for part in m.group(1).split(",")
          for x in _expand(pattern[:m.start()] + part + pattern[m.end():])]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_key_preset_and_command_a_page_names_exists(page):
  # A line quoting an error message shows a bad input on purpose (docs/faults.md).
  text = "\n".join(line for line in page.read_text().splitlines() if "`error:" not in line)
  missing = []
  for written, path in _named_paths(page, text):
    for one in _expand(str(path)):
      if "*" in one or "NAME" in one or "DATE" in one or "<" in one:
        continue  # a pattern, not a file
      if not Path(one).exists() and not one.startswith(str(ROOT / "runs")):
        missing.append(f"file {written}")
  keys = config_keys()
  for key in re.findall(r"--config\.([\w.]*\w)", text):
    if key not in keys and not re.search(r"\b[A-Z]{2,}\b", key):
      missing.append(f"config key {key}")
  for token in _backticked(text):
    name = re.split(r"\s*=", token, maxsplit=1)[0].strip()
    m = re.fullmatch(r"(\w+)\.([\w.]*\w)", name)
    if (not m or m.group(1) not in SECTIONS or name in keys or re.search(FILE_SUFFIX, name)
        or re.search(r"\b[A-Z]{2,}\b", name)):
      continue
    try:
      module = importlib.import_module(f"stabledrl_jax.{m.group(1)}")
    except ImportError:
      module = None
    if module is not None and hasattr(module, m.group(2).split(".")[0]):
      continue  # a function or class of the module of that name (rl.step)
    missing.append(f"config key {token}")
  for family, preset in re.findall(r"configs/(\w+)\.py:(\w+)", text):
    if family.isupper() or preset.isupper():
      continue
    if preset not in presets.PRESETS or not (ROOT / "configs" / f"{family}.py").exists():
      missing.append(f"preset configs/{family}.py:{preset}")
      continue
    try:
      config_lib.config(family, preset)
    except ValueError:
      missing.append(f"preset configs/{family}.py:{preset}")
  commands = (ROOT / "docs" / "reference" / "commands.md").read_text()
  for command, rest in re.findall(r"python -m stabledrl_jax\.(\w+)([^\n`]*)", text):
    if not (ROOT / "stabledrl_jax" / f"{command}.py").exists():
      missing.append(f"command {command}")
      continue
    flags = commands.split(f"## `python -m stabledrl_jax.{command}`", 1)[-1].split("\n## ", 1)[0]
    for flag in re.findall(r"\s--(\w+)", rest):
      if f"`--{flag}`" not in flags:
        missing.append(f"flag {command} --{flag}")
  assert not missing, sorted(set(missing))
