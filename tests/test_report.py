"""The run report of real tiny runs (a finished one, a killed and resumed one), in Chromium too."""

import base64
import html
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from big_vit_lite.logs import metrics
from big_vit_lite import report
from big_vit_lite.logs import summary
from big_vit_lite import train
import trainer_runs
from test_bucket_workdir import fake_bucket  # pylint: disable=unused-import
import forkserver
import train_config_tiny

# val/prec@1, val/prec@5, val/loss at steps 6 and 12
EVALS = trainer_runs.TINY + ":evals"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tfds_data_dir):
  """A run with config.report=True: the trainer writes the report itself."""
  workdir = str(tmp_path_factory.mktemp("runs") / "finished")
  p = trainer_runs.run_train(
      tfds_data_dir, workdir, "--config.report=True", config=EVALS
  )
  assert p.returncode == 0, p.stderr[-3000:]
  return workdir


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tfds_data_dir):
  """kill -9 after step 21 (a report of the run in progress first), then the same command again.

  Returns (workdir, the report written while it ran).
  """
  workdir = str(tmp_path_factory.mktemp("runs") / "resumed")
  args = (
      "--config.total_steps=60",
      "--config.ckpt_steps=10",
      "--config.evals.val.log_steps=20",
  )
  proc, pid = trainer_runs.start_train_to_kill(
      tfds_data_dir, workdir, *args, config=EVALS
  )
  try:
    trainer_runs.wait_for_step(proc, workdir, 21)
    # Mid-run (steps take milliseconds), until the kill.
    os.kill(pid, signal.SIGSTOP)
    live = report.write(
        [workdir], out=os.path.join(os.path.dirname(workdir), "live")
    )
  finally:
    os.kill(pid, signal.SIGKILL)
    proc.communicate()
  p = trainer_runs.run_train(tfds_data_dir, workdir, *args, config=EVALS)
  assert p.returncode == 0, p.stderr[-3000:]
  return workdir, str(live)


def _plotted(page):
  """The metric keys the report's figures show (listed under each figure)."""
  return {
      k
      for p in re.findall(r'<p class="keys">(.*?)</p>', page)
      for k in html.unescape(p).split(", ")
  }


def _logged(workdir):
  return {k for r in metrics.read_metrics(workdir) for k in r if k != "step"}


def _embedded_pngs(page):
  return [
      Image.open(io.BytesIO(base64.b64decode(b)))
      for b in re.findall(
          r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page
      )
  ]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_trainer_writes_the_report_with_every_metric(finished_run):
  path = os.path.join(finished_run, "report", "report.html")
  assert summary.read(finished_run)["report"] == path
  page = open(path).read()
  # Every metric the run logged, nothing else.
  assert _plotted(page) == _logged(finished_run)
  assert {
      "val/prec@1",
      "learning_rate",
      "img/sec",
      "core_hours",
      "mfu",
  } <= _plotted(page)
  pngs = _embedded_pngs(page)
  assert len(pngs) == 4 and all(im.size[0] > 300 for im in pngs)
  assert sorted(os.listdir(os.path.dirname(path))) == [
      "evals.png",
      "other.png",
      "report.html",
      "throughput.png",
      "training.png",
  ]
  assert "<td>finished</td>" in page and "<td>12 / 12</td>" in page


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_report_of_a_killed_and_resumed_run_overlaid(
    finished_run, resumed_run, tmp_path, tfds_data_dir
):
  workdir, live = resumed_run
  # Written while the run was going (before the kill): what it had logged by
  # then.
  live_page = open(live).read()
  assert "<td>running</td>" in live_page and "val/prec@1" in _plotted(live_page)

  s = summary.read(workdir)
  assert [a["status"] for a in s["attempts"]] == ["killed", "finished"]
  resumed_at = s["attempts"][1]["start_step"]
  assert resumed_at in (10, 20)
  out = tmp_path / "compare"
  p = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              "-m",
              "big_vit_lite.report",
              finished_run,
              workdir,
              f"--out={out}",
          ]
      ),
      cwd=trainer_runs.ROOT,
      capture_output=True,
      text=True,
      timeout=120,
      # (the trainer runs' environment: their zygote forks it)
      env=trainer_runs.env_for(tfds_data_dir),
  )
  assert p.returncode == 0, p.stderr[-3000:]
  assert p.stdout.strip().splitlines()[-1] == str(out / "report.html")
  page = (out / "report.html").read_text()
  assert _plotted(page) == _logged(finished_run) | _logged(workdir)
  assert f"<td>2 (resumed at {resumed_at})</td>" in page
  assert "<td>60 / 60</td>" in page and "<td>12 / 12</td>" in page
  # The config keys that differ between the two runs, with both values.
  assert "<td>total_steps</td><td>12</td><td>60</td>" in page
  assert "<td>ckpt_steps</td><td>4</td><td>10</td>" in page
  # The resumed run's steps each show once: metrics.jsonl was cut back to the
  # checkpoint.
  steps = [
      r["step"] for r in metrics.read_metrics(workdir) if "training_loss" in r
  ]
  assert steps == list(range(1, 61))
  _check_in_chromium(out / "report.html", tmp_path)


