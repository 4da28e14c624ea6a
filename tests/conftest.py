"""Shared pytest fixtures.

`tfds_data_dir`: a tfds data dir holding the three offline datasets
(fashion_mnist, mnist10k, animal_mnist), prepared once and reused across
sessions. Where: $BVL_TEST_DATA_DIR, else $TFDS_DATA_DIR, else
~/tensorflow_datasets. Their sources must be installed first with
scripts/fetch_offline_sources.sh (.ci/run does it before pytest).

JAX's persistent compilation cache is on for the whole run (a temporary dir,
shared with the trainer subprocesses and xdist workers through the
environment): the kill/resume tests start the same tiny run several times,
and each start compiled the same programs again (~7 s of a ~22 s start).

shared_dirs.built_once(name, build): a folder several test files read (a
trained workdir), built once per pytest run in a temporary dir the xdist
workers share (BVL_TEST_BUILT_DIR, made here).

With xdist's `--dist loadfile` (scripts/test.sh), one worker runs each test
file (its module fixtures built once), except that the files in SPLIT are
dealt to both (pytest_xdist_make_scheduler, at the end).
"""

import atexit
import collections
import os
import shutil
import tempfile

import pytest

# Before any test module imports TensorFlow: its import then skips Keras and
# scikit-learn (big_vit_lite/data/__init__.py), ~1.5 s of CPU per xdist worker.
import big_vit_lite.data  # noqa: F401  pylint: disable=unused-import
from big_vit_lite.runtime import hostmem
import shared_dirs
import xla_flags

OFFLINE = ("fashion_mnist", "mnist10k", "animal_mnist")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="bvl-test-jax-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(
      JAX_COMPILATION_CACHE_DIR=_cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )
# XLA's CPU compiler without LLVM's optimisations (tests/xla_flags.py): read when
# jax starts its backend, in this process and in the ones the tests start.
if xla_flags.FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = xla_flags.for_run(os.environ.get("XLA_FLAGS"))
# Set by the first process (pytest itself, or xdist's controller before it
# starts the workers): the workers find it in their environment.
if "BVL_TEST_BUILT_DIR" not in os.environ:
  _built = tempfile.mkdtemp(prefix="bvl-test-built-")
  atexit.register(shutil.rmtree, _built, ignore_errors=True)
  os.environ["BVL_TEST_BUILT_DIR"] = _built
# The job entry points (train, evaluate, bench) re-execute themselves once with
# glibc's huge-page tunable where it helps (big_vit_lite/runtime/hostmem.py). The
# processes the tests start have it from the start: no re-execution, so a command
# the fork server forks needs no second zygote, keyed by the re-executed
# environment (4 of them in the whole suite). The numbers are the same (malloc's
# page size only); test_hostmem.py and test_bench.py drop the variable to check
# the re-execution itself.
if (
    "GLIBC_TUNABLES" not in os.environ
    and os.environ.get(hostmem.OPT_OUT) != "0"
    and hostmem.supported()
):
  os.environ["GLIBC_TUNABLES"] = f"{hostmem.TUNABLE}=1"
# The trainers the tests start keep the CPU's measured peak (metrics.py) in the
# run's temporary dir, not in the user's ~/.cache: a peak timed while the
# suite loads the machine would make the user's own runs read a high MFU.
if "BVL_CPU_PEAK_FILE" not in os.environ:
  os.environ["BVL_CPU_PEAK_FILE"] = os.path.join(
      os.environ["BVL_TEST_BUILT_DIR"], "cpu_peak.json"
  )


def _test_data_dir():
  return os.path.expanduser(
      os.environ.get("BVL_TEST_DATA_DIR")
      or os.environ.get("TFDS_DATA_DIR")
      or "~/tensorflow_datasets"
  )


def prepare_shared(data_dir, names, **kwargs):
  """Prepares the datasets `names` in `data_dir`, which several pytest runs and
  xdist workers may share: one prepares under the dir's lock, the others wait
  (a reader that did not wait could find a half-written dataset)."""
  from big_vit_lite.data import prepare  # pylint: disable=import-outside-toplevel

  with shared_dirs.locked(os.path.join(data_dir, ".bvl_prepare.lock")):
    for name in names:
      prepare.prepare(name, data_dir, **kwargs)


