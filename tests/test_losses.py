"""Losses take one-hot float labels shaped like the logits, and say so otherwise."""
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite import losses


@pytest.mark.parametrize("name", ["softmax_xent", "sigmoid_xent"])
def test_integer_or_misshaped_labels_are_a_one_line_error(name):
  fn = losses.get(name)
  logits = jnp.zeros((10, 10))
  # Class ids: a batch of 10 with 10 classes would broadcast and train on nonsense.
  with pytest.raises(ValueError, match=r"labels are int32\[10\] but the logits are \[10, 10\].*"
                                       r"onehot\(10, key='label', key_result='labels'\)"):
    fn(logits, jnp.arange(10))
  with pytest.raises(ValueError, match=r"labels are float32\[10, 5\]"):
    fn(logits, jnp.zeros((10, 5)))


def test_values():
  logits = jnp.array([[0.0, np.log(3.0)]])
  labels = jnp.array([[0.0, 1.0]])
  np.testing.assert_allclose(losses.softmax_xent(logits, labels), -np.log(0.75), rtol=1e-6)
  np.testing.assert_allclose(losses.sigmoid_xent(jnp.zeros((2, 3)), jnp.ones((2, 3))),
                             3 * np.log(2.0), rtol=1e-6)
