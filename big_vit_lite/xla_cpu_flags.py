"""Named sets of XLA CPU flags, applied through the environment before JAX starts.

XLA reads XLA_FLAGS once, when the CPU backend is created (the first jax call
that touches a device), so `apply()` must run before that; afterwards it
raises instead of silently doing nothing. Presets are opt-in: nothing in the
library sets flags on import, and tests never do. `python -m big_vit_lite.bench
--cpu_flags=NAME` applies one for a benchmark; a training job can call
`xla_cpu_flags.apply(NAME)` before importing anything that touches jax devices,
or export the same flags in XLA_FLAGS itself.

None is a default: none has shown a reliable gain for the whole ViT training step
(what was tried and measured: benchmarks/NOTES.md, section "Plan, bench, FLOPs, metrics").
Splitting the CPU into a few devices (config.num_cpu_devices) is what helps small models.
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
