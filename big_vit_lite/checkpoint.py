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

`load_params(src)` reads params from a training workdir (its newest complete
checkpoint), an orbax step directory or an `.npz` file as nested numpy dicts.
Workdirs and sources may be local or on a bucket (gs://...): paths are
etils.epath paths, which orbax takes as they are.
"""
import errno
import fnmatch
import json
import logging as py_logging
import os
import re
import signal
import sys
import threading
import traceback

from absl import logging
from flax import traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from big_vit_lite import paths
from big_vit_lite.models import interop

CKPT_SUBDIR = "checkpoints"


class SaveError(RuntimeError):
  """A checkpoint save that did not complete (e.g. the disk is full); one line, `step` failed."""

  def __init__(self, message, step, disk_full):
    super().__init__(message)
    self.step = step
    self.disk_full = disk_full


def unusable_path_reason(path):
  """Why orbax cannot keep checkpoints under `path`, or None.

  tensorstore reads a backslash in a local path as a separator, and orbax
  finds the files it has just written with a glob of the full path, which a
  `[...]` in a directory name turns into a character class: such a run would
  train to the end and leave checkpoints nobody can read.
  """
  text = os.fspath(path)
  if "\\" in text:
    return "a backslash (tensorstore reads it as '/')"
  if not fnmatch.fnmatchcase(text, text):
    return "'[...]' (orbax globs the path, so it cannot find its own files there)"
  return None


class Checkpointer:
  """Saves and restores the train state + iterator position under WORKDIR/checkpoints.

  Every process must call `save` and `restore` for the same steps (orbax
  synchronises the processes inside these calls).
  """

  def __init__(self, workdir, *, keep=3, keep_every=None, async_save=True):
    self.directory = paths.resolve(workdir) / CKPT_SUBDIR
    reason = unusable_path_reason(self.directory)
    if reason:
      raise ValueError(f"Checkpoints cannot be saved under {self.directory}: its path has "
                       f"{reason}. Use a --workdir without it.")
    if self.directory.exists() and not self.directory.is_dir():
      raise ValueError(f"{self.directory} is not a directory: move that file away, checkpoints "
                       "are saved there.")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,           # The last `keep` checkpoints ...
        keep_period=keep_every,     # ... plus every step divisible by keep_every.
        enable_async_checkpointing=async_save,
        create=True,
        cleanup_tmp_directories=True,  # Leftovers of a save interrupted by a kill.
    )
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data", "config", "checksums"))
    self._closed = False
    self._in_flight = None  # The step of the last save started.
    _drop_abandoned_read_reports()  # (Writes too: a failed save abandons the others.)

  def latest_step(self):
    return self.manager.latest_step()

  def all_steps(self):
    return list(self.manager.all_steps())

  def step_dir(self, step):
    return self.directory / str(int(step))

  def saved_config(self, step):
    """The config (a plain dict) the checkpoint at `step` was written with, or None."""
    path = self.step_dir(step) / "config" / "metadata"
    try:
      return json.loads(path.read_text()) or None
    except (OSError, ValueError):
      return None

  def state_mismatch(self, step, abstract_state):
    """None if the arrays saved at `step` fit `abstract_state`, else the first difference.

    Compares array names and shapes from the checkpoint's metadata (nothing
    is read): restoring a checkpoint of another model or optimizer would
    otherwise fail deep inside orbax with a message about its internals.
    dtypes may differ (orbax casts on restore, e.g. a changed mu_dtype).
    """
    saved = {p: tuple(m.shape) for p, m in _flatten_metadata(_state_tree(self.step_dir(step)))}
    wanted = {"/".join(_key_name(k) for k in path): tuple(x.shape)
              for path, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    # Params first: a changed model shows as a param, not as its optimizer moments.
    for path in sorted(set(saved) | set(wanted), key=lambda p: (not p.startswith("params/"), p)):
      if path not in saved:
        return f"'{path}' is not in the checkpoint"
      if path not in wanted:
        return f"the checkpoint has '{path}', which this config does not make"
      if saved[path] != wanted[path]:
        return f"'{path}' has shape {saved[path]} in the checkpoint, {wanted[path]} in this config"
    return None

  def save(self, step, state, data_state, config=None):
    """Starts an (async) save of `state` (pytree) and `data_state` (JSON dict)."""
    items = dict(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state if data_state is not None else {}),
        config=ocp.args.JsonSave(_config_to_json(config)),
        checksums=ocp.args.JsonSave(checksums(state)),
    )
    # A failed earlier (async) save is reported as that step, before this one starts.
    self.wait()
    self._in_flight = int(step)
    try:
      # force=True: the caller decides when to save (ckpt_steps, end, preemption).
      self.manager.save(int(step), args=ocp.args.Composite(**items), force=True)
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(e) from e

  def restore(self, step, abstract_state):
    """Restores onto the shardings of `abstract_state` (ShapeDtypeStructs with .sharding).

    The shardings may differ from those the checkpoint was written with:
    orbax reads each device's slice, so a checkpoint from 8 FSDP devices
    restores onto 1 device and back.
    """
    _drop_abandoned_read_reports()
    out = self.manager.restore(int(step), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
    ))
    _verify_checksums(self.step_dir(step), out["state"])
    return out["state"], out["data"]

  def wait(self):
    """Waits for the save in flight; a SaveError if it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(e) from e

  def _save_error(self, error):
    global _save_failed
    _save_failed = True  # What orbax's other writes report from now on is this failure again.
    reason = error_reason(error)
    disk_full = (getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
                 or "No space left on device" in reason or "Disk quota exceeded" in reason)
    if disk_full:  # (tensorstore's reason names orbax's temporary files, twice.)
      reason = "no space left on device"
    return SaveError(f"Saving checkpoint step {self._in_flight} to {self.directory} failed "
                     f"({reason})", self._in_flight, disk_full)

  def close(self):
    """Waits for a save in flight (it commits), then releases orbax's threads. Idempotent.

    A SaveError if that save failed.
    """
    if self._closed:
      return
    self._closed = True
    failed = None
    try:
      self.wait()
    except SaveError as e:
      failed = e
    try:
      self.manager.close()
    except Exception:  # pylint: disable=broad-except
      if failed is None:  # (Else it is that failure again: orbax's close waits too.)
        raise
    if failed is not None:
      raise failed


