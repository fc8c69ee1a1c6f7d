"""bench/report.py: the committed references and results tables are the ones the code and the
committed data give, and what it reads it reads right."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
  spec = importlib.util.spec_from_file_location("report", ROOT / "bench" / "report.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


report = _report()


def test_every_generated_page_is_committed_as_generated():
  assert report.differing() == [], "rerun: .venv/bin/python bench/report.py"


def test_key_comments_take_the_block_above_and_the_lines_own_with_its_continuation():
  source = '''
def base_config(family):
  c = ml_collections.ConfigDict()
  # the block
  # above
  c.a.x = 1  # own
  c.a.y = 2  # starts
                # and goes on

  c.a.z = 3
  # a run's block
  c.b.x = 4
  c.b.y = 5
  return c
'''
  assert report.key_comments(source) == {"a.x": "the block above own", "a.y": "starts and goes on",
                                         "a.z": "", "b.x": "a run's block", "b.y": "a run's block"}


def test_a_marked_table_is_rewritten_from_its_results_file(tmp_path, monkeypatch):
  rec = {"title": "Demo", "columns": ["run", "score"], "align": "lr", "rows": [["a|b", 0.5], ["c", 1]],
         "command": "python x.py", "commit": "abc1234", "machine": "2 CPUs", "date": "2026-12-07"}
  (tmp_path / "demo.json").write_text(json.dumps(rec))
  monkeypatch.setattr(report, "RESULTS", str(tmp_path))
  monkeypatch.setattr(report, "DOCS", str(tmp_path.parent))
  page = "intro\n<!-- table: results/demo.json -->\nstale\n<!-- end of table -->\nrest\n"
  out = report.with_tables(page)
  assert out.startswith("intro\n<!-- table: results/demo.json -->\n| run | score |\n|---|---:|\n"
                        "| a\\|b | 0.5 |\n| c | 1 |\n\nDemo. Measured 2026-12-07 on 2 CPUs, recorded at commit "
                        "abc1234: `python x.py` (data: [docs/results/demo.json]")
  assert out.endswith("\n<!-- end of table -->\nrest\n") and "stale" not in out
  assert report.with_tables(out) == out
