"""distill.kl_loss against the KL divergence written out in float64 with
scipy (rel_entr), on a batch whose rows have different divergences and a
temperature of 3 (at 2, T * 2 would be T^2), so that T against T^2, the direction of the KL, a sum over
the batch instead of a mean, or the temperature applied to one side only all
change the number.

The Teacher and from_config: a teacher written as an .npz by the test and read
back through from_config (its params compared with the file, its logits with
the model's own forward), the config's checks at their edges, the targets'
dtype and stop-gradient, the loss at a temperature and weight other than 1,
the projection's logical axis names, the abstract params' dtypes and the
bound step's arguments.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import scipy.special

from big_vit_lite.models import layout
from big_vit_lite.models import vit
from big_vit_lite.runtime import sharding
from big_vit_lite.trainer import distill
from big_vit_lite.trainer import losses

import checks


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


def _teacher_file(tmp_path, **kw):
  """A tiny ViT's random params as an .npz (10 classes, 16x16x3); (path, flat params)."""
  params = checks.vit_params(seed=8, **kw)
  path = tmp_path / "teacher.npz"
  vit.save_npz(params, path)
  return str(path), layout.to_numpy_flat(params)


def _from_config(cfg, num_classes=10, image_shape=(16, 16, 3), student=None):
  mesh = sharding.make_mesh()
  rules = sharding.make_rules(None, mesh)
  return distill.from_config(
      cfg, mesh, rules, num_classes, image_shape, student or checks.tiny_vit()
  )


def test_from_config_loads_the_teacher_and_its_settings(tmp_path):
  """Guards: the config's weight or temperature not read (or read from the
  wrong key), a ConfigDict refused or copied wrong, feature distillation's
  widths not the student's and the teacher's pre-logits (rep_size) widths,
  the teacher's params or forward not the file's model. Oracle: the file the
  test wrote, and the model's own forward on those params."""
  path, flat = _teacher_file(tmp_path, rep_size=24)
  assert _from_config(None) is None
  cfg = ml_collections.ConfigDict(
      dict(teacher=path, weight=0.3, temperature=0.5)
  )
  teacher = _from_config(cfg)
  assert (teacher.weight, teacher.temperature) == (0.3, 0.5)
  assert teacher.feature_weight == 0.0 and teacher.feature_widths == ()
  checks.assert_same_params(teacher.params, layout.unflatten(flat))
  images = jax.random.uniform(jax.random.key(2), (2, 16, 16, 3))
  logits, out = teacher.predict_fn(teacher.params, images)
  want = checks.tiny_vit(rep_size=24).apply(
      {"params": layout.unflatten(flat)}, images
  )[0]
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  assert out["pre_logits"].shape == (2, 24)
  # Feature distillation: (student's, teacher's) pre-logits widths.
  teacher = _from_config(
      dict(teacher=path, feature_weight=0.0, weight=0.0, temperature=1.0)
  )
  assert teacher.feature_widths == () and teacher.weight == 0.0
  teacher = _from_config(dict(teacher=path, feature_weight=2.0, weight=1.0))
  assert teacher.feature_weight == 2.0 and teacher.temperature == 1.0
  assert teacher.feature_widths == (32, 24)
  student = checks.tiny_vit(rep_size=12)
  teacher = _from_config(
      dict(teacher=path, feature_weight=1.0), student=student
  )
  assert teacher.feature_widths == (12, 24)
  student = checks.tiny_vit(rep_size=True)
  teacher = _from_config(
      dict(teacher=path, feature_weight=1.0), student=student
  )
  assert teacher.feature_widths == (32, 24)


@pytest.mark.parametrize(
    "cfg,task,words",
    [
        (dict(temp=2.0), {}, ("config.distill.temp", "unknown key")),
        (dict(teacher=""), {}, ("no teacher",)),
        (dict(weight=1.01), {}, ("weight=1.01", "[0, 1]")),
        (dict(weight=-0.01), {}, ("weight=-0.01",)),
        (dict(temperature=0.0), {}, ("temperature=0.0", "> 0")),
        (dict(feature_weight=-0.5), {}, ("feature_weight=-0.5", ">= 0")),
        ({}, dict(num_classes=9), ("10 classes", "the student 9")),
        ({}, dict(image_shape=(32, 32, 3)), ("takes 16x16x3", "32x32x3")),
        ({}, dict(image_shape=(16, 16, 1)), ("16x16x1",)),
    ],
)
def test_from_config_refuses_a_bad_config_in_one_line(
    tmp_path, cfg, task, words
):
  """Guards: a check that lets a bad weight, temperature, feature weight,
  class count or image size through, or one that fires on a good config
  (above: a temperature below 1, a feature weight of 0, both weights at
  their ends). Oracle: the docstring's ranges."""
  path, _ = _teacher_file(tmp_path)
  full = {"teacher": path, **cfg}
  checks.one_line_error(lambda: _from_config(full, **task), *words)


