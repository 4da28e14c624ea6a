"""Smoke tests of the benchmark tools: they run and report what they promise (no timing checks)."""

import json
import os
import subprocess
import sys

import jax
import pytest

from big_vit_lite import bench
from big_vit_lite.runtime import hostmem
from big_vit_lite.runtime import sharding
import forkserver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_vs_timm  # pylint: disable=g-import-not-at-top,wrong-import-position

CONTRACT_KEYS = {
    "variant",
    "batch",
    "train_img_per_s",
    "infer_img_per_s",
    "step_flops",
    "mfu",
    "calib_gflops",
}
ISSUE_KEYS = {
    "achieved_gflops",
    "train_compile_s",
    "infer_compile_s",
    "train_step_s",
    "train_step_s_min",
    "train_step_s_max",
    "train_program_bytes",
    "peak_host_rss_bytes",
    "dtype",
    "remat",
    "scan",
    "mesh",
    "res",
    "xla_step_flops",
    "mfu_xla",
    "mfu_basis",
    "train_hw_step_flops",
    "train_mfu_calib",
    "attention",
}


def _env():
  """The environment of the commands these tests fork: one per zygote (tests/forkserver.py), so
  every bench command shares the zygote of test_plan's (JAX_PLATFORMS=cpu)."""
  return dict(os.environ, JAX_PLATFORMS="cpu")


def _run(args, timeout=100, as_a_user=False):
  """`python ARGS`, forked by the fork server; `as_a_user`: a real process, without the huge-page
  tunable conftest.py sets (so that an entry point re-executes itself with it, as a user's
  does)."""
  cmd = [sys.executable, *args]
  env = _env()
  if as_a_user:
    env.pop("GLIBC_TUNABLES", None)
  else:
    cmd = forkserver.command(cmd)
  p = subprocess.run(
      cmd,
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
      env=env,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  return p


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cli_prints_one_json_line_per_case():
  p = _run(
      [
          "-m",
          "big_vit_lite.bench",
          "--variant=mu/8",
          "--batch=2,4",
          "--res=16",
          "--num_classes=10",
          "--steps=2",
          "--warmup=1",
          "--calib_n=64",
          "--mesh=data:-1",
          "--num_cpu_devices=2",
      ]
  )
  lines = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  assert [l["batch"] for l in lines] == [2, 4]
  for line in lines:
    assert CONTRACT_KEYS | ISSUE_KEYS <= set(line), sorted(
        CONTRACT_KEYS | ISSUE_KEYS - set(line)
    )
    assert (
        line["variant"] == "mu/8"
        and line["mesh"] == "data:-1"
        and line["num_devices"] == 2
    )
    assert line["train_img_per_s"] > 0 and line["infer_img_per_s"] > 0
    assert (
        line["train_step_s_min"]
        <= line["train_step_s"]
        <= line["train_step_s_max"]
    )
    # The training step costs more FLOPs than inference (backward ~2x forward).
    assert line["step_flops"] > 2 * line["infer_step_flops"] > 0
    # Two CPU devices share the cores that one calibration matmul already uses:
    # MFU is the whole step's FLOP/s over that one rate. MFU: model FLOPs (the
    # jaxpr's matmuls) over the matmul timed in-process (no datasheet peak for a
    # CPU); XLA's count (elementwise work included) as mfu_xla.
    assert line["mfu_basis"] == "calib"
    assert line["mfu"] == pytest.approx(
        line["achieved_gflops"] / line["calib_gflops"]
    )
    assert line["mfu_xla"] == pytest.approx(
        line["mfu"] * line["xla_step_flops"] / line["step_flops"]
    )
  # Whole-step FLOPs (both devices' shares), as the same step on one device.
  # Inference: training adds the optimizer update, which each data-parallel
  # device repeats on its replica of the params.
  one = _run(
      [
          "-m",
          "big_vit_lite.bench",
          "--variant=mu/8",
          "--batch=4",
          "--res=16",
          "--num_classes=10",
          "--steps=1",
          "--warmup=1",
          "--calib_n=64",
          "--mode=infer",
      ],
      as_a_user=True,
  )
  one = json.loads([l for l in one.stdout.splitlines() if l.startswith("{")][0])
  assert one["num_devices"] == 1
  # The entry point re-executed itself with huge pages for XLA's buffers
  # (hostmem.py).
  if hostmem.supported() and os.environ.get(hostmem.OPT_OUT) != "0":
    assert one["host_malloc"].startswith("glibc.malloc.hugetlb=1"), one[
        "host_malloc"
    ]
  assert lines[1]["infer_step_flops"] == pytest.approx(
      one["infer_step_flops"], rel=0.02
  )
  # Twice the batch, twice the FLOPs (everything in a ViT step scales with batch
  # except the optimizer update, which is tiny for mu/8).
  assert lines[1]["infer_step_flops"] == pytest.approx(
      2 * lines[0]["infer_step_flops"], rel=0.05
  )


@pytest.mark.timeout(60)
def test_cli_rejects_bad_flags_in_one_line():
  p = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              "-m",
              "big_vit_lite.bench",
              "--variant=mu/8",
              "--mesh=data",
          ]
      ),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=50,
      env=_env(),
  )
  assert p.returncode != 0
  last = p.stderr.strip().splitlines()[-1]
  assert (
      last.startswith("bench: ")
      and "'data'" in last
      and "Traceback" not in p.stderr
  ), last


