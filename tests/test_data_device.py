"""Device side: global arrays from host batches, prefetch state, mixup/cutmix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.data import device, mixup


def _mesh():
  return jax.make_mesh(
      (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )


class _Counter:
  """A stand-in for TrainIterator: batch i holds i; state = batches consumed."""

  def __init__(self, n=10):
    self.i, self.n = 0, n

  def __iter__(self):
    return self

  def __next__(self):
    if self.i >= self.n:
      raise StopIteration
    self.i += 1
    return {"x": np.full((2 * jax.device_count(), 3), self.i, np.float32)}

  def get_state(self):
    return {"step": self.i}


def test_put_batch_shards_on_batch_axes():
  mesh = _mesh()
  out = device.put_batch(
      {"image": np.ones((4, 2, 2, 3), np.float32), "labels": np.arange(4)}, mesh
  )
  assert out["image"].shape == (4, 2, 2, 3)
  assert out["image"].sharding.spec == jax.sharding.PartitionSpec(("data",))
  np.testing.assert_array_equal(np.asarray(out["labels"]), np.arange(4))
  with pytest.raises(ValueError, match="keep"):
    device.put_batch({"file_name": np.array([b"a", b"b"])}, mesh)


@pytest.mark.parametrize("size", [0, 3])
def test_prefetch_state_is_that_of_the_last_returned_batch(size):
  src = _Counter()
  pf = device.prefetch(src, size, _mesh())
  first = [float(next(pf)["x"][0, 0]) for _ in range(4)]
  assert first == [1, 2, 3, 4]
  assert pf.get_state() == {"step": 4}  # even though the thread ran ahead
  rest = [float(b["x"][0, 0]) for b in pf]
  assert rest == [5, 6, 7, 8, 9, 10]
  pf.close()


@pytest.mark.timeout(60)
def test_prefetch_reraises_source_errors():
  def bad():
    yield {"x": np.zeros((jax.device_count(),), np.float32)}
    raise RuntimeError("disk on fire")

  pf = device.prefetch(bad(), 2, _mesh())
  next(pf)
  with pytest.raises(RuntimeError, match="disk on fire"):
    next(pf)
  # again, instead of hanging
  with pytest.raises(RuntimeError, match="disk on fire"):
    next(pf)


def test_mixup_and_cutmix_mix_labels_consistently():
  rng = jax.random.key(0)
  images = jnp.stack([jnp.full((8, 8, 3), float(i)) for i in range(4)])
  labels = jax.nn.one_hot(jnp.arange(4), 4)

  @jax.jit  # one program for all three (compiles dominate on CPU)
  def run(rng, images, labels):
    cut_rng = jax.random.fold_in(rng, 3)
    return (
        mixup.mixup(rng, images, labels),
        mixup.cutmix(cut_rng, images, labels),
        mixup.mixup_or_cutmix(
            rng, images, labels, mixup_alpha=0.2, cutmix_alpha=1.0
        ),
    )

  (mi, ml), (ci, cl), (_, bl) = run(rng, images, labels)
  np.testing.assert_allclose(ml.sum(-1), 1, atol=1e-6)
  lam = float(ml[1, 1])
  assert 0.5 <= lam <= 1
  np.testing.assert_allclose(mi[1], lam * 1 + (1 - lam) * 0, atol=1e-5)
  # The label weight of the pasted neighbour equals the pasted pixel fraction.
  pasted = float(jnp.mean(ci[1, ..., 0] == 0.0))
  assert 0 < pasted < 1  # (this rng pastes a real box)
  np.testing.assert_allclose(cl[1, 0], pasted, atol=1e-6)
  np.testing.assert_allclose(cl.sum(-1), 1, atol=1e-6)
  np.testing.assert_allclose(bl.sum(-1), 1, atol=1e-6)
  same = mixup.mixup_or_cutmix(rng, images, labels)
  assert same[0] is images


def test_mixup_refuses_integer_labels():
  # Mixed class ids (lam*3 + (1-lam)*7 -> 4) would be silently wrong targets.
  images, ids = jnp.zeros((4, 8, 8, 3)), jnp.arange(4)
  for fn in (mixup.mixup, mixup.cutmix):
    with pytest.raises(ValueError, match="one-hot"):
      fn(jax.random.key(0), images, ids)
  with pytest.raises(ValueError, match="onehot"):
    mixup.mixup_or_cutmix(jax.random.key(0), images, ids, mixup_alpha=0.2)
