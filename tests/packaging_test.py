"""Every third-party module the package imports is declared in requirements.txt (and so in
pyproject.toml, which reads it): a fresh `pip install .` must give a working package."""
import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stabledrl_jax"

# Import name -> distribution name, for modules not installed here (installed ones are looked up).
KNOWN = {"absl": "absl-py", "ml_collections": "ml-collections", "orbax": "orbax-checkpoint",
         "tensorflow_datasets": "tensorflow-datasets", "math_verify": "math-verify",
         "tensorboardX": "tensorboardx", "jinja2": "jinja2", "ml_dtypes": "ml-dtypes"}


def normalise(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def declared(path: Path) -> set[str]:
  """Distribution names of a requirements file (extras and version bounds dropped)."""
  names = set()
  for line in path.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line and not line.startswith("-"):
      names.add(normalise(re.split(r"[\[<>=!~;\s]", line, maxsplit=1)[0]))
  return names


def imported_modules(package: Path) -> dict[str, str]:
  """Top-level third-party module -> the first file importing it (function-level imports too)."""
  found: dict[str, str] = {}
  for path in sorted(package.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top != package.name:
          found.setdefault(top, str(path.relative_to(package.parent)))
  return found


def distributions(module: str) -> set[str]:
  dists = importlib.metadata.packages_distributions().get(module, [])
  return {normalise(d) for d in dists} | ({normalise(KNOWN[module])} if module in KNOWN else set())


def undeclared(package: Path, requirements: Path) -> list[str]:
  names = declared(requirements)
  return sorted(f"{module} (imported by {where})"
                for module, where in imported_modules(package).items()
                if not distributions(module) & names)


def test_every_import_of_the_package_is_declared():
  assert undeclared(PACKAGE, ROOT / "requirements.txt") == []


def test_an_undeclared_import_is_caught(tmp_path):
  package = tmp_path / "pkg"
  package.mkdir()
  (package / "a.py").write_text(
      "import os\nimport numpy as np\n\ndef f():\n  from jinja2 import Template\n")
  requirements = tmp_path / "requirements.txt"
  requirements.write_text("numpy>=1.26,<3  # arrays\n")
  assert undeclared(package, requirements) == ["jinja2 (imported by pkg/a.py)"]
  requirements.write_text("numpy>=1.26\nJinja2[i18n]>=3\n")
  assert undeclared(package, requirements) == []


def test_pyproject_needs_only_jax_and_reads_the_trainers_extra_from_requirements():
  tomllib = pytest.importorskip("tomllib")
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert project["tool"]["setuptools"]["dynamic"]["optional-dependencies"] == {
      "train": {"file": ["requirements.txt"]}}
  [jax] = project["project"]["dependencies"]
  pinned = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line.startswith("jax")]
  assert [p.replace("[cpu]", "") for p in pinned] == [jax]  # one JAX bound for both installs


def test_the_installed_jax_is_the_pinned_one():
  # The suite's results and docs/scaling_fits.md's figures are of this version.
  [pin] = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()
           if line.startswith("jax")]
  version = pin.split("==")[1]
  assert importlib.metadata.version("jax") == version and importlib.metadata.version("jaxlib") == version


def closure(requirements: list[str]) -> set[str]:
  """Installed distributions these requirements pull in (extras and markers not taken)."""
  seen, todo = set(), [re.split(r"[\[<>=!~;\s(]", r, maxsplit=1)[0] for r in requirements]
  while todo:
    name = normalise(todo.pop())
    if name in seen:
      continue
    seen.add(name)
    for r in importlib.metadata.distribution(name).requires or []:
      if ";" not in r:
        todo.append(re.split(r"[\[<>=!~;\s(]", r, maxsplit=1)[0])
  return seen


