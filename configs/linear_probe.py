r"""Linear probe of a checkpoint: logistic regression on frozen pre-logits.

  python -m big_vit_lite.evaluate --config=configs/linear_probe.py \
      --workdir=workdirs/linear_probe --config.model_init=workdirs/demo

Forwards the whole train and test splits once, standardises the features,
picks the l2 penalty on a held-out 10% of train (L-BFGS, optax, along the
l2 path with warm starts), refits on all of train and reports "linear_probe/DATASET" (test
accuracy). Defaults: the offline datasets mnist10k and animal_mnist.

Expected, demo model (configs/demo.py checkpoint at step 1000): mnist10k
77.8%, animal_mnist 72.9% (pre_logits); logistic regression on raw pixels
gives 91.5% and 77.6%. About a minute on 2 CPU cores.

Args (after ':', comma separated):
  res=R        the model's input resolution (default 28, the demo's).
  channels=C   the model's input channels (default 1, the demo's grey input;
               3 decodes grey images to RGB, for RGB models).
  folder=ROOT  probe the image folder ROOT/{train,val}/CLASS/* instead (the test
               split: val/, validation/ or test/, the first found);
               metric "linear_probe/basename(ROOT)".
  layer=NAME   the representation: pre_logits (default), encoded, block00..,
               logits.
  pool=P       for token-shaped layers: mean (default) or flatten (keeps the
               tokens' positions; see README "Evaluation" for why it matters).
  runlocal     slices of the splits, fewer L-BFGS iterations (seconds).
Every setting of the probe can be set on the command line, e.g.
  --config.evals.linear_probe.l2_regs='(1e-4, 1e-3)' --config.evals.linear_probe.max_iter=500
"""

import ml_collections

from big_vit_lite.config import config_loading
from big_vit_lite.evaluators import presets


def get_config(arg=None):
  args = config_loading.parse_arg(
      arg,
      res=28,
      channels=1,
      folder="",
      layer="pre_logits",
      pool="mean",
      runlocal=False,
  )
  config = ml_collections.ConfigDict()
  # SRC: a training workdir, a checkpoint step dir or an .npz.
  config.model_init = ml_collections.config_dict.placeholder(str)
  config.use_ema = False  # True: a run's EMA of the weights (config.ema_decay).
  config.model = ml_collections.ConfigDict(
      dict(
          gelu=ml_collections.config_dict.placeholder(str),
          dtype_mm=ml_collections.config_dict.placeholder(str),
      )
  )
  # A tuple, not a list: only tuples take --config.mesh="[...]".
  config.mesh = (("data", -1),)
  config.evals = ml_collections.ConfigDict()
  config.evals.linear_probe = presets.linear_probe(
      res=args.res,
      channels=args.channels,
      folder=args.folder or None,
      representation_layer=args.layer,
      token_pool=args.pool,
      runlocal=args.runlocal,
  )
  return config
