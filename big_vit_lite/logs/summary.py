"""The end of a run: `WORKDIR/summary.json`, the same facts as a block in the log, and the
reading of a run's workdir (summary.json, statistics of metrics.jsonl) that report.py plots.

Read off what the run wrote (metrics.jsonl, the checkpoint listing) plus
what only the trainer knows (status, device, attempts): the final value of
every metric, the best of every eval metric and its step, training hours,
core-hours, median img/s and MFU, the newest checkpoint, and the commands
that resume and evaluate it. The trainer writes it at the start of each
attempt (status "running": a run in progress, or a killed one) and when it
ends: "finished", "preempted" (SIGTERM: saved, exit 0), "interrupted"
(Ctrl-C) or "failed" (with the error). `attempts` lists every start of the
run with its first step, so resumes can be shown (report.py). An evaluate
run writes its own (kind "evaluate"); in a training workdir under the name
EVAL_FILE, so that the trainer's stays.
"""

import datetime
import json
import os
import shlex
import statistics
import sys

from absl import logging
import jax

from big_vit_lite.trainer import checkpoint as ckpt_lib
from big_vit_lite.logs import metrics
from big_vit_lite.runtime import paths
from big_vit_lite.evaluators import presets

FILE = "summary.json"
EVAL_FILE = "summary_evaluate.json"
REPORT = "report/report.html"


def read(workdir):
  """The summary.json of `workdir`, or {}."""
  path = paths.resolve(workdir) / FILE
  return json.loads(path.read_text()) if path.exists() else {}


def numeric(v):
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def split_keys(rows):
  """(training keys, eval keys): keys of lines with `training_loss` and of the others."""
  train, evals = {}, {}
  for row in rows:
    into = train if "training_loss" in row else evals
    into.update((k, None) for k, v in row.items() if k != "step" and numeric(v))
  return list(train), [k for k in evals if k not in train]


def segments(rows, starts=()):
  """Training rows split into attempts: after each step of `starts`, and where `uptime_hours`
  starts again from 0.

  starts: the first steps of the resumed attempts (summary.json's `attempts`); a row at
  such a step is the earlier attempt's (its saved step), the rows after it the next one's.
  Without them an attempt that took longer than the one before would not show.
  """
  out, last, last_step = [], 0.0, None
  for row in (r for r in rows if "training_loss" in r):
    # (A line without timing: the attempt goes on.)
    up = row.get("uptime_hours", last)
    resumed = last_step is not None and any(
        last_step <= s < row["step"] for s in starts
    )
    if not out or up < last or resumed:
      out.append([])
    out[-1].append(row)
    last, last_step = up, row["step"]
  return out


def stats(rows, starts=()):
  """Final and best values of the metrics, throughput and time, from metrics.jsonl's rows.

  starts: the resumed attempts' first steps (segments).
  """
  train_keys, eval_keys = split_keys(rows)
  final, best = {}, {}
  for row in rows:
    for k, v in row.items():
      if k == "step" or not numeric(v):
        continue
      final[k] = v
      # Losses and errors at their lowest.
      sign = -1 if "loss" in k or "err" in k else 1
      if (k in eval_keys or k in ("training_loss", "training_loss_avg")) and (
          k not in best or sign * v > sign * best[k]["value"]
      ):
        best[k] = dict(value=v, step=row["step"])
  train_rows = [r for r in rows if "training_loss" in r]

  def median(key):
    values = [r[key] for r in train_rows if numeric(r.get(key))]
    return statistics.median(values) if values else None

  # The last training step; an evaluate run's: its newest row.
  step = max((r["step"] for r in rows), default=0)
  if train_rows:
    step = train_rows[-1]["step"]
  return dict(
      step=step,
      epochs=final.get("epoch"),
      final=final,
      best=best,
      hours=sum(s[-1].get("uptime_hours", 0.0) for s in segments(rows, starts))
      or None,
      core_hours=final.get("core_hours"),
      img_per_sec=median("img/sec"),
      mfu={k: median(k) for k in train_keys if k.startswith("mfu")},
  )


def duration(hours):
  """'42 s', '3.5 min' or '2.25 h'; '-' for None."""
  if hours is None:
    return "-"
  sec = hours * 3600
  if sec < 120:
    return f"{sec:.0f} s"
  if sec < 7200:
    return f"{sec / 60:.1f} min"
  return f"{hours:.2f} h"


def flat_config(tree, prefix=""):
  """(dotted key, JSON of the value) for every leaf of a nested config dict."""
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      yield from flat_config(v, f"{prefix}{k}.")
    else:
      yield prefix + k, json.dumps(v)


