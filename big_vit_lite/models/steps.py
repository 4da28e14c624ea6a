"""Reading our orbax training checkpoints: params, saved config, checksums.

A step directory `WORKDIR/checkpoints/<step>/` (see `big_vit_lite.trainer.checkpoint`,
which writes them) holds `state/` (params, optimizer state, `ema`),
`config/` (the run's config as JSON) and `checksums/`. Everything here reads
them, on local disk or a bucket, without a mesh or an orbax manager.
"""

import fnmatch
import json
import logging as py_logging
import os
import re
import sys
from typing import Optional

from flax import traverse_util
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from big_vit_lite.runtime import paths
from big_vit_lite.models import npz

CKPT_SUBDIR = "checkpoints"


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
    return (
        "'[...]' (orbax globs the path, so it cannot find its own files there)"
    )
  return None


def checksums(state):
  """{array path: [dtype, checksum]} for the arrays of `state` (computed where they live).

  The checksum is the sum over an array's 8-, 16- or 32-bit words of word x
  (2 x position + 1), mod 2^32: a change to any one word changes it. Exact
  whatever the sharding, so a checkpoint restored onto another mesh checks too.
  """
  leaves = [(name, jnp.asarray(x)) for name, x in flatten_metadata(state)]
  values = _checksums([x for _, x in leaves])
  return {
      name: [str(x.dtype), int(v.addressable_data(0))]
      for (name, x), v in zip(leaves, values)
  }


@jax.jit
def _checksums(arrays):
  def one(x):
    # (bool has no bitcast)
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    # 8 bytes: 2 words
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    weights = jax.lax.iota(jnp.uint32, words.size).reshape(words.shape) * 2 + 1
    return jnp.sum(words * weights, dtype=jnp.uint32)

  return [one(x) for x in arrays]


def verify_checksums(step_dir, state):
  """A ValueError naming the first array of `state` whose checksum differs from the saved one."""
  try:  # (Checkpoints written before checksums were saved have none.)
    saved = json.loads((step_dir / "checksums" / "metadata").read_text())
  except (OSError, ValueError):
    saved = {}
  for path, (dtype, value) in checksums(state).items():
    # A restore cast to another dtype (e.g. a changed mu_dtype) has other bits.
    if path in saved and saved[path][0] == dtype and saved[path][1] != value:
      raise ValueError(f"'{path}' does not match the checksum saved with it")


def state_tree(step_dir):
  """The array metadata tree of `step_dir`/state; a one-line ValueError saying why not."""
  drop_abandoned_read_reports()
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
  if (
      "See full TensorStore details" in str(error)
      and error.__cause__ is not None
  ):
    # orbax's wrapper: the reason is tensorstore's.
    return error_reason(error.__cause__)
  line = (str(error).strip().splitlines() or [""])[0]
  # TensorFlow's op name.
  line = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", line)
  return re.sub(r"\s*\[tensorstore_spec=.*", "", line) or type(error).__name__


def drop_abandoned_read_reports():
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

    # (tensorstore calling a closed asyncio loop's call_soon_threadsafe)
    def hook(unraisable):
      error = unraisable.exc_value
      if not (
          type(error) is RuntimeError  # pylint: disable=unidiomatic-typecheck
          and str(error) == "Event loop is closed"
          and unraisable.object is None
      ):
        previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook
  # (idempotent)
  py_logging.getLogger("asyncio").addFilter(_keep_unless_abandoned_read)


_save_failed = False  # Set once a SaveError has been raised in this process.


def mark_save_failed():
  """From now on asyncio's reports of unawaited orbax errors repeat that failure: drop them."""
  global _save_failed
  _save_failed = True


def _keep_unless_abandoned_read(record):
  """A logging filter: False for asyncio's report of an orbax error nobody awaited.

  That is a tensorstore read's, or after a failed save any (its other writes).
  """
  error = record.exc_info[1] if record.exc_info else None
  return not (
      re.match(r"(Task|Future) exception was never retrieved", str(record.msg))
      and (_save_failed or "tensorstore_spec" in str(error))
  )


