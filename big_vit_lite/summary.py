"""The end of a run: `WORKDIR/summary.json` and the same facts as a block in the log.

Read off what the run wrote (metrics.jsonl, the checkpoint listing) plus
what only the trainer knows (status, device, attempts): the final value of
every metric, the best of every eval metric and its step, training hours,
core-hours, median img/s and MFU, the newest checkpoint, and the commands
that resume and evaluate it. The trainer writes it at the start of each
attempt (status "running": a run in progress, or a killed one) and when it
ends: "finished", "preempted" (SIGTERM: saved, exit 0), "interrupted"
(Ctrl-C) or "failed" (with the error). `attempts` lists every start of the
run with its first step, so resumes can be shown (report.py).
"""
import datetime
import json
import os
import shlex
import sys

from absl import logging
import jax

from big_vit_lite import checkpoint as ckpt_lib
from big_vit_lite import paths
from big_vit_lite.runlog import (  # noqa: F401  (summary.read_rows etc. for callers)
    FILE, REPORT, duration, lower_is_better, numeric, read, read_rows, segments, split_keys,
    stats)

def command(module):
  """The command line that started this process when it runs `python -m MODULE`, else None."""
  script = os.path.join(*module.split(".")) + ".py"
  if not sys.argv or not sys.argv[0].endswith(script):
    return None
  return shlex.join(["python", "-m", module, *sys.argv[1:]])


def _now():
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _device():
  d = jax.devices()[0]
  return dict(platform=d.platform, device_kind=d.device_kind, devices=jax.device_count(),
              processes=jax.process_count())


def write(workdir, summary):
  """Writes summary.json (through a rename: a run in progress may read it) and logs the block."""
  workdir = paths.resolve(workdir)
  tmp = workdir / (FILE + ".tmp")
  tmp.write_text(json.dumps(summary, indent=1) + "\n")
  tmp.replace(workdir / FILE)
  if summary["status"] != "running":
    logging.info("%s", block(summary, workdir / FILE))


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
  lines = [f"==== Summary: {head} ===="]
  if s.get("error"):
    lines.append(f"  error: {s['error']}")
  for k, v in s.get("final", {}).items():
    if k in s.get("best", {}) or s["kind"] == "evaluate":
      b = s.get("best", {}).get(k)
      best = f"   best {b['value']:.4g} at step {b['step']}" if b and s["kind"] == "train" else ""
      lines.append(f"  {k:<32} {v:.4g}{best}")
  speed = [f"{duration(s['hours'])} of training and evals" if s.get("hours") else None,
           f"{s['core_hours']:.3g} core-hours" if s.get("core_hours") else None,
           f"{s['img_per_sec']:,.0f} img/s (median)" if s.get("img_per_sec") else None,
           f"{s['seconds']:.1f} s" if s.get("seconds") else None]
  speed += [f"{k} {100 * v:.1f}%" for k, v in (s.get("mfu") or {}).items() if v is not None]
  if any(speed):
    lines.append("  " + ", ".join(x for x in speed if x))
  dev = s.get("device") or {}
  if dev:
    lines.append(f"  device: {dev['devices']} x {dev['device_kind']} ({dev['processes']} "
                 f"process{'es' if dev['processes'] > 1 else ''})")
  for key in ("checkpoint", "source"):
    if s.get(key):
      lines.append(f"  {key}: {s[key]}")
  lines += [f"  {name}: {cmd}" for name, cmd in s.get("commands", {}).items() if cmd]
  if s.get("report"):
    lines.append(f"  report: {s['report']}")
  lines.append(f"  summary: {path}")
  return "\n".join(lines)


class TrainRun:
  """summary.json of a training run: written now ("running") and when the run ends.

  Register `exit` on the run's ExitStack; set `status = "preempted"` before
  a preempted run returns. `evaluated()` after each eval rewrites the report
  when `report` is set. Process 0 only; the others do nothing.
  """

  def __init__(self, workdir, *, total_steps, start_step, checkpoint_dir, image_shape,
               report=False):
    self.active = jax.process_index() == 0
    self.workdir, self.report = paths.resolve(workdir), report
    self.status = "finished"
    if not self.active:
      return
    res, channels = image_shape[0], image_shape[-1]
    previous = read(workdir).get("attempts", []) if start_step else []
    for a in previous:  # An attempt that never wrote its end was killed.
      a["status"] = "killed" if a.get("status") == "running" else a.get("status")
    self.summary = dict(
        kind="train", status="running", workdir=str(self.workdir), total_steps=total_steps,
        device=_device(), checkpoint_dir=str(checkpoint_dir),
        attempts=previous + [dict(start_step=int(start_step or 0), started=_now(),
                                  status="running")],
        commands={})
    self._evaluate = shlex.join([
        "python", "-m", "big_vit_lite.evaluate",
        f"--config=configs/fewshot.py:res={res},channels={channels}",
        f"--workdir={self.workdir / 'eval'}", f"--config.model_init={self.workdir}"])
    self._write("running")

  def _write(self, status, error=None):
    s = self.summary
    s.update(stats(read_rows(self.workdir)), status=status, error=error, updated=_now())
    steps = ckpt_lib.complete_steps(self.workdir)
    s["checkpoint"] = f"{s['checkpoint_dir']}/{steps[-1]}" if steps else None
    s["step"] = max(s["step"], steps[-1] if steps else 0)  # A preemption saves unlogged steps.
    s["attempts"][-1].update(status=status, end_step=s["step"])
    s["report"] = str(self.workdir / REPORT) if self.report else None
    # The same command resumes a run that did not finish (it also trains on a finished
    # one whose total_steps was raised).
    s["commands"] = dict(resume=command("big_vit_lite.train") if status != "finished" else None,
                         evaluate=self._evaluate if steps else None)
    write(self.workdir, s)

  def evaluated(self):
    """After an eval: the report again, when config.report is set (a failure is a warning)."""
    if not (self.active and self.report):
      return
    from big_vit_lite import report  # pylint: disable=g-import-not-at-top
    try:
      report.write([self.workdir])
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Could not write the report: %s", e)

  def exit(self, exc_type, exc, tb):
    """An ExitStack callback: the final summary however the run ends; never swallows `exc`."""
    del tb
    if not self.active:
      return False
    status, error = self.status, None
    if exc_type is not None:
      interrupted = issubclass(exc_type, KeyboardInterrupt) or "Interrupted" in exc_type.__name__
      status = "interrupted" if interrupted else "failed"
      error = (str(exc).strip().splitlines() or [exc_type.__name__])[0][:300]
    try:
      self._write(status, error)
      self.evaluated()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Could not write %s: %s", self.workdir / FILE, e)
    return False


def write_evaluate(workdir, *, source, step, results, seconds, error=None, interrupted=False):
  """summary.json of an evaluate run (process 0): its results, source checkpoint and time."""
  if jax.process_index() != 0:
    return
  final = {f"{n}/{k}": v for n, r in results.items() for k, v in r.items()}
  status = "interrupted" if interrupted else "failed" if error else "finished"
  s = dict(kind="evaluate", status=status, workdir=str(paths.resolve(workdir)), step=step,
           source=str(source), final=final, seconds=seconds, device=_device(),
           error=None if error is None else str(error).splitlines()[0][:300],
           commands=dict(again=command("big_vit_lite.evaluate")), updated=_now())
  try:
    paths.resolve(workdir).mkdir(parents=True, exist_ok=True)
    write(workdir, s)
  except OSError as e:
    logging.warning("Could not write %s: %s", paths.resolve(workdir) / FILE, e)
