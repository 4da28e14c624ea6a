"""The trainer's config read into frozen values: the job, its inputs, the model, the settings."""

import dataclasses
import functools
import importlib

from absl import logging
import jax
import jax.numpy as jnp

from big_vit_lite.config import config_loading
from big_vit_lite.trainer import distill as distill_lib
from big_vit_lite.runtime import distributed
from big_vit_lite.trainer import ema as ema_lib
from big_vit_lite import evaluators as evaluators_lib
from big_vit_lite.trainer import grad_accum
from big_vit_lite.runtime import hostmem
from big_vit_lite.trainer import losses
from big_vit_lite.trainer import optim
from big_vit_lite.logs import metrics as metrics_lib
from big_vit_lite.runtime import paths
from big_vit_lite.trainer import profiling
from big_vit_lite.trainer import resume
from big_vit_lite.trainer import train_state
from big_vit_lite.runtime import sharding
from big_vit_lite.logs import wandb_writer
from big_vit_lite.data import device_aug as device_aug_lib
from big_vit_lite.data import input_pipeline
from big_vit_lite.data import mixup as mixup_lib


@dataclasses.dataclass(frozen=True)
class Job:
  """Where the run lives: the workdir, its metric writer, the mesh and its shardings."""

  workdir: object
  seed: int
  writer: metrics_lib.MetricWriter
  mesh: jax.sharding.Mesh
  rules: object  # The logical-axis rules (sharding.make_rules).
  repl: jax.sharding.Sharding  # Replicated over the mesh.
  # The batch dimension split over the batch devices.
  batch_sh: jax.sharding.Sharding


def start_job(config, workdir, cleanup) -> Job:
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
  return Job(
      workdir=workdir,
      seed=int(config.get("seed", 0)),
      writer=writer,
      mesh=mesh,
      rules=rules,
      repl=sharding.replicated(mesh),
      batch_sh=sharding.batch_sharding(mesh),
  )


@dataclasses.dataclass(frozen=True)
class Inputs:
  """The training data and the step counts read with it."""

  train_iter: object  # input_pipeline.make_train_iterator's iterator.
  batch_size: int
  accum_steps: int
  steps_per_epoch: float
  total_steps: int
  log_steps: int
  # None or 0: only at the end (and on preemption).
  ckpt_steps: int | None
  keep_ckpts: int
  keep_every: int | None
  prefetch_size: int

  @property
  def dur(self):
    """What config_loading.get_steps needs to turn epochs/examples/percent into steps."""
    return dict(
        steps_per_epoch=self.steps_per_epoch,
        batch_size=self.batch_size,
        total_steps=self.total_steps,
    )


def read_inputs(config, *, mesh, seed):
  """Opens the training data and reads how many steps to train, log and checkpoint."""
  input_cfg = config.consume("input")
  batch_size = (input_cfg or {}).get("batch_size")
  for key, value in (("input", input_cfg), ("input.batch_size", batch_size)):
    if value is None:
      raise ValueError(
          f"The config sets no config.{key}: the training data needs config.input = "
          "dict(data=dict(name=..., split=...), batch_size=..., pp=...), as in "
          "configs/demo.py."
      )
  batch_size = int(batch_size)
  # Also checks the batch divides over the batch devices (its message says what
  # to use).
  accum_steps = grad_accum.check(
      config.get("grad_accum_steps", 1),
      batch_size,
      sharding.batch_devices(mesh),
  )
  train_iter = input_pipeline.make_train_iterator(input_cfg, seed=seed)
  dur = read_duration(
      config, batch_size=batch_size, num_examples=train_iter.num_examples
  )
  steps_per_epoch, total_steps = dur["steps_per_epoch"], dur["total_steps"]
  log_steps = positive(
      "log_training_steps",
      config_loading.get_steps("log_training", config, default=50, **dur),
  )
  # None or 0: only at the end (and on preemption).
  ckpt_steps = config_loading.get_steps("ckpt", config, default=None, **dur)
  # Last N checkpoints ...
  keep_ckpts = positive("keep_ckpts", int(config.get("keep_ckpts", 3)))
  # ... plus every step divisible by keep_ckpt_steps (and by ckpt_steps: only
  # saved steps).
  keep_every = positive(
      "keep_ckpt_steps",
      config_loading.get_steps("keep_ckpt", config, default=None, **dur),
      allow_none=True,
  )
  prefetch_size = input_cfg.get("prefetch", None)
  if prefetch_size is None:
    prefetch_size = 2
  if accum_steps > 1:
    microbatches = (
        f" in {accum_steps} microbatches of {batch_size // accum_steps}"
    )
  else:
    microbatches = ""
  logging.info(
      "Training %d steps (%.2f epochs of %d examples), batch %d%s.",
      total_steps,
      total_steps / steps_per_epoch,
      train_iter.num_examples,
      batch_size,
      microbatches,
  )
  return Inputs(
      train_iter=train_iter,
      batch_size=batch_size,
      accum_steps=accum_steps,
      steps_per_epoch=steps_per_epoch,
      total_steps=total_steps,
      log_steps=log_steps,
      ckpt_steps=ckpt_steps,
      keep_ckpts=keep_ckpts,
      keep_every=keep_every,
      prefetch_size=prefetch_size,
  )


