"""A command whose output cannot be written ends in one line, not a traceback.

The unwritable paths fail for root too (tests may run as root): a path under a regular
file, or a directory where the output file should be.
"""

import json
import subprocess
import sys

import pytest

from big_vit_lite.models import vit

import checks
from trainer_runs import ROOT, env_for


def _run(module, *args):
  return subprocess.run(
      [sys.executable, "-m", f"big_vit_lite.{module}", *args],
      env=env_for("/nonexistent"),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )


def _one_line(proc, start):
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith(start), proc.stderr[-2000:]
  return last


@pytest.fixture(name="blocked")
def _blocked(tmp_path):
  """(a regular file, a directory): paths under the first and the second itself are unwritable."""
  (tmp_path / "a_file").write_text("x")
  (tmp_path / "a_dir.safetensors").mkdir()
  return tmp_path / "a_file", tmp_path / "a_dir.safetensors"


def test_export_to_an_unwritable_safetensors_is_one_line(tmp_path, blocked):
  a_file, a_dir = blocked
  src = tmp_path / "src.npz"
  vit.save_npz(checks.vit_params(), src)
  # The write itself fails (safetensors' own error was a traceback):
  last = _one_line(
      _run("export", f"--src={src}", f"--out={a_dir}", "--res=16"), "export: "
  )
  assert f"--out={a_dir}: cannot write it" in last and "Is a directory" in last
  last = _one_line(
      _run(
          "export", f"--src={src}", f"--out={a_file}/m.safetensors", "--res=16"
      ),
      "export: ",
  )
  assert "does not exist" in last


def test_predict_to_an_unwritable_out_is_one_line(tmp_path, blocked):
  a_file, _ = blocked
  out = f"{a_file}/predictions.jsonl"
  last = _one_line(
      _run(
          "predict",
          f"--model={tmp_path}",
          f"--images={tmp_path}",
          f"--out={out}",
      ),
      "predict: error: ",
  )
  assert last == f"predict: error: cannot write --out={out}: Not a directory"


def test_report_to_an_unwritable_out_is_one_line(tmp_path, blocked):
  a_file, _ = blocked
  (tmp_path / "run").mkdir()
  rows = [
      {"step": s, "training_loss": 1.0 / s, "learning_rate": 0.1}
      for s in (1, 2)
  ]
  (tmp_path / "run" / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows)
  )
  last = _one_line(
      _run("report", str(tmp_path / "run"), f"--out={a_file}/report"),
      "big_vit_lite.report: error: ",
  )
  assert "Not a directory" in last or "File exists" in last
