r"""Evaluate a checkpoint: few-shot, linear probe or classification, no training.

  python -m big_vit_lite.evaluate --config=configs/fewshot.py --workdir=OUT \
      --config.model_init=SRC

SRC: a training workdir (its newest checkpoint), a step directory, an .npz (vision_transformer,
big_vision, SigLIP / LiT image tower, pre-linen) or a timm .safetensors; read once. The model:
the run's saved config, else the architecture read off the param shapes; non-None entries of
the eval config's `model` override both (e.g. --config.model.gelu=tanh). It runs at the
resolution (or patch grid) and channels it was trained with: an eval pp giving other images is
a one-line error naming the values (configs/fewshot.py:res=R,channels=C). A checkpoint without
a head takes fewshot and linear_probe only. --config.use_ema=True evaluates a run's EMA weights.

Results: OUT/metrics.jsonl (one line at the checkpoint's step, keys "EVAL_NAME/KEY"; evaluating
a step again replaces its numbers), TensorBoard and a printed table. A failed eval or Ctrl-C (exit
status 130) keeps the results of those that finished and says which. OUT/summary.json says how
it ended (unless OUT holds a training run's, which stays). Why some things are done the way they
are: benchmarks/NOTES.md, section "Evaluators, evaluate, predict, export".
"""

import functools
import gc
import os
import re
import signal
import sys
import threading
import time


def _exit_interrupted(reason):
  # Not sys.exit: tearing down the interpreter after an interrupted XLA dispatch
  # or tf.data pipeline can crash (a segfault, exit status -11) instead of
  # exiting 130.
  print(f"big_vit_lite.evaluate: {reason}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(130)  # pylint: disable=protected-access


if __name__ == "__main__":
  # Ctrl-C during the imports (seconds of them) or the config parsing: no
  # traceback.
  signal.signal(
      signal.SIGINT,
      lambda *_: _exit_interrupted(
          # main() sets its own.
          "interrupted (Ctrl-C) while starting; nothing was written."
      ),
  )
  # First, before jax and TF load: once more with huge pages.
  from big_vit_lite.runtime import hostmem  # pylint: disable=g-import-not-at-top

  hostmem.use_huge_pages(__file__)

from absl import app
from absl import flags
from absl import logging
import flax.linen as nn
import jax

from big_vit_lite.config import config_loading
from big_vit_lite.logs import console
from big_vit_lite.logs import metrics
from big_vit_lite.runtime import oom
from big_vit_lite.runtime import paths
from big_vit_lite.runtime import sharding
from big_vit_lite.logs import summary
from big_vit_lite import evaluators
from big_vit_lite.evaluators import presets
from big_vit_lite.models import loading

_CONFIG = _WORKDIR = None  # flag holders, defined by _define_flags()


# Only when run as a command: no clash with other CLIs' flags.
def _define_flags():
  global _CONFIG, _WORKDIR
  _CONFIG = config_loading.define_config_flag(
      help_string="Evaluation config file (FILE.py[:arg]), e.g. configs/fewshot.py."
  )
  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "Where metrics.jsonl and TensorBoard go."
  )


# Eval types whose every result is an accuracy: shown in percent, as few-shot's.
ACCURACY_TYPES = ("fewshot", "linear_probe")


def _percent_cell(value):
  """A 9-wide table cell: the accuracy in percent, or "-" where there is none."""
  if value is None:
    return f"{'-':>9}"
  return f"{100 * value:8.2f}%"


def format_table(results, accuracies=()):
  """Readable text for {eval_name: {key: value}}; few-shot keys as datasets x shots.

  accuracies: the eval names whose values are accuracies (in percent). A key's
  pixel baseline (KEY_pixels, pixel_baseline=True) is shown beside it.
  """
  suffix = presets.PIXELS_SUFFIX
  lines = []
  for name, res in results.items():
    lines.append(f"== {name}")
    shots = {}
    for k, v in res.items():
      base = k.removesuffix(suffix)
      if k.endswith(suffix) and base in res:
        continue  # In its key's line.
      pixels = res.get(k + suffix)
      if m := re.fullmatch(r"(.+)_(\d+)shot", k):
        shots.setdefault(m.group(1), {})[int(m.group(2))] = (v, pixels)
      elif name in accuracies:
        line = f"  {k:<24}{_percent_cell(v)}"
        if pixels is not None:
          line += f"  (pixels {100 * pixels:.2f}%)"
        lines.append(line)
      else:
        lines.append(f"  {k:<24}{v:9.4f}")
    if shots:
      cols = sorted({s for d in shots.values() for s in d})
      # A "pixels" column after each shot count that has a baseline.
      with_pixels = {
          s for d in shots.values() for s, (_, p) in d.items() if p is not None
      }
      width = max(len("dataset"), *map(len, shots))
      head = f"  {'dataset':<{width}}"
      for s in cols:
        head += f"{f'{s}-shot':>9}"
        if s in with_pixels:
          head += f"{'pixels':>9}"
      lines.append(head)
      for ds, by_shot in shots.items():
        row = f"  {ds:<{width}}"
        for s in cols:
          value, pixels = by_shot.get(s, (None, None))
          row += _percent_cell(value)
          if s in with_pixels:
            row += _percent_cell(pixels)
        lines.append(row)
  return "\n".join(lines)


