r"""A run report: `python -m big_vit_lite.report WORKDIR [WORKDIR...] [--out=DIR]`.

Writes report.html (one self-contained file: the plots are embedded PNGs,
no scripts) and the PNGs to DIR, by default WORKDIR/report (several
workdirs, overlaid for comparison, need --out):
  training.png    training loss (per logged step, and training_loss_avg: averaged over
                  each logging interval) and learning rate against step and wall-clock time
  evals.png       every eval metric against step, with those `evaluate` wrote into
                  WORKDIR/eval (the command the trainer prints), as "evaluate/KEY";
                  a metric's raw-pixel baseline (KEY_pixels) dotted in its panel
  throughput.png  img/s, MFU (every key starting with "mfu") and core-hours
  other.png       every other numeric training metric (grad_norm, step_time, ...)
Wall-clock time is each attempt's uptime, the attempts of a resumed run
back to back; resumes are dashed vertical lines. Tables: per run its status,
step (the newest of the last logged step and the last checkpoint), epochs,
time, img/s, MFU, device and attempts; final and best metrics; the config
keys that differ between the runs. Only what the runs wrote is read
(metrics.jsonl, config.json, summary.json, the checkpoint listing), so it
works on a run in progress and on a bucket workdir (gs://...).
`config.report = True` makes the trainer write it at each eval.
Needs matplotlib: pip install 'big_vit_lite[report]'.
"""

import base64
import datetime
import html
import io
import json
import math
import sys

from absl import app
from absl import flags
from absl import logging

from big_vit_lite.trainer import checkpoint as ckpt_lib
from big_vit_lite.logs import metrics
from big_vit_lite.runtime import paths
from big_vit_lite.logs import summary
from big_vit_lite.evaluators import presets

INSTALL = "pip install 'big_vit_lite[report]'"
_TRAINING = ("training_loss", "learning_rate")
# Drawn in the panel of the key before it, not in a panel of its own.
_OVERLAY = {"training_loss": "training_loss_avg"}
EVAL_SUBDIR = "eval"  # Where the trainer's printed `evaluate` command writes.
# Its keys in the report, beside the trainer's own evals.
EVAL_PREFIX = "evaluate/"
_THROUGHPUT = ("img/sec", "mfu", "core_hours")  # key prefixes
_OUT = None
_CSS = (
    "body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
    "table{border-collapse:collapse;font-size:13px}img{max-width:100%}"
    "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
    "td:first-child,th:first-child,.cfg td{text-align:left}.keys{color:#666;font-size:12px}"
)


def require_matplotlib():
  """matplotlib.pyplot on the Agg backend; a one-line ValueError saying what to install."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(
        f"The report needs matplotlib, which is not installed: {INSTALL}"
    ) from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt


def load(workdir):
  """One run's rows, hours, resumes, config and summary, as a dict."""
  wd = paths.resolve(workdir)
  rows = metrics.read_metrics(wd)
  rows += _evaluate_rows(wd / EVAL_SUBDIR) if rows else []
  if not rows:
    raise ValueError(
        f"{wd} has no metrics.jsonl lines: pass a training or evaluate workdir "
        "(a run writes its first line at its first logged step)."
    )
  config_path = wd / "config.json"
  config = {}
  if config_path.exists():
    config = dict(summary.flat_config(json.loads(config_path.read_text())))
  attempts = summary.read(wd).get("attempts", [])
  # The resumed attempts' first steps (where the time starts again).
  resume_steps = [a["start_step"] for a in attempts[1:]]
  run = dict(
      workdir=wd,
      name=wd.name,
      rows=rows,
      summary=summary.read(wd),
      stats=summary.stats(rows, resume_steps),
      checkpoints=ckpt_lib.complete_steps(wd),
      config=config,
      train_rows=[],
      hours=[],
      resume_hours=[],
  )
  run["train_keys"], run["eval_keys"] = summary.split_keys(rows)
  segments, offset = summary.segments(rows, resume_steps), 0.0
  # Hours: each attempt's uptime after those before it.
  for i, seg in enumerate(segments):
    run["resume_hours"] += [offset] if i else []
    run["train_rows"] += seg
    for r in seg:
      if "uptime_hours" in r:
        run["hours"].append(offset + r["uptime_hours"])
      else:
        run["hours"].append(None)
    offset += max([r.get("uptime_hours", 0.0) for r in seg])
  run["resume_steps"] = (
      resume_steps if attempts else [s[0]["step"] for s in segments[1:]]
  )
  # Where the run is: a checkpoint (a preemption's) may be past the last logged
  # step.
  run["final_step"] = max(
      run["stats"]["step"],
      run["summary"].get("step") or 0,
      *run["checkpoints"][-1:],
  )
  return run


