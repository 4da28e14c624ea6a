"""Checkpoints: orbax CheckpointManager with atomic async saves, resume and preemption.

Layout: `WORKDIR/checkpoints/<step>/` with four items:
  state/   params, optimizer state, step and rng, and `ema` (the weights' EMA)
           when config.ema_decay is set (a pytree of arrays, saved sharded;
           restorable onto any device count or mesh),
  data/    the training iterator's position (`TrainIterator.get_state()`),
  config/  the run's config as JSON (so `load_params` can rebuild the model),
  checksums/  a checksum of each array of state/, computed on device before
           the save and checked after a restore: orbax's files have none, so
           flipped bits in them would otherwise resume silently.
Orbax writes each step into a temporary directory and renames it when every
item is complete, so a kill during a save leaves the previous step usable and
an incomplete one invisible.

Reading params back (`load_params`, `resolve_step_dir`, checksums) is in
`big_vit_lite.models.steps`, re-exported here. Workdirs may be local or on a
bucket (gs://...): paths are etils.epath paths, which orbax takes as they are.
"""

import contextlib
import errno
import json
import signal
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from big_vit_lite.runtime import paths
from big_vit_lite.models import steps
from big_vit_lite.models.steps import (  # noqa: F401  (the names callers use)
    CKPT_SUBDIR,
    checksums,
    complete_steps,
    error_reason,
    load_npz,
    load_params,
    resolve_step_dir,
    unusable_path_reason,
)


class SaveError(RuntimeError):
  """A checkpoint save that did not complete (e.g. the disk is full: its message says so)."""


