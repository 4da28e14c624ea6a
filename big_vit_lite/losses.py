"""Training losses on (logits, labels) with one-hot / multi-hot float labels.

Label smoothing is done by the pp op `onehot(..., on=0.9, off=...)`, mixup
by the trainer before the model: both produce soft labels, which these
losses take as they are.
"""
import jax
import jax.numpy as jnp
import optax


def _check(name, logits, labels):
  # Integer class ids would broadcast against the logits (and train on nonsense
  # without an error when the batch size equals the class count).
  if labels.shape != logits.shape or not jnp.issubdtype(labels.dtype, jnp.floating):
    raise ValueError(
        f"loss {name}: labels are {labels.dtype}{list(labels.shape)} but the logits are "
        f"{list(logits.shape)}: the pp must give one-hot float labels of the model's class "
        f"count, e.g. onehot({logits.shape[-1]}, key='label', key_result='labels')")


def softmax_xent(logits, labels):
  """Mean over the batch of -sum_c labels_c * log softmax(logits)_c."""
  _check("softmax_xent", logits, labels)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.sum(labels * logp, axis=-1))


def sigmoid_xent(logits, labels):
  """The ViT paper's pretraining loss: per-class binary xent, summed over classes.

  Summed (not averaged) over classes as in big_vision, so its scale does not
  shrink with the number of classes (21k for ImageNet-21k).
  """
  _check("sigmoid_xent", logits, labels)
  per_class = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), labels)
  return jnp.mean(jnp.sum(per_class, axis=-1))


LOSSES = {"softmax_xent": softmax_xent, "sigmoid_xent": sigmoid_xent}


def get(name):
  if name not in LOSSES:
    raise ValueError(f"Unknown loss '{name}': use one of {', '.join(LOSSES)}.")
  return LOSSES[name]
