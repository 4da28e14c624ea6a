"""Resuming: which checkpoint fits which config, read back as it was saved.

Two real checkpoints of a tiny state (orbax, in-process): one saved by an
optimizer chain with the gradient clip, one without. Oracles: the truth table
of grad_clip_norm on and off between the save and the resume worked by hand
(the clip keeps no state, so every pair resumes, with the saved layout), the
saved arrays themselves, and the one-line messages spelled out for a changed
model, a changed optimizer and a damaged step.
"""

import logging
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.trainer import optim
from big_vit_lite.trainer import resume
import checks


def _params(width=2):
  return {"head": {"kernel": jnp.arange(3.0 * width).reshape(3, width)}}


def _opt(clip, params, name="scale_by_adam"):
  config = checks.tracked_config(lr=0.1, optax_name=name, grad_clip_norm=clip)
  return optim.make(config, params, total_steps=10)


def _state(opt, params):
  grads = jax.tree.map(jnp.ones_like, params)
  opt_state = opt.tx.init(params)
  # One step: Adam's moments and the count are not their initial zeros.
  params, opt_state = opt.apply(params, grads, opt_state)
  return dict(params=params, opt_state=opt_state, step=jnp.asarray(1))


def _abstract(state):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state,
  )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """{clipped: (workdir, the state saved at step 1 there)}, clip 1.0 or none."""
  out = {}
  for clipped in (True, False):
    workdir = tmp_path_factory.mktemp("clipped" if clipped else "unclipped")
    params = _params()
    state = _state(_opt(1.0 if clipped else None, params), params)
    config = ml_collections.ConfigDict(
        dict(model=dict(width=2), optax_name="scale_by_adam", lr=0.1)
    )
    ckpt = checkpoint.Checkpointer(str(workdir), async_save=False)
    ckpt.save(1, state, {"position": 7}, config)
    ckpt.close()
    out[clipped] = (workdir, state)
  return out


@pytest.mark.parametrize("saved_clip", [True, False])
@pytest.mark.parametrize("now_clip", [True, False])
def test_grad_clip_on_or_off_resumes_with_the_saved_layout(
    saved, saved_clip, now_clip, caplog
):
  """Guards: the clip setting of the checkpoint (saved_clipped) lost or
  inverted when it differs from this run's (session 21's regression: the
  restore then asks orbax for the other layout and fails), a changed clip
  setting refused, or the optimizer state restored into the wrong slots.
  Oracle: the truth table (whatever now_clip is, the checkpoint's setting
  comes back, said in one log line when it differs) and the saved arrays,
  bit for bit, in this run's layout."""
  workdir, state = saved[saved_clip]
  params = _params()
  opt = _opt(1.0 if now_clip else None, params)
  ckpt = checkpoint.Checkpointer(str(workdir), async_save=False)
  abstract = _abstract(_state(opt, params))
  with caplog.at_level(logging.INFO, logger="absl"):
    got = resume.check_resumable(ckpt, 1, abstract, opt)
  assert got is saved_clip
  said = [
      r.getMessage()
      for r in caplog.records
      if "gradient clipping" in r.getMessage()
  ]
  if saved_clip == now_clip:
    assert not said
  else:
    saved_how, now_how = (
        ("with", "does not clip") if saved_clip else ("without", "clips")
    )
    assert said == [
        f"The checkpoint at step 1 was saved {saved_how} gradient clipping; this "
        f"run {now_how} (config.grad_clip_norm): its optimizer state carries "
        "over as it is."
    ]
  restored, data = resume.restore(
      ckpt, 1, resume.with_opt_layout(abstract, opt, got)
  )
  assert data == {"position": 7}
  restored["opt_state"] = optim.clip_relayout(
      restored["opt_state"], got, now_clip
  )
  want = dict(
      state,
      opt_state=optim.clip_relayout(state["opt_state"], saved_clip, now_clip),
  )
  assert jax.tree.structure(restored) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  ckpt.close()


