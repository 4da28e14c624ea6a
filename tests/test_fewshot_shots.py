"""Few-shot on a small image folder: the default shot list adapts, an explicit one does not."""

import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from big_vit_lite.runtime import sharding
from big_vit_lite.evaluators import fewshot
from big_vit_lite.evaluators import presets
from big_vit_lite.models import vit

import evaluator_fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREY_PP = "decode(channels=1)|value_range(-1, 1)|keep('image', 'label')"


@pytest.fixture(scope="module")
def folder15(tmp_path_factory):
  """15 train images per class: enough for 1, 5 and 10 shots, not for the default 25."""
  root = str(tmp_path_factory.mktemp("f") / "shapes15")
  return evaluator_fixtures.write_image_folder(root, n_train=15, n_test=6)


def _pixels(params, images):
  del params
  flat = images.reshape(images.shape[0], -1)
  return flat, {"pre_logits": flat}


def test_default_shots_drop_what_the_folder_cannot_supply(folder15, caplog):
  mesh = sharding.make_mesh([("data", -1)])
  with caplog.at_level(logging.WARNING):
    ev = fewshot.Evaluator(
        _pixels,
        mesh=mesh,
        datasets=presets.folder_datasets(folder15),
        pp=GREY_PP,
        num_seeds=2,
        batch_size=16,
    )
  warned = [
      r.getMessage()
      for r in caplog.records
      if "skipping the default" in r.getMessage()
  ]
  assert warned == [
      "Few-shot dataset 'shapes15' (imagefolder, split 'train'): class 0 has only "
      "15 train examples: skipping the default 25-shot (set `shots` to choose the "
      "counts)."
  ], warned
  res = ev.run({})
  assert set(res) == {
      "shapes15_1shot",
      "shapes15_5shot",
      "shapes15_10shot",
  }, res
  assert res["shapes15_10shot"] > 0.9, res  # 3 easy classes; chance is 1/3
  # Explicit shots are taken as given: as many as the folder has is fine, one
  # more is an error.
  ev = fewshot.Evaluator(
      _pixels,
      mesh=mesh,
      datasets=presets.folder_datasets(folder15),
      pp=GREY_PP,
      shots=(2, 15),
      num_seeds=1,
      batch_size=16,
  )
  assert set(ev.run({})) == {"shapes15_2shot", "shapes15_15shot"}
  with pytest.raises(
      ValueError,
      match=r"^Few-shot dataset 'shapes15' .*class 0 has only 15 "
      r"train examples, too few for 25-shot; lower `shots` to at most 15 or use a "
      r"bigger train split\.$",
  ):
    fewshot.Evaluator(
        _pixels,
        mesh=mesh,
        datasets=presets.folder_datasets(folder15),
        pp=GREY_PP,
        shots=(1, 5, 10, 25),
        num_seeds=1,
        batch_size=16,
    )


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  return evaluator_fixtures.save_tiny_npz(tmp_path_factory.mktemp("npz"))


def _evaluate(folder, npz, out, *overrides):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run(
      [
          sys.executable,
          "-m",
          "big_vit_lite.evaluate",
          f"--config=configs/fewshot.py:channels=3," f"folder={folder}",
          f"--workdir={out}",
          f"--config.model_init={npz}",
          "--config.evals.fewshot.num_seeds=2",
          *overrides,
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=200,
  )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_evaluate_on_a_small_folder_runs_the_shots_it_can(
    folder15, tiny_npz, tmp_path
):
  # The command: it refused to start because the default shots include
  # 25.
  p = _evaluate(folder15, tiny_npz, tmp_path / "out")
  assert p.returncode == 0, p.stderr[-3000:]
  warned = [l for l in p.stderr.splitlines() if "skipping the default" in l]
  assert len(warned) == 1 and warned[0].endswith(
      "class 0 has only 15 train examples: skipping the default 25-shot (set `shots` to choose "
      "the counts)."
  ), p.stderr[-3000:]
  (row,) = [json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")]
  assert {k for k in row if k != "step"} == {
      f"fewshot/shapes15_{k}shot" for k in (1, 5, 10)
  }
  assert "10-shot" in p.stdout and "25-shot" not in p.stdout
  summary = json.load(open(tmp_path / "out" / "summary.json"))
  assert summary["status"] == "finished" and summary["source"] == tiny_npz
  assert summary["final"] == {k: v for k, v in row.items() if k != "step"}
  assert "==== Summary: evaluate finished" in p.stderr
  # Set explicitly, the same 25 stays a one-line error.
  p = _evaluate(
      folder15,
      tiny_npz,
      tmp_path / "out2",
      "--config.evals.fewshot.shots=(1, 25)",
  )
  assert p.returncode == 1
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith("big_vit_lite.evaluate: error: ") and (
      "class 0 has only 15 train examples, too few for 25-shot; lower `shots` to at most 15"
      in last
  ), p.stderr[-2000:]
  assert "Traceback" not in p.stderr
