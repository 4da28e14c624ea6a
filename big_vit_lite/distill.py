"""Knowledge distillation in the trainer: a frozen teacher's logits as a second target.

  config.distill = dict(teacher=SRC, weight=0.5, temperature=1.0, params="params")

SRC is anything `evaluate` loads (a training workdir, an orbax step directory, a
vision_transformer/big_vision .npz, a timm .safetensors); params="ema" takes a
training checkpoint's EMA weights. The teacher runs in inference mode inside the
jitted step, on the very images the student gets (same crops, same mixup: big_vision's
"consistent" distillation); its params are sharded by the same logical rules as the
student's and passed to the step as an argument, so they are not in the state and
never in the student's checkpoint. The loss is

  (1 - weight) * label_loss + weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))

averaged over the batch (Hinton et al. 2015; T^2 keeps the gradient scale as T grows).
User guide: docs/distillation.md.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from big_vit_lite import config_loading

_DEFAULTS = dict(weight=0.5, temperature=1.0, params="params")


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
  # evaluate.make_predict_fn's: (params, images) -> (logits, out)
  predict_fn: object
  weight: float
  temperature: float

  def targets(self, params, images):
    """The teacher's logits on the step's (augmented) images, joining the batch."""
    logits, _ = self.predict_fn(params, images)
    return {"teacher_logits": jax.lax.stop_gradient(logits.astype(jnp.float32))}

  def loss(self, label_loss, logits, batch):
    distill = kl_loss(logits, batch["teacher_logits"], self.temperature)
    return (1.0 - self.weight) * label_loss + self.weight * distill

  def abstract(self):
    """The params as ShapeDtypeStructs with their shardings (the step's third argument)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        self.params,
    )

  def bind(self, compiled):
    """compiled(state, batch, teacher_params) -> step(state, batch), as the loop calls it."""
    return lambda state, batch: compiled(state, batch, self.params)


def from_config(
    cfg, mesh, rules, num_classes: int, image_shape
) -> Teacher | None:
  """The teacher of config.distill (None without one), checked against the student's task."""
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
  if not 0.0 <= cfg["weight"] <= 1.0 or cfg["temperature"] <= 0:
    raise ValueError(
        f"config.distill: weight={cfg['weight']} must be in [0, 1] and "
        f"temperature={cfg['temperature']} > 0."
    )
  from big_vit_lite import evaluate  # pylint: disable=g-import-not-at-top  (heavy; only here)

  no_overrides = config_loading.TrackedConfig(ml_collections.ConfigDict())
  t = evaluate.load_model(
      cfg["teacher"], cfg["params"], no_overrides, mesh, rules
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
  return Teacher(
      t.params, t.predict_fn, float(cfg["weight"]), float(cfg["temperature"])
  )
