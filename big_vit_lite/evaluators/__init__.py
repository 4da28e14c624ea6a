"""Evaluators, found by the `type` name of a config's `evals.NAME` entry.

Each module `big_vit_lite.evaluators.<type>` defines `Evaluator(predict_fn, *,
mesh, **cfg)` with `.run(params) -> dict[str, float]`; adding an evaluator is
adding a module, nothing else. The other modules here (features, ridge,
logistic, config_keys, presets) are shared pieces, not types.
"""
import importlib
import pkgutil

# big_vision's evaluator types -> ours (a hint, not an alias: their keys differ too).
PEER_TYPES = {"fewshot_lsr": "fewshot"}


def available():
  """Names of the modules here that define an `Evaluator` (the valid types)."""
  return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.ispkg and
                hasattr(importlib.import_module(f"{__name__}.{info.name}"), "Evaluator"))


def get_evaluator_cls(type_name):
  """The `Evaluator` class of module `big_vit_lite.evaluators.<type_name>`."""
  if not isinstance(type_name, str) or not type_name.isidentifier():
    peer = (" (big_vision's proj.* evaluators have no counterpart here)"
            if isinstance(type_name, str) and type_name.startswith("proj.") else "")
    raise ValueError(f"Evaluator type must be one of {', '.join(available())}, got "
                     f"{type_name!r}{peer}.")
  try:
    module = importlib.import_module(f"{__name__}.{type_name}")
  except ModuleNotFoundError as e:
    if e.name != f"{__name__}.{type_name}":
      raise  # A missing dependency inside an existing evaluator: show it.
    module = None
  if module is None or not hasattr(module, "Evaluator"):
    ours = PEER_TYPES.get(type_name)
    hint = f" (big_vision's {type_name!r} is {ours!r} here)" if ours else ""
    raise ValueError(f"Unknown evaluator type {type_name!r}{hint}; use one of "
                     f"{', '.join(available())}.")
  return module.Evaluator