def command(module):
  """The command line that started this process when it runs `python -m MODULE`, else None."""
  ran = sys.argv and sys.argv[0].endswith(
      os.path.join(*module.split(".")) + ".py"
  )
  return shlex.join(["python", "-m", module, *sys.argv[1:]]) if ran else None


def _now():
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"
  )


def _device():
  d = jax.devices()[0]
  return dict(
      platform=d.platform,
      device_kind=d.device_kind,
      devices=jax.device_count(),
      processes=jax.process_count(),
  )


def write(workdir, summary, name=FILE):
  """Writes summary.json (through a rename: a run in progress may read it) and logs the block."""
  path = paths.resolve(workdir) / name
  tmp = path.parent / (name + ".tmp")
  tmp.write_text(json.dumps(summary, indent=1) + "\n")
  tmp.replace(path)
  if summary["status"] != "running":
    logging.info("%s", block(summary, path))


def block(s, path):
  """The summary as readable lines for the log."""
  head = f"{s['kind']} {s['status']}"
  if s.get("total_steps"):
    head += f" at step {s['step']}/{s['total_steps']}"
  elif s["kind"] == "evaluate":
    head += f" (checkpoint step {s['step']})"
  if s.get("epochs") is not None:
    head += f" ({s['epochs']:.3g} epochs)"
  if len(s.get("attempts", ())) > 1:
    head += f", {len(s['attempts'])} attempts"
  # (No error line: the job's last line says it, once; summary.json keeps it.)
  lines = [f"==== Summary: {head} ===="]
  final = s.get("final", {})
  suffix = presets.PIXELS_SUFFIX
  for k, v in final.items():
    if k.endswith(suffix) and k.removesuffix(suffix) in final:
      continue  # A pixel baseline: in its metric's line.
    # (An evaluate run has no best: it shows the results that finished, unless
    # it finished: then its table follows, evaluate.format_table.)
    b = s.get("best", {}).get(k)
    if b or (s["kind"] == "evaluate" and s["status"] != "finished"):
      line = f"  {k:<32} {v:.4g}"
      if b:
        line += f"   best {b['value']:.4g} at step {b['step']}"
      if k + suffix in final:
        line += f"   pixels {final[k + suffix]:.4g}"
      lines.append(line)
  speed = []
  if s.get("hours"):
    speed.append(f"{duration(s['hours'])} of training and evals")
  if s.get("core_hours"):
    speed.append(f"{s['core_hours']:.3g} core-hours")
  if s.get("img_per_sec"):
    speed.append(f"{s['img_per_sec']:,.0f} img/s (median)")
  if s.get("seconds"):
    speed.append(f"{s['seconds']:.1f} s")
  speed += [
      f"{k} {100 * v:.1f}%"
      for k, v in (s.get("mfu") or {}).items()
      if v is not None
  ]
  if speed:
    lines.append("  " + ", ".join(speed))
  dev = s.get("device")
  if dev:
    processes = f"{dev['processes']} process"
    if dev["processes"] > 1:
      processes += "es"
    lines.append(
        f"  device: {dev['devices']} x {dev['device_kind']} ({processes})"
    )
  lines += [
      f"  {key}: {s[key]}" for key in ("checkpoint", "source") if s.get(key)
  ]
  lines += [
      f"  {name}: {cmd}" for name, cmd in s.get("commands", {}).items() if cmd
  ]
  if s.get("report"):
    lines.append(f"  report: {s['report']}")
  return "\n".join(lines + [f"  summary: {path}"])


def fewshot_args(evals):
  """configs/fewshot.py's args for what the run's own few-shot eval reads.

  `evals` is the run's config.evals. The evaluate command the summary gives
  then reads the same features (configs/demo.py: the second block's tokens,
  flattened: ["layer=block01", "pool=flatten"]); [] for the evaluator's
  defaults (pre_logits, mean) or a run without a few-shot eval.
  """
  args = []
  for name, settings in evals.items():
    # The trainer's rule (train_setup.make_evaluators): an entry named after an
    # evaluator type needs no `type` (None or unset).
    if (settings.get("type") or name) != "fewshot":
      continue
    layer = settings.get("representation_layer", "pre_logits")
    if layer != "pre_logits":
      args.append(f"layer={layer}")
    pool = settings.get("token_pool", "mean")
    if pool != "mean":
      args.append(f"pool={pool}")
    break
  return args


