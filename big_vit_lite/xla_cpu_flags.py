"""Named sets of XLA CPU flags, applied through the environment before JAX starts.

XLA reads XLA_FLAGS once, when the CPU backend is created (the first jax call
that touches a device), so `apply()` must run before that; afterwards it
raises instead of silently doing nothing. Presets are opt-in: nothing in the
library sets flags on import, and tests never do. `python -m big_vit_lite.bench
--cpu_flags=NAME` applies one for a benchmark; a training job can call
`xla_cpu_flags.apply(NAME)` before importing anything that touches jax devices,
or export the same flags in XLA_FLAGS itself.

None of them is a default: none has shown a reliable gain for the whole ViT
training step (jax 0.10.2 already sends dots to its multi-threaded YNNPACK
kernels). What was measured (2-core AVX-512 EPYC, heavily shared, so only
CPU-seconds were trustworthy):
  no_xnnpack  dots on XLA's own kernels: the 6304x192x{192,768} projections of
              ViT-Ti/16 took ~1.4x fewer CPU-seconds in a micro-benchmark, the
              (seq x head_dim) attention dots ~0.8x; whole step not measured.
  onednn      oneDNN matmuls: +2% (noise) on a 2-core AVX2 Zen3 (shared/PERF.md).
Also tried on the demo ViT's training step (28x28, batch 128, width 128;
CPU-seconds per step, idle machine, jax 0.10.2), none kept:
  --xla_cpu_experimental_ynn_fusion_type=dot                 6% slower
  --xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce  12% slower
  --xla_cpu_prefer_vector_width=512                          same
  --xla_cpu_use_xnnpack=false                                2% slower
On the ViT-Ti/16 training step (batch 32, 224 px; jax 0.10.2; separate
processes, one round each unless noted; the VM's noise is ~5-10%), none kept:
  --xla_cpu_use_xnnpack=false                                 16% slower
  --xla_cpu_experimental_xnn_graph_fusion_mode=..._GREEDY     12% slower
  ... =XNN_GRAPH_FUSION_MODE_GREEDY_SLINKY                    same (noise)
  --xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_RUNTIME            same (noise)
  --xla_cpu_enable_fast_math=true                             2% slower
  --xla_cpu_experimental_enable_tiling_propagation=true       30% slower
  --xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce   same (noise)
  --xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED  +4% in 4 pairs of
      processes, but 0.97x and 0.95x in two in-process A/Bs (as a compile option)
  compile option xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT
      (no YNN reductions)                                     3% slower
  (benchmarks/ab_vit.py --compiler_options='{...}' A/Bs a compile option in
  one process; compile options take enum names, XLA_FLAGS the short ones.)
What did help small models is not a flag but splitting the CPU into a few
devices (config.num_cpu_devices; see distributed.set_cpu_devices).
"""
import os

PRESETS = {
    "default": (),
    "no_xnnpack": ("--xla_cpu_use_xnnpack=false",),
    "onednn": ("--xla_cpu_use_onednn=true",),
}


def _backend_started():
  try:
    from jax._src import xla_bridge  # private, but the only way to ask
    return bool(getattr(xla_bridge, "_backends", {}))
  except Exception:  # pylint: disable=broad-except
    return False


def apply(preset):
  """Appends the preset's flags to XLA_FLAGS; call before the first jax computation."""
  if preset not in PRESETS:
    raise ValueError(f"unknown XLA CPU flag preset {preset!r}; choose one of {sorted(PRESETS)}")
  flags = PRESETS[preset]
  if not flags:
    return
  if _backend_started():
    raise RuntimeError(f"XLA CPU flag preset {preset!r} must be applied before JAX's backend "
                       "starts (before the first jax computation)")
  current = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join([current, *flags]).strip()