def test_bench_model_train_only_scan_and_grad_accum():
  from big_vit_lite.models import vit

  outs = {}
  for scan, accum, remat in (
      (False, 1, None),
      (True, 1, None),
      (True, 2, None),
      (False, 1, "nothing_saveable"),
  ):
    model = vit.Model(
        num_classes=10, variant="mu/8", scan=scan, remat_policy=remat
    )
    out = bench.bench_model(
        model,
        batch=4,
        res=16,
        num_classes=10,
        mode=("train",),
        steps=1,
        warmup=0,
        calib_gflops=None,
        grad_accum_steps=accum,
    )
    assert out["train_img_per_s"] > 0 and "infer_img_per_s" not in out
    assert out["mfu"] is None  # no calibration given, no MFU claimed
    assert out["params"] > 0
    outs[scan, accum, remat] = out["step_flops"], out["train_hw_step_flops"]
  # Scanned blocks, microbatches and remat: the same model FLOPs as the plain
  # step (XLA alone counts a loop body once: 1/depth and 1/k of it); remat's
  # recomputation is hardware work.
  plain = outs[False, 1, None]
  assert plain[0] == plain[1] > 0
  assert outs[True, 1, None] == outs[True, 2, None] == plain
  assert (
      outs[False, 1, "nothing_saveable"][0]
      == plain[0]
      < outs[False, 1, "nothing_saveable"][1]
  )


@pytest.mark.timeout(90)
def test_cli_out_of_memory_is_one_line():
  p = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              "-m",
              "big_vit_lite.bench",
              "--variant=mu/16",
              "--res=32",
              "--batch=50000000",
              "--mode=infer",
              "--steps=1",
              "--warmup=0",
              "--calib_n=64",
          ]
      ),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=80,
      env=_env(),
  )
  assert p.returncode == 1
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith(
      "bench: mu/16: out of memory during the benchmark at "
      "input.batch_size=50000000 (50,000,000 per device)"
  ), last
  assert "Traceback" not in p.stderr


def test_check_args_names_the_bad_flag():
  mesh = sharding.make_mesh([("data", 1)], devices=jax.devices("cpu")[:1])
  bench.check_args(
      ["Ti/16", "mu/8"], [1, 32], ["none"], {"gelu": "tanh"}, res=224
  )
  bench.check_args(["mu/8"], [4], ["none"], {}, res=16, mesh=mesh, accum=2)
  bad = [
      ((["X/16"], [32], ["none"], {}), {}, "Unknown ViT variant 'X/16'"),
      (
          (["Ti/16"], [32, 0], ["none"], {}),
          {},
          "--batch=0 --grad_accum=1: input.batch_size=0",
      ),
      (
          (["mu/8"], [4], ["none"], {}),
          dict(mesh=mesh, accum=3),
          r"--batch=4 --grad_accum=3: grad_accum_steps=3 does not divide",
      ),
      (
          (["mu/8"], [4], ["bogus"], {}),
          {},
          r"mu/8: Unknown remat_policy='bogus'",
      ),
      (
          (["mu/8"], [4], ["none"], {"num_heads": 5}),
          {},
          r"mu/8: Width 32 is not divisible by num_heads=5",
      ),
      ((["Ti/16"], [32], ["none"], {"widht": 8}), {}, r"Ti/16: .*'widht'"),
  ]
  for args, kw, match in bad:
    with pytest.raises(ValueError, match=match):
      bench.check_args(
          *args, **{"res": 16 if args[0] == ["mu/8"] else 224, **kw}
      )


def _fake_round(ours_train, timm_train):
  ours = dict(
      train_img_per_s=ours_train,
      infer_img_per_s=2 * ours_train,
      train_mfu=0.5,
      infer_mfu=0.6,
      calib_gflops=100.0,
      train_step_s=32 / ours_train,
      infer_step_s=16 / ours_train,
      dtype="float32",
  )
  timm = dict(
      train_img_per_s=timm_train,
      infer_img_per_s=timm_train,
      train_step_s=32 / timm_train,
      infer_step_s=32 / timm_train,
      calib_gflops=100.0,
  )
  return dict(ours=ours, timm=timm)


