"""train_step.make_update_fn against the step written out by hand: the keys of
the device augmentation, mixup and dropout, the loss and gradient of the model
on the step's own images, the optimizer's update, the measurements and the
state that comes out, with the EMA and a distillation teacher.

The model draws a dropout mask only in train mode and the fake augmentations
use their keys, so a key reused, folded with another number or swapped, eval
mode, the teacher seeing the un-augmented images, or the EMA fed the old
params all change a number the tests compare.
"""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from big_vit_lite.trainer import grad_accum
from big_vit_lite.trainer import train_step


class _Tiny(nn.Module):
  """logits = (x * dropout mask) @ w; the mask only with train=True."""

  @nn.compact
  def __call__(self, x, train=False):
    w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], 2))
    if train:
      keep = jax.random.bernoulli(self.make_rng("dropout"), 0.6, x.shape)
      x = x * keep
    logits = x @ w
    return logits, {"pre_logits": x}


def _mse(logits, labels):
  return jnp.mean((logits - labels) ** 2)


def _augment(rng, images):
  return images + jax.random.uniform(rng, images.shape)


def _mixup(rng, images, labels):
  lam = jax.random.uniform(rng, ())
  return (
      lam * images + (1 - lam) * images[::-1],
      lam * labels + (1 - lam) * labels[::-1],
  )


def _opt():
  """SGD with a learning rate that depends on the step (so step vs step+1 shows)."""

  def lr_fn(step):
    return 0.1 + 0.01 * step

  def apply(params, grads, opt_state):
    lr = lr_fn(opt_state)
    new = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    return new, opt_state + 1

  return types.SimpleNamespace(apply=apply, lr_fn=lr_fn)


def _setup():
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
  labels = jnp.asarray(rng.normal(size=(4, 2)), jnp.float32)
  params = _Tiny().init(jax.random.PRNGKey(1), images)["params"]
  state = dict(
      params=params, opt_state=5, step=jnp.asarray(5), rng=jax.random.PRNGKey(3)
  )
  return state, {"image": images, "labels": labels}


def _by_hand(state, batch, loss_of_out=None):
  """The step's contract, written out: keys from (rng, step), aug, mixup, SGD."""
  rng_step = jax.random.fold_in(state["rng"], state["step"])
  rng_mix, rng_drop = jax.random.split(rng_step)
  images = _augment(jax.random.fold_in(rng_step, 1), batch["image"])
  images, labels = _mixup(rng_mix, images, batch["labels"])

  def loss(params):
    logits, out = _Tiny().apply(
        {"params": params}, images, train=True, rngs={"dropout": rng_drop}
    )
    if loss_of_out is not None:
      return loss_of_out(out, images)
    return _mse(logits, labels)

  value, grads = jax.value_and_grad(loss)(state["params"])
  lr = 0.1 + 0.01 * 5
  params = jax.tree.map(lambda p, g: p - lr * g, state["params"], grads)
  grad_norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))
  return value, grads, params, grad_norm, images


def _augmented_update_fn(**more):
  """The step of _by_hand: the tiny model, SGD, MSE, augmentation and mixup."""
  return train_step.make_update_fn(
      model=_Tiny(),
      opt=_opt(),
      loss_fn=_mse,
      mixup_fn=_mixup,
      device_aug_fn=_augment,
      **more,
  )


def _close(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5)


def test_step_matches_the_hand_written_step():
  """Guards: a key not folded with the step (or folded with another value), the
  aug key folded with 0 or the dropout key reused for mixup, train=False in
  the forward pass, a measurement of the wrong thing (loss, gradient norm, the
  learning rate of step+1), step not +1, the rng changed, the optimizer given
  the old gradients or params. Oracle: the same step in straight-line jax."""
  state, batch = _setup()
  update = _augmented_update_fn()
  new_state, m = update(state, batch)
  value, _, params, grad_norm, _ = _by_hand(state, batch)
  assert sorted(new_state) == ["opt_state", "params", "rng", "step"]
  _close(new_state["params"], params)
  assert int(new_state["step"]) == 6 and new_state["opt_state"] == 6
  np.testing.assert_array_equal(new_state["rng"], state["rng"])
  np.testing.assert_allclose(m["training_loss"], value, rtol=1e-5)
  np.testing.assert_allclose(m["grad_norm"], grad_norm, rtol=1e-5)
  np.testing.assert_allclose(m["learning_rate"], 0.15, rtol=1e-6)
  assert sorted(m) == ["grad_norm", "learning_rate", "training_loss"]


