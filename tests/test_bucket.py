"""Data and workdirs on gs:// through the real GCS clients, against a fake.

tests/fake_gcs.py is the fake: TensorFlow's GCS filesystem (tf.io.gfile,
tf.data, tfds, etils.epath) and tensorstore (orbax's arrays) talk HTTPS to
storage.googleapis.com as they would on a TPU VM, through a proxy that serves
the bucket from a local folder. So the bytes a test finds on disk are the
bytes a real bucket would hold, and the oracle of each test is the same work
done on a local disk.
"""

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
import fake_gcs
import forkserver
import test_docs_commands
import trainer_runs

BUCKET = "fake-bucket"


@contextlib.contextmanager
def _fake_gcs(folder):
  """The fake serving folder/gcs/fake-bucket (server.bucket); at the end, it refused nothing."""
  if not shutil.which("openssl"):
    pytest.skip("the fake's TLS certificates are made by the openssl command")
  root = folder / "gcs"
  (root / BUCKET).mkdir(parents=True)
  server = fake_gcs.FakeGcs(str(root), str(folder / "gcs.log"))
  server.bucket = root / BUCKET
  try:
    yield server
  finally:
    server.stop()
  assert (
      not server.unhandled()
  ), f"requests the fake refused: {server.unhandled()}"


@pytest.fixture
def gcs(tmp_path, monkeypatch):
  """The fake serving tmp_path/gcs/fake-bucket; its env set in this process."""
  with _fake_gcs(tmp_path) as server:
    for key, value in server.env.items():
      monkeypatch.setenv(key, value)
    yield server


def test_tensorflow_reads_writes_lists_and_renames_on_the_bucket(gcs):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  gfile = tf.io.gfile
  url = f"gs://{BUCKET}"
  data = np.random.default_rng(0).bytes(3_000_000)
  with gfile.GFile(f"{url}/a/b.bin", "wb") as f:
    f.write(data)
  assert (gcs.bucket / "a" / "b.bin").read_bytes() == data
  (gcs.bucket / "a" / "c.txt").write_text("on disk first")
  with gfile.GFile(f"{url}/a/c.txt") as f:
    assert f.read() == "on disk first"
  with gfile.GFile(f"{url}/a/b.bin", "rb") as f:  # A ranged read.
    f.seek(2_999_990)
    assert f.read() == data[-10:]
  assert sorted(gfile.listdir(f"{url}/a")) == ["b.bin", "c.txt"]
  assert gfile.isdir(f"{url}/a") and not gfile.exists(f"{url}/nothing")
  assert gfile.glob(f"{url}/a/*.txt") == [f"{url}/a/c.txt"]
  gfile.makedirs(f"{url}/x/y")
  assert gfile.isdir(f"{url}/x/y") and (gcs.bucket / "x" / "y").is_dir()
  gfile.rename(f"{url}/a/c.txt", f"{url}/x/y/c.txt")
  assert sorted(os.listdir(gcs.bucket / "a")) == ["b.bin"]
  assert (gcs.bucket / "x" / "y" / "c.txt").read_text() == "on disk first"
  gfile.rmtree(f"{url}/x")
  assert sorted(os.listdir(gcs.bucket)) == ["a"]
  records = [b"record %d" % i for i in range(300)]
  with tf.io.TFRecordWriter(f"{url}/r.tfrecord") as writer:
    for record in records:
      writer.write(record)
  read_back = tf.data.TFRecordDataset(str(gcs.bucket / "r.tfrecord"))
  assert [r.numpy() for r in read_back] == records
  read_back = tf.data.TFRecordDataset(f"{url}/r.tfrecord")
  assert [r.numpy() for r in read_back] == records
  # Each of these went to the fake, not to a local "gs:" folder.
  hosts = {host for _, host, _, _ in gcs.requests()}
  assert hosts == {"www.googleapis.com", "storage.googleapis.com"}


@pytest.mark.slow
def test_prepare_on_a_bucket_writes_what_it_writes_locally(
    documented_bucket, tfds_data_dir
):
  """`prepare NAME --data_dir=gs://...` (the documented loop's, run once for this file): tfds
  writes through the bucket (and renames its incomplete.* folder there): its record files hold
  the examples of a local prepare, in the same order."""
  prepared = documented_bucket.bucket / "tensorflow_datasets"
  local = os.path.join(tfds_data_dir, "mnist10k", "1.0.0")
  on_bucket = prepared / "mnist10k" / "1.0.0"
  records = sorted(f for f in os.listdir(local) if ".tfrecord" in f)
  assert len(records) >= 2
  assert sorted(f for f in os.listdir(on_bucket) if ".tfrecord" in f) == records
  # Compared as protos: the serialised bytes may order a proto map's
  # entries (the feature names) differently from one process to the next.
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  def examples(path):
    records = tf.data.TFRecordDataset(os.fspath(path))
    return [tf.train.Example.FromString(r.numpy()) for r in records]

  for name in records:
    expected = examples(os.path.join(local, name))
    assert len(expected) > 100 and examples(on_bucket / name) == expected, name
  info = json.loads((on_bucket / "dataset_info.json").read_text())
  assert {s["name"] for s in info["splits"]} == {"train", "test"}
  assert not [p for p in os.listdir(prepared) if "incomplete" in p]


