"""Training and evaluation input pipelines (tf.data, host side).

Training data order (contract, see DESIGN.md "Data order"):
  * the split is cut into `num_shards` contiguous, disjoint example ranges;
  * each shard is an endless stream of epochs; epoch e of shard s reads the
    shard's file pieces in an order and through a shuffle buffer both seeded
    by (seed, s, e), then numbers its examples 0, 1, 2, ...;
  * example i of epoch e of shard s gets the augmentation seed
    hash(key(seed, s, e), i): random pp ops are stateless, so an example's
    augmentation depends only on its position;
  * a shard yields batches of batch_size // num_shards; the global batch is
    the shard batches concatenated in shard order, and process p of P holds
    shards [p*S/P, (p+1)*S/P): its host batch is its slice of the global one.
So the order depends on (seed, num_shards) only, never on the process count,
and the whole position is one number, the examples consumed per shard:
`get_state()` is a tiny dict and `set_state()` rebuilds the pipeline at that
epoch and skips the consumed raw records (cheap: before decoding) within it.
That skip still reads them: resuming late in a long epoch of a TFRecord
dataset costs a pass over that part of the shard's files (image folders skip
cheaply: their raw records are indices).

Random-access sources (tfds datasets in the ArrayRecord format, see
sources.py) keep the contract with another epoch order: epoch e of shard s is
a permutation of the whole shard seeded by (seed, s, e) (tf's stateless
index_shuffle: position i -> example, O(1) each), so the order is a true
shuffle of the shard, no buffer is needed (shuffle_buffer_size only switches
it off: 0 reads the canonical order), and a resume starts the epoch's
positions at the consumed count: it reads no record it will not use.
"""

import contextlib
import logging
import math
import re
import traceback

import jax
import tensorflow as tf

from big_vit_lite.data import config_dict, count
from big_vit_lite.data import pp as pp_lib
from big_vit_lite.data import sources

# input_cfg keys this module reads; `prefetch` is the device-prefetch depth,
# read by the trainer through `device.prefetch`.
TRAIN_KEYS = (
    "data",
    "batch_size",
    "pp",
    "shuffle_buffer_size",
    "num_shards",
    "cache",
    "prefetch",
)
_MAX_EPOCHS = 2**62
# eval augmentation (if any) is a fixed function of the example index
_EVAL_KEY = 0x5EED


def _processes(process_index, process_count):
  process_count = (
      jax.process_count() if process_count is None else process_count
  )
  process_index = (
      jax.process_index() if process_index is None else process_index
  )
  return process_index, process_count


def _fold(seed, value):
  """Stateless [2] seed from a [2] seed and an int (tensor)."""
  return tf.random.experimental.stateless_fold_in(
      seed, tf.cast(value, tf.int64)
  )


def _int64s(shape, seed2):
  """Uniform int64s of `shape` from a [2] seed: a shuffle's scalar seed, or with shape [2]
  and the seed (epoch key, example index) an example's `_rng`, well mixed on purpose: pp ops
  advance it by small counters (pp/rng.py), so a structured pair such as (hash, index) would
  give neighbouring examples shared seeds."""
  return tf.random.stateless_uniform(
      shape, seed=seed2, minval=None, maxval=None, dtype=tf.int64
  )


