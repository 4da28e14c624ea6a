"""ArrayRecord (random-access) sources: seeded whole-shard permutations, exact resume by seeking.

The same tiny dataset is prepared twice, as TFRecord and as ArrayRecord: the TFRecord copy,
read by tfds itself, is the oracle for the split's canonical order and contents.
"""

import gc
import json
import os
import signal
import weakref

import numpy as np
import pytest
import tensorflow_datasets as tfds

from big_vit_lite.data import input_pipeline as ip
from big_vit_lite.data import prepare
from big_vit_lite.data import sources

import data_fixtures
import trainer_runs

PP_IDS = "decode|keep('image', 'id')"
PP_AUG = (
    "decode|inception_crop(6)|flip_lr|value_range(-1, 1)|keep('image', 'id')"
)


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
  """{file format: data_dir} of the tiny ids dataset (1000 train examples, 4 files)."""
  dirs = {}
  for fmt in ("tfrecord", "array_record"):
    dirs[fmt] = str(tmp_path_factory.mktemp(fmt))
    data_fixtures.prepare_tiny_ids(dirs[fmt], file_format=fmt)
  return dirs


def cfg(data_dir, split="train", **kw):
  base = dict(
      data=dict(name="bvl_tiny_ids", split=split, data_dir=data_dir),
      batch_size=8,
      pp=PP_IDS,
      shuffle_buffer_size=64,
      num_shards=2,
  )
  return {**base, **kw}


def ids(batches):
  return np.stack([b["id"] for b in batches])


def test_source_reads_the_canonical_records_by_index(formats):
  split = "train[100:900]"
  want = ids_in_canonical_order(formats["tfrecord"], split)
  source = sources.TfdsSource("bvl_tiny_ids", split, formats["array_record"])
  assert source.random_access and source.num_examples == 800
  got = source.raw(0, 800).map(lambda i: source.decode(i)["id"])
  assert list(got.as_numpy_iterator()) == want


def test_each_epoch_is_a_seeded_permutation_of_the_shard(formats):
  it = ip.make_train_iterator(
      cfg(formats["array_record"], batch_size=2),
      seed=3,
      process_index=0,
      process_count=1,
  )
  # [steps, shard]: two epochs of 500 per shard
  rows = ids([next(it) for _ in range(1000)])
  # positions in canonical order
  tf_shards = [list(range(0, 500)), list(range(500, 1000))]
  canonical = ids_in_canonical_order(formats["tfrecord"])
  for shard in (0, 1):
    first, second = rows[:500, shard], rows[500:, shard]
    want = sorted(canonical[p] for p in tf_shards[shard])
    assert sorted(first.tolist()) == want and sorted(second.tolist()) == want
    assert not np.array_equal(first, second)  # reshuffled each epoch
    # A whole-shard shuffle, not a buffer: the first 10 come from all over the
    # shard.
    where = [canonical.index(i) - tf_shards[shard][0] for i in first[:10]]
    assert max(where) - min(where) > 250


def ids_in_canonical_order(data_dir, split="train"):
  """tfds' own reader, one file after the other."""
  ds = tfds.builder("bvl_tiny_ids", data_dir=data_dir).as_dataset(
      split=split,
      shuffle_files=False,
      read_config=tfds.ReadConfig(interleave_cycle_length=1),
  )
  return [int(ex["id"]) for ex in ds.as_numpy_iterator()]


def test_no_shuffle_reads_the_canonical_order(formats):
  it = ip.make_train_iterator(
      cfg(formats["array_record"], shuffle_buffer_size=0, num_shards=1),
      seed=0,
      process_index=0,
      process_count=1,
  )
  # 1040: wraps into epoch 2
  got = ids([next(it) for _ in range(130)]).reshape(-1)
  canonical = ids_in_canonical_order(formats["tfrecord"])
  assert got.tolist() == canonical + canonical[:40]


def test_order_depends_on_seed_and_num_shards_not_processes(formats):
  c = cfg(formats["array_record"], pp=PP_AUG)
  single = ip.make_train_iterator(c, seed=0, process_index=0, process_count=1)
  halves = [
      ip.make_train_iterator(c, seed=0, process_index=p, process_count=2)
      for p in (0, 1)
  ]
  other_seed = ip.make_train_iterator(
      c, seed=1, process_index=0, process_count=1
  )
  for _ in range(3):
    g, a, b = next(single), next(halves[0]), next(halves[1])
    for k in ("id", "image"):
      np.testing.assert_array_equal(g[k], np.concatenate([a[k], b[k]]))
  assert not np.array_equal(next(single)["id"], next(other_seed)["id"])


