r"""Linear probe of a checkpoint: logistic regression on frozen pre-logits.

  python -m big_vit_lite.evaluate --config=configs/linear_probe.py \
      --workdir=workdirs/linear_probe --config.model_init=workdirs/demo

Forwards the whole train and test splits once, standardises the features,
picks the l2 penalty on a held-out 10% of train (L-BFGS, optax, all values
at once), refits on all of train and reports "linear_probe/DATASET" (test
accuracy). Defaults: the offline datasets mnist10k and animal_mnist.

Expected (demo model, configs/demo.py): see README "Evaluation".
~1-2 min on 2 CPU cores for the demo model.

Args (after ':', comma separated):
  res=R        the model's input resolution (default 28, the demo's).
  channels=C   the model's input channels (default 1, the demo's grey input;
               3 decodes grey images to RGB, for RGB models).
  folder=ROOT  probe the image folder ROOT/{train,test}/CLASS/* instead;
               metric "linear_probe/basename(ROOT)".
  runlocal     slices of the splits, fewer L-BFGS iterations (seconds).
"""
import ml_collections

from big_vit_lite.evaluators import presets


def get_config(arg=None):
  args = presets.parse_arg(arg, res=28, channels=1, folder="", runlocal=False)
  config = ml_collections.ConfigDict()
  config.model_init = ml_collections.config_dict.placeholder(str)  # SRC: training workdir, checkpoint step dir or .npz.
  config.model = ml_collections.ConfigDict(dict(
      gelu=ml_collections.config_dict.placeholder(str),
      dtype_mm=ml_collections.config_dict.placeholder(str)))
  config.mesh = [("data", -1)]
  config.evals = ml_collections.ConfigDict()
  config.evals.linear_probe = presets.linear_probe(
      res=args["res"], channels=args["channels"], folder=args["folder"] or None,
      runlocal=args["runlocal"])
  return config