def _bounds(n, parts):
  return [i * n // parts for i in range(parts + 1)]


def _pp_map(source, pp_fn):
  """(epoch key, index, raw record) -> preprocessed example; runs in the parallel map.

  Not autograph-converted: the pp ops are plain tf ops with no Python control
  flow on tensors (see benchmarks/NOTES.md, section "Input pipeline (data/)").
  """

  @tf.autograph.experimental.do_not_convert
  def fn(key, index, record):
    rng = {
        pp_lib.RNG_KEY: _int64s([2], tf.stack([key, tf.cast(index, tf.int64)]))
    }
    data = pp_fn({**source.decode(record), **rng})
    return {k: v for k, v in data.items() if k != pp_lib.RNG_KEY}

  return fn


@contextlib.contextmanager
def _data_errors(what):
  """tf's errors on bad data or pp -> a one-line ValueError.

  They come while iterating (a crop larger than the image, a label beyond
  onehot's depth, examples of different sizes, a truncated or deleted
  dataset file), wrapped in several lines of tf graph context that say
  nothing to the user.
  """
  try:
    yield
  except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
    _let_the_iterator_go(e)
    msg = _tf_error_text(str(e))
    # tf's "cannot batch": examples of different shapes
    if "batch" in msg and "hape" in msg:
      raise ValueError(
          f"pp output has examples of different shapes, which cannot be batched: "
          f"end the pp with ops giving a fixed size (e.g. resize(224)) and channel "
          f"count (decode(3) or decode(1), not decode(0)); {msg[:200]}"
      ) from None
    raise ValueError(f"{what}: preprocessing an example failed: {msg}") from e
  except (tf.errors.DataLossError, tf.errors.NotFoundError) as e:
    _let_the_iterator_go(e)
    raise ValueError(
        f"{what}: a file is truncated or missing ({_tf_error_text(str(e))}); "
        f"for a tfds dataset, delete its folder and prepare it again"
    ) from e


def _let_the_iterator_go(error):
  """Clears the locals of the frames of tf's traceback: they hold the failed tf.data
  iterator, and with it its threads, for as long as a caller keeps the error (which
  a garbage collection then waits on). Their lines stay, for the traceback."""
  traceback.clear_frames(error.__traceback__)


def _tf_error_text(msg):
  """The useful part of a tf runtime error: no graph node names, one line."""
  msg = msg.split("\n\t [[")[0]  # node context
  msg = re.sub(r"\{\{function_node [^}]*\}\}", "", msg)
  msg = re.sub(r"\[Op:\w+\].*$", "", msg, flags=re.S)
  msg = re.sub(r"^.*transformation with iterator: \S+: ", "", msg, flags=re.S)
  if msg.lstrip().startswith("assertion failed:"):
    # tf.debugging.Assert's data: "[text] [values]..." -> "text values".
    msg = " ".join(p.strip() for p in re.findall(r"\[([^\[\]]*)\]", msg))
  return " ".join(msg.split())[:300]


_OPTIONS = tf.data.Options()
_OPTIONS.deterministic = True  # (the default, but exact resume depends on it)


@tf.autograph.experimental.do_not_convert
def _permuted_epoch(base_seed, start, end, e, first_epoch, offset, shuffled):
  """(key, position, example index) of epoch e of a random-access shard [start, end), from
  position `offset` in the first epoch: a seeded permutation of the shard (the identity
  unless `shuffled`), read by index.
  """
  eseed = _fold(base_seed, e)
  # augmentation key of this shard's epoch (as in TrainIterator._shard_dataset)
  key = _int64s([], _fold(eseed, 3))
  last = tf.constant(end - start - 1, tf.int64)
  first = tf.where(
      e == first_epoch,
      tf.constant(offset, tf.int64),
      tf.constant(0, tf.int64),
  )
  positions = tf.data.Dataset.range(first, end - start)
  if shuffled:
    perm_seed = _fold(eseed, 1)
    shuffle = lambda i: tf.random.experimental.index_shuffle(i, perm_seed, last)  # noqa: E731
  else:
    shuffle = lambda i: i  # noqa: E731
  return positions.map(lambda i: (key, i, start + shuffle(i)))


class TrainIterator:
  """Endless iterator of host-local training batches (dict of np.ndarray).

  Position = examples consumed per shard; `get_state()`/`set_state()` save
  and restore it exactly (same examples, same augmentation).
  """

  def __init__(
      self,
      source,
      pp_fn,
      *,
      seed,
      num_shards,
      shards,
      batch_per_shard,
      shuffle_buffer_size,
      cache,
  ):
    self._source, self._pp_fn, self._batch_per_shard = (
        source,
        pp_fn,
        batch_per_shard,
    )
    self._seed, self._num_shards, self._shards = (
        int(seed),
        num_shards,
        tuple(shards),
    )
    self._shuffle_buffer_size, self._cache = shuffle_buffer_size, cache
    self.num_examples = source.num_examples
    self._bounds = _bounds(self.num_examples, num_shards)
    self._consumed, self._it = 0, None

  # --- state -------------------------------------------------------------
  def get_state(self):
    return {
        "examples_per_shard": int(self._consumed),
        "num_shards": self._num_shards,
        "seed": self._seed,
        "step": int(self._consumed // self._batch_per_shard),
        "num_examples": int(self.num_examples),
    }

  def set_state(self, state):
    for key, where in (
        ("num_shards", "input.num_shards"),
        ("seed", "config.seed"),
    ):
      mine = getattr(self, "_" + key)
      saved = state.get(key, mine)
      if int(saved) != mine:
        raise ValueError(
            f"data iterator state was saved with {key}={saved} but this run has "
            f"{mine}; set {where}={saved} to resume the same data order"
        )
    # The position is in examples, so another batch size or pp resumes at the
    # same example; another split size means other data at that position.
    saved_n = state.get("num_examples", self.num_examples)
    if int(saved_n) != self.num_examples:
      logging.warning(
          "data iterator state was saved for a split of %d examples, this one has "
          "%d: resuming at example %d per shard of different data",
          int(saved_n),
          self.num_examples,
          int(state["examples_per_shard"]),
      )
    self._consumed = int(state["examples_per_shard"])
    self._it = None

  def batch_spec(self):
    """{key: jax.ShapeDtypeStruct} of one host-local batch, without moving the position.

    Read from the pipeline's static element spec when the pp ops give fixed
    shapes (no data is read: peeking would fill the shuffle buffer and
    discard a partly read cache); otherwise one batch is read from a
    throwaway pipeline without shuffle buffer or cache.
    """
    # jax >= 0.11 refuses a ShapeDtypeStruct with unknown (None) dims: check the
    # tf shapes first.
    spec = self._build(0, peek=True).element_spec
    if not all(d is not None for s in spec.values() for d in s.shape):
      with _data_errors(f"train data {self._source.name}"):
        spec = next(iter(self._build(0, peek=True)))
    return {
        k: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype.as_numpy_dtype)
        for k, s in spec.items()
    }

  # --- iteration ---------------------------------------------------------
  def __iter__(self):
    return self

  def __next__(self):
    with _data_errors(f"train data {self._source.name}"):
      if self._it is None:
        self._it = iter(self._build(self._consumed))
      try:
        batch = next(self._it)
      except BaseException:
        # A tf.data iterator that failed reads no further: drop it, and its
        # threads, now rather than when the error is collected (_data_errors
        # clears the error's frames); a next call starts again at the same
        # position.
        self._it = None
        raise
    self._consumed += self._batch_per_shard
    return {
        k: v.numpy() if hasattr(v, "numpy") else v for k, v in batch.items()
    }

  def _shard_dataset(self, shard, consumed, peek=False):
    start, end = self._bounds[shard], self._bounds[shard + 1]
    first_epoch, offset = divmod(consumed, end - start)
    base_seed = tf.constant([self._seed, shard], tf.int64)
    source, buf = self._source, (1 if peek else self._shuffle_buffer_size)
    cached = None
    if self._cache == "raw" and not peek:
      # Filled here, in one pass over the raw records (no decoding): filled by
      # the first epoch, a run ending within it made tf warn at exit that it
      # discarded the partial cache. (see benchmarks/NOTES.md, section "Input
      # pipeline (data/)")
      cached = source.raw(start, end).cache()
      cached.reduce(0, lambda n, _: n)

    @tf.autograph.experimental.do_not_convert
    def epoch(e):
      eseed = _fold(base_seed, e)
      ds = (
          cached
          if cached is not None
          else source.raw(start, end, order_seed=_int64s([], _fold(eseed, 1)))
      )
      if buf and buf > 1:
        ds = ds.shuffle(
            buf,
            seed=_int64s([], _fold(eseed, 2)),
            reshuffle_each_iteration=False,
        )
      # augmentation key of this shard's epoch
      key = _int64s([], _fold(eseed, 3))
      return ds.enumerate().map(lambda i, rec: (key, i, rec))

    if getattr(source, "random_access", False):
      # (No `self` in a function tf.data traces: the traced graph would keep this
      # iterator, and with it the tf.data threads, alive until a garbage
      # collection, which then waits for each thread to stop.)
      shuffled = bool(self._shuffle_buffer_size)
      ds = tf.data.Dataset.range(first_epoch, _MAX_EPOCHS).flat_map(
          lambda e: _permuted_epoch(
              base_seed, start, end, e, first_epoch, offset, shuffled
          )
      )
    else:
      ds = tf.data.Dataset.range(first_epoch, _MAX_EPOCHS).flat_map(epoch)
      # raw records: skipping them costs reading, not decoding
      ds = ds.skip(offset)
    ds = ds.map(
        _pp_map(source, self._pp_fn),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return ds.batch(self._batch_per_shard, drop_remainder=True)

  def _build(self, consumed, peek=False):
    per_shard = [self._shard_dataset(s, consumed, peek) for s in self._shards]
    if len(per_shard) == 1:
      ds = per_shard[0]
    else:
      ds = tf.data.Dataset.zip(tuple(per_shard)).map(
          lambda *bs: tf.nest.map_structure(lambda *xs: tf.concat(xs, 0), *bs)
      )
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_OPTIONS)


def make_train_iterator(
    input_cfg, *, seed, process_index=None, process_count=None
):
  """TrainIterator over this process's shards; see the module docstring."""
  cfg = config_dict(input_cfg, TRAIN_KEYS, "input config")
  for key in ("data", "batch_size", "pp"):
    if cfg.get(key) is None:
      raise ValueError(f"input config needs '{key}'")
  process_index, process_count = _processes(process_index, process_count)
  num_shards = count(
      cfg.get("num_shards") or process_count, "input.num_shards", 1
  )
  batch_size = count(cfg["batch_size"], "input.batch_size", 1)
  if num_shards % process_count:
    raise ValueError(
        f"input.num_shards={num_shards} must be a multiple of the process count "
        f"{process_count}"
    )
  if batch_size % num_shards:
    raise ValueError(
        f"input.batch_size={batch_size} must be divisible by input.num_shards="
        f"{num_shards}"
    )
  cache = cfg.get("cache")
  if cache not in (None, "raw"):
    raise ValueError(
        f"input.cache must be None or 'raw' (cache the raw records in memory), "
        f"got {cache!r}"
    )
  buf = cfg.get("shuffle_buffer_size", 10_000)
  buf = (
      0
      if buf is None
      else count(buf, "input.shuffle_buffer_size (0 or None: no shuffle)", 0)
  )
  source = sources.get_source(cfg["data"])
  if cache and getattr(source, "random_access", False):
    raise ValueError(
        f"input.cache='raw' is for TFRecord data; {source.name} is in the "
        f"ArrayRecord format (read by index): set input.cache=None"
    )
  if source.num_examples == 0:
    skipped = getattr(source, "num_skipped", 0)
    raise ValueError(
        f"train data {source.name} has no examples"
        + (
            f" ({skipped} unreadable or unsupported file(s) skipped, see the log)"
            if skipped
            else ""
        )
    )
  # Every process checks every shard (not only its own), so all fail alike: one
  # process failing alone would leave the others waiting in collectives.
  # (the shards differ by 1 example at most)
  smallest = source.num_examples // num_shards
  if smallest < batch_size // num_shards:
    raise ValueError(
        f"train data {source.name} has {source.num_examples} examples: cut into "
        f"{num_shards} shard(s), the smallest has {smallest}, fewer than its batch "
        f"of {batch_size // num_shards}; lower input.batch_size (or num_shards)"
    )
  pp_fn = pp_lib.get_preprocess_fn(cfg["pp"])
  per_process = num_shards // process_count
  shards = range(process_index * per_process, (process_index + 1) * per_process)
  logging.info(
      "train input: %s, %d examples, %d shards (process %d reads %s), batch %d/shard",
      cfg["data"],
      source.num_examples,
      num_shards,
      process_index,
      list(shards),
      batch_size // num_shards,
  )
  return TrainIterator(
      source,
      pp_fn,
      seed=seed,
      num_shards=num_shards,
      shards=shards,
      batch_per_shard=batch_size // num_shards,
      shuffle_buffer_size=buf,
      cache=cache,
  )


class EvalIterable:
  """Re-iterable eval batches of one process: every example exactly once.

  Process p reads the p-th contiguous range of the split. All processes
  yield the same number of batches; padding examples (zeros) have
  `_mask` False. Random pp ops get a seed from the example's index, so
  evaluation is deterministic.
  """

  def __init__(self, source, pp_fn, local_batch, process_index, process_count):
    self._source, self._pp_fn, self._local_batch = source, pp_fn, local_batch
    self.name = source.name  # e.g. "imagefolder ROOT/val"
    bounds = _bounds(source.num_examples, process_count)
    self._start, self._end = bounds[process_index], bounds[process_index + 1]
    # (the parts differ by 1 at most)
    longest = math.ceil(source.num_examples / process_count)
    self.num_batches = math.ceil(longest / local_batch)
    self.num_examples = self._end - self._start

  def __len__(self):
    return self.num_batches

  def _examples(self, start, end):
    ds = self._source.raw(start, end).enumerate(start)
    fn = _pp_map(self._source, self._pp_fn)
    ds = ds.map(
        lambda i, rec: fn(tf.constant(_EVAL_KEY, tf.int64), i, rec),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return ds.map(lambda d: dict(d, _mask=tf.constant(True)))

  def example_shapes(self):
    """{key: (shape, numpy dtype)} of one preprocessed example (the split's first), padding
    and batching aside: read from the static spec when the pp gives fixed shapes, else
    from that example."""
    ds = self._examples(0, 1)
    spec = ds.element_spec
    if not all(d is not None for s in spec.values() for d in s.shape):
      with _data_errors(f"eval data {self._source.name}"):
        spec = next(iter(ds))
    return {
        k: (tuple(s.shape), s.dtype.as_numpy_dtype)
        for k, s in spec.items()
        if k != "_mask"
    }

  def __iter__(self):
    ds = self._examples(self._start, self._end)
    if pad := self.num_batches * self._local_batch - self.num_examples:
      # Padding: example 0 of the split, zeroed and masked out (any real
      # example has the right shapes and dtypes, even dynamic ones).
      zero = self._examples(0, 1).map(
          lambda d: tf.nest.map_structure(tf.zeros_like, d)
      )
      ds = ds.concatenate(zero.cache().repeat(pad))
    ds = (
        ds.batch(self._local_batch)
        .prefetch(tf.data.AUTOTUNE)
        .with_options(_OPTIONS)
    )
    with _data_errors(f"eval data {self._source.name}"):
      for batch in ds:
        yield {k: v.numpy() for k, v in batch.items()}


def make_eval_iterator(
    data_cfg, pp, batch_size, *, process_index=None, process_count=None
):
  """Host-local eval batches with a bool `_mask`; see EvalIterable."""
  process_index, process_count = _processes(process_index, process_count)
  batch_size = count(batch_size, "eval batch_size", 1)
  if batch_size % process_count:
    raise ValueError(
        f"eval batch_size={batch_size} must be divisible by the process count "
        f"{process_count}"
    )
  data_cfg = sources.with_eval_split(data_cfg)
  source = sources.get_source(data_cfg)
  if source.num_examples == 0:
    raise ValueError(
        f"eval data {sources.check_data_cfg(data_cfg)} has no examples"
    )
  return EvalIterable(
      source,
      pp_lib.get_preprocess_fn(pp),
      batch_size // process_count,
      process_index,
      process_count,
  )


def get_num_examples(data_cfg):
  return sources.get_source(data_cfg).num_examples
