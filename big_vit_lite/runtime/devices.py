"""Datasheet figures of the accelerators we know: one table for MFU and planning.

The trainer's MFU (metrics.py), the benchmark's `mfu_peak` (bench.py) and
the memory / step-time planner (plan.py) all read this table, so a new chip
is added once.

Figures are per JAX device. On TPU v2/v3 a JAX device is one TensorCore
(half a chip); on v4, v5p (megacore) and v5e/v6e (one core) it is a chip.
Sources (vendor datasheets / Cloud TPU system-architecture pages):
  TPU v2:  45 TFLOP/s bf16 and 16 GiB HBM per chip (2 cores)
  TPU v3:  123 TFLOP/s bf16 and 32 GiB HBM per chip (2 cores), ICI 656 Gbit/s per core
  TPU v4:  275 TFLOP/s bf16, 32 GiB HBM2, ICI 2,400 Gbit/s per chip (cloud.google.com/tpu/docs/v4)
  TPU v5e: 197 TFLOP/s bf16, 16 GiB HBM2, ICI 1,600 Gbit/s per chip (cloud.google.com/tpu/docs/v5e)
  TPU v5p: 459 TFLOP/s bf16, 95 GiB HBM2e, ICI 4,800 Gbit/s per chip (cloud.google.com/tpu/docs/v5p)
  TPU v6e: 918 TFLOP/s bf16, 32 GiB HBM, ICI 3,584 Gbit/s per chip (cloud.google.com/tpu/docs/v6e)
  A100 SXM 80GB: 312 TFLOP/s bf16 dense, 80 GB HBM2e, NVLink 3 600 GB/s
  H100 SXM: 989 TFLOP/s bf16 dense, 80 GB HBM3, NVLink 4 900 GB/s
  H200 SXM: 989 TFLOP/s bf16 dense, 141 GB HBM3e, NVLink 4 900 GB/s
  L4: 121 TFLOP/s bf16 dense, 24 GB GDDR6, PCIe Gen4 x16 (64 GB/s both ways)
NVLink / PCIe figures are bidirectional totals; halved here. Multi-node GPU
jobs are slower (InfiniBand). f32 matmuls at JAX's default precision: TPUs
run them as one bf16 pass (full bf16 rate); Ampere and newer GPUs use TF32
tensor cores at half the bf16 rate.

CPUs have no entry: their rate depends on cores, SIMD width and neighbours,
so MFU on CPU is against a matmul rate measured once per machine (metrics.py).
"""

import dataclasses
import re

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  name: str
  # lower-case substrings of jax's `device.device_kind` that mean this device
  kinds: tuple
  bf16_flops: float  # dense peak, per JAX device
  f32_flops: float  # at JAX's default matmul precision
  hbm_bytes: int
  # one direction, per device, of the links data/fsdp collectives use
  link_bytes_per_s: float


# Order matters for matching: the first entry with a substring of the
# device_kind wins, so more specific names come first ("tpu v5 lite" before
# "tpu v5").
DEVICES = {
    "tpu_v2": DeviceSpec(
        "TPU v2 (per core)", ("tpu v2",), 22.5e12, 22.5e12, 8 * GIB, 496e9 / 8
    ),
    "tpu_v3": DeviceSpec(
        "TPU v3 (per core)", ("tpu v3",), 61.5e12, 61.5e12, 16 * GIB, 656e9 / 8
    ),
    "tpu_v4": DeviceSpec(
        "TPU v4", ("tpu v4",), 275e12, 275e12, 32 * GIB, 2400e9 / 8
    ),
    "tpu_v5e": DeviceSpec(
        "TPU v5e",
        ("tpu v5 lite", "tpu v5e"),
        197e12,
        197e12,
        16 * GIB,
        1600e9 / 8,
    ),
    "tpu_v5p": DeviceSpec(
        "TPU v5p", ("tpu v5p", "tpu v5"), 459e12, 459e12, 95 * GIB, 4800e9 / 8
    ),
    "tpu_v6e": DeviceSpec(
        "TPU v6e",
        ("tpu v6 lite", "tpu v6e"),
        918e12,
        918e12,
        32 * GIB,
        3584e9 / 8,
    ),
    "a100": DeviceSpec(
        "A100 SXM 80GB", ("a100",), 312e12, 156e12, 80 * 10**9, 600e9 / 2
    ),
    "h100": DeviceSpec(
        "H100 SXM", ("h100",), 989e12, 494.5e12, 80 * 10**9, 900e9 / 2
    ),
    "h200": DeviceSpec(
        "H200 SXM", ("h200",), 989e12, 494.5e12, 141 * 10**9, 900e9 / 2
    ),
    "b200": DeviceSpec(
        "B200 SXM", ("b200",), 2250e12, 1125e12, 180 * 10**9, 1800e9 / 2
    ),
    "l4": DeviceSpec("L4", ("nvidia l4",), 121e12, 60e12, 24 * 10**9, 64e9 / 2),
}


def lookup(device_kind):
  """The DeviceSpec whose kinds match `device_kind` (e.g. 'NVIDIA H200'), or None."""
  # A name must not run on into more letters/digits: "nvidia l4" is not an L40S.
  return next(
      (
          spec
          for spec in DEVICES.values()
          if any(
              re.search(re.escape(k) + r"(?![0-9a-z])", device_kind.lower())
              for k in spec.kinds
          )
      ),
      None,
  )


def datasheet_peak(device, dtype="bfloat16"):
  """Peak matmul FLOP/s of one jax device for `dtype` ('bfloat16' | 'float32'), or None."""
  spec = None if device.platform == "cpu" else lookup(device.device_kind)
  return spec and (spec.f32_flops if dtype == "float32" else spec.bf16_flops)
