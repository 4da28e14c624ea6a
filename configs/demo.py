r"""The offline demo: a small ViT pretrained on Fashion-MNIST, few-shot evals on MNIST / Animal-MNIST.

Runs anywhere, no internet needed once the datasets are prepared:

  for ds in fashion_mnist mnist10k animal_mnist; do python -m big_vit_lite.data.prepare $ds; done
  python -m big_vit_lite.train --config=configs/demo.py --workdir=workdirs/demo

Expected result: Fashion-MNIST test prec@1 ("val/prec@1" in
workdirs/demo/metrics.jsonl) ~0.89-0.90 after 5,600 steps (12 epochs), few-shot
10-shot ~0.54 (MNIST) / ~0.42 (Animal-MNIST). Measured 2026-12-02 on 2 idle
CPU cores (AMD EPYC, jax 0.10.2): val/prec@1 0.8683 / 0.8912 / 0.8944 at steps
2800 / 4200 / 5600, 515 s wall in all (0.085 s/step, evals included).
The target of >= 0.91 in <= 15 min is not reached yet. Tried (same day, step
counts sized to 15 min of these 2 cores): batch 256, lr 2e-3, 5,000 steps
(21 epochs) with pad(2)|random_crop(28)|flip_lr -> 0.8939; 4x4 patches
(49 tokens, 0.26 s/step), 3,000 steps -> 0.8799; width 192, depth 6, 3 heads
(0.21 s/step), 4,000 steps -> 0.8898. All still underfit
(val loss falling at the end): what limits it is FLOPs per second on 2 cores.

Args (comma-separated after the file name, e.g. `configs/demo.py:runlocal`):
  runlocal   a few steps on a small batch, for tests and smoke runs.
"""
import ml_collections
from ml_collections import config_dict

TRAIN_PP = ("decode(channels=1)|flip_lr|value_range(-1, 1)"
            "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')")
EVAL_PP = ("decode(channels=1)|value_range(-1, 1)"
           "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')")


def _parse_args(arg):
  args = [a for a in (arg or "").split(",") if a]
  known = {"runlocal"}
  for a in args:
    if a not in known:
      raise ValueError(f"Unknown config arg '{a}': use one of {', '.join(sorted(known))}.")
  return set(args)


def get_config(arg=None):
  args = _parse_args(arg)
  runlocal = "runlocal" in args
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.input = dict(
      data=dict(name="fashion_mnist", split="train", data_dir=config_dict.placeholder(str)),
      batch_size=128,
      pp=TRAIN_PP,
      shuffle_buffer_size=20_000,
      cache="raw",  # 60k tiny PNGs: keep the raw records in memory after epoch 1.
  )
  # 28x28 images, 7x7 patches -> 16 tokens: on CPU attention over many short
  # heads is slow, so few tokens and a moderately wide model train fastest.
  config.model_name = "vit"
  config.model = dict(variant=config_dict.placeholder(str), width=128, depth=4, mlp_dim=512,
                      num_heads=2, patch_size=7, posemb="learn", pool_type="gap", num_classes=10,
                      remat_policy=config_dict.placeholder(str), stem_channels=())
  config.loss = "softmax_xent"
  # Start from another run / an .npz instead of random init: --config.model_init=SRC
  # (a training workdir, a checkpoint step dir or a vision_transformer .npz);
  # dont_load: regexes of params to keep from init, e.g. "('head/.*',)".
  config.model_init = config_dict.placeholder(str)
  config.model_load = dict(dont_load=())

  config.total_steps = 5600  # ~12 epochs.
  config.total_epochs = config_dict.placeholder(float)
  config.optax_name = "scale_by_adam"
  config.optax = dict(b1=0.9, b2=0.999)
  config.lr = 1e-3
  config.wd = 1e-4  # Decoupled (not multiplied by lr), see optim.py.
  config.schedule = dict(warmup_steps=500, decay_type="cosine")
  config.grad_clip_norm = 1.0

  config.log_training_steps = 100
  config.ckpt_steps = 1000
  config.keep_ckpt_steps = config_dict.placeholder(int)

  config.evals = ml_collections.ConfigDict()
  config.evals.val = dict(
      type="classification",
      data=dict(name="fashion_mnist", split="test", data_dir=config_dict.placeholder(str)),
      pp=EVAL_PP, batch_size=500, log_steps=1400)
  # The ViT paper's few-shot linear probe on the other offline datasets.
  config.evals.fewshot = dict(
      type="fewshot", datasets=dict(mnist10k=dict(name="mnist10k"),
                                    animal_mnist=dict(name="animal_mnist")),
      pp="decode(channels=1)|value_range(-1, 1)|keep('image', 'label')",
      shots=(10,), num_seeds=3, batch_size=500, log_steps=5600)

  if runlocal:
    config.input.batch_size = 32
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
    config.evals.fewshot.log_steps = 6
    config.evals.fewshot.num_seeds = 1
    config.evals.fewshot.shots = (1,)
  return config
