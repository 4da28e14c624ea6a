"""Evaluators end to end in-process: real data pipeline, sharded forward, tiny models."""

import os
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from big_vit_lite.runtime import sharding
from big_vit_lite import train
from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import classification
from big_vit_lite.evaluators import features
from big_vit_lite.evaluators import fewshot
from big_vit_lite.evaluators import get_evaluator_cls
from big_vit_lite.evaluators import linear_probe
from big_vit_lite.evaluators import presets
from big_vit_lite.evaluators import ridge
from big_vit_lite.models import vit

import checks
import evaluator_fixtures

GREY_PP = "decode(channels=1)|value_range(-1, 1)|keep('image', 'label')"


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh([("data", -1)])


def pixels_predict_fn(params, images):
  """A 'model' whose representation is the raw pixels: the issue's baseline."""
  del params
  flat = images.reshape(images.shape[0], -1)
  return flat, {"pre_logits": flat}


def test_registry_finds_types_and_rejects_others(mesh):
  assert get_evaluator_cls("fewshot") is fewshot.Evaluator
  assert get_evaluator_cls("linear_probe") is linear_probe.Evaluator
  assert get_evaluator_cls("classification") is classification.Evaluator
  with pytest.raises(ValueError, match="classification, fewshot, linear_probe"):
    get_evaluator_cls("few_shot")
  with pytest.raises(ValueError, match="Unknown evaluator type 'ridge'"):
    get_evaluator_cls("ridge")  # a helper module, not an evaluator
  with pytest.raises(TypeError, match="shotz"):
    fewshot.Evaluator(pixels_predict_fn, mesh=mesh, shotz=(1,))
  with pytest.raises(ValueError, match="needs name"):
    fewshot.Evaluator(
        pixels_predict_fn, mesh=mesh, datasets={"x": dict(split="train")}
    )
  # Checked when built, not after the forward passes (or deep in the input
  # pipeline).
  with pytest.raises(ValueError, match="l2_regs"):
    fewshot.Evaluator(pixels_predict_fn, mesh=mesh, l2_regs=(0.0,))
  for cls in (fewshot.Evaluator, linear_probe.Evaluator):
    with pytest.raises(
        ValueError, match="batch_size must be an int >= 1, got 0"
    ):
      cls(pixels_predict_fn, mesh=mesh, batch_size=0)
  with pytest.raises(
      ValueError, match="batch_size must be an int >= 1, got 2.5"
  ):
    classification.Evaluator(
        pixels_predict_fn, mesh=mesh, data={}, pp="", batch_size=2.5
    )


@pytest.fixture(scope="module")
def shapes_folder(tmp_path_factory):
  return evaluator_fixtures.write_image_folder(
      str(tmp_path_factory.mktemp("f") / "shapes3")
  )


def test_fewshot_on_image_folder(shapes_folder, mesh):
  ev = get_evaluator_cls("fewshot")(
      pixels_predict_fn,
      mesh=mesh,
      datasets=presets.folder_datasets(shapes_folder),
      pp=presets.eval_pp(28, channels=1),
      shots=(1, 10),
      num_seeds=3,
      batch_size=16,
  )
  res = ev.run({})
  # Metrics are named after the folder; wrong labels or features misaligned
  # with their labels would give ~33% (3 classes).
  assert set(res) == {"shapes3_1shot", "shapes3_10shot"}
  assert res["shapes3_10shot"] >= 0.95, res


