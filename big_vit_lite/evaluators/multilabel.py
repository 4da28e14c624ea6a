"""Multi-label metrics of the model's own (sigmoid) head over a whole split.

Reports
  "mAP"          mean over classes with at least one positive example of the average
                 precision of the class's scores (sklearn's average_precision_score: sum over
                 distinct score thresholds of (recall step) * precision; tied scores form one
                 threshold);
  "prec@1"       ReaL-style: the top-scoring class is in the example's set of correct labels;
                 examples with an empty set count nowhere (as ImageNet-ReaL's unlabelled ones);
  "precision", "recall"  macro averages at sigmoid(logit) > 0.5 (a class never predicted has
                 precision 0; classes without positives are left out of recall);
  "precision/C", "recall/C"  the same per class C, for heads of at most PER_CLASS_MAX classes;
  "loss"         mean sigmoid cross-entropy summed over classes (as training's sigmoid_xent).
Labels come from "labels" (k-hot, e.g. the pp `onehot(K, key='labels')` of a label list): a
row's correct classes are its largest entries when positive (so also under label smoothing).
Average precision needs every score of a class, so all logits of the split come back to the
host: examples x classes x 4 bytes (50k x 18k classes = 3.6 GB); use a subset split for heads
that large.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import features as feats

PER_CLASS_MAX = 32


def average_precision(scores, positive):
  """AP of one class: scores [N] float, positive [N] bool; NaN when there is no positive."""
  order = np.argsort(-scores, kind="stable")
  scores, positive = scores[order], positive[order]
  # The last example of each run of tied scores: one threshold per distinct
  # score.
  ends = np.flatnonzero(np.diff(scores, append=-np.inf) != 0)
  true_pos = np.cumsum(positive)[ends]
  precision = true_pos / (ends + 1)
  recall_steps = np.diff(true_pos, prepend=0) / max(int(positive.sum()), 1)
  if not positive.any():
    return float("nan")
  return float(np.sum(recall_steps * precision))


def metrics(logits, labels):
  """The metrics above from host arrays logits [N, C] and k-hot labels [N, C]."""
  positive = (labels > 0) & (labels >= labels.max(axis=1, keepdims=True))
  num_classes = logits.shape[1]
  per_class_ap = [
      average_precision(logits[:, c], positive[:, c])
      for c in range(num_classes)
  ]
  has_positive = positive.any(axis=0)
  predicted = logits > 0
  true_pos = np.sum(predicted & positive, axis=0)
  precision = true_pos / np.maximum(predicted.sum(axis=0), 1)
  recall = true_pos / np.maximum(positive.sum(axis=0), 1)
  labelled = positive.any(axis=1)
  top1_correct = positive[np.arange(len(logits)), np.argmax(logits, axis=1)]
  out = {
      "mAP": float(np.nanmean(per_class_ap)),
      "prec@1": float(top1_correct[labelled].mean()),
      "precision": float(precision.mean()),
      "recall": float(recall[has_positive].mean()),
  }
  if num_classes <= PER_CLASS_MAX:
    for c in range(num_classes):
      out[f"precision/{c}"] = float(precision[c])
      out[f"recall/{c}"] = float(recall[c])
  return out


class Evaluator:
  """mAP, ReaL-style prec@1, precision/recall and loss of a multi-label head over one split."""

  def __init__(self, predict_fn, *, mesh, data, pp, batch_size=256):
    self.data = data.to_dict() if hasattr(data, "to_dict") else dict(data)
    self.mesh = mesh
    self.batches = input_pipeline.make_eval_iterator(self.data, pp, batch_size)

    def outputs(params, batch):
      logits, _ = predict_fn(params, batch["image"])
      # Static: raised while tracing.
      if batch["labels"].shape[-1] != logits.shape[-1]:
        raise ValueError(
            f"The eval pp makes {batch['labels'].shape[-1]}-class 'labels' but the "
            f"model's head has {logits.shape[-1]} outputs; use "
            f"onehot({logits.shape[-1]}, key='labels') in the pp."
        )
      return {
          "logits": logits.astype(jnp.float32),
          "labels": batch["labels"],
          "mask": batch["_mask"],
      }

    self._outputs = jax.jit(outputs)

  def _batches(self):
    for b in self.batches:
      if "labels" not in b:
        raise ValueError(
            f"multilabel eval data {self.data}: the pp makes no k-hot 'labels' "
            f"(it gives {sorted(b)}); end it with onehot(K, key='labels')|"
            f"keep('image', 'labels')"
        )
      yield {k: b[k] for k in ("image", "labels", "_mask")}

  def run(self, params):
    parts = {"logits": [], "labels": [], "mask": []}
    for out in feats.map_batches(
        self._outputs, params, self._batches(), self.mesh
    ):
      for k, v in out.items():
        parts[k].append(np.asarray(v))
    mask = np.concatenate(parts["mask"]).astype(bool)
    logits = np.concatenate(parts["logits"])[mask]
    labels = np.concatenate(parts["labels"])[mask].astype(np.float32)
    if not np.isfinite(logits).all():
      raise ValueError(
          f"multilabel eval data {self.data}: the model's logits are NaN/inf; "
          f"evaluate a finite checkpoint"
      )
    if not (labels > 0).any():
      raise ValueError(
          f"multilabel eval data {self.data} has no positive label; check the "
          f"split and the pp"
      )
    loss = optax.sigmoid_binary_cross_entropy(logits, labels)
    return {
        **metrics(logits, labels),
        "loss": float(np.mean(np.sum(loss, axis=1))),
    }
