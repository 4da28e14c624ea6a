r"""The offline demo: a small ViT pretrained on Fashion-MNIST, few-shot evals on MNIST / Animal-MNIST.

Runs anywhere, no internet needed once the datasets are prepared:

  for ds in fashion_mnist mnist10k animal_mnist; do python -m big_vit_lite.data.prepare $ds; done
  python -m big_vit_lite.train --config=configs/demo.py --workdir=workdirs/demo

Expected result: Fashion-MNIST test prec@1 ("val/prec@1" in
workdirs/demo/metrics.jsonl) 0.9144 after 30,000 steps (32 epochs at batch 64),
few-shot 10-shot 0.7957 (MNIST-10k) / 0.6495 (Animal-MNIST) on the second block's
tokens, against 0.6978 / 0.5012 for the same ridge on the raw pixels
("fewshot/mnist10k_10shot_pixels"), in about 15 minutes on 2 quiet CPU cores.
Deterministic on a given machine; the measured runs and the variants tried:
benchmarks/NOTES.md, section "Config, optimizer, sharding, distributed".

Args (comma-separated after the file name, e.g. `configs/demo.py:runlocal`):
  runlocal   a few steps on a small batch, evals on slices of the test sets, for tests and
             smoke runs.
"""

import ml_collections
from ml_collections import config_dict

from big_vit_lite.config import config_knobs
from big_vit_lite.config import config_loading  # No random ops here: the shifts and flips run on device (config.device_aug).

TRAIN_PP = (
    "decode(channels=1)|value_range(-1, 1)"
    "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')"
)
EVAL_PP = (
    "decode(channels=1)|value_range(-1, 1)"
    "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')"
)


def get_config(arg=None):
  args = config_loading.parse_arg(arg, runlocal=False)
  return make_config(runlocal=args.runlocal)


