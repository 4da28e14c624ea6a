"""Resuming a run: whether a checkpoint fits this config, reading it, and why not in one line.

Also the workdir (created and locked) and the line naming the last complete checkpoint.
"""

import json

from absl import logging

from big_vit_lite.trainer import checkpoint as ckpt_lib
from big_vit_lite.trainer import optim
from big_vit_lite.runtime import paths


class TrainingError(RuntimeError):
  """A failure with a one-line explanation for the user (exit status 1)."""


def with_opt_layout(state_abstract, opt, clipped):
  """`state_abstract` with the optimizer state laid out for a chain with(out) the clip."""
  return dict(
      state_abstract,
      opt_state=optim.clip_relayout(
          state_abstract["opt_state"], opt.clipped, clipped
      ),
  )


def check_resumable(checkpointer, step, state_abstract, opt, config=None):
  """Whether the checkpoint at `step` was saved with the gradient clip in its optimizer chain.

  Raises a one-line TrainingError when it cannot continue this config (the
  raw ConfigDict: its keys that differ from the checkpoint's are named). A
  changed grad_clip_norm (on <-> off) is fine: the clip keeps no state.
  """
  try:
    mismatch = checkpointer.state_mismatch(step, state_abstract)
    saved_clipped = opt.clipped
    if mismatch and not checkpointer.state_mismatch(
        step, with_opt_layout(state_abstract, opt, not opt.clipped)
    ):
      mismatch = None
      saved_clipped = not opt.clipped
      if saved_clipped:
        saved, now = "with", "does not clip"
      else:
        saved, now = "without", "clips"
      logging.info(
          "The checkpoint at step %d was saved %s gradient clipping; this run %s "
          "(config.grad_clip_norm): its optimizer state carries over as it is.",
          step,
          saved,
          now,
      )
  except Exception as e:  # pylint: disable=broad-except
    raise TrainingError(damaged(checkpointer, step, e)) from e
  if mismatch:
    step_dir = checkpointer.step_dir(step)
    changed = changed_keys(step_dir, config)
    # Params of another shape cannot initialise this model either: model_init is
    # no way out.
    fix = f"Use a new --workdir with config.model_init={step_dir} to start from its params"
    if mismatch.startswith("'params/"):
      fix = "Use a new --workdir"
    raise TrainingError(
        f"Cannot resume from {step_dir}: it was written for another model or "
        f"optimizer ({mismatch}; {changed}). {fix}, or undo the change."
    )
  return saved_clipped


# The config keys that shape the train state (params, optimizer state, EMA).
_STATE_KEYS = (
    "model.",
    "model_name",
    "optax_name",
    "optax.",
    "ema_decay",
    "schedule",
)


def changed_keys(step_dir, config):
  """'config keys changed since the checkpoint: model.width 16 -> 32, ...' (those that shape
  the state), from the config saved with the checkpoint; a note where none is known.
  """
  path = step_dir / "config" / "metadata"
  if config is None or not path.is_file():
    return "the checkpoint holds no config to compare with"
  saved, now = _flat(json.loads(path.read_text())), _flat(
      json.loads(config.to_json_best_effort())
  )
  changed = [
      f"{k} {saved.get(k, '(unset)')} -> {now.get(k, '(unset)')}"
      for k in sorted(set(saved) | set(now))
      if k.startswith(_STATE_KEYS) and saved.get(k) != now.get(k)
  ]
  if not changed:
    return "no config key that shapes the state changed: the code did"
  return "config keys changed since the checkpoint: " + ", ".join(changed)


def _flat(tree, prefix=""):
  """{'a.b': value} of a JSON dict."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def finish_saves(checkpointer):
  """close() on the way out of a failing run; its own error must not hide the run's."""
  try:
    checkpointer.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("The checkpoint save in flight did not complete: %s", e)


def restore(checkpointer, step, state_abstract):
  """(state, data iterator state) at `step`; a one-line TrainingError if it cannot be read."""
  try:
    return checkpointer.restore(step, state_abstract)
  except Exception as e:  # pylint: disable=broad-except
    raise TrainingError(damaged(checkpointer, step, e)) from e


def damaged(checkpointer, step, error):
  """One line for a checkpoint that cannot be read (files deleted or truncated after the save)."""
  reason = ckpt_lib.error_reason(error)
  if len(reason) > 300:
    reason = reason[:300] + "..."
  older = sorted(s for s in checkpointer.all_steps() if s < step)
  step_dir = checkpointer.step_dir(step)
  where = "to start afresh"
  if older:
    where = f"(e.g. to {step_dir}.damaged) to resume from step {older[-1]}"
  return (
      f"Cannot read checkpoint {step_dir} ({reason}); if it is damaged, move it out of "
      f"{checkpointer.directory} {where}."
  )


def last_checkpoint(workdir, todo=None):
  """'the last complete checkpoint is step N in DIR: [TODO and ]run the same command to resume'."""
  todo = f"{todo} and run" if todo else "run"
  steps = ckpt_lib.complete_steps(workdir)
  where = f" in {paths.resolve(workdir) / ckpt_lib.CKPT_SUBDIR}"
  if steps:
    return (
        f"the last complete checkpoint is step {steps[-1]}{where}: {todo} the same command "
        "to resume"
    )
  return (
      f"no checkpoint was saved{where}: {todo} the same command to start again"
  )


def prepare_workdir(workdir, cleanup):
  """Creates `workdir` and locks it against a second trainer (process 0 only)."""
  reason = ckpt_lib.unusable_path_reason(workdir)
  if reason:
    raise ValueError(
        f"--workdir {workdir} has {reason}: use a directory name without it."
    )
  workdir.mkdir(parents=True, exist_ok=True)
  cleanup.enter_context(paths.lock_workdir(workdir))
