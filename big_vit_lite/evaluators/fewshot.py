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
    examples. Every test class must be one of the train split's (labels are
    class ids >= 0).
  representation_layer: "pre_logits" (default), "logits" or any key of the
    model's `out` ("encoded", "block03", ...); token_pool: "mean" or
    "flatten" for token-shaped layers (see features.representation).
"""
import math
import weakref

from absl import logging
import jax
import numpy as np

from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import config_keys
from big_vit_lite.evaluators import features as feats
from big_vit_lite.evaluators import ridge

DEFAULT_DATASETS = {
    "mnist10k": dict(name="mnist10k"),
    "animal_mnist": dict(name="animal_mnist"),
}
DEFAULT_SHOTS = (1, 5, 10, 25)
DEFAULT_PP = "decode|value_range(-1, 1)|keep('image', 'label')"
_DATASET_KEYS_OWN = ("train_split", "test_split", "pp")


def dataset_cfgs(datasets, pp, train_split, test_split):
  """NAME -> (train data cfg, test data cfg, pp) from the `datasets` config."""
  if hasattr(datasets, "to_dict"):
    datasets = datasets.to_dict()
  if not isinstance(datasets, dict) or not datasets:
    raise ValueError("`datasets` must be a non-empty dict NAME -> dict(name=..., ...), "
                     f"got {datasets!r}.")
  out = {}
  for name, spec in datasets.items():
    if hasattr(spec, "to_dict"):
      spec = spec.to_dict()
    if (isinstance(spec, (tuple, list)) and len(spec) == 3
        and all(isinstance(v, str) for v in spec)):  # big_vision's (name, train, test)
      spec = dict(name=spec[0], train_split=spec[1], test_split=spec[2])
    if not isinstance(spec, dict) or "name" not in spec:
      raise ValueError(f"datasets[{name!r}] must be a dict with at least `name` (a tfds "
                       f"name or 'imagefolder'), got {spec!r}.")
    base = {k: v for k, v in spec.items() if k not in _DATASET_KEYS_OWN}
    out[name] = (dict(base, split=spec.get("train_split", train_split)),
                 dict(base, split=spec.get("test_split", test_split)),
                 spec.get("pp", pp))
  return out


class ParamsCache:
  """Remembers values computed for one params pytree while it stays the same.

  jax arrays are immutable, so the same leaf objects mean the same values;
  weak references avoid keeping old params alive. Numpy leaves (mutable)
  disable caching.
  """

  def __init__(self):
    self._refs = None
    self.values = {}

  def check(self, params):
    leaves = jax.tree.leaves(params)
    same = (self._refs is not None and len(leaves) == len(self._refs)
            and all(r() is leaf for r, leaf in zip(self._refs, leaves)))
    if not same:
      self.values = {}
      cacheable = all(isinstance(leaf, jax.Array) for leaf in leaves)
      self._refs = [weakref.ref(leaf) for leaf in leaves] if cacheable else None
    return self.values


def positive_ints(values, what):
  """A tuple of ints >= 1 from an int or a sequence of them (no strings, no 2.5)."""
  items = (values,) if isinstance(values, (int, np.integer)) else values
  if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
    items = None
  else:
    items = tuple(items)
  if not items or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                          and v >= 1 for v in items):
    raise ValueError(f"{what} must be positive integers, e.g. (1, 5, 10, 25); got {values!r}.")
  return tuple(dict.fromkeys(int(v) for v in items))


def positive_int(value, what):
  """An int >= 1 (not 1.5, not True, not a list)."""
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{what} must be a positive integer; got {value!r}.")
  return int(value)


def class_ids(train_labels, test_labels, what):
  """(train, test, num_classes): labels as positions among the train split's classes.

  The classifiers get one output per class the train split holds (not one
  per id up to the largest: ids need not be small or contiguous). A test
  label the train split lacks would be a class no classifier can predict:
  -1 (the "no label" of unlabelled test splits) or a class missing from the
  train split (a too small slice, a misnamed folder) stops with one line
  instead of lowering the accuracy without a word.
  """
  classes = np.unique(train_labels)
  test = np.asarray(test_labels)
  pos = np.minimum(np.searchsorted(classes, test), classes.size - 1)
  unseen = classes[pos] != test
  if np.any(unseen):
    bad = np.unique(test[unseen])
    listed = ", ".join(map(str, bad[:5].tolist())) + (", ..." if bad.size > 5 else "")
    why = ("negative labels (-1: an unlabelled split?); use a labelled test split"
           if bad.min() < 0 else
           "classes the train split lacks; use a train split holding every class (e.g. a "
           "bigger slice) or a test split without them")
    raise ValueError(f"{what}: {int(unseen.sum())} of {test.size} test examples have labels "
                     f"{listed}: {why}.")
  return np.searchsorted(classes, train_labels), pos, int(classes.size)


def sample_per_class(labels, shot, rng):
  """Indices of `shot` random examples per class (all of them if fewer)."""
  out = []
  for c in np.unique(labels):
    idx = np.flatnonzero(labels == c)
    out.append(rng.permutation(idx)[:shot])
  return np.concatenate(out)


def check_classes(train_labels, what):
  """Integer class ids, at least two classes: else the accuracy would be meaningless."""
  labels = np.asarray(train_labels)
  if labels.size and (not np.issubdtype(labels.dtype, np.integer) or labels.min() < 0):
    raise ValueError(f"{what} evaluation needs integer class ids >= 0 as labels, got "
                     f"{labels.dtype} values from {labels.min()} to {labels.max()}.")
  classes = np.unique(labels)
  if classes.size < 2:
    # One class: every prediction is that class, a "100%" that measures nothing.
    raise ValueError(f"{what} evaluation needs at least 2 classes in the train split, found "
                     f"{classes.size} ({classes.tolist()}); check the dataset and its split.")


@config_keys.checked_keys
class Evaluator:
  """Few-shot ridge evaluation on one or more datasets."""

  def __init__(self, predict_fn, *, mesh, datasets=None, pp=DEFAULT_PP,
               shots=None, num_seeds=5, representation_layer="pre_logits",
               token_pool="mean", batch_size=256, l2_regs=ridge.DEFAULT_L2_REGS,
               label_key="label", train_split="train", test_split="test"):
    self.mesh = mesh
    self.datasets = dataset_cfgs(DEFAULT_DATASETS if datasets is None else datasets,
                                 pp, train_split, test_split)
    self.default_shots = shots is None  # Adapted per dataset in _samples.
    self.shots = positive_ints(DEFAULT_SHOTS if shots is None else shots, "shots")
    self.seeds = tuple(range(positive_int(num_seeds, "num_seeds")))
    self.batch_size = feats.check_batch_size(batch_size)
    # Checked now, not after the forward passes.
    self.l2_regs = tuple(float(r) for r in ridge.check_l2_regs(l2_regs))
    self.label_key = label_key
    self.extractor = feats.FeatureExtractor(predict_fn, mesh, representation_layer,
                                            token_pool)
    self._cache = ParamsCache()
    # Now, not at the first run: a dataset with too few examples for `shots`
    # (or a wrong split or pp op) stops the trainer before it trains.
    for train_cfg, test_cfg, dataset_pp in self.datasets.values():
      feats.check_data(train_cfg, dataset_pp)
      feats.check_data(test_cfg, dataset_pp)
    self._plans = {name: self._plan(name) for name in self.datasets}

  # ------------------------------------------------------------------ data

  def _train_labels(self, data_cfg):
    """All processes' labels of the train split: (labels (P, n), valid (P, n))."""
    labels, masks = [], []
    it = input_pipeline.make_eval_iterator(
        data_cfg, f"keep('{self.label_key}')", self.batch_size)
    for batch in it:
      labels.append(np.asarray(batch[self.label_key]))
      masks.append(np.asarray(batch["_mask"]).astype(bool))
    if not labels:
      raise ValueError(f"Few-shot train split {data_cfg} is empty.")
    return (feats.gather_local(np.concatenate(labels)),
            feats.gather_local(np.concatenate(masks)))

  def _samples(self, labels, what):
    """({(seed, shot): ids} nested per seed, over valid global example ids; the shots used)."""
    ids = np.arange(labels.shape[0])
    check_classes(labels, "Few-shot")
    classes, counts = np.unique(labels, return_counts=True)  # (not bincount: ids may be huge)
    fewest = np.argmin(counts)
    shots = self.shots
    if counts[fewest] < max(shots) and self.default_shots:
      shots = tuple(s for s in shots if s <= counts[fewest])
      logging.warning("Few-shot %s: class %s has only %d train examples: skipping the default "
                      "%s (set `shots` to choose the counts).", what, classes[fewest],
                      counts[fewest], ", ".join(f"{s}-shot" for s in self.shots if s not in shots))
    elif counts[fewest] < max(shots):
      raise ValueError(
          f"Few-shot {what}: class {classes[fewest]} has only {counts[fewest]} train examples, "
          f"too few for {max(shots)}-shot; lower `shots` to at most {counts[fewest]} or "
          "use a bigger train split.")
    out = {}
    for seed in self.seeds:
      order = sample_per_class(labels, max(shots), np.random.default_rng(seed))
      # Re-split the per-class prefix: the first `shot` of each class.
      for shot in shots:
        chosen = []
        for c in np.unique(labels):
          in_c = order[labels[order] == c]
          chosen.append(in_c[:shot])
        out[seed, shot] = ids[np.concatenate(chosen)]
    return out, shots

  def _plan(self, name):
    """The train labels of dataset `name` and its samples (as global example ids)."""
    train_cfg = self.datasets[name][0]
    labels_pn, valid_pn = self._train_labels(train_cfg)
    gid = np.arange(labels_pn.size).reshape(labels_pn.shape)
    valid_ids = gid[valid_pn]
    valid_labels = labels_pn[valid_pn]
    samples, shots = self._samples(valid_labels, f"dataset {name!r} ({train_cfg['name']}, split "
                                          f"{train_cfg['split']!r})")
    # Sample positions index valid_ids; map them to global ids (process, row).
    return dict(labels_pn=labels_pn, train_labels=valid_labels, shots=shots,
                samples={k: valid_ids[v] for k, v in samples.items()})

  def _features(self, params, name):
    train_cfg, test_cfg, pp = self.datasets[name]
    plan = self._plans[name]
    labels_pn, samples = plan["labels_pn"], plan["samples"]
    nproc, n_local = labels_pn.shape
    wanted_global = np.unique(np.concatenate(list(samples.values())))
    counts = np.bincount(wanted_global // n_local, minlength=nproc)
    local_bs = self.batch_size // nproc
    num_batches = max(1, math.ceil(counts.max() / local_bs))
    me = jax.process_index()
    mine = wanted_global[wanted_global // n_local == me]
    wanted = {int(g - me * n_local): int(g) for g in mine}
    batches = feats.select_batches(
        input_pipeline.make_eval_iterator(train_cfg, pp, self.batch_size),
        wanted, local_bs, num_batches, keys=("image", self.label_key))
    train = self.extractor(params, batches, keys=(self.label_key, "_id"))
    row_of = {int(g): i for i, g in enumerate(train["_id"])}
    flat_labels = labels_pn.reshape(-1)
    if len(row_of) != wanted_global.size or np.any(
        train[self.label_key] != flat_labels[train["_id"]]):
      raise RuntimeError(f"{name}: the train split was not read in the same order twice; "
                         "few-shot needs a deterministic eval iterator.")
    test = self.extractor(params, input_pipeline.make_eval_iterator(
        test_cfg, pp, self.batch_size), keys=(self.label_key,))
    classes = np.unique(plan["train_labels"])
    _, test_y, num_classes = class_ids(
        classes, test[self.label_key],
        f"Few-shot dataset {name!r} ({test_cfg['name']}, split {test_cfg['split']!r})")
    return dict(train_x=train["feature"], train_y=np.searchsorted(classes, train[self.label_key]),
                rows={k: np.array([row_of[int(g)] for g in v]) for k, v in samples.items()},
                test_x=test["feature"], test_y=test_y, num_classes=num_classes)

  # ------------------------------------------------------------------ eval

  def run(self, params):
    cache = self._cache.check(params)
    results = {}
    for name in self.datasets:
      if name not in cache:
        cache[name] = self._features(params, name)
      f = cache[name]
      for shot in self._plans[name]["shots"]:
        accs = []
        for seed in self.seeds:
          rows = f["rows"][seed, shot]
          acc, fit = ridge.fit_and_score(
              f["train_x"][rows], f["train_y"][rows], f["test_x"], f["test_y"],
              f["num_classes"], self.l2_regs)
          accs.append(acc)
          logging.info("fewshot %s %d-shot seed %d: %.4f (l2=%g)", name, shot, seed,
                       acc, fit.l2)
        results[f"{name}_{shot}shot"] = float(np.mean(accs))
    return results