def test_no_aug_no_mixup_is_the_plain_step():
  """Guards: an augmentation or mixup run when none is given (a condition
  flipped), the dropout key taken from another split. Oracle: the model's
  loss and gradient on the batch as given, by hand."""
  state, batch = _setup()
  update = train_step.make_update_fn(model=_Tiny(), opt=_opt(), loss_fn=_mse)
  new_state, m = update(state, batch)
  rng_step = jax.random.fold_in(state["rng"], state["step"])
  _, rng_drop = jax.random.split(rng_step)

  def loss(params):
    logits, _ = _Tiny().apply(
        {"params": params},
        batch["image"],
        train=True,
        rngs={"dropout": rng_drop},
    )
    return _mse(logits, batch["labels"])

  value, grads = jax.value_and_grad(loss)(state["params"])
  np.testing.assert_allclose(m["training_loss"], value, rtol=1e-5)
  _close(
      new_state["params"],
      jax.tree.map(lambda p, g: p - 0.15 * g, state["params"], grads),
  )


def test_ema_gets_the_new_params_and_the_step():
  """Guards: the EMA updated with the params before the step, with step+1,
  from another state, or not kept at all. Oracle: a recording EMA."""
  state, batch = _setup()
  state["ema"] = "previous ema"
  calls = []

  class Ema:

    def update(self, ema_state, params, step):
      calls.append((ema_state, params, int(step)))
      return "new ema"

  update = train_step.make_update_fn(
      model=_Tiny(), opt=_opt(), loss_fn=_mse, ema=Ema()
  )
  new_state, _ = update(state, batch)
  assert new_state["ema"] == "new ema"
  [(ema_state, params, step)] = calls
  assert ema_state == "previous ema" and step == 5
  _close(params, new_state["params"])


def test_teacher_sees_the_augmented_images_and_makes_the_loss():
  """Guards: the teacher run on the batch's un-augmented images, the
  teacher's params or targets not passed, the student's own loss used in
  place of the teacher's. Oracle: a recording teacher whose loss is written
  out by hand on the augmented, mixed images."""
  state, batch = _setup()
  seen = []

  class Teacher:

    def targets(self, teacher_params, images):
      seen.append(np.asarray(images))
      return {"teacher": images.sum(axis=1) * teacher_params}

    def loss(self, loss_fn, params, out, step_batch):
      del loss_fn, params
      return jnp.mean(
          (out["pre_logits"].sum(axis=1) - step_batch["teacher"]) ** 2
      )

  update = _augmented_update_fn(distill=Teacher())
  new_state, m = update(state, batch, 2.0)

  def by_hand(out, images):
    return jnp.mean((out["pre_logits"].sum(axis=1) - 2.0 * images.sum(1)) ** 2)

  value, _, params, _, images = _by_hand(state, batch, by_hand)
  np.testing.assert_allclose(seen[0], images, rtol=1e-6)
  np.testing.assert_allclose(m["training_loss"], value, rtol=1e-5)
  _close(new_state["params"], params)


def test_accumulation_and_shardings_reach_the_microbatch_loop(monkeypatch):
  """Guards: accum_steps, batch_sharding or param_shardings dropped on the way
  to grad_accum (on one CPU device a dropped sharding changes no number, on
  a pod it gathers the gradients whole). Oracle: what a recording
  grad_accum.value_and_grad receives."""
  state, batch = _setup()
  got = {}
  real = grad_accum.value_and_grad

  def spy(loss_fn, params, step_batch, rng, steps, **kwargs):
    got.update(steps=steps, **kwargs)
    return real(loss_fn, params, step_batch, rng, steps)

  monkeypatch.setattr(grad_accum, "value_and_grad", spy)
  update = train_step.make_update_fn(
      model=_Tiny(),
      opt=_opt(),
      loss_fn=_mse,
      accum_steps=2,
      batch_sharding="batch sharding",
      param_shardings="param shardings",
  )
  update(state, batch)
  assert got == dict(
      steps=2,
      batch_sharding="batch sharding",
      param_shardings="param shardings",
  )