def _evaluate_rows(eval_dir):
  """The rows `evaluate` wrote into the run's eval dir, keys prefixed with EVAL_PREFIX."""
  rows = sorted(metrics.read_metrics(eval_dir), key=lambda r: r["step"])
  return [
      {
          "step": r["step"],
          **{EVAL_PREFIX + k: v for k, v in r.items() if k != "step"},
      }
      for r in rows
  ]


def _points(run, key, x, scale):
  """(x, value) of `key` in `run`'s rows, against "step" or its wall-clock hours * scale."""
  if x == "step":
    return [
        (r["step"], r[key]) for r in run["rows"] if summary.numeric(r.get(key))
    ]
  return [
      (h * scale, r[key])
      for r, h in zip(run["train_rows"], run["hours"])
      if h is not None and summary.numeric(r.get(key))
  ]


def _baseline_key(run, key):
  """KEY_pixels where `run` logged that pixel baseline of eval metric `key`, else None."""
  pixels = key + presets.PIXELS_SUFFIX
  if key in run["eval_keys"] and pixels in run["eval_keys"]:
    return pixels
  return None


def _plot(ax, runs, key, x):
  """`key` of every run against "step" or "hours"/"minutes", resumes as dashed lines.

  Its _OVERLAY key in the same panel (the loss averaged over each interval, bold, the
  per-step loss thin), and its pixel baseline dotted; a single point gets a marker.
  """
  scale = 60 if x == "minutes" else 1
  overlay = _OVERLAY.get(key)
  right = 0
  for i, run in enumerate(runs):
    color = f"C{i % 10}"
    pts = _points(run, key, x, scale)
    avg = _points(run, overlay, x, scale) if overlay else []
    if pts:
      style = dict(lw=1.2, alpha=1.0, marker=None)
      if avg:  # Thin and faint under its average.
        style.update(lw=0.8, alpha=0.45)
      if key in run["eval_keys"] or len(pts) == 1:
        style.update(marker="o")
      ax.plot(*zip(*pts), color=color, label=run["name"], ms=4, **style)
    if avg:
      marker = None
      if len(avg) == 1:
        marker = "o"
      label = f"{run['name']}: {overlay}"
      ax.plot(*zip(*avg), color=color, label=label, lw=1.8, marker=marker, ms=4)
    baseline_key = _baseline_key(run, key)
    baseline = []
    if baseline_key:
      baseline = _points(run, baseline_key, x, scale)
      ax.plot(
          *zip(*baseline),
          color=color,
          label=f"{run['name']}: raw pixels",
          ls=":",
          lw=1.5,
          marker="x",
          ms=4,
      )
    resumes = run["resume_steps"]
    if x != "step":
      resumes = [h * scale for h in run["resume_hours"]]
    # One legend entry per run, at its first resume.
    labels = [f"resumed ({run['name']})"] + [None] * (len(resumes) - 1)
    for at, label in zip(resumes, labels):
      ax.axvline(at, color=color, ls="--", lw=0.8, alpha=0.8, label=label)
    right = max([right, *resumes, *(p[0] for p in pts + avg + baseline)])
  # From 0, with room on the right: a last point or a resume line is not on the
  # frame.
  ax.set_xlim(0, right * 1.05 or 1)
  ax.set_title(key, fontsize=10)
  xlabel = x
  if x != "step":
    xlabel = f"wall-clock {x} (attempts back to back)"
  ax.set_xlabel(xlabel, fontsize=8)
  ax.tick_params(labelsize=8)
  ax.grid(alpha=0.3)
  baselines = any(_baseline_key(run, key) for run in runs)
  resumed = any(run["resume_steps"] for run in runs)
  # (A panel against time of rows without timing has no lines to name.)
  named = ax.get_legend_handles_labels()[0]
  if named and (len(runs) > 1 or overlay or baselines or resumed):
    ax.legend(fontsize=7)


