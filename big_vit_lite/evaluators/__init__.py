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
  names = []
  for info in pkgutil.iter_modules(__path__):
    if info.ispkg:
      continue
    module = importlib.import_module(f"{__name__}.{info.name}")
    if hasattr(module, "Evaluator"):
      names.append(info.name)
  return sorted(names)


def get_evaluator_cls(type_name):
  """The `Evaluator` class of module `big_vit_lite.evaluators.<type_name>`."""
  if type_name not in available():
    raise ValueError(
        f"Unknown evaluator type {type_name!r}; use one of "
        f"{', '.join(available())}."
    )
  return importlib.import_module(f"{__name__}.{type_name}").Evaluator
