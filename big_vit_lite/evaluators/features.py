"""Sharded forward passes over eval data, with results gathered to the host.

Shared by the evaluators: each host-local batch is placed on the mesh with
`data.device.put_batch` (a global array sharded on the batch axes), a jitted
function of (params, batch) runs on it, and its (small) outputs come back to
every process as numpy via `process_allgather`. Padding rows carry
`_mask == False` and are dropped by the callers.

Also here: reading a representation (a named intermediate of the model) out
of `predict_fn`'s output, re-batching a chosen subset of a split (few-shot
forwards only the examples it samples), and `DatasetsEvaluator`, what fewshot
and linear_probe share (their datasets config, checks, features cached per params
and the pixel baseline).
"""

import math
import weakref

from absl import logging
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from big_vit_lite.runtime import sharding
from big_vit_lite.data import device as data_device
from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import presets

DEFAULT_DATASETS = {name: dict(name=name) for name in presets.OFFLINE_DATASETS}
DEFAULT_PP = "decode|value_range(-1, 1)|keep('image', 'label')"


def require_keys(batch, keys):
  """{k: batch[k] for k in keys}; a one-line error if the eval pp dropped one (e.g. "label")."""
  missing = [k for k in keys if k not in batch]
  if missing:
    have = sorted(k for k in batch if not k.startswith("_"))
    raise ValueError(
        f"The eval batches lack {', '.join(map(repr, missing))}: the pp gives "
        f"{have}. Keep the integer label (end the pp with keep('image', "
        "'label'); no onehot) for this evaluator."
    )
  return {k: batch[k] for k in keys}


def _pad_for_mesh(local, mesh):
  """Pads a host-local batch with masked-out zero rows so the mesh's batch axes divide it.

  Any eval batch_size then works on any device count (e.g. 256 on 6 GPUs);
  the callers drop rows with `_mask == False`.
  """
  devices = sharding.batch_devices(mesh)
  # (local rows x processes must split evenly over the devices)
  multiple = devices // math.gcd(devices, jax.process_count())
  pad = (-len(local["_mask"])) % multiple
  if not pad:
    return local

  def padded(v):
    v = np.asarray(v)
    return np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)])

  return {k: padded(v) for k, v in local.items()}


def map_batches(fn, params, local_batches, mesh):
  """Yields fn(params, global_batch) as host numpy (all processes' rows) per host-local batch.

  The next batch is dispatched before the previous result is fetched, so the
  host copy overlaps the device work.
  """
  pending = None
  for local in local_batches:
    out = fn(params, data_device.put_batch(_pad_for_mesh(local, mesh), mesh))
    if pending is not None:
      yield multihost_utils.process_allgather(pending, tiled=True)
    pending = out
  if pending is not None:
    yield multihost_utils.process_allgather(pending, tiled=True)


_INT64 = "/int64"


def _split_int64(batch):
  """int64 arrays as pairs of int32 (jax runs without int64; a cast would wrap ids >= 2**31)."""
  out = {}
  for k, v in batch.items():
    v = np.ascontiguousarray(v)
    if v.dtype == np.int64:
      k, v = k + _INT64, v.view(np.int32).reshape(*v.shape, 2)
    out[k] = v
  return out


def _join_int64(arrays):
  """The inverse of `_split_int64` on host arrays."""
  out = {}
  for k, v in arrays.items():
    if k.endswith(_INT64):
      k, v = (
          k.removesuffix(_INT64),
          np.ascontiguousarray(v).view(np.int64)[..., 0],
      )
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
  if layer != "logits" and layer not in out:
    raise ValueError(
        f"representation_layer={layer!r} is not an output of the model; "
        f"choose one of {sorted(['logits', *out])}."
    )
  rep = logits if layer == "logits" else out[layer]
  if rep.ndim > 2 and token_pool == "mean":
    rep = rep.mean(axis=tuple(range(1, rep.ndim - 1)))
  elif rep.ndim > 2:
    rep = rep.reshape(rep.shape[0], -1)
  return rep.astype(jnp.float32)


