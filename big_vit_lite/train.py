r"""Pretrain a ViT: `python -m big_vit_lite.train --config=configs/FILE.py[:args] --workdir=DIR`.

Reads top to bottom in stages (_train), each returning a frozen value that the
next ones take as arguments: the job (workdir, mesh) -> the inputs and step
counts -> the model -> the state's layout -> the settings and evals -> the
start (restored or fresh) -> the update step (train_state.jit_step),
jitted with its shardings and compiled -> the loop (train_loop.Loop).

The same code runs on one CPU core and on a pod: everything is global
jax.Arrays under one mesh, with shardings from the config's logical-axis
rules (sharding.py). A run resumes from the newest complete checkpoint in
DIR; a run killed at any moment and restarted with the same command gives
the same losses and final params as an uninterrupted one (bit for bit on
CPU), because the checkpoint holds params, optimizer state, step, rng and
the data iterator's position, and every random number is a function of
(seed, step). SIGTERM (preemption) saves and exits 0; Ctrl-C saves and
exits 130. One trainer per workdir (WORKDIR/.lock). A write that fails (a
full disk, a checkpoint save) ends in one line naming the last complete
checkpoint, which a rerun resumes from.
"""

# First, before jax and TF load: once more with huge pages. (TensorFlow's
# start-up lines: the package's __init__.)
if __name__ == "__main__":
  from big_vit_lite.runtime import hostmem  # pylint: disable=g-import-not-at-top

  hostmem.use_huge_pages(__file__)

import atexit
import contextlib
import functools
import os
import shutil
import sys
import tempfile
from typing import NamedTuple

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from big_vit_lite.trainer import checkpoint as ckpt_lib
from big_vit_lite.config import config_loading
from big_vit_lite.logs import console
from big_vit_lite.trainer import ema as ema_lib
from big_vit_lite.runtime import flops as flops_lib
from big_vit_lite.logs import metrics as metrics_lib
from big_vit_lite.runtime import oom
from big_vit_lite.trainer import optim
from big_vit_lite.trainer import resume
from big_vit_lite.runtime import sharding
from big_vit_lite.trainer import train_loop
from big_vit_lite.trainer import train_state  # The flags, defined only when run as a command (at the end): importing this

# module (tests, other CLIs) must not clash with other CLIs' --config/--workdir
# in one process.
_CONFIG = _WORKDIR = _CHECK = None


# A failure with a one-line explanation (exit status 1).
TrainingError = resume.TrainingError
# Ctrl-C: saved; exit status 130.
TrainingInterrupted = train_loop.TrainingInterrupted


def main(argv):
  del argv
  # Other libraries' INFO lines (orbax: every file) when verbose.
  console.keep_log_readable()
  workdir = _WORKDIR.value
  if _CHECK.value and workdir is None:
    # Nothing is kept: the lock and the log go to a throwaway folder.
    workdir = tempfile.mkdtemp(prefix="big_vit_lite_check_")
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
  if workdir is None or _CONFIG.value is None:
    raise app.UsageError(
        "--config and --workdir are required, e.g. --config=configs/demo.py "
        "--workdir=workdirs/demo"
    )
  try:
    train(
        config_loading.loaded(_CONFIG.value, "--config"),
        workdir,
        check=_CHECK.value,
    )
  except TrainingInterrupted as e:
    print(f"big_vit_lite.train: {e}", file=sys.stderr, flush=True)
    _exit_now(130)
  except jax.errors.JaxRuntimeError as e:
    if not oom.is_oom(e):
      raise
    # XLA's own report (what it tried to allocate), with --verbosity=1.
    logging.debug("%s", e)
    cfg = _CONFIG.value
    msg = oom.message(
        e,
        what="training",
        batch_size=cfg.get("input", {}).get("batch_size"),
        grad_accum_steps=cfg.get("grad_accum_steps"),
    )
    sys.exit(
        f"big_vit_lite.train: error: {msg} Checkpoints already written are intact."
    )
  # (UnreadConfigKeyError is a ValueError.)
  except (ValueError, TypeError, TrainingError) as e:
    # The error once (the line below); a TypeError's traceback with
    # --verbosity=1.
    logging.debug("Traceback:", exc_info=isinstance(e, TypeError))
    sys.exit(f"big_vit_lite.train: error: {e}")


