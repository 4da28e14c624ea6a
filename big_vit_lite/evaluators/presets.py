"""Ready-made `evals` entries for config files (like big_vision's common_fewshot).

Light on purpose (no jax / tf imports): config files import it.

    from big_vit_lite.evaluators import presets
    config.evals.fewshot = presets.fewshot(res=28, log_steps=500)

gives few-shot ridge evals on the offline datasets (mnist10k, animal_mnist)
whose metrics appear as "fewshot/mnist10k_10shot" etc.; `folder=ROOT`
evaluates an image folder ROOT/{train,val}/CLASS/* instead, named after
basename(ROOT); its test split is found (val, validation, then test:
imagefolder.EVAL_SPLITS) unless `test_split` names one.
"""

import os

from ml_collections import config_dict

from big_vit_lite.evaluators import ridge  # numpy only

OFFLINE_DATASETS = ("mnist10k", "animal_mnist")
# A metric's raw-pixel baseline (pixel_baseline=True) is logged under its key
# plus this (summary, report and evaluate's table show the two side by side).
PIXELS_SUFFIX = "_pixels"
# The linear probe's l2 candidates (picked on a held-out part of train).
LINEAR_PROBE_L2_REGS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


def eval_pp(res, channels=3, label_key="label"):
  """Decode, resize to the model's resolution, grey->RGB (channels=3), [-1, 1]."""
  return (
      f"decode(channels={int(channels)})|resize({int(res)})|value_range(-1, 1)|"
      f"keep('image', '{label_key}')"
  )


def folder_datasets(root):
  """{basename(ROOT): imagefolder data cfg} for ROOT/{train,val}/CLASS/*."""
  root = os.path.abspath(os.path.expanduser(str(root)))
  if not os.path.isdir(root):
    raise ValueError(
        f"folder={root}: no such folder; give the image folder that holds "
        "train/CLASS/* and val/CLASS/* (the README's layout)."
    )
  name = os.path.basename(root.rstrip(os.sep))
  if not name:
    raise ValueError(
        f"folder={root!r}: use a named folder holding train/ and val/."
    )
  return {name: dict(name="imagefolder", data_dir=root)}


def _datasets(datasets, folder, data_dir):
  if folder:
    return folder_datasets(folder)
  names = datasets or OFFLINE_DATASETS
  # An unset data_dir is a typed placeholder (reads as None), one per dataset:
  # `--config.evals.fewshot.datasets.mnist10k.data_dir=DIR` must work, and
  # ml_collections cannot override a plain None from the command line. (These
  # dicts are meant for ConfigDicts, which resolve placeholders on access.)
  out = {}
  for name in names:
    if data_dir is None:
      out[name] = dict(name=name, data_dir=config_dict.placeholder(str))
    else:
      out[name] = dict(name=name, data_dir=data_dir)
  return out


def folder_test_split(folder):
  """An image folder's: unset, so found (imagefolder.EVAL_SPLITS); a tfds dataset's: "test"."""
  if folder:
    return config_dict.placeholder(str)
  return "test"


def _entry(cfg, runlocal, folder, log_steps, **local):
  """cfg with the runlocal settings (`local`, and small tfds splits) and log_steps, if set."""
  if runlocal:
    cfg.update(local)
    if not folder:  # tfds split slicing; image folders are small anyway.
      cfg.update(train_split="train[:1000]", test_split="test[:500]")
  if log_steps is not None:
    cfg["log_steps"] = log_steps
  return cfg


def fewshot(
    res,
    *,
    channels=3,
    datasets=None,
    folder=None,
    data_dir=None,
    shots=None,
    num_seeds=5,
    representation_layer="pre_logits",
    token_pool="mean",
    batch_size=256,
    pixel_baseline=False,
    log_steps=None,
    runlocal=False,
):
  """A `type="fewshot"` evals entry (dict); `log_steps=None` for eval-only configs.

  shots=None: 1, 5, 10, 25 less those a dataset has too few images per class for.
  pixel_baseline=True: each metric also on the raw pixels, KEY_pixels.
  """
  # Every setting spelled out, so that each can be set from the command line
  # (e.g. --config.evals.fewshot.l2_regs='(1.0,)'); shots unset until a
  # caller names them.
  shots_setting = config_dict.placeholder(tuple)
  if shots is not None:
    shots_setting = tuple(shots)
  cfg = dict(
      type="fewshot",
      datasets=_datasets(datasets, folder, data_dir),
      pp=eval_pp(res, channels),
      num_seeds=num_seeds,
      shots=shots_setting,
      representation_layer=representation_layer,
      token_pool=token_pool,
      batch_size=batch_size,
      train_split="train",
      test_split=folder_test_split(folder),
      l2_regs=tuple(ridge.DEFAULT_L2_REGS),
      pixel_baseline=pixel_baseline,
  )
  return _entry(
      cfg, runlocal, folder, log_steps, shots=(1, 5), num_seeds=2, batch_size=64
  )


def linear_probe(
    res,
    *,
    channels=3,
    datasets=None,
    folder=None,
    data_dir=None,
    representation_layer="pre_logits",
    token_pool="mean",
    batch_size=256,
    pixel_baseline=False,
    log_steps=None,
    runlocal=False,
):
  """A `type="linear_probe"` evals entry (dict); pixel_baseline as in `fewshot`."""
  cfg = dict(
      type="linear_probe",
      datasets=_datasets(datasets, folder, data_dir),
      pp=eval_pp(res, channels),
      representation_layer=representation_layer,
      token_pool=token_pool,
      batch_size=batch_size,
      train_split="train",
      test_split=folder_test_split(folder),
      l2_regs=LINEAR_PROBE_L2_REGS,
      holdout_fraction=0.1,
      max_iter=1000,
      pixel_baseline=pixel_baseline,
  )
  return _entry(cfg, runlocal, folder, log_steps, batch_size=64, max_iter=200)
