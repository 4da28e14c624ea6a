"""Weights & Biases for a training run: `config.wandb = dict(project="NAME", ...)`.

The same rows as metrics.jsonl (against their "step"), the config, and at the end the
summary (status, final and best metrics, img/s, MFU) go to one W&B run. Its id is kept in
WORKDIR/wandb_id.txt, so a resumed run (the same command again) continues the same W&B run;
the steps it trains again after the checkpoint are logged again, charted against "step".
Keys of config.wandb: project (required), and entity, name, group, tags, notes, mode
("online", "offline": written under WORKDIR/wandb for `wandb sync`, "disabled"); the
environment (WANDB_MODE, WANDB_API_KEY, ...) works as usual. Process 0 only.
Needs wandb: pip install 'big_vit_lite[wandb]'.
"""

import netrc
import os
import secrets
import socket
import urllib.parse

from absl import logging
import jax

from big_vit_lite.runtime import paths
from big_vit_lite.logs import summary as summary_lib

INSTALL = "pip install 'big_vit_lite[wandb]'"
KEYS = ("project", "entity", "name", "group", "tags", "notes", "mode")
ID_FILE = "wandb_id.txt"


def _plain(cfg):
  return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


def configured(cfg):
  """config.wandb's set keys as a plain dict; None when none is set (every training config
  has the keys, unset: config_knobs.trainer_knobs)."""
  if cfg is None:
    return None
  cfg = {k: v for k, v in _plain(cfg).items() if v is not None}
  return cfg or None


def check(cfg):
  """A one-line ValueError for a config.wandb that cannot work (before the compile)."""
  cfg = configured(cfg)
  if cfg is None:
    return
  unknown = sorted(set(cfg) - set(KEYS))
  if unknown:
    raise ValueError(
        f"config.wandb has unknown keys {unknown}: use {', '.join(KEYS)}."
    )
  if not cfg.get("project"):
    raise ValueError(
        "config.wandb needs a project, e.g. --config.wandb.project=my-vits."
    )
  try:
    import wandb  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ValueError(
        f"config.wandb needs wandb, which is not installed: {INSTALL}"
    ) from None
  mode = cfg.get("mode") or os.environ.get("WANDB_MODE") or "online"
  if mode in ("online", "run"):
    check_online()


OFFLINE_HINT = (
    "or --config.wandb.mode=offline (the run is written under WORKDIR/wandb; "
    "upload it later with `wandb sync`)"
)


def check_online():
  """W&B's online mode: a login (WANDB_API_KEY or `wandb login`'s netrc entry) and its
  server reachable; else a one-line ValueError saying what to do."""
  base_url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
  url = urllib.parse.urlparse(base_url)
  host = url.hostname or "api.wandb.ai"
  if not os.environ.get("WANDB_API_KEY") and not _netrc_login(host):
    raise ValueError(
        "config.wandb: W&B's online mode needs a login, and there is none "
        "(no WANDB_API_KEY, no `wandb login`): run `wandb login`, "
        + OFFLINE_HINT
        + "."
    )
  port = url.port or (80 if url.scheme == "http" else 443)
  try:
    socket.create_connection((host, port), timeout=5).close()
  except OSError as e:
    raise ValueError(
        f"config.wandb: W&B's online mode cannot reach {base_url} ({e}): check "
        f"the network, {OFFLINE_HINT}."
    ) from None


def _netrc_login(host):
  """True when the netrc file (`wandb login` writes it) has a password for `host`."""
  path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
  try:
    entry = netrc.netrc(path).authenticators(host)
  except (OSError, netrc.NetrcParseError):
    return False
  return bool(entry and entry[2])


class Writer:
  """One W&B run: `write` a metrics row, `finish` with the run's summary.json."""

  def __init__(self, run):
    self.run = run

  def write(self, step, row):
    scalars = {
        k: v for k, v in row.items() if k != "step" and summary_lib.numeric(v)
    }
    if scalars:
      self.run.log({"step": int(step), **scalars})

  def finish(self, summary):
    """The summary's status and final/best values into the W&B run's summary; ends the run."""
    best = {f"best/{k}": b["value"] for k, b in summary.get("best", {}).items()}
    speed = {k: summary.get(k) for k in ("img_per_sec", "hours", "core_hours")}
    speed |= {f"median/{k}": v for k, v in (summary.get("mfu") or {}).items()}
    self.run.summary.update(
        {
            "status": summary["status"],
            "step": summary.get("step"),
            **summary.get("final", {}),
            **best,
            **{k: v for k, v in speed.items() if v is not None},
        }
    )
    exit_code = 1  # failed, stopped by a signal
    if summary["status"] in ("finished", "preempted"):
      exit_code = 0
    self.run.finish(exit_code=exit_code)


def start(cfg, workdir, raw_config):
  """The Writer of config.wandb (checked), or None: not configured, or not process 0."""
  cfg = configured(cfg)
  if cfg is None or jax.process_index() != 0:
    return None
  import wandb  # pylint: disable=g-import-not-at-top

  workdir = paths.resolve(workdir)
  id_path = workdir / ID_FILE
  run_id = (
      id_path.read_text().strip() if id_path.exists() else secrets.token_hex(6)
  )
  id_path.write_text(run_id + "\n")
  # wandb writes its files locally: into the workdir, unless that is a bucket.
  local_dir = None if paths.is_uri(workdir) else str(workdir)
  run = wandb.init(
      id=run_id,
      resume="allow",
      dir=local_dir,
      config=raw_config.to_dict(),
      settings=wandb.Settings(console="off", silent=True),
      **cfg,
  )
  run.define_metric("*", step_metric="step")
  where = (
      f"offline; upload with: wandb sync {os.path.dirname(run.dir)}"
      if run.offline
      else run.url
  )
  logging.info(
      "Weights & Biases: run %s (%s); its id is kept in %s",
      run.id,
      where,
      id_path,
  )
  return Writer(run)
