"""Stand-in `torchvision` so that `import timm` works beside torch 2.13 CPU.

timm imports torchvision at import time (transforms, datasets, ops), but a
VisionTransformer never calls into it, and PyPI's torchvision wheels do not
load beside torch 2.13.0 on this machine. bench_vs_timm.py puts this folder
on PYTHONPATH for the timm measurement only. Any `torchvision.X.Y` import
succeeds and yields placeholders; *using* one raises, so a timm code path that
really needs torchvision fails loudly instead of measuring something else.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+standin"


class _PlaceholderMeta(type):
  # Class-level attribute access (e.g. InterpolationMode.BILINEAR, used to
  # build lookup tables at timm import time) yields distinct sentinels.
  def __getattr__(cls, name):
    if name.startswith("__"):
      raise AttributeError(name)
    sentinel = _PlaceholderMeta(f"{cls.__name__}.{name}", (_Placeholder,), {})
    setattr(cls, name, sentinel)
    return sentinel


class _Placeholder(metaclass=_PlaceholderMeta):

  def __init__(self, *args, **kwargs):
    raise RuntimeError(
        f"{type(self).__name__} comes from the torchvision stand-in used for "
        "benchmarking timm's ViT; install a real torchvision to use it."
    )


class _StubModule(types.ModuleType):

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    value = _PlaceholderMeta(name, (_Placeholder,), {})
    setattr(self, name, value)
    return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):

  def find_spec(self, fullname, path=None, target=None):
    if fullname.startswith(__name__ + "."):
      return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    return None

  def create_module(self, spec):
    module = _StubModule(spec.name)
    module.__path__ = []
    return module

  def exec_module(self, module):
    pass


sys.meta_path.insert(0, _Finder())