def test_vs_timm_ratio_is_median_of_per_round_ratios_and_table_renders():
  rounds = [_fake_round(10, 5), _fake_round(4, 4), _fake_round(30, 10)]
  s = bench_vs_timm.summarize(rounds, flops_train=320e9, flops_infer=100e9)
  assert (
      s["train_ratio"] == 2.0
      and s["train_ratio_min"] == 1.0
      and s["train_ratio_max"] == 3.0
  )
  assert s["ours_train_img_per_s"] == 10
  record = dict(
      label="x",
      variant="Ti/16",
      batch=32,
      res=224,
      dtype="float32",
      machine="cpu",
      rounds=3,
      date="2026-01-01T00:00",
      command="python benchmarks/bench_vs_timm.py",
      summary=s,
  )
  md = bench_vs_timm.render_markdown([record, dict(record, label="y")])
  rows = [
      l for l in md.splitlines() if l.startswith("| x") or l.startswith("| y")
  ]
  assert len(rows) == 2 and "2.00 (1.00-3.00)" in rows[0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_vs_timm_without_timm_runs_our_side(tmp_path):
  p = _run(
      [
          os.path.join("benchmarks", "bench_vs_timm.py"),
          "--variant=mu/8",
          "--batch=2",
          "--res=16",
          "--rounds=1",
          "--steps=1",
          "--warmup=0",
          "--timm_python=none",
          "--no_write",
          "--ours_args=--calib_n=64 --num_classes=10",
      ]
  )
  record = json.loads(
      [l for l in p.stdout.splitlines() if l.startswith("{")][-1]
  )
  assert record["summary"]["ours_train_img_per_s"] > 0
  assert "train_ratio" not in record["summary"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_bench_smoke_runs_on_cpu(tmp_path):
  """The one-command GPU benchmark, tiny variants on the CPU: numerics, our cases, timm's
  (eager and torch.compile), the A/B variants in two worker processes (one with an XLA flag
  preset), the table, RESULTS.md. docs/performance.md's command, with --smoke: every group.
  """
  results = tmp_path / "RESULTS.md"
  results.write_text("# Benchmark results\n\nearlier rows\n")
  env = dict(os.environ, OUT=str(tmp_path), JAX_PLATFORMS="cpu")
  p = subprocess.run(
      [
          "bash",
          os.path.join("benchmarks", "gpu_bench.sh"),
          "--smoke",
          f"--results_md={results}",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=280,
      env=env,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [
      json.loads(l)
      for l in (tmp_path / "gpu_bench.jsonl").read_text().splitlines()
  ]
  numerics = [r for r in rows if r["kind"] == "numerics"][0]
  assert (
      numerics["padded_xla_vs_xla_rel_err"] < 1e-5
      and "skipped" in numerics["cudnn"]
  )
  assert (
      numerics["model_compared"] == "custom vs xla"
      and numerics["model_grad_rel_err"] < 1e-4
  )
  ours = {r["name"]: r for r in rows if r["kind"] == "ours"}
  assert (
      ours["ours mu/8"]["train_img_per_s"] > 0 and ours["ours mu/8"]["default"]
  )
  assert ours["ours mu/8 remat=nothing_saveable"]["train_hw_step_flops"] > (
      ours["ours mu/8 remat=nothing_saveable"]["train_step_flops"]
  )
  assert ours["ours mu/8 attention=xla"]["attention"] == "xla"
  timm = {(r["variant"], r["mode"]): r for r in rows if r["kind"] == "timm"}
  assert timm[("mu/8", "compile")]["train_img_per_s"] > 0, timm
  assert timm[("mu/8", "eager")]["train_img_per_s"] > 0, timm
  # One worker (the flags group) ran with the preset; the others without it.
  devices = [r for r in rows if r["kind"] == "device"]
  preset = [r for r in devices if "triton_gemm" in r["xla_flags"]]
  assert len(preset) == 1 and len(devices) > 1, devices
  assert all("elapsed_s" in r for r in ours.values())
  text = results.read_text()
  assert (
      text.startswith("# Benchmark results\n\nearlier rows")
      and "| ours mu/16 |" in text
  )
  assert (tmp_path / "gpu_bench.md").read_text().strip() in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gpu_bench_stops_at_its_deadline(tmp_path):
  p = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              os.path.join(ROOT, "benchmarks", "gpu_bench.py"),
              "--smoke",
              "--only=main",
              "--budget_s=1",
              "--results_md=none",
          ]
      ),
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=110,
      env=_env(),
  )
  assert p.returncode == 0, p.stderr[-3000:]
  assert (
      "skipped (deadline)" in p.stdout
      and "| ours mu/8 | skipped: deadline" in p.stdout
  )


_BLOCKED = (
    "tensorflow",
    "tensorflow_datasets",
    "ml_collections",
    "clu",
    "orbax",
)
_BLOCKER = f"""
import importlib.abc, runpy, sys
class Blocked(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {_BLOCKED!r}:
      raise ImportError("blocked for this test: " + name)
sys.meta_path.insert(0, Blocked())
"""


@pytest.mark.timeout(120)
def test_bench_runs_from_a_checkout_without_tensorflow_and_friends(tmp_path):
  """What the GPU box has: jax/flax/optax/numpy/absl, no TF, tfds, ml_collections, clu, orbax,
  and no install of this package: the GPU benchmark's worker must run from the checkout.
  """
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["JAX_PLATFORMS"] = "cpu"
  code = _BLOCKER + (
      "import big_vit_lite.bench, big_vit_lite.logs.metrics, big_vit_lite.runtime.flops\n"
      "from big_vit_lite.models import vit\n"
      "assert not any(m.split('.')[0] in %r for m in sys.modules)\n"
      % (_BLOCKED,)
  )
  p = subprocess.run(
      [sys.executable, "-c", code],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=100,
      env=env,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  script = os.path.join(ROOT, "benchmarks", "gpu_bench.py")
  code = _BLOCKER + (
      f"sys.argv = [{script!r}, '--worker=ours', '--cases=[]', '--calib_n=64']\n"
      f"runpy.run_path({script!r}, run_name='__main__')\n"
  )
  p = subprocess.run(
      [sys.executable, "-c", code],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=100,
      env=env,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  assert json.loads(p.stdout.splitlines()[0])["kind"] == "device"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gpu_profile_summarises_a_trace_of_the_timed_steps(tmp_path):
  p = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              os.path.join("benchmarks", "gpu_profile.py"),
              "--smoke",
              f"--trace_dir={tmp_path}",
          ]
      ),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=190,
      env=_env(),
  )
  assert p.returncode == 0, p.stderr[-3000:]
  summary = json.loads(p.stdout.strip().splitlines()[-1])
  assert (
      summary["trace"].startswith(str(tmp_path))
      and summary["train_img_per_s"] > 0
  )
  names = [row["name"] for row in summary["top"]]
  # execution only, no compilation
  assert names and not any("Compile" in n for n in names)
  assert 0.99 <= sum(summary["by_kind"].values()) <= 1.01


