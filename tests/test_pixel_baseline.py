"""The pixel baseline of fewshot and linear_probe (pixel_baseline=True) against scikit-learn.

The baseline must be the evaluator's own protocol (split, shots, seeds, l2) run on the eval
pp's images, flattened: each oracle here fits scikit-learn on the pixels read by a plain pass
over the split, never on anything the evaluator computed.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite import evaluate
from big_vit_lite import report
from big_vit_lite.runtime import sharding
from big_vit_lite.logs import summary
from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import fewshot
from big_vit_lite.evaluators import linear_probe

import checks

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
  reads = checks.record_eval_reads(monkeypatch)
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


def test_summary_report_and_evaluate_table_show_each_baseline_beside_its_metric(
    tmp_path,
):
  """Guards: a baseline in a line, row or panel of its own (or lost), the model's and the
  pixels' values swapped, a baseline from another metric."""
  rows = [
      {"step": 2, "training_loss": 1.0, "learning_rate": 0.1},
      {
          "step": 4,
          "fewshot/a_10shot": 0.5,
          "fewshot/a_10shot_pixels": 0.75,
          "fewshot/b_10shot": 0.25,
      },
      {"step": 6, "training_loss": 0.5, "learning_rate": 0.1},
      {
          "step": 8,
          "fewshot/a_10shot": 0.625,
          "fewshot/a_10shot_pixels": 0.75,
          "fewshot/b_10shot": 0.375,
      },
  ]
  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows)
  )
  block = summary.block(
      dict(kind="train", status="finished", **summary.stats(rows)), "S"
  )
  assert (
      "  fewshot/a_10shot                 0.625   best 0.625 at step 8   pixels 0.75\n"
      in block
  )
  assert (
      "  fewshot/b_10shot                 0.375   best 0.375 at step 8\n"
      in block
  )
  assert "a_10shot_pixels" not in block

  run = report.load(str(tmp_path))
  plt = report.require_matplotlib()
  _, keys, shown = report.figures(plt, [run])["evals"]
  assert keys == [
      "fewshot/a_10shot",
      "fewshot/a_10shot_pixels",
      "fewshot/b_10shot",
  ]
  lines = {(l["panel"], l["label"]): (l["xs"], l["ys"]) for l in shown}
  assert lines == {
      ("fewshot/a_10shot", tmp_path.name): ([4.0, 8.0], [0.5, 0.625]),
      ("fewshot/a_10shot", f"{tmp_path.name}: raw pixels"): (
          [4.0, 8.0],
          [0.75, 0.75],
      ),
      ("fewshot/b_10shot", tmp_path.name): ([4.0, 8.0], [0.25, 0.375]),
  }
  table = report._metrics_table([run])  # pylint: disable=protected-access
  assert "<td>0.625 (best 0.625 at 8); raw pixels 0.75</td>" in table
  assert "<td>0.375 (best 0.375 at 8)</td>" in table
  assert "a_10shot_pixels" not in table

  table = evaluate.format_table(
      {
          "fewshot": {
              "a_1shot": 0.5,
              "a_1shot_pixels": 0.25,
              "a_10shot": 0.625,
              "a_10shot_pixels": 0.75,
              "bb_10shot": 0.125,
          },
          "probe": {"a": 0.875, "a_pixels": 0.9375, "b": 0.5},
      },
      accuracies=("fewshot", "probe"),
  )
  assert table == (
      "== fewshot\n"
      "  dataset   1-shot   pixels  10-shot   pixels\n"
      "  a         50.00%   25.00%   62.50%   75.00%\n"
      "  bb             -        -   12.50%        -\n"
      "== probe\n"
      "  a" + " " * 23 + "   87.50%  (pixels 93.75%)\n"
      "  b" + " " * 23 + "   50.00%"
  )