def _chromium():
  path = shutil.which("chromium")
  if path is None:
    message = "headless Chromium is needed (Debian: apt-get install chromium)"
    if os.environ.get("CI") == "true":
      pytest.fail(f"{message}; CI must have it", pytrace=False)
    pytest.skip(message)
  return path


def _render(page, tmp_path, size=(1280, 2400)):
  """(console messages, screenshot pixels) of `page` in headless Chromium."""
  png = tmp_path / "shot.png"
  p = subprocess.run(
      [
          _chromium(),
          "--headless",
          "--no-sandbox",
          "--disable-gpu",
          "--disable-quic",
          "--no-first-run",
          "--disable-background-networking",
          "--disable-component-update",
          "--disable-sync",
          f"--user-data-dir={tmp_path / 'profile'}",
          f"--screenshot={png}",
          f"--window-size={size[0]},{size[1]}",
          "--enable-logging=stderr",
          "--v=0",
          f"file://{page}",
      ],
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert p.returncode == 0 and png.exists(), p.stderr[-3000:]
  console = [l for l in p.stderr.splitlines() if ":CONSOLE" in l]
  return console, np.asarray(Image.open(png).convert("RGB"))


def _check_in_chromium(page, tmp_path):
  # The check can fail: a page with a script error shows up as console lines.
  bad = tmp_path / "bad.html"
  bad.write_text(
      "<html><body><p>x</p><script>no_such_function();</script></body></html>"
  )
  console, _ = _render(bad, tmp_path, size=(200, 100))
  assert any("Uncaught ReferenceError" in l for l in console), console
  console, pixels = _render(page, tmp_path)
  assert not console, console
  # Not blank: plenty of non-white pixels and the plots' colours (lines, text,
  # grid).
  ink = np.any(pixels < 200, axis=-1)
  assert ink.mean() > 0.03, ink.mean()
  assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 200
  assert ink[1200:].mean() > 0.01  # The figures below the tables rendered too.


def _write_run(workdir):
  """A run's files as the trainer writes them: resumed at step 4 (uptime starts again)."""
  os.makedirs(workdir, exist_ok=True)
  rows = [
      dict(
          step=s,
          training_loss=2.0 / s,
          learning_rate=0.1,
          uptime_hours=up,
          mfu_xla=0.3,
          **{"img/sec": 100.0 + s},
      )
      for s, up in ((2, 0.01), (4, 0.02), (6, 0.005), (8, 0.01))
  ]
  rows.insert(2, {"step": 4, "val/prec@1": 0.5})
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dict(lr=0.1, input=dict(batch_size=8)), f)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(
        dict(
            status="running", attempts=[dict(start_step=0), dict(start_step=4)]
        ),
        f,
    )
  return {k for r in rows for k in r if k != "step"}


def test_report_on_a_bucket_workdir(fake_bucket):  # pylint: disable=redefined-outer-name
  run = fake_bucket / "b" / "run"
  logged = _write_run(run)
  path = report.write(["gs://b/run"])
  assert str(path) == "gs://b/run/report/report.html"
  page = (run / "report" / "report.html").read_text()
  # mfu_xla too: every numeric key, whatever its name.
  assert _plotted(page) == logged
  assert "<td>running</td>" in page and "<td>2 (resumed at 4)</td>" in page
  assert "mfu_xla 30.0%" in page
  # The run by its name, not its path.
  assert "gs://" not in page and str(run) not in page
  assert (run / "report" / "training.png").stat().st_size > 1000