@pytest.fixture(scope="session")
def tfds_data_dir():
  data_dir = _test_data_dir()
  os.makedirs(data_dir, exist_ok=True)
  try:
    prepare_shared(data_dir, OFFLINE, source="offline")
  except FileNotFoundError as e:
    pytest.fail(f"cannot prepare the offline datasets: {e}", pytrace=False)
  return data_dir


@pytest.fixture(scope="session")
def prepare_in_test_data(tfds_data_dir):
  """`prepare_in_test_data(name)` prepares one more dataset in tfds_data_dir."""
  return lambda name: prepare_shared(tfds_data_dir, [name])


# xdist (scripts/test.sh: --dist loadfile) runs each test file on one worker.
# These files take longer than the rest of the suite keeps the other worker
# busy: their tests are dealt (in turn, in collection order) to this many parts,
# each scheduled like a file of its own.
SPLIT = {"tests/test_docs_commands.py": 6}
# The longest files and parts, started first so that neither worker is left
# with a long one at the end; the rest follow in xdist's order (most tests
# first), which would otherwise leave the long files of few tests to the end.
# Longest first, as timed on a quiet 2-core machine (the junit XML of the
# whole suite on 2026-12-05, worker seconds; test_multiprocess and test_bucket
# less since): test_multiprocess ~240, test_bucket ~160, test_docs_commands.py
# 860 whole, so ~145 a part, test_plan 122, test_train 119, test_train_sharded 86, test_evaluate_cli and test_bench 80 (test_timm_options 76, ~40 since
# it runs in-process), test_summary 74, test_tpu_compile 66, test_vit 64, test_distill 61,
# test_ema 58, test_configs 56, test_report 52, test_train_stages 47,
# test_train_faults 43, test_vit_options 42, test_data_random_access 41,
# test_folder_walk and test_train_state 36 (the rest under 35; test_grad_accum
# ~30 since it reads test_train's shared kill runs: left to the end, when they are
# built, so that it does not wait for them). A file that grows long belongs here.
LONGEST_FIRST = (
    "tests/test_multiprocess.py",
    "tests/test_bucket.py",
    *(f"tests/test_docs_commands.py::part{i}" for i in range(6)),
    "tests/test_plan.py",
    "tests/test_train.py",
    "tests/test_train_sharded.py",
    "tests/test_evaluate_cli.py",
    "tests/test_bench.py",
    "tests/test_summary.py",
    "tests/test_tpu_compile.py",
    "tests/test_vit.py",
    "tests/test_distill.py",
    "tests/test_ema.py",
    "tests/test_configs.py",
    "tests/test_report.py",
    "tests/test_timm_options.py",
    "tests/test_train_stages.py",
    "tests/test_train_faults.py",
    "tests/test_vit_options.py",
    "tests/test_data_random_access.py",
    "tests/test_folder_walk.py",
    "tests/test_train_state.py",
)


def pytest_xdist_make_scheduler(config, log):
  """--dist loadfile with SPLIT's files in parts and LONGEST_FIRST first."""
  if config.getvalue("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=import-outside-toplevel

  class LoadFileSplitScheduling(LoadFileScheduling):

    def __init__(self, config, log):
      super().__init__(config, log)
      self.part_of = None  # nodeid -> its part, for the tests of SPLIT's files
      self.ordered = False

    def _split_scope(self, nodeid):
      path = super()._split_scope(nodeid)
      if path not in SPLIT:
        return path
      if self.part_of is None:
        self.part_of, dealt = {}, collections.Counter()
        for n in self.collection:
          file = super()._split_scope(n)
          if file in SPLIT:
            self.part_of[n] = dealt[file] % SPLIT[file]
            dealt[file] += 1
      return f"{path}::part{self.part_of[nodeid]}"

    def _assign_work_unit(self, node):
      if not self.ordered:
        for scope in reversed(LONGEST_FIRST):
          if scope in self.workqueue:
            self.workqueue.move_to_end(scope, last=False)
        self.ordered = True
      super()._assign_work_unit(node)

  return LoadFileSplitScheduling(config, log)
