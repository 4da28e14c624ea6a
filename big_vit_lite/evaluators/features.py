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
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from big_vit_lite.data import device as data_device


def to_host(tree):
  """Global (possibly multi-process) jax arrays -> full numpy arrays on every process."""
  return multihost_utils.process_allgather(tree, tiled=True)


def map_batches(fn, params, local_batches, mesh, keys=None):
  """Yields to_host(fn(params, global_batch)) for each host-local batch.

  The next batch is dispatched before the previous result is fetched, so the
  host copy overlaps the device work.
  """
  pending = None
  for local in local_batches:
    if keys is not None:
      local = {k: local[k] for k in keys}
    batch = data_device.put_batch(local, mesh)
    out = fn(params, batch)
    if pending is not None:
      yield to_host(pending)
    pending = out
  if pending is not None:
    yield to_host(pending)


def representation(logits, out, layer):
  """The features named `layer` ("logits" or a key of the model's `out`) as (B, D).

  Token-shaped intermediates (B, T, D) such as "encoded" or "block3" are
  averaged over their token axes (global average pooling).
  """
  if layer == "logits":
    rep = logits
  elif layer in out:
    rep = out[layer]
  else:
    raise ValueError(f"representation_layer={layer!r} is not an output of the model; "
                     f"choose one of {sorted(['logits', *out])}.")
  if rep.ndim > 2:
    rep = rep.mean(axis=tuple(range(1, rep.ndim - 1)))
  return rep.astype(jnp.float32)


class FeatureExtractor:
  """Computes `representation(...)` for every valid example of some batches.

  Batches must hold "image", "_mask" and the label key; extra integer keys
  (e.g. "_id") are passed through so callers can tell examples apart.
  """

  def __init__(self, predict_fn, mesh, layer="pre_logits"):
    self.mesh = mesh
    self.layer = layer

    def features(params, batch):
      logits, out = predict_fn(params, batch["image"])
      rest = {k: v for k, v in batch.items() if k != "image"}
      return {"feature": representation(logits, out, layer), **rest}

    self._fn = jax.jit(features)

  def __call__(self, params, local_batches, keys):
    """Returns a dict of numpy arrays ("feature" + keys) over the valid rows."""
    keys = tuple(dict.fromkeys(("image", "_mask", *keys)))
    chunks = list(map_batches(self._fn, params, local_batches, self.mesh, keys))
    if not chunks:
      raise ValueError("The eval data yielded no batches; check its split name and size.")
    cat = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
    valid = cat.pop("_mask").astype(bool)
    return {k: v[valid] for k, v in cat.items()}


def gather_local(array):
  """Stacks the same-shaped host-local numpy arrays of all processes: (P, ...)."""
  array = np.asarray(array)
  if jax.process_count() == 1:
    return array[None]
  return np.asarray(multihost_utils.process_allgather(array, tiled=False))


def select_batches(local_batches, wanted, local_batch_size, num_batches, keys):
  """Re-batches the wanted rows of a host-local stream.

  Args:
    local_batches: iterable of host-local batches (with "_mask").
    wanted: dict mapping a row's local position (counting padding rows too)
      to the integer id to tag it with; only these rows are kept.
    local_batch_size: rows per emitted batch.
    num_batches: how many batches to emit (the same on every process, so
      collective steps stay matched); padding batches have `_mask` False.
    keys: which keys to keep besides "_mask".

  Yields batches of exactly `local_batch_size` rows with an extra "_id".
  """
  buf = {k: [] for k in keys}
  ids = []
  emitted = 0
  position = 0
  template = None

  def flush(n_rows):
    batch = {}
    for k in keys:
      rows = buf[k][:n_rows]
      del buf[k][:n_rows]
      batch[k] = np.stack(rows) if rows else None
    rows_ids = ids[:n_rows]
    del ids[:n_rows]
    return _pad_batch(batch, np.asarray(rows_ids, np.int64), local_batch_size)

  for local in local_batches:
    mask = np.asarray(local["_mask"]).astype(bool)
    for i in range(mask.shape[0]):
      pos = position + i
      if mask[i] and pos in wanted:
        for k in keys:
          buf[k].append(np.asarray(local[k][i]))
        ids.append(wanted[pos])
    position += mask.shape[0]
    # Template for the padding batches: shapes and dtypes of one real row.
    template = {k: np.asarray(local[k][0]) for k in keys}
    while len(ids) >= local_batch_size:
      yield flush(local_batch_size)
      emitted += 1
  if template is None:
    raise ValueError("The eval data yielded no batches; check its split name and size.")
  if emitted + (1 if ids else 0) > num_batches:
    raise RuntimeError("select_batches: more selected rows than planned batches.")
  while emitted < num_batches:
    batch = flush(len(ids)) if ids else _pad_batch(
        {k: None for k in keys}, np.zeros((0,), np.int64), local_batch_size)
    for k in keys:  # Fill in empty padding batches from the template.
      if batch[k] is None:
        batch[k] = np.zeros((local_batch_size, *template[k].shape), template[k].dtype)
    yield batch
    emitted += 1


def _pad_batch(batch, ids, size):
  n = ids.shape[0]
  out = {"_mask": np.arange(size) < n, "_id": np.pad(ids, (0, size - n))}
  for k, v in batch.items():
    if v is None:
      out[k] = None
    else:
      out[k] = np.concatenate([v, np.zeros((size - n, *v.shape[1:]), v.dtype)])
  return out