def test_fewshot_reuses_features_only_for_the_same_params(
    shapes_folder, mesh, monkeypatch
):
  model = vit.Model(num_classes=0, **evaluator_fixtures.TINY_VIT)
  init = lambda seed: nn.meta.unbox(
      model.init(jax.random.key(seed), jnp.zeros((1, 28, 28, 1)))["params"]
  )
  params = init(0)
  reads = checks.record_eval_reads(monkeypatch)
  ev = fewshot.Evaluator(
      lambda p, x: model.apply({"params": p}, x, train=False),
      mesh=mesh,
      datasets=presets.folder_datasets(shapes_folder),
      pp=presets.eval_pp(28, channels=1),
      shots=(5,),
      num_seeds=3,
      batch_size=16,
  )
  # Both splits opened (not read) to check them, and the labels pass, once, when
  # built.
  assert reads == ["train", "test", "train"]
  first = ev.run(params)
  # random-init features beat chance (33%)
  assert first["shapes3_5shot"] > 0.5, first
  assert reads[3:] == ["train", "test"]  # sampled pass, test pass
  # Same params: the features are reused, nothing is read again.
  assert ev.run(params) == first
  assert len(reads) == 5
  # New params (other arrays): features are recomputed, not served stale (the
  # samples, which depend on the labels alone, are kept).
  second = ev.run(init(1))
  assert reads[5:] == ["train", "test"]
  assert second != first


def test_more_shots_than_a_class_has_is_one_line_before_any_forward(
    shapes_folder, mesh, tmp_path
):
  # 12 train images per class, but only 7 of class 1 ("corner", in sorted
  # order).
  root = tmp_path / "shapes3"
  shutil.copytree(shapes_folder, root)
  for i in range(7, 12):
    os.remove(root / "train" / "corner" / f"{i}.png")
  calls = []

  def predict_fn(params, images):
    calls.append(images.shape)
    return pixels_predict_fn(params, images)

  # It used to warn, then report "shapes3_10shot" fitted on 7 examples of that
  # class.
  with pytest.raises(ValueError) as e:
    fewshot.Evaluator(
        predict_fn,
        mesh=mesh,
        datasets=presets.folder_datasets(str(root)),
        pp=GREY_PP,
        shots=(1, 5, 10),
        num_seeds=2,
        batch_size=16,
    )
  msg = str(e.value)
  assert "\n" not in msg and not calls, msg
  assert msg.startswith(
      "Few-shot dataset 'shapes3' (imagefolder, split 'train'): class 1 has "
      "only 7 train examples, too few for 10-shot; lower `shots` to at most 7 "
      "or use a bigger train split."
  ), msg
  # As many shots as the smallest class has: fine.
  ev = fewshot.Evaluator(
      predict_fn,
      mesh=mesh,
      datasets=presets.folder_datasets(str(root)),
      pp=GREY_PP,
      shots=(1, 7),
      num_seeds=2,
      batch_size=16,
  )
  assert set(ev.run({})) == {"shapes3_1shot", "shapes3_7shot"}


def test_trainer_stops_on_too_many_shots_before_training(
    shapes_folder, tfds_data_dir, tmp_path
):
  import train_config_tiny  # pylint: disable=import-outside-toplevel

  config = train_config_tiny.get_config()
  config.input.data.data_dir = tfds_data_dir
  config.evals = dict(
      fewshot=dict(
          type="fewshot",
          datasets=presets.folder_datasets(shapes_folder),
          pp=GREY_PP,
          shots=(1, 25),
          num_seeds=1,
          log_steps=100,
      )
  )
  # (main prints this ValueError as its one line, like the evaluators' other
  # config errors.)
  with pytest.raises(
      ValueError,
      match=r"'shapes3' .*class 0 has only 12 train examples, too few "
      r"for 25-shot",
  ):
    train.train(config, str(tmp_path / "run"))
  # Before the checkpointer, the step's compile and any training.
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def _load_split(data_cfg, pp):
  """All valid examples of a split as numpy (one plain pass, no evaluator)."""
  batches = list(input_pipeline.make_eval_iterator(data_cfg, pp, 500))
  x = np.concatenate([b["image"].reshape(len(b["image"]), -1) for b in batches])
  y = np.concatenate([b["label"] for b in batches])
  m = np.concatenate([b["_mask"] for b in batches]).astype(bool)
  return x[m], y[m]