def plotted(fig):
  """What `fig`'s panels show, read back from its lines: a dict per line (resume lines too)."""
  return [
      dict(
          panel=ax.get_title(),
          x=ax.get_xlabel(),
          label=line.get_label(),
          xs=[float(v) for v in line.get_xdata()],
          ys=[float(v) for v in line.get_ydata()],
          marker=line.get_marker(),
          xlim=[float(v) for v in ax.get_xlim()],
      )
      for ax in fig.axes
      if ax.get_visible()
      for line in ax.get_lines()
  ]


def _figure(plt, runs, panels, cols):
  """(PNG bytes, plotted(fig)) of a grid of (key, x) panels."""
  rows = math.ceil(len(panels) / cols)
  fig, axes = plt.subplots(
      rows, cols, figsize=(4.6 * cols, 3.1 * rows), squeeze=False
  )
  for ax in axes.flat[len(panels) :]:
    ax.set_visible(False)
  for ax, (key, x) in zip(axes.flat, panels):
    _plot(ax, runs, key, x)
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=100)
  shown = plotted(fig)
  plt.close(fig)
  return buf.getvalue(), shown


def figures(plt, runs):
  """{png name: (bytes, keys plotted, plotted(fig))} for the runs overlaid."""

  def keys(kind):
    return list(dict.fromkeys(k for run in runs for k in run[kind]))

  train_keys, eval_keys = keys("train_keys"), keys("eval_keys")
  # Pixel baselines are drawn in their metric's panel.
  baselines = {
      k
      for run in runs
      for key in run["eval_keys"]
      if (k := _baseline_key(run, key))
  }
  throughput = [k for k in train_keys if k.startswith(_THROUGHPUT)]
  longest = max(
      (h for run in runs for h in run["hours"] if h is not None), default=0
  )
  time_x = "hours" if longest > 2 else "minutes"
  groups = {
      "training": (
          [
              (k, x)
              for k in _TRAINING
              if k in train_keys
              for x in ("step", time_x)
          ],
          2,
      ),
      "evals": (
          [(k, "step") for k in sorted(eval_keys) if k not in baselines],
          3,
      ),
      "throughput": ([(k, "step") for k in throughput], 3),
      "other": (
          [
              (k, "step")
              for k in train_keys
              if k not in (*_TRAINING, *_OVERLAY.values(), *throughput)
          ],
          3,
      ),
  }
  out = {}
  for name, (panels, cols) in groups.items():
    if not panels:
      continue
    png, shown = _figure(plt, runs, panels, min(cols, len(panels)))
    keys = [
        k
        for key, _ in panels
        for k in (key, _OVERLAY.get(key), key + presets.PIXELS_SUFFIX)
        if k in train_keys + eval_keys
    ]
    out[name] = (png, list(dict.fromkeys(keys)), shown)
  return out


def _fmt(v, pct=False):
  if v is None:
    return "-"
  if pct:
    return f"{100 * v:.1f}%"
  if abs(v) >= 1000:
    return f"{v:,.0f}"
  return f"{v:.4g}"


def _table(head, rows):
  cell = lambda tag, v: f"<{tag}>{html.escape(str(v))}</{tag}>"
  return (
      "<table><tr>"
      + "".join(cell("th", h) for h in head)
      + "</tr>"
      + "".join(
          "<tr>" + "".join(cell("td", v) for v in r) + "</tr>" for r in rows
      )
      + "</table>"
  )


def _runs_table(runs):
  rows = []
  for run in runs:
    s, st, dev = run["summary"], run["stats"], run["summary"].get("device")
    step = f"{run['final_step']}"
    if s.get("total_steps"):
      step += f" / {s['total_steps']}"
    device = "-"
    if dev:
      device = f"{dev['devices']} x {dev['device_kind']}"
    attempts = f"{max(len(s.get('attempts', [])), 1)}"
    if run["resume_steps"]:
      attempts += f" (resumed at {', '.join(map(str, run['resume_steps']))})"
    rows.append(
        [
            run["name"],
            s.get("status", "?"),
            step,
            _fmt(st["epochs"]),
            summary.duration(st["hours"]),
            _fmt(st["core_hours"]),
            _fmt(st["img_per_sec"]),
            ", ".join(f"{k} {_fmt(v, pct=True)}" for k, v in st["mfu"].items())
            or "-",
            device,
            attempts,
            ", ".join(map(str, run["checkpoints"][-3:])) or "-",
        ]
    )
  return _table(
      [
          "run",
          "status",
          "step",
          "epochs",
          "training time",
          "core-hours",
          "img/s (median)",
          "MFU (median)",
          "device",
          "attempts",
          "checkpoints",
      ],
      rows,
  )


