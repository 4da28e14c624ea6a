r"""Multi-label pretraining as on JFT, offline: a small ViT on mnist_multilabel.

  python -m big_vit_lite.data.prepare mnist_multilabel   # once (~1 minute)
  python -m big_vit_lite.train --config=configs/multilabel.py --workdir=workdirs/multilabel

mnist_multilabel (data/builders/mnist_multilabel.py): 2-3 real MNIST digits on a 56x56 image,
the labels are the set of digits. The JFT-style settings of configs/vit_l16.py: the example's
label list becomes k-hot targets in the pp (`onehot(10, key='labels')`), sigmoid
cross-entropy, a zero-initialised head whose bias starts at init_head_bias = -10 (p ~ 5e-5
per class at the start, the vit_l16 value), and the `multilabel` evaluator (mAP, ReaL-style
prec@1, per-class precision/recall) on the test split.

Expected result (measured once, seed 0, on the shared 2-core VM, where it took 28 minutes):
on the 4,000 test images, "multilabel/mAP" is 0.9764 and ReaL-style prec@1 is 0.9898 after
6,000 steps (16 epochs at batch 64). Macro precision/recall at p > 0.5 is 0.940 / 0.926.
At step 2,000 mAP was 0.934, at 4,000 it was 0.973. The bag-of-pixels baseline,
`python benchmarks/multilabel_baseline.py` (one logistic regression per class on the raw
pixels), reaches mAP 0.8397 and prec@1 0.9263. Details: benchmarks/NOTES.md, section
"JFT-scale data (issue 33)".

Args (comma-separated after the file name, e.g. `configs/multilabel.py:runlocal`):
  runlocal   a few steps of a tinier model, for tests and smoke runs.
"""

import ml_collections
from ml_collections import config_dict

PP = (
    "decode(channels=1)|value_range(-1, 1)"
    "|onehot(10, key='labels', key_result='labels')|keep('image', 'labels')"
)


def get_config(arg=None):
  args = [a for a in (arg or "").split(",") if a]
  for a in args:
    if a != "runlocal":
      raise ValueError(f"Unknown config arg '{a}': use runlocal or nothing.")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.input = dict(
      data=dict(
          name="mnist_multilabel",
          split="train",
          data_dir=config_dict.placeholder(str),
      ),
      batch_size=64,
      pp=PP,
      shuffle_buffer_size=10_000,
  )
  config.model_name = "vit"
  # 56x56 images, 14x14 patches: 16 tokens, one digit cell = 2x2 patches.
  config.model = dict(
      variant=config_dict.placeholder(str),
      width=128,
      depth=4,
      mlp_dim=512,
      num_heads=2,
      patch_size=14,
      posemb="learn",
      pool_type="gap",
      num_classes=10,
      head_zeroinit=True,
      remat_policy=config_dict.placeholder(str),
  )
  config.loss = "sigmoid_xent"
  config.init_head_bias = -10.0
  config.grad_accum_steps = 1
  config.total_steps = 6000
  config.optax_name = "scale_by_adam"
  config.optax = dict(b1=0.9, b2=0.999)
  config.lr = 1e-3
  config.wd = 1e-4  # Decoupled (not multiplied by lr), see optim.py.
  config.schedule = dict(warmup_steps=500, decay_type="cosine")
  config.grad_clip_norm = 1.0
  config.num_cpu_devices = 2
  config.mesh = (("data", -1),)
  config.log_training_steps = 200
  config.ckpt_steps = 2000
  config.evals = ml_collections.ConfigDict()
  config.evals.multilabel = dict(
      type="multilabel",
      data=dict(
          name="mnist_multilabel",
          split="test",
          data_dir=config_dict.placeholder(str),
      ),
      pp=PP,
      batch_size=500,
      log_steps=2000,
  )
  if "runlocal" in args:
    config.input.batch_size = 32
    config.input.shuffle_buffer_size = 100
    config.num_cpu_devices = config_dict.placeholder(int)
    config.model.update(width=32, depth=2, mlp_dim=64)
    config.total_steps = 6
    config.schedule.warmup_steps = 2
    config.log_training_steps = 2
    config.ckpt_steps = 3
    config.evals.multilabel.data.split = "test[:500]"
    config.evals.multilabel.log_steps = 6
  return config
