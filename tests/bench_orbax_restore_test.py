"""bench/orbax_restore.py on the tiny model: a checkpoint written, restored on 1 and 2 processes."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_restore_table_has_a_row_per_process_count(tmp_path):
  out = subprocess.run([sys.executable, "bench/orbax_restore.py", "--sizes=tiny",
                        f"--dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| tiny")]
  assert [r[2].strip() for r in rows] == ["1", "2"]
  for r in rows:
    seconds = [float(x.replace(",", "")) for x in r[3].split(" / ")]
    peaks = [float(x.replace(",", "")) for x in r[5].split(" / ")]
    assert len(seconds) == len(peaks) == int(r[2]) and min(seconds) > 0 and min(peaks) > 0
