"""examples/gradient_bound.py shows StableDRL within its gradient bound while GRPO explodes."""
import pathlib
import subprocess
import sys


def test_the_example_prints_the_gradient_bound_table():
  repo = pathlib.Path(__file__).resolve().parents[1]
  out = subprocess.run([sys.executable, "examples/gradient_bound.py"], capture_output=True,
                       text=True, cwd=repo, timeout=300)
  assert out.returncode == 0, out.stderr
  rows = [line.split("|") for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
  assert [int(r[0]) for r in rows] == [0, 1, 2, 4, 6, 8]
  assert all(r[-1].strip() == "yes" for r in rows)
  grpo = [float(r[3]) for r in rows]
  assert grpo[-1] > 1e4 * float(rows[-1][1])  # GRPO far outside the bound at ρ = 1e8