def test_fewshot_equals_direct_computation(tfds_data_dir, mesh):
  # The evaluator forwards only the sampled train examples (labels pass, then
  # a re-batched pass over the chosen ones). Computing the same protocol
  # directly on the whole split in numpy must give identical numbers.
  data = dict(name="animal_mnist", data_dir=tfds_data_dir)
  ev = fewshot.Evaluator(
      pixels_predict_fn,
      mesh=mesh,
      datasets={"animal_mnist": data},
      pp=GREY_PP,
      shots=(2, 10),
      num_seeds=3,
      batch_size=500,
  )
  got = ev.run({})
  x_tr, y_tr = _load_split(dict(data, split="train"), GREY_PP)
  x_te, y_te = _load_split(dict(data, split="test"), GREY_PP)
  assert len(y_tr) == 8000 and len(y_te) == 2000
  for shot in (2, 10):
    accs = []
    for seed in range(3):
      rng = np.random.default_rng(seed)
      # The documented sampling: per class (ascending), a seeded permutation's
      # prefix.
      rows = np.concatenate(
          [
              rng.permutation(np.flatnonzero(y_tr == c))[:10][:shot]
              for c in range(10)
          ]
      )
      acc, _ = ridge.fit_and_score(x_tr[rows], y_tr[rows], x_te, y_te, 10)
      accs.append(acc)
    assert got[f"animal_mnist_{shot}shot"] == pytest.approx(
        np.mean(accs), abs=1e-12
    )
  assert got["animal_mnist_10shot"] > got["animal_mnist_2shot"] > 0.2

  bad = fewshot.Evaluator(
      pixels_predict_fn,
      mesh=mesh,
      datasets={"animal_mnist": data},
      pp=GREY_PP,
      representation_layer="block3",
      shots=(1,),
      num_seeds=1,
  )
  with pytest.raises(ValueError, match="not an output of the model"):
    bad.run({})


def test_classification_matches_numpy(tfds_data_dir, mesh):
  data = dict(name="mnist10k", split="test[:250]", data_dir=tfds_data_dir)
  pp = (
      "decode(channels=1)|value_range(-1, 1)|onehot(10, key='label', key_result='labels')"
      "|keep('image', 'labels')"
  )
  w = np.random.default_rng(0).normal(size=(784, 10)).astype(np.float32) * 0.05

  def predict_fn(params, images):
    logits = images.reshape(images.shape[0], -1) @ params["w"]
    return logits, {"pre_logits": logits}

  # Reference: the whole split in one batch (250 examples, no padding), numpy
  # math.
  (full,) = list(input_pipeline.make_eval_iterator(data, pp, 250))
  assert full["_mask"].all()
  logits = full["image"].reshape(250, -1) @ w
  labels = full["labels"].argmax(-1)
  logp = (
      logits
      - np.log(
          np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
      )
      - logits.max(-1, keepdims=True)
  )
  want_top1 = np.mean(logits.argmax(-1) == labels)
  want_top5 = np.mean(
      [l in np.argsort(-row)[:5] for row, l in zip(logits, labels)]
  )
  want_loss = -np.mean(logp[np.arange(250), labels])

  # Batches of 64: the last of 4 batches has 58 padding rows that must not
  # count.
  ev = classification.Evaluator(
      predict_fn, mesh=mesh, data=data, pp=pp, batch_size=64
  )
  got = ev.run({"w": jnp.asarray(w)})
  assert got["prec@1"] == pytest.approx(want_top1, abs=1e-6)
  assert got["prec@5"] == pytest.approx(want_top5, abs=1e-6)
  assert got["loss"] == pytest.approx(want_loss, rel=1e-4)
  assert 0.0 < want_top1 < 1.0

  with pytest.raises(ValueError, match="loss_name"):
    classification.Evaluator(
        predict_fn, mesh=mesh, data=data, pp=pp, loss_name="l2"
    )


