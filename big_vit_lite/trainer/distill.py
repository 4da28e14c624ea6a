"""Knowledge distillation in the trainer: a frozen teacher's logits as a second target.

  config.distill = dict(teacher=SRC, weight=0.5, temperature=1.0, params="params",
                        feature_weight=0.0)

SRC is anything `evaluate` loads (a training workdir, an orbax step directory, a
vision_transformer/big_vision .npz, a timm .safetensors); params="ema" takes a
training checkpoint's EMA weights. The teacher runs in inference mode inside the
jitted step, on the very images the student gets (same crops, same mixup: big_vision's
"consistent" distillation); its params are sharded by the same logical rules as the
student's and passed to the step as an argument, so they are not in the state and
never in the student's checkpoint. The loss is

  (1 - weight) * label_loss + weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))
      + feature_weight * mean((proj(student_pre_logits) - teacher_pre_logits)^2)

averaged over the batch (Hinton et al. 2015; T^2 keeps the gradient scale as T grows).

Feature distillation (feature_weight > 0; 0, the default, is off) matches the pooled
pre-logits by mean squared error, as timm's FeatureDistillationTask does (not cosine: the
teacher's features come out of its final norm, so their scale is fixed and a match in
magnitude is a real target, not noise). The student's features go through a learned
linear projection to the teacher's width, params["distill_proj"]/{kernel, bias}: it is
in the train state (trained by the optimizer, in the checkpoint, EMA'd, resumed) only
when feature distillation is on, initialised from the run's init rng; loaders drop it
(layout.merge), so the student evaluates and exports as the plain model.

A student with a distillation token (vit.Model(distill_token=True), DeiT) learns the
labels with its class head ("logits_cls") and the teacher with its distillation head
("logits_dist"); its logits at inference are their mean.
User guide: docs/distillation.md.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from big_vit_lite.config import config_loading

_DEFAULTS = dict(
    weight=0.5, temperature=1.0, params="params", feature_weight=0.0
)
PROJ = "distill_proj"  # the feature projection's key in the student's params


def kl_loss(student_logits, teacher_logits, temperature):
  """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the batch."""
  t = jax.nn.log_softmax(
      teacher_logits.astype(jnp.float32) / temperature, axis=-1
  )
  s = jax.nn.log_softmax(
      student_logits.astype(jnp.float32) / temperature, axis=-1
  )
  return temperature**2 * jnp.mean(jnp.sum(jnp.exp(t) * (t - s), axis=-1))


@dataclasses.dataclass
class Teacher:
  """A loaded teacher and the loss mix; the trainer's hooks are `targets`, `loss` and `bind`."""

  params: object  # on the mesh, sharded like a student's
  # models.loading.make_predict_fn's: (params, images) -> (logits, out)
  predict_fn: object
  weight: float
  temperature: float
  feature_weight: float = 0.0
  # (student, teacher) pre-logits widths: the projection's shape
  feature_widths: tuple = ()

  def targets(self, params, images):
    """The teacher's logits (and features) on the step's (augmented) images, joining the batch."""
    logits, out = self.predict_fn(params, images)
    targets = {"teacher_logits": logits}
    if self.feature_weight:
      targets["teacher_features"] = out["pre_logits"]
    return {
        k: jax.lax.stop_gradient(v.astype(jnp.float32))
        for k, v in targets.items()
    }

  def loss(self, loss_fn, params, out, batch):
    """The step's loss from the student's `out` (model.apply's) and the batch with targets.

    loss_fn(logits, labels): the label loss. A distillation-token student's class head
    learns the labels and its distillation head the teacher; others' logits learn both.
    """
    label_loss = loss_fn(out.get("logits_cls", out["logits"]), batch["labels"])
    distill = kl_loss(
        out.get("logits_dist", out["logits"]),
        batch["teacher_logits"],
        self.temperature,
    )
    loss = (1.0 - self.weight) * label_loss + self.weight * distill
    if self.feature_weight:
      proj = params[PROJ]
      student = out["pre_logits"].astype(jnp.float32) @ proj["kernel"]
      err = student + proj["bias"] - batch["teacher_features"]
      loss += self.feature_weight * jnp.mean(jnp.square(err))
    return loss

  def with_projection(self, init_params):
    """The student's init (rng -> boxed params), plus params[PROJ] with feature distillation.

    The projection is Dense-initialised (lecun normal kernel, zero bias) from its own key
    folded out of the init rng, so the model's params are those of a run without it.
    """
    if not self.feature_weight:
      return init_params
    s, t = self.feature_widths

    def init(rng):
      kernel = nn.initializers.lecun_normal()(
          jax.random.fold_in(rng, 0xD157), (s, t), jnp.float32
      )
      proj = dict(
          kernel=nn.LogicallyPartitioned(kernel, names=("embed", None)),
          bias=nn.LogicallyPartitioned(
              jnp.zeros((t,), jnp.float32), names=(None,)
          ),
      )
      return dict(init_params(rng), **{PROJ: proj})

    return init

  def abstract(self):
    """The params as ShapeDtypeStructs with their shardings (the step's third argument)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        self.params,
    )

  def bind(self, compiled):
    """compiled(state, batch, teacher_params) -> step(state, batch), as the loop calls it."""
    return lambda state, batch: compiled(state, batch, self.params)


def _feature_width(model) -> int:
  """The width of a vit.Model's pre-logits: its rep_size's, else the model's."""
  if model.rep_size and model.rep_size is not True:
    return int(model.rep_size)
  return model.arch()["width"]