class Interrupted(Exception):
  """Ctrl-C during the evals; the message says which results were written (exit 130)."""


class _CtrlC:
  """The SIGINT handler of main(): raises KeyboardInterrupt, and remembers it.

  Inside a garbage-collection callback (jax has one) or a __del__, Python would swallow
  the exception: there it only sets `pressed`, which the evals check between evals.
  """

  pressed = False

  def __call__(self, _, frame):
    self.pressed = True
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
      if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
        return
      frame = frame.f_back
    raise KeyboardInterrupt

  def check(self):
    if self.pressed:
      raise KeyboardInterrupt


_CTRL_C = _CtrlC()


def _drop_earlier_results(workdir, step, keys):
  """Removes `keys` from metrics.jsonl's rows at `step`: evaluating a step again replaces them.

  Rows left with only "step" go; others stay. Rewritten (through a rename, so a kill
  cannot lose the file) only when something changes.
  """
  rows = metrics.read_metrics(workdir)
  if any(r["step"] == step and keys & r.keys() for r in rows):
    rows = [
        {k: v for k, v in r.items() if r["step"] != step or k not in keys}
        for r in rows
    ]
    metrics.rewrite_metrics(workdir, [r for r in rows if len(r) > 1])


def write_results(workdir, step, results):
  """One metrics.jsonl line (and TensorBoard scalars) for {eval_name: {key: value}}."""
  row = {f"{n}/{k}": v for n, r in results.items() for k, v in r.items()}
  # A Ctrl-C now would leave the results written or not: no one could tell.
  main = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
  try:
    writer = metrics.MetricWriter(workdir)
    if jax.process_index() == 0:
      _drop_earlier_results(workdir, step, set(row))
    writer.write(step, row)
    writer.close()
  finally:
    if main:
      if previous is None:  # A handler not set from Python.
        previous = signal.default_int_handler
      signal.signal(signal.SIGINT, previous)
  return writer.path


def _eval_entries(cfg):
  """{name: (Evaluator class, type, kwargs)} of config.evals, checked before any data is read."""
  entries = {}
  for name in cfg.raw.evals:
    entry = cfg.evals[name]
    if not isinstance(entry, config_loading.TrackedConfig):
      raise ValueError(
          f"evals.{name} must be a dict of the eval's settings, e.g. "
          f"dict(type='fewshot', ...), got {entry!r}."
      )
    ecfg = entry.to_dict()  # marks the whole entry read
    etype = ecfg.pop("type", None)
    if etype is None and name in evaluators.available():
      etype = (
          name  # Like big_vision, an entry named after a type needs no `type`.
      )
    if etype is None:
      raise ValueError(
          f"evals.{name} needs a `type` (one of {', '.join(evaluators.available())})."
      )
    # log_steps / _epochs / _percent ...: only the trainer schedules evals.
    ecfg = {k: v for k, v in ecfg.items() if not k.startswith("log_")}
    entries[name] = (evaluators.get_evaluator_cls(etype), etype, ecfg)
  return entries


def _make_evaluators(entries, model, mesh, cfg):
  """{name: Evaluator} on the model's predict_fn; a config mistake names its entry."""
  # Before the evaluators read any data (fewshot reads its labels).
  cfg.check_all_read()
  out = {}
  for name, (cls, etype, ecfg) in entries.items():
    try:
      out[name] = cls(model.predict_fn, mesh=mesh, **ecfg)
    except (TypeError, ValueError) as e:
      raise ValueError(f"evals.{name} (type {etype}): {e}") from None
  return out


