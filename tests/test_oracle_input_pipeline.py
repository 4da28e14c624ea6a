"""The training order and resume against the statistics of a uniform shuffle and an uninterrupted run.

Oracles: a uniform random permutation of n = 1000 ids has a rank correlation
with the ids (and with an independent permutation) of mean 0 and standard
error 1 / sqrt(n - 1) = 0.032, so |r| < 0.16 is 5 standard errors; resuming
from a saved position must give the very batches an uninterrupted iterator
gives, at every kind of cut: inside the first epoch, just before, at and
just after an epoch boundary.
"""

import json
import logging
import re

import numpy as np
import pytest

from big_vit_lite.data import input_pipeline as ip

import data_fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tfds"))
  data_fixtures.prepare_tiny_ids(d)
  return d


@pytest.fixture(scope="module")
def tiny_random_access(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tfds_ar"))
  data_fixtures.prepare_tiny_ids(d, file_format="array_record")
  return d


def _cfg(
    data_dir, split="train", batch_size=50, pp="decode|keep('id')", buffer=64
):
  return dict(
      data=dict(name="bvl_tiny_ids", split=split, data_dir=data_dir),
      batch_size=batch_size,
      pp=pp,
      shuffle_buffer_size=buffer,
      num_shards=1,
      cache=None,
      prefetch=2,
  )


def _rank_corr(a, b):
  return np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1]


@pytest.mark.parametrize("random_access", [True, False])
def test_each_epoch_is_a_fresh_uniform_shuffle(
    tiny, tiny_random_access, random_access
):
  """Guards: no shuffle (ids in file order), the same permutation every
  epoch, or an epoch order that depends on the previous one; each epoch
  still holds every id once. A random-access source (array_record) is
  permuted by index; a streamed one (tfrecord) is only as shuffled as its
  buffer, here the whole split (with a buffer of 64 of 1000, epochs
  differ only locally: rank correlation 0.96 between them)."""
  if random_access:
    c = _cfg(tiny_random_access)
  else:
    c = _cfg(tiny, buffer=1000)
  it = ip.make_train_iterator(c, seed=0, process_index=0, process_count=1)
  ids = np.concatenate([next(it)["id"] for _ in range(40)])  # 2 epochs
  first, second = ids[:1000], ids[1000:]
  assert sorted(first) == list(range(1000)) == sorted(second)
  pos_first, pos_second = np.argsort(first), np.argsort(second)
  assert abs(_rank_corr(pos_first, np.arange(1000))) < 0.16
  assert abs(_rank_corr(pos_second, np.arange(1000))) < 0.16
  assert abs(_rank_corr(pos_first, pos_second)) < 0.16


@pytest.mark.parametrize("cut", [1, 9, 10, 11])
def test_resume_anywhere_gives_the_uninterrupted_batches(tiny, cut):
  """Guards the position arithmetic: the epoch and offset of a saved
  position (divmod by the split size), a resume that restarts the epoch or
  skips one, the step counted in examples. 40 examples, batches of 4: cuts
  inside epoch 0, before, at and after the boundary at 10 batches."""
  c = _cfg(tiny, split="train[:40]", batch_size=4)
  it = ip.make_train_iterator(c, seed=2, process_index=0, process_count=1)
  stream = [next(it)["id"] for _ in range(cut + 3)]
  again = ip.make_train_iterator(c, seed=2, process_index=0, process_count=1)
  for _ in range(cut):
    next(again)
  state = json.loads(json.dumps(again.get_state()))
  assert state["examples_per_shard"] == 4 * cut and state["step"] == cut
  resumed = ip.make_train_iterator(c, seed=2, process_index=0, process_count=1)
  resumed.set_state(state)
  for want in stream[cut:]:
    np.testing.assert_array_equal(next(resumed)["id"], want)


