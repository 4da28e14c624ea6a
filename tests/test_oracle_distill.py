"""distill.kl_loss against the KL divergence written out in float64 with
scipy (rel_entr), on a batch whose rows have different divergences and a
temperature of 3 (at 2, T * 2 would be T^2), so that T against T^2, the direction of the KL, a sum over
the batch instead of a mean, or the temperature applied to one side only all
change the number.
"""

import numpy as np
import scipy.special

from big_vit_lite.trainer import distill


def test_kl_loss_is_t_squared_times_the_mean_kl_of_the_tempered_softmaxes():
  """Guards: KL(student || teacher) instead of KL(teacher || student), T or
  1 in place of T^2, no temperature on the student's or the teacher's
  logits, a sum over the batch or over the classes' mean. Oracle:
  scipy.special.rel_entr on softmaxes computed in float64."""
  rng = np.random.default_rng(0)
  student = rng.normal(size=(3, 5)) * [[1.0], [2.0], [3.0]]
  teacher = rng.normal(size=(3, 5)) * 2.0
  t = 3.0  # not 2: T * 2 == T ** 2 there
  p_teacher = scipy.special.softmax(teacher / t, axis=-1)
  p_student = scipy.special.softmax(student / t, axis=-1)
  per_row = scipy.special.rel_entr(p_teacher, p_student).sum(axis=-1)
  want = t * t * per_row.mean()
  got = distill.kl_loss(np.float32(student), np.float32(teacher), temperature=t)
  np.testing.assert_allclose(float(got), want, rtol=1e-5)
  # The reverse direction differs here by more than the tolerance.
  reverse = t * t * scipy.special.rel_entr(p_student, p_teacher).sum(-1).mean()
  assert abs(reverse - want) > 1e-2 * want