def _exit_now(status):
  """Exits without tearing down the interpreter's objects. After Ctrl-C all is saved and closed
  (train's cleanup ran), and tf.data's iterator destructor would wait while its shuffle buffer
  refills (17-55 s after the message with the demo's 20,000 examples)."""
  atexit._run_exitfuncs()  # pylint: disable=protected-access  (temporary folders, log files)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)  # pylint: disable=protected-access


def train(raw_config, workdir, check=False):
  """The training job; returns the final (global) params.

  check=True: only the job's checks (job_check.py) and the step's compile;
  prints "ok" with the run's shapes and returns None.

  Ctrl-C anywhere raises TrainingInterrupted, a failed write (a full disk,
  a checkpoint save) a one-line TrainingError saying which checkpoint is left.
  """
  try:
    # Undone however train ends: the workdir lock, the signal handlers, a save
    # in flight.
    with contextlib.ExitStack() as cleanup:
      return _train(raw_config, workdir, cleanup, check)
  # Before the loop's handler is in place, or a second Ctrl-C.
  except KeyboardInterrupt:
    raise TrainingInterrupted(
        f"interrupted (Ctrl-C); {resume.last_checkpoint(workdir)}."
    ) from None
  except Exception as e:  # pylint: disable=broad-except
    full = ckpt_lib.disk_full(e)
    failed_write = full or isinstance(e, (OSError, ckpt_lib.SaveError))
    if isinstance(e, TrainingError) or not failed_write:
      raise
    if full:
      todo = (
          "free space on the disk of --workdir (config.keep_ckpts sets how "
          "many checkpoints are kept)"
      )
    else:
      todo = "fix the cause"
    raise TrainingError(
        f"{ckpt_lib.error_reason(e)}; {resume.last_checkpoint(workdir, todo)}."
    ) from e


def _train(raw_config, workdir, cleanup, check=False):
  """The stages, in order; each reads its part of the config (all of it before the compile).

  Each stage returns a frozen value (train_setup.Job, Inputs, Model, Settings;
  Layout, Start below) that the later stages take as arguments.
  """
  # Here, not at the top: both load TensorFlow (tf.data), ~5 s of CPU that
  # --help and a config error caught while parsing the flags do without.
  from big_vit_lite.trainer import job_check  # pylint: disable=g-import-not-at-top
  from big_vit_lite.trainer import train_setup  # pylint: disable=g-import-not-at-top

  config = config_loading.TrackedConfig(raw_config)
  job = train_setup.start_job(config, workdir, cleanup)
  inputs = train_setup.read_inputs(config, mesh=job.mesh, seed=job.seed)
  model = train_setup.make_model(
      config,
      batch_spec=inputs.train_iter.batch_spec(),
      mesh=job.mesh,
      rules=job.rules,
  )
  with jax.set_mesh(job.mesh), nn.logical_axis_rules(job.rules):
    layout = lay_out_state(config, job=job, inputs=inputs, model=model)
    settings = train_setup.read_settings(
        config,
        model=model.module,
        ema=layout.ema,
        mesh=job.mesh,
        dur=inputs.dur,
    )
    # Before the first step: the evals' images against the model, ...
    job_check.check_job(inputs=inputs, model=model, settings=settings)
    if check:
      start = None  # Nothing restored or initialised.
    else:
      start = restore_or_init(
          raw_config,
          job=job,
          inputs=inputs,
          model=model,
          layout=layout,
          settings=settings,
          cleanup=cleanup,
      )
    # One training step: (state, batch) -> (new state, measurements), jitted
    # with the state's shardings (train_state.jit_step).
    jitted_update = train_state.jit_step(
        model=model,
        layout=layout,
        mesh=job.mesh,
        accum_steps=inputs.accum_steps,
    )
    if start and start.step is not None and start.step >= inputs.total_steps:
      # A finished run started again (e.g. by a scheduler): no step to compile.
      step_fn, flops = None, {}
    else:
      step_fn, flops = compile_step(
          jitted_update,
          job=job,
          inputs=inputs,
          model=model,
          layout=layout,
      )
    if check:
      print(
          job_check.describe(
              inputs=inputs,
              model=model,
              settings=settings,
              params_abstract=layout.params_abstract,
          ),
          flush=True,
      )
      return None
    loop = train_loop.Loop(
        raw_config=raw_config,
        job=job,
        inputs=inputs,
        settings=settings,
        step_fn=step_fn,
        flops=flops,
        start=start,
        image_shape=model.image_shape,
        cleanup=cleanup,
    )
    return loop.run()


