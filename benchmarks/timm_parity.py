r"""Checks that our timm export gives timm's logits (not part of the test suite).

  python benchmarks/timm_parity.py [--timm_python=/path/to/python] [--cases=a,b]

Runs our ViTs (random init, non-zero heads) in JAX, exports each with
`timm.write_timm`, then, in a second interpreter that has torch and timm,
builds the timm model, loads the file with `strict=True` and compares logits.
Cases: timm.create_model("vit_base_patch16_224") against our B/16, and tiny
custom configs for every pool type and posemb. Prints one JSON line per case
with the max abs logit difference; exits 1 if any exceeds --tol (1e-4).

The timm interpreter is --timm_python, else $TIMM_PYTHON, else this one when
it can import torch and timm. A separate venv keeps torch out of the
project's: `pip install torch==2.13.0` (CPU wheel), `timm --no-deps`,
safetensors, numpy. timm imports torchvision, which a ViT never uses: a
stand-in module is installed in that interpreter for the run.
"""

import argparse
import json
import os
import pkgutil
import subprocess
import sys
import tempfile

import numpy as np

CASES = {
    # name: (our Model kwargs, image size, timm model name or None for
    # VisionTransformer(**kw))
    "vit_base_patch16_224": (
        dict(variant="B/16", num_classes=1000),
        224,
        "vit_base_patch16_224",
    ),
    "tiny_tok_learn": (
        dict(
            variant=None,
            width=64,
            depth=2,
            mlp_dim=128,
            num_heads=4,
            patch_size=8,
            num_classes=7,
        ),
        32,
        None,
    ),
    "tiny_gap_sincos2d": (
        dict(
            variant=None,
            width=64,
            depth=2,
            mlp_dim=128,
            num_heads=4,
            patch_size=8,
            num_classes=7,
            pool_type="gap",
            posemb="sincos2d",
        ),
        32,
        None,
    ),
    "tiny_map_learn": (
        dict(
            variant=None,
            width=64,
            depth=2,
            mlp_dim=96,
            num_heads=2,
            patch_size=4,
            num_classes=5,
            pool_type="map",
        ),
        16,
        None,
    ),
}
# The block options, alone and together, on random params: the one definition
# of the all-options cases, which tests/test_timm_options.py and
# tests/test_oracle_timm.py import.
_TINY = dict(
    variant=None,
    width=64,
    depth=2,
    mlp_dim=96,
    num_heads=4,
    patch_size=8,
    num_classes=7,
)
OPTIONS = dict(
    reg=dict(reg_tokens=2),
    qk_norm=dict(qk_norm=True),
    layerscale=dict(layerscale_init=0.5),
    swiglu=dict(mlp="swiglu"),
    rmsnorm=dict(norm="rmsnorm"),
    parallel=dict(parallel_block=True),
    no_bias=dict(use_bias=False),
    distill_token=dict(distill_token=True),
    # (timm's DeiT has no registers)
    all_serial_distill=dict(
        qk_norm=True,
        layerscale_init=0.5,
        mlp="swiglu",
        norm="rmsnorm",
        use_bias=False,
        distill_token=True,
    ),
    all_serial=dict(
        reg_tokens=2,
        qk_norm=True,
        layerscale_init=0.5,
        mlp="swiglu",
        norm="rmsnorm",
        use_bias=False,
    ),
    all_parallel_map=dict(
        reg_tokens=1,
        qk_norm=True,
        layerscale_init=0.5,
        norm="rmsnorm",
        parallel_block=True,
        use_bias=False,
        pool_type="map",
    ),
)
CASES.update(
    {f"opt_{k}": (dict(_TINY, **v), 32, None) for k, v in OPTIONS.items()}
)
OPTION_CASES = [f"opt_{k}" for k in OPTIONS]


def _install_torchvision_standin():
  """Makes `import torchvision...` succeed with inert placeholders (timm imports it eagerly)."""
  import importlib.abc  # pylint: disable=g-import-not-at-top
  import importlib.machinery  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top

  # a class whose attributes are placeholders too (enum-like use)
  class _Placeholder(type):

    def __getattr__(cls, name):
      if name.startswith("__"):
        raise AttributeError(name)
      return f"{cls.__name__}.{name}"

  class _Module(types.ModuleType):

    def __getattr__(self, name):
      if name.startswith("__"):
        raise AttributeError(name)
      return _Placeholder(name, (), {})

  class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):

    def find_spec(self, fullname, path, target=None):
      if fullname == "torchvision" or fullname.startswith("torchvision."):
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
      return None

    def create_module(self, spec):
      m = _Module(spec.name)
      m.__path__ = []
      return m

    def exec_module(self, module):
      pass

  sys.meta_path.insert(0, _Finder())