def test_one_line_errors(tmp_path, tfds_data_dir, monkeypatch):
  with pytest.raises(ValueError, match="has no metrics.jsonl lines"):
    report.write([str(tmp_path)])
  run = str(tmp_path / "run")
  _write_run(run)
  with pytest.raises(ValueError, match="pass --out=DIR"):
    report.write([run, run])
  # Without matplotlib: the report command and a trainer with config.report stop
  # at once.
  shadow = tmp_path / "shadow" / "matplotlib"
  shadow.mkdir(parents=True)
  (shadow / "__init__.py").write_text(
      "raise ImportError(\"No module named 'matplotlib'\")\n"
  )
  env = dict(
      trainer_runs.env_for(tfds_data_dir),
      PYTHONPATH=f"{shadow.parent}:{trainer_runs.ROOT}",
  )
  # A real process: a zygote of this PYTHONPATH would be this test's alone, and
  # it would import far more than the report does.
  p = subprocess.run(
      [sys.executable, "-m", "big_vit_lite.report", run],
      cwd=trainer_runs.ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert p.returncode == 1
  assert p.stderr.strip().splitlines()[-1] == (
      "big_vit_lite.report: error: The report needs matplotlib, which is not installed: "
      "pip install 'big_vit_lite[report]'"
  ), p.stderr[-2000:]
  # The trainer in process (matplotlib made unimportable here): its command line
  # prints train()'s ValueError as its last line (test_console.py's
  # test_an_error_is_said_once).
  workdir = tmp_path / "w"
  config = train_config_tiny.get_config("evals")
  config.input.data.data_dir = tfds_data_dir
  config.report = True
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  with pytest.raises(ValueError) as e:
    train.train(config, str(workdir))
  assert str(e.value) == (
      "The report needs matplotlib, which is not installed: "
      "pip install 'big_vit_lite[report]'"
  )
  # Before the first step, not at the first eval.
  assert not (workdir / "metrics.jsonl").exists()


def _series_from_file(workdir, key, prefix=""):
  """(steps, values) of `key` read straight from metrics.jsonl (WORKDIR/eval's with a prefix)."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows = [json.loads(line) for line in open(path) if line.strip()]
  pairs = [
      (r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
  ]
  return [float(s) for s, _ in pairs], [float(v) for _, v in pairs]


def _check_plotted_series(workdir, name):
  """Each panel against step draws its own metric's values (and training_loss_avg its own)."""
  plt = report.require_matplotlib()
  shown = [
      line
      for _, _, lines in report.figures(plt, [report.load(workdir)]).values()
      for line in lines
      if line["x"] == "step" and not line["label"].startswith("resumed")
  ]
  assert shown
  for line in shown:
    key = (
        report._OVERLAY[line["panel"]]
        if line["label"].endswith(": training_loss_avg")  # pylint: disable=protected-access
        else line["panel"]
    )
    assert line["label"].startswith(name), line["label"]
    if key.startswith(report.EVAL_PREFIX):
      want = _series_from_file(
          os.path.join(workdir, "eval"), key[len(report.EVAL_PREFIX) :]
      )
    else:
      want = _series_from_file(workdir, key)
    assert (line["xs"], line["ys"]) == want, key
  return shown


def test_the_figures_plot_each_metrics_own_values(tmp_path):
  run = tmp_path / "run"
  _write_run(run)
  rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
  # The loss averaged over each interval, as the trainer logs it.
  for r in rows:
    if "training_loss" in r:
      r["training_loss_avg"] = r["training_loss"] + 0.25
  (run / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows)
  )
  (run / "eval").mkdir()  # What `evaluate --workdir=WORKDIR/eval` writes.
  (run / "eval" / "metrics.jsonl").write_text(
      json.dumps(
          {
              "step": 8,
              "fewshot/mnist10k_10shot": 0.625,
              "linear_probe/prec@1": 0.75,
          }
      )
      + "\n"
  )
  shown = _check_plotted_series(str(run), "run")
  panels = {line["panel"] for line in shown}
  assert {
      "training_loss",
      "learning_rate",
      "img/sec",
      "mfu_xla",
      "val/prec@1",
      "evaluate/fewshot/mnist10k_10shot",
      "evaluate/linear_probe/prec@1",
  } <= panels
  # Drawn over the loss, not in a panel of its own.
  assert "training_loss_avg" not in panels
  for line in shown:
    # A single point has a marker, away from the frame.
    if len(line["xs"]) == 1:
      assert (
          line["marker"] == "o" and line["xs"][0] < line["xlim"][1] * 0.97
      ), line
  # Resume lines (at step 4) inside the frame too.
  page = report.write([str(run)]).read_text()
  assert "<h2>Config</h2>" not in page  # One run: no empty section.
  assert "evaluate/fewshot/mnist10k_10shot" in page
  # The step the run is at: summary.json's (a preemption saves steps it did not
  # log).
  summary_path = run / "summary.json"
  s = json.loads(summary_path.read_text())
  summary_path.write_text(json.dumps(dict(s, step=9, total_steps=10)))
  assert "<td>9 / 10</td>" in report.write([str(run)]).read_text()
