r"""Pretrain a ViT: `python -m big_vit_lite.train --config=configs/FILE.py[:args] --workdir=DIR`.

Reads top to bottom in stages (_train): setup and mesh -> input and schedule
-> model -> state layout -> settings and evals -> restore or initialise ->
update step, compiled -> loop.

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

# First, before jax and TF load: once more with huge pages.
if __name__ == "__main__":
  from big_vit_lite import console  # pylint: disable=g-import-not-at-top
  from big_vit_lite import hostmem  # pylint: disable=g-import-not-at-top

  console.quiet_startup()
  hostmem.use_huge_pages(__file__)

import atexit
import contextlib
import dataclasses
import functools
import importlib
import os
import sys

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from big_vit_lite import checkpoint as ckpt_lib
from big_vit_lite import config_loading
from big_vit_lite import console
from big_vit_lite import distributed
from big_vit_lite import ema as ema_lib
from big_vit_lite import flops as flops_lib
from big_vit_lite import hostmem
from big_vit_lite import distill as distill_lib
from big_vit_lite import losses
from big_vit_lite import metrics as metrics_lib
from big_vit_lite import oom
from big_vit_lite import optim
from big_vit_lite import paths
from big_vit_lite import resume
from big_vit_lite import sharding
from big_vit_lite import train_loop
from big_vit_lite import train_setup
from big_vit_lite import train_step
from big_vit_lite.data import device_aug as device_aug_lib

# The flags, defined only when run as a command (at the end): importing this
# module (tests, other CLIs) must not clash with other CLIs' --config/--workdir
# in one process.
_CONFIG = _WORKDIR = None


# A failure with a one-line explanation (exit status 1).
TrainingError = resume.TrainingError
# Ctrl-C: saved; exit status 130.
TrainingInterrupted = train_loop.TrainingInterrupted


def main(argv):
  del argv
  # Other libraries' INFO lines (orbax: every file) when verbose.
  console.keep_log_readable()
  if _WORKDIR.value is None or _CONFIG.value is None:
    raise app.UsageError(
        "--config and --workdir are required, e.g. --config=configs/demo.py "
        "--workdir=workdirs/demo"
    )
  try:
    train(config_loading.loaded(_CONFIG.value, "--config"), _WORKDIR.value)
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


def train(raw_config, workdir):
  """The training job; returns the final (global) params.

  Ctrl-C anywhere raises TrainingInterrupted, a failed write (a full disk,
  a checkpoint save) a one-line TrainingError saying which checkpoint is left.
  """
  try:
    # Undone however train ends: the workdir lock, the signal handlers, a save
    # in flight.
    with contextlib.ExitStack() as cleanup:
      return _train(raw_config, workdir, cleanup)
  # Before the loop's handler is in place, or a second Ctrl-C.
  except KeyboardInterrupt:
    raise TrainingInterrupted(
        f"interrupted (Ctrl-C); {resume.last_checkpoint(workdir)}."
    ) from None
  except Exception as e:  # pylint: disable=broad-except
    full = ckpt_lib.disk_full(e)
    if isinstance(e, TrainingError) or not (
        full or isinstance(e, (OSError, ckpt_lib.SaveError))
    ):
      raise
    todo = (
        "free space on the disk of --workdir (config.keep_ckpts sets how many checkpoints "
        "are kept)"
        if full
        else "fix the cause"
    )
    raise TrainingError(
        f"{ckpt_lib.error_reason(e)}; {resume.last_checkpoint(workdir, todo)}."
    ) from e


def _train(raw_config, workdir, cleanup):
  """The stages, in order; each reads its part of the config (all of it before the compile)."""
  config = config_loading.TrackedConfig(raw_config)
  run = _setup(config, workdir, cleanup)
  train_setup.read_input_and_schedule(config, run)
  parts = _make_model(config, run)
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
    _lay_out_state(config, run, parts)
    settings = train_setup.read_settings(config, run, parts)
    state, resume_step, checkpointer = _restore_or_init(
        raw_config, run, parts, settings, cleanup
    )
    compiled, flops = _compile(
        run, parts, _make_update(run, parts), resume_step
    )
    return train_loop.Loop(
        raw_config,
        run,
        parts,
        settings,
        compiled,
        flops,
        state,
        resume_step,
        checkpointer,
        cleanup,
    ).run()


def _setup(config, workdir, cleanup):
  """Starts the backend, locks the workdir, opens the metric writer and builds the mesh."""
  # Before any backend starts.
  distributed.set_cpu_devices(config.get("num_cpu_devices", None))
  distributed.initialize()  # Before anything touches a backend.
  # Local (made absolute) or a bucket (gs://..., as given).
  workdir = paths.resolve(workdir)
  if jax.process_index() == 0:
    # config.json is written once the checkpoint (if any) has been read: a run
    # that stops on a bad config must not overwrite the config of the run
    # that made this workdir.
    resume.prepare_workdir(workdir, cleanup)
  logging.debug(
      "big_vit_lite.train: process %d/%d",
      jax.process_index(),
      jax.process_count(),
  )
  logging.debug("Host memory for XLA buffers: %s", hostmem.status())
  writer = metrics_lib.MetricWriter(workdir)
  mesh = sharding.make_mesh(config.get("mesh", None))
  rules = sharding.make_rules(config.get("sharding_rules", None), mesh)
  logging.debug("Mesh %s; rules %s", dict(mesh.shape), rules)
  return train_setup.Run(
      workdir,
      int(config.get("seed", 0)),
      writer,
      mesh,
      rules,
      repl=sharding.replicated(mesh),
      batch_sh=sharding.batch_sharding(mesh),
  )


@dataclasses.dataclass
class _Parts:
  """The model, its loss and augmentations; then the optimizer and the state's layout."""

  model_mod: object
  model_kw: object
  model: nn.Module
  loss_fn: object
  init_head_bias: float | None
  mixup_fn: object
  device_aug_fn: object
  batch_spec: dict
  image_shape: tuple
  init_params: object  # rng -> boxed params (logical axis names attached).
  distill: object = None  # distill.Teacher (config.distill) or None
  # Set by _lay_out_state, inside the mesh:
  rng_init: object = None
  rng_train: object = None
  params_abstract: object = None
  params_sh: object = None
  opt: object = None  # optim.make(...)
  opt_sh: object = None
  ema: object = None
  state_sh: dict = None
  state_abstract: dict = None  # ShapeDtypeStructs with their shardings.


