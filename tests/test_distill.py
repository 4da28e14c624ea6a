"""Knowledge distillation in the trainer (distill.py and its hooks in train.py)."""

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.trainer import distill
from big_vit_lite.trainer import losses
from big_vit_lite import train
from big_vit_lite.models import layout
from big_vit_lite.models import vit

import checks
import train_config_tiny
from trainer_runs import read_losses

XENT = losses.get("softmax_xent")


def test_kl_loss_by_hand():
  student, teacher = np.array([[0.0, np.log(3.0)]]), np.array(
      [[np.log(3.0), 0.0]]
  )
  # softmax: student (1/4, 3/4), teacher (3/4, 1/4); KL(t || s) = 3/4 ln 3 + 1/4
  # ln(1/3)
  want = 0.75 * np.log(3.0) + 0.25 * np.log(1 / 3.0)
  np.testing.assert_allclose(
      distill.kl_loss(student, teacher, 1.0), want, rtol=1e-6
  )
  # T = 2: the logits halved (softmax (1/(1+sqrt3), ...)), times T^2 = 4.
  p_s = np.array([1, np.sqrt(3)]) / (1 + np.sqrt(3))
  p_t = p_s[::-1]
  np.testing.assert_allclose(
      distill.kl_loss(student, teacher, 2.0),
      4 * np.sum(p_t * np.log(p_t / p_s)),
      rtol=1e-6,
  )
  assert float(distill.kl_loss(teacher, teacher, 3.0)) == 0.0


def _xent(logits, labels):
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.mean(np.sum(labels * logp, -1))


def _np_kl(student, teacher):  # T = 1
  p_t = np.exp(teacher) / np.exp(teacher).sum(-1, keepdims=True)
  p_s = np.exp(student) / np.exp(student).sum(-1, keepdims=True)
  return np.mean(np.sum(p_t * np.log(p_t / p_s), -1))


def test_feature_and_token_losses_by_hand():
  """The mix: (1 - w) label loss of the class head + w KL of the distillation head (or both of
  the logits) + feature_weight * mean squared error of the projected pre-logits.
  """
  rng = np.random.default_rng(0)
  b, k, s, t = 4, 3, 5, 2
  labels = np.eye(k)[[0, 2, 1, 1]]
  teacher_logits, teacher_features = rng.normal(size=(b, k)), rng.normal(
      size=(b, t)
  )
  batch = dict(
      labels=labels,
      teacher_logits=teacher_logits,
      teacher_features=teacher_features,
  )
  proj = dict(kernel=rng.normal(size=(s, t)), bias=rng.normal(size=t))
  out = dict(
      logits=rng.normal(size=(b, k)),
      logits_cls=rng.normal(size=(b, k)),
      logits_dist=rng.normal(size=(b, k)),
      pre_logits=rng.normal(size=(b, s)),
  )
  teacher = distill.Teacher(None, None, 0.25, 1.0, feature_weight=3.0)
  mse = np.mean(
      (out["pre_logits"] @ proj["kernel"] + proj["bias"] - teacher_features)
      ** 2
  )
  want = (
      0.75 * _xent(out["logits_cls"], labels)
      + 0.25 * _np_kl(out["logits_dist"], teacher_logits)
      + 3.0 * mse
  )
  got = teacher.loss(XENT, {distill.PROJ: proj}, out, batch)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # Without a token, the logits take both terms; without features, no MSE.
  plain = {"logits": out["logits"], "pre_logits": out["pre_logits"]}
  teacher.feature_weight = 0.0
  want = 0.75 * _xent(out["logits"], labels) + 0.25 * _np_kl(
      out["logits"], teacher_logits
  )
  np.testing.assert_allclose(
      teacher.loss(XENT, {}, plain, batch), want, rtol=1e-5
  )


def test_projection_is_seeded_and_leaves_the_model_params_alone():
  model = checks.tiny_vit()

  def init(rng):
    return model.init(rng, np.zeros((1, 16, 16, 3), np.float32))["params"]

  teacher = distill.Teacher(
      None, None, 0.5, 1.0, feature_weight=1.0, feature_widths=(32, 48)
  )
  rng = jax.random.key(3)
  with_proj = nn.meta.unbox(teacher.with_projection(init)(rng))
  proj = with_proj.pop(distill.PROJ)
  assert proj["kernel"].shape == (32, 48) and not np.any(proj["bias"])
  checks.assert_same_params(with_proj, nn.meta.unbox(init(rng)))
  again = nn.meta.unbox(teacher.with_projection(init)(rng))[distill.PROJ]
  np.testing.assert_array_equal(again["kernel"], proj["kernel"])
  other = nn.meta.unbox(teacher.with_projection(init)(jax.random.key(4)))
  assert np.abs(other[distill.PROJ]["kernel"] - proj["kernel"]).max() > 0.1
  # Off: the init itself, no projection.
  teacher.feature_weight = 0.0
  assert teacher.with_projection(init) is init