def _run_evals(evaluators_by_name, model, mesh, rules, workdir, src):
  """Runs the evals and writes their results; on an error or Ctrl-C, those that finished."""
  results, running, t0, step = {}, None, time.time(), model.step
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      for name, evaluator in evaluators_by_name.items():
        _CTRL_C.check()
        running = name
        logging.info("Running eval %s ...", name)
        results[name] = {
            k: float(v) for k, v in evaluator.run(model.params).items()
        }
        running = None
      _CTRL_C.check()
  except BaseException as e:  # Keep what finished; say so in the one line.
    done = (
        f"the results of {', '.join(results)} were written to "
        f"{write_results(workdir, step, results)}"
        if results
        else f"nothing was written to {paths.resolve(workdir) / 'metrics.jsonl'}"
    )
    error = f"evals.{running}: {e}" if running else str(e) or type(e).__name__
    summary.write_evaluate(
        workdir,
        source=src,
        step=step,
        results=results,
        error=error,
        seconds=time.time() - t0,
        interrupted=isinstance(e, KeyboardInterrupt),
    )
    if isinstance(e, KeyboardInterrupt):
      where = f" during evals.{running}" if running else ""
      raise Interrupted(f"interrupted (Ctrl-C){where}; {done}.") from None
    if isinstance(e, ValueError) and running:
      raise ValueError(
          f"evals.{running}: {str(e).rstrip('.')}; {done}."
      ) from None
    logging.error("evals.%s failed; %s.", running, done)
    raise
  write_results(workdir, step, results)
  summary.write_evaluate(
      workdir, source=src, step=step, results=results, seconds=time.time() - t0
  )
  return results


def evaluate(config, workdir):
  """Runs every evaluator of `config.evals` on `config.model_init`; returns {name: results}."""
  from big_vit_lite.runtime import distributed  # pylint: disable=g-import-not-at-top
  # Multi-process runs (launch/local.sh, pods): before any backend use.
  distributed.initialize()
  cfg = config_loading.TrackedConfig(config)
  src = cfg.get("model_init")
  if not src:
    raise ValueError(
        "Set the checkpoint to evaluate: --config.model_init=SRC (a training "
        "workdir, a checkpoint step directory or an .npz)."
    )
  if "evals" not in cfg or not len(cfg.raw.evals):
    raise ValueError("The config has no `evals`: nothing to evaluate.")
  # Now, not after the evals: an OUT that cannot be written.
  if jax.process_index() == 0:
    metrics.MetricWriter(workdir).path.open("a").close()
  # The entries first: a mistake there stops before a large checkpoint is read.
  entries = _eval_entries(cfg)
  mesh = sharding.make_mesh(cfg.get("mesh"))
  rules = sharding.make_rules(cfg.get("sharding_rules"), mesh)
  weights = "params"
  if cfg.get("use_ema", False):
    weights = "ema"
  model = loading.load_model(src, weights, cfg, mesh, rules)
  return _run_evals(
      _make_evaluators(entries, model, mesh, cfg),
      model,
      mesh,
      rules,
      workdir,
      src,
  )


def main(argv):
  # Other libraries' INFO lines (orbax, tfds) only with --verbosity=1.
  console.keep_log_readable()
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  if _CONFIG.value is None:
    raise app.UsageError("--config=configs/FILE.py is required.")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir=OUT is required.")
  # Ctrl-C from here on raises KeyboardInterrupt, so the evals can keep what
  # finished.
  signal.signal(signal.SIGINT, _CTRL_C)
  try:
    config = config_loading.loaded(_CONFIG.value)
    results = evaluate(config, _WORKDIR.value)
  except Interrupted as e:
    _exit_interrupted(str(e))
  except KeyboardInterrupt:
    _exit_interrupted("interrupted (Ctrl-C); nothing was written.")
  except (
      ValueError,
      OSError,
      config_loading.UnreadConfigKeyError,
      jax.errors.JaxRuntimeError,
  ) as e:
    if isinstance(e, jax.errors.JaxRuntimeError) and not oom.is_oom(e):
      raise
    # One line on stderr and a non-zero exit; the full traceback only at -v 1.
    logging.debug("evaluate failed", exc_info=True)
    if oom.is_oom(e):
      e = oom.message(e, what="evaluation", advice=oom.EVAL_ADVICE)
    print(
        f"big_vit_lite.evaluate: error: {' '.join(str(e).split())}",
        file=sys.stderr,
    )
    sys.exit(1)
  # The results are written; no traceback from the exit either.
  signal.signal(
      signal.SIGINT,
      lambda *_: _exit_interrupted(
          "interrupted (Ctrl-C) after the results were written."
      ),
  )
  if jax.process_index() == 0:
    accuracies = [
        name
        for name, entry in config.evals.items()
        if entry.get("type") in ACCURACY_TYPES
    ]
    print(format_table(results, accuracies))
    print(f"(written to {paths.resolve(_WORKDIR.value) / 'metrics.jsonl'})")


if __name__ == "__main__":
  _define_flags()
  app.run(
      main,
      flags_parser=functools.partial(
          config_loading.parse_flags, prog="big_vit_lite.evaluate"
      ),
  )
