"""Workdir and checkpoint paths that may be local or on a bucket (gs://, s3://, ...).

Every file the trainer and evaluator read or write goes through
`etils.epath` (as orbax does), so `--workdir=gs://bucket/run` works the same
as a local directory. `resolve` leaves a URI untouched (os.path.abspath would
turn `gs://b/x` into `$PWD/gs:/b/x`) and makes a local path absolute with `~`
expanded, so that it names the same directory whatever the current
directory is later.
"""
import os

from etils import epath


def is_uri(path):
  """True for `scheme://...` paths (buckets), False for local ones."""
  return "://" in os.fspath(path)


def resolve(path):
  """A workdir / checkpoint source -> epath.Path (URIs as given, local paths absolute)."""
  if not isinstance(path, (str, os.PathLike)):
    raise ValueError(f"Expected a path (str or os.PathLike), got {type(path).__name__}: {path!r}.")
  if not os.fspath(path):
    raise ValueError("Got an empty path: pass a directory, e.g. --workdir=workdirs/run.")
  if is_uri(path):
    try:
      return epath.Path(path)
    except KeyError:  # epath knows gs://, s3://, az://, hf://.
      raise ValueError(f"Unsupported filesystem in {os.fspath(path)!r}: use a local path or "
                       "gs://, s3://, az://.") from None
  return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
