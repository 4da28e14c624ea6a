"""The side tools (evaluate, predict, export, plan, report, prepare) start as quietly as train."""

import json
import os
import re
import subprocess
import sys

import pytest

import evaluator_fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TensorFlow's and absl's start-up lines, and the error-level oneDNN line that
# is not an error (it falls back to Eigen).
NOISE = (
    "oneDNN",
    "DT_UINT8",
    "absl::InitializeLog",
    "This TensorFlow binary is optimized",
    "cpu_feature_guard",
)
# A C++ log line at error level ("E0000 00:00:..." or "E1205 20:03:03.1 ..."):
# none of these runs has an error.
CPP_ERROR = re.compile(r"^E\d{4} \d\d:\d\d:", re.M)


def _run(args, data_dir):
  """`python -m ARGS` as a user starts it: no TF_CPP_MIN_LOG_LEVEL or oneDNN setting."""
  env = dict(
      os.environ,
      TFDS_DATA_DIR=data_dir,
      JAX_PLATFORMS="cpu",
      PYTHONPATH=REPO,
  )
  for key in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS"):
    env.pop(key, None)
  return subprocess.run(
      [sys.executable, "-m", *args],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  root = tmp_path_factory.mktemp("quiet")
  npz = evaluator_fixtures.save_tiny_npz(root)
  folder = evaluator_fixtures.write_image_folder(str(root / "shapes3"))
  run = root / "run"  # A training workdir's metrics, for the report.
  run.mkdir()
  rows = [
      {"step": s, "training_loss": 2.0 / s, "img/sec": 100.0, "uptime_hours": s}
      for s in (1, 2, 3)
  ]
  (run / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows)
  )
  return dict(root=root, npz=npz, folder=folder, run=str(run))


COMMANDS = {
    "evaluate": lambda i: [
        "big_vit_lite.evaluate",
        f"--config=configs/fewshot.py:channels=3,folder={i['folder']}",
        f"--workdir={i['root'] / 'eval'}",
        f"--config.model_init={i['npz']}",
        "--config.evals.fewshot.num_seeds=2",
        "--config.evals.fewshot.shots=(1,2)",
    ],
    "predict": lambda i: [
        "big_vit_lite.predict",
        f"--model={i['npz']}",
        f"--images={i['folder']}/test/disc",
    ],
    "export": lambda i: [
        "big_vit_lite.export",
        f"--src={i['npz']}",
        f"--out={i['root'] / 'out.npz'}",
    ],
    "plan": lambda i: [
        "big_vit_lite.plan",
        "--config=configs/demo.py:runlocal",
        "--mesh=data:2",
    ],
    "report": lambda i: ["big_vit_lite.report", i["run"]],
    "prepare": lambda i: ["big_vit_lite.data.prepare", "mnist10k"],
}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("tool", sorted(COMMANDS))
def test_side_tool_prints_no_start_up_noise(tool, inputs, tfds_data_dir):
  """Guards against TensorFlow's start-up banner, absl's notice and the error-level
  oneDNN line in a side tool's output (train's quiet start-up not applied to it), and
  few-shot's per-seed lines at the default verbosity."""
  p = _run(COMMANDS[tool](inputs), tfds_data_dir)
  assert p.returncode == 0, p.stderr[-3000:]
  out = p.stdout + p.stderr
  for noise in NOISE:
    assert noise not in out, (noise, out[-3000:])
  assert not CPP_ERROR.search(out), out[-3000:]
  if tool == "evaluate":
    # Per-seed lines only with --verbosity=1; the table once, at the end.
    assert " seed 0: " not in out, out[-3000:]
    assert out.count("1-shot") == 1, out[-3000:]
    assert p.stdout.splitlines()[-2].split()[0] == "shapes3", p.stdout
