"""ImageNet-21k builder on a tiny fake release, mock_data runs, the prepare CLI."""

import io
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from big_vit_lite.data import image_check
from big_vit_lite.data import input_pipeline as ip
from big_vit_lite.data import prepare


def _add(tar, name, data):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def _fake_release(manual_dir, synsets, per_class=3):
  """winter21_whole.tar.gz layout: a gzip'd tar of per-synset tars of JPEGs."""
  rng = np.random.default_rng(0)
  os.makedirs(manual_dir)
  with tarfile.open(
      os.path.join(manual_dir, "winter21_whole.tar.gz"), "w:gz"
  ) as outer:
    for s in synsets:
      buf = io.BytesIO()
      with tarfile.open(fileobj=buf, mode="w") as inner:
        for i in range(per_class):
          jpg = io.BytesIO()
          Image.fromarray(
              rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)
          ).save(jpg, "JPEG")
          _add(inner, f"{s}_{i}.JPEG", jpg.getvalue())
        _add(inner, f"{s}_broken.JPEG", b"<html>not an image</html>")
        # a PNG posing as JPEG (ImageNet has some) and a truncated JPEG
        if s == synsets[0]:
          png = io.BytesIO()
          Image.fromarray(rng.integers(0, 256, (9, 9), dtype=np.uint8)).save(
              png, "PNG"
          )
          _add(inner, f"{s}_png.JPEG", png.getvalue())
          _add(inner, f"{s}_cut.JPEG", jpg.getvalue()[:200])
      _add(outer, f"winter21_whole/{s}.tar", buf.getvalue())


def test_imagenet21k_builds_from_release_tars(tmp_path):
  manual, data_dir = str(tmp_path / "manual"), str(tmp_path / "tfds")
  synsets = ["n00000003", "n00000001", "n00000002"]
  _fake_release(manual, synsets)
  builder, _ = prepare.prepare(
      "imagenet21k/custom", data_dir, manual_dir=manual
  )
  # 3 per class + the PNG; the 3 non-images and the truncated JPEG skipped.
  assert builder.info.splits["full"].num_examples == 10
  reread = tfds.builder("imagenet21k/custom", data_dir=data_dir)
  assert reread.info.features["label"].names == sorted(synsets)
  batches = list(
      ip.make_eval_iterator(
          dict(name="imagenet21k/custom", split="full", data_dir=data_dir),
          "decode_jpeg_and_inception_crop(8)|keep('image', 'label', 'file_name')",
          4,
          process_index=0,
          process_count=1,
      )
  )
  names = np.concatenate([b["file_name"] for b in batches])[
      np.concatenate([b["_mask"] for b in batches])
  ]
  labels = np.concatenate([b["label"] for b in batches])[
      np.concatenate([b["_mask"] for b in batches])
  ]
  for n, l in zip(names, labels):
    assert n.decode().startswith(sorted(synsets)[l])
  # The release configs check the class count.
  with pytest.raises(ValueError, match="19167"):
    prepare.prepare("imagenet21k/winter21", data_dir, manual_dir=manual)


def test_imagenet_configs_run_on_tfds_mock_data():
  with tfds.testing.mock_data(num_examples=10):
    for name, split in [
        ("imagenet21k", "full[51200:]"),
        ("imagenet2012", "train[:99%]"),
    ]:
      it = ip.make_train_iterator(
          dict(
              data=dict(name=name, split=split),
              batch_size=4,
              num_shards=2,
              pp="decode_jpeg_and_inception_crop(16)|flip_lr|value_range(-1, 1)|"
              "onehot(21841, key_result='labels')|keep('image', 'labels')",
          ),
          seed=0,
          process_index=0,
          process_count=1,
      )
      batch = [next(it) for _ in range(3)][-1]
      assert batch["image"].shape == (4, 16, 16, 3) and batch[
          "labels"
      ].shape == (4, 21841)
      ev = ip.make_eval_iterator(
          dict(name=name, split=split),
          "decode|resize(8)",
          4,
          process_index=0,
          process_count=1,
      )
      assert sum(int(b["_mask"].sum()) for b in ev) == 10


def test_prepare_unknown_dataset_is_one_line(tmp_path):
  with pytest.raises(ValueError, match="unknown dataset"):
    prepare.prepare("no_such_dataset_xyz", str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_prepare_cli_reports_sizes(tfds_data_dir):
  out = subprocess.run(
      [
          sys.executable,
          "-m",
          "big_vit_lite.data.prepare",
          "mnist10k",
          f"--data_dir={tfds_data_dir}",
      ],
      capture_output=True,
      text=True,
      timeout=110,
      check=False,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "'train': 8000" in out.stdout and "'test': 2000" in out.stdout


def test_imagenet21k_reads_per_synset_tars_and_folders(tmp_path):
  from big_vit_lite.data.builders import imagenet21k  # pylint: disable=import-outside-toplevel

  manual = tmp_path / "m"
  manual.mkdir()
  with tarfile.open(manual / "n00000002.tar", "w") as t:  # a per-synset tar
    _add(t, "n00000002_7.JPEG", b"\xff\xd8jpeg bytes")
  (manual / "n00000001").mkdir()  # an extracted synset folder
  (manual / "n00000001" / "n00000001_3.JPEG").write_bytes(b"\xff\xd8more")
  (manual / "synsets_notes.txt").write_text("ignored")
  assert imagenet21k.find_synsets(str(manual)) == ["n00000001", "n00000002"]
  got = [(s, n, d) for s, n, d in imagenet21k.iter_images(str(manual))]
  assert got == [
      ("n00000001", "n00000001_3.JPEG", b"\xff\xd8more"),
      ("n00000002", "n00000002_7.JPEG", b"\xff\xd8jpeg bytes"),
  ]


RNG = np.random.default_rng(0)


def test_imagenet21k_builder_skips_files_tf_would_misread():
  def encoded(mode, fmt):
    buf = io.BytesIO()
    Image.fromarray(RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)).convert(
        mode
    ).save(buf, fmt)
    return buf.getvalue()

  # The builder stores the bytes it checks as they are: these were stored, then
  # read as wrong colours (palette BMP) or stopped training (TIFF).
  assert "BMP" in image_check.bytes_problem(encoded("P", "BMP"))
  assert "TIFF" in image_check.bytes_problem(encoded("RGB", "TIFF"))
  assert image_check.bytes_problem(encoded("RGB", "JPEG")) is None