# The state's shapes and shardings (train_state.py).
Layout = train_state.Layout


def lay_out_state(config, *, job, inputs, model) -> Layout:
  """Shapes and shardings of params, optimizer state (and EMA), without computing any."""
  from big_vit_lite.trainer import train_setup  # pylint: disable=g-import-not-at-top (_train's)

  layout = train_setup.lay_out(
      config,
      model=model,
      mesh=job.mesh,
      rules=job.rules,
      seed=job.seed,
      dur=inputs.dur,
  )
  params_abstract = layout.params_abstract
  num_params, table = metrics_lib.parameter_overview(params_abstract)
  console.header(
      workdir=job.workdir,
      mesh=job.mesh,
      num_params=num_params,
      table=table,
      params_bytes=sharding.describe(layout.params_sh, params_abstract),
      opt_bytes=sharding.describe(layout.opt_sh, layout.opt_abstract),
  )
  return layout


class Start(NamedTuple):
  """Where the loop starts: the state, the step it was restored at, the checkpointer."""

  state: dict
  step: int | None  # The checkpoint's step; None for a fresh run.
  checkpointer: ckpt_lib.Checkpointer


def restore_or_init(
    raw_config, *, job, inputs, model, layout, settings, cleanup
) -> Start:
  """The newest checkpoint (the data iterator set to its position), else a fresh state.

  Runs before the (slow) compile: a workdir this config cannot resume, a
  damaged checkpoint or a bad model_init fails in seconds, not after minutes.
  """
  checkpointer = ckpt_lib.Checkpointer(
      job.workdir,
      keep=inputs.keep_ckpts,
      keep_every=inputs.keep_every,
      async_save=settings.ckpt_async,
  )
  # However the run ends (an eval or the data raising, Ctrl-C), an async save
  # in flight finishes: otherwise the process exits with its step uncommitted.
  cleanup.callback(resume.finish_saves, checkpointer)
  resume_step = checkpointer.manager.latest_step()
  if resume_step is not None:
    state = _restore(
        raw_config,
        checkpointer,
        resume_step,
        inputs=inputs,
        layout=layout,
        model_init=settings.model_init,
    )
  else:
    state = init_state(job=job, model=model, layout=layout, settings=settings)
  if jax.process_index() == 0:  # This config now runs in this workdir.
    (job.workdir / "config.json").write_text(
        raw_config.to_json_best_effort(indent=2) + "\n"
    )
  return Start(state=state, step=resume_step, checkpointer=checkpointer)


def _restore(raw_config, checkpointer, step, *, inputs, layout, model_init):
  """The state saved at `step`; sets the train iterator to its saved position."""
  opt = layout.opt
  saved_clipped = resume.check_resumable(
      checkpointer, step, layout.state_abstract, opt, raw_config
  )
  # model_init only initialises a fresh run (as in big_vision): say so, not
  # silently.
  if model_init:
    not_read = (
        f"; config.model_init={model_init} is not read again (it only "
        "initialises a fresh run)"
    )
  else:
    not_read = ""
  logging.info("Resuming from %s/%d%s", checkpointer.directory, step, not_read)
  state_abstract = resume.with_opt_layout(
      layout.state_abstract, opt, saved_clipped
  )
  state, data_state = resume.restore(checkpointer, step, state_abstract)
  state["opt_state"] = optim.clip_relayout(
      state["opt_state"], saved_clipped, opt.clipped
  )
  inputs.train_iter.set_state(data_state)
  return state


