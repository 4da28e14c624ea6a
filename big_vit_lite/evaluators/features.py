"""Sharded forward passes over eval data, with results gathered to the host.

Shared by the evaluators: each host-local batch is placed on the mesh with
`data.device.put_batch` (a global array sharded on the batch axes), a jitted
function of (params, batch) runs on it, and its (small) outputs come back to
every process as numpy via `process_allgather`. Padding rows carry
`_mask == False` and are dropped by the callers.

Also here: reading a representation (a named intermediate of the model) out
of `predict_fn`'s output, and re-batching a chosen subset of a split so that
few-shot evaluation forwards only the examples it samples.
"""
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from big_vit_lite import sharding
from big_vit_lite.data import device as data_device
from big_vit_lite.data import pp as pp_lib
from big_vit_lite.data import sources


def to_host(tree):
  """Global (possibly multi-process) jax arrays -> full numpy arrays on every process."""
  return multihost_utils.process_allgather(tree, tiled=True)


def check_batch_size(batch_size):
  """The eval batch size as an int: positive and split evenly over the processes."""
  try:
    n = int(batch_size)
  except (TypeError, ValueError):
    n = 0
  if n < 1 or n != batch_size or n % jax.process_count():
    raise ValueError(f"batch_size={batch_size!r} must be a positive integer divisible by the "
                     f"process count {jax.process_count()}.")
  return n