def test_linear_probe_matches_sklearn(tfds_data_dir, mesh, caplog):
  """Also guards the probe's result line: it names the dataset and gives a percentage."""
  sklearn_lm = pytest.importorskip("sklearn.linear_model")
  pp = "decode(channels=1)|resize(14)|value_range(-1, 1)|keep('image', 'label')"
  datasets = {
      "mnist10k": dict(
          name="mnist10k",
          data_dir=tfds_data_dir,
          train_split="train[:1500]",
          test_split="test[:500]",
      )
  }
  l2 = 1e-3
  ev = linear_probe.Evaluator(
      pixels_predict_fn,
      mesh=mesh,
      datasets=datasets,
      pp=pp,
      l2_regs=(l2,),
      batch_size=500,
  )
  with caplog.at_level("INFO"):
    ours = ev.run({})["mnist10k"]
  assert (
      f"linear probe mnist10k: test accuracy {100 * ours:.2f}% (l2=0.001"
      in (caplog.text)
  )

  data = dict(name="mnist10k", data_dir=tfds_data_dir)
  x_tr, y_tr = _load_split(dict(data, split="train[:1500]"), pp)
  x_te, y_te = _load_split(dict(data, split="test[:500]"), pp)
  st = ridge.Standardizer.fit(x_tr)
  ref = sklearn_lm.LogisticRegression(C=1.0 / (len(y_tr) * l2), max_iter=5000)
  theirs = ref.fit(st(x_tr), y_tr).score(st(x_te), y_te)
  assert abs(ours - theirs) <= 0.01, (ours, theirs)
  assert ours > 0.8


def test_select_batches_keeps_wanted_rows_and_pads_to_the_planned_count():
  # 3 local batches of 4 rows; the last two rows of the last batch are padding.
  stream = [
      {
          "image": np.arange(4 * b, 4 * b + 4, dtype=np.float32)[:, None],
          "label": np.arange(4 * b, 4 * b + 4),
          "_mask": np.array([True, True] + [b < 2] * 2),
      }
      for b in range(3)
  ]
  # 10 is a padding row: never taken
  wanted = {1: 101, 2: 102, 7: 107, 9: 109, 10: 110}
  out = list(
      features.select_batches(stream, wanted, 3, 3, keys=("image", "label"))
  )
  # one full, one partial, one all-padding (another process needs it)
  assert len(out) == 3
  assert [b["_mask"].tolist() for b in out] == [
      [True] * 3,
      [True, False, False],
      [False] * 3,
  ]
  assert out[0]["_id"].tolist() == [101, 102, 107]
  assert out[0]["label"].tolist() == [1, 2, 7] and out[1]["label"][0] == 9
  assert out[2]["image"].shape == (3, 1) and out[2]["image"].dtype == np.float32


def test_representation_pools_token_layers():
  tokens = jnp.arange(24.0).reshape(2, 3, 4)
  out = {"encoded": tokens, "pre_logits": tokens[:, 0]}
  assert features.representation(None, out, "pre_logits").shape == (2, 4)
  np.testing.assert_allclose(
      features.representation(None, out, "encoded"), tokens.mean(1)
  )
  flat = features.representation(None, out, "encoded", token_pool="flatten")
  np.testing.assert_allclose(flat, tokens.reshape(2, 12))
  with pytest.raises(ValueError, match="token_pool"):
    features.FeatureExtractor(pixels_predict_fn, None, token_pool="max")


def test_feature_extractor_returns_the_valid_rows_in_order(mesh):
  # Three batches of 3 rows with padding rows (mask False) in each, the
  # last one short; ids past 2**31 (the int64 keys cross jax as int32
  # pairs). Oracle: the valid rows picked out by hand.
  images = np.arange(9 * 2, dtype=np.float32).reshape(9, 2, 1, 1)
  ids = np.int64(2**40) + np.arange(9)
  masks = [[True, False, True], [False, True, True], [True, False]]
  batches, start = [], 0
  for mask in masks:
    rows = slice(start, start + len(mask))
    batches.append(
        {
            "image": images[rows],
            "_mask": np.array(mask),
            "_id": ids[rows],
            "text": np.array(["not", "for", "jax"][: len(mask)]),
        }
    )
    start += len(mask)
  valid = [0, 2, 4, 5, 6]
  extractor = features.FeatureExtractor(pixels_predict_fn, mesh)
  out = extractor(None, batches, keys=("_id",))
  assert sorted(out) == ["_id", "feature"]
  np.testing.assert_array_equal(out["feature"], images[valid].reshape(5, 2))
  assert out["_id"].dtype == np.int64
  np.testing.assert_array_equal(out["_id"], ids[valid])


