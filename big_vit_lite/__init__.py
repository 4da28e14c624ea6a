"""big_vit_lite: pretrain Vision Transformers with JAX/Flax at any scale."""

import glob
import importlib.util
import os
import sys

__version__ = "0.1.0"


def _skip_tpu_probe_without_tpu():
  """jax on the CPU, quietly, where libtpu is installed but this host has no TPU chip.

  libtpu comes with the `[tpu]` extra (and the test venv) for `plan --topology=SLICE --compile`,
  the TPU compiler on a CPU machine. Left alone, jax's start-up then probes for TPU chips and
  prints a screen of metadata errors before falling back to the CPU. A TPU VM has /dev/accel*
  (v2-v4) or /dev/vfio/N (v5e and later); a user's JAX_PLATFORMS always wins, and a host with
  jax's CUDA plugin is left to jax.
  """
  if (
      os.environ.get("JAX_PLATFORMS")
      or importlib.util.find_spec("libtpu") is None
  ):
    return
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  for cuda_plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin"):
    if importlib.util.find_spec(cuda_plugin) is not None:
      return
  if "jax" in sys.modules:
    sys.modules["jax"].config.update("jax_platforms", "cpu")
  else:
    os.environ["JAX_PLATFORMS"] = "cpu"


def _our_command(argv):
  """Whether `argv` (sys.orig_argv) runs one of this package's modules: `python -m big_vit_lite.X`."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg == "-m":
      module = argv[i + 1] if i + 1 < len(argv) else ""
    elif arg.startswith("-m"):
      module = arg[2:]
    else:
      continue
    return module.startswith("big_vit_lite.")
  return False


def _quiet_tensorflow_start_up():
  """TensorFlow's start-up lines off in every command (train, evaluate, predict, ...).

  Runs when a `python -m big_vit_lite.X` process imports this package, which is before the
  module, and so TensorFlow, loads; the user's settings win. TensorFlow's oneDNN ops print a
  banner and, on CPUs without AVX-512, an error-level line about DT_UINT8 at the first batch
  (not an error: it falls back to Eigen); they run only in the input pipeline here. C++ INFO
  lines go too (TF_CPP_MIN_LOG_LEVEL=1, and with them absl's "before InitializeLog" notice):
  warnings and errors stay. A program that imports the package is left alone.
  """
  if not _our_command(getattr(sys, "orig_argv", [])):
    return
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


_skip_tpu_probe_without_tpu()
_quiet_tensorflow_start_up()