def checksums(state):
  """{array path: [dtype, checksum]} for the arrays of `state` (computed where they live).

  The checksum is the sum over an array's 8-, 16- or 32-bit words of word x
  (2 x position + 1), mod 2^32: a change to any one word changes it. Exact
  whatever the sharding, so a checkpoint restored onto another mesh checks too.
  """
  leaves = [(path, jnp.asarray(x)) for path, x in jax.tree_util.tree_flatten_with_path(state)[0]]
  values = _checksums([x for _, x in leaves])
  return {"/".join(_key_name(k) for k in path): [str(x.dtype), int(v.addressable_data(0))]
          for (path, x), v in zip(leaves, values)}


@jax.jit
def _checksums(arrays):
  def one(x):
    if x.dtype == jnp.bool_:
      words = x.astype(jnp.uint32)
    elif x.dtype.itemsize > 4:
      words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
      unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
      words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    weights = jax.lax.iota(jnp.uint32, words.size).reshape(words.shape) * 2 + 1
    return jnp.sum(words * weights, dtype=jnp.uint32)
  return [one(x) for x in arrays]


def _verify_checksums(step_dir, state):
  """A ValueError naming the first array of `state` whose checksum differs from the saved one."""
  try:  # (Checkpoints written before checksums were saved have none.)
    saved = json.loads((step_dir / "checksums" / "metadata").read_text())
  except (OSError, ValueError):
    saved = {}
  for path, (dtype, value) in checksums(state).items():
    # A restore cast to another dtype (e.g. a changed mu_dtype) has other bits.
    if path in saved and saved[path][0] == dtype and saved[path][1] != value:
      raise ValueError(f"'{path}' does not match the checksum saved with it")


