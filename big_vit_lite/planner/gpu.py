"""The trainer's step compiled by XLA's GPU compiler for a GPU host, on a CPU-only machine.

  python -m big_vit_lite.plan --config=configs/vit_b16.py --gpu=h100x8 --compile

The CUDA plugin wheels carry XLA's GPU compiler (`pip install 'big_vit_lite[gpu-compile]'`,
docs/gpu.md); jax builds abstract devices of a host from a GpuTargetConfig
(`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`), and
the step compiles for them without a GPU. What comes back is the compiler's, per GPU:
argument, output and temporary bytes (`memory_analysis`) and the collectives in the
program. No time: the GPU compiler's cost analysis needs a GPU. Kernel autotuning (which
runs kernels) is off, and so are Triton GEMM fusions (their tiling is chosen by autotuning;
without it the compile fails): the memory is that of cuBLAS GEMMs.

The devices' target configs below are written from NVIDIA's datasheets (SM count, FP32
lanes per SM, boost clock, memory bandwidth and size, L2, shared memory, compute
capability), in the format of XLA's own spec files (xla/backends/gpu/target_config).
"""

import dataclasses
import importlib.util
import os
import re

import jax

from big_vit_lite.runtime import flops as flops_lib
from big_vit_lite.runtime.devices import DEVICES
from big_vit_lite.planner import assemble

# What the GPU compiler needs deviceless: no autotuning (it runs kernels), and no
# Triton GEMMs (autotuning picks their tiles: "Couldn't find output tile sizes").
COMPILER_OPTIONS = dict(
    xla_gpu_autotune_level=0,
    xla_gpu_enable_triton_gemm=False,
)


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU model: its devices.DEVICES key and its XLA GpuTargetConfig's numbers."""

  device_key: str
  description: str  # What the CUDA driver calls it (device_kind).
  core_count: int  # SMs
  fpus_per_core: int  # FP32 lanes per SM
  clock_rate_ghz: float
  memory_bandwidth: int  # bytes/s
  l2_cache_size: int
  device_memory_size: int
  shared_memory_per_core: int
  shared_memory_per_block_optin: int
  compute_capability: tuple

  def target_config(self) -> str:
    """XLA's GpuTargetConfig as a text proto (cuDNN 9.7, CUDA 12.8)."""
    major, minor = self.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 7 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{self.description}"