def test_the_losses_import_in_a_venv_holding_only_jax(tmp_path):
  """A fresh venv whose site-packages hold the package and the closure of its `dependencies`
  (JAX's), linked from this one: no tfds, grain, orbax, flax or math-verify."""
  import subprocess

  tomllib = pytest.importorskip("tomllib")
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
  site = next(venv.glob("lib/python*/site-packages"))
  for name in closure(deps):
    dist = importlib.metadata.distribution(name)
    for top in {Path(str(f)).parts[0] for f in dist.files} - {".."}:
      (site / top).symlink_to(dist.locate_file(top))
  (site / "stabledrl_jax").symlink_to(PACKAGE)
  code = """
import importlib.util, jax.numpy as jnp
from stabledrl_jax import estimators, losses
adv_B = losses.group_advantages(jnp.array([1., 0., 0., 1.]), group_size=2)
loss, _ = losses.snis_clip_loss(jnp.zeros(4), adv_B, jnp.array([-1., -2., -3., -5.]), group_size=2,
                                epsilon=5.0)
print(float(loss), [importlib.util.find_spec(m) is None for m in ("flax", "optax", "grain")])
"""
  out = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr
  # α = ½ (log ratios 0), A = ±½: -mean(½·½·(-1) + ½·(-½)·(-2), ½·(-½)·(-3) + ½·½·(-5)) = 0.125
  assert out.stdout.split()[0] == "0.125"
  assert out.stdout.split(None, 1)[1].strip() == "[True, True, True]"


def test_config_paths_resolve_from_any_directory(tmp_path, monkeypatch):
  from stabledrl_jax import config_lib

  monkeypatch.chdir(tmp_path)
  resolved = config_lib.resolve_config_arg("configs/llada.py:8b")
  assert resolved == str(ROOT / "configs" / "llada.py") + ":8b"
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "llada.py").write_text("")  # a user's own file of that name wins
  assert config_lib.resolve_config_arg("configs/llada.py:8b") == "configs/llada.py:8b"
  assert config_lib.resolve_config_flags(["main", "--config", "configs/sdar.py", "--x=1"]) == [
      "main", "--config", str(ROOT / "configs" / "sdar.py"), "--x=1"]


def test_main_reads_its_configs_outside_the_repository(tmp_path):
  import subprocess

  env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-m", "stabledrl_jax.main",
                        "--config=configs/sdar.py:smoke", "--config.rl.objective=bogus"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
  assert out.stderr.strip().splitlines()[-1].startswith("error: config.rl.objective='bogus'")


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_8b_presets_need_the_users_data(family, tmp_path):
  import importlib

  from stabledrl_jax import config_lib

  c = importlib.import_module(f"configs.{family}").get_config("8b").unlock()
  c.model.checkpoint = str(tmp_path)
  with pytest.raises(ValueError, match=r"^config.task.source_dir='': task.source='local' needs"):
    config_lib.validate(c)
  c.task.source = "public"
  config_lib.validate(c)


def test_the_wheel_carries_every_module_and_the_configs_found_from_anywhere(tmp_path):
  import subprocess
  import zipfile

  import shutil

  source = tmp_path / "source"  # a copy: building writes build/ and egg-info next to the sources
  source.mkdir()
  for name in ("pyproject.toml", "requirements.txt", "README.md"):
    shutil.copy(ROOT / name, source / name)
  for name in ("stabledrl_jax", "configs"):
    shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True,
                 timeout=300)
  wheel = next((tmp_path / "wheel").glob("*.whl"))
  with zipfile.ZipFile(wheel) as z:
    names = {n for n in z.namelist() if n.endswith(".py")}
    z.extractall(tmp_path / "site")
    metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
  requires = [line.split(": ", 1)[1] for line in metadata.splitlines()
              if line.startswith("Requires-Dist: ")]
  assert [r for r in requires if "extra ==" not in r] == ["jax==0.10.2"]  # the losses alone
  assert {normalise(re.split(r"[\[<>=!~;\s(]", r, maxsplit=1)[0]) for r in requires
          if 'extra == "train"' in r} == declared(ROOT / "requirements.txt")
  want = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}
  want |= {f"stabledrl_jax/configs/{p.name}" for p in (ROOT / "configs").glob("*.py")}
  assert names == want
  for p in (ROOT / "configs").glob("*.py"):
    assert (tmp_path / "site" / "stabledrl_jax" / "configs" / p.name).read_text() == p.read_text()
  out = subprocess.run([sys.executable, "-c", "from stabledrl_jax import config_lib; "
                        "print(config_lib.resolve_config_arg('configs/sdar.py:smoke'))"],
                       cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site")},
                       capture_output=True, text=True, timeout=120, check=True)
  assert out.stdout.strip() == f"{tmp_path / 'site' / 'stabledrl_jax' / 'configs' / 'sdar.py'}:smoke"