def _state_tree(step_dir):
  """The array metadata tree of `step_dir`/state; a one-line ValueError saying why not."""
  _drop_abandoned_read_reports()
  # The handler, not a PyTreeCheckpointer: that one swallows the reason (and
  # warns about a step metadata file that state/ never has).
  handler = ocp.PyTreeCheckpointHandler()
  try:
    return handler.metadata(step_dir / "state").tree
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(error_reason(e)) from e
  finally:
    handler.close()


def error_reason(error):
  """The first line of `error`, without tensorstore's spec (a long JSON)."""
  if "See full TensorStore details" in str(error) and error.__cause__ is not None:
    return error_reason(error.__cause__)  # orbax's wrapper: the reason is tensorstore's.
  line = (str(error).strip().splitlines() or [""])[0]
  line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line)  # TensorFlow's op name.
  return re.sub(r"\s*\[tensorstore_spec=.*", "", line) or type(error).__name__


def _drop_abandoned_read_reports():
  """Silences the reports of the reads orbax abandons when one read fails.

  orbax starts the reads of all arrays at once; when one fails (a damaged
  checkpoint) it raises and closes its event loop at once. The other reads
  finish later on tensorstore's threads, and their callbacks find the loop
  closed: "RuntimeError: Event loop is closed" tracebacks through
  sys.unraisablehook, or asyncio's "Task (Future) exception was never
  retrieved", around the one-line error. Nothing waits for those reads and nothing can,
  so these two reports, and only they, are dropped from now on (they come
  at any time later). Writes are the same once a save has failed (a full
  disk): the SaveError says it. Idempotent.
  """
  if not getattr(sys.unraisablehook, "drops_abandoned_reads", False):
    previous = sys.unraisablehook

    def hook(unraisable):
      if not _is_closed_loop_callback(unraisable):
        previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook
  asyncio_logger = py_logging.getLogger("asyncio")
  if _keep_unless_abandoned_read not in asyncio_logger.filters:
    asyncio_logger.addFilter(_keep_unless_abandoned_read)


def _is_closed_loop_callback(unraisable):
  """Whether native code (tensorstore) called a closed asyncio loop's call_soon_threadsafe."""
  frames = traceback.extract_tb(unraisable.exc_traceback)
  return (type(unraisable.exc_value) is RuntimeError  # pylint: disable=unidiomatic-typecheck
          and str(unraisable.exc_value) == "Event loop is closed" and unraisable.object is None
          and bool(frames) and frames[0].name == "call_soon_threadsafe")


_save_failed = False  # Set once a SaveError has been raised in this process.


def _keep_unless_abandoned_read(record):
  """A logging filter: False for asyncio's report of an orbax error nobody awaited.

  That is a tensorstore read's, or after a failed save any (its other writes).
  """
  error = record.exc_info[1] if record.exc_info else None
  return not (re.match(r"(Task|Future) exception was never retrieved", str(record.msg))
              and (_save_failed or "tensorstore_spec" in str(error)))


def _flatten_metadata(tree, prefix=""):
  """(path "a/b/0", array metadata) pairs of orbax's metadata tree (dicts, lists, None)."""
  if isinstance(tree, dict):
    items = tree.items()
  elif isinstance(tree, (list, tuple)):
    items = enumerate(tree)
  else:
    if tree is not None:  # None: an empty optimizer state (no arrays).
      yield prefix[:-1], tree
    return
  for k, v in items:
    yield from _flatten_metadata(v, f"{prefix}{k}/")


def _key_name(key):
  """A jax tree path entry as orbax names it (dict key, list index, namedtuple field)."""
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _config_to_json(config):
  if config is None:
    return {}
  if isinstance(config, ml_collections.ConfigDict):
    return json.loads(config.to_json_best_effort())
  return json.loads(json.dumps(config, default=str))


# --------------------------------------------------------------------------
# Reading params from other runs / files.

def complete_steps(workdir):
  """The committed checkpoint steps in `workdir` (a listing: no orbax manager, nothing written)."""
  directory = paths.resolve(workdir) / CKPT_SUBDIR
  try:
    return sorted(ocp.utils.checkpoint_steps(directory)) if directory.is_dir() else []
  except (OSError, ValueError):
    return []


