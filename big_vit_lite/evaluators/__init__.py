"""Evaluators, found by the `type` name of a config's `evals.NAME` entry.

Each module `big_vit_lite.evaluators.<type>` defines `Evaluator(predict_fn, *,
mesh, **cfg)` with `.run(params) -> dict[str, float]`; adding an evaluator is
adding a module, nothing else. The other modules here (features, ridge,
logistic, presets) are shared pieces, not types.
"""

import importlib
import pkgutil


def available():
  """Names of the modules here that define an `Evaluator` (the valid types)."""
  modules = [m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg]
  return sorted(
      name
      for name in modules
      if hasattr(importlib.import_module(f"{__name__}.{name}"), "Evaluator")
  )


def get_evaluator_cls(type_name):
  """The `Evaluator` class of module `big_vit_lite.evaluators.<type_name>`."""
  if type_name not in available():
    raise ValueError(
        f"Unknown evaluator type {type_name!r}; use one of "
        f"{', '.join(available())}."
    )
  return importlib.import_module(f"{__name__}.{type_name}").Evaluator