class Checkpointer:
  """Saves and restores the train state + iterator position under WORKDIR/checkpoints.

  Every process must call `save` and `restore` for the same steps (orbax
  synchronises the processes inside these calls).
  """

  def __init__(self, workdir, *, keep=3, keep_every=None, async_save=True):
    self.directory = paths.resolve(workdir) / CKPT_SUBDIR
    paths.check_checkpoint_client(self.directory)
    options = ocp.CheckpointManagerOptions(
        # The last `keep` checkpoints, plus every step divisible by keep_every.
        max_to_keep=keep,
        keep_period=keep_every,
        enable_async_checkpointing=async_save,
        # (Leftovers of a save interrupted by a kill.)
        cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_names=("state", "data", "config", "checksums"),
    )
    self._closed = False
    self._in_flight = None  # The step of the last save started.
    self._reported = None  # The last step logged as saved.
    # (Writes too: a failed save abandons the others.)
    steps.drop_abandoned_read_reports()

  def all_steps(self):
    return list(self.manager.all_steps())

  def step_dir(self, step):
    return self.directory / str(int(step))

  def state_mismatch(self, step, abstract_state):
    """None if the arrays saved at `step` fit `abstract_state`, else the first difference.

    Compares array names and shapes from the checkpoint's metadata (nothing
    is read): restoring a checkpoint of another model or optimizer would
    otherwise fail deep inside orbax with a message about its internals.
    dtypes may differ (orbax casts on restore, e.g. a changed mu_dtype).
    """
    saved = {
        p: tuple(m.shape)
        for p, m in steps.flatten_metadata(
            steps.state_tree(self.step_dir(step))
        )
    }
    wanted = {
        "/".join(steps.key_name(k) for k in path): tuple(x.shape)
        for path, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    }
    # Params first: a changed model shows as a param, not as its optimizer
    # moments.
    for path in sorted(
        set(saved) | set(wanted), key=lambda p: (not p.startswith("params/"), p)
    ):
      if path not in saved:
        return f"'{path}' is not in the checkpoint"
      if path not in wanted:
        return f"the checkpoint has '{path}', which this config does not make"
      if saved[path] != wanted[path]:
        return f"'{path}' has shape {saved[path]} in the checkpoint, {wanted[path]} in this config"
    return None

  def save(self, step, state, data_state, config=None):
    """Starts an (async) save of `state` (pytree), `data_state` (JSON dict) and `config`."""
    config_json = {}
    if config:
      config_json = json.loads(config.to_json_best_effort())
    items = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state or {}),
        config=ocp.args.JsonSave(config_json),
        checksums=ocp.args.JsonSave(checksums(state)),
    )
    # A failed earlier (async) save is reported as that step, before this one
    # starts.
    self.wait()
    self._in_flight = int(step)
    try:
      # force=True: the caller decides when to save (ckpt_steps, end,
      # preemption).
      self.manager.save(int(step), args=items, force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(e) from e

  def restore(self, step, abstract_state):
    """Restores onto the shardings of `abstract_state` (ShapeDtypeStructs with .sharding).

    The shardings may differ from those the checkpoint was written with:
    orbax reads each device's slice, so a checkpoint from 8 FSDP devices
    restores onto 1 device and back.
    """
    out = self.manager.restore(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
        ),
    )
    steps.verify_checksums(self.step_dir(step), out["state"])
    return out["state"], out["data"]

  def wait(self):
    """Waits for the save in flight; a SaveError if it failed. Logs the step saved, once."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(e) from e
    if self._in_flight is not None and self._in_flight != self._reported:
      self._reported = self._in_flight
      logging.info(
          "Saved checkpoint step %d: %s",
          self._in_flight,
          self.step_dir(self._in_flight),
      )

  def _save_error(self, error):
    # What orbax's other writes report from now on is this failure again.
    steps.mark_save_failed()
    # (When the disk is full, tensorstore's reason names orbax's temporary
    # files, twice.)
    reason = (
        "No space left on device" if disk_full(error) else error_reason(error)
    )
    return SaveError(
        f"Saving checkpoint step {self._in_flight} to {self.directory} failed "
        f"({reason})"
    )

  def close(self):
    """Waits for a save in flight (it commits), then releases orbax's threads. Idempotent.

    A SaveError if that save failed.
    """
    if self._closed:
      return
    self._closed = True
    try:
      self.wait()
    finally:
      # A failed save again: orbax's close waits too.
      with contextlib.suppress(Exception):
        self.manager.close()


def disk_full(error):
  """Whether `error` (Python's, orbax's, TensorFlow's writing TensorBoard events) is ENOSPC."""
  text = f"{error} {error_reason(error)}"
  return (
      getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
      or "No space left on device" in text
      or "Disk quota exceeded" in text
  )


# --------------------------------------------------------------------------
# Preemption: SIGTERM -> save at the next step boundary and exit 0.
# Ctrl-C (SIGINT) -> the same save, then the trainer exits 130; a second
# Ctrl-C stops at once (Python's default KeyboardInterrupt).


class PreemptionWatcher:
  """Notices SIGTERM (how schedulers and TPU VMs announce preemption) and Ctrl-C.

  The handler only sets a flag; the training loop checks `reached(step)` after
  each step, saves and exits cleanly. With several processes jax's
  preemption sync manager picks one step on which all processes agree (the
  coordination service relays the signal), so all of them save that step;
  there Ctrl-C keeps its default (one process alone cannot stop in step).
  `interrupted` says whether it was Ctrl-C. `close()` puts the previous
  handlers back.
  """

  def __init__(self):
    self._flag = threading.Event()
    self.interrupted = False
    self._multi = jax.process_count() > 1
    self._previous = {}
    if (
        not self._multi
        and threading.current_thread() is threading.main_thread()
    ):
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, unused_frame):
    if signum == signal.SIGINT:
      self.interrupted = True
      # A second Ctrl-C (e.g. while the save runs) stops at once.
      signal.signal(
          signal.SIGINT,
          self._previous.get(signal.SIGINT, signal.default_int_handler),
      )
      logging.warning(
          "Ctrl-C: saving a checkpoint at the next step, then stopping "
          "(press Ctrl-C again to stop without saving)."
      )
    else:
      logging.warning("SIGTERM received: saving a checkpoint at the next step.")
    self._flag.set()

  def reached(self, step):
    if not self._multi:
      return self._flag.is_set()
    try:
      return multihost_utils.reached_preemption_sync_point(int(step))
    # Preemption service not running (e.g. no coordinator).
    except RuntimeError:
      return False

  def close(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