def make_config(*, runlocal):
  """The demo's config; configs/distill.py and configs/multilabel.py build on it."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.input = dict(
      data=dict(
          name="fashion_mnist",
          split="train",
          data_dir=config_dict.placeholder(str),
      ),
      batch_size=64,  # 32 per CPU device: small enough to stay in cache.
      pp=TRAIN_PP,
      shuffle_buffer_size=20_000,
      # 60k tiny PNGs: keep the raw records in memory after epoch 1.
      cache="raw",
      # Default: one per process (data order: README).
      num_shards=config_dict.placeholder(int),
  )
  # 28x28 images, 7x7 patches -> 16 tokens: on CPU attention over many short
  # heads is slow, so few tokens and a moderately wide model train fastest.
  # Shifts of up to 2 px and left-right flips (with 32 epochs the model overfits
  # without them): the pp ops "pad(2)|random_crop(28)|flip_lr" (-1.0 is black
  # after value_range(-1, 1)), inside the jitted step, cheaper than per example
  # in tf.data.
  config.device_aug = dict(translate=2, fill=-1.0, flip_lr=True)
  config.model_name = "vit"
  # Data parallel over 2 CPU devices (each runs its half of the batch on its own
  # thread): faster than one device for a model this small
  # (distributed.set_cpu_devices). On a GPU/TPU machine this changes nothing.
  config.num_cpu_devices = 2
  config.mesh = (("data", -1),)
  # Every vit.Model knob at its default, settable from the command line
  # (--config.model.drop_path=0.1).
  config.model = config_knobs.vit_model(
      variant=config_dict.placeholder(str),
      width=128,
      depth=4,
      mlp_dim=512,
      num_heads=2,
      patch_size=7,
      posemb="learn",
      pool_type="gap",
      num_classes=10,
      # No remat (vit_model's None): a model this small fits anywhere;
      # remat would only recompute each block's forward (~1/3 more block
      # FLOPs).
      stem_channels=(),
  )
  config.loss = "softmax_xent"
  # Start from another run / an .npz instead of random init:
  # --config.model_init=SRC (a training workdir, a checkpoint step dir or a
  # vision_transformer .npz); dont_load: regexes of params to keep from init,
  # e.g. "('head/.*',)".
  config.model_init = config_dict.placeholder(str)
  config.model_load = dict(dont_load=())

  # grad_accum_steps, ema_decay, profile_steps, wandb: unset or off, settable
  # from the command line (--config.wandb.project=NAME).
  config.update(config_knobs.trainer_knobs())
  # 32 epochs = 30,000 steps at batch 64. In epochs, so that
  # --config.total_epochs=E works too (a total_steps set here would win over
  # it); --config.total_steps=N wins over both.
  config.total_steps = config_dict.placeholder(int)
  config.total_epochs = 32.0
  config.optax_name = "scale_by_adam"
  config.optax = dict(b1=0.9, b2=0.999)
  config.lr = 7e-4
  config.wd = 1e-4  # Decoupled (not multiplied by lr), see optim.py.
  config.schedule = dict(warmup_steps=1000, decay_type="cosine")
  config.grad_clip_norm = 1.0

  config.log_training_steps = 500
  config.ckpt_steps = 4000
  config.keep_ckpt_steps = config_dict.placeholder(int)
  # Trainer knobs, spelled out so the command line can set them
  # (--config.keep_ckpts=5). The last N checkpoints, plus every
  # keep_ckpt_steps-th.
  config.keep_ckpts = 3
  config.ckpt_async = True  # Save in the background while training goes on.
  config.eval_at_start = False  # Also run the evals at step 0.
  # True: plots in WORKDIR/report/report.html at each eval.
  config.report = False
  # Stop a process stuck this long.
  config.hang_timeout_s = config_dict.placeholder(float)

  config.evals = ml_collections.ConfigDict()
  config.evals.val = dict(
      type="classification",
      data=dict(
          name="fashion_mnist",
          split="test",
          data_dir=config_dict.placeholder(str),
      ),
      pp=EVAL_PP,
      batch_size=500,
      log_steps=4000,
  )
  # The ViT paper's few-shot linear probe on the other offline datasets, each
  # beside the same probe on the raw pixels ("fewshot/mnist10k_10shot_pixels";
  # computed once per run): what the pretrained features must beat.
  # The features: the second block's 16 tokens, flattened (16 x width). Digits
  # and animal silhouettes share strokes and edges with clothes, not classes:
  # an early layer's tokens transfer, the pooled last block (pre-logits) is
  # specialised to Fashion-MNIST's classes and falls below the pixels on
  # mnist10k (benchmarks/NOTES.md, issue 42).
  config.evals.fewshot = dict(
      type="fewshot",
      datasets=dict(
          mnist10k=dict(name="mnist10k"), animal_mnist=dict(name="animal_mnist")
      ),
      representation_layer="block01",
      token_pool="flatten",
      pp="decode(channels=1)|value_range(-1, 1)|keep('image', 'label')",
      shots=(10,),
      num_seeds=3,
      batch_size=500,
      pixel_baseline=True,
      log_steps=30_000,
  )

  if runlocal:
    config.input.batch_size = 32
    # Tests choose their device count.
    config.num_cpu_devices = config_dict.placeholder(int)
    config.input.shuffle_buffer_size = 100
    config.input.cache = config_dict.placeholder(str)
    config.model.depth = 2
    config.model.width = 32
    config.model.mlp_dim = 64
    config.model.num_heads = 2
    config.total_steps = 6
    config.schedule.warmup_steps = 2
    config.log_training_steps = 2
    config.ckpt_steps = 3
    config.evals.val.log_steps = 6
    config.evals.val.batch_size = 100
    # Slices of the test sets: a smoke run's evals check the path, not the
    # number (the full sets cost a tiny run more than its training).
    config.evals.val.data.split = "test[:1000]"
    config.evals.fewshot.log_steps = 6
    config.evals.fewshot.num_seeds = 1
    config.evals.fewshot.shots = (1,)
    for name in config.evals.fewshot.datasets:
      config.evals.fewshot.datasets[name].train_split = "train[:1000]"
      config.evals.fewshot.datasets[name].test_split = "test[:500]"
  return config