def resolve_step_dir(src):
  """A workdir, checkpoints dir or step dir -> the step directory to read (an epath.Path)."""
  src = paths.resolve(src)
  if (src / "state").is_dir():
    return src
  for ckpt_dir in (src / CKPT_SUBDIR, src):
    if ckpt_dir.is_dir():
      steps = ocp.utils.checkpoint_steps(ckpt_dir)  # Complete (committed) steps only.
      if steps:
        return ckpt_dir / str(max(steps))
  raise ValueError(
      f"No complete checkpoint found in {src}: pass a training workdir, a "
      "checkpoint step directory (.../checkpoints/<step>) or an .npz file.")


def load_params(src, key="params"):
  """Returns (params as a nested dict of np.ndarray, config ConfigDict or None).

  src: a training workdir (its newest complete checkpoint), an orbax step
  directory, or an `.npz` file (flat "a/b/c" keys; config None).
  key: "params", or "ema" for the EMA of the weights (config.ema_decay runs).
  """
  if not isinstance(src, (str, os.PathLike)):
    raise ValueError(f"load_params needs a path, got {type(src).__name__}.")
  src = paths.resolve(src)
  if src.name.endswith(".npz"):
    if key != "params":
      raise ValueError(f"{src} is an .npz, which holds one set of params (no '{key}'): pass a "
                       "training workdir or step directory.")
    if not src.is_file():
      raise ValueError(f"No such .npz file: {src}")
    return load_npz(src), None
  if not src.exists():
    raise ValueError(f"model_init path does not exist: {src}")
  if "\\" in os.fspath(src):
    raise ValueError(f"Cannot read checkpoints under {src}: {unusable_path_reason(src)}; "
                     "rename the directory.")
  step_dir = resolve_step_dir(src)
  try:
    tree = _state_tree(step_dir)
  except ValueError as e:
    raise ValueError(_cannot_read(step_dir, e)) from e
  if key not in tree:
    hint = " (its run set no config.ema_decay)" if key == "ema" else ""
    raise ValueError(f"Checkpoint {step_dir} holds no '{key}'{hint}.")
  # Restore only the params, as host numpy arrays (no device/mesh needed).
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree[key])
  try:
    out = ocp.PyTreeCheckpointer().restore(step_dir / "state", args=ocp.args.PyTreeRestore(
        item={key: tree[key]}, restore_args={key: restore_args},
        partial_restore=True))
    _verify_checksums(step_dir, {key: out[key]})
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(_cannot_read(step_dir, e)) from e
  config = None
  config_path = step_dir / "config" / "metadata"
  if config_path.is_file():
    cfg = json.loads(config_path.read_text())
    if cfg:
      config = ml_collections.ConfigDict(cfg)
  return out[key], config


def _cannot_read(step_dir, error):
  """One line for a step directory whose arrays cannot be read (damaged after the save)."""
  older = [s for s in ocp.utils.checkpoint_steps(step_dir.parent)
           if step_dir.name.isdigit() and s < int(step_dir.name)]
  other = f"an older step ({step_dir.parent / str(max(older))})" if older else "another checkpoint"
  return f"Cannot read checkpoint {step_dir} ({error_reason(error)}); if it is damaged, pass {other}."


def load_npz(path):
  """Reads an .npz with flat 'a/b/c' keys into a nested dict of np.ndarray."""
  return traverse_util.unflatten_dict(interop.read_npz(path), sep="/")


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
    if not self._multi and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT:
      self.interrupted = True
      # A second Ctrl-C (e.g. while the save runs) stops at once.
      signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))
      logging.warning("Ctrl-C: saving a checkpoint at the next step, then stopping "
                      "(press Ctrl-C again to stop without saving).")
    else:
      logging.warning("SIGTERM received: saving a checkpoint at the next step.")
    self._flag.set()

  def reached(self, step):
    if self._multi:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      try:
        return multihost_utils.reached_preemption_sync_point(int(step))
      except RuntimeError:  # Preemption service not running (e.g. no coordinator).
        return False
    return self._flag.is_set()

  def close(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
