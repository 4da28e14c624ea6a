r"""Top-1 / top-5 accuracy of a checkpoint's own head on a split (timm's validate.py).

  python -m big_vit_lite.evaluate --config=configs/classify.py:data=mnist10k \
      --workdir=workdirs/classify --config.model_init=workdirs/ft_mnist10k

Runs the classification evaluator over the whole split (every example once)
and reports "classify/prec@1", "classify/prec@5" (more than 5 classes) and
"classify/loss". The model's head must have the dataset's classes (a run
fine-tuned on it, e.g. with configs/transfer.py).

Expected: the configs/transfer.py run on mnist10k (its README table) gives
here exactly its own final "val/prec@1" (the same split and pp).

Args (after ':', comma separated):
  data=NAME    tfds dataset (default mnist10k), split=SPLIT (default test).
  folder=ROOT  an image folder instead: ROOT/SPLIT/CLASS/* (labels: sorted class folders);
               SPLIT by default the first of val, validation and test it holds.
  res=R        the model's input resolution (default 28, the demo's).
  channels=C   the model's input channels (default 1; 3 decodes grey images to RGB).
  runlocal     the first 200 examples of the split.
--config.use_ema=True scores the EMA of the weights of a run with config.ema_decay.
"""

import ml_collections
from ml_collections import config_dict

from big_vit_lite.config import config_loading
from big_vit_lite.evaluators import presets


def get_config(arg=None):
  args = config_loading.parse_arg(
      arg,
      data="mnist10k",
      split="",
      folder="",
      res=28,
      channels=1,
      runlocal=False,
  )
  config = ml_collections.ConfigDict()
  # A workdir, step dir, .npz or .safetensors.
  config.model_init = config_dict.placeholder(str)
  config.use_ema = False
  config.model = ml_collections.ConfigDict(
      dict(
          gelu=config_dict.placeholder(str),
          dtype_mm=config_dict.placeholder(str),
      )
  )
  config.mesh = (("data", -1),)
  if args.folder:
    data = dict(presets.folder_datasets(args.folder).popitem()[1])
    # Unset: found (val, validation or test: imagefolder.EVAL_SPLITS).
    data["split"] = args.split or config_dict.placeholder(str)
  else:
    data = dict(name=args.data, data_dir=config_dict.placeholder(str))
    data["split"] = (args.split or "test") + ("[:200]" if args.runlocal else "")
  config.evals = ml_collections.ConfigDict()
  config.evals.classify = dict(
      type="classification",
      data=data,
      batch_size=500,
      pp=presets.eval_pp(args.res, args.channels),
  )
  return config