def test_resume_in_a_new_pipeline_gives_the_same_batches(formats):
  c = cfg(
      formats["array_record"], split="train[:200]", pp=PP_AUG, batch_size=32
  )
  it = ip.make_train_iterator(c, seed=5, process_index=0, process_count=1)
  for _ in range(7):  # 7 * 16 per shard > 100: crosses an epoch boundary
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  expected = [next(it) for _ in range(9)]  # and across the next boundary
  resumed = ip.make_train_iterator(c, seed=5, process_index=0, process_count=1)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    np.testing.assert_array_equal(got["id"], want["id"])
    # same augmentation
    np.testing.assert_array_equal(got["image"], want["image"])


@pytest.mark.parametrize("fraction", [0.0, 0.95])
def test_a_resume_reads_a_few_batches_not_the_consumed_records(
    formats, fraction
):
  c = cfg(formats["array_record"], num_shards=1)
  source = sources.get_source(c["data"])
  it = ip.make_train_iterator(c, seed=0, process_index=0, process_count=1)
  it.set_state(
      {**it.get_state(), "examples_per_shard": int(fraction * 1000) + 2000}
  )
  source.reads = 0
  next(it)
  # Read-ahead (parallel map, prefetch) reads some batches beyond the first,
  # never the 2950 examples (two epochs and 95% of a third) that a reading skip
  # would.
  assert 8 <= source.reads <= 400, source.reads


@pytest.mark.parametrize("shuffle_buffer_size", [64, 0])
def test_a_dropped_iterator_goes_at_once_with_its_threads(
    formats, shuffle_buffer_size
):
  """Guards: a function that tf.data traces holding the TrainIterator (a bound
  method in the epoch's flat_map did), so that the traced graph keeps it, its
  tf.data iterator and that iterator's threads alive until a garbage collection,
  which then waits for each thread to stop (24-36 s of the suite's runs, in
  whichever test collected). Oracle: Python's reference counting: with the
  collector off, the last reference dropped frees the iterator at once, and the
  process's threads fall back to their count before it was made (counted after a
  first iterator, which starts TensorFlow's process-wide thread pools).
  """
  config = cfg(formats["array_record"], shuffle_buffer_size=shuffle_buffer_size)

  def first_batch_read():
    it = ip.make_train_iterator(
        config, seed=0, process_index=0, process_count=1
    )
    next(it)
    return it

  gc.disable()
  try:
    first = first_batch_read()
    del first
    threads_before = len(os.listdir("/proc/self/task"))
    it = first_batch_read()
    alive = weakref.ref(it)
    assert len(os.listdir("/proc/self/task")) > threads_before
    del it
    assert alive() is None
    assert len(os.listdir("/proc/self/task")) <= threads_before
  finally:
    gc.enable()


def test_raw_cache_is_refused_for_array_record(formats):
  with pytest.raises(ValueError, match="ArrayRecord"):
    ip.make_train_iterator(
        cfg(formats["array_record"], cache="raw"),
        seed=0,
        process_index=0,
        process_count=1,
    )


@pytest.fixture(scope="module")
def mnist_array_record(tmp_path_factory):
  """mnist10k prepared by `prepare --file_format=array_record` (needs its offline source)."""
  data_dir = str(tmp_path_factory.mktemp("ar_mnist"))
  builder, _ = prepare.prepare("mnist10k", data_dir, file_format="array_record")
  assert builder.info.file_format.value == "array_record"
  return data_dir


def test_prepare_refuses_a_dataset_already_prepared_in_the_other_format(
    mnist_array_record,
):
  with pytest.raises(ValueError, match="another file format"):
    prepare.prepare("mnist10k", mnist_array_record, file_format="tfrecord")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_killed_and_restarted_on_array_record_is_bit_identical(
    mnist_array_record, tmp_path
):
  args = (
      "--config.input.data.name=mnist10k",
      "--config.total_steps=120",
      "--config.ckpt_steps=25",
  )
  ref = str(tmp_path / "ref")
  r = trainer_runs.run_train(mnist_array_record, ref, *args)
  assert r.returncode == 0, r.stderr[-3000:]
  killed = str(tmp_path / "killed")
  proc = trainer_runs.start_train(mnist_array_record, killed, *args)
  trainer_runs.wait_for_step(proc, killed, 60)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=30)
  r = trainer_runs.run_train(mnist_array_record, killed, *args)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "Resuming from" in r.stderr
  assert trainer_runs.read_losses(killed) == trainer_runs.read_losses(ref)
  trainer_runs.assert_same_params(ref, killed)
