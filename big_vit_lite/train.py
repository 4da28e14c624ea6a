r"""Pretrain a ViT: `python -m big_vit_lite.train --config=configs/FILE.py[:args] --workdir=DIR`.

Reads top to bottom in stages: setup -> mesh -> input -> model + optimizer
-> sharded init -> update step -> checkpoint resume -> evaluators -> loop.

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
if __name__ == "__main__":  # First, before jax and TF load: once more with huge pages.
  from big_vit_lite import hostmem  # pylint: disable=g-import-not-at-top
  hostmem.use_huge_pages(__file__)

import contextlib
import errno
import functools
import importlib
import json
import logging as py_logging
import math
import sys

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import optax

from big_vit_lite import checkpoint as ckpt_lib
from big_vit_lite import config_loading
from big_vit_lite import distributed
from big_vit_lite import ema as ema_lib
from big_vit_lite import evaluators as evaluators_lib
from big_vit_lite import flops as flops_lib
from big_vit_lite import grad_accum
from big_vit_lite import hostmem
from big_vit_lite import losses
from big_vit_lite import metrics as metrics_lib
from big_vit_lite import oom
from big_vit_lite import optim
from big_vit_lite import paths
from big_vit_lite import sharding
from big_vit_lite import summary as summary_lib
from big_vit_lite.data import device as device_lib
from big_vit_lite.data import device_aug as device_aug_lib
from big_vit_lite.data import input_pipeline
from big_vit_lite.data import mixup as mixup_lib

_CONFIG = _WORKDIR = None  # flag holders, defined by _define_flags()


def _define_flags():
  # Only when run as a command: importing this module (tests, other CLIs)
  # must not clash with other CLIs' --config/--workdir in one process.
  global _CONFIG, _WORKDIR
  _CONFIG = config_loading.define_config_flag()
  _WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")


class TrainingError(RuntimeError):
  """A failure with a one-line explanation for the user (exit status 1)."""


class TrainingInterrupted(TrainingError):
  """Ctrl-C: the state was saved; exit status 130 (the shell's code for SIGINT)."""


def _model_module(name):
  try:
    return importlib.import_module(f"big_vit_lite.models.{name}")
  except ModuleNotFoundError as e:
    if e.name != f"big_vit_lite.models.{name}":
      raise
    raise ValueError(f"Unknown model_name '{name}': it must be a module in big_vit_lite/models/.") from None


def _global_from_host(tree, shardings):
  """Host numpy tree (identical on every process) -> global arrays with `shardings`."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), tree, shardings)


def _host_copy(tree):
  """Global arrays -> host numpy (all processes get the full values)."""
  if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def _quiet_library_logs():
  """Orbax logs every file it writes at INFO level: keep its warnings only."""
  class _Filter(py_logging.Filter):
    def filter(self, record):
      return record.levelno >= py_logging.WARNING or "/orbax/" not in record.pathname
  logging.get_absl_handler().addFilter(_Filter())


def main(argv):
  del argv
  _quiet_library_logs()
  if _WORKDIR.value is None:
    raise app.UsageError("--workdir is required.")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/demo.py")
  try:
    train(config_loading.loaded(_CONFIG.value, "--config"), _WORKDIR.value)
  except TrainingInterrupted as e:
    print(f"big_vit_lite.train: {e}", file=sys.stderr, flush=True)
    sys.exit(130)
  except jax.errors.JaxRuntimeError as e:
    if not oom.is_oom(e):
      raise
    logging.error("%s", e)  # XLA's own report (what it tried to allocate) stays in the log.
    cfg = _CONFIG.value
    msg = oom.message(e, what="training", batch_size=cfg.get("input", {}).get("batch_size"),
                      grad_accum_steps=cfg.get("grad_accum_steps"))
    print(f"big_vit_lite.train: error: {msg} Checkpoints already written are intact.",
          file=sys.stderr, flush=True)
    sys.exit(1)
  except (ValueError, TypeError, TrainingError, config_loading.UnreadConfigKeyError) as e:
    logging.error("%s", e, exc_info=isinstance(e, TypeError))
    print(f"big_vit_lite.train: error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)


def train(raw_config, workdir):
  """The training job; returns the final (global) params.

  Ctrl-C anywhere raises TrainingInterrupted, a failed write (a full disk,
  a checkpoint save) a one-line TrainingError saying which checkpoint is left.
  """
  try:
    # Undone however train ends: the workdir lock, the signal handlers, a save in flight.
    with contextlib.ExitStack() as cleanup:
      return _train(raw_config, workdir, cleanup)
  except KeyboardInterrupt:  # Before the loop's handler is in place, or a second Ctrl-C.
    raise TrainingInterrupted(f"interrupted (Ctrl-C); {_last_checkpoint(workdir)}.") from None
  except Exception as e:  # pylint: disable=broad-except
    disk_full = _disk_full(e)
    io_error = isinstance(e, (OSError, ckpt_lib.SaveError)) or disk_full
    if isinstance(e, TrainingError) or not io_error:
      raise
    todo = ("free space on the disk of --workdir (config.keep_ckpts sets how many checkpoints "
            "are kept)" if disk_full else "fix the cause")
    raise TrainingError(f"{ckpt_lib.error_reason(e)}; {_last_checkpoint(workdir, todo)}.") from e


def _disk_full(error):
  """Whether `error` (Python's, orbax's, TensorFlow's writing TensorBoard events) is ENOSPC."""
  if isinstance(error, ckpt_lib.SaveError):
    return error.disk_full
  if isinstance(error, OSError):
    return error.errno in (errno.ENOSPC, errno.EDQUOT)
  return "No space left on device" in str(error) or "Disk quota exceeded" in str(error)


def _last_checkpoint(workdir, todo=None):
  """'the last complete checkpoint is step N in DIR: [TODO and ]run the same command to resume'."""
  todo = f"{todo} and run" if todo else "run"
  try:
    steps = ckpt_lib.complete_steps(workdir)
    where = paths.resolve(workdir) / ckpt_lib.CKPT_SUBDIR
  except ValueError:
    steps, where = [], None
  if steps:
    return (f"the last complete checkpoint is step {steps[-1]} in {where}: {todo} the same "
            "command to resume")
  return (f"no checkpoint was saved{f' in {where}' if where else ''}: {todo} the same command "
          "to start again")


def _prepare_workdir(workdir, cleanup):
  """Creates `workdir` and locks it against a second trainer (process 0 only)."""
  if workdir.exists() and not workdir.is_dir():
    raise ValueError(f"--workdir {workdir} exists and is not a directory: pass a directory.")
  reason = ckpt_lib.unusable_path_reason(workdir)
  if reason:
    raise ValueError(f"--workdir {workdir} has {reason}: use a directory name without it.")
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"Cannot create --workdir {workdir}: {e.strerror or e}.") from None
  cleanup.enter_context(paths.lock_workdir(workdir))


def _positive(name, value, allow_none=False, config=None):
  """`value` (the steps of config key `name`) if >= 1; else a one-line ValueError.

  With `config`, a duration given in another unit (`total_epochs=0`) is named as given.
  """
  if value is None and allow_none:
    return None
  if value is None or value < 1:
    if config is not None and name.endswith("_steps") and config.get(name) is None:
      base = name[:-len("steps")]
      given = next((k for k in (base + u for u in ("epochs", "examples", "percent"))
                    if config.get(k) is not None), None)
      if given:
        raise ValueError(f"config.{given}={config.get(given)} gives {value} steps: it must give "
                         "at least 1.")
    raise ValueError(f"config.{name} must be a positive number of steps, got {value}"
                     f"{' (leave it unset for none)' if allow_none else ''}.")
  return value


def _train(raw_config, workdir, cleanup):
  # ------------------------------------------------------------------ setup
  config = config_loading.TrackedConfig(raw_config)
  distributed.set_cpu_devices(config.get("num_cpu_devices", None))  # Before any backend starts.
  distributed.initialize()  # Before anything touches a backend.
  workdir = paths.resolve(workdir)  # Local (made absolute) or a bucket (gs://..., as given).
  is_main = jax.process_index() == 0
  if is_main:
    _prepare_workdir(workdir, cleanup)
    # config.json is written once the checkpoint (if any) has been read: a run
    # that stops on a bad config must not overwrite the config of the run
    # that made this workdir.
  logging.info("big_vit_lite.train: process %d/%d, %d devices (%s), workdir %s",
               jax.process_index(), jax.process_count(), jax.device_count(),
               jax.devices()[0].device_kind, workdir)
  logging.info("Host memory for XLA buffers: %s", hostmem.status())
  seed = int(config.get("seed", 0))
  writer = metrics_lib.MetricWriter(workdir)

  # ------------------------------------------------------------------- mesh
  mesh = sharding.make_mesh(config.get("mesh", None))
  rules = sharding.make_rules(config.get("sharding_rules", None), mesh)
  logging.info("Mesh %s; rules %s", dict(mesh.shape), rules)
  repl = sharding.replicated(mesh)
  batch_sh = sharding.batch_sharding(mesh)

  # ------------------------------------------------------------------ input
  input_cfg = config.consume("input")
  if input_cfg is None:
    raise ValueError("The config needs an `input` dict (data, batch_size, pp).")
  batch_size = int(input_cfg.batch_size)
  n_batch_dev = sharding.batch_devices(mesh)
  # Also checks the batch divides over the batch devices (its message says what to use).
  accum_steps = grad_accum.check(config.get("grad_accum_steps", 1), batch_size, n_batch_dev)
  train_iter = input_pipeline.make_train_iterator(input_cfg, seed=seed)
  steps_per_epoch = train_iter.num_examples / batch_size
  total_steps = _positive("total_steps", config_loading.get_steps(
      "total", config, steps_per_epoch=steps_per_epoch, batch_size=batch_size, required=True),
                          config=config)
  overridden = [f"total_{u}={config.get(f'total_{u}')}" for u in ("epochs", "examples", "percent")
                if config.get(f"total_{u}") is not None and config.get("total_steps") is not None]
  if overridden:
    logging.info("config.total_steps=%d wins over config.%s.", total_steps, overridden[0])
  dur = dict(steps_per_epoch=steps_per_epoch, batch_size=batch_size, total_steps=total_steps)
  log_steps = _positive("log_training_steps",
                        config_loading.get_steps("log_training", config, default=50, **dur),
                        config=config)
  # Unset or 0: saves only at the end (and on preemption).
  ckpt_steps = config_loading.get_steps("ckpt", config, default=None, **dur)
  if ckpt_steps is not None and ckpt_steps < 0:
    raise ValueError(f"config.ckpt_steps must be >= 0 (0: save only at the end), got {ckpt_steps}.")
  keep_ckpts = _positive("keep_ckpts", int(config.get("keep_ckpts", 3)))  # The last N ...
  # ... plus every step divisible by keep_ckpt_steps.
  keep_every = _positive("keep_ckpt_steps", config_loading.get_steps(
      "keep_ckpt", config, default=None, **dur), allow_none=True, config=config)
  if keep_every and (not ckpt_steps or keep_every % ckpt_steps):
    # Only saved steps can be kept: those divisible by both.
    kept = (f"only the steps divisible by {math.lcm(keep_every, ckpt_steps)} are kept" if ckpt_steps
            else "checkpoints are saved only at the end")
    logging.warning("config.keep_ckpt_steps=%d is not a multiple of config.ckpt_steps=%s: %s "
                    "(besides the last %d); make it a multiple of ckpt_steps.", keep_every,
                    ckpt_steps, kept, keep_ckpts)
  prefetch_size = input_cfg.get("prefetch", 2)
  prefetch_size = 2 if prefetch_size is None else int(prefetch_size)
  logging.info("Training %d steps (%.2f epochs of %d examples), batch %d%s.",
               total_steps, total_steps / steps_per_epoch, train_iter.num_examples, batch_size,
               f" in {accum_steps} microbatches of {batch_size // accum_steps}"
               if accum_steps > 1 else "")

  # ---------------------------------------------------- model and optimizer
  model_mod = _model_module(config.get("model_name", "vit"))
  model_kw = config.consume("model", {})
  model = model_mod.Model(**(model_kw.to_dict() if hasattr(model_kw, "to_dict") else model_kw))
  loss_fn = losses.get(config.get("loss", "softmax_xent"))
  init_head_bias = config.get("init_head_bias", None)
  mixup_cfg = config.consume("mixup", None)
  mixup_fn = _make_mixup(mixup_cfg)
  device_aug_fn = device_aug_lib.make(config.consume("device_aug", None))

  batch_spec = train_iter.batch_spec()
  missing = [k for k in ("image", "labels") if k not in batch_spec]
  if missing:
    raise ValueError(f"the train pp gives {sorted(batch_spec)}, without {missing}: the step needs "
                     "'image' and one-hot 'labels', e.g. end input.pp with "
                     "onehot(K, key='label', key_result='labels')|keep('image', 'labels')")
  image_shape = batch_spec["image"].shape[1:]

  def init_params(rng):
    dummy = jnp.zeros((n_batch_dev,) + tuple(image_shape), jnp.float32)
    params = model.init(rng, dummy)["params"]
    return params

  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    rng = jax.random.PRNGKey(seed)
    rng_init, rng_train = jax.random.split(rng)
    boxed_abstract = jax.eval_shape(init_params, rng_init)
    params_sh = sharding.logical_shardings(boxed_abstract, mesh, rules)
    params_abstract = sharding.unbox(boxed_abstract)
    opt = optim.make(config, params_abstract, **dur)
    opt_abstract = jax.eval_shape(opt.tx.init, params_abstract)
    opt_sh = sharding.like_params_shardings(opt_abstract, params_abstract, params_sh, mesh)
    state_sh = dict(params=params_sh, opt_state=opt_sh, step=repl, rng=repl)
    ema = ema_lib.from_config(config)  # An EMA of the weights in the state, if configured.
    if ema:
      state_sh[ema_lib.KEY] = params_sh
    metrics_lib.log_parameter_overview(params_abstract)
    logging.info("Per-device bytes: params %s, optimizer state %s",
                 f"{sharding.describe(params_sh, params_abstract):,}",
                 f"{sharding.describe(opt_sh, opt_abstract):,}")

    # ------------------------------------------ evaluators, remaining settings
    ema_evals = set()  # The evals that score the EMA params (use_ema=True).
    evaluators = _make_evaluators(config, model, mesh, ema_evals=ema_evals, **dur)
    ema_lib.check_evals(ema, ema_evals)
    model_init = config.get("model_init", None)
    model_load = config.consume("model_load", {}) or {}
    dont_load = tuple(model_load.get("dont_load", ()) or ())
    ckpt_async = bool(config.get("ckpt_async", True))
    profile = _profile_steps(config.get("profile_steps", None))  # (first step, steps) to trace.
    eval_at_start = bool(config.get("eval_at_start", False))
    hang_timeout = config.get("hang_timeout_s", None)
    report = bool(config.get("report", False))  # WORKDIR/report/report.html at each eval.
    if report:
      from big_vit_lite import report as report_lib  # pylint: disable=g-import-not-at-top
      report_lib.require_matplotlib()  # Missing: one line now, not at the first eval.
    # Everything the run uses has been read by now (before the slow compile):
    # a key left unread is a typo or a leftover, and an error.
    config.check_all_read()

    # Params and optimizer state are born sharded: jit with out_shardings
    # makes each device compute only its slice; nothing is materialised whole.
    @functools.partial(jax.jit, out_shardings=params_sh)
    def init_fn(rng):
      params = nn.meta.unbox(init_params(rng))
      if init_head_bias is not None:
        params["head"]["bias"] = jnp.full_like(params["head"]["bias"], init_head_bias)
      return params

    def make_state(params):
      opt_state = jax.jit(opt.tx.init, out_shardings=opt_sh)(params)
      state = dict(params=params, opt_state=opt_state,
                   step=jax.device_put(jnp.zeros([], jnp.int32), repl),
                   rng=jax.device_put(rng_train, repl))
      if ema:
        state[ema_lib.KEY] = ema.init(params, params_sh)
      return state

    # ------------------------------------------------------------ update step
    def update(state, batch):
      step = state["step"]
      rng_step = jax.random.fold_in(state["rng"], step)
      rng_mix, rng_drop = jax.random.split(rng_step)
      images, labels = batch["image"], batch["labels"]
      if device_aug_fn is not None:  # its own key: mixup and dropout keep theirs
        images = device_aug_fn(jax.random.fold_in(rng_step, 1), images)
      if mixup_fn is not None:
        images, labels = mixup_fn(rng_mix, images, labels)

      def loss_of(params, batch, rng):
        logits, _ = model.apply({"params": params}, batch["image"], train=True,
                                rngs={"dropout": rng})
        return loss_fn(logits, batch["labels"])

      loss, grads = grad_accum.value_and_grad(
          loss_of, state["params"], {"image": images, "labels": labels}, rng_drop, accum_steps,
          batch_sharding=batch_sh, param_shardings=params_sh)
      params, opt_state = opt.apply(state["params"], grads, state["opt_state"])
      measurements = {"training_loss": loss, "grad_norm": optax.global_norm(grads),
                      "learning_rate": opt.lr_fn(step)}
      new_state = dict(params=params, opt_state=opt_state, step=step + 1, rng=state["rng"])
      if ema:
        new_state[ema_lib.KEY] = ema.update(state[ema_lib.KEY], params, step)
      return new_state, measurements

    state_abstract = dict(
        params=params_abstract, opt_state=opt_abstract,
        step=jax.ShapeDtypeStruct((), jnp.int32), rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
    if ema:
      state_abstract[ema_lib.KEY] = params_abstract
    state_abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  state_abstract, state_sh)

    # ----------------------------------------------------- checkpoint / resume
    # Before the (slow) compile: a workdir this config cannot resume, a damaged
    # checkpoint or a bad model_init fails in seconds, not after minutes.
    checkpointer = ckpt_lib.Checkpointer(workdir, keep=keep_ckpts, keep_every=keep_every,
                                         async_save=ckpt_async)
    # However the run ends (an eval or the data raising, Ctrl-C), an async save
    # in flight finishes: otherwise the process exits with its step uncommitted.
    cleanup.callback(_finish_saves, checkpointer)
    resume_step = checkpointer.latest_step()
    if resume_step is not None:
      saved_clipped = _check_resumable(checkpointer, resume_step, state_abstract, raw_config,
                                       total_steps, opt)
      # model_init only initialises a fresh run (as in big_vision): say so, not silently.
      logging.info("Resuming from %s/%d%s", checkpointer.directory, resume_step,
                   f"; config.model_init={model_init} is not read again (it only initialises a "
                   "fresh run)" if model_init else "")
      state, data_state = _restore(checkpointer, resume_step, _with_opt_layout(
          state_abstract, opt, saved_clipped))
      state["opt_state"] = optim.clip_relayout(state["opt_state"], saved_clipped, opt.clipped)
      train_iter.set_state(data_state)
    else:
      params = init_fn(rng_init)
      if model_init:
        logging.info("Initialising params from %s (dont_load=%s)", model_init, dont_load)
        init_values = _host_copy(params) if dont_load else params_abstract
        # The patch grid, so that a learned posemb is resampled to this run's
        # (possibly non-square) input, not to the square of its token count.
        patch = model.arch()["patch_size"]
        grid_hw = (image_shape[0] // patch, image_shape[1] // patch)
        loaded = model_mod.load(init_values, model_init, model_kw, dont_load=dont_load,
                                grid_hw=grid_hw)
        params = _global_from_host(loaded, params_sh)
      state = make_state(params)
    if is_main:  # This config now runs in this workdir.
      (workdir / "config.json").write_text(raw_config.to_json_best_effort(indent=2) + "\n")

    # ---------------------------------------------------------------- compile
    batch_abstract = {k: jax.ShapeDtypeStruct((batch_size,) + v.shape[1:], v.dtype, sharding=batch_sh)
                      for k, v in batch_spec.items()}
    if resume_step is not None and resume_step >= total_steps:
      # A finished run started again (e.g. by a scheduler): no step to compile.
      update_compiled = step_flops = xla_flops = peak = None
    else:
      # One compile, reused for every step; donation lets XLA update in place.
      update_traced = jax.jit(update, in_shardings=(state_sh, batch_sh),
                              out_shardings=(state_sh, repl),
                              donate_argnums=(0,)).trace(state_abstract, batch_abstract)
      update_compiled = update_traced.lower().compile()
      # Per device: model FLOPs (matmuls in the jaxpr, for `mfu`) and XLA's (`mfu_xla`).
      step_flops = flops_lib.model_flops(update_traced) / mesh.size
      xla_flops = flops_lib.step_flops(update_traced, update_compiled, num_devices=mesh.size)
      peak = metrics_lib.peak_flops_per_device(dtype=model.dtype_mm)
      logging.info("Train step: %.6g model GFLOP per device (XLA: %s); device peak %s GFLOP/s",
                   step_flops / 1e9, None if xla_flops is None else f"{xla_flops / 1e9:.4g}",
                   None if peak is None else f"{peak / 1e9:.6g}")

    # Drops what a killed earlier attempt logged after the resumed step (or
    # all of it, for a fresh start), in metrics.jsonl and in TensorBoard.
    writer.start_run(resume_step)
    # Device prefetch; its get_state() is the position after the last batch *returned*.
    batches = device_lib.prefetch(train_iter, prefetch_size, mesh)
    cleanup.callback(batches.close)  # (Idempotent; on an error its thread must stop too.)
    first_step = int(jax.device_get(state["step"]))
    # summary.json now ("running") and however the run ends, with the log's summary block.
    run_summary = summary_lib.TrainRun(workdir, total_steps=total_steps, start_step=resume_step,
                                       checkpoint_dir=checkpointer.directory,
                                       image_shape=image_shape, report=report)
    cleanup.push(run_summary.exit)

    # ------------------------------------------------------------------- loop
    # core_hours counts the earlier attempts too (their lines up to the checkpoint are kept).
    chrono = metrics_lib.Chrono(first_step=first_step, total_steps=total_steps,
                                global_batch=batch_size, step_flops=step_flops,
                                peak_flops_total=peak,
                                xla_step_flops=flops_lib.sane_xla_flops(xla_flops, step_flops),
                                core_hours_before=writer.last_value("core_hours"))
    preemption = ckpt_lib.PreemptionWatcher()
    cleanup.callback(preemption.close)
    guard = distributed.HangGuard.from_env(timeout_s=hang_timeout)
    cleanup.callback(guard.stop)
    last_saved = resume_step
    tracing = False
    pending_loss = None  # (step, loss array): checked one step late to keep the pipeline full.

    def check_finite(step, loss):
      value = float(jax.device_get(loss))
      if not math.isfinite(value):
        checkpointer.wait()
        where = (f"the last good checkpoint is step {last_saved} in {checkpointer.directory}"
                 if last_saved is not None else "no checkpoint was saved before it")
        raise TrainingError(f"Non-finite training loss ({value}) at step {step}; {where}. "
                            "Lower config.lr, add warmup or set config.grad_clip_norm.")

    all_finite = jax.jit(lambda t: jnp.all(jnp.stack(
        [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)])))

    def save(step):
      # Never replace a good checkpoint with a poisoned one.
      if not bool(jax.device_get(all_finite(state["params"]))):
        checkpointer.wait()
        raise TrainingError(f"Non-finite parameters after step {step}; the last good checkpoint "
                            f"is step {last_saved} in {checkpointer.directory}. Lower config.lr "
                            "or set config.grad_clip_norm.")
      checkpointer.save(step, state, data_state, raw_config)

    def run_evals(step, final, only=None):
      ran = False
      for name, (evaluator, every) in evaluators.items():
        if only is not None and name not in only:
          continue
        if final or (every and step % every == 0):
          ran = True
          results = evaluator.run(state[ema_lib.KEY if name in ema_evals else "params"])
          writer.write(step, {f"{name}/{k}": v for k, v in results.items()})
          logging.info("[%d] %s: %s", step, name,
                       ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in results.items()))
      if ran and not final:  # (The run's end writes the last one.)
        run_summary.evaluated()  # The report (config.report), with this step's evals.

    if first_step == 0 and evaluators and eval_at_start:
      run_evals(0, final=False)
    due = [name for name, (_, every) in evaluators.items()
           if first_step == total_steps or (every and first_step and first_step % every == 0)]
    if resume_step is not None and due:
      # The run that saved this checkpoint was stopped (killed, preempted,
      # Ctrl-C) before the evals due at its step had all logged.
      missing = [n for n in _evals_not_logged(writer, evaluators, first_step) if n in due]
      if missing:
        logging.info("Running the evals due at step %d that the previous attempt did not log: %s",
                     first_step, missing)
        run_evals(first_step, final=first_step == total_steps, only=missing)
    chrono.tick(first_step)
    step = first_step
    data_state = batches.get_state()
    while step < total_steps:
      if profile and step == profile[0]:
        jax.profiler.start_trace(str(workdir / "profile"))
        tracing = True
      # Implicit host<->device copies in the hot loop are bugs (hidden syncs,
      # per-step transfers): fail loudly instead. Explicit ones are fine.
      with jax.transfer_guard("disallow"):
        batch = next(batches)
        state, measured = update_compiled(state, batch)
      data_state = batches.get_state()
      step += 1
      guard.tick(step)
      if tracing and (step == profile[0] + profile[1] or step == total_steps):
        jax.profiler.stop_trace()
        tracing = False
        logging.info("Wrote a profile of steps %d..%d to %s/profile", profile[0] + 1, step, workdir)
      if pending_loss is not None:
        check_finite(*pending_loss)
      pending_loss = (step, measured["training_loss"])
      final = step == total_steps

      if step % log_steps == 0 or final:
        m = jax.device_get(measured)
        check_finite(step, m["training_loss"])
        m = {k: float(v) for k, v in m.items()}
        m.update(chrono.tick(step))
        m["epoch"] = step / steps_per_epoch
        writer.write(step, m)
        if jax.process_index() == 0:
          logging.info("%s", metrics_lib.progress_line(step, total_steps, m))

      chrono.pause()
      preempted = preemption.reached(step)
      if preempted or final or (ckpt_steps and step % ckpt_steps == 0):
        check_finite(step, measured["training_loss"])
        save(step)
        last_saved = step
      if preempted:  # (The prefetch thread and the hang guard stop on the way out: cleanup.)
        checkpointer.close()
        writer.close()
        if preemption.interrupted:
          raise TrainingInterrupted(f"interrupted (Ctrl-C): saved step {step} to "
                                    f"{checkpointer.directory}; run the same command to resume.")
        logging.warning("Preempted: saved step %d to %s; exiting.", step, checkpointer.directory)
        run_summary.status = "preempted"
        return state["params"]
      run_evals(step, final)
      guard.tick(step)
      chrono.resume()

    checkpointer.close()
    writer.close()
    logging.info("Done: %d steps; checkpoints in %s", step, checkpointer.directory)
    return state["params"]