class FeatureExtractor:
  """Computes `representation(...)` for every valid example of some batches.

  Batches must hold "image", "_mask" and the label key; extra integer keys
  (e.g. "_id") are passed through so callers can tell examples apart.
  """

  def __init__(self, predict_fn, mesh, layer="pre_logits", token_pool="mean"):
    if token_pool not in TOKEN_POOLS:
      raise ValueError(
          f"token_pool={token_pool!r} is not one of {TOKEN_POOLS}."
      )
    self.mesh, self.layer = mesh, layer

    def features(params, batch):
      logits, out = predict_fn(params, batch["image"])
      rest = {k: v for k, v in batch.items() if k != "image"}
      return {"feature": representation(logits, out, layer, token_pool), **rest}

    self._fn = jax.jit(features)

  def __call__(self, params, local_batches, keys):
    """Returns a dict of numpy arrays ("feature" + keys) over the valid rows."""
    keys = tuple(dict.fromkeys(("image", "_mask", *keys)))
    inputs = (_split_int64(require_keys(b, keys)) for b in local_batches)
    columns = {}
    for batch_out in map_batches(self._fn, params, inputs, self.mesh):
      batch_out = _join_int64(batch_out)
      valid = batch_out.pop("_mask").astype(bool)
      for k, v in batch_out.items():
        columns.setdefault(k, []).append(v[valid])
    out = {k: np.concatenate(v) for k, v in columns.items()}
    bad = int(np.sum(~np.isfinite(out["feature"]).all(axis=1)))
    if bad:
      # Ridge's SVD would fail on them and L-BFGS would silently fit chance.
      raise ValueError(
          f"The model's {self.layer!r} features are NaN/inf for {bad} of "
          f"{len(out['feature'])} examples: the checkpoint holds non-finite "
          "params or overflows (e.g. in bfloat16); evaluate a finite checkpoint."
      )
    return out


def gather_local(array):
  """Stacks the same-shaped host-local numpy arrays of all processes: (P, ...)."""
  array = np.asarray(array)
  if jax.process_count() == 1:
    return array[None]
  gathered = multihost_utils.process_allgather(
      _split_int64({"x": array}), tiled=False
  )
  return _join_int64({k: np.asarray(v) for k, v in gathered.items()})["x"]


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
  rows, emitted, position, template = [], 0, 0, None

  def make(chunk):
    batch = {
        k: np.zeros((local_batch_size, *v.shape), v.dtype)
        for k, v in template.items()
    }
    for j, row in enumerate(chunk):
      for k, v in row.items():
        batch[k][j] = v
    batch["_mask"] = np.arange(local_batch_size) < len(chunk)
    return batch

  for local in local_batches:
    if template is None:  # Shapes and dtypes of one row, for the zero rows.
      template = {
          k: np.asarray(v[0]) for k, v in require_keys(local, keys).items()
      }
      template["_id"] = np.zeros((), np.int64)
    mask = np.asarray(local["_mask"]).astype(bool)
    for i in np.flatnonzero(mask):
      gid = wanted.get(position + int(i))
      if gid is not None:
        row = {k: local[k][i] for k in keys}
        row["_id"] = gid
        rows.append(row)
    position += mask.shape[0]
    while len(rows) >= local_batch_size:
      yield make(rows[:local_batch_size])
      del rows[:local_batch_size]
      emitted += 1
  for _ in range(emitted, num_batches):
    yield make(rows)
    rows = []


def dataset_cfgs(datasets, pp, train_split, test_split):
  """NAME -> (train data cfg, test data cfg, pp) from the `datasets` config."""
  out = {}
  for name, spec in dict(datasets).items():
    spec = spec.to_dict() if hasattr(spec, "to_dict") else spec
    # big_vision's (name, train split, test split)
    if isinstance(spec, (tuple, list)):
      spec = dict(zip(("name", "train_split", "test_split"), spec))
    base = {
        k: v
        for k, v in spec.items()
        if k not in ("train_split", "test_split", "pp")
    }
    out[name] = (
        dict(base, split=spec.get("train_split", train_split)),
        dict(base, split=spec.get("test_split", test_split)),
        spec.get("pp", pp),
    )
  return out