@pytest.mark.timeout(120)
def test_cli_reports_with_and_without_remat():
  p = _run(
      [
          "-m",
          "big_vit_lite.bench",
          "--variant=mu/8",
          "--batch=2",
          "--res=16",
          "--num_classes=10",
          "--steps=1",
          "--warmup=0",
          "--calib_n=64",
          "--mode=train",
          "--remat=none,nothing_saveable",
      ]
  )
  off, on = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  assert (off["remat"], on["remat"]) == ("none", "nothing_saveable")
  # model FLOPs: remat recomputes, adds nothing
  assert off["step_flops"] == on["step_flops"]
  assert (
      off["train_hw_step_flops"]
      == off["step_flops"]
      < on["train_hw_step_flops"]
  )
  assert off["attention"] == on["attention"] == "custom"  # CPU


@pytest.mark.timeout(60)
def test_gpu_bench_skips_timm_in_one_line_without_torch(tmp_path):
  # a python that cannot import torch
  python = os.path.join(str(tmp_path), "no_torch_python")
  with open(python, "w") as f:
    f.write(
        f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.exit(\"no torch\")'\n"
    )
  os.chmod(python, 0o755)
  p = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              os.path.join(ROOT, "benchmarks", "gpu_bench.py"),
              "--smoke",
              "--only=timm",
              f"--timm_python={python}",
              "--results_md=none",
          ]
      ),
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=50,
      env=_env(),
  )
  assert p.returncode == 0, p.stderr[-2000:]
  assert [l for l in p.stdout.splitlines() if l.startswith("timm")] == [
      f"timm: skipped (torch/timm not importable by {python})"
  ]


@pytest.mark.timeout(60)
def test_bench_cli_bad_remat_is_one_line_not_a_traceback():
  r = subprocess.run(
      forkserver.command(
          [
              sys.executable,
              "-m",
              "big_vit_lite.bench",
              "--variant=mu/8",
              "--res=16",
              "--remat=bogus",
          ]
      ),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=50,
      env=_env(),
  )
  assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert (
      r.stderr.strip()
      .splitlines()[-1]
      .startswith("bench: mu/8: Unknown remat_policy='bogus'")
  )