def _teacher_npz(tmp_path, **kw):
  """The tiny config's model with random params, as an .npz; returns (path, params)."""
  model_cfg = dict(train_config_tiny.get_config().model, dropout=0.0, **kw)
  model = vit.Model(**model_cfg)
  params = jax.jit(model.init)(
      jax.random.key(5), np.zeros((1, 28, 28, 1), np.float32)
  )["params"]
  vit.save_npz(params, tmp_path / "teacher.npz")
  return str(tmp_path / "teacher.npz")


def _config(data_dir, **overrides):
  config = train_config_tiny.get_config()
  config.input.data.data_dir = data_dir
  config.model.dropout = 0.0
  return checks.set_dotted(config, overrides)


@pytest.mark.slow
def test_teacher_sees_the_students_augmented_batch(tfds_data_dir, tmp_path):
  """Student initialised as the teacher, weight 1: the first step's loss is KL(t || t) = 0,
  with random shifts and flips in the step and mixup: the teacher got the same images.
  """
  teacher = _teacher_npz(tmp_path)
  config = _config(
      tfds_data_dir,
      total_steps=3,
      ckpt_steps=3,
      model_init=teacher,
      mixup=dict(mixup_alpha=1.0),
  )
  config.distill = ml_collections.ConfigDict(
      dict(teacher=teacher, weight=1.0, temperature=2.0)
  )
  train.train(config, str(tmp_path / "run"))
  losses = read_losses(str(tmp_path / "run"))
  assert abs(losses[1]) < 1e-6, losses
  # The teacher is not in the student's checkpoint: its params are the student's
  # tree.
  params, _ = checkpoint.load_params(str(tmp_path / "run"))
  with np.load(teacher) as f:
    assert set(layout.flatten(params)) == set(f.files)


@pytest.mark.slow
@pytest.mark.parametrize("student", ["plain", "token_feature"])
def test_distill_resume_is_bit_exact(tfds_data_dir, tmp_path, student):
  # a different (bigger) teacher
  teacher = _teacher_npz(tmp_path, width=32, num_heads=4)
  # A student with a distillation token and feature distillation: its
  # projection (16 -> 32) in the state.
  extra = student == "token_feature"

  def cfg(steps):
    config = _config(tfds_data_dir, total_steps=steps, ckpt_steps=2)
    config.distill = ml_collections.ConfigDict(
        dict(teacher=teacher, temperature=2.0)
    )
    if extra:
      config.distill.feature_weight = 0.5
      config.model.update(distill_token=True, pool_type="tok")
    return config

  train.train(cfg(4), str(tmp_path / "straight"))
  without = cfg(1)
  del without.distill
  train.train(without, str(tmp_path / "no_teacher"))
  # The teacher changes the loss (weight 0.5: half the xent plus half a non-zero
  # KL).
  assert (
      read_losses(str(tmp_path / "straight"))[1]
      != read_losses(str(tmp_path / "no_teacher"))[1]
  )
  train.train(cfg(2), str(tmp_path / "resumed"))
  train.train(cfg(4), str(tmp_path / "resumed"))
  assert read_losses(str(tmp_path / "resumed")) == read_losses(
      str(tmp_path / "straight")
  )
  resumed = checkpoint.load_params(str(tmp_path / "resumed"))[0]
  checks.assert_same_params(
      resumed, checkpoint.load_params(str(tmp_path / "straight"))[0]
  )
  assert (distill.PROJ in resumed) == extra
  if extra:  # trained: no longer its init (bias zeros)
    assert resumed[distill.PROJ]["kernel"].shape == (16, 32)
    assert np.abs(resumed[distill.PROJ]["bias"]).max() > 0
    assert "head_dist" in resumed


@pytest.mark.parametrize(
    "teacher_kw,distill_kw,words",
    [
        (dict(num_classes=5), {}, ("5 classes", "the student 10")),
        (dict(patch_size=4), {}, ("takes 16x16x1", "28x28x1")),
        ({}, dict(temp=2.0), ("config.distill.temp", "temperature")),
        ({}, dict(weight=1.5), ("weight=1.5", "[0, 1]")),
        ({}, dict(feature_weight=-1.0), ("feature_weight=-1.0", ">= 0")),
    ],
)
def test_distill_config_errors_are_one_line(
    tfds_data_dir, tmp_path, teacher_kw, distill_kw, words
):
  if "patch_size" in teacher_kw:  # a teacher trained on 16x16 images
    params = checks.vit_params(hw=(16, 16), channels=1)
    vit.save_npz(params, tmp_path / "teacher.npz")
    teacher = str(tmp_path / "teacher.npz")
  else:
    teacher = _teacher_npz(tmp_path, **teacher_kw)
  config = _config(tfds_data_dir, total_steps=1)
  config.distill = ml_collections.ConfigDict(
      dict(teacher=teacher, **distill_kw)
  )
  checks.one_line_error(
      lambda: train.train(config, str(tmp_path / "run")), *words
  )