def init_state(*, job, model, layout, settings):
  """A fresh state: random params (or config.model_init's), their optimizer state, step 0."""

  # Born sharded: jit with out_shardings makes each device compute only its
  # slice; nothing is materialised whole.
  @functools.partial(jax.jit, out_shardings=layout.params_sh)
  def init_fn(rng):
    params = nn.meta.unbox(model.init_params(rng))
    if model.init_head_bias is not None:
      params["head"]["bias"] = jnp.full_like(
          params["head"]["bias"], model.init_head_bias
      )
    return params

  params = init_fn(layout.rng_init)
  if settings.model_init:
    params = _load_init(params, model=model, layout=layout, settings=settings)
  opt_state = jax.jit(layout.opt.tx.init, out_shardings=layout.opt_sh)(params)
  state = dict(
      params=params,
      opt_state=opt_state,
      rng=jax.device_put(layout.rng_train, job.repl),
      step=jax.device_put(jnp.zeros([], jnp.int32), job.repl),
  )
  if layout.ema:
    state[ema_lib.KEY] = layout.ema.init(params, layout.params_sh)
  return state


def _load_init(params, *, model, layout, settings):
  """config.model_init's params (those in dont_load keep `params`' values)."""
  dont_load = settings.dont_load
  logging.info(
      "Initialising params from %s (dont_load=%s)",
      settings.model_init,
      dont_load,
  )
  # The values of the params not loaded, in full on every process.
  if dont_load:
    init_values = multihost_utils.process_allgather(params, tiled=True)
  else:
    init_values = layout.params_abstract
  # The patch grid, so that a learned posemb is resampled to this run's
  # (possibly non-square) input, not to the square of its token count.
  patch_size = model.module.arch()["patch_size"]
  grid_hw = tuple(d // patch_size for d in model.image_shape[:2])
  loaded = model.model_mod.load(
      init_values,
      settings.model_init,
      model.model_kw,
      dont_load=dont_load,
      grid_hw=grid_hw,
  )
  # Host numpy (the same on every process) -> global arrays with the params'
  # shardings.
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
      loaded,
      layout.params_sh,
  )


def compile_step(jitted_update, *, job, inputs, model, layout):
  """(the compiled step, its FLOPs per device as metrics.Chrono's keyword arguments).

  The step: step_fn(state, batch) -> (new state, measurements), the
  teacher's params (config.distill) bound in.
  """
  args = train_state.step_args(
      model=model, layout=layout, mesh=job.mesh, batch_size=inputs.batch_size
  )
  traced, compiled = train_state.compile_step(jitted_update, args)
  # Matmuls in the jaxpr: `mfu`.
  model_flops = flops_lib.model_flops(traced) / job.mesh.size
  # `mfu_xla`.
  xla_flops = flops_lib.step_flops(traced, compiled, num_devices=job.mesh.size)
  peak = metrics_lib.peak_flops_per_device(
      dtype=model.module.resolved_dtype_mm()
  )
  # (None where the backend does not say.)
  memory = flops_lib.program_memory(compiled)
  # Each figure None where the backend does not say.
  xla_gflops = peak_gflops = temp_mib = None
  if xla_flops is not None:
    xla_gflops = f"{xla_flops / 1e9:.4g}"
  if peak is not None:
    peak_gflops = f"{peak / 1e9:.6g}"
  if memory:
    temp_mib = f"{memory['temp'] / 2**20:.1f}"
  logging.info(
      "Train step: %.6g model GFLOP per device (XLA: %s); device peak %s "
      "GFLOP/s; XLA temporaries %s MiB per device",
      model_flops / 1e9,
      xla_gflops,
      peak_gflops,
      temp_mib,
  )
  if model.distill:
    compiled = model.distill.bind(compiled)
  flops = dict(
      step_flops=model_flops,
      peak_flops_total=peak,
      xla_step_flops=flops_lib.sane_xla_flops(xla_flops, model_flops),
  )
  return compiled, flops


if __name__ == "__main__":
  _CONFIG = config_loading.define_config_flag()
  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "Directory for checkpoints, metrics and logs."
  )
  _CHECK = flags.DEFINE_bool(
      "check",
      False,
      "Only check the job (every eval's images against the model, datasets, "
      "W&B, ranges) and compile its step; print 'ok' and the run's shapes.",
  )
  app.run(
      main,
      flags_parser=functools.partial(
          config_loading.parse_flags, prog="big_vit_lite.train"
      ),
  )