def test_another_model_or_optimizer_is_one_line_naming_the_change(saved):
  """Guards: a checkpoint of another model resumed (or failing inside
  orbax), the changed config keys not named or named with the wrong values,
  keys that do not shape the state (lr) named, the fix for a changed model
  offering model_init (its params cannot initialise this model) or the fix
  for a changed optimizer not offering it."""
  workdir, _ = saved[False]
  ckpt = checkpoint.Checkpointer(str(workdir), async_save=False)
  step_dir = ckpt.step_dir(1)
  wide = _params(width=4)
  opt = _opt(None, wide)
  config = ml_collections.ConfigDict(
      dict(model=dict(width=4), optax_name="scale_by_adam", lr=0.5)
  )
  with pytest.raises(resume.TrainingError) as e:
    resume.check_resumable(ckpt, 1, _abstract(_state(opt, wide)), opt, config)
  assert str(e.value) == (
      f"Cannot resume from {step_dir}: it was written for another model or "
      "optimizer ('params/head/kernel' has shape (3, 2) in the checkpoint, "
      "(3, 4) in this config; config keys changed since the checkpoint: "
      "model.width 2 -> 4). Use a new --workdir, or undo the change."
  )
  # The same params, another optimizer (no moments): model_init is a way out.
  params = _params()
  sgd = _opt(None, params, name="sgd")
  config = ml_collections.ConfigDict(
      dict(model=dict(width=2), optax_name="sgd", lr=0.1, ema_decay=0.9)
  )
  with pytest.raises(resume.TrainingError) as e:
    resume.check_resumable(ckpt, 1, _abstract(_state(sgd, params)), sgd, config)
  message = str(e.value)
  assert "the checkpoint has 'opt_state/" in message
  assert (
      "config keys changed since the checkpoint: ema_decay (unset) -> 0.9, "
      "optax_name scale_by_adam -> sgd). Use a new --workdir with "
      f"config.model_init={step_dir} to start from its params, or undo the "
      "change." in message
  )
  ckpt.close()


def test_a_damaged_step_names_the_older_one_to_resume_from(tmp_path):
  """Guards: the one line for an unreadable checkpoint pointing at the wrong
  step (a newer one, or none when an older one exists), or the reason cut
  elsewhere than at 300 characters, a deleted step's files reported other
  than in that line; the line naming the last complete checkpoint."""
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  params = _params()
  state = _state(_opt(None, params), params)
  for step in (2, 5, 9):
    ckpt.save(step, state, {}, None)
  step_dir = ckpt.step_dir(9)
  got = resume.damaged(ckpt, 9, OSError("x" * 400))
  assert got == (
      f"Cannot read checkpoint {step_dir} ({'x' * 300}...); if it is damaged, "
      f"move it out of {ckpt.directory} (e.g. to {step_dir}.damaged) to resume "
      "from step 5."
  )
  first = resume.damaged(ckpt, 2, OSError("gone"))
  assert first == (
      f"Cannot read checkpoint {ckpt.step_dir(2)} (gone); if it is damaged, "
      f"move it out of {ckpt.directory} to start afresh."
  )
  # Files deleted after the save: check_resumable says so in the same line.
  shutil.rmtree(step_dir / "state")
  opt = _opt(None, params)
  with pytest.raises(resume.TrainingError) as e:
    resume.check_resumable(ckpt, 9, _abstract(state), opt)
  assert str(e.value).startswith(f"Cannot read checkpoint {step_dir} (")
  assert str(e.value).endswith(
      f"(e.g. to {step_dir}.damaged) to resume from step 5."
  )
  ckpt.close()
  assert resume.last_checkpoint(tmp_path) == (
      f"the last complete checkpoint is step 9 in {ckpt.directory}: run the "
      "same command to resume"
  )
  assert resume.last_checkpoint(tmp_path, "free some disk space") == (
      f"the last complete checkpoint is step 9 in {ckpt.directory}: free some "
      "disk space and run the same command to resume"
  )
  empty = tmp_path / "empty"
  assert resume.last_checkpoint(empty) == (
      f"no checkpoint was saved in {empty / 'checkpoints'}: run the same "
      "command to start again"
  )


def test_a_failing_close_on_the_way_out_is_logged_not_raised(caplog):
  """Guards: the error of the save in flight hiding the run's own error
  (raised from finish_saves), or not said at all."""

  class Failing:

    def close(self):
      raise checkpoint.SaveError("disk full")

  with caplog.at_level(logging.ERROR, logger="absl"):
    resume.finish_saves(Failing())
  assert [r.getMessage() for r in caplog.records] == [
      "The checkpoint save in flight did not complete: disk full"
  ]