def test_wrong_labels_for_the_model_are_one_line_errors(
    shapes_folder, mesh, tmp_path
):
  data = dict(name="imagefolder", data_dir=shapes_folder, split="test")

  def two_class_head(params, images):  # 2 outputs; the folder has 3 classes
    flat = images.reshape(images.shape[0], -1)
    return flat[:, :2], {"pre_logits": flat[:, :32]}

  # Integer labels past the head used to become all-zero targets: never a hit
  # but zero loss, i.e. a wrong prec@1 and loss without complaint.
  ev = classification.Evaluator(
      two_class_head, mesh=mesh, data=data, pp=GREY_PP, batch_size=16
  )
  with pytest.raises(
      ValueError, match=r"8 examples have a label outside the model's 2 classes"
  ):
    ev.run({})
  onehot_pp = (
      "decode(channels=1)|value_range(-1, 1)|onehot(3, key='label', key_result='labels')"
      "|keep('image', 'labels')"
  )
  ev = classification.Evaluator(
      two_class_head, mesh=mesh, data=data, pp=onehot_pp, batch_size=16
  )
  with pytest.raises(
      ValueError, match=r"3-class 'labels' but the model's head has 2 outputs"
  ):
    ev.run({})  # was a TypeError from inside jit
  # Few-shot / linear probe need the integer label: a pp that drops it was a
  # KeyError.
  for cls, kw in (
      (fewshot.Evaluator, dict(shots=(1, 10))),
      (linear_probe.Evaluator, {}),
  ):
    ev = cls(
        pixels_predict_fn,
        mesh=mesh,
        datasets=presets.folder_datasets(shapes_folder),
        pp=onehot_pp,
        batch_size=16,
        **kw,
    )
    with pytest.raises(
        ValueError, match=r"lack 'label'.*keep\('image', 'label'\)"
    ):
      ev.run({})
  # One class: every prediction is right, a 100% that measures nothing.
  one = tmp_path / "one"
  for split in ("train", "test"):
    shutil.copytree(
        os.path.join(shapes_folder, split, "bars"), one / split / "bars"
    )
  for cls in (fewshot.Evaluator, linear_probe.Evaluator):
    with pytest.raises(ValueError, match="at least 2 classes"):
      cls(
          pixels_predict_fn,
          mesh=mesh,
          datasets=presets.folder_datasets(str(one)),
          pp=GREY_PP,
          batch_size=16,
      ).run({})


def test_non_finite_model_outputs_are_one_line_errors(shapes_folder, mesh):
  # A diverged (NaN) checkpoint: few-shot died in the SVD (LinAlgError), the
  # linear probe reported chance accuracy and classification a prec@1 from
  # argmax(NaN).
  def scaled_pixels(params, images):
    flat = images.reshape(images.shape[0], -1) * params["scale"]
    return flat[:, :3], {"pre_logits": flat}

  nan = {"scale": jnp.float32(np.nan)}
  datasets = presets.folder_datasets(shapes_folder)
  for ev in (
      fewshot.Evaluator(
          scaled_pixels,
          mesh=mesh,
          datasets=datasets,
          pp=GREY_PP,
          shots=(1,),
          num_seeds=1,
          batch_size=16,
      ),
      linear_probe.Evaluator(
          scaled_pixels, mesh=mesh, datasets=datasets, pp=GREY_PP, batch_size=16
      ),
  ):
    with pytest.raises(
        ValueError, match=r"'pre_logits' features are NaN/inf for \d+ of"
    ):
      ev.run(nan)
  ev = classification.Evaluator(
      scaled_pixels,
      mesh=mesh,
      batch_size=16,
      pp=GREY_PP,
      data=dict(name="imagefolder", data_dir=shapes_folder, split="test"),
  )
  with pytest.raises(ValueError, match="logits are NaN/inf for 24 of 24"):
    ev.run(nan)
  assert ev.run({"scale": jnp.float32(1.0)})["prec@1"] >= 0.0