class TrainRun:
  """summary.json of a training run: written now ("running") and when the run ends.

  Register `exit` on the run's ExitStack; set `status = "preempted"` before
  a preempted run returns. `evaluated()` after each eval rewrites the report
  with `report` (report.write, when config.report is set; passed in: report.py
  reads this module). `on_end(summary)` when the run ends (wandb_writer.Writer.finish).
  `fewshot`: the evaluate command's extra config args (fewshot_args).
  Process 0 only; the others do nothing.
  """

  def __init__(
      self,
      workdir,
      *,
      total_steps,
      start_step,
      checkpoint_dir,
      image_shape,
      fewshot=(),
      report=None,
      on_end=None,
  ):
    self.active = jax.process_index() == 0
    self.workdir, self.report, self.on_end = (
        paths.resolve(workdir),
        report,
        on_end,
    )
    self.status = "finished"
    if not self.active:
      return
    previous = read(workdir).get("attempts", []) if start_step else []
    for a in previous:  # An attempt that never wrote its end was killed.
      a["status"] = (
          "killed" if a.get("status") == "running" else a.get("status")
      )
    self.summary = dict(
        kind="train",
        status="running",
        workdir=str(self.workdir),
        total_steps=total_steps,
        device=_device(),
        checkpoint_dir=str(checkpoint_dir),
        commands={},
        attempts=previous
        + [dict(start_step=start_step or 0, started=_now(), status="running")],
    )
    config_args = [f"res={image_shape[0]}", f"channels={image_shape[-1]}"]
    config_args.extend(fewshot)
    self._evaluate = shlex.join(
        [
            "python",
            "-m",
            "big_vit_lite.evaluate",
            "--config=configs/fewshot.py:" + ",".join(config_args),
            f"--workdir={self.workdir / 'eval'}",
            f"--config.model_init={self.workdir}",
        ]
    )
    self._write("running")

  def _write(self, status, error=None):
    s = self.summary
    starts = [a["start_step"] for a in s["attempts"][1:]]
    s.update(
        stats(metrics.read_metrics(self.workdir), starts),
        status=status,
        error=error,
        updated=_now(),
    )
    steps = ckpt_lib.complete_steps(self.workdir)
    s["checkpoint"] = s["report"] = None
    s["commands"] = dict(resume=None, evaluate=None)
    if steps:
      s["checkpoint"] = f"{s['checkpoint_dir']}/{steps[-1]}"
      # A preemption saves unlogged steps.
      s["step"] = max(s["step"], steps[-1])
      s["commands"]["evaluate"] = self._evaluate
    s["attempts"][-1].update(status=status, end_step=s["step"])
    if self.report:
      s["report"] = str(self.workdir / REPORT)
    if status != "finished":
      # (The same command also trains on a finished run whose total_steps was
      # raised.)
      s["commands"]["resume"] = command("big_vit_lite.train")
    write(self.workdir, s)

  def evaluated(self):
    """After an eval: the report again, when config.report is set (a failure is a warning)."""
    if not (self.active and self.report):
      return
    try:
      self.report([self.workdir])
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Could not write the report: %s", e)

  def exit(self, exc_type, exc, unused_tb):
    """An ExitStack callback: the final summary however the run ends; never swallows `exc`."""
    if not self.active:
      return False
    status, error = self.status, None
    if exc_type is not None:
      interrupted = (
          issubclass(exc_type, KeyboardInterrupt)
          or "Interrupted" in exc_type.__name__
      )
      status = "interrupted" if interrupted else "failed"
      error = (str(exc).strip().splitlines() or [exc_type.__name__])[0][:300]
    try:
      self._write(status, error)
      self.evaluated()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Could not write %s: %s", self.workdir / FILE, e)
    try:
      if self.on_end:
        # (config.wandb: the W&B run's summary; it ends.)
        self.on_end(self.summary)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Could not send the summary to the tracker: %s", e)
    return False


def write_evaluate(
    workdir, *, source, step, results, seconds, error=None, interrupted=False
):
  """summary.json of an evaluate run (process 0): its results, source checkpoint and time.

  In a training workdir (its summary.json is a training run's) it is EVAL_FILE instead.
  """
  if jax.process_index() != 0:
    return
  workdir = paths.resolve(workdir)
  status = "finished"
  if interrupted:
    status = "interrupted"
  elif error:
    status = "failed"
  if error is not None:
    error = str(error).splitlines()[0][:300]
  s = dict(
      kind="evaluate",
      status=status,
      workdir=str(workdir),
      step=step,
      source=str(source),
      final={f"{n}/{k}": v for n, r in results.items() for k, v in r.items()},
      seconds=seconds,
      device=_device(),
      error=error,
      commands=dict(again=command("big_vit_lite.evaluate")),
      updated=_now(),
  )
  name = EVAL_FILE if read(workdir).get("kind") == "train" else FILE
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    write(workdir, s, name)
  except OSError as e:
    logging.warning("Could not write %s: %s", workdir / name, e)
