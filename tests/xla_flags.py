"""XLA_FLAGS for the test run and the processes its tests start.

The tests' models are tiny, so XLA's CPU compiler takes far longer than running
what it compiles: without LLVM's optimisations (FAST_COMPILE) the compiles
cost less than half. Measured on 2026-12-06 (2-core machine, cold compile
cache): test_train_stages.py + test_vit_options.py 110 -> 71 s of CPU; a
`demo:runlocal` run 20.3 -> 15.8 s. The numbers a step computes do not move
(LLVM keeps IEEE semantics at every level; XLA's fast-math stays off), and each
test compares runs made under the same flags.

conftest.py puts FAST_COMPILE in os.environ's XLA_FLAGS for the whole run;
a test that sets XLA_FLAGS for a process it starts uses `with_devices(n)`.
"""

import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
DEVICES = "--xla_force_host_platform_device_count"


def for_run(environ_flags):
  """The run's XLA_FLAGS: the user's own (`environ_flags`, may be None) and FAST_COMPILE."""
  return f"{environ_flags or ''} {FAST_COMPILE}".strip()


def with_devices(devices):
  """XLA_FLAGS for a process with `devices` simulated CPU devices (and FAST_COMPILE)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if FAST_COMPILE not in flags:
    flags = for_run(flags)
  # (a later flag wins over an earlier one of the same name)
  return f"{flags} {DEVICES}={devices}"
