"""The trainer's step compiled by the TPU compiler for any TPU slice, on a CPU-only machine.

  python -m big_vit_lite.plan --config=configs/vit_l16.py --topology=v5p-256 --compile

The `libtpu` wheel (`pip install 'big_vit_lite[tpu]'`) carries the TPU compiler; jax builds
abstract devices of a slice (`jax.experimental.topologies.get_topology_desc`) and compiles
ahead of time for them. What comes back is the compiler's, per device: argument, output and
temporary bytes (`memory_analysis`), FLOPs and `optimal_seconds`, its cost model's step time
(`cost_analysis`), and the collectives in the compiled program. Those times are estimates of a
cost model, not measurements.

Slices are named as Cloud TPU names them (`v5p-256`, `v4-32`, `v5litepod-16`, `v6e-256`:
TensorCores for v2, v3, v4 and v5p, chips for v5e and v6e) or as topologies (`v5p:8x8x8`,
`v5e:2x2`). A JAX device is a TensorCore on v2/v3 (two per chip) and a chip from v4 on.
"""

import dataclasses
import importlib.util
import math
import os
import re

import jax

from big_vit_lite.runtime import flops as flops_lib
from big_vit_lite.runtime.devices import DEVICES
from big_vit_lite.planner import assemble

# Generation (as in accelerator names) -> (topology prefix, counted in cores,
# devices.py key, topology dims).
_GENERATIONS = {
    "v2": ("v2", True, "tpu_v2", 2),
    "v3": ("v3", True, "tpu_v3", 2),
    "v4": ("v4", True, "tpu_v4", 3),
    "v5p": ("v5p", True, "tpu_v5p", 3),
    "v5litepod": ("v5e", False, "tpu_v5e", 2),
    "v5e": ("v5e", False, "tpu_v5e", 2),
    "v6e": ("v6e", False, "tpu_v6e", 2),
}
_PREFIXES = {
    prefix: gen for gen, (prefix, *_) in reversed(_GENERATIONS.items())
}


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str  # as given
  topology: str  # e.g. "v5p:4x4x8"
  chips: int
  devices: int  # JAX devices: cores on v2/v3, chips from v4 on
  device_key: str  # devices.DEVICES key


def _shape(chips, dims):
  """The most nearly cubic (square) power-of-two shape of `chips`, as Cloud TPU lays them out."""
  exp = chips.bit_length() - 1
  if dims == 3 and exp < 3:  # v4-8 is 2x2x1
    return _shape(chips, 2) + "x1"
  sides = [exp // dims + (i >= dims - exp % dims) for i in range(dims)]
  return "x".join(str(2**s) for s in sides)


def parse_slice(name: str) -> Slice:
  """'v5p-256' | 'v5litepod-16' | 'v4-32' | 'v5p:8x8x8' -> Slice; one-line ValueError if unknown."""
  known = (
      "accelerator names like v5p-256, v4-32, v5litepod-16, v6e-256 or topologies like "
      "v5p:8x8x8, v5e:2x2"
  )
  text = name.strip().lower()
  match_acc = re.fullmatch(r"(v\d\w*?)-(\d+)", text)
  match_topo = re.fullmatch(r"(v\d\w*?):(\d+(?:x\d+){1,2})", text)
  if match_acc and match_acc.group(1) in _GENERATIONS:
    prefix, in_cores, key, dims = _GENERATIONS[match_acc.group(1)]
    count = int(match_acc.group(2))
    chips, unit = count, "chips"
    if in_cores:
      chips, unit = count // 2, "cores"
    if chips < 1 or chips & (chips - 1) or (in_cores and count % 2):
      raise ValueError(
          f"--topology={name}: {count} is not a slice size (a power of two "
          f"{unit}); use {known}."
      )
    topology = f"{prefix}:{_shape(chips, dims)}"
  elif match_topo and match_topo.group(1) in _PREFIXES:
    prefix, topology = match_topo.group(1), text
    _, in_cores, key, _ = _GENERATIONS[_PREFIXES[prefix]]
    chips = math.prod(int(s) for s in match_topo.group(2).split("x"))
  else:
    raise ValueError(f"--topology={name}: unknown TPU slice; use {known}.")
  cores_per_device = 2 if prefix in ("v2", "v3") else 1
  return Slice(name, topology, chips, chips * cores_per_device, key)


def slice_devices(tpu_slice: Slice):
  """The slice's abstract TPU devices (nothing runs on them); one-line errors."""
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError(
        "the TPU compiler needs libtpu: pip install 'big_vit_lite[tpu]'"
    )
  # Without it libtpu asks a GCE metadata server (absent here) for the VM's TPU
  # and waits.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # Any other jax process on this host holds libtpu's lockfile (each one tries
  # to start a TPU backend and keeps the lock): compiling needs no TPU, so share
  # it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # A v4 VM runs its chips' two cores as one JAX device (megacore); the
  # topology's default is a device per core.
  megacore = {}
  if tpu_slice.topology.startswith("v4:"):
    megacore = {"chip_config_name": "megacore"}
  try:
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=tpu_slice.topology, **megacore
    )
  except Exception as e:  # pylint: disable=broad-except  # libtpu's own error types
    raise ValueError(
        f"--topology={tpu_slice.name}: libtpu refused topology "
        f"{tpu_slice.topology}: {assemble.first_line(e)}"
    ) from None
  devices = list(desc.devices)
  if len(devices) != tpu_slice.devices:
    raise ValueError(
        f"--topology={tpu_slice.name}: topology {tpu_slice.topology} gave "
        f"{len(devices)} devices, expected {tpu_slice.devices}"
    )
  return devices