def test_an_example_is_augmented_afresh_each_epoch(tiny):
  """Guards the augmentation key: the same example must get other random
  crops/flips in another epoch (not one fixed augmentation per example),
  and others again with another seed."""
  pp = "decode|inception_crop(6)|flip_lr|keep('image', 'id')"
  c = _cfg(tiny, split="train[:20]", batch_size=20, pp=pp)
  it = ip.make_train_iterator(c, seed=0, process_index=0, process_count=1)
  epochs = [next(it) for _ in range(2)]
  other = next(
      ip.make_train_iterator(c, seed=1, process_index=0, process_count=1)
  )
  by_id = [dict(zip(e["id"].tolist(), e["image"])) for e in (*epochs, other)]
  assert set(by_id[0]) == set(by_id[1]) == set(by_id[2])
  same = [np.array_equal(by_id[0][i], by_id[1][i]) for i in by_id[0]]
  assert sum(same) <= 2, same
  same = [np.array_equal(by_id[0][i], by_id[2][i]) for i in by_id[0]]
  assert sum(same) <= 2, same


def test_processes_with_several_shards_each_read_the_epoch_once_together(tiny):
  """Guards: a process's shards off its own contiguous run of them (e.g.
  range(p, p + k) for range(p * k, (p + 1) * k): with one shard per
  process, as in the other multi-process tests, the two agree; with two
  per process, two hosts read one shard and no host the last). Oracle: data
  parallelism's contract, written as sets: one epoch of the global batch
  (4 shards of 250 ids, batch 100: 10 steps) holds each of the 1000 ids
  exactly once over both processes."""
  c = dict(_cfg(tiny, batch_size=100), num_shards=4)
  ids = []
  for p in range(2):
    it = ip.make_train_iterator(c, seed=0, process_index=p, process_count=2)
    ids += [next(it)["id"] for _ in range(10)]
  assert sorted(np.concatenate(ids).tolist()) == list(range(1000))


def test_a_state_of_another_run_is_refused_or_said_in_one_line(tiny, caplog):
  """Guards: a saved position of another shard count or seed taken (other
  data in another order, silently), the refusal naming the wrong config key,
  and a split of another size resumed without a word (or a word naming the
  wrong sizes or position). By hand: a split of 40 saved, one of 48 now."""
  c = _cfg(tiny, split="train[:48]", batch_size=4)
  it = ip.make_train_iterator(c, seed=2, process_index=0, process_count=1)
  state = dict(it.get_state(), num_shards=4)
  with pytest.raises(
      ValueError,
      match=re.escape(
          "data iterator state was saved with num_shards=4 but this run has 1; "
          "set input.num_shards=4 to resume the same data order"
      ),
  ):
    it.set_state(state)
  state = dict(it.get_state(), seed=5)
  with pytest.raises(
      ValueError, match=re.escape("set config.seed=5 to resume")
  ):
    it.set_state(state)
  state = dict(it.get_state(), num_examples=40, examples_per_shard=12)
  with caplog.at_level(logging.WARNING, logger="absl"):
    it.set_state(state)
  assert [r.getMessage() for r in caplog.records] == [
      "data iterator state was saved for a split of 40 examples, this one has "
      "48: resuming at example 12 per shard of different data"
  ]
  assert it.get_state()["examples_per_shard"] == 12


def test_raw_cache_reads_the_files_once(tmp_path):
  """Guards: cache="raw" not taking effect (a misspelt comparison): every
  epoch reads the files again, the input-bound run the cache is for stays
  input-bound. Oracle: the files deleted after the first batch, three more
  epochs still come, and the same ids in each epoch."""
  data_fixtures.prepare_tiny_ids(str(tmp_path))
  c = dict(_cfg(str(tmp_path), split="train[:8]", batch_size=4), cache="raw")
  it = ip.make_train_iterator(c, seed=1, process_index=0, process_count=1)
  first = [next(it)["id"]]
  for f in tmp_path.rglob("*.tfrecord*"):
    f.unlink()
  batches = first + [next(it)["id"] for _ in range(7)]
  epochs = [np.sort(np.concatenate(batches[i : i + 2])) for i in (0, 2, 4, 6)]
  for ids in epochs[1:]:
    np.testing.assert_array_equal(ids, epochs[0])
