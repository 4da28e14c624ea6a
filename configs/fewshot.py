r"""Few-shot linear evaluation of a checkpoint (ridge on frozen pre-logits).

  python -m big_vit_lite.evaluate --config=configs/fewshot.py \
      --workdir=workdirs/fewshot --config.model_init=workdirs/demo

For each of 1/5/10/25 shots x 5 seeds (the counts a dataset has too few
images per class for are skipped, with a warning; an explicit
--config.evals.fewshot.shots that cannot be met is an error): sample that many training images per
class, fit closed-form ridge regression on standardised features (l2 chosen
by leave-one-out on those images), report the mean test accuracy as
"fewshot/DATASET_Kshot". Defaults: the offline datasets mnist10k and
animal_mnist (`python -m big_vit_lite.data.prepare mnist10k`, `... animal_mnist`).

Expected, demo model (configs/demo.py checkpoint at step 3000), 10-shot:
mnist10k 50.9%, animal_mnist 44.8% (pre_logits); with
`:layer=block01,pool=flatten` 72.9% and 54.3%, above ridge on raw pixels
(71.4%, 48.2%). About a minute of CPU time (2 cores) for the demo model.

Args (after ':', comma separated):
  res=R        the model's input resolution (default 28, the demo's); the
               evaluator refuses images of another size and says which.
  channels=C   the model's input channels (default 1, the demo's grey input;
               3 decodes grey images to RGB, for RGB models).
  folder=ROOT  evaluate on the image folder ROOT/{train,val}/CLASS/* instead (the
               test split: val/, validation/ or test/, the first found);
               metrics "fewshot/basename(ROOT)_10shot".
  layer=NAME   the representation: pre_logits (default), encoded, block00..,
               logits.
  pool=P       for token-shaped layers: mean (default) or flatten (keeps the
               tokens' positions; see README "Evaluation" for why it matters).
  runlocal     1 and 5 shots, 2 seeds, slices of the splits (seconds).
Every setting can be set on the command line, e.g.
  --config.evals.fewshot.shots='(1, 5)' --config.evals.fewshot.l2_regs='(1.0, 16.0)'
For an .npz of another model, e.g. ViT-B/16 at 224:
  --config=configs/fewshot.py:res=224,channels=3 --config.model_init=ViT-B_16.npz
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
  # Overrides of the checkpoint's model config (None: keep it), e.g. gelu="tanh"
  # for the original paper's .npz files.
  config.model = ml_collections.ConfigDict(
      dict(
          gelu=ml_collections.config_dict.placeholder(str),
          dtype_mm=ml_collections.config_dict.placeholder(str),
      )
  )
  # A tuple, not a list: only tuples take --config.mesh="[...]".
  config.mesh = (("data", -1),)
  config.evals = ml_collections.ConfigDict()
  config.evals.fewshot = presets.fewshot(
      res=args.res,
      channels=args.channels,
      folder=args.folder or None,
      representation_layer=args.layer,
      token_pool=args.pool,
      runlocal=args.runlocal,
  )
  return config