def _profile_steps(value):
  """config.profile_steps as (first step, number of steps), or None; checked before the compile."""
  if value is None:
    return None
  try:
    first, count = (int(v) for v in value)
    ok = first >= 0 and count >= 1
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise ValueError(f"config.profile_steps={value!r} must be (first step, number of steps), "
                     "e.g. (10, 5).")
  return first, count


def _evals_not_logged(writer, evaluators, step):
  """Names of `evaluators` with no line at `step` in metrics.jsonl (process 0 decides for all)."""
  logged = writer.logged_keys(step)
  mask = np.array([not any(k.startswith(f"{name}/") for k in logged) for name in evaluators],
                  np.int32)
  if jax.process_count() > 1:  # Every process must run the same evals (collectives).
    mask = np.asarray(multihost_utils.broadcast_one_to_all(mask))
  return [name for name, m in zip(evaluators, mask) if m]


def _with_opt_layout(state_abstract, opt, clipped):
  """`state_abstract` with the optimizer state laid out for a chain with(out) the clip."""
  return dict(state_abstract, opt_state=optim.clip_relayout(state_abstract["opt_state"],
                                                            opt.clipped, clipped))


def _check_resumable(checkpointer, step, state_abstract, raw_config, total_steps, opt):
  """Whether the checkpoint at `step` was saved with the gradient clip in its optimizer chain.

  Raises a one-line TrainingError when it cannot continue this config. A
  changed grad_clip_norm (on <-> off) is fine: the clip keeps no state.
  """
  step_dir = checkpointer.step_dir(step)
  try:
    mismatch = checkpointer.state_mismatch(step, state_abstract)
    saved_clipped = opt.clipped
    if mismatch and not checkpointer.state_mismatch(
        step, _with_opt_layout(state_abstract, opt, not opt.clipped)):
      mismatch, saved_clipped = None, not opt.clipped
      logging.info("The checkpoint at step %d was saved %s gradient clipping; this run %s "
                   "(config.grad_clip_norm): its optimizer state carries over as it is.", step,
                   "with" if saved_clipped else "without",
                   "clips" if opt.clipped else "does not clip")
  except Exception as e:  # pylint: disable=broad-except
    raise TrainingError(_damaged(checkpointer, step, e)) from e
  if mismatch:
    changed = _config_changes(checkpointer.saved_config(step),
                              json.loads(raw_config.to_json_best_effort()))
    changed = f"; config changes since it was saved: {changed}" if changed else ""
    raise TrainingError(
        f"Cannot resume from {step_dir}: it was written for another model or optimizer "
        f"({mismatch}){changed}. Use a new --workdir (with config.model_init={step_dir} to "
        "start from its params), or undo the change.")
  if step >= total_steps:
    logging.warning("The checkpoint at step %d is already at or past total_steps=%d: "
                    "nothing to train (raise config.total_steps to train on).", step, total_steps)
  return saved_clipped


