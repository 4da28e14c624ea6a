"""Workdirs and checkpoint sources on a bucket (gs://...): every access goes through epath.

No bucket is reachable from the tests, so `gs://` paths are served from a
local folder by etils' own test backend (`epath.testing.mock_epath`). Code
that bypassed epath (`open`, `os.path`, `os.makedirs`) would see "gs:/..."
as a relative local path: it fails, or leaves a "gs:" folder in the current
directory, which the fixture checks for. Orbax's array I/O (tensorstore) and
TensorBoard's writer (tf.io.gfile) talk to GCS themselves and are not covered.
"""

import os

import numpy as np
import pytest
from etils.epath import gpath
from etils.epath import testing as epath_testing

from big_vit_lite.trainer import checkpoint
from big_vit_lite.logs import metrics
from big_vit_lite.runtime import paths


@pytest.fixture
def fake_bucket(tmp_path, monkeypatch):
  """gs://NAME/... -> tmp_path/bucket/NAME/... for everything that goes through epath."""
  root = tmp_path / "bucket"
  root.mkdir()
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  # With TensorFlow installed epath hands gs:// to tf.io.gfile (real GCS); this
  # makes it use its backend table, which mock_epath replaces. epath caches
  # its "is TF installed" answer on first use (any earlier test that touched
  # epath), so the cache is cleared for the variable to count, and again after.
  monkeypatch.setenv("EPATH_USE_TF", "false")
  gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access

  def local(path):
    path = os.fspath(path)
    return (
        str(root / path[len("gs://") :]) if path.startswith("gs://") else path
    )

  def one(fn, path, *args, **kwargs):
    return fn(local(path), *args, **kwargs)

  def two(fn, src, dst, *args, **kwargs):
    return fn(local(src), local(dst), *args, **kwargs)

  with epath_testing.mock_epath(
      open=one,
      exists=one,
      isdir=one,
      listdir=one,
      glob=one,
      makedirs=one,
      mkdir=one,
      remove=one,
      rmtree=one,
      stat=one,
      walk=one,
      rename=two,
      replace=two,
      copy=two,
  ):
    yield root
  monkeypatch.undo()
  gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access
  assert not os.listdir(
      cwd
  ), "something wrote to a local 'gs:' path, bypassing epath"


def test_resolve_passes_uris_through_and_makes_local_paths_absolute(
    tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert str(paths.resolve("gs://b/x")) == "gs://b/x"
  assert (
      str(paths.resolve("gs://b/x") / "checkpoints") == "gs://b/x/checkpoints"
  )
  assert str(paths.resolve("run")) == str(tmp_path / "run")
  assert str(paths.resolve("~/run")) == str(tmp_path / "home" / "run")
  assert str(paths.resolve(tmp_path / "a" / ".." / "b")) == str(tmp_path / "b")
  for bad in ("", "ram://x"):
    with pytest.raises(ValueError):
      paths.resolve(bad)


def test_metrics_on_a_bucket_append_and_trim_on_resume(fake_bucket):
  writer = metrics.MetricWriter("gs://b/run", tensorboard=False)
  writer.start_run(None)
  for step in (1, 2, 3):
    writer.write(step, {"training_loss": float(step)})
  writer = metrics.MetricWriter("gs://b/run", tensorboard=False)
  writer.start_run(2)  # Resumed from the checkpoint of step 2.
  writer.write(3, {"training_loss": 30.0})
  assert metrics.read_metrics("gs://b/run") == [
      {"step": 1, "training_loss": 1.0},
      {"step": 2, "training_loss": 2.0},
      {"step": 3, "training_loss": 30.0},
  ]
  # tmp renamed away.
  assert sorted(os.listdir(fake_bucket / "b" / "run")) == ["metrics.jsonl"]


def test_load_params_sources_on_a_bucket(fake_bucket):
  np.savez(
      fake_bucket / "w.npz", **{"head/kernel": np.ones((2, 3), np.float32)}
  )
  params, config = checkpoint.load_params("gs://w.npz")
  np.testing.assert_array_equal(params["head"]["kernel"], np.ones((2, 3)))
  assert config is None
  with pytest.raises(ValueError, match="No such .npz"):
    checkpoint.load_params("gs://missing.npz")
  with pytest.raises(ValueError, match="does not exist"):
    checkpoint.load_params("gs://b/no_run")
  # A workdir's newest complete step is found through epath (the arrays
  # themselves are read by tensorstore, which needs a real bucket).
  for step in (4, 8):
    (fake_bucket / "b" / "run" / "checkpoints" / str(step) / "state").mkdir(
        parents=True
    )
    # On gs:// orbax marks a finished step with this file (no atomic rename
    # there).
    (
        fake_bucket
        / "b"
        / "run"
        / "checkpoints"
        / str(step)
        / "commit_success.txt"
    ).write_text("")
  (
      fake_bucket / "b" / "run" / "checkpoints" / "12.orbax-checkpoint-tmp"
  ).mkdir()
  assert (
      str(checkpoint.resolve_step_dir("gs://b/run"))
      == "gs://b/run/checkpoints/8"
  )


def test_model_init_npz_on_a_bucket(fake_bucket):
  # `config.model_init=gs://...npz` goes through models.formats.read_params.
  from big_vit_lite.models import formats

  np.savez(
      fake_bucket / "init.npz",
      **{"head/kernel": np.full((2, 3), 2.0, np.float32)}
  )
  flat = formats.read_params("gs://init.npz")
  np.testing.assert_array_equal(flat["head/kernel"], np.full((2, 3), 2.0))
  with pytest.raises(ValueError, match="does not exist"):
    formats.read_params("gs://missing_init.npz")


def test_tfds_data_dir_on_a_bucket_is_found_and_listed_through_epath(
    fake_bucket, tmp_path
):
  """TFDS_DATA_DIR=gs://... (docs/tpu.md): the dataset's metadata, splits and file pieces
  are read through epath, and the pieces the pipeline opens are the bucket's files. The
  records themselves are read by tf.data's own GCS filesystem, which no local fake reaches.
  """
  import shutil  # pylint: disable=import-outside-toplevel
  import data_fixtures  # pylint: disable=import-outside-toplevel
  from big_vit_lite.data import sources  # pylint: disable=import-outside-toplevel

  local = tmp_path / "local_tfds"
  data_fixtures.prepare_tiny_ids(str(local))
  shutil.copytree(local, fake_bucket / "b" / "tfds")
  source = sources.TfdsSource("bvl_tiny_ids", "train[10:]", "gs://b/tfds")
  assert source.num_examples == 990
  pieces = source._pieces_in(0, 990)  # pylint: disable=protected-access
  assert [
      os.fspath(f).startswith("gs://b/tfds/bvl_tiny_ids/1.0.0/")
      for f, _, _ in pieces
  ] == [True] * 4
  assert sum(take for _, _, take in pieces) == 990 and pieces[0][1] == 10
  with pytest.raises(ValueError, match="not prepared in gs://b/tfds"):
    sources.TfdsSource("mnist10k", "train", "gs://b/tfds")