def _make_model(config, run):
  """The model from config.model_name/model, its loss, mixup and on-device augmentation."""
  if (name := config.get("model_name", "vit")) != "vit":
    raise ValueError(f"model_name={name!r}: only 'vit' is supported.")
  model_mod = importlib.import_module("big_vit_lite.models.vit")
  model_kw = config.consume("model", {})
  model = model_mod.Model(
      **(model_kw.to_dict() if hasattr(model_kw, "to_dict") else model_kw)
  )
  batch_spec = run.train_iter.batch_spec()
  labels = batch_spec.get("labels")
  # Integer class ids would broadcast against the logits: nonsense, and without
  # an error when the batch size equals the class count.
  if (
      "image" not in batch_spec
      or labels is None
      or not jnp.issubdtype(labels.dtype, jnp.floating)
  ):
    given = {k: f"{v.dtype}{list(v.shape[1:])}" for k, v in batch_spec.items()}
    raise ValueError(
        f"the train pp gives {given}: the step needs 'image' and one-hot float "
        "'labels', e.g. end input.pp with "
        "onehot(K, key='label', key_result='labels')|keep('image', 'labels')"
    )
  image_shape = batch_spec["image"].shape[1:]
  n_batch_dev = sharding.batch_devices(run.mesh)
  teacher = distill_lib.from_config(
      config.consume("distill", None),
      run.mesh,
      run.rules,
      labels.shape[-1],
      image_shape,
      model,
  )

  def init_params(rng):
    return model.init(
        rng, jnp.zeros((n_batch_dev,) + tuple(image_shape), jnp.float32)
    )["params"]

  return _Parts(
      model_mod,
      model_kw,
      model,
      loss_fn=losses.get(config.get("loss", "softmax_xent")),
      init_head_bias=config.get("init_head_bias"),
      mixup_fn=train_setup.make_mixup(config.consume("mixup", None)),
      device_aug_fn=device_aug_lib.make(config.consume("device_aug", None)),
      batch_spec=batch_spec,
      image_shape=image_shape,
      init_params=teacher.with_projection(init_params)
      if teacher
      else init_params,
      distill=teacher,
  )