def _metrics_table(runs):
  keys = []
  for run in runs:
    wanted = ["training_loss", "training_loss_avg", *sorted(run["eval_keys"])]
    baselines = {_baseline_key(run, k) for k in run["eval_keys"]}
    keys += [
        k for k in wanted if k in run["stats"]["final"] and k not in baselines
    ]
  keys = list(dict.fromkeys(keys))

  def cell(run, k):
    final = run["stats"]["final"].get(k)
    best = run["stats"]["best"].get(k)
    text = _fmt(final)
    # (No final, no best.)
    if best:
      text += f" (best {_fmt(best['value'])} at {best['step']})"
    baseline_key = _baseline_key(run, k)
    if baseline_key:
      text += f"; raw pixels {_fmt(run['stats']['final'][baseline_key])}"
    return text

  return _table(
      ["metric: final (best at step)", *(run["name"] for run in runs)],
      [[k, *(cell(run, k) for run in runs)] for k in keys],
  )


def _config_table(runs):
  keys = sorted({k for run in runs for k in run["config"]})
  differ = [k for k in keys if len({run["config"].get(k) for run in runs}) > 1]
  if not differ:
    return "<p>The runs have the same config.</p>" if len(runs) > 1 else ""
  return (
      '<div class="cfg">'
      + _table(
          ["config key", *(run["name"] for run in runs)],
          [
              [k, *(run["config"].get(k, "(unset)") for run in runs)]
              for k in differ
          ],
      )
      + "</div>"
  )


def write(workdirs, out=None):
  """Writes report.html and the PNGs for `workdirs` to `out` (default WORKDIR/report); its path."""
  plt = require_matplotlib()
  if out is None and len(workdirs) > 1:
    raise ValueError(
        "Several workdirs: pass --out=DIR for the comparison report."
    )
  runs = [load(w) for w in workdirs]
  out = paths.resolve(out) if out else runs[0]["workdir"] / "report"
  out.mkdir(parents=True, exist_ok=True)
  title = "Run report: " + ", ".join(run["name"] for run in runs)
  now = datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y-%m-%d %H:%M UTC"
  )
  # (The runs by name: an absolute workdir path says nothing to a reader of the
  # page.)
  parts = [
      f"<h1>{html.escape(title)}</h1>",
      f"<p>{now}</p>",
      "<h2>Runs</h2>",
      _runs_table(runs),
      "<h2>Metrics</h2>",
      _metrics_table(runs),
  ]
  config = _config_table(runs)
  # (One run: nothing to compare.)
  parts += ["<h2>Config</h2>", config] if config else []
  for name, (png, keys, _) in figures(plt, runs).items():
    (out / f"{name}.png").write_bytes(png)
    parts += [
        f"<h2>{name.capitalize()}</h2>",
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(png).decode()}">',
        f'<p class="keys">{html.escape(", ".join(keys))}</p>',
    ]
  # (The empty icon: no request for a favicon.ico that is not there.)
  page = (
      '<!doctype html>\n<html><head><meta charset="utf-8"><link rel="icon" href="data:,">'
      f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
      + "\n".join(parts)
      + "\n</body></html>\n"
  )
  path = out / "report.html"
  (out / "report.html.tmp").write_text(page)
  (out / "report.html.tmp").replace(path)
  logging.info("Wrote the report %s", path)
  return path


def main(argv):
  if len(argv) < 2:
    raise app.UsageError(
        "Pass one or more workdirs: WORKDIR [WORKDIR...] [--out=DIR]"
    )
  try:
    print(write(argv[1:], _OUT.value))
  except (ValueError, OSError) as e:  # (OSError: --out cannot be written)
    sys.exit(f"big_vit_lite.report: error: {e}")


if __name__ == "__main__":
  _OUT = flags.DEFINE_string(
      "out",
      None,
      "Where report.html and the PNGs go (default " "WORKDIR/report).",
  )
  app.run(main)
