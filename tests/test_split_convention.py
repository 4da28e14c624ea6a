"""One split convention for image folders: an eval's split is found (val, validation, then
test) unless the config names one (imagefolder.EVAL_SPLITS)."""

import os

import numpy as np
from PIL import Image
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.data import input_pipeline
from big_vit_lite.data import imagefolder
from big_vit_lite.evaluators import features


def _folder(root, splits):
  for split in splits:
    for c in ("a", "b"):
      os.makedirs(os.path.join(root, split, c))
      for i in range(2):
        Image.fromarray(np.full((5, 7, 3), 40 * i, np.uint8)).save(
            os.path.join(root, split, c, f"{i}.png")
        )
  return root


@pytest.mark.parametrize(
    "splits, found",
    [
        (("train", "val", "validation", "test"), "val"),
        (("train", "validation", "test"), "validation"),
        (("train", "test"), "test"),
    ],
)
def test_eval_split_is_found_in_order(tmp_path, splits, found):
  """Guards against another order than val, validation, test (or a split the folder lacks)."""
  root = _folder(str(tmp_path / "r"), splits)
  assert imagefolder.eval_split(root) == found
  it = input_pipeline.make_eval_iterator(
      dict(name="imagefolder", data_dir=root, split=None), "decode", 2
  )
  assert it.name == f"imagefolder {os.path.join(root, found)}"


def test_no_eval_split_names_the_keys_that_set_it(tmp_path):
  """Guards against a folder without val/validation/test failing with no word of the key that
  names another split (transfer said only "no folder my_folder/test")."""
  root = _folder(str(tmp_path / "r"), ("train", "holdout"))
  with pytest.raises(ValueError) as e:
    imagefolder.eval_split(root)
  msg = str(e.value)
  assert "\n" not in msg and "['holdout', 'train']" in msg
  for key in ("evals.NAME.data.split", "evals.NAME.test_split", "split="):
    assert key in msg, key
  # A split named in the config is read as named.
  it = input_pipeline.make_eval_iterator(
      dict(name="imagefolder", data_dir=root, split="holdout"), "decode", 2
  )
  assert it.name.endswith("/holdout")


@pytest.mark.parametrize(
    "config, arg",
    [
        ("transfer", "init=/nonexistent,runlocal"),
        ("vit_b16", "classes=2,runlocal,data=folder:"),
        ("classify", ""),
        ("fewshot", "runlocal"),
        ("linear_probe", "runlocal"),
    ],
)
def test_every_config_reads_the_readme_layout(tmp_path, config, arg):
  """Guards against a config or preset wanting test/ (or any fixed name) where the README's
  layout has train/ and val/: each config's eval on ROOT opens ROOT/val."""
  root = _folder(str(tmp_path / "my_images"), ("train", "val"))
  if arg.endswith("data=folder:"):
    arg += root
  else:
    arg = ",".join(filter(None, [arg, f"folder={root}"]))
  module = config_loading.config_module(f"configs/{config}.py")
  cfg = module.get_config(arg)
  names = []
  for name, ev in cfg.evals.items():
    if "datasets" in ev:
      cfgs = features.dataset_cfgs(
          ev.datasets.to_dict(),
          ev.pp,
          ev.get("train_split", "train"),
          ev.get("test_split", "test"),
      )
      data = [test for _, test, _ in cfgs.values()]
    else:
      data = [ev.data.to_dict()]
    for d in data:
      if d["name"] == "imagefolder":
        names.append(input_pipeline.make_eval_iterator(d, "decode", 2).name)
  assert names and set(names) == {f"imagefolder {root}/val"}, names
