"""The pixel baseline of fewshot and linear_probe (pixel_baseline=True) against scikit-learn.

The baseline must be the evaluator's own protocol (split, shots, seeds, l2) run on the eval
pp's images, flattened: each oracle here fits scikit-learn on the pixels read by a plain pass
over the split, never on anything the evaluator computed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite import sharding
from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import fewshot
from big_vit_lite.evaluators import linear_probe

GREY_PP = "decode(channels=1)|value_range(-1, 1)|keep('image', 'label')"


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh([("data", -1)])


def projection_predict_fn(params, images):
  """A 'model' whose features are a random projection of the pixels (not the pixels)."""
  feats = jnp.tanh(images.reshape(images.shape[0], -1) @ params["w"])
  return feats, {"pre_logits": feats}


def random_params(seed, dim):
  """As many features as pixels (the probe's solver compiles once), 8 of them not constant."""
  w = jax.random.normal(jax.random.key(seed), (dim, 8)) / np.sqrt(dim)
  return {"w": jnp.pad(w, ((0, 0), (0, dim - 8)))}


def load_pixels(data_cfg, pp):
  """All valid examples of a split: (flattened float64 images, labels), one plain pass."""
  batches = list(input_pipeline.make_eval_iterator(data_cfg, pp, 500))
  x = np.concatenate([b["image"].reshape(len(b["image"]), -1) for b in batches])
  y = np.concatenate([b["label"] for b in batches])
  m = np.concatenate([b["_mask"] for b in batches]).astype(bool)
  return x[m].astype(np.float64), y[m]


def zscore(x_train, x_test):
  """Both standardised with the train rows' statistics (constant pixels: std 1)."""
  mean, std = x_train.mean(0), x_train.std(0)
  std[std < 1e-6 * std.max()] = 1.0
  return (x_train - mean) / std, (x_test - mean) / std


def test_fewshot_pixel_baseline_equals_scikit_learn_ridge_on_the_pixels(
    tfds_data_dir, mesh, monkeypatch
):
  """Guards: the baseline fitted on the model's features instead of the pixels, on samples of
  other seeds or shots than the model's, recomputed at every eval, or its keys not beside
  the model's."""
  sk = pytest.importorskip("sklearn.linear_model")
  data = dict(name="animal_mnist", data_dir=tfds_data_dir)
  l2, shots, seeds = 16.0, (1, 3), 2
  ev = fewshot.Evaluator(
      projection_predict_fn,
      mesh=mesh,
      pp=GREY_PP,
      shots=shots,
      num_seeds=seeds,
      l2_regs=(l2,),
      batch_size=64,
      pixel_baseline=True,
      datasets={
          "a": dict(data, train_split="train[:150]", test_split="test[:200]")
      },
  )
  reads = []
  real = input_pipeline.make_eval_iterator
  monkeypatch.setattr(
      input_pipeline,
      "make_eval_iterator",
      lambda *a, **k: reads.append(a[0]["split"]) or real(*a, **k),
  )
  got = ev.run(random_params(0, 784))
  # Each model metric, then its baseline.
  assert list(got) == ["a_1shot", "a_1shot_pixels", "a_3shot", "a_3shot_pixels"]
  assert len(reads) == 4  # model: sampled train rows, test; pixels: the same

  x_tr, y_tr = load_pixels(dict(data, split="train[:150]"), GREY_PP)
  x_te, y_te = load_pixels(dict(data, split="test[:200]"), GREY_PP)
  classes = np.unique(y_tr)
  for shot in shots:
    accs = []
    for seed in range(seeds):
      # The documented sampling: per class (ascending), a seeded permutation's
      # prefix of max(shots), of which the first `shot`.
      rng = np.random.default_rng(seed)
      rows = np.concatenate(
          [
              rng.permutation(np.flatnonzero(y_tr == c))[: max(shots)][:shot]
              for c in classes
          ]
      )
      z, z_te = zscore(x_tr[rows], x_te)
      ridge = sk.RidgeClassifier(alpha=l2).fit(z, y_tr[rows])
      accs.append(ridge.score(z_te, y_te))
    want = np.mean(accs)
    assert got[f"a_{shot}shot_pixels"] == pytest.approx(want, abs=1e-9), shot
    assert got[f"a_{shot}shot"] != got[f"a_{shot}shot_pixels"]
  assert got["a_3shot_pixels"] > 0.3

  # Other params: the model's features again, the baseline kept (nothing more read
  # for it).
  del reads[:]
  again = ev.run(random_params(1, 784))
  assert len(reads) == 2
  assert again["a_3shot_pixels"] == got["a_3shot_pixels"]
  assert again["a_3shot"] != got["a_3shot"]

  with pytest.raises(ValueError, match="pixel_baseline='yes': use True"):
    fewshot.Evaluator(
        projection_predict_fn,
        mesh=mesh,
        pp=GREY_PP,
        shots=(1,),
        pixel_baseline="yes",
        datasets={"a": dict(data, train_split="train[:150]")},
    )


def test_linear_probe_pixel_baseline_equals_scikit_learn_logistic_regression(
    tfds_data_dir, mesh
):
  """Guards: the probe's baseline fitted on the model's features instead of the pixels,
  or with another l2 than the grid's."""
  sk = pytest.importorskip("sklearn.linear_model")
  pp = "decode(channels=1)|resize(14)|value_range(-1, 1)|keep('image', 'label')"
  data = dict(name="mnist10k", data_dir=tfds_data_dir)
  l2 = 1e-2
  ev = linear_probe.Evaluator(
      projection_predict_fn,
      mesh=mesh,
      datasets={
          "m": dict(data, train_split="train[:400]", test_split="test[:300]")
      },
      pp=pp,
      l2_regs=(l2,),
      batch_size=200,
      pixel_baseline=True,
  )
  got = ev.run(random_params(0, 196))
  assert list(got) == ["m", "m_pixels"]

  x_tr, y_tr = load_pixels(dict(data, split="train[:400]"), pp)
  x_te, y_te = load_pixels(dict(data, split="test[:300]"), pp)
  z, z_te = zscore(x_tr, x_te)
  # The probe's penalty is l2 * |w|^2 / 2 on the mean loss: C = 1 / (n * l2).
  ref = sk.LogisticRegression(C=1.0 / (len(y_tr) * l2), max_iter=5000)
  want = ref.fit(z, y_tr).score(z_te, y_te)
  # (Two L-BFGS runs to a tolerance: a test prediction or two may differ.)
  assert abs(got["m_pixels"] - want) <= 0.01, (got, want)
  assert abs(got["m"] - want) > 0.05, got
