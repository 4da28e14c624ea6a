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


_skip_tpu_probe_without_tpu()