def _lay_out_state(config, run, parts):
  """Shapes and shardings of params, optimizer state (and EMA), without computing any."""
  parts.rng_init, parts.rng_train = jax.random.split(
      jax.random.PRNGKey(run.seed)
  )
  boxed_abstract = jax.eval_shape(parts.init_params, parts.rng_init)
  parts.params_sh = params_sh = sharding.logical_shardings(
      boxed_abstract, run.mesh, run.rules
  )
  parts.params_abstract = params_abstract = sharding.unbox(boxed_abstract)
  parts.opt = optim.make(config, params_abstract, **run.dur)
  opt_abstract = jax.eval_shape(parts.opt.tx.init, params_abstract)
  parts.opt_sh = sharding.like_params_shardings(
      opt_abstract, params_abstract, params_sh, run.mesh
  )
  parts.state_sh = dict(
      params=params_sh, opt_state=parts.opt_sh, step=run.repl, rng=run.repl
  )
  state_abstract = dict(
      params=params_abstract,
      opt_state=opt_abstract,
      step=jax.ShapeDtypeStruct((), jnp.int32),
      rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
  )
  # An EMA of the weights in the state, if configured.
  parts.ema = ema_lib.from_config(config)
  if parts.ema:
    parts.state_sh[ema_lib.KEY] = params_sh
    state_abstract[ema_lib.KEY] = params_abstract
  parts.state_abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      state_abstract,
      parts.state_sh,
  )
  num_params, table = metrics_lib.parameter_overview(params_abstract)
  console.header(
      workdir=run.workdir,
      mesh=run.mesh,
      num_params=num_params,
      table=table,
      params_bytes=sharding.describe(params_sh, params_abstract),
      opt_bytes=sharding.describe(parts.opt_sh, opt_abstract),
  )


def _make_update(run, parts):
  """The step (train_step.py): (state, batch) -> (state, measurements)."""
  return train_step.make_update_fn(
      model=parts.model,
      opt=parts.opt,
      loss_fn=parts.loss_fn,
      accum_steps=run.accum_steps,
      mixup_fn=parts.mixup_fn,
      device_aug_fn=parts.device_aug_fn,
      ema=parts.ema,
      distill=parts.distill,
      batch_sharding=run.batch_sh,
      param_shardings=parts.params_sh,
  )


def _restore_or_init(raw_config, run, parts, settings, cleanup):
  """(state, resume step or None, checkpointer): the newest checkpoint, else a fresh state.

  Runs before the (slow) compile: a workdir this config cannot resume, a
  damaged checkpoint or a bad model_init fails in seconds, not after minutes.
  """
  checkpointer = ckpt_lib.Checkpointer(
      run.workdir,
      keep=run.keep_ckpts,
      keep_every=run.keep_every,
      async_save=settings.ckpt_async,
  )
  # However the run ends (an eval or the data raising, Ctrl-C), an async save
  # in flight finishes: otherwise the process exits with its step uncommitted.
  cleanup.callback(resume.finish_saves, checkpointer)
  resume_step = checkpointer.manager.latest_step()
  if resume_step is not None:
    opt, model_init = parts.opt, settings.model_init
    saved_clipped = resume.check_resumable(
        checkpointer, resume_step, parts.state_abstract, opt, raw_config
    )
    # model_init only initialises a fresh run (as in big_vision): say so, not
    # silently.
    logging.info(
        "Resuming from %s/%d%s",
        checkpointer.directory,
        resume_step,
        f"; config.model_init={model_init} is not read again (it only initialises a "
        "fresh run)"
        if model_init
        else "",
    )
    state_abstract = resume.with_opt_layout(
        parts.state_abstract, opt, saved_clipped
    )
    state, data_state = resume.restore(
        checkpointer, resume_step, state_abstract
    )
    state["opt_state"] = optim.clip_relayout(
        state["opt_state"], saved_clipped, opt.clipped
    )
    run.train_iter.set_state(data_state)
  else:
    state = _init_state(run, parts, settings)
  if jax.process_index() == 0:  # This config now runs in this workdir.
    (run.workdir / "config.json").write_text(
        raw_config.to_json_best_effort(indent=2) + "\n"
    )
  return state, resume_step, checkpointer