def test_eval_batches_are_padded_to_the_mesh():
  # batch_size=10 on 4 devices was an IndivisibleError traceback from put_batch:
  # the batch now gets masked-out zero rows up to a multiple of the batch axes.
  mesh4 = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  batch = {
      "image": np.ones((10, 2, 2, 1), np.float32),
      "_mask": np.ones(10, bool),
      "label": np.arange(10),
  }
  out = features._pad_for_mesh(batch, mesh4)
  assert {k: v.shape[0] for k, v in out.items()} == {
      "image": 12,
      "_mask": 12,
      "label": 12,
  }
  assert out["_mask"].sum() == 10 and not out["image"][10:].any()
  assert (
      features._pad_for_mesh(batch, jax.sharding.AbstractMesh((2,), ("data",)))
      is batch
  )


# Settings, labels and memory limits the way a big_vision user hits them.

HUGE = 2**40  # A class id far beyond any sensible class count.


class BvlEvalLabels(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """8x8 images of classes 0, 1, 3 (no 2), plus test splits with odd labels."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(shape=(8, 8, 1)),
                "label": tfds.features.Scalar(np.int64),
            }
        ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {
        "train": self._generate_examples([0, 1, 3] * 6, 0),
        "test": self._generate_examples([0, 1, 3] * 4, 1),
        "train_huge": self._generate_examples([0, 1, 3] * 6, 0, offset=HUGE),
        "test_huge": self._generate_examples([0, 1, 3] * 4, 1, offset=HUGE),
        "test_unlabelled": self._generate_examples([0, 1, -1, 3], 2),
        "test_unseen": self._generate_examples([0, 1, 2, 3], 3),
    }

  def _generate_examples(self, labels, seed, offset=0):  # pylint: disable=arguments-differ
    rng = np.random.default_rng(seed)
    for i, label in enumerate(labels):
      image = rng.integers(0, 60, (8, 8, 1))
      image[:, 2 * (label % 4) : 2 * (label % 4) + 2] += 150  # a bar per class
      yield i, {
          "image": image.astype(np.uint8),
          "label": label + offset if label >= 0 else label,
      }


@pytest.fixture(scope="module")
def labels_data(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  BvlEvalLabels(data_dir=data_dir).download_and_prepare()
  return data_dir


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
  """4 train and 3 test images per class: 12 train rows (the memory tests count them)."""
  return evaluator_fixtures.write_image_folder(
      str(tmp_path_factory.mktemp("f") / "shapes3"), n_train=4, n_test=3
  )


def test_big_vision_dataset_tuples_are_read():
  # big_vision's dataset tuples (tfds name, train split, test split) are taken
  # as they are.
  ((train, test, pp),) = features.dataset_cfgs(
      {"pets": ("oxford_iiit_pet", "train", "test")}, "PP", "x", "y"
  ).values()
  assert (train, test, pp) == (
      dict(name="oxford_iiit_pet", split="train"),
      dict(name="oxford_iiit_pet", split="test"),
      "PP",
  )


def test_fewshot_equals_scikit_learn_ridge_with_brute_force_leave_one_out(
    tfds_data_dir, mesh
):
  sk = pytest.importorskip("sklearn.linear_model")
  data = dict(name="animal_mnist", data_dir=tfds_data_dir)
  regs = (0.25, 16.0, 1024.0)
  ev = fewshot.Evaluator(
      pixels_predict_fn,
      mesh=mesh,
      pp=GREY_PP,
      shots=(1, 3),
      num_seeds=2,
      l2_regs=regs,
      batch_size=64,
      datasets={
          "a": dict(data, train_split="train[:150]", test_split="test[:200]")
      },
  )
  got = ev.run({})
  x_tr, y_tr = _load_split(dict(data, split="train[:150]"), GREY_PP)
  x_te, y_te = _load_split(dict(data, split="test[:200]"), GREY_PP)
  x_tr, x_te = x_tr.astype(np.float64), x_te.astype(np.float64)
  classes = np.unique(y_tr)
  onehot = lambda y: 2.0 * (y[:, None] == classes) - 1.0
  for shot in (1, 3):
    accs = []
    for seed in range(2):
      # The documented sampling: a seeded prefix per class.
      rng = np.random.default_rng(seed)
      rows = np.concatenate(
          [
              rng.permutation(np.flatnonzero(y_tr == c))[:3][:shot]
              for c in classes
          ]
      )
      x, y = x_tr[rows], y_tr[rows]
      mean, std = x.mean(0), x.std(0)
      std[std < 1e-6 * std.max()] = 1.0
      z, z_te = (x - mean) / std, (x_te - mean) / std
      best = None
      for l2 in regs:  # Leave-one-out by refitting without each row.
        loo = np.stack(
            [
                sk.Ridge(alpha=l2)
                .fit(np.delete(z, i, 0), np.delete(onehot(y), i, 0))
                .predict(z[i : i + 1])[0]
                for i in range(len(y))
            ]
        )
        key = (
            -np.mean(classes[loo.argmax(1)] == y),
            np.mean((loo - onehot(y)) ** 2),
            -l2,
        )
        best = min(best or (key, l2), (key, l2))
      pred = sk.Ridge(alpha=best[1]).fit(z, onehot(y)).predict(z_te)
      accs.append(np.mean(classes[pred.argmax(1)] == y_te))
    assert got[f"a_{shot}shot"] == pytest.approx(np.mean(accs), abs=1e-9), shot
  assert got["a_3shot"] > 0.15


def test_test_labels_the_train_split_lacks_stop_with_one_line(
    labels_data, mesh
):
  data = dict(name="bvl_eval_labels", data_dir=labels_data)

  def evaluators(train, test):
    ds = {"t": dict(data, train_split=train, test_split=test)}
    return (
        fewshot.Evaluator(
            pixels_predict_fn,
            mesh=mesh,
            datasets=ds,
            pp=GREY_PP,
            shots=(2,),
            num_seeds=2,
            batch_size=8,
        ),
        linear_probe.Evaluator(
            pixels_predict_fn,
            mesh=mesh,
            datasets=ds,
            pp=GREY_PP,
            batch_size=8,
            max_iter=50,
        ),
    )

  # Were a silent accuracy over examples no classifier could get right.
  for test, message, ev in (
      ("test_unlabelled", "labels -1: negative labels (-1: an unlabelled", 0),
      ("test_unseen", "labels 2: classes the train split lacks", 1),
  ):
    with pytest.raises(
        ValueError, match=re.escape(f"1 of 4 test examples have {message}")
    ):
      evaluators("train", test)[ev].run({})
  # Class ids need not be small (was a bincount / one-hot of 2**40 + 4 columns;
  # the linear probe goes through the same class_ids).
  small = evaluators("train", "test")[0].run({})["t_2shot"]
  huge = evaluators("train_huge", "test_huge")[0].run({})["t_2shot"]
  assert huge == small > 0.5, (small, huge)


def test_linear_probe_l2_and_fewshot_counts_are_checked(labels_data, mesh):
  ds = {"t": dict(name="bvl_eval_labels", data_dir=labels_data)}
  lp = lambda **kw: linear_probe.Evaluator(
      pixels_predict_fn, mesh=mesh, datasets=ds, pp=GREY_PP, batch_size=8, **kw
  )
  # NaN / inf reported chance accuracy; a single number was a TypeError.
  for regs in ((float("nan"),), (1e-3, float("inf")), (-1.0,), ()):
    with pytest.raises(ValueError, match="l2_regs must be finite numbers >= 0"):
      lp(l2_regs=regs)
  assert lp(l2_regs=1e-3).l2_regs == (1e-3,)
  fs = lambda **kw: fewshot.Evaluator(
      pixels_predict_fn, mesh=mesh, datasets=ds, pp=GREY_PP, batch_size=8, **kw
  )
  # Was "'int' object is not iterable".
  assert fs(shots=2, num_seeds=1).shots == (2,)
  # "25" became shots (2, 5), 2.5 became 2 and 1.5 seeds became 1.
  for kw in (
      dict(shots="25"),
      dict(shots=(2.5,)),
      dict(shots=(True,)),
      dict(shots=(2,), num_seeds=1.5),
  ):
    with pytest.raises(ValueError, match="must be an int >= 1"):
      fs(**kw)


def test_data_errors_stop_when_the_evaluator_is_built(shapes, mesh):
  # A trainer builds its evaluators before it trains: these used to surface at
  # the first eval (after hours of training).
  folder = dict(name="imagefolder", data_dir=shapes)
  with pytest.raises(ValueError, match="no folder .*validation"):
    classification.Evaluator(
        pixels_predict_fn,
        mesh=mesh,
        data=dict(folder, split="validation"),
        pp=GREY_PP,
    )
  with pytest.raises(ValueError, match="unknown pp op 'resise'"):
    linear_probe.Evaluator(
        pixels_predict_fn,
        mesh=mesh,
        datasets={"s": folder},
        pp="decode|resise(8)|keep('image', 'label')",
    )
  with pytest.raises(ValueError, match="no folder .*val"):
    fewshot.Evaluator(
        pixels_predict_fn,
        mesh=mesh,
        datasets={"s": folder},
        pp=GREY_PP,
        shots=(1,),
        test_split="val",
    )


def test_classification_of_a_headless_model_in_training_is_refused(
    shapes, mesh
):
  model = vit.Model(num_classes=0, **evaluator_fixtures.TINY_VIT)
  params = evaluator_fixtures.random_params(model)
  predict_fn = lambda p, x: model.apply({"params": p}, x, train=False)
  ev = classification.Evaluator(
      predict_fn,
      mesh=mesh,
      pp=GREY_PP,
      batch_size=4,
      data=dict(name="imagefolder", data_dir=shapes, split="test"),
  )
  # Was a prec@1 of the 32 features' argmax against the labels.
  with pytest.raises(ValueError, match="no classification head"):
    ev.run(params)


def test_classification_counts_hits_under_label_smoothing_and_skips_unlabelled_rows(
    shapes, mesh
):
  def always_class_0(params, images):
    del params
    logits = jnp.zeros((images.shape[0], 3)).at[:, 0].set(1.0)
    return logits, {"pre_logits": logits}

  smoothed = (
      "decode(channels=1)|onehot(3, key='label', key_result='labels', on=0.9, off=0.05)"
      "|keep('image', 'labels')"
  )
  ev = classification.Evaluator(
      always_class_0,
      mesh=mesh,
      pp=smoothed,
      batch_size=4,
      data=dict(name="imagefolder", data_dir=shapes, split="test"),
  )
  # Was 1.0: every off=0.05 was a "hit".
  assert ev.run({})["prec@1"] == pytest.approx(1 / 3)
  # ImageNet-ReaL style k-hot rows: one with no label at all counts nowhere (as
  # in big_vision); the 2-label row is a hit for either of its classes.
  labels = jnp.array([[1.0, 0, 0], [0, 1, 1], [0, 0, 0]])
  logits = jnp.array([[5.0, 0, 0], [0, 0, 5.0], [5.0, 0, 0]])
  sums = classification.batch_sums(logits, labels, jnp.ones(3), "sigmoid_xent")
  assert (float(sums["correct@1"]), float(sums["count"])) == (2.0, 2.0)


def test_linear_probe_out_of_device_memory_names_its_own_knobs(
    shapes, mesh, monkeypatch
):
  from big_vit_lite.evaluators import logistic  # pylint: disable=import-outside-toplevel

  def out_of_memory(*args, **kwargs):
    del args, kwargs
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to "
        "allocate 81604378624 bytes."
    )

  monkeypatch.setattr(logistic, "fit", out_of_memory)
  ev = linear_probe.Evaluator(
      pixels_predict_fn,
      mesh=mesh,
      pp=GREY_PP,
      batch_size=4,
      datasets={"s": dict(name="imagefolder", data_dir=shapes)},
  )
  # Was evaluate's generic advice to lower the eval batch size, which changes
  # nothing here.
  with pytest.raises(
      ValueError,
      match=r"fitting 12 examples x 784 features, 3 classes; use "
      r"token_pool='mean'",
  ):
    ev.run({})