"""


# From the datasheets (SXM parts); memory as devices.DEVICES counts it.
GPUS = {
    "a100-80gb": Gpu(
        device_key="a100",
        description="NVIDIA A100-SXM4-80GB",
        core_count=108,
        fpus_per_core=64,
        clock_rate_ghz=1.41,
        memory_bandwidth=2_039_000_000_000,
        l2_cache_size=40 * 2**20,
        device_memory_size=DEVICES["a100"].hbm_bytes,
        shared_memory_per_core=167936,
        shared_memory_per_block_optin=166912,
        compute_capability=(8, 0),
    ),
    "h100": Gpu(
        device_key="h100",
        description="NVIDIA H100 80GB HBM3",
        core_count=132,
        fpus_per_core=128,
        clock_rate_ghz=1.98,
        memory_bandwidth=3_350_000_000_000,
        l2_cache_size=50 * 2**20,
        device_memory_size=DEVICES["h100"].hbm_bytes,
        shared_memory_per_core=233472,
        shared_memory_per_block_optin=232448,
        compute_capability=(9, 0),
    ),
    "h200": Gpu(
        device_key="h200",
        description="NVIDIA H200",
        core_count=132,
        fpus_per_core=128,
        clock_rate_ghz=1.98,
        memory_bandwidth=4_800_000_000_000,
        l2_cache_size=50 * 2**20,
        device_memory_size=DEVICES["h200"].hbm_bytes,
        shared_memory_per_core=233472,
        shared_memory_per_block_optin=232448,
        compute_capability=(9, 0),
    ),
    "b200": Gpu(
        device_key="b200",
        description="NVIDIA B200",
        core_count=148,
        fpus_per_core=128,
        clock_rate_ghz=1.965,
        memory_bandwidth=8_000_000_000_000,
        l2_cache_size=126 * 2**20,
        device_memory_size=DEVICES["b200"].hbm_bytes,
        shared_memory_per_core=233472,
        shared_memory_per_block_optin=232448,
        compute_capability=(10, 0),
    ),
}


@dataclasses.dataclass(frozen=True)
class Host:
  """GPU hosts as `--gpu=h100x8 --hosts=N` name them."""

  name: str  # as given
  gpu: str  # GPUS key
  per_host: int
  hosts: int

  @property
  def devices(self) -> int:
    return self.per_host * self.hosts


def parse_host(name: str, hosts: int = 1) -> Host:
  """'h100x8' (GPU name x GPUs per host) -> Host; a one-line ValueError if unknown."""
  match = re.fullmatch(r"([a-z0-9-]+?)x(\d+)", name.strip().lower())
  known = ", ".join(f"{g}x8" for g in GPUS)
  if not match or match.group(1) not in GPUS:
    raise ValueError(f"--gpu={name}: unknown GPU host; use one of {known}.")
  per_host = int(match.group(2))
  if per_host < 1 or hosts < 1:
    raise ValueError(
        f"--gpu={name} --hosts={hosts}: need at least one GPU and one host."
    )
  return Host(name, match.group(1), per_host, hosts)


def host_devices(host: Host):
  """The host's abstract GPUs (nothing runs on them); one-line errors."""
  if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    raise ValueError(
        "the GPU compiler needs the CUDA plugin: pip install "
        "'big_vit_lite[gpu-compile]' (docs/gpu.md)"
    )
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  try:
    desc = topologies.get_topology_desc(
        platform="cuda",
        target_config=GPUS[host.gpu].target_config(),
        topology=f"1x{host.hosts}x{host.per_host}",
    )
  except Exception as e:  # pylint: disable=broad-except  # the plugin's own error types
    raise ValueError(
        f"--gpu={host.name}: the CUDA plugin gave no devices "
        f"({assemble.first_line(e)}); run "
        "with JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (docs/gpu.md)"
    ) from None
  devices = list(desc.devices)
  if len(devices) != host.devices:
    raise ValueError(
        f"--gpu={host.name} --hosts={host.hosts}: the plugin gave "
        f"{len(devices)} devices, expected {host.devices}"
    )
  return devices


def compiled_stats(config, mesh: dict, res: int, host: Host) -> dict:
  """The GPU compiler's figures for the trainer's step on `host` (plan's gpu_* fields)."""
  gpu = GPUS[host.gpu]
  # (cuDNN attention looks for the library as it traces.)
  try:
    built, _, compiled, memory = assemble.compile_on(
        config, mesh, host_devices(host), res, "gpu", COMPILER_OPTIONS
    )
  except RuntimeError as e:
    if "cuDNN not found" not in str(e):
      raise
    raise ValueError(
        "attention 'cudnn' needs the cuDNN library to compile: pip install "
        "'big_vit_lite[cuda]' (docs/gpu.md), or plan with "
        "--config.model.attention=custom"
    ) from None
  hbm = gpu.device_memory_size
  return dict(
      gpu_host=host.name,
      gpu_hosts=host.hosts,
      gpu_name=gpu.description,
      **{f"gpu_{k}_bytes": b for k, b in memory.items()},
      gpu_memory_bytes=int(hbm),
      gpu_fits=bool(memory["peak"] <= hbm),
      gpu_spare=1.0 - memory["peak"] / hbm,
      gpu_attention=built.model.module.resolved_attention("gpu"),
      gpu_collectives=flops_lib.collectives(compiled.as_text()),
  )


def prepare_environment():
  """Before jax starts a backend: CPU only, and the CUDA plugin loaded without a GPU."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  jax.config.update("jax_platforms", "cpu")