def available_host_bytes():
  """MemAvailable of /proc/meminfo in bytes; None where there is no such file."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _size(num_bytes):
  return (f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**29 else
          f"{num_bytes / 2**20:.2f} MiB")


def check_data(data_cfg, pp):
  """Opens the split and builds the pp now, reading no example.

  Called when an evaluator is built: a misspelt dataset, split or pp op
  then stops a trainer before it trains, not at its first eval hours later.
  """
  if sources.get_source(data_cfg).num_examples == 0:
    raise ValueError(f"eval data {sources.check_data_cfg(data_cfg)} has no examples")
  pp_lib.get_preprocess_fn(pp)


def require_keys(batch, keys):
  """A one-line error when the eval pp dropped a key the evaluator needs (e.g. "label")."""
  missing = [k for k in keys if k not in batch]
  if missing:
    raise ValueError(
        f"The eval batches lack {', '.join(map(repr, missing))}: the pp gives "
        f"{sorted(k for k in batch if not k.startswith('_'))}. Keep the integer label "
        "(end the pp with keep('image', 'label'); no onehot) for this evaluator.")


def _pad_for_mesh(local, mesh):
  """Pads a host-local batch with masked-out zero rows so the mesh's batch axes divide it.

  Any eval batch_size then works on any device count (e.g. 256 on 6 GPUs);
  the callers drop rows with `_mask == False`.
  """
  n = len(local["_mask"])
  devices, procs = sharding.batch_devices(mesh), jax.process_count()
  multiple = devices // math.gcd(devices, procs)  # local rows x procs must split evenly
  pad = (-n) % multiple
  if not pad:
    return local
  return {k: np.concatenate([np.asarray(v), np.zeros((pad, *np.shape(v)[1:]), np.asarray(v).dtype)])
          for k, v in local.items()}


def map_batches(fn, params, local_batches, mesh, keys=None):
  """Yields to_host(fn(params, global_batch)) for each host-local batch.

  The next batch is dispatched before the previous result is fetched, so the
  host copy overlaps the device work.
  """
  pending = None
  for local in local_batches:
    if keys is not None:
      require_keys(local, keys)
      local = {k: local[k] for k in keys}
    batch = data_device.put_batch(_pad_for_mesh(local, mesh), mesh)
    out = fn(params, batch)
    if pending is not None:
      yield to_host(pending)
    pending = out
  if pending is not None:
    yield to_host(pending)


_HIGH, _LOW = "/int64_high", "/int64_low"


def _split_int64(batch):
  """int64 arrays -> int32 high and uint32 low halves (jax runs without int64).

  Class ids and example ids go through the device and come back: a plain
  cast would wrap an id of 2**31 or more onto another one without a sign.
  """
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    if v.dtype == np.int64 and k != "image":
      out[k + _HIGH] = (v >> 32).astype(np.int32)
      out[k + _LOW] = (v & 0xFFFFFFFF).astype(np.uint32)
    else:
      out[k] = v
  return out


def _join_int64(arrays):
  """The inverse of `_split_int64` on host arrays."""
  out = {}
  for k, v in arrays.items():
    if k.endswith(_HIGH):
      key = k[:-len(_HIGH)]
      out[key] = (np.asarray(v).astype(np.int64) << 32) | np.asarray(
          arrays[key + _LOW]).astype(np.int64)
    elif not k.endswith(_LOW):
      out[k] = v
  return out


TOKEN_POOLS = ("mean", "flatten")


def representation(logits, out, layer, token_pool="mean"):
  """The features named `layer` ("logits" or a key of the model's `out`) as (B, D).

  Token-shaped intermediates (B, T, D) such as "encoded" or "block03" are
  reduced by `token_pool`: "mean" averages the tokens (global average
  pooling); "flatten" concatenates them (B, T*D), which keeps where in the
  image each feature is, what small images like digits need (averaging the
  16 tokens of a 28x28 image throws the layout away).
  """
  if token_pool not in TOKEN_POOLS:
    raise ValueError(f"token_pool={token_pool!r} is not one of {TOKEN_POOLS}.")
  if layer == "logits":
    rep = logits
  elif layer in out:
    rep = out[layer]
  else:
    raise ValueError(f"representation_layer={layer!r} is not an output of the model; "
                     f"choose one of {sorted(['logits', *out])}.")
  if rep.ndim > 2:
    if token_pool == "mean":
      rep = rep.mean(axis=tuple(range(1, rep.ndim - 1)))
    else:
      rep = rep.reshape(rep.shape[0], -1)
  return rep.astype(jnp.float32)


class FeatureExtractor:
  """Computes `representation(...)` for every valid example of some batches.

  Batches must hold "image", "_mask" and the label key; extra integer keys
  (e.g. "_id") are passed through so callers can tell examples apart.
  """

  def __init__(self, predict_fn, mesh, layer="pre_logits", token_pool="mean"):
    if token_pool not in TOKEN_POOLS:
      raise ValueError(f"token_pool={token_pool!r} is not one of {TOKEN_POOLS}.")
    self.mesh = mesh
    self.layer = layer

    def features(params, batch):
      logits, out = predict_fn(params, batch["image"])
      rest = {k: v for k, v in batch.items() if k != "image"}
      return {"feature": representation(logits, out, layer, token_pool), **rest}

    self._fn = jax.jit(features)
    self._token_pool = token_pool

  def _check_memory(self, features, local_batches):
    """Stops at the first batch if a whole split's features cannot fit in host memory.

    E.g. token_pool="flatten" on a 224 px B/16 is 151k numbers per example:
    60 GB for 100k examples, and a swapping or killed process otherwise.
    """
    num_batches, free = getattr(local_batches, "num_batches", None), available_host_bytes()
    if num_batches is None or free is None:
      return
    rows = num_batches * features.shape[0]
    need = 2 * rows * features[0].nbytes  # The batches, then their concatenation.
    if need > free:
      raise ValueError(
          f"The {self.layer!r} features (token_pool={self._token_pool!r}: "
          f"{features.shape[1]} numbers per example) of {rows} examples need {_size(need)} "
          f"of host memory and {_size(free)} is free; use "
          "token_pool='mean', another representation_layer or a smaller split (e.g. "
          "train[:10%]).")

  def __call__(self, params, local_batches, keys):
    """Returns a dict of numpy arrays ("feature" + keys) over the valid rows."""
    keys = tuple(dict.fromkeys(("image", "_mask", *keys)))

    def selected():
      for local in local_batches:
        require_keys(local, keys)
        yield _split_int64({k: local[k] for k in keys})

    chunks = []
    for chunk in map_batches(self._fn, params, selected(), self.mesh):
      if not chunks:
        self._check_memory(chunk["feature"], local_batches)
      chunks.append(chunk)
    if not chunks:
      raise ValueError("The eval data yielded no batches; check its split name and size.")
    cat = _join_int64({k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]})
    valid = cat.pop("_mask").astype(bool)
    out = {k: v[valid] for k, v in cat.items()}
    bad = int(np.sum(~np.isfinite(out["feature"]).all(axis=1)))
    if bad:
      # Ridge's SVD would fail on them and L-BFGS would silently fit chance.
      raise ValueError(f"The model's {self.layer!r} features are NaN/inf for {bad} of "
                       f"{len(out['feature'])} examples: the checkpoint holds non-finite "
                       "params or overflows (e.g. in bfloat16); evaluate a finite checkpoint.")
    return out


def gather_local(array):
  """Stacks the same-shaped host-local numpy arrays of all processes: (P, ...)."""
  array = np.asarray(array)
  if jax.process_count() == 1:
    return array[None]
  return _join_int64({k: np.asarray(v) for k, v in multihost_utils.process_allgather(
      _split_int64({"x": array}), tiled=False).items()})["x"]


def select_batches(local_batches, wanted, local_batch_size, num_batches, keys):
  """Re-batches the wanted rows of a host-local stream.

  Args:
    local_batches: iterable of host-local batches (with "_mask").
    wanted: dict mapping a row's local position (counting padding rows too)
      to the integer id to tag it with; only these rows are kept.
    local_batch_size: rows per emitted batch.
    num_batches: how many batches to emit (the same on every process, so
      the collective steps of all processes stay matched).
    keys: which keys to keep besides "_mask".

  Yields `num_batches` batches of exactly `local_batch_size` rows, with an
  extra int64 "_id"; unfilled rows are zeros with `_mask` False.
  """
  rows, ids = [], []
  emitted, position, template = 0, 0, None

  def make(chunk_rows, chunk_ids):
    batch = {k: np.zeros((local_batch_size, *template[k].shape), template[k].dtype)
             for k in keys}
    for j, row in enumerate(chunk_rows):
      for k in keys:
        batch[k][j] = row[k]
    n = len(chunk_ids)
    batch["_mask"] = np.arange(local_batch_size) < n
    batch["_id"] = np.zeros((local_batch_size,), np.int64)
    batch["_id"][:n] = chunk_ids
    return batch

  for local in local_batches:
    if template is None:  # Shapes and dtypes of one row, for the zero rows.
      require_keys(local, keys)
      template = {k: np.asarray(local[k][0]) for k in keys}
    mask = np.asarray(local["_mask"]).astype(bool)
    for i in np.flatnonzero(mask):
      gid = wanted.get(position + int(i))
      if gid is not None:
        rows.append({k: local[k][i] for k in keys})
        ids.append(gid)
    position += mask.shape[0]
    while len(ids) >= local_batch_size:
      yield make(rows[:local_batch_size], ids[:local_batch_size])
      del rows[:local_batch_size], ids[:local_batch_size]
      emitted += 1
  if template is None:
    raise ValueError("The eval data yielded no batches; check its split name and size.")
  if emitted + (1 if ids else 0) > num_batches:
    raise RuntimeError(f"select_batches: {emitted} full batches + {len(ids)} rows exceed the "
                       f"{num_batches} planned batches.")
  while emitted < num_batches:
    yield make(rows, ids)
    rows, ids = [], []
    emitted += 1