def pixels_predict_fn(params, images):
  """A predict_fn whose one output, "pixels", is its input: the eval pp's images."""
  del params
  return None, {"pixels": images}


class DatasetsEvaluator:
  """Base of fewshot and linear_probe: train/test splits per dataset, features per params.

  Subclasses define `_features(extractor, params, name)` (one dataset's features) and
  `scores(named_features)` ({metric: value} from (name, features) pairs). `run` scores
  the features of `params`; `features_per_dataset` computes them once per dataset and
  reuses them while the params are the very same arrays (jax arrays are immutable; weak
  references keep no old params alive; numpy leaves, mutable, disable the cache).

  pixel_baseline=True: `run` also scores the eval pp's images, flattened, with the same
  protocol (splits, shots, seeds, l2 grid): each metric KEY is followed by
  KEY + presets.PIXELS_SUFFIX. They do not depend on the params: computed at the first `run`
  and kept for the evaluator's life (a training run's).
  """

  def __init__(
      self,
      predict_fn,
      mesh,
      datasets,
      pp,
      train_split,
      test_split,
      representation_layer,
      token_pool,
      batch_size,
      label_key,
      pixel_baseline,
  ):
    if not isinstance(pixel_baseline, bool):
      raise ValueError(
          f"pixel_baseline={pixel_baseline!r}: use True (also score the raw "
          "pixels, as a baseline) or False."
      )
    self.mesh = mesh
    if datasets is None:
      datasets = DEFAULT_DATASETS
    self.datasets = dataset_cfgs(
        datasets,
        pp,
        train_split,
        test_split,
    )
    # Now: a misspelt dataset, split or pp op, a bad batch_size stop a trainer
    # before it trains.
    for train_cfg, test_cfg, dataset_pp in self.datasets.values():
      input_pipeline.make_eval_iterator(train_cfg, dataset_pp, batch_size)
      input_pipeline.make_eval_iterator(test_cfg, dataset_pp, batch_size)
    self.batch_size, self.label_key = int(batch_size), label_key
    self.extractor = FeatureExtractor(
        predict_fn, mesh, representation_layer, token_pool
    )
    self.pixel_baseline = pixel_baseline
    self.pixel_extractor = FeatureExtractor(
        pixels_predict_fn, mesh, "pixels", "flatten"
    )
    self._refs, self._cache, self._pixel_results = None, {}, None

  def split_features(self, extractor, params, data_cfg, pp):
    """(features, int64 labels) of every example of one split."""
    f = extractor(
        params,
        input_pipeline.make_eval_iterator(data_cfg, pp, self.batch_size),
        keys=(self.label_key,),
    )
    return f["feature"], f[self.label_key].astype(np.int64)

  def features_per_dataset(self, params):
    """Yields (name, self._features(params, name)) for each dataset, cached per params."""
    leaves = jax.tree.leaves(params)
    if (
        self._refs is None
        or len(leaves) != len(self._refs)
        or any(r() is not leaf for r, leaf in zip(self._refs, leaves))
    ):
      self._cache = {}
      cacheable = all(isinstance(leaf, jax.Array) for leaf in leaves)
      self._refs = [weakref.ref(leaf) for leaf in leaves] if cacheable else None
    for name in self.datasets:
      if name not in self._cache:
        self._cache[name] = self._features(self.extractor, params, name)
      yield name, self._cache[name]

  def run(self, params):
    """{metric: value} of the model's features; with the pixel baseline, each metric's beside it."""
    results = self.scores(self.features_per_dataset(params))
    if not self.pixel_baseline:
      return results
    if self._pixel_results is None:
      logging.info(
          "Pixel baseline of %s (once per run) ...", list(self.datasets)
      )
      pixels = (
          (name, self._features(self.pixel_extractor, {}, name))
          for name in self.datasets
      )
      self._pixel_results = self.scores(pixels)
    side_by_side = {}
    for key, value in results.items():
      side_by_side[key] = value
      side_by_side[key + presets.PIXELS_SUFFIX] = self._pixel_results[key]
    return side_by_side
