"""The losses' values on one-hot float labels."""

import jax.numpy as jnp
import numpy as np

from big_vit_lite.trainer import losses


def test_values():
  logits = jnp.array([[0.0, np.log(3.0)]])
  labels = jnp.array([[0.0, 1.0]])
  np.testing.assert_allclose(
      losses.softmax_xent(logits, labels), -np.log(0.75), rtol=1e-6
  )
  np.testing.assert_allclose(
      losses.sigmoid_xent(jnp.zeros((2, 3)), jnp.ones((2, 3))),
      3 * np.log(2.0),
      rtol=1e-6,
  )