def timm_logits(path, images, timm_name=None):
  """timm's logits (numpy) for NHWC `images` from the export at `path`, loaded with strict=True.

  The model is timm.create_model(timm_name) when given, else the class and kwargs the file's
  metadata names. Needs torch and timm importable (and torchvision or its stand-in).
  """
  import safetensors  # pylint: disable=g-import-not-at-top
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  path = os.fspath(path)
  with safetensors.safe_open(path, "np") as f:
    metadata = f.metadata()
  kwargs = json.loads(metadata["timm_kwargs"])
  if timm_name:
    model = timm.create_model(
        timm_name, pretrained=False, num_classes=kwargs["num_classes"]
    )
  else:
    # Class-valued kwargs (mlp_layer, block_fn) and the class itself (DeiT's
    # distillation token has its own) are stored as import paths.
    classes = json.loads(metadata.get("timm_classes", "{}"))
    for key, import_path in classes.items():
      kwargs[key] = pkgutil.resolve_name(import_path)
    model_class = pkgutil.resolve_name(metadata["timm_class"])
    model = model_class(**kwargs)
  model.load_state_dict(safetensors.torch.load_file(path), strict=True)
  model.eval()
  with torch.no_grad():
    return model(
        torch.from_numpy(np.array(images)).permute(0, 3, 1, 2).contiguous()
    ).numpy()


def timm_side(workdir, cases):
  """Runs in the torch interpreter: loads each export into timm and writes its logits."""
  _install_torchvision_standin()
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(2)
  results = {}
  for name in cases:
    path = os.path.join(workdir, f"{name}.safetensors")
    images = np.load(os.path.join(workdir, f"{name}_images.npy"))
    logits = timm_logits(path, images, CASES[name][2])
    np.save(os.path.join(workdir, f"{name}_timm.npy"), logits)
    results[name] = list(logits.shape)
  print(
      json.dumps(
          {
              "timm": timm.__version__,
              "torch": torch.__version__,
              "shapes": results,
          }
      )
  )


def _keys(tree, seed):
  """One PRNG key per leaf of `tree`, in a tree of its structure."""
  import jax  # pylint: disable=g-import-not-at-top

  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(
      treedef, list(jax.random.split(jax.random.key(seed), len(leaves)))
  )


def our_case(name, index):
  """(model, params, images) of case `name`, the `index`-th of a run: our ViT, its random init
  (initialised op by op: no compile per case) and two random images."""
  import jax  # pylint: disable=g-import-not-at-top
  from big_vit_lite.models import vit  # pylint: disable=g-import-not-at-top

  kw, res, _ = CASES[name]
  model = vit.Model(**kw, head_zeroinit=False, gelu="exact")
  images = np.asarray(
      jax.random.uniform(
          jax.random.key(index), (2, res, res, 3), minval=-1, maxval=1
      )
  )
  params = model.init(jax.random.key(100 + index), images)["params"]
  # ones, zeros and LayerScale inits would hide swapped params
  if name in OPTION_CASES:
    params = jax.tree.map(
        lambda a, k: a + 0.1 * jax.random.normal(k, a.shape),
        params,
        _keys(params, 300 + index),
    )
  return model, params, images


def timm_python(flag=None):
  """The interpreter to run timm in: --timm_python, $TIMM_PYTHON, or this one; None if none."""
  if flag or os.environ.get("TIMM_PYTHON"):
    return flag or os.environ["TIMM_PYTHON"]
  try:
    import timm  # pylint: disable=g-import-not-at-top,unused-import
    import torch  # pylint: disable=g-import-not-at-top,unused-import

    return sys.executable
  except ImportError:
    return None


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--timm_python", default=None)
  parser.add_argument("--tol", type=float, default=1e-4)
  parser.add_argument(
      "--cases",
      default=",".join(CASES),
      help=f"comma-separated subset of {', '.join(CASES)}",
  )
  parser.add_argument("--timm_side", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  cases = args.cases.split(",")
  unknown = sorted(set(cases) - set(CASES))
  if unknown:
    parser.error(f"unknown case {unknown[0]!r}; choose from {', '.join(CASES)}")
  if args.timm_side:
    return timm_side(args.timm_side, cases)

  python = timm_python(args.timm_python)
  if python is None:
    sys.exit(
        "timm_parity: torch/timm are not importable here; pass --timm_python=PY or set "
        "TIMM_PYTHON to an interpreter that has them (see shared/PERF.md)."
    )
  import jax  # pylint: disable=g-import-not-at-top
  from big_vit_lite.models import timm  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as workdir:
    ours = {}
    for i, name in enumerate(cases):
      model, params, images = our_case(name, i)
      ours[name] = np.asarray(
          jax.jit(lambda p, x: model.apply({"params": p}, x)[0])(params, images)
      )
      timm.write_timm(
          params,
          os.path.join(workdir, f"{name}.safetensors"),
          image_size=images.shape[1],
      )
      np.save(os.path.join(workdir, f"{name}_images.npy"), images)
    run = subprocess.run(
        [
            python,
            os.path.abspath(__file__),
            f"--timm_side={workdir}",
            f"--cases={','.join(cases)}",
        ],
        capture_output=True,
        text=True,
    )
    if run.returncode:
      sys.exit(
          f"timm side failed: {run.stderr.strip().splitlines()[-1] if run.stderr else run.returncode}"
      )
    print(run.stdout.strip())
    worst = 0.0
    for name in cases:
      theirs = np.load(os.path.join(workdir, f"{name}_timm.npy"))
      diff = float(np.abs(theirs - ours[name]).max())
      worst = max(worst, diff)
      print(
          json.dumps(
              {
                  "case": name,
                  "max_abs_diff": diff,
                  "max_abs_logit": float(np.abs(ours[name]).max()),
                  "tol": args.tol,
              }
          )
      )
  sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
  main()
