"""Training/eval pipelines: shard coverage, process independence, exact resume, eval padding."""

import gc
import json

import numpy as np
import pytest

from big_vit_lite.data import input_pipeline as ip

import data_fixtures  # (pytest puts tests/ on sys.path: no __init__.py there)

PP_IDS = "decode|keep('image', 'id')"
PP_AUG = (
    "decode|inception_crop(6)|flip_lr|value_range(-1, 1)|keep('image', 'id')"
)
PP_RANDAUG = "decode|inception_crop(6)|flip_lr|randaug(2, 10)|value_range(-1, 1)|keep('image', 'id')"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tfds"))
  data_fixtures.prepare_tiny_ids(d)
  return d


def cfg(data_dir, **kw):
  base = dict(
      data=dict(name="bvl_tiny_ids", split="train", data_dir=data_dir),
      batch_size=6,
      pp=PP_IDS,
      shuffle_buffer_size=64,
      num_shards=None,
      cache=None,
      prefetch=2,
  )
  base.update(kw)
  return base


@pytest.mark.parametrize("num_shards", [2, 3])
def test_shards_cover_each_epoch_exactly_once(tiny, num_shards):
  # batch = num_shards: row s of every global batch comes from shard s.
  it = ip.make_train_iterator(
      cfg(tiny, batch_size=num_shards, num_shards=num_shards),
      seed=3,
      process_index=0,
      process_count=1,
  )
  bounds = ip._bounds(1000, num_shards)  # pylint: disable=protected-access
  sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
  # [steps, shards]
  rows = np.stack([next(it)["id"] for _ in range(2 * max(sizes))])
  for epoch in range(2):
    seen = np.concatenate(
        [rows[epoch * n : (epoch + 1) * n, s] for s, n in enumerate(sizes)]
    )
    assert sorted(seen.tolist()) == list(range(1000)), f"epoch {epoch}"
  # Shards are disjoint and each reshuffles between epochs.
  for s, n in enumerate(sizes):
    assert set(rows[:n, s]) == set(rows[n : 2 * n, s])
    assert not np.array_equal(rows[:n, s], rows[n : 2 * n, s])


def test_one_process_two_shards_equals_two_processes(tiny):
  c = cfg(tiny, num_shards=2, pp=PP_AUG)
  single = ip.make_train_iterator(c, seed=0, process_index=0, process_count=1)
  p0 = ip.make_train_iterator(c, seed=0, process_index=0, process_count=2)
  p1 = ip.make_train_iterator(c, seed=0, process_index=1, process_count=2)
  for _ in range(4):
    g, a, b = next(single), next(p0), next(p1)
    assert a["image"].shape[0] == 3
    for k in ("id", "image"):
      np.testing.assert_array_equal(g[k], np.concatenate([a[k], b[k]]))


def test_default_num_shards_is_process_count_and_seed_changes_order(tiny):
  a = ip.make_train_iterator(
      cfg(tiny), seed=0, process_index=0, process_count=1
  )
  b = ip.make_train_iterator(
      cfg(tiny), seed=1, process_index=0, process_count=1
  )
  assert a.get_state()["num_shards"] == 1 and a.num_examples == 1000
  assert not np.array_equal(next(a)["id"], next(b)["id"])


@pytest.mark.parametrize("cache, pp", [(None, PP_RANDAUG), ("raw", PP_AUG)])
def test_state_restore_gives_identical_next_batches(tiny, cache, pp):
  # 100 per shard
  data = dict(name="bvl_tiny_ids", split="train[:200]", data_dir=tiny)
  c = cfg(tiny, data=data, num_shards=2, pp=pp, cache=cache, batch_size=32)
  it = ip.make_train_iterator(c, seed=5, process_index=0, process_count=1)
  for _ in range(7):  # 7 * 16 per shard > 100: crosses an epoch boundary
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  assert len(json.dumps(state)) < 200
  expected = [next(it) for _ in range(3)]
  resumed = ip.make_train_iterator(c, seed=5, process_index=0, process_count=1)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    np.testing.assert_array_equal(got["id"], want["id"])
    # same augmentation
    np.testing.assert_array_equal(got["image"], want["image"])
  if pp == PP_RANDAUG:
    # (randaug's big graph is slow to build: one pair of iterators is enough)
    return
  # Resuming on 2 processes gives each its half of the same global batches.
  halves = [
      ip.make_train_iterator(c, seed=5, process_index=p, process_count=2)
      for p in (0, 1)
  ]
  for h in halves:
    h.set_state(state)
  got = [next(h) for h in halves]
  np.testing.assert_array_equal(
      np.concatenate([g["image"] for g in got]), expected[0]["image"]
  )


@pytest.mark.parametrize("pp", [PP_IDS, "decode|resize(5)|keep('image', 'id')"])
def test_batch_spec_does_not_move_the_position(tiny, pp):
  c = cfg(tiny, pp=pp, num_shards=2, cache="raw")
  it = ip.make_train_iterator(c, seed=3, process_index=0, process_count=1)
  first = next(
      ip.make_train_iterator(c, seed=3, process_index=0, process_count=1)
  )
  spec = it.batch_spec()
  assert {k: (s.shape, s.dtype) for k, s in spec.items()} == {
      k: (v.shape, v.dtype) for k, v in first.items()
  }
  assert it.get_state()["examples_per_shard"] == 0
  np.testing.assert_array_equal(next(it)["id"], first["id"])


def test_state_from_other_num_shards_is_refused(tiny):
  it = ip.make_train_iterator(
      cfg(tiny, num_shards=2), seed=0, process_index=0, process_count=1
  )
  state = it.get_state()
  other = ip.make_train_iterator(
      cfg(tiny, num_shards=3), seed=0, process_index=0, process_count=1
  )
  with pytest.raises(ValueError, match="num_shards"):
    other.set_state(state)


