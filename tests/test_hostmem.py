"""hostmem: the entry points re-execute once with glibc's huge-page tunable."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from big_vit_lite.runtime import hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# With THP `always` the kernel gives large blocks huge pages without the
# tunable, and hostmem leaves the process alone; with `never` nothing can.
needs_thp = pytest.mark.skipif(
    not hostmem.supported(),
    reason="needs Linux, glibc >= 2.35 and transparent huge pages in madvise mode",
)

# A job entry point in miniature: the call first, then it reports what it got.
# The array part counts the page faults of a jitted op with a 64 MB output,
# which XLA allocates afresh on every call.
_MAIN = textwrap.dedent("""
    import os, sys
    print("pid_before", os.getpid(), flush=True)
    if __name__ == "__main__":
      from big_vit_lite.runtime import hostmem
      hostmem.use_huge_pages(__file__)
    import json, resource
    out = dict(pid=os.getpid(), argv=sys.argv[1:], tunables=os.environ.get("GLIBC_TUNABLES"),
               status=hostmem.status())
    if "faults" in sys.argv:
      import jax, jax.numpy as jnp
      f = jax.jit(lambda x: x * 2.0 + 1.0)
      x = jnp.ones((16 * 1024 * 1024,), jnp.float32)
      for _ in range(2): f(x).block_until_ready()
      r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      for _ in range(5): f(x).block_until_ready()
      out["faults_per_call"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5
    print(json.dumps(out), flush=True)
""")


def _run(tmp_path, *args, **env):
  script = tmp_path / "entry.py"
  script.write_text(_MAIN)
  full_env = {
      k: v
      for k, v in os.environ.items()
      if k not in ("GLIBC_TUNABLES", hostmem.OPT_OUT)
  }
  full_env.update(env, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  p = subprocess.run(
      [sys.executable, str(script), *args],
      capture_output=True,
      text=True,
      env=full_env,
      timeout=300,
      check=True,
  )
  lines = p.stdout.splitlines()
  pids = [int(l.split()[1]) for l in lines if l.startswith("pid_before")]
  return pids, json.loads(lines[-1])


@needs_thp
def test_reexecutes_once_with_the_tunable_same_pid_and_argv(tmp_path):
  pids, out = _run(tmp_path, "a", "--b=1")
  # Ran twice, one process.
  assert len(pids) == 2 and pids[0] == pids[1] == out["pid"]
  assert out["argv"] == ["a", "--b=1"]
  assert out["tunables"] == "glibc.malloc.hugetlb=1"
  assert out["status"].startswith("glibc.malloc.hugetlb=1")


@needs_thp
def test_keeps_other_tunables_and_respects_the_users_setting(tmp_path):
  _, out = _run(tmp_path, GLIBC_TUNABLES="glibc.malloc.check=0")
  assert out["tunables"] == "glibc.malloc.check=0:glibc.malloc.hugetlb=1"
  pids, out = _run(tmp_path, GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
  assert len(pids) == 1 and out["tunables"] == "glibc.malloc.hugetlb=0"


def test_opt_out_runs_once_with_the_default_malloc(tmp_path):
  pids, out = _run(tmp_path, **{hostmem.OPT_OUT: "0"})
  assert len(pids) == 1 and out["tunables"] is None
  assert "BIG_VIT_LITE_HUGE_PAGES=0" in out["status"]


@needs_thp
def test_huge_pages_cut_the_page_faults_of_xla_buffers(tmp_path):
  # 64 MB per call: ~16k faults of 4 KiB without the tunable, ~32 of 2 MiB with
  # it.
  _, default = _run(tmp_path, "faults", **{hostmem.OPT_OUT: "0"})
  _, huge = _run(tmp_path, "faults")
  assert default["faults_per_call"] > 8000, default
  assert huge["faults_per_call"] < default["faults_per_call"] / 10, (
      huge,
      default,
  )


def test_not_applied_when_run_from_another_program(monkeypatch, tmp_path):
  # runpy from another program: argv[0] is not the module's file, so no exec.
  monkeypatch.setattr(sys, "argv", [str(tmp_path / "other.py")])
  monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
  monkeypatch.setattr(
      os, "execve", lambda *a: pytest.fail("must not re-execute")
  )
  hostmem.use_huge_pages(os.path.join(ROOT, "big_vit_lite", "train.py"))