def from_config(
    cfg, mesh, rules, num_classes: int, image_shape, student=None, place=True
) -> Teacher | None:
  """The teacher of config.distill (None without one), checked against the student's task.

  student: the student's vit.Model (its feature width, for feature distillation);
  place=False: the teacher's params stay ShapeDtypeStructs with their shardings (`plan`).
  """
  if cfg is None:
    return None
  cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  if unknown := sorted(set(cfg) - set(_DEFAULTS) - {"teacher"}):
    raise ValueError(
        f"config.distill.{unknown[0]}: unknown key; use teacher, "
        f"{', '.join(_DEFAULTS)}."
    )
  cfg = dict(_DEFAULTS, **cfg)
  if not cfg.get("teacher"):
    raise ValueError(
        "config.distill has no teacher: set config.distill.teacher to a workdir, "
        "step directory, .npz or .safetensors."
    )
  if (
      not 0.0 <= cfg["weight"] <= 1.0
      or cfg["temperature"] <= 0
      or cfg["feature_weight"] < 0
  ):
    raise ValueError(
        f"config.distill: weight={cfg['weight']} must be in [0, 1], "
        f"temperature={cfg['temperature']} > 0 and "
        f"feature_weight={cfg['feature_weight']} >= 0."
    )
  from big_vit_lite.models import loading  # pylint: disable=g-import-not-at-top  (heavy; only here)
  from big_vit_lite.models import vit  # pylint: disable=g-import-not-at-top

  no_overrides = config_loading.TrackedConfig(ml_collections.ConfigDict())
  t = loading.load_model(
      cfg["teacher"], cfg["params"], no_overrides, mesh, rules, place=place
  )
  src, h, w, c = cfg["teacher"], *image_shape
  if t.model_cfg["num_classes"] != num_classes:
    raise ValueError(
        f"config.distill.teacher={src} has {t.model_cfg['num_classes']} classes, "
        f"the student {num_classes}: distill from a teacher of the same labels."
    )
  if c != t.channels or (t.res is not None and (h, w) != (t.res, t.res)):
    size = f"{t.res}x{t.res}x{t.channels}" if t.res else f"{t.channels}-channel"
    raise ValueError(
        f"config.distill.teacher={src} takes {size} images, the student's are "
        f"{h}x{w}x{c}: train the student at the teacher's resolution."
    )
  teacher = Teacher(
      t.params, t.predict_fn, float(cfg["weight"]), float(cfg["temperature"])
  )
  if cfg["feature_weight"]:
    teacher.feature_weight = float(cfg["feature_weight"])
    # A linear map projects any width to any other: no width is refused.
    teacher.feature_widths = (
        _feature_width(student),
        _feature_width(vit.Model(**t.model_cfg)),
    )
  return teacher
