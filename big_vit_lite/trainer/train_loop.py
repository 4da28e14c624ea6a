"""The training loop: steps, logging, checkpoints, evals and preemption, until total_steps."""

import math

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from big_vit_lite.trainer import checkpoint as ckpt_lib
from big_vit_lite.logs import console
from big_vit_lite.runtime import distributed
from big_vit_lite.logs import metrics as metrics_lib
from big_vit_lite.trainer import profiling
from big_vit_lite import report as report_lib
from big_vit_lite.logs import summary as summary_lib
from big_vit_lite.logs import wandb_writer
from big_vit_lite.data import device as device_lib
from big_vit_lite.trainer.resume import TrainingError


class TrainingInterrupted(TrainingError):
  """Ctrl-C: the state was saved; exit status 130 (the shell's code for SIGINT)."""


# Whether every leaf of a tree is finite (one device->host bool).
_all_finite = jax.jit(
    lambda t: jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)])
    )
)


class Loop:
  """The training loop with what it carries: state, data position, last saved step, evals."""

  def __init__(
      self,
      *,
      raw_config,
      job,
      inputs,
      settings,
      step_fn,
      flops,
      start,
      image_shape,
      cleanup,
  ):
    """Starts the run's bookkeeping; `run()` trains.

    job, inputs, settings: train_setup's values; step_fn: the compiled
    step(state, batch) -> (state, measurements), None for a finished run;
    flops: compile_step's figures (metrics.Chrono's keyword arguments);
    start: train.Start (state, resume step, checkpointer); cleanup: the
    ExitStack that stops what the loop starts, however the run ends.
    """
    self.raw_config = raw_config
    self.job = job
    self.inputs = inputs
    self.settings = settings
    self.step_fn = step_fn
    self.state = start.state
    self.resume_step = start.step
    self.checkpointer = start.checkpointer
    self.last_saved = start.step
    self.data_state = None
    # Drops what a killed earlier attempt logged after the resumed step (or
    # all of it, for a fresh start), in metrics.jsonl and in TensorBoard.
    job.writer.start_run(start.step)
    # config.wandb: the same rows to Weights & Biases, and the summary at the
    # end.
    self.tracker = wandb_writer.start(settings.wandb, job.workdir, raw_config)
    if self.tracker:
      job.writer.also.append(self.tracker)
    # Device prefetch; its get_state() is the position after the last batch
    # *returned*.
    self.batches = device_lib.prefetch(
        inputs.train_iter, inputs.prefetch_size, job.mesh
    )
    # (Idempotent; on an error its thread must stop too.)
    cleanup.callback(self.batches.close)
    self.first_step = int(jax.device_get(start.state["step"]))
    # summary.json now ("running") and however the run ends, with the log's
    # summary block.
    write_report = on_end = None
    if settings.report:
      write_report = report_lib.write
    if self.tracker:
      on_end = self.tracker.finish
    self.summary = summary_lib.TrainRun(
        job.workdir,
        total_steps=inputs.total_steps,
        start_step=start.step,
        checkpoint_dir=start.checkpointer.directory,
        image_shape=image_shape,
        fewshot=summary_lib.fewshot_args(raw_config.get("evals", {})),
        report=write_report,
        on_end=on_end,
    )
    cleanup.push(self.summary.exit)
    # core_hours counts the earlier attempts too (their lines up to the
    # checkpoint are kept). The loss over the interval; lines on time.
    self.progress = console.Progress()
    self.chrono = metrics_lib.Chrono(
        total_steps=inputs.total_steps,
        global_batch=inputs.batch_size,
        core_hours_before=job.writer.last_value("core_hours"),
        **flops,
    )
    self.preemption = ckpt_lib.PreemptionWatcher()
    cleanup.callback(self.preemption.close)
    self.guard = distributed.HangGuard.from_env(timeout_s=settings.hang_timeout)
    cleanup.callback(self.guard.stop)
    self.profiler = profiling.StepProfiler(job.workdir, settings.profile_steps)
    cleanup.callback(self.profiler.close)

  def run(self):
    """Trains to total_steps (or a preemption); returns the final params."""
    inputs = self.inputs
    batches = self.batches
    chrono = self.chrono
    step = self.first_step
    pending_loss = None
    preempted = False
    self._catch_up_evals()
    chrono.tick(step)
    self.data_state = batches.get_state()
    while step < inputs.total_steps:
      # Implicit host<->device copies in the hot loop are bugs (hidden syncs,
      # per-step transfers): fail loudly instead. Explicit ones are fine.
      with jax.transfer_guard("disallow"):
        batch = next(batches)
        self.profiler.before(step + 1)
        self.state, measured = self.step_fn(self.state, batch)
        self.profiler.after(step + 1, measured)
      self.data_state = batches.get_state()
      step += 1
      self.guard.tick(step)
      # Checked one step late to keep the pipeline full.
      if pending_loss is not None:
        self._check_finite(*pending_loss)
      pending_loss = (step, measured["training_loss"])
      self.progress.add(measured["training_loss"])
      final = step == inputs.total_steps
      if step % inputs.log_steps == 0 or final:
        self._log(step, measured)
      elif self.progress.due():  # Between logged steps: the log only.
        self._print_progress(step, measured)
      chrono.pause()
      preempted = self.preemption.reached(step)
      ckpt_due = inputs.ckpt_steps and step % inputs.ckpt_steps == 0
      if preempted and not (step % inputs.log_steps == 0 or final):
        # The saved step's line: this attempt's time, core-hours and loss,
        # also when it stopped before its first logged step (the resume keeps
        # the lines up to the checkpoint).
        self._log(step, measured)
      if preempted or final or ckpt_due:
        self._check_finite(step, measured["training_loss"])
        self._save(step)
      if preempted:
        break
      self._run_evals(step, final)
      self.guard.tick(step)
      chrono.resume()
    # (The prefetch thread and the hang guard stop on the way out: cleanup.)
    self.checkpointer.close()
    self.job.writer.close()
    where = self.checkpointer.directory
    if preempted and self.preemption.interrupted:
      raise TrainingInterrupted(
          f"interrupted (Ctrl-C): saved step {step} to {where}; run the "
          "same command to resume."
      )
    if preempted:
      logging.warning("Preempted: saved step %d to %s; exiting.", step, where)
      self.summary.status = "preempted"
    else:
      logging.info("Done: %d steps; checkpoints in %s", step, where)
    return self.state["params"]

  def _log(self, step, measured):
    """A metrics.jsonl row (training_loss_avg: over the steps since the last row) and a line."""
    m = jax.device_get(measured)
    self._check_finite(step, m["training_loss"])
    m = {k: float(v) for k, v in m.items()} | self.chrono.tick(step)
    m["epoch"] = step / self.inputs.steps_per_epoch
    # In the log: since its previous progress line.
    line_avg = self.progress.line_mean()
    m["training_loss_avg"] = self.progress.logged_mean()
    self.job.writer.write(step, m)
    if jax.process_index() == 0:
      line = m | {"training_loss_avg": line_avg}
      logging.info(
          "%s", metrics_lib.progress_line(step, self.inputs.total_steps, line)
      )

  def _print_progress(self, step, measured):
    """A progress line between logged steps (loss_avg: since the last line), not in metrics."""
    values = jax.device_get(measured)
    m = {k: float(v) for k, v in values.items()}
    m.update(self.chrono.tick(step))
    m["training_loss_avg"] = self.progress.line_mean()
    if jax.process_index() == 0:
      logging.info(
          "%s", metrics_lib.progress_line(step, self.inputs.total_steps, m)
      )

  def _non_finite(self, what, todo):
    """A TrainingError naming the last good checkpoint (once the save in flight is done)."""
    self.checkpointer.wait()
    where = (
        f"the last good checkpoint is step {self.last_saved} in {self.checkpointer.directory}"
        if self.last_saved is not None
        else "no checkpoint was saved before it"
    )
    return TrainingError(f"Non-finite {what}; {where}. {todo}")

  def _check_finite(self, step, loss):
    value = float(jax.device_get(loss))
    if not math.isfinite(value):
      raise self._non_finite(
          f"training loss ({value}) at step {step}",
          "Lower config.lr, add warmup or set config.grad_clip_norm.",
      )

  def _save(self, step):
    # Never replace a good checkpoint with a poisoned one.
    if not bool(jax.device_get(_all_finite(self.state["params"]))):
      raise self._non_finite(
          f"parameters after step {step}",
          "Lower config.lr or set config.grad_clip_norm.",
      )
    self.checkpointer.save(step, self.state, self.data_state, self.raw_config)
    self.last_saved = step

  def _run_evals(self, step, final, only=None):
    ran = False
    for name, (evaluator, every, key) in self.settings.evaluators.items():
      wanted = only is None or name in only
      due = final or (every and step % every == 0)
      if wanted and due:
        ran = True
        results = evaluator.run(self.state[key])
        self.job.writer.write(
            step, {f"{name}/{k}": v for k, v in results.items()}
        )
        logging.info(
            "[%d] %s: %s",
            step,
            name,
            ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in results.items()
            ),
        )
    if ran and not final:  # (The run's end writes the last one.)
      # The report (config.report), with this step's evals.
      self.summary.evaluated()

  def _catch_up_evals(self):
    """The evals at step 0 (config.eval_at_start) or those a stopped attempt did not log."""
    evaluators = self.settings.evaluators
    first = self.first_step
    total = self.inputs.total_steps
    if first == 0 and evaluators and self.settings.eval_at_start:
      self._run_evals(0, final=False)
    due = [
        name
        for name, (_, every, _) in evaluators.items()
        if first == total or (every and first and first % every == 0)
    ]
    if self.resume_step is not None and due:
      # The run that saved this checkpoint was stopped (killed, preempted,
      # Ctrl-C) before the evals due at its step had all logged.
      missing = [
          n
          for n in evals_not_logged(self.job.writer, evaluators, first)
          if n in due
      ]
      if missing:
        logging.info(
            "Running the evals due at step %d that the previous attempt did not log: %s",
            first,
            missing,
        )
        self._run_evals(first, final=first == total, only=missing)


def evals_not_logged(writer, evaluators, step):
  """Names of `evaluators` with no line at `step` in metrics.jsonl (process 0 decides for all)."""
  logged = writer.logged_keys(step)
  mask = np.array(
      [
          not any(k.startswith(f"{name}/") for k in logged)
          for name in evaluators
      ],
      np.int32,
  )
  # Every process must run the same evals (collectives): process 0's mask.
  return [
      name
      for name, m in zip(evaluators, multihost_utils.broadcast_one_to_all(mask))
      if m
  ]