def compiled_stats(config, mesh: dict, res: int, tpu_slice: Slice):
  """The TPU compiler's figures for the trainer's step on `tpu_slice` (plan's tpu_* fields)."""
  spec = DEVICES[tpu_slice.device_key]
  try:
    built, traced, compiled, memory = assemble.compile_on(
        config, mesh, slice_devices(tpu_slice), res, target="tpu"
    )
  # The compiler refuses a program over the HBM.
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return _refused(str(e), tpu_slice, spec)
  cost = compiled.cost_analysis() or {}
  raw_flops = float(cost.get("flops", 0.0))
  # XLA counts a loop body (nn.scan's layers, the microbatches) once: scale its
  # flops, and its time by the same ratio. Rough: the time outside the loops
  # (the optimizer update, large for replicated params) is scaled too; without
  # loops (scan=False, no grad_accum) it is exact.
  flops = flops_lib.step_flops(traced, compiled, tpu_slice.devices) or raw_flops
  loop_scale = flops / raw_flops if raw_flops else 1.0
  # Some programs get no estimate (optimal_seconds <= 0: seen for a scanned S/16
  # on v5e).
  est_s = max(0.0, float(cost.get("optimal_seconds", 0.0))) * loop_scale
  model_flops = float(flops_lib.model_flops(traced))
  return dict(
      tpu_topology=tpu_slice.topology,
      tpu_chips=tpu_slice.chips,
      **{f"tpu_{k}_bytes": b for k, b in memory.items()},
      tpu_hbm_bytes=int(spec.hbm_bytes),
      tpu_fits=bool(memory["peak"] <= spec.hbm_bytes),
      tpu_hbm_spare=1.0 - memory["peak"] / spec.hbm_bytes,
      tpu_flops_per_device=flops,
      tpu_model_flops=model_flops,
      tpu_loop_scale=loop_scale,
      **estimates(est_s, built.batch_size, model_flops, tpu_slice),
      tpu_collectives=flops_lib.collectives(compiled.as_text()),
  )


def estimates(step_s, batch, model_flops, tpu_slice: Slice):
  """tpu_est_*: a step time and the img/s per chip and MFU it implies (None: no time)."""
  if not step_s:
    return dict(
        tpu_est_step_s=None,
        tpu_est_img_per_s_per_chip=None,
        tpu_est_mfu=None,
    )
  peak_flops = DEVICES[tpu_slice.device_key].bf16_flops
  return dict(
      tpu_est_step_s=step_s,
      tpu_est_img_per_s_per_chip=batch / step_s / tpu_slice.chips,
      tpu_est_mfu=model_flops / tpu_slice.devices / step_s / peak_flops,
  )


def _refused(message, tpu_slice, spec):
  """plan's tpu_* fields for a step the compiler refused as too big for the HBM."""
  first = message.strip().splitlines()[0]
  # "... the total memory required for HLO temporaries (395.57G) exceeds
  # available HBM ..."
  sizes = re.findall(r"\(([\d.]+)([KMGT])\)", first)
  units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
  needed = None
  if sizes:
    needed = int(float(sizes[0][0]) * units[sizes[0][1]])
  return dict(
      tpu_topology=tpu_slice.topology,
      tpu_chips=tpu_slice.chips,
      tpu_hbm_bytes=int(spec.hbm_bytes),
      tpu_fits=False,
      tpu_refused=first,
      tpu_needed_bytes=needed,
  )
