"""Shared pytest fixtures.

`tfds_data_dir`: a tfds data dir holding the three offline datasets
(fashion_mnist, mnist10k, animal_mnist), prepared once and reused across
sessions. Where: $BVL_TEST_DATA_DIR, else $TFDS_DATA_DIR, else
~/tensorflow_datasets. Their sources must be installed first with
scripts/fetch_offline_sources.sh (.ci/run does it before pytest).
"""
import fcntl
import os

import pytest

OFFLINE = ("fashion_mnist", "mnist10k", "animal_mnist")


def _test_data_dir():
  return os.path.expanduser(os.environ.get("BVL_TEST_DATA_DIR") or os.environ.get("TFDS_DATA_DIR")
                            or "~/tensorflow_datasets")


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