def test_targets_are_the_teachers_float32_outputs_without_gradient():
  """Guards: the targets' keys renamed, features fetched without feature
  distillation (or not with it), bfloat16 targets left as they came, a
  gradient flowing into the teacher. Oracle: a hand-written predict_fn."""

  def predict_fn(params, images):
    logits = (images.sum((1, 2)) @ params["w"]).astype(jnp.bfloat16)
    return logits, {"pre_logits": logits[:, :2] * 2}

  params = {"w": jnp.arange(12.0).reshape(3, 4) / 10}
  images = jnp.ones((2, 2, 2, 3))
  teacher = distill.Teacher(params, predict_fn, 0.5, 1.0)
  got = teacher.targets(params, images)
  assert set(got) == {"teacher_logits"}
  want = np.asarray(predict_fn(params, images)[0], np.float32)
  assert got["teacher_logits"].dtype == jnp.float32
  np.testing.assert_array_equal(got["teacher_logits"], want)
  teacher.feature_weight = 1.0
  got = teacher.targets(params, images)
  assert set(got) == {"teacher_logits", "teacher_features"}
  np.testing.assert_array_equal(got["teacher_features"], want[:, :2] * 2)
  assert got["teacher_features"].dtype == jnp.float32
  grad = jax.grad(
      lambda p: sum(v.sum() for v in teacher.targets(p, images).values())
  )(params)
  assert not np.any(grad["w"])


def test_loss_at_a_temperature_and_weight_other_than_one():
  """Guards: the temperature or the weight not passed on (or swapped), the
  teacher's logits or the labels dropped, the feature term not the mean
  squared error of the projection. Oracle: scipy's rel_entr and a numpy
  cross-entropy in float64."""
  rng = np.random.default_rng(1)
  b, k, s, t = 3, 4, 5, 2
  labels = np.eye(k)[[0, 3, 1]]
  batch = dict(
      labels=labels,
      teacher_logits=rng.normal(size=(b, k)) * 2,
      teacher_features=rng.normal(size=(b, t)),
  )
  out = dict(logits=rng.normal(size=(b, k)), pre_logits=rng.normal(size=(b, s)))
  proj = dict(kernel=rng.normal(size=(s, t)), bias=rng.normal(size=t))
  temp = 3.0
  p_t = scipy.special.softmax(batch["teacher_logits"] / temp, axis=-1)
  p_s = scipy.special.softmax(out["logits"] / temp, axis=-1)
  kl = temp**2 * scipy.special.rel_entr(p_t, p_s).sum(-1).mean()
  xent = -np.mean(
      np.sum(labels * scipy.special.log_softmax(out["logits"], -1), -1)
  )
  err = out["pre_logits"] @ proj["kernel"] + proj["bias"]
  mse = np.mean((err - batch["teacher_features"]) ** 2)
  teacher = distill.Teacher(None, None, 0.2, temp, feature_weight=0.7)
  got = teacher.loss(
      losses.get("softmax_xent"), {distill.PROJ: proj}, out, batch
  )
  np.testing.assert_allclose(got, 0.8 * xent + 0.2 * kl + 0.7 * mse, rtol=1e-5)


def test_projection_axes_abstract_params_and_the_bound_step():
  """Guards: the projection's logical axis names lost (it would not shard
  with the student), its bias not zeros of the teacher's width, the abstract
  teacher params' dtype or sharding dropped (a bfloat16 teacher traced as
  float32), the bound step not given the teacher's params. Oracle: the
  values set here."""
  teacher = distill.Teacher(
      None, None, 0.5, 1.0, feature_weight=1.0, feature_widths=(4, 6)
  )
  init = teacher.with_projection(lambda rng: {"w": jnp.zeros(2)})
  params = init(jax.random.key(0))
  proj = params[distill.PROJ]
  assert proj["kernel"].names == ("embed", None)
  assert proj["bias"].names == (None,)
  assert proj["bias"].value.shape == (6,) and not np.any(proj["bias"].value)
  assert proj["kernel"].value.shape == (4, 6)
  assert set(params) == {"w", distill.PROJ}

  mesh = sharding.make_mesh()
  placed = jax.device_put(
      {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.ones((4,), jnp.int32)},
      sharding.replicated(mesh),
  )
  teacher = distill.Teacher(placed, None, 0.5, 1.0)
  abstract = teacher.abstract()
  assert abstract["a"].shape == (2, 3) and abstract["a"].dtype == jnp.bfloat16
  assert abstract["b"].dtype == jnp.int32
  assert abstract["a"].sharding == placed["a"].sharding
  calls = []
  step = teacher.bind(lambda *args: calls.append(args) or "out")
  assert step("state", "batch") == "out"
  assert calls == [("state", "batch", placed)]