@pytest.mark.parametrize("processes, batch", [(1, 10), (3, 6), (2, 202)])
def test_eval_covers_every_example_once_with_padding(tiny, processes, batch):
  data = dict(name="bvl_tiny_ids", split="test", data_dir=tiny)
  runs = [
      ip.make_eval_iterator(
          data,
          "decode|value_range(0, 1)",
          batch,
          process_index=p,
          process_count=processes,
      )
      for p in range(processes)
  ]
  batches = [list(r) for r in runs]
  assert len({len(b) for b in batches}) == 1  # same count on every process
  assert all(len(b) == len(r) for b, r in zip(batches, runs))
  ids, masks = [], []
  for per_process in batches:
    for b in per_process:
      assert b["_mask"].dtype == bool and len(b["_mask"]) == batch // processes
      ids.append(b["id"])
      masks.append(b["_mask"])
      assert (b["image"][~b["_mask"]] == 0).all()
  ids, masks = np.concatenate(ids), np.concatenate(masks)
  assert sorted(ids[masks].tolist()) == list(range(1000, 1101))
  # Deterministic: a second pass is identical.
  again = np.concatenate([b["id"] for b in runs[0]])
  np.testing.assert_array_equal(
      again, np.concatenate([b["id"] for b in batches[0]])
  )


def test_tfds_split_syntax(tiny):
  assert (
      ip.get_num_examples(
          dict(name="bvl_tiny_ids", split="train[:90%]", data_dir=tiny)
      )
      == 900
  )
  it = ip.make_train_iterator(
      cfg(
          tiny,
          data=dict(name="bvl_tiny_ids", split="train[100:200]", data_dir=tiny),
          batch_size=50,
          shuffle_buffer_size=0,
      ),
      seed=0,
      process_index=0,
      process_count=1,
  )
  assert it.num_examples == 100
  ids = np.concatenate([next(it)["id"] for _ in range(2)])
  assert len(set(ids.tolist())) == 100


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(shuffle_buffer=5), ["shuffle_buffer", "unknown"]),
        (dict(num_shards=4), ["num_shards", "batch_size"]),
        (dict(cache="disk"), ["cache"]),
        (
            dict(
                data=dict(
                    name="bvl_tiny_ids", split="train", data_dir="/x", colour=1
                )
            ),
            ["colour"],
        ),
        (dict(pp="decode|bogus"), ["bogus"]),
    ],
)
def test_config_errors_are_one_line(tiny, change, words):
  with pytest.raises(ValueError) as e:
    ip.make_train_iterator(
        cfg(tiny, **change), seed=0, process_index=0, process_count=1
    )
  assert "\n" not in str(e.value)
  for w in words:
    assert w in str(e.value)


def test_missing_dataset_names_the_prepare_command(tmp_path):
  with pytest.raises(
      ValueError, match=r"python -m big_vit_lite.data.prepare mnist10k"
  ):
    ip.get_num_examples(
        dict(name="mnist10k", split="train", data_dir=str(tmp_path))
    )


def test_neighbouring_examples_do_not_share_augmentation_seeds(tiny):
  # Two flips per example; rows of a batch are consecutive stream positions.
  # Per-example seeds that were (hash, index) plus a per-op counter would make
  # example i's 2nd flip equal example i+1's 1st flip every time.
  pp = (
      "decode|copy('image', 'a')|copy('image', 'b')|flip_lr(key='a')|flip_lr(key='b')|"
      "keep('image', 'a', 'b')"
  )
  it = ip.make_train_iterator(
      cfg(tiny, batch_size=128, pp=pp, shuffle_buffer_size=0),
      seed=0,
      process_index=0,
      process_count=1,
  )
  b = next(it)
  flipped = lambda k: np.array([not np.array_equal(x, o) for x, o in zip(b[k], b["image"])])  # noqa: E731
  symmetric = np.array([np.array_equal(o, o[:, ::-1]) for o in b["image"]])
  fa, fb = flipped("a")[~symmetric], flipped("b")[~symmetric]
  assert 0.2 < fa.mean() < 0.8 and 0.2 < fb.mean() < 0.8
  assert np.mean(fb[:-1] == fa[1:]) < 0.8
  # the two ops of one example are independent too
  assert np.mean(fa == fb) < 0.8


def test_batch_spec_never_makes_a_spec_with_unknown_dims(tiny, monkeypatch):
  # jax >= 0.11 refuses ShapeDtypeStruct((32, None, None, 1), ...): a pp with no
  # fixed image size ('decode' alone) must read a batch instead of building such
  # a spec first.
  real = ip.jax.ShapeDtypeStruct

  def strict(shape, dtype, **kw):
    if any(d is None for d in shape):
      raise TypeError(
          f"`shape` passed to `ShapeDtypeStruct` cannot have None in it: {shape}"
      )
    return real(shape, dtype, **kw)

  monkeypatch.setattr(ip.jax, "ShapeDtypeStruct", strict)
  it = ip.make_train_iterator(
      cfg(tiny), seed=3, process_index=0, process_count=1
  )
  spec = it.batch_spec()
  assert all(d is not None for s in spec.values() for d in s.shape)


def test_raw_cache_ending_within_its_first_epoch_does_not_warn(tiny, capfd):
  # The cache used to be filled by the first epoch: a run ending within it made
  # tf.data warn at exit "The calling iterator did not fully read the dataset
  # being cached".
  it = ip.make_train_iterator(
      cfg(tiny, cache="raw"), seed=1, process_index=0, process_count=1
  )
  assert len({tuple(next(it)["id"]) for _ in range(3)}) == 3
  del it
  gc.collect()
  assert "did not fully read" not in capfd.readouterr().err
