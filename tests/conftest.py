"""Shared pytest fixtures.

`tfds_data_dir`: a tfds data dir holding the three offline datasets
(fashion_mnist, mnist10k, animal_mnist), prepared once and reused across
sessions. Where: $BVL_TEST_DATA_DIR, else $TFDS_DATA_DIR, else
~/tensorflow_datasets. Their sources must be installed first with
scripts/fetch_offline_sources.sh (.ci/run does it before pytest).

JAX's persistent compilation cache is on for the whole run (a temporary dir,
shared with the trainer subprocesses and xdist workers through the
environment): the kill/resume tests start the same tiny run several times,
and each start compiled the same programs again (~7 s of a ~22 s start).
"""

import atexit
import fcntl
import os
import shutil
import tempfile

import pytest

OFFLINE = ("fashion_mnist", "mnist10k", "animal_mnist")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="bvl-test-jax-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(
      JAX_COMPILATION_CACHE_DIR=_cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )


def _test_data_dir():
  return os.path.expanduser(
      os.environ.get("BVL_TEST_DATA_DIR")
      or os.environ.get("TFDS_DATA_DIR")
      or "~/tensorflow_datasets"
  )


def prepare_shared(data_dir, names, **kwargs):
  """Prepares the datasets `names` in `data_dir`, which several pytest runs and
  xdist workers may share: one prepares under the dir's lock, the others wait
  (a reader that did not wait could find a half-written dataset)."""
  from big_vit_lite.data import prepare  # pylint: disable=import-outside-toplevel

  with open(os.path.join(data_dir, ".bvl_prepare.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      for name in names:
        prepare.prepare(name, data_dir, **kwargs)
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def tfds_data_dir():
  data_dir = _test_data_dir()
  os.makedirs(data_dir, exist_ok=True)
  try:
    prepare_shared(data_dir, OFFLINE, source="offline")
  except FileNotFoundError as e:
    pytest.fail(f"cannot prepare the offline datasets: {e}", pytrace=False)
  return data_dir


@pytest.fixture(scope="session")
def prepare_in_test_data(tfds_data_dir):
  """`prepare_in_test_data(name)` prepares one more dataset in tfds_data_dir."""
  return lambda name: prepare_shared(tfds_data_dir, [name])
