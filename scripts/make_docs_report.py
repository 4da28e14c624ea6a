r"""Regenerates docs/report.png and the README's demo results table from a real demo run.

  python scripts/make_docs_report.py [--workdir=workdirs/demo_short] [--steps=3000] [--reuse]

Trains configs/demo.py for --steps steps (the full demo is 30,000) with the
val eval every steps/6 steps and config.report=True, stops it with SIGTERM
(a preemption) half way and runs the same command again, which resumes it;
then writes the report of the workdir, screenshots report.html with headless
Chromium (Debian's `chromium`) into docs/report.png and rewrites the table
between the README's "demo-results" markers from the run's summary.json.
--reuse skips the training and uses the workdir as it is. Needs matplotlib
(pip install 'big_vit_lite[report]') and chromium.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- demo-results:begin -->", "<!-- demo-results:end -->"


def train(workdir, steps):
  """The short demo run, preempted (SIGTERM) half way and resumed by the same command."""
  shutil.rmtree(workdir, ignore_errors=True)
  cmd = [
      sys.executable,
      "-m",
      "big_vit_lite.train",
      "--config=configs/demo.py",
      f"--workdir={workdir}",
      f"--config.total_steps={steps}",
      f"--config.evals.val.log_steps={steps // 6}",
      "--config.log_training_steps=50",
      "--config.report=True",
  ]
  print(" ".join(cmd), flush=True)
  proc = subprocess.Popen(cmd, cwd=ROOT)
  metrics = os.path.join(workdir, "metrics.jsonl")
  while proc.poll() is None:
    lines = open(metrics).read().splitlines() if os.path.exists(metrics) else []
    if any(
        l.endswith("}") and json.loads(l)["step"] >= steps // 2
        for l in lines[-3:]
    ):
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(1)
  if proc.wait() != 0:
    sys.exit(f"the demo run failed (exit status {proc.returncode})")
  subprocess.run(cmd, cwd=ROOT, check=True)


def screenshot(html, png, width=1280, height=2600):
  """A PNG of `html` as headless Chromium renders it."""
  with tempfile.TemporaryDirectory() as profile:
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={png}",
            f"--window-size={width},{height}",
            f"file://{os.path.abspath(html)}",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


def results_table(summary, steps):
  """Markdown: the run's figures, from its summary.json."""
  final, best = summary["final"], summary["best"]
  pct = lambda k: f"{100 * final[k]:.2f}%" if k in final else "-"
  dev = summary["device"]
  attempts = summary["attempts"]

  def fewshot_cell(key):
    """The run's few-shot figure beside the same probe on the raw pixels."""
    pixels = key + "_pixels"
    if pixels not in final:
      return pct(key)
    return f"{pct(key)} (pixels {pct(pixels)})"

  return "\n".join(
      [
          f"Short demo run: `python scripts/make_docs_report.py --steps={steps}` "
          f"({summary['updated'][:10]}; preempted at step {attempts[1]['start_step']} and resumed)"
          if len(attempts) > 1
          else f"Short demo run ({summary['updated'][:10]}):",
          "",
          "| steps | epochs | val/prec@1 (best at step) | 10-shot mnist10k | 10-shot animal_mnist | "
          "time (evals included) | img/s (median) | MFU (median) | device |",
          "|---|---|---|---|---|---|---|---|---|",
          f"| {summary['step']:,} | {summary['epochs']:.2f} | {pct('val/prec@1')} "
          f"({100 * best['val/prec@1']['value']:.2f}% at {best['val/prec@1']['step']:,}) | "
          f"{fewshot_cell('fewshot/mnist10k_10shot')} | "
          f"{fewshot_cell('fewshot/animal_mnist_10shot')} | "
          f"{summary['hours'] * 60:.1f} min | {summary['img_per_sec']:,.0f} | "
          f"{100 * summary['mfu']['mfu']:.1f}% | {dev['devices']} x {dev['device_kind']} |",
          "",
          "(On CPU, MFU is against the machine's best matmul rate, measured once per machine and "
          "kept, divided among the devices: [docs/performance.md](docs/performance.md#mfu).)",
      ]
  )


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n", maxsplit=1)[0]
  )
  parser.add_argument(
      "--workdir", default=os.path.join(ROOT, "workdirs", "demo_short")
  )
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument(
      "--reuse", action="store_true", help="use the workdir's run as it is"
  )
  args = parser.parse_args()
  workdir = os.path.abspath(args.workdir)
  if not args.reuse:
    train(workdir, args.steps)
  subprocess.run(
      [sys.executable, "-m", "big_vit_lite.report", workdir],
      cwd=ROOT,
      check=True,
  )
  os.makedirs(os.path.join(ROOT, "docs"), exist_ok=True)
  screenshot(
      os.path.join(workdir, "report", "report.html"),
      os.path.join(ROOT, "docs", "report.png"),
  )
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  readme = os.path.join(ROOT, "README.md")
  text = open(readme).read()
  if BEGIN not in text or END not in text:
    sys.exit(f"README.md has no {BEGIN} ... {END} markers")
  head, rest = text.split(BEGIN, 1)
  table = results_table(summary, summary["total_steps"])
  with open(readme, "w") as f:
    f.write(head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1])
  print(table)


if __name__ == "__main__":
  main()