def make_model(
    config, *, batch_spec, mesh, rules, target=None
) -> train_state.Model:
  """The model from config.model_name/model, its loss, mixup and on-device augmentation.

  batch_spec: the train iterator's batch_spec(); mesh, rules: the job's.
  target: None to run here; or the platform the step is planned for ("tpu", "gpu": `plan`
  on abstract devices): the model's "auto" settings are decided for it, and a
  distillation teacher's params stay abstract (shapes and shardings, never placed).
  """
  name = config.get("model_name", "vit")
  if name != "vit":
    raise ValueError(f"model_name={name!r}: only 'vit' is supported.")
  model_mod = importlib.import_module("big_vit_lite.models.vit")
  model_kw = config.consume("model", {})
  if hasattr(model_kw, "to_dict"):
    module = model_mod.Model(**model_kw.to_dict())
  else:
    module = model_mod.Model(**model_kw)
  backend = jax.default_backend()
  if target is not None:
    backend = target
    # The settings the model takes there, decided here.
    module = module.clone(
        dtype_mm=module.resolved_dtype_mm(target),
        dtype_act=module.resolved_dtype_act(target),
        attention=module.resolved_attention(target),
    )
  if module.resolved_attention() == "splash" and backend != "tpu":
    raise ValueError(
        f"model.attention='splash' runs Pallas TPU kernels; this backend is "
        f"{backend}: use 'auto' (or 'xla', 'custom') here"
    )
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
  n_batch_dev = sharding.batch_devices(mesh)

  teacher = distill_lib.from_config(
      config.consume("distill", None),
      mesh,
      rules,
      labels.shape[-1],
      image_shape,
      module,
      place=target is None,
  )

  init_module = module
  if target is not None and module.attention == "cudnn":
    # The same params; their shapes traced on this host without the cuDNN
    # library.
    init_module = module.clone(attention="xla")

  def init_params(rng):
    images = jnp.zeros((n_batch_dev,) + tuple(image_shape), jnp.float32)
    return init_module.init(rng, images)["params"]

  if teacher:
    # Feature distillation's projection joins the student's params.
    init_params = teacher.with_projection(init_params)
  return train_state.Model(
      model_mod=model_mod,
      model_kw=model_kw,
      module=module,
      loss_fn=losses.get(config.get("loss", "softmax_xent")),
      init_head_bias=config.get("init_head_bias"),
      mixup_fn=mixup_lib.make_mixup(config.consume("mixup", None)),
      device_aug_fn=device_aug_lib.make(config.consume("device_aug", None)),
      batch_spec=batch_spec,
      image_shape=image_shape,
      init_params=init_params,
      distill=teacher,
  )


def read_duration(config, *, batch_size, num_examples) -> dict:
  """The run's length, as Inputs.dur: steps_per_epoch, batch_size and total_steps.

  config.total_steps wins over total_epochs/examples/percent (said in the log).
  """
  steps_per_epoch = num_examples / batch_size
  total_steps = positive(
      "total_steps",
      config_loading.get_steps(
          "total",
          config,
          steps_per_epoch=steps_per_epoch,
          batch_size=batch_size,
          required=True,
      ),
  )
  for other in ("total_epochs", "total_examples", "total_percent"):
    if config.get("total_steps") is not None and config.get(other) is not None:
      logging.info(
          "config.total_steps=%d wins over config.%s=%s.",
          total_steps,
          other,
          config.get(other),
      )
  return dict(
      steps_per_epoch=steps_per_epoch,
      batch_size=batch_size,
      total_steps=total_steps,
  )


