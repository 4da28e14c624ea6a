"""Classification accuracy and loss of the model's own head over a whole split.

Reports "prec@1" (the top-scoring class is a positive label), "prec@5" when
there are more than 5 classes, and the mean "loss" (softmax or sigmoid
cross-entropy, as in training). Every example of the split counts exactly
once: padding rows of the last batch have `_mask == False` and are excluded
from all sums. Sums are taken on device per batch; only scalars come back.

Labels are read from "labels" (one-hot / multi-hot, as the training pp
makes them) or, when absent, from the integer "label". A row's classes are
its largest entries, so label smoothing (onehot(..., off=0.1/K)) does not
make every prediction a hit; rows with no positive entry (ImageNet-ReaL's
images without a label) count nowhere, as in big_vision.
"""

import jax
import jax.numpy as jnp
import optax

from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import features as feats

LOSSES = ("softmax_xent", "sigmoid_xent")


def _labels(batch, num_classes):
  """(B, num_classes) float targets; a class count that differs from the head's is an error."""
  if "labels" in batch:
    # Static: raised while tracing.
    if batch["labels"].shape[-1] != num_classes:
      raise ValueError(
          f"The eval pp makes {batch['labels'].shape[-1]}-class 'labels' but the "
          f"model's head has {num_classes} outputs; use onehot({num_classes}, ...) in "
          "the pp, or evaluate a model whose head fits this dataset."
      )
    return batch["labels"].astype(jnp.float32)
  if "label" in batch:
    # Labels outside [0, num_classes) would become all-zero rows (never a hit,
    # zero loss): run() counts them and refuses the result instead.
    return jax.nn.one_hot(batch["label"], num_classes, dtype=jnp.float32)
  raise ValueError(
      "Classification eval batches need 'labels' (one-hot) or 'label' "
      f"(integer); the pp produced {sorted(batch)}."
  )


def batch_sums(logits, labels, mask, loss_name):
  """Masked sums of correct@1, correct@5, loss and example count for one batch."""
  logits = logits.astype(jnp.float32)
  top = jnp.max(labels, axis=-1, keepdims=True)
  # no positive class: not counted
  mask = mask.astype(jnp.float32) * (top[:, 0] > 0)
  positive = labels >= top  # the row's class(es), also under label smoothing
  if loss_name == "softmax_xent":
    loss = -jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1)
  else:
    loss = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, labels), axis=-1)
  top1 = jnp.argmax(logits, axis=-1)
  hit1 = jnp.take_along_axis(positive, top1[:, None], axis=-1)[:, 0]
  out = {
      "correct@1": jnp.sum(hit1 * mask),
      "loss": jnp.sum(loss * mask),
      "count": jnp.sum(mask),
      # argmax of NaN logits picks a class anyway: counted so that run()
      # refuses.
      "non_finite": jnp.sum(~jnp.all(jnp.isfinite(logits), axis=-1) * mask),
  }
  if logits.shape[-1] > 5:
    _, top5 = jax.lax.top_k(logits, 5)
    hit5 = jnp.any(jnp.take_along_axis(positive, top5, axis=-1), axis=-1)
    out["correct@5"] = jnp.sum(hit5 * mask)
  return out


class Evaluator:
  """prec@1 / prec@5 / loss of the classifier head over one split."""

  def __init__(
      self,
      predict_fn,
      *,
      mesh,
      data,
      pp,
      batch_size=256,
      loss_name="softmax_xent",
  ):
    if loss_name not in LOSSES:
      raise ValueError(f"loss_name={loss_name!r} is not one of {LOSSES}.")
    self.data = data.to_dict() if hasattr(data, "to_dict") else dict(data)
    self.mesh, self._head_size = mesh, None
    # Now: a misspelt dataset, split or pp op stops a trainer before it trains.
    self.batches = input_pipeline.make_eval_iterator(self.data, pp, batch_size)

    def sums(params, batch):
      logits, out = predict_fn(params, batch["image"])
      if (
          isinstance(out, dict)
          and "head_input" in out
          and out.get("pre_logits") is logits
      ):
        # vit.Model(num_classes=0) returns its features as "logits" (seen while
        # tracing): their argmax against the labels would be a meaningless
        # accuracy.
        raise ValueError(
            "The model has no classification head (num_classes=0), so a "
            "classification eval has nothing to score; use fewshot or "
            "linear_probe on its features, or give the model a head."
        )
      num_classes = logits.shape[-1]
      # Static, known once traced; for run()'s messages.
      self._head_size = num_classes
      out = batch_sums(
          logits, _labels(batch, num_classes), batch["_mask"], loss_name
      )
      if "labels" not in batch and "label" in batch:
        label = batch["label"]
        outside = (label < 0) | (label >= num_classes)
        out["bad_label"] = jnp.sum(outside * batch["_mask"].astype(jnp.float32))
        out["max_label"] = jnp.max(jnp.where(batch["_mask"], label, 0))
      return out

    self._sums = jax.jit(sums)

  def run(self, params):
    # Only what the forward needs (not e.g. string keys).
    wanted = ("image", "labels", "label", "_mask")
    batches = ({k: b[k] for k in wanted if k in b} for b in self.batches)
    totals, max_label = {}, 0
    for out in feats.map_batches(self._sums, params, batches, self.mesh):
      max_label = max(max_label, int(out.pop("max_label", 0)))
      for k, v in out.items():
        totals[k] = totals.get(k, 0.0) + float(v)
    if totals.get("bad_label"):
      raise ValueError(
          f"Classification eval data {self.data}: {int(totals['bad_label'])} examples "
          f"have a label outside the model's {self._head_size} classes (largest label "
          f"{max_label}); evaluate a model whose head fits this dataset."
      )
    if not totals or totals["count"] == 0:
      raise ValueError(
          f"Classification eval data {self.data} yielded no labelled examples "
          "(a row of 'labels' with no positive entry does not count); check the "
          "split and the pp."
      )
    if totals["non_finite"]:
      raise ValueError(
          f"Classification eval data {self.data}: the model's logits are NaN/inf for "
          f"{int(totals['non_finite'])} of {int(totals['count'])} examples (non-finite params "
          "or an overflow); prec@1 would be meaningless. Evaluate a finite checkpoint."
      )
    n = totals["count"]
    results = {"prec@1": totals["correct@1"] / n, "loss": totals["loss"] / n}
    if "correct@5" in totals:
      results["prec@5"] = totals["correct@5"] / n
    return results
