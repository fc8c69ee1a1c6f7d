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


def test_pyproject_reads_its_dependencies_from_requirements():
  tomllib = pytest.importorskip("tomllib")
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "dependencies" in project["project"]["dynamic"]
  assert project["tool"]["setuptools"]["dynamic"]["dependencies"]["file"] == ["requirements.txt"]


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
