"""Named sets of XLA CPU flags, applied through the environment before JAX starts.

XLA reads XLA_FLAGS once, when the CPU backend is created (the first jax call
that touches a device), so `apply()` must run before that; afterwards it
raises instead of silently doing nothing. Presets are opt-in: nothing in the
library sets flags on import, and tests never do.

Measured on the 2-core Zen3 CPU this project is developed on (see
benchmarks/RESULTS.md for the figures and commands).
"""
import os

PRESETS = {
  "default": (),
}


def _backend_started():
  try:
    from jax._src import xla_bridge  # private, but the only way to ask
    return bool(getattr(xla_bridge, "_backends", {}))
  except Exception:
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
