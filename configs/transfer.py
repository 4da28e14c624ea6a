r"""Fine-tune (transfer) a pretrained ViT to a new dataset, at any resolution, with a new head.

  python -m big_vit_lite.train --config=configs/transfer.py:init=workdirs/demo,data=mnist10k \
      --workdir=workdirs/ft_mnist10k

The ViT paper's recipe (big_vision's transfer configs): start from a
checkpoint, replace the head by a zero-initialised one for the new classes,
resample the learned position embedding to the new patch grid, SGD with
momentum 0.9, warmup then cosine decay, gradient clipping at global norm 1,
no weight decay; at the end prec@1 on the test split ("val/prec@1").

The checkpoint (`init=`) may be a training workdir or step dir of this
project, a vision_transformer / big_vision .npz or a timm .safetensors; the
model is rebuilt from it (its run's saved model config, else the param
shapes), at `res=` (default: its own resolution). `--config.model_init=SRC`
changes the weights loaded, not the architecture.

Expected result: the demo checkpoint cut to 3,000 steps, fine-tuned for 500 steps (SGD, lr 0.1),
reaches test prec@1 ~0.94 on MNIST-10k and ~0.87 on Animal-MNIST at 28 px, well above the same
model trained from scratch for the same steps (~0.89 / ~0.73); the transfer table in
docs/training.md has every row and its commands (measured with aug=none), benchmarks/NOTES.md
(section "Config, optimizer, sharding, distributed") the learning rates and variants tried.

The train-time augmentation, measured on Animal-MNIST (2026-12-05, this project's 2-core VM
shared with five other jobs): the demo checkpoint at 3,000 steps (the run of the README's short
demo table), 500 steps of this recipe at 28 px, test prec@1 on its 2,000 test images:
aug=none 0.8705, aug=flip 0.8760 (the default here), aug=crop_flip 0.6145 (5-6 min wall each):

  python -m big_vit_lite.train \
      --config=configs/transfer.py:init=workdirs/demo_short,data=animal_mnist,aug=flip \
      --workdir=workdirs/ft_animal_flip

(`aug=none` / `aug=crop_flip` and their own workdirs for the other two.) The inception crop was
made for natural images at 224-384 px; on 28-px silhouettes a crop of 5% of the image is a 6x6
patch of one shape, so it costs 26 points in this short run. One seed each: the flip's +0.55 is
within what a second seed could move.

Args (comma-separated after the file name, e.g. `configs/transfer.py:data=animal_mnist,res=42`):
  init=SRC      the pretrained checkpoint (default workdirs/demo, the demo's workdir).
  data=NAME     a tfds dataset with train/test splits and an integer "label" (default mnist10k).
  folder=ROOT   an image folder ROOT/{train,val}/CLASS/* instead of data= (the test split:
                val/, validation/ or test/, the first found; --config.evals.val.data.split
                names another).
  res=R         input resolution (default: the checkpoint's); the posemb is resampled.
  channels=C    input channels (default: the checkpoint's; 3 turns grey images to RGB).
  classes=K     number of classes (default: read from the dataset or the folder).
  opt=sgd|adamw SGD momentum 0.9 (default, the paper's) or AdamW (b2=0.999, wd 1e-4, decoupled).
  lr=LR         base learning rate (default 0.1 for sgd, 1e-3 for adamw).
  steps=N       training steps (default 500), batch=B (default 64).
  aug=A         train-time augmentation: crop_flip (an inception crop of 5-100% of the
                image resized to res, then a left-right flip, as big_vision's and the paper's
                fine-tuning), crop, flip (resize, then the flip) or none (resize only).
                Default: crop_flip for natural images (image folders and tfds datasets not
                named below); none for the digit sets in FLIP_CHANGES_CLASS (a flip changes
                a digit's class); flip for the 28-px silhouette sets in SMALL_IMAGES, where a
                crop of a few percent of 28x28 pixels loses the object (measured below).
                Pass aug=none for text, digits or any images whose mirror image is another
                class, aug=flip for other tiny images.
  mixup         mixup (alpha 0.2) in the step.
  scratch       the same model and recipe from random init (the baseline).
  runlocal      a few steps on slices of the data, for tests and smoke runs.
Also settable: --config.layer_decay=0.75 (layer-wise lr decay), --config.ema_decay=0.999
(EMA of the weights; --config.evals.val.use_ema=True scores it), --config.grad_clip_norm.
"""

import os

import ml_collections
from ml_collections import config_dict

from big_vit_lite.config import config_knobs
from big_vit_lite.config import config_loading
from big_vit_lite.trainer import transfer  # The demo's architecture: the model when `init` does not exist (yet): training

# then stops on it.
DEMO_MODEL = dict(
    variant=None,
    width=128,
    depth=4,
    mlp_dim=512,
    num_heads=2,
    patch_size=7,
    posemb="learn",
    pool_type="gap",
)


# Datasets whose class a left-right flip changes (digits, letters): no
# augmentation by default.
FLIP_CHANGES_CLASS = (
    "mnist",
    "mnist10k",
    "emnist",
    "kmnist",
    "svhn_cropped",
    "binarized_mnist",
)
# 28-px silhouettes: a flip keeps the class, an inception crop loses the object
# (the docstring).
SMALL_IMAGES = ("fashion_mnist", "animal_mnist")
TRAIN_AUG = dict(
    crop_flip="inception_crop({res})|flip_lr",
    crop="inception_crop({res})",
    flip="resize({res})|flip_lr",
    none="resize({res})",
)


