"""`python -m big_vit_lite.predict` on a real folder (with a corrupt file) and a real checkpoint."""

import csv
import json
import os
import subprocess
import sys

import jax
import numpy as np
from PIL import Image
import pytest
import tensorflow_datasets as tfds

from big_vit_lite.models import layout
from big_vit_lite.models import vit
from big_vit_lite.models import loading
from trainer_runs import ROOT, env_for, tiny_run
import forkserver

FASHION = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


@pytest.fixture(scope="module")
def trained(tfds_data_dir, tmp_path_factory):
  """A tiny ViT trained on Fashion-MNIST in a real process, and a folder of its test images."""
  workdir, _ = tiny_run(tfds_data_dir)
  folder = tmp_path_factory.mktemp("images")
  os.makedirs(folder / "sub")
  ds = tfds.load("fashion_mnist", split="test[:5]", data_dir=tfds_data_dir)
  for i, ex in enumerate(tfds.as_numpy(ds)):
    Image.fromarray(ex["image"][:, :, 0]).save(
        folder / ("sub" if i % 2 else "") / f"{i}.png"
    )
  Image.fromarray(np.zeros((40, 30, 3), np.uint8) + 200).save(
      folder / "big_rgb.jpg"
  )
  # header only
  (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)
  (folder / "readme.txt").write_text("not an image, not read")
  return workdir, str(folder)


def _predict(data_dir, *args):
  return subprocess.run(
      forkserver.command([sys.executable, "-m", "big_vit_lite.predict", *args]),
      env=env_for(data_dir, devices=2),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )


@pytest.mark.slow
def test_predict_jsonl_skips_the_corrupt_file_and_matches_the_model(
    trained, tfds_data_dir
):
  workdir, folder = trained
  r = _predict(
      tfds_data_dir, f"--model={workdir}", f"--images={folder}", "--top_k=3"
  )
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in r.stdout.splitlines()]
  assert sorted(os.path.relpath(row["file"], folder) for row in rows) == sorted(
      ["0.png", "sub/1.png", "2.png", "sub/3.png", "4.png", "big_rgb.jpg"]
  )
  skipped = [
      l for l in r.stderr.splitlines() if l.startswith("predict: skipped")
  ]
  assert len(skipped) == 1 and "corrupt.png: " in skipped[0], r.stderr[-2000:]
  assert "predict: 6 images predicted, 1 skipped" in r.stderr
  for row in rows:
    preds = row["predictions"]
    assert len(preds) == 3 and all(
        p["label"] == FASHION[p["class"]] for p in preds
    )
    probs = [p["prob"] for p in preds]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0 + 1e-5

  # The same probabilities as the model applied here to the same image.
  flat, saved, _ = loading.read_source(workdir)
  model = vit.Model(**dict(saved.model.to_dict(), dropout=0.0))
  params = layout.unflatten(flat)
  image = np.asarray(Image.open(os.path.join(folder, "0.png")), np.float32)[
      None, :, :, None
  ]
  logits, _ = model.apply({"params": params}, image / 127.5 - 1.0)
  probs = np.asarray(jax.nn.softmax(logits[0]))
  row = next(row for row in rows if row["file"].endswith("/0.png"))
  for p in row["predictions"]:
    assert p["prob"] == pytest.approx(float(probs[p["class"]]), abs=1e-4)


@pytest.mark.slow
def test_predict_csv_with_a_labels_file_and_bad_inputs(
    trained, tfds_data_dir, tmp_path
):
  workdir, folder = trained
  labels = tmp_path / "labels.txt"
  labels.write_text("".join(f"c{i}\n" for i in range(10)))
  out = tmp_path / "preds.csv"
  r = _predict(
      tfds_data_dir,
      f"--model={workdir}",
      f"--images={folder}/0.png,{folder}/sub",
      "--format=csv",
      f"--out={out}",
      f"--labels={labels}",
      "--top_k=2",
  )
  assert r.returncode == 0, r.stderr[-3000:]
  rows = list(csv.DictReader(open(out)))
  assert [(os.path.basename(x["file"]), x["rank"]) for x in rows] == [
      ("0.png", "1"),
      ("0.png", "2"),
      ("1.png", "1"),
      ("1.png", "2"),
      ("3.png", "1"),
      ("3.png", "2"),
  ]
  assert all(x["label"] == f"c{x['class']}" for x in rows)

  labels.write_text("a\nb\n")
  r = _predict(
      tfds_data_dir,
      f"--model={workdir}",
      f"--images={folder}",
      f"--labels={labels}",
  )
  assert (
      r.returncode == 1
      and "has 2 names, but the model has 10 classes" in r.stderr
  )
  r = _predict(
      tfds_data_dir, f"--model={workdir}", f"--images={folder}/corrupt.png"
  )
  assert r.returncode == 1 and "0 images predicted, 1 skipped" in r.stderr
