"""The training step, defined once: what train.py jits, and what `plan --compile` compiles.

    update = make_update_fn(model=..., opt=..., loss_fn=..., accum_steps=...)
    new_state, measurements = update(state, batch)

state: dict(params, opt_state, step, rng) (+ `ema` when an EMA is kept); batch: dict(image,
labels) with one-hot float labels. Every random number is a function of (state["rng"],
state["step"]): device augmentation, mixup and dropout each draw from their own key, so a
resumed run draws the same numbers as an uninterrupted one.
"""

import jax
import optax

from big_vit_lite.trainer import ema as ema_lib
from big_vit_lite.trainer import grad_accum


def make_update_fn(
    *,
    model,
    opt,
    loss_fn,
    accum_steps=1,
    mixup_fn=None,
    device_aug_fn=None,
    ema=None,
    distill=None,
    batch_sharding=None,
    param_shardings=None
):
  """(state, batch[, teacher_params]) -> (new state, measurements): forward, loss, backward,
  optimizer, EMA.

  model: a flax module, apply(..., train=True) -> (logits, out).
  opt: optim.make(...)'s optimizer (its `apply` and `lr_fn`).
  loss_fn: (logits, labels) -> mean loss (losses.get).
  accum_steps: the batch runs as this many sequential microbatches (grad_accum.py).
  mixup_fn, device_aug_fn: (rng, images, labels) -> (images, labels) / (rng, images) -> images.
  ema: an ema.Ema, or None (no EMA in the state).
  distill: a distill.Teacher, or None. With one, the step takes the teacher's params as a third
    argument (so they are never part of the saved state), runs the teacher on the step's own
    augmented images, and its `loss` makes the loss from the student's outputs.
  batch_sharding, param_shardings: kept by the microbatch loop (None: no constraints).
  """

  def loss_of(params, batch, rng):
    logits, out = model.apply(
        {"params": params}, batch["image"], train=True, rngs={"dropout": rng}
    )
    if distill:
      return distill.loss(loss_fn, params, out, batch)
    return loss_fn(logits, batch["labels"])

  def update(state, batch, teacher_params=None):
    step = state["step"]
    rng_step = jax.random.fold_in(state["rng"], step)
    rng_mix, rng_drop = jax.random.split(rng_step)
    images, labels = batch["image"], batch["labels"]
    if device_aug_fn is not None:  # its own key: mixup and dropout keep theirs
      images = device_aug_fn(jax.random.fold_in(rng_step, 1), images)
    if mixup_fn is not None:
      images, labels = mixup_fn(rng_mix, images, labels)
    step_batch = {"image": images, "labels": labels}
    # The teacher's logits on these very (augmented) images join the batch.
    if distill:
      step_batch.update(distill.targets(teacher_params, images))
    loss, grads = grad_accum.value_and_grad(
        loss_of,
        state["params"],
        step_batch,
        rng_drop,
        accum_steps,
        batch_sharding=batch_sharding,
        param_shardings=param_shardings,
    )
    params, opt_state = opt.apply(state["params"], grads, state["opt_state"])
    measurements = {
        "training_loss": loss,
        "grad_norm": optax.global_norm(grads),
        "learning_rate": opt.lr_fn(step),
    }
    new_state = dict(
        params=params, opt_state=opt_state, step=step + 1, rng=state["rng"]
    )
    if ema:
      new_state[ema_lib.KEY] = ema.update(state[ema_lib.KEY], params, step)
    return new_state, measurements

  return update
