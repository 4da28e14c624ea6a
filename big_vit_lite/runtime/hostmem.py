"""Host memory for XLA's buffers: transparent huge pages through glibc malloc.

XLA CPU allocates a jitted step's temporaries as one block per call and frees it
when the call returns; glibc serves such blocks (over 32 MB) with a fresh mmap, so
every step faults the whole block in again, 4 KiB at a time. `glibc.malloc.hugetlb=1`
(glibc >= 2.35) makes malloc madvise them for transparent huge pages: 1.4-1.5x on
ViT-Ti/16's CPU step; numerics are untouched (benchmarks/NOTES.md, section "Plan,
bench, FLOPs, metrics").

glibc reads GLIBC_TUNABLES when the process starts, so the job entry points
(train, bench, evaluate) call `use_huge_pages()` first thing: it re-executes
the same command once with the tunable added (same pid, argv, stdin/stdout).
It does so only on Linux with glibc >= 2.35, when the kernel's
transparent-huge-page mode is `madvise` (with `always` such blocks get huge
pages anyway; with `never` they cannot), when GLIBC_TUNABLES does not set the
tunable already (to either value), and unless BIG_VIT_LITE_HUGE_PAGES=0.
"""

import os
import platform
import re
import sys

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "BIG_VIT_LITE_HUGE_PAGES"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode():
  """The kernel's transparent-huge-page mode ('always', 'madvise', 'never'), or None."""
  try:
    with open(_THP) as f:
      return re.search(r"\[(\w+)\]", f.read()).group(1)
  except (OSError, AttributeError):  # No such file, or no [mode] in it.
    return None


def _setting():
  """The `glibc.malloc.hugetlb=...` entry of GLIBC_TUNABLES, or None."""
  tunables = os.environ.get("GLIBC_TUNABLES", "")
  return next(
      (t for t in tunables.split(":") if t.startswith(TUNABLE + "=")), None
  )


def supported():
  """Linux, glibc >= 2.35 (older ones ignore the tunable) and THP in `madvise` mode."""
  libc, version = platform.libc_ver()
  return (
      sys.platform == "linux"
      and libc == "glibc"
      and tuple(int(p) for p in version.split(".")[:2]) >= (2, 35)
      and thp_mode() == "madvise"
  )


def status():
  """One line for the logs: whether XLA's buffers get huge pages, and why not."""
  if _setting():
    return f"{_setting()} (transparent huge pages: {thp_mode()})"
  off = os.environ.get(OPT_OUT) == "0"
  return (
      f"default malloc ({OPT_OUT}=0)"
      if off
      else (f"default malloc (transparent huge pages: {thp_mode()})")
  )


def use_huge_pages(main_file):
  """Re-executes this process once with GLIBC_TUNABLES=glibc.malloc.hugetlb=1.

  Call it as `use_huge_pages(__file__)` at the top of a `__main__` block,
  before jax or TensorFlow load (they would be loaded twice otherwise).
  Returns when there is nothing to do; otherwise the process image is
  replaced and the same command starts again.
  """
  # e.g. runpy from elsewhere
  if (
      os.path.realpath(sys.argv[0]) != os.path.realpath(main_file)
      or os.environ.get(OPT_OUT) == "0"
      or _setting()
      or not supported()
  ):
    # (_setting: already set, by us or by the user, who may have set it to 0.)
    return
  tunables = (os.environ.get("GLIBC_TUNABLES"), f"{TUNABLE}=1")
  env = dict(os.environ, GLIBC_TUNABLES=":".join(t for t in tunables if t))
  sys.stdout.flush()
  sys.stderr.flush()
  try:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
  # Keep going without huge pages rather than fail the job.
  except OSError as e:
    print(
        f"big_vit_lite: could not re-execute with {TUNABLE}=1 ({e}); "
        f"continuing with the default malloc.",
        file=sys.stderr,
    )
