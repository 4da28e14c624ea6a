"""Few-shot linear evaluation: closed-form ridge on frozen features.

The protocol of the ViT paper (and big_vision's `fewshot` evaluator): for
each dataset, shot count k and seed, take k random training examples per
class, fit a ridge regression from their standardised representation to
{-1, +1} one-hot targets and report the test accuracy; the metric
f"{dataset}_{k}shot" is the mean over seeds.

What differs from big_vision:
- Only the sampled training examples are forwarded. A first pass reads the
  labels alone, the samples of every (seed, shot) are drawn from them (nested:
  the 5-shot sample of a seed contains its 1-shot sample), and a second pass
  forwards just their union (at most max(shots) x classes x seeds images)
  plus the test split.
- The l2 penalty is chosen per fit by exact leave-one-out accuracy on the
  sampled training examples (see ridge.py), never on the test split.
- The labels pass and the samples depend on the data alone: they are done
  once, when the evaluator is built, so that a shot count above a class's
  train examples fails then (before training or any forward pass) instead of
  reporting a "25shot" that used fewer examples.
- Features are computed once per dataset per `run`, and reused by later runs
  only while the params are the very same (immutable) arrays.

Config (evals.NAME minus type/log_steps):
  datasets: {NAME: dict(name=TFDS_NAME, data_dir=None, [train_split], [test_split], [pp])};
    big_vision's {NAME: (TFDS_NAME, TRAIN_SPLIT, TEST_SPLIT)} also works.
  pp: preprocessing of both splits; must keep "image" and the integer label.
  shots, num_seeds: k-shot settings and seeds. Unset (None), shots is
    DEFAULT_SHOTS less the counts a dataset cannot supply (one warning names
    them); set, every class of each train split needs at least max(shots)
    examples. Every test class must be one of the train split's (at least 2).
  representation_layer: "pre_logits" (default), "logits" or any key of the
    model's `out` ("encoded", "block03", ...); token_pool: "mean" or
    "flatten" for token-shaped layers (see features.representation).
  pixel_baseline: True also reports the same protocol (the same samples and
    l2 grid) on the pp's images, flattened, as f"{dataset}_{k}shot_pixels":
    computed once per run (see features.DatasetsEvaluator).
"""

import dataclasses
import math

from absl import logging
import jax
import numpy as np

from big_vit_lite.data import count
from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import features as feats
from big_vit_lite.evaluators import ridge

DEFAULT_SHOTS = (1, 5, 10, 25)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """One dataset's train labels and samples, drawn once from the labels alone."""

  labels_pn: np.ndarray  # (processes, rows per process), padding rows too
  train_labels: np.ndarray  # the valid labels, in global example order
  shots: tuple  # the shot counts this dataset supplies
  samples: dict  # (seed, shot) -> the global example ids of that sample


@dataclasses.dataclass(frozen=True)
class _Features:
  """One dataset's features for one params: the sampled train rows and the test split."""

  train_x: np.ndarray  # features of the union of all samples
  train_y: np.ndarray  # their class positions (see class_ids)
  rows: dict  # (seed, shot) -> the rows of train_x of that sample
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int


def class_ids(train_labels, test_labels, what):
  """(train, test, num_classes): labels as positions among the train split's classes.

  The classifiers get one output per class the train split holds (not one
  per id up to the largest: ids need not be small or contiguous). A test
  label the train split lacks would be a class no classifier can predict:
  -1 (the "no label" of unlabelled test splits) or a class missing from the
  train split (a too small slice, a misnamed folder) stops with one line
  instead of lowering the accuracy without a word.
  """
  classes, test = np.unique(train_labels), np.asarray(test_labels)
  # Every prediction that class: a "100%" that measures nothing.
  if classes.size < 2:
    raise ValueError(
        f"{what}: the train split has {classes.size} class(es) "
        f"{classes.tolist()}; evaluation needs at least 2 classes."
    )
  pos = np.minimum(np.searchsorted(classes, test), classes.size - 1)
  unseen = classes[pos] != test
  if np.any(unseen):
    bad = np.unique(test[unseen])
    listed = ", ".join(map(str, bad[:5].tolist()))
    if bad.size > 5:
      listed += ", ..."
    if bad.min() < 0:
      why = "negative labels (-1: an unlabelled split?); use a labelled test split"
    else:
      why = (
          "classes the train split lacks; use a train split holding every "
          "class (e.g. a bigger slice) or a test split without them"
      )
    raise ValueError(
        f"{what}: {int(unseen.sum())} of {test.size} test examples have labels "
        f"{listed}: {why}."
    )
  return np.searchsorted(classes, train_labels), pos, int(classes.size)