def _init_state(run, parts, settings):
  """A fresh state: random params (or config.model_init's), their optimizer state, step 0."""

  # Born sharded: jit with out_shardings makes each device compute only its
  # slice; nothing is materialised whole.
  @functools.partial(jax.jit, out_shardings=parts.params_sh)
  def init_fn(rng):
    params = nn.meta.unbox(parts.init_params(rng))
    if parts.init_head_bias is not None:
      params["head"]["bias"] = jnp.full_like(
          params["head"]["bias"], parts.init_head_bias
      )
    return params

  params = init_fn(parts.rng_init)
  if settings.model_init:
    dont_load = settings.dont_load
    logging.info(
        "Initialising params from %s (dont_load=%s)",
        settings.model_init,
        dont_load,
    )
    # The values of the params not loaded, in full on every process.
    init_values = (
        multihost_utils.process_allgather(params, tiled=True)
        if dont_load
        else parts.params_abstract
    )
    # The patch grid, so that a learned posemb is resampled to this run's
    # (possibly non-square) input, not to the square of its token count.
    grid_hw = tuple(
        d // parts.model.arch()["patch_size"] for d in parts.image_shape[:2]
    )
    loaded = parts.model_mod.load(
        init_values,
        settings.model_init,
        parts.model_kw,
        dont_load=dont_load,
        grid_hw=grid_hw,
    )
    # Host numpy (the same on every process) -> global arrays with the params'
    # shardings.
    params = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
        loaded,
        parts.params_sh,
    )
  opt_state = jax.jit(parts.opt.tx.init, out_shardings=parts.opt_sh)(params)
  state = dict(
      params=params,
      opt_state=opt_state,
      rng=jax.device_put(parts.rng_train, run.repl),
      step=jax.device_put(jnp.zeros([], jnp.int32), run.repl),
  )
  if parts.ema:
    state[ema_lib.KEY] = parts.ema.init(params, parts.params_sh)
  return state


def _compile(run, parts, update, resume_step):
  """(the compiled step or None, its FLOPs per device as metrics.Chrono's keyword arguments).

  Compiles `update` once for every step; donation lets XLA update the state in place.
  """
  if resume_step is not None and resume_step >= run.total_steps:
    # A finished run started again (e.g. by a scheduler): no step to compile.
    return None, {}
  batch_abstract = {
      k: jax.ShapeDtypeStruct(
          (run.batch_size,) + v.shape[1:], v.dtype, sharding=run.batch_sh
      )
      for k, v in parts.batch_spec.items()
  }
  args, in_sh = (parts.state_abstract, batch_abstract), (
      parts.state_sh,
      run.batch_sh,
  )
  # The teacher's params: a third argument, so never in the saved state.
  if parts.distill:
    args, in_sh = args + (parts.distill.abstract(),), in_sh + (None,)
  traced = jax.jit(
      update,
      in_shardings=in_sh,
      out_shardings=(parts.state_sh, run.repl),
      donate_argnums=(0,),
  ).trace(*args)
  compiled = traced.lower().compile()
  # Matmuls in the jaxpr: `mfu`.
  model_flops = flops_lib.model_flops(traced) / run.mesh.size
  # `mfu_xla`.
  xla_flops = flops_lib.step_flops(traced, compiled, num_devices=run.mesh.size)
  peak = metrics_lib.peak_flops_per_device(
      dtype=parts.model.resolved_dtype_mm()
  )
  memory = compiled.memory_analysis()  # (None where the backend does not say.)
  temp = getattr(memory, "temp_size_in_bytes", None)
  logging.info(
      "Train step: %.6g model GFLOP per device (XLA: %s); device peak %s "
      "GFLOP/s; XLA temporaries %s MiB per device",
      model_flops / 1e9,
      None if xla_flops is None else f"{xla_flops / 1e9:.4g}",
      None if peak is None else f"{peak / 1e9:.6g}",
      None if temp is None else f"{temp / 2**20:.1f}",
  )
  if parts.distill:
    compiled = parts.distill.bind(compiled)
  return compiled, dict(
      step_flops=model_flops,
      peak_flops_total=peak,
      xla_step_flops=flops_lib.sane_xla_flops(xla_flops, model_flops),
  )


if __name__ == "__main__":
  _CONFIG = config_loading.define_config_flag()
  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "Directory for checkpoints, metrics and logs."
  )
  app.run(
      main,
      flags_parser=functools.partial(
          config_loading.parse_flags, prog="big_vit_lite.train"
      ),
  )
