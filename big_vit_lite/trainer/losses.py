"""Training losses on (logits, labels) with one-hot / multi-hot float labels.

The trainer checks that the pp gives float labels (train_setup.make_model).
Label smoothing is done by the pp op `onehot(..., on=0.9, off=...)`, mixup
by the trainer before the model: both produce soft labels, which these
losses take as they are.
"""

import jax
import jax.numpy as jnp
import optax


def softmax_xent(logits, labels):
  """Mean over the batch of -sum_c labels_c * log softmax(logits)_c."""
  return -jnp.mean(
      jnp.sum(labels * jax.nn.log_softmax(logits.astype(jnp.float32)), axis=-1)
  )


def sigmoid_xent(logits, labels):
  """The ViT paper's pretraining loss: per-class binary xent, summed over classes.

  Summed (not averaged) over classes as in big_vision, so its scale does not
  shrink with the number of classes (21k for ImageNet-21k).
  """
  per_class = optax.sigmoid_binary_cross_entropy(
      logits.astype(jnp.float32), labels
  )
  return jnp.mean(jnp.sum(per_class, axis=-1))


LOSSES = {"softmax_xent": softmax_xent, "sigmoid_xent": sigmoid_xent}


def get(name):
  if name not in LOSSES:
    raise ValueError(f"Unknown loss '{name}': use one of {', '.join(LOSSES)}.")
  return LOSSES[name]