def _finish_saves(checkpointer):
  """close() on the way out of a failing run; its own error must not hide the run's."""
  try:
    checkpointer.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("The checkpoint save in flight did not complete: %s", e)


def _restore(checkpointer, step, state_abstract):
  try:
    return checkpointer.restore(step, state_abstract)
  except Exception as e:  # pylint: disable=broad-except
    raise TrainingError(_damaged(checkpointer, step, e)) from e


def _damaged(checkpointer, step, error):
  """One line for a checkpoint that cannot be read (files deleted or truncated after the save)."""
  first_line = ckpt_lib.error_reason(error)
  if len(first_line) > 300:
    first_line = first_line[:300] + "..."
  older = sorted(s for s in checkpointer.all_steps() if s < step)
  where = (f"move it out of {checkpointer.directory} (e.g. to {checkpointer.step_dir(step)}.damaged) "
           f"to resume from step {older[-1]}" if older else
           f"move it out of {checkpointer.directory} to start afresh")
  return f"Cannot read checkpoint {checkpointer.step_dir(step)} ({first_line}); if it is damaged, {where}."


def _config_changes(saved, current, limit=5):
  """'a.b: 16 -> 32, ...' for the leaves that differ between two config dicts."""
  if not saved:
    return ""
  flat_saved, flat_current = dict(_flat_items(saved)), dict(_flat_items(current))
  keys = sorted(k for k in set(flat_saved) | set(flat_current)
                if flat_saved.get(k, "<unset>") != flat_current.get(k, "<unset>"))
  out = [f"{k}: {flat_saved.get(k, '<unset>')} -> {flat_current.get(k, '<unset>')}"
         for k in keys[:limit]]
  return ", ".join(out) + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def _flat_items(tree, prefix=""):
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      yield from _flat_items(v, f"{prefix}{k}.")
    else:
      yield prefix + k, json.dumps(v)


