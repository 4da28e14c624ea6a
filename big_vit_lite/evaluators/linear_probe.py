"""Linear probe: logistic regression on frozen features of the full train split.

For each dataset: forward the whole train and test splits once, standardise
with train statistics, hold out a seeded fraction of train to pick the l2
penalty among `l2_regs` (L-BFGS along the path from the largest, each fit
starting from the previous one's solution, see logistic.py), refit on the
whole train split with that penalty (starting from its held-out fit) and
report the test accuracy under the dataset's name. A line per fit shows the
progress.

Config (evals.NAME minus type/log_steps):
  datasets: {NAME: dict(name=TFDS_NAME, data_dir=None, [train_split], [test_split], [pp])}
  pp: preprocessing of both splits; must keep "image" and the integer label.
  representation_layer, token_pool: which features, as in fewshot.py.
  pixel_baseline: True also reports the same probe (the same held-out part and
    l2 grid) on the pp's images, flattened, as f"{dataset}_pixels": computed
    once per run (see features.DatasetsEvaluator).
"""

from absl import logging
import jax
import numpy as np

from big_vit_lite.runtime import oom
from big_vit_lite.evaluators import features as feats
from big_vit_lite.evaluators import fewshot
from big_vit_lite.evaluators import logistic
from big_vit_lite.evaluators import presets
from big_vit_lite.evaluators import ridge


class Evaluator(feats.DatasetsEvaluator):
  """Logistic-regression probe on one or more datasets."""

  def __init__(
      self,
      predict_fn,
      *,
      mesh,
      datasets=None,
      pp=feats.DEFAULT_PP,
      representation_layer="pre_logits",
      token_pool="mean",
      batch_size=256,
      l2_regs=presets.LINEAR_PROBE_L2_REGS,
      holdout_fraction=0.1,
      seed=0,
      max_iter=1000,
      tol=1e-4,
      label_key="label",
      train_split="train",
      test_split="test",
      pixel_baseline=False,
  ):
    self.holdout_fraction = float(holdout_fraction)
    self.l2_regs = tuple(
        float(r) for r in ridge.check_l2_regs(l2_regs, allow_zero=True)
    )
    self.seed, self.max_iter = int(seed), int(max_iter)
    # Gradient-norm tolerance of the mean loss (scikit-learn's lbfgs default is
    # 1e-4 too); weakly penalised fits would otherwise run to max_iter.
    self.tol = float(tol)
    super().__init__(
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
    )

  def _features(self, extractor, params, name):
    train_cfg, test_cfg, pp = self.datasets[name]
    return [
        self.split_features(extractor, params, cfg, pp)
        for cfg in (train_cfg, test_cfg)
    ]

  def _fit(self, x, y, num_classes, l2s, weights, start, on_fit):
    """logistic.fit along `l2s`; running out of device memory is one line."""
    try:
      return logistic.fit(
          x,
          y,
          num_classes,
          l2s,
          weights=weights,
          mesh=self.mesh,
          max_iter=self.max_iter,
          tol=self.tol,
          start=start,
          on_fit=on_fit,
      )
    except jax.errors.JaxRuntimeError as e:
      if not oom.is_oom(e):
        raise
      # Not the eval batch size: L-BFGS keeps ~20 copies of the (d x classes)
      # weights, besides the features themselves.
      raise ValueError(
          f"The linear probe ran out of device memory fitting {x.shape[0]} examples x "
          f"{x.shape[1]} features, {num_classes} classes; use token_pool='mean' or "
          "another representation_layer (fewer features), or a smaller train split."
      ) from None

  def probe(self, name, x_train, y_train, x_test, y_test, num_classes):
    """The test accuracy of the probe fitted on host features (l2 picked on a held-out part).

    Logs a line per fit (the dataset, l2, L-BFGS iterations, seconds), the held-out
    accuracies and the test accuracy.
    """
    standardize = ridge.Standardizer.fit(x_train)
    x_train, x_test = standardize(x_train), standardize(x_test)
    n = len(y_train)
    best, start = 0, None
    if len(self.l2_regs) > 1:
      # Both fits use all rows with 0/1 weights (same shapes: one compilation).
      hold = np.random.default_rng(self.seed).permutation(n)[
          : max(1, int(round(self.holdout_fraction * n)))
      ]
      weights = np.ones((n,), np.float32)
      weights[hold] = 0.0

      def held_out(l2, iters, seconds):
        logging.info(
            "linear probe %s: l2=%g, %d L-BFGS iterations (%.1f s)",
            name,
            l2,
            iters,
            seconds,
        )

      kernels, biases, _ = self._fit(
          x_train, y_train, num_classes, self.l2_regs, weights, None, held_out
      )
      accs = [
          logistic.accuracy(k, b, x_train[hold], y_train[hold])
          for k, b in zip(kernels, biases)
      ]
      # Ties go to the larger penalty (the smoother model).
      best = max(range(len(accs)), key=lambda i: (accs[i], self.l2_regs[i]))
      logging.info(
          "linear probe %s: held-out accuracy per l2 %s; refitting l2=%g on "
          "all %d train examples",
          name,
          ", ".join(
              f"{l2:g}: {100 * a:.2f}%" for l2, a in zip(self.l2_regs, accs)
          ),
          self.l2_regs[best],
          n,
      )
      # The refit starts from the held-out fit of the same l2.
      start = (kernels[best], biases[best])
    l2 = self.l2_regs[best]
    (kernel,), (bias,), (iters,) = self._fit(
        x_train, y_train, num_classes, (l2,), None, start, None
    )
    acc = logistic.accuracy(kernel, bias, x_test, y_test)
    logging.info(
        "linear probe %s: test accuracy %.2f%% (l2=%g, %d L-BFGS iterations)",
        name,
        100 * acc,
        l2,
        int(iters),
    )
    return acc

  def scores(self, named_features):
    """{dataset: test accuracy} of (name, ((train x, y), (test x, y))) pairs."""
    results = {}
    for name, ((x_tr, y_tr), (x_te, y_te)) in named_features:
      test_cfg = self.datasets[name][1]
      y_tr, y_te, num_classes = fewshot.class_ids(
          y_tr,
          y_te,
          f"Linear-probe dataset {name!r} ({test_cfg['name']}, "
          f"split {test_cfg['split']!r})",
      )
      results[name] = self.probe(name, x_tr, y_tr, x_te, y_te, num_classes)
    return results