class Evaluator(feats.DatasetsEvaluator):
  """Few-shot ridge evaluation on one or more datasets."""

  def __init__(
      self,
      predict_fn,
      *,
      mesh,
      datasets=None,
      pp=feats.DEFAULT_PP,
      shots=None,
      num_seeds=5,
      representation_layer="pre_logits",
      token_pool="mean",
      batch_size=256,
      l2_regs=ridge.DEFAULT_L2_REGS,
      label_key="label",
      train_split="train",
      test_split="test",
      pixel_baseline=False,
  ):
    self.default_shots = shots is None  # Adapted per dataset in _samples.
    if shots is None:
      shots = DEFAULT_SHOTS
    elif not isinstance(shots, (tuple, list)) or not shots:
      shots = (shots,)
    self.shots = tuple(
        dict.fromkeys(count(s, "each of shots", 1) for s in shots)
    )
    self.seeds = tuple(range(count(num_seeds, "num_seeds", 1)))
    self.l2_regs = tuple(float(r) for r in ridge.check_l2_regs(l2_regs))
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
    # Now, not at the first run: a dataset with too few examples for `shots`
    # stops the trainer before it trains.
    self._plans = {name: self._plan(name) for name in self.datasets}

  def _train_labels(self, data_cfg):
    """All processes' labels of the train split: (labels (P, n), valid (P, n))."""
    labels, masks = [], []
    for batch in input_pipeline.make_eval_iterator(
        data_cfg, f"keep('{self.label_key}')", self.batch_size
    ):
      labels.append(np.asarray(batch[self.label_key]))
      masks.append(np.asarray(batch["_mask"]).astype(bool))
    return (
        feats.gather_local(np.concatenate(labels)),
        feats.gather_local(np.concatenate(masks)),
    )

  def _samples(self, labels, what):
    """({(seed, shot): positions in labels} nested per seed; the shots used)."""
    # (not bincount: ids may be huge)
    classes, counts = np.unique(labels, return_counts=True)
    fewest = np.argmin(counts)
    shots = self.shots
    if counts[fewest] < max(shots) and self.default_shots:
      shots = tuple(s for s in shots if s <= counts[fewest])
      logging.warning(
          "Few-shot %s: class %s has only %d train examples: skipping the default "
          "%s (set `shots` to choose the counts).",
          what,
          classes[fewest],
          counts[fewest],
          ", ".join(f"{s}-shot" for s in self.shots if s not in shots),
      )
    elif counts[fewest] < max(shots):
      raise ValueError(
          f"Few-shot {what}: class {classes[fewest]} has only {counts[fewest]} train "
          f"examples, too few for {max(shots)}-shot; lower `shots` to at most "
          f"{counts[fewest]} or use a bigger train split."
      )
    out = {}
    for seed in self.seeds:
      rng = np.random.default_rng(seed)
      # The first `shot` of each class's sample of max(shots): nested samples.
      per_class = [
          rng.permutation(np.flatnonzero(labels == c))[: max(shots)]
          for c in classes
      ]
      for shot in shots:
        out[seed, shot] = np.concatenate([p[:shot] for p in per_class])
    return out, shots

  def _plan(self, name):
    """The train labels of dataset `name` and its samples (as global example ids)."""
    train_cfg = self.datasets[name][0]
    labels_pn, valid_pn = self._train_labels(train_cfg)
    # Global example id: process * rows per process + row.
    valid_ids = np.arange(labels_pn.size).reshape(labels_pn.shape)[valid_pn]
    samples, shots = self._samples(
        labels_pn[valid_pn],
        f"dataset {name!r} ({train_cfg['name']}, "
        f"split {train_cfg['split']!r})",
    )
    return _Plan(
        labels_pn=labels_pn,
        train_labels=labels_pn[valid_pn],
        shots=shots,
        samples={k: valid_ids[v] for k, v in samples.items()},
    )

  def _sampled_batches(self, name):
    """This process's batches of the sampled train examples (tagged "_id": their global id)."""
    train_cfg, _, pp = self.datasets[name]
    plan = self._plans[name]
    wanted = np.unique(np.concatenate(list(plan.samples.values())))
    nproc, n_local = plan.labels_pn.shape
    local_bs = self.batch_size // nproc
    most = np.bincount(wanted // n_local, minlength=nproc).max()
    first = jax.process_index() * n_local
    mine = wanted[wanted // n_local == jax.process_index()]
    return feats.select_batches(
        input_pipeline.make_eval_iterator(train_cfg, pp, self.batch_size),
        {int(g - first): int(g) for g in mine},
        local_bs,
        max(1, math.ceil(most / local_bs)),
        keys=("image", self.label_key),
    )

  def _features(self, extractor, params, name):
    _, test_cfg, pp = self.datasets[name]
    plan = self._plans[name]
    train = extractor(
        params, self._sampled_batches(name), keys=(self.label_key, "_id")
    )
    row_of = {int(g): i for i, g in enumerate(train["_id"])}
    test_x, test_labels = self.split_features(extractor, params, test_cfg, pp)
    classes = np.unique(plan.train_labels)
    _, test_y, num_classes = class_ids(
        classes,
        test_labels,
        f"Few-shot dataset {name!r} ({test_cfg['name']}, split {test_cfg['split']!r})",
    )
    rows = {}
    for seed_shot, ids in plan.samples.items():
      rows[seed_shot] = np.array([row_of[int(g)] for g in ids])
    return _Features(
        train_x=train["feature"],
        train_y=np.searchsorted(classes, train[self.label_key]),
        rows=rows,
        test_x=test_x,
        test_y=test_y,
        num_classes=num_classes,
    )

  def scores(self, named_features):
    """{f"{dataset}_{shot}shot": mean test accuracy over the seeds} of (name, _Features) pairs."""
    results = {}
    for name, f in named_features:
      for shot in self._plans[name].shots:
        accs = []
        for seed in self.seeds:
          rows = f.rows[seed, shot]
          acc, fit = ridge.fit_and_score(
              f.train_x[rows],
              f.train_y[rows],
              f.test_x,
              f.test_y,
              f.num_classes,
              self.l2_regs,
          )
          accs.append(acc)
          # Per seed only when verbose (--verbosity=1); the mean is the result.
          logging.debug(
              "fewshot %s %d-shot seed %d: %.4f (l2=%g)",
              name,
              shot,
              seed,
              acc,
              fit.l2,
          )
        results[f"{name}_{shot}shot"] = float(np.mean(accs))
    return results