def _make_mixup(mixup_cfg):
  """mixup/cutmix applied in the jitted step, or None when not configured.

  config.mixup = dict(mixup_alpha=0.2, cutmix_alpha=0.0, switch_prob=0.5)
  (data/mixup.py's mixup_or_cutmix; big_vision's `p` is accepted for mixup_alpha).
  """
  if not mixup_cfg:
    return None
  kw = mixup_cfg.to_dict() if hasattr(mixup_cfg, "to_dict") else dict(mixup_cfg)
  if "p" in kw:
    kw["mixup_alpha"] = kw.pop("p")
  try:
    functools.partial(mixup_lib.mixup_or_cutmix, **kw)(  # Checks the keys now, not in the step.
        jax.random.PRNGKey(0), jnp.zeros((2, 1, 1, 1)), jnp.zeros((2, 2)))
  except TypeError as e:
    raise ValueError(f"config.mixup: {e}") from None
  return functools.partial(mixup_lib.mixup_or_cutmix, **kw)


def _make_evaluators(config, model, mesh, ema_evals=None, **dur):
  """{name: (Evaluator, every_n_steps)} from config.evals; adds use_ema=True ones to ema_evals."""
  evals_cfg = config.get("evals", None)
  if evals_cfg is None:
    return {}

  def predict_fn(params, images):
    return model.apply({"params": params}, images, train=False)

  out = {}
  for name in evals_cfg.keys():
    cfg = evals_cfg[name]
    if not isinstance(cfg, config_loading.TrackedConfig):
      raise ValueError(f"config.evals.{name} must be a dict of the eval's settings, got {cfg!r}.")
    # As in big_vision: an entry named after an evaluator type needs no `type`.
    type_name = cfg.get("type", None) or (name if name in evaluators_lib.available() else None)
    if type_name is None:
      raise ValueError(f"config.evals.{name} needs a `type` (e.g. 'classification').")
    every = config_loading.get_steps("log", cfg, **dur)
    if every is not None and every < 0:
      raise ValueError(f"config.evals.{name}.log_steps must be >= 0 (0 or unset: only at the "
                       f"end), got {every}.")
    kwargs = {k: v for k, v in cfg.consume().items()
              if k not in ("type",) and not k.startswith("log_")}
    kwargs = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in kwargs.items()}
    if kwargs.pop("use_ema", False) and ema_evals is not None:
      ema_evals.add(name)
    cls = evaluators_lib.get_evaluator_cls(type_name)
    try:
      out[name] = (cls(predict_fn, mesh=mesh, **kwargs), every)
    except TypeError as e:
      raise ValueError(f"config.evals.{name} (type {type_name}): {e}") from None
  return out


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=functools.partial(config_loading.parse_flags,
                                               prog="big_vit_lite.train"))
