"""The trainer's console log: a quiet start, the run's header, and progress lines on time.

What a person watching a run reads (metrics.jsonl and TensorBoard hold the numbers):
the header (config, devices, mesh, parameter count, per-device memory, workdir), one
line per progress point, one per eval, one per checkpoint saved, the summary, and
errors once. Other libraries' INFO lines (tfds, jax, orbax) and TensorFlow's C++
start-up banner are left out; their warnings and errors are kept. `--verbosity=1`
shows everything, the parameter table included (always written to WORKDIR/params.txt).
"""

import logging as py_logging
import os
import sys
import time

from absl import logging
import jax
import numpy as np

PARAMS_FILE = "params.txt"
# A progress line at least this often, between the logged steps
# (log_training_steps).
PRINT_EVERY_S = 30.0


def _shown(record):
  """Whether the absl handler shows `record`: ours, any warning, or anything when verbose."""
  ours = f"{os.sep}big_vit_lite{os.sep}" in record.pathname
  return (
      ours
      or record.levelno >= py_logging.WARNING
      or logging.get_verbosity() > logging.INFO
  )


def keep_log_readable():
  """Filters the absl handler (call it in main): other libraries' INFO lines only when verbose."""
  logging.get_absl_handler().addFilter(_shown)


def config_argument(argv=None):
  """The --config value this process was started with (for the header), or None."""
  for arg in (sys.argv if argv is None else argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
  return None


def header(*, workdir, mesh, num_params, params_bytes, opt_bytes, table):
  """Logs the run's header and writes the parameter table to WORKDIR/params.txt (once)."""
  device = jax.devices()[0]
  # Once per workdir: a resumed run has the same params, and a rerun with
  # another model (that will fail on the checkpoint) must not replace the table
  # of the run that made the workdir.
  if jax.process_index() == 0 and not (workdir / PARAMS_FILE).exists():
    (workdir / PARAMS_FILE).write_text(table + "\n")
  lines = [
      f"==== big_vit_lite.train: {config_argument() or 'config given in Python'} ====",
      f"  workdir: {workdir}",
      f"  devices: {jax.device_count()} x {device.device_kind}, "
      f"{jax.process_count()} process(es); mesh {dict(mesh.shape)}",
      f"  params: {num_params:,} (the table: {workdir / PARAMS_FILE})",
      f"  per-device bytes: params {params_bytes:,}, optimizer state {opt_bytes:,}",
  ]
  logging.info("%s", "\n".join(lines))
  logging.debug("Parameters:\n%s", table)


class Progress:
  """The training loss averaged over the interval, and when a progress line is due.

  `add` keeps each step's loss on the device (no sync); a printed line reads them all at once.
  `line_mean` averages the steps since the last line printed, `logged_mean` those since the
  last logged step (metrics.jsonl's `training_loss_avg`). `due` says a line is due between the
  logged steps: PRINT_EVERY_S after the last line, counted from the first step (after the
  compile), so the first comes within a minute whatever log_training_steps is.
  """

  def __init__(self, every_s=PRINT_EVERY_S):
    self.every_s = every_s
    self._losses = []  # Device scalars since the last line printed.
    self._sum, self._count = 0.0, 0  # Since the last logged step.
    self._last_print = None

  def add(self, loss):
    self._losses.append(loss)
    if self._last_print is None:
      self._last_print = time.monotonic()

  def due(self):
    return (
        self._last_print is not None
        and time.monotonic() - self._last_print >= self.every_s
    )

  def line_mean(self):
    values = np.asarray(jax.device_get(self._losses), np.float64)
    self._losses = []
    self._sum += float(values.sum())
    self._count += values.size
    self._last_print = time.monotonic()
    return float(values.mean()) if values.size else None

  def logged_mean(self):
    self.line_mean()
    mean = self._sum / self._count if self._count else None
    self._sum, self._count = 0.0, 0
    return mean
