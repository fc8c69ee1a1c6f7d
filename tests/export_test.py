"""Tests for stabledrl_jax.export: the export is atomic and refuses a non-empty target."""
import os

import pytest

from stabledrl_jax import models
from stabledrl_jax.models import huggingface


def test_export_refuses_a_non_empty_target_and_is_atomic(tmp_path):
  model = models.create(models.tiny(), seed=0)
  target = tmp_path / "out"
  target.mkdir()
  (target / "keep.txt").write_text("mine")
  with pytest.raises(huggingface.ExportError, match="exists and is not empty"):
    models.export_pretrained(model, str(target))
  assert os.listdir(target) == ["keep.txt"]
  models.export_pretrained(model, str(tmp_path / "new"), max_shard_bytes=20_000)
  assert not os.path.exists(tmp_path / "new.partial")
  names = set(os.listdir(tmp_path / "new"))
  assert "model.safetensors.index.json" in names and "config.json" in names
  models.export_pretrained(model, str(target), replace=True)  # the end of a run: swapped whole
  assert "keep.txt" not in os.listdir(target) and not os.path.exists(str(target) + ".old")
