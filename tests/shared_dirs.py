"""Folders the test processes share: one lock file at a time, and folders built once per run."""

import contextlib
import fcntl
import os
import shutil


@contextlib.contextmanager
def locked(path):
  """Holds an exclusive lock on the file `path` (made if missing): one process at a time."""
  with open(path, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def built_once(name, build):
  """The folder `name`, filled by `build(folder)` once per pytest run: the first process to ask
  builds it under a lock, the others (xdist workers) wait for it and reuse it.

  Tests read what is in it and write nowhere in it. A build that raises leaves no folder, so the
  next caller builds again (and fails the same way).
  """
  root = os.environ["BVL_TEST_BUILT_DIR"]
  folder = os.path.join(root, name)
  done = folder + ".done"
  with locked(folder + ".lock"):
    if not os.path.exists(done):
      shutil.rmtree(folder, ignore_errors=True)
      os.makedirs(folder)
      try:
        build(folder)
      except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
      open(done, "w").close()
  return folder
