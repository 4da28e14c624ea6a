"""The losses against second implementations (numpy in float64, optax).

Cases are chosen so that the plausible wrong versions disagree with the right
one: a batch of several rows with different losses (a sum over the batch, or a
sum over everything, is not the mean), soft labels that are not one-hot, and
bfloat16 logits (a loss computed in bfloat16 is off by its rounding).
"""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from big_vit_lite.trainer import losses  # bfloat16 has an 8-bit mantissa: a result rounded to it is off by up to 2^-9

# relative; the float32 path is exact to ~1e-7. 1e-5 tells them apart.
RTOL = 1e-5


def _logits_and_soft_labels():
  rng = np.random.default_rng(0)
  logits = rng.normal(0.0, 3.0, size=(3, 5))
  labels = rng.dirichlet(np.ones(5), size=3)  # soft, rows sum to 1
  return logits, labels


def _np_softmax_xent(logits, labels):
  logits = logits.astype(np.float64)
  shifted = logits - logits.max(axis=-1, keepdims=True)
  log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
  return float(np.mean(-np.sum(labels * log_p, axis=-1)))


def _np_sigmoid_xent(logits, labels):
  logits = logits.astype(np.float64)
  # log(1 + exp(-x)) for the positive part, log(1 + exp(x)) for the negative.
  per_class = labels * np.logaddexp(0.0, -logits) + (1 - labels) * np.logaddexp(
      0.0, logits
  )
  return float(np.mean(np.sum(per_class, axis=-1)))


def test_softmax_xent_is_batch_mean_of_soft_label_xent():
  """Guards: softmax xent summed over the batch or over all axes (not the
  batch mean), or the wrong sign/normaliser, with soft labels."""
  logits, labels = _logits_and_soft_labels()
  want = _np_softmax_xent(logits, labels)
  got = losses.softmax_xent(jnp.asarray(logits), jnp.asarray(labels))
  np.testing.assert_allclose(float(got), want, rtol=RTOL)
  # optax as a second, independent implementation of the same number.
  np.testing.assert_allclose(
      float(jnp.mean(optax.softmax_cross_entropy(logits, labels))),
      want,
      rtol=RTOL,
  )


def test_sigmoid_xent_sums_classes_and_averages_batch():
  """Guards: sigmoid xent averaged over classes (1/C the scale big_vision
  uses), summed over the batch, or over all axes; multi-hot labels."""
  rng = np.random.default_rng(1)
  logits = rng.normal(0.0, 3.0, size=(3, 4))
  labels = (rng.random((3, 4)) < 0.5).astype(np.float64)
  labels[0] = [1.0, 0.0, 0.5, 0.25]  # soft labels too
  want = _np_sigmoid_xent(logits, labels)
  got = losses.sigmoid_xent(jnp.asarray(logits), jnp.asarray(labels))
  np.testing.assert_allclose(float(got), want, rtol=RTOL)


@pytest.mark.parametrize("name", ["softmax_xent", "sigmoid_xent"])
def test_bfloat16_logits_are_upcast_before_the_loss(name):
  """Guards: the loss computed in the logits' bfloat16 (the float32 upcast
  dropped): bf16 rounding moves the loss by ~1e-3, far above RTOL."""
  logits, labels = _logits_and_soft_labels()
  logits = logits * 7.0 + 40.0  # large logits: bf16 log-sum-exp rounds badly
  bf16 = jnp.asarray(logits, dtype=jnp.bfloat16)
  # The oracle sees the same bf16-rounded inputs, computed in float64.
  exact_inputs = np.asarray(bf16.astype(jnp.float32), dtype=np.float64)
  oracle = {"softmax_xent": _np_softmax_xent, "sigmoid_xent": _np_sigmoid_xent}
  want = oracle[name](exact_inputs, labels)
  got = losses.get(name)(bf16, jnp.asarray(labels, dtype=jnp.float32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(float(got), want, rtol=RTOL)


def test_get_returns_the_named_loss_and_rejects_unknown_names():
  """Guards: `losses.get` inverted or with a broken error (a config's loss
  name silently mapped to the other loss, or an unreadable error)."""
  assert losses.get("softmax_xent") is losses.softmax_xent
  assert losses.get("sigmoid_xent") is losses.sigmoid_xent
  with pytest.raises(
      ValueError,
      match=r"^Unknown loss 'l2': use one of softmax_xent, sigmoid_xent\.$",
  ):
    losses.get("l2")