def flatten_metadata(tree):
  """(path "a/b/0", leaf) pairs of a tree, e.g. orbax's metadata tree (dicts, lists, None)."""
  # (None: no arrays)
  return [
      (jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def key_name(key):
  """A jax tree path entry as orbax names it (dict key, list index, namedtuple field)."""
  return jax.tree_util.keystr((key,), simple=True)


def complete_steps(workdir):
  """The committed checkpoint steps in `workdir` (a listing: no orbax manager, nothing written)."""
  directory = paths.resolve(workdir) / CKPT_SUBDIR
  try:
    if not directory.is_dir():
      return []
    return sorted(ocp.utils.checkpoint_steps(directory))
  except (OSError, ValueError):
    return []


def resolve_step_dir(src):
  """A workdir, checkpoints dir or step dir -> the step directory to read (an epath.Path)."""
  src = paths.resolve(src)
  if (src / "state").is_dir():
    return src
  # (checkpoint_steps: complete, committed steps only)
  for ckpt_dir in (src / CKPT_SUBDIR, src):
    if not ckpt_dir.is_dir():
      continue
    steps = ocp.utils.checkpoint_steps(ckpt_dir)
    if steps:
      return ckpt_dir / str(max(steps))
  raise ValueError(
      f"No complete checkpoint found in {src}: pass a training workdir, a checkpoint "
      "step directory (.../checkpoints/<step>) or an .npz file."
  )


def load_params(src, key="params"):
  """Returns (params as a nested dict of np.ndarray, config ConfigDict or None).

  src: a training workdir (its newest complete checkpoint), an orbax step
  directory, or an `.npz` file (flat "a/b/c" keys; config None).
  key: "params", or "ema" for the EMA of the weights (config.ema_decay runs).
  """
  src = paths.resolve(src)
  if src.name.endswith(".npz"):
    if not src.is_file():
      raise ValueError(f"No such .npz file: {src}")
    return load_npz(src), None
  if not src.exists():
    raise ValueError(f"model_init path does not exist: {src}")
  step_dir = resolve_step_dir(src)
  try:
    tree = state_tree(step_dir)
  except ValueError as e:
    raise ValueError(_cannot_read(step_dir, e)) from e
  if key not in tree:
    raise ValueError(
        f"Checkpoint {step_dir} holds no '{key}' (config.ema_decay saves 'ema')."
    )
  # Restore only the params, as host numpy arrays (no device/mesh needed).
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree[key]
  )
  try:
    out = ocp.PyTreeCheckpointer().restore(
        step_dir / "state",
        args=ocp.args.PyTreeRestore(
            item={key: tree[key]},
            restore_args={key: restore_args},
            partial_restore=True,
        ),
    )
    verify_checksums(step_dir, {key: out[key]})
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(_cannot_read(step_dir, e)) from e
  config_path = step_dir / "config" / "metadata"
  config = None  # a file written by another tool has none
  if config_path.is_file():
    config = json.loads(config_path.read_text())
  if not config:
    return out[key], None
  return out[key], ml_collections.ConfigDict(config)


def _cannot_read(step_dir, error):
  """One line for a step directory whose arrays cannot be read (damaged after the save)."""
  older = [
      s
      for s in ocp.utils.checkpoint_steps(step_dir.parent)
      if step_dir.name.isdigit() and s < int(step_dir.name)
  ]
  other = "another checkpoint"
  if older:
    other = f"an older step ({step_dir.parent / str(max(older))})"
  return (
      f"Cannot read checkpoint {step_dir} ({error_reason(error)}); if it is damaged, "
      f"pass {other}."
  )


def load_npz(path):
  """Reads an .npz with flat 'a/b/c' keys into a nested dict of np.ndarray."""
  return traverse_util.unflatten_dict(npz.read_npz(path), sep="/")


def trained_hw(config, flat) -> Optional[tuple[int, int]]:
  """(h, w) a training run's pp gives its images (config: the run's saved config), or None."""
  pp = ""
  if config is not None and "input" in config:
    pp = str(config.input.get("pp", ""))
  if not pp.strip() or "embedding/kernel" not in flat:
    return None
  from big_vit_lite.data import pp as pp_lib  # pylint: disable=g-import-not-at-top
  # The image goes into the stem, if any.
  channels = flat.get("stem/conv_0/kernel", flat["embedding/kernel"]).shape[2]
  try:
    return pp_lib.output_hw(pp, channels=int(channels))
  # a pp this version cannot build: the posemb's shape must do
  except ValueError:
    return None