def lay_out(config, *, model, mesh, rules, seed, dur, unsplit=None):
  """train_state.lay_out with the config's optimizer and EMA slot.

  The optimizer is optim.make over the run's length `dur` (read_duration's dict).
  The trainer and the planner both lay out their state here, so they hold the same one.
  """
  return train_state.lay_out(
      model=model,
      mesh=mesh,
      rules=rules,
      seed=seed,
      make_opt=functools.partial(optim.make, config, **dur),
      ema=ema_lib.from_config(config),
      unsplit=unsplit,
  )


def positive(name, value, allow_none=False):
  """`value` (the steps of config key `name`) if >= 1; else a one-line ValueError."""
  if (value is None and allow_none) or (value is not None and value >= 1):
    return value
  raise ValueError(
      f"config.{name} must be a positive number of steps, got {value}"
      f"{' (leave it unset for none)' if allow_none else ''}."
  )


def make_evaluators(config, model, mesh, ema=None, **dur):
  """{name: (Evaluator, every_n_steps, the state's key it scores)} from config.evals.

  The key is "params", or ema.KEY for an eval with use_ema=True (the run's `ema` must be set).
  """
  evals_cfg = config.get("evals", None)
  if evals_cfg is None:
    return {}

  def predict_fn(params, images):
    return model.apply({"params": params}, images, train=False)

  out = {}
  for name in evals_cfg.keys():
    cfg = evals_cfg[name]
    # As in big_vision: an entry named after an evaluator type needs no `type`.
    type_name = cfg.get("type", None) or name
    every = config_loading.get_steps("log", cfg, **dur)
    kwargs = {
        k: v.to_dict() if hasattr(v, "to_dict") else v
        for k, v in cfg.consume().items()
        if k != "type" and not k.startswith("log_")
    }
    key = ema_lib.KEY if kwargs.pop("use_ema", False) else "params"
    if key == ema_lib.KEY and ema is None:
      raise ValueError(
          f"config.evals.{name}.use_ema=True, but the run keeps no EMA of the "
          "weights: set config.ema_decay (e.g. 0.9999)."
      )
    try:
      cls = evaluators_lib.get_evaluator_cls(type_name)
      out[name] = cls(predict_fn, mesh=mesh, **kwargs), every, key
    except TypeError as e:
      raise ValueError(f"config.evals.{name} (type {type_name}): {e}") from None
  return out


@dataclasses.dataclass(frozen=True)
class Settings:
  """The evaluators and the remaining knobs: the last of the config that the run reads."""

  evaluators: dict  # {name: (Evaluator, every_n_steps, "params" or "ema")}
  model_init: str | None
  dont_load: tuple
  ckpt_async: bool
  eval_at_start: bool
  hang_timeout: float | None
  report: bool  # WORKDIR/report/report.html at each eval.
  profile_steps: tuple  # Steps traced by jax.profiler (profiling.py).
  wandb: object  # config.wandb (wandb_writer.py), checked; or None.


def read_settings(config, *, model, ema, mesh, dur):
  """Builds the evaluators, reads the rest of the config and fails on keys nothing read.

  model: the flax module the evaluators run; ema: the run's ema.Ema or None;
  dur: Inputs.dur (for evaluators' log_epochs and the like).
  """
  evaluators = make_evaluators(config, model, mesh, ema=ema, **dur)
  model_load = config.consume("model_load", {}) or {}
  settings = Settings(
      evaluators=evaluators,
      model_init=config.get("model_init"),
      dont_load=tuple(model_load.get("dont_load", ()) or ()),
      ckpt_async=bool(config.get("ckpt_async", True)),
      eval_at_start=bool(config.get("eval_at_start", False)),
      hang_timeout=config.get("hang_timeout_s"),
      report=bool(config.get("report", False)),
      profile_steps=profiling.parse_steps(config.get("profile_steps", None)),
      wandb=config.consume("wandb", None),
  )
  # A bad one: one line now, not after the compile.
  wandb_writer.check(settings.wandb)
  if settings.report:
    from big_vit_lite import report as report_lib  # pylint: disable=g-import-not-at-top
    # Missing: one line now, not at the first eval.
    report_lib.require_matplotlib()
  # Everything the run uses has been read by now (before the slow compile):
  # a key left unread is a typo or a leftover, and an error.
  config.check_all_read()
  return settings
