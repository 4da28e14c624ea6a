"""Reading a run's workdir: metrics.jsonl rows, summary.json, and the statistics of both.

Shared by `summary` (which writes summary.json) and `report` (which plots them).
"""
import json
import statistics

from big_vit_lite import paths

FILE = "summary.json"
REPORT = "report/report.html"


def read_rows(workdir):
  """metrics.jsonl's rows ([] without one); a torn last line (a run in progress) is skipped."""
  path = paths.resolve(workdir) / "metrics.jsonl"
  rows = []
  for line in (path.read_text().splitlines() if path.exists() else []):
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if isinstance(row, dict) and isinstance(row.get("step"), int):
      rows.append(row)
  return rows


def read(workdir):
  """The summary.json of `workdir`, or {}."""
  path = paths.resolve(workdir) / FILE
  try:
    return json.loads(path.read_text()) if path.exists() else {}
  except ValueError:
    return {}


def lower_is_better(key):
  return "loss" in key or "err" in key


def numeric(v):
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def split_keys(rows):
  """(training keys, eval keys): keys of lines with `training_loss` and of the others."""
  train, evals = {}, {}
  for row in rows:
    into = train if "training_loss" in row else evals
    into.update((k, None) for k, v in row.items() if k != "step" and numeric(v))
  return list(train), [k for k in evals if k not in train]


def segments(rows):
  """Training rows split into attempts, where `uptime_hours` starts again from 0."""
  out, last = [], None
  for row in rows:
    if "training_loss" not in row:
      continue
    up = row.get("uptime_hours")
    if not out or (up is not None and last is not None and up < last):
      out.append([])
    out[-1].append(row)
    last = up if up is not None else last
  return out


def stats(rows):
  """Final and best values of the metrics, throughput and time, from metrics.jsonl's rows."""
  train_keys, eval_keys = split_keys(rows)
  final, best = {}, {}
  for row in rows:
    for k, v in row.items():
      if k == "step" or not numeric(v):
        continue
      final[k] = v
      if k in eval_keys or k == "training_loss":
        b = best.get(k)
        if b is None or (v < b["value"] if lower_is_better(k) else v > b["value"]):
          best[k] = dict(value=v, step=row["step"])
  train_rows = [r for r in rows if "training_loss" in r]
  median = lambda k: (statistics.median(vals) if (vals := [r[k] for r in train_rows
                                                            if numeric(r.get(k))]) else None)
  return dict(
      step=train_rows[-1]["step"] if train_rows else max((r["step"] for r in rows), default=0),
      epochs=final.get("epoch"), final=final, best=best,
      hours=sum(s[-1].get("uptime_hours", 0.0) for s in segments(rows)) or None,
      core_hours=final.get("core_hours"), img_per_sec=median("img/sec"),
      mfu={k: median(k) for k in train_keys if k.startswith("mfu")})


def duration(hours):
  """'42 s', '3.5 min' or '2.25 h'; '-' for None."""
  if hours is None:
    return "-"
  seconds = hours * 3600
  return f"{seconds:.0f} s" if seconds < 120 else (
      f"{seconds / 60:.1f} min" if seconds < 7200 else f"{hours:.2f} h")


def flat_config(tree, prefix=""):
  """(dotted key, JSON of the value) for every leaf of a nested config dict."""
  for k, v in tree.items():
    if isinstance(v, dict) and v:
      yield from flat_config(v, f"{prefix}{k}.")
    else:
      yield prefix + k, json.dumps(v)
