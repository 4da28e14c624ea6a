"""Profiler traces of chosen training steps: `config.profile_steps = (10, 11, 12)` in the config.

Each run of consecutive listed steps is one jax.profiler trace, written under the workdir
where TensorBoard's profile tab finds it, WORKDIR/profile/step_N/plugins/profile/<time>/ (N
its first step): an .xplane.pb, and a perfetto_trace.json.gz for https://ui.perfetto.dev.

  tensorboard --logdir=WORKDIR    # the PROFILE tab

(From the command line, `--config.profile_steps=(20,21)`, where the config file sets the
key, e.g. to `config_dict.placeholder(tuple)`.)

Step N is the update that makes the state's step N (metrics.jsonl's "step": N). Trace a few
steps after the first (step 1 waits for the compile and the input pipeline to fill).
"""

from absl import logging
import jax


def parse_steps(value):
  """config.profile_steps (None, an int or a list of ints >= 1) -> a sorted tuple."""
  if value is None:
    steps = ()
  elif isinstance(value, (list, tuple)):
    steps = tuple(value)
  else:
    steps = (value,)
  if not all(
      isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in steps
  ):
    raise ValueError(
        f"config.profile_steps={value!r}: give training step numbers >= 1, e.g. "
        "[10, 11, 12] (each run of consecutive steps is one trace)."
    )
  return tuple(sorted(set(steps)))


class StepProfiler:
  """Starts a trace before a listed step and stops it after the last consecutive one."""

  def __init__(self, workdir, steps):
    self.workdir, self.steps = str(workdir), frozenset(steps)
    self.tracing = None  # The folder of the trace running.

  def before(self, step):
    """Call before computing `step` (the state's step + 1)."""
    if step in self.steps and not self.tracing:
      # A folder per trace: jax names a trace by the second it starts, so two
      # traces in one second would share a folder and the second overwrite the
      # first.
      self.tracing = f"{self.workdir}/profile/step_{step}"
      jax.profiler.start_trace(self.tracing, create_perfetto_trace=True)

  def after(self, step, outputs):
    """Call after `step` was dispatched; `outputs` are waited for before the trace stops."""
    if self.tracing and step + 1 not in self.steps:
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      logging.info(
          "Profiler trace up to step %d written under %s", step, self.tracing
      )
      self.tracing = None

  def close(self):
    """Stops a trace still running (the run ended inside a listed run of steps)."""
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = None