@pytest.mark.slow
def test_training_reads_a_bucket_and_resumes_from_a_bucket_workdir(
    gcs, tfds_data_dir
):
  """TFDS_DATA_DIR=gs://... and --workdir=gs://...: records through tf.data,
  checkpoints through orbax/tensorstore, metrics through epath. A run resumed
  from step 8 on the bucket logs the losses of a local run, and its checkpoint
  holds the same arrays."""
  shutil.copytree(
      os.path.join(tfds_data_dir, "fashion_mnist"),
      gcs.bucket / "tfds" / "fashion_mnist",
  )
  # The local run of the same config: the suite's shared tiny run.
  local, _ = trainer_runs.tiny_run(tfds_data_dir)

  def on_bucket(*overrides):
    return subprocess.run(
        forkserver.command(
            trainer_runs.train_cmd(
                f"gs://{BUCKET}/run", trainer_runs.TINY, *overrides
            )
        ),
        env={**trainer_runs.env_for(f"gs://{BUCKET}/tfds"), **gcs.env},
        cwd=trainer_runs.ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )

  proc = on_bucket()
  assert proc.returncode == 0, proc.stderr[-3000:]
  checkpoints = gcs.bucket / "run" / "checkpoints"
  assert sorted(os.listdir(checkpoints), key=int) == ["4", "8", "12"]
  # A preemption after step 8's save: the run resumes from the bucket.
  shutil.rmtree(checkpoints / "12")
  proc = on_bucket()
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert re.search(rf"Resuming from gs://{BUCKET}/run\S*/8\b", proc.stderr)
  expected = trainer_runs.read_losses(local)
  assert sorted(expected) == list(range(1, 13))
  assert trainer_runs.read_losses(str(gcs.bucket / "run")) == expected
  # The arrays tensorstore wrote to the bucket, read back from its disk, and
  # through the bucket (as `config.model_init=gs://.../run` reads them).
  trainer_runs.assert_same_params(local, str(checkpoints / "12"))
  trainer_runs.assert_same_params(local, f"gs://{BUCKET}/run")


def test_a_bucket_workdir_without_google_cloud_storage_says_what_to_install(
    monkeypatch, tmp_path
):
  """orbax lists gs:// checkpoints with google-cloud-storage; without it the
  trainer failed deep in orbax with an ImportError."""
  monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
  with pytest.raises(ValueError, match=r"pip install 'big_vit_lite\[gcs\]'"):
    checkpoint.Checkpointer("gs://fake-bucket/run")
  checkpoint.Checkpointer(tmp_path / "run").close()  # Local: not needed.


def _bucket_commands():
  """The documented bucket commands (test_docs_commands' `bucket` rows)."""
  return [
      (doc, line, raw, block_env)
      for doc, line, words, block_env, raw in test_docs_commands.CMDS
      if getattr(test_docs_commands.lookup(words), "mode", None) == "bucket"
  ]


@pytest.fixture(scope="module")
def documented_bucket(tmp_path_factory, tfds_data_dir):
  """The fake after docs/jft_scale.md's bucket example ran on it as written (MY_BUCKET: the
  fake's bucket; the demo cut to runlocal, as test_docs_commands runs it), once for the tests
  that read what it wrote. Its `python` is the fork server's, as in test_docs_commands (the
  same environment: the same zygotes).
  """
  commands = _bucket_commands()
  assert [raw.split()[0] for _, _, raw, _ in commands] == [
      "for",
      "TFDS_DATA_DIR=gs://MY_BUCKET/tensorflow_datasets",
  ]
  env = dict(os.environ)
  env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
  if forkserver.enabled():
    env["PATH"] = f"{forkserver.bin_dir()}:{env['PATH']}"
  with _fake_gcs(tmp_path_factory.mktemp("documented")) as server:
    for doc, line, raw, block_env in commands:
      cmd = raw.replace("MY_BUCKET", BUCKET).replace(
          "--config=configs/demo.py",
          "--config=configs/demo.py:runlocal --config.total_steps=6"
          # (~6 s of CPU: the data it reads, the few-shot eval reads)
          " --config.evals.fewshot.pixel_baseline=False",
      )
      proc = subprocess.run(
          ["bash", "-c", cmd],
          env={**env, **block_env, **server.env},
          cwd=trainer_runs.ROOT,
          capture_output=True,
          text=True,
          timeout=900,
      )
      assert proc.returncode == 0, f"{doc}:{line}: {cmd}\n{proc.stderr[-3000:]}"
      if raw.startswith("for"):
        # The loop's status is its last prepare's: each one's summary line
        # says it wrote its splits on the bucket.
        for name in ("fashion_mnist", "mnist10k", "animal_mnist"):
          on_bucket = f"in gs://{BUCKET}/tensorflow_datasets/{name}/"
          summaries = [
              l
              for l in proc.stdout.splitlines()
              if l.startswith(f"{name}: {{") and on_bucket in l
          ]
          assert summaries, (name, proc.stdout[-3000:])
    yield server


@pytest.mark.slow
def test_documented_bucket_commands_run_against_the_fake(documented_bucket):
  """The documented commands prepared the three datasets on the bucket and trained the demo
  there (documented_bucket ran them)."""
  prepared = documented_bucket.bucket / "tensorflow_datasets"
  for name in ("fashion_mnist", "mnist10k", "animal_mnist"):
    assert (prepared / name).is_dir() and not [
        p for p in os.listdir(prepared / name) if "incomplete" in p
    ], name
  run = documented_bucket.bucket / "runs" / "demo"
  assert max(trainer_runs.read_losses(str(run))) == 6
  assert "6" in os.listdir(run / "checkpoints")
