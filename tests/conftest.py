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


@pytest.fixture(scope="session")
def tfds_data_dir():
  from big_vit_lite.data import prepare  # pylint: disable=import-outside-toplevel

  data_dir = _test_data_dir()
  os.makedirs(data_dir, exist_ok=True)
  # Several pytest runs may share the dir: one prepares, the others wait.
  with open(os.path.join(data_dir, ".bvl_prepare.lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      for name in OFFLINE:
        try:
          prepare.prepare(name, data_dir, source="offline")
        except FileNotFoundError as e:
          pytest.fail(f"cannot prepare {name}: {e}", pytrace=False)
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  return data_dir
