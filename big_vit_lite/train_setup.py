"""The trainer's config read into what it runs: step counts, mixup, evaluators, other knobs."""

import dataclasses
import functools

from absl import logging
import jax
import jax.numpy as jnp

from big_vit_lite import config_loading
from big_vit_lite import ema as ema_lib
from big_vit_lite import evaluators as evaluators_lib
from big_vit_lite import grad_accum
from big_vit_lite import metrics as metrics_lib
from big_vit_lite import profiling
from big_vit_lite import sharding
from big_vit_lite import wandb_writer
from big_vit_lite.data import input_pipeline
from big_vit_lite.data import mixup as mixup_lib


@dataclasses.dataclass
class Run:
  """Where and how long: the workdir, mesh, training data and step counts."""

  workdir: object
  seed: int
  writer: metrics_lib.MetricWriter
  mesh: jax.sharding.Mesh
  rules: object
  repl: jax.sharding.Sharding  # Replicated over the mesh.
  # The batch dimension split over the batch devices.
  batch_sh: jax.sharding.Sharding
  train_iter: object = None
  batch_size: int = 0
  accum_steps: int = 1
  steps_per_epoch: float = 0.0
  total_steps: int = 0
  log_steps: int = 0
  # None or 0: only at the end (and on preemption).
  ckpt_steps: int | None = None
  keep_ckpts: int = 0
  keep_every: int | None = None
  prefetch_size: int = 2

  @property
  def dur(self):
    """What config_loading.get_steps needs to turn epochs/examples/percent into steps."""
    return dict(
        steps_per_epoch=self.steps_per_epoch,
        batch_size=self.batch_size,
        total_steps=self.total_steps,
    )


def read_input_and_schedule(config, run):
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
  run.batch_size = batch_size = int(input_cfg.batch_size)
  # Also checks the batch divides over the batch devices (its message says what
  # to use).
  run.accum_steps = grad_accum.check(
      config.get("grad_accum_steps", 1),
      batch_size,
      sharding.batch_devices(run.mesh),
  )
  run.train_iter = input_pipeline.make_train_iterator(input_cfg, seed=run.seed)
  run.steps_per_epoch = run.train_iter.num_examples / batch_size
  run.total_steps = positive(
      "total_steps",
      config_loading.get_steps(
          "total",
          config,
          steps_per_epoch=run.steps_per_epoch,
          batch_size=batch_size,
          required=True,
      ),
  )
  for other in ("total_epochs", "total_examples", "total_percent"):
    if config.get("total_steps") is not None and config.get(other) is not None:
      logging.info(
          "config.total_steps=%d wins over config.%s=%s.",
          run.total_steps,
          other,
          config.get(other),
      )
  run.log_steps = positive(
      "log_training_steps",
      config_loading.get_steps("log_training", config, default=50, **run.dur),
  )
  # None or 0: only at the end (and on preemption).
  run.ckpt_steps = config_loading.get_steps(
      "ckpt", config, default=None, **run.dur
  )
  # Last N
  run.keep_ckpts = positive("keep_ckpts", int(config.get("keep_ckpts", 3)))
  # ... plus every step divisible by keep_ckpt_steps (and by ckpt_steps: only
  # saved steps).
  run.keep_every = positive(
      "keep_ckpt_steps",
      config_loading.get_steps("keep_ckpt", config, default=None, **run.dur),
      allow_none=True,
  )
  run.prefetch_size = (
      2 if input_cfg.get("prefetch", None) is None else input_cfg.prefetch
  )
  logging.info(
      "Training %d steps (%.2f epochs of %d examples), batch %d%s.",
      run.total_steps,
      run.total_steps / run.steps_per_epoch,
      run.train_iter.num_examples,
      batch_size,
      f" in {run.accum_steps} microbatches of {batch_size // run.accum_steps}"
      if run.accum_steps > 1
      else "",
  )


def positive(name, value, allow_none=False):
  """`value` (the steps of config key `name`) if >= 1; else a one-line ValueError."""
  if (value is None and allow_none) or (value is not None and value >= 1):
    return value
  raise ValueError(
      f"config.{name} must be a positive number of steps, got {value}"
      f"{' (leave it unset for none)' if allow_none else ''}."
  )


def make_mixup(mixup_cfg):
  """mixup/cutmix applied in the jitted step, or None when not configured.

  config.mixup = dict(mixup_alpha=0.2, cutmix_alpha=0.0, switch_prob=0.5)
  (data/mixup.py's mixup_or_cutmix; big_vision's `p` is accepted for mixup_alpha).
  """
  if not mixup_cfg:
    return None
  kw = dict(mixup_cfg.to_dict() if hasattr(mixup_cfg, "to_dict") else mixup_cfg)
  if "p" in kw:
    kw["mixup_alpha"] = kw.pop("p")
  mix = functools.partial(mixup_lib.mixup_or_cutmix, **kw)
  try:  # Checks the keys now, before the compile.
    mix(jax.random.PRNGKey(0), jnp.zeros((2, 1, 1, 1)), jnp.zeros((2, 2)))
  except TypeError as e:  # An unknown key.
    raise ValueError(f"config.mixup: {e}") from None
  return mix


def make_evaluators(config, model, mesh, ema=None, **dur):
  """{name: (Evaluator, every_n_steps, the state's key it scores)} from config.evals.

  The key is "params", or ema.KEY for an eval with use_ema=True (the run's `ema` must be set).
  """
  evals_cfg = config.get("evals", None)

  def predict_fn(params, images):
    return model.apply({"params": params}, images, train=False)

  out = {}
  for name in (evals_cfg.keys() if evals_cfg is not None else ()):
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


@dataclasses.dataclass
class Settings:
  """The evaluators and the remaining knobs: the last of the config that the run reads."""

  evaluators: dict  # {name: (Evaluator, every_n_steps, "params" or "ema")}
  model_init: str | None
  dont_load: tuple
  ckpt_async: bool
  eval_at_start: bool
  hang_timeout: float | None
  report: bool  # WORKDIR/report/report.html at each eval.
  profile_steps: tuple = ()  # Steps traced by jax.profiler (profiling.py).
  wandb: object = None  # config.wandb (wandb_writer.py), checked.


def read_settings(config, run, parts):
  """Builds the evaluators, reads the rest of the config and fails on keys nothing read."""
  evaluators = make_evaluators(
      config, parts.model, run.mesh, ema=parts.ema, **run.dur
  )
  model_load = config.consume("model_load", {}) or {}
  settings = Settings(
      evaluators,
      model_init=config.get("model_init"),
      report=bool(config.get("report", False)),
      ckpt_async=bool(config.get("ckpt_async", True)),
      hang_timeout=config.get("hang_timeout_s"),
      dont_load=tuple(model_load.get("dont_load", ()) or ()),
      eval_at_start=bool(config.get("eval_at_start", False)),
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