def get_config(arg=None):
  args = config_loading.parse_arg(
      arg,
      init="workdirs/demo",
      data="mnist10k",
      folder="",
      res=0,
      channels=0,
      classes=0,
      opt="sgd",
      lr=0.0,
      steps=500,
      batch=64,
      aug="",
      mixup=False,
      scratch=False,
      runlocal=False,
  )
  if args.opt not in ("sgd", "adamw"):
    raise ValueError(f"Config arg opt={args.opt!r}: use opt=sgd or opt=adamw.")
  data_name = "" if args.folder else args.data
  default_aug = "crop_flip"
  if data_name in FLIP_CHANGES_CLASS:
    default_aug = "none"
  elif data_name in SMALL_IMAGES:
    default_aug = "flip"
  aug = args.aug or default_aug
  if aug not in TRAIN_AUG:
    raise ValueError(
        f"Config arg aug={aug!r}: use aug=crop_flip, aug=crop, aug=flip or "
        "aug=none."
    )
  model, res, channels = transfer.checkpoint_model(args.init)
  if model is None:
    model = dict(DEMO_MODEL)
  res = args.res or res or 28
  channels = args.channels or channels or 1
  folder = ""
  if args.folder:
    folder = os.path.abspath(os.path.expanduser(args.folder))
  classes = args.classes or transfer.num_classes(args.data, folder)

  config = ml_collections.ConfigDict()
  config.seed = 0
  if folder:
    data = dict(name="imagefolder", data_dir=folder)
    # Found: val, validation or test (imagefolder.EVAL_SPLITS).
    eval_split = config_dict.placeholder(str)
  else:
    data = dict(name=args.data, data_dir=config_dict.placeholder(str))
    eval_split = "test"
  decode = f"decode(channels={channels})|resize({res})|value_range(-1, 1)"
  train_decode = "|".join(
      [
          f"decode(channels={channels})",
          TRAIN_AUG[aug].format(res=res),
          "value_range(-1, 1)",
      ]
  )
  labels = (
      f"onehot({classes}, key='label', key_result='labels')"
      "|keep('image', 'labels')"
  )
  config.input = dict(
      data=dict(data, split="train"),
      batch_size=args.batch,
      pp=f"{train_decode}|{labels}",
      shuffle_buffer_size=10_000,
  )
  # As configs/demo.py: 2 CPU devices; nothing changes on a GPU/TPU.
  config.num_cpu_devices = 2
  config.mesh = (("data", -1),)
  # The checkpoint's model with a new zero-initialised head (head_zeroinit) and
  # no pre_logits layer (as the ViT paper fine-tunes), at this resolution.
  model.update(num_classes=classes, rep_size=False, head_zeroinit=True)
  config.model_name = "vit"
  # The checkpoint's model; every other vit.Model knob at its default,
  # settable from the command line (--config.model.drop_path=0.1).
  config.model = config_knobs.vit_model(**model)
  config.model_init = (
      config_dict.placeholder(str) if args.scratch else args.init
  )
  # The posemb is resampled by the loader.
  config.model_load = dict(dont_load=("head/.*",))

  config.total_steps = args.steps
  config.loss = "softmax_xent"
  if args.opt == "sgd":
    config.optax_name = "momentum"
    config.optax = dict(momentum=0.9)
    # The best of 0.01..0.3 on MNIST-10k (benchmarks/NOTES.md).
    config.lr = args.lr or 0.1
    config.wd = 0.0
  else:
    config.optax_name = "adamw"
    config.optax = dict(b1=0.9, b2=0.999)
    config.lr = args.lr or 1e-3
    config.wd = 1e-4  # Decoupled (not multiplied by lr), see optim.py.
  config.schedule = dict(
      warmup_steps=max(1, args.steps // 10), decay_type="cosine"
  )
  config.grad_clip_norm = 1.0
  config.layer_decay = config_dict.placeholder(float)
  # grad_accum_steps, ema_decay, profile_steps, wandb: unset or off, settable
  # from the command line.
  config.update(config_knobs.trainer_knobs())
  if args.mixup:
    config.mixup = dict(mixup_alpha=0.2)

  config.log_training_steps = max(1, args.steps // 10)
  config.ckpt_steps = max(1, args.steps // 2)
  config.keep_ckpts = 1
  config.evals = ml_collections.ConfigDict()
  config.evals.val = dict(
      type="classification",
      data=dict(data, split=eval_split),
      pp=f"{decode}|{labels}",
      batch_size=500,
      use_ema=False,
      log_steps=config_dict.placeholder(int),
  )

  if args.runlocal:
    # Tests choose their device count.
    config.num_cpu_devices = config_dict.placeholder(int)
    config.input.batch_size = min(args.batch, 16)
    if not folder:  # (An image folder for a smoke run is small already.)
      config.input.data.split = "train[:256]"
      config.evals.val.data.split = "test[:200]"
    config.input.shuffle_buffer_size = 100
    config.total_steps = min(args.steps, 6)
    config.schedule.warmup_steps = 2
    config.log_training_steps = 2
    config.ckpt_steps = 3
    config.evals.val.batch_size = 100
  return config
