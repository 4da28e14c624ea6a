"""Workdir and checkpoint paths that may be local or on a bucket (gs://, s3://, ...).

Every file the trainer and evaluator read or write goes through
`etils.epath` (as orbax does), so `--workdir=gs://bucket/run` works the same
as a local directory. `resolve` leaves a URI untouched (os.path.abspath would
turn `gs://b/x` into `$PWD/gs:/b/x`) and makes a local path absolute with `~`
expanded, so that it names the same directory whatever the current
directory is later.

`lock_workdir` keeps a second trainer out of a workdir that one is using
(both would write the same checkpoint steps and interleave metrics.jsonl).
"""

import contextlib
import fcntl
import importlib
import os
import socket

from absl import logging

from etils import epath


def is_uri(path):
  """True for `scheme://...` paths (buckets), False for local ones."""
  return "://" in os.fspath(path)


def resolve(path):
  """A workdir / checkpoint source -> epath.Path (URIs as given, local paths absolute)."""
  if not os.fspath(path):
    raise ValueError(
        "Got an empty path: pass a directory, e.g. --workdir=workdirs/run."
    )
  if is_uri(path):
    try:
      return epath.Path(path)
    except KeyError:  # epath knows gs://, s3://, az://, hf://.
      raise ValueError(
          f"Unsupported filesystem in {os.fspath(path)!r}: use a local path or "
          "gs://, s3://, az://."
      ) from None
  return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def check_checkpoint_client(directory):
  """Orbax lists gs:// checkpoints with google-cloud-storage: say how to get it."""
  if not os.fspath(directory).startswith("gs://"):
    return
  try:
    importlib.import_module("google.cloud.storage")
  except ImportError:
    raise ValueError(
        f"Checkpoints in {os.fspath(directory)} need google-cloud-storage "
        "(orbax asks it about the bucket): pip install 'big_vit_lite[gcs]' "
        "(the [tpu] extra includes it)."
    ) from None


@contextlib.contextmanager
def lock_workdir(workdir):
  """Holds an exclusive lock on `workdir/.lock` while the block runs (local workdirs).

  flock: the kernel drops it when the holder dies, even by `kill -9`, so a
  restarted run never finds a stale lock. Buckets have no locks: skipped.
  """
  if is_uri(workdir):
    yield
    return
  path = os.path.join(os.fspath(workdir), ".lock")
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  # E.g. a read-only mount: nothing could be saved there either.
  except OSError as e:
    raise ValueError(
        f"Cannot write to --workdir {workdir}: {e.strerror or e}."
    ) from None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = (
          os.pread(fd, 200, 0).decode(errors="replace").strip()
          or "another process"
      )
      raise ValueError(
          f"Another trainer ({holder}) is using --workdir {workdir}: wait for it "
          "to finish or stop it, or pass another --workdir."
      ) from None
    except OSError as e:  # A filesystem without locks (some network mounts).
      logging.warning(
          "Cannot lock %s (%s); not guarding against a second trainer.", path, e
      )
    else:
      os.ftruncate(fd, 0)
      os.pwrite(
          fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0
      )
    yield
  finally:
    os.close(fd)
