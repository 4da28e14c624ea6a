r"""ViT-S/16 on ImageNet-1k from scratch: the "Better plain ViT baselines" recipe (Beyer et al. 2022).

  # ImageNet-1k must be prepared for tfds by hand (manual download, see tfds' imagenet2012).
  python -m big_vit_lite.train --config=configs/vit_s16_i1k.py --workdir=workdirs/vit_s16_i1k

Recipe: ViT-S/16, global average pooling (no class token), fixed 2D sin-cos
position embedding, batch 1024, 90 epochs, Adam (b2=0.999) lr 1e-3 with
decoupled weight decay 1e-4, 10k warmup steps then cosine decay, gradient
clipping at 1, inception crop + flip + RandAugment(2, 10) + mixup 0.2, no
dropout, no stochastic depth. 1% of the train split is held out as minival.

Expected result (paper: 76.5% ImageNet val top-1 after 90 epochs, ~7h on a
TPU v3-8): "val/prec@1" ~ 0.765. On CPU only `runlocal` is practical.

Accelerators: meant for a TPU v3-8 (8 TensorCores, 128 images each), as in the paper.
The "auto" model settings (configs/vit_l16.py's rule): bfloat16 matmuls wherever the backend is
not the CPU, and on a TPU a bfloat16 residual stream and XLA's attention; the other
accelerator knobs are config.model's scan, remat_policy, drop_path, gelu.
The TPU compiler (`python -m big_vit_lite.plan --topology=v3-8 --config=configs/vit_s16_i1k.py
--compile`, libtpu 0.0.42.1): 5.5 of 16 GiB HBM per core (66% spare), est. 123 ms per step,
~2080 img/s per chip, MFU ~46% (its cost model; ~3.8 h for 90 epochs against the paper's ~7 h;
with attention=custom and dtype_act=float32, the defaults before, 7.3 GiB and 146 ms).

Args: runlocal (3 steps, 32x32 images, tiny model, batch 8; the tests run it
under tfds.testing.mock_data since ImageNet is not on the machine).
"""

import ml_collections
from ml_collections import config_dict

from big_vit_lite.config import config_knobs
from big_vit_lite.config import config_loading


def get_config(arg=None):
  runlocal = config_loading.parse_arg(arg, runlocal=False).runlocal
  res = 32 if runlocal else 224
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.input = dict(
      data=dict(
          name="imagenet2012",
          split="train[:99%]",
          data_dir=config_dict.placeholder(str),
      ),
      batch_size=1024,
      pp=(
          f"decode_jpeg_and_inception_crop({res})|flip_lr|randaug(2, 10)"
          "|value_range(-1, 1)"
          "|onehot(1000, key='label', key_result='labels')"
          "|keep('image', 'labels')"
      ),
      shuffle_buffer_size=250_000,
  )
  # grad_accum_steps, ema_decay, profile_steps, wandb: unset or off, settable
  # from the command line (--config.grad_accum_steps=4 when the batch does not
  # fit).
  config.update(config_knobs.trainer_knobs())
  config.total_steps = config_dict.placeholder(int)  # None: counted in epochs.
  config.total_epochs = 90.0  # float: --config.total_epochs=0.5 works too.
  config.log_training_steps = 50
  config.ckpt_steps = 1000
  config.keep_ckpt_steps = 10_000
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

  config.model_name = "vit"
  config.model = config_knobs.vit_model(
      variant="S/16",
      num_classes=1000,
      pool_type="gap",
      posemb="sincos2d",
      rep_size=False,
      head_zeroinit=True,
      # No remat (vit_model's None): S/16 fits without it (see
      # `plan`); it costs ~20%.
      # Accelerator knobs (--config.model.KEY=VALUE).
      # "auto", the rule of configs/vit_l16.py's ACCELERATOR_KNOBS:
      # bfloat16 matmuls wherever the backend is not the CPU, a
      # bfloat16 residual stream and XLA's attention on a TPU.
      dtype_mm="auto",
      dtype_act="auto",
      scan=False,
      attention="auto",
      drop_path=0.0,
      gelu="exact",
  )
  config.loss = "softmax_xent"
  # Start from another run / an .npz instead of random init:
  # --config.model_init=SRC (a training workdir, a checkpoint step dir or a
  # vision_transformer .npz); dont_load: regexes of params to keep from init,
  # e.g. "('head/.*',)".
  config.model_init = config_dict.placeholder(str)
  config.model_load = dict(dont_load=())
  config.mixup = dict(mixup_alpha=0.2)

  config.optax_name = "scale_by_adam"
  config.optax = dict(b1=0.9, b2=0.999)
  config.lr = 1e-3
  config.wd = 1e-4  # Decoupled: p -= wd * schedule * p.
  config.schedule = dict(warmup_steps=10_000, decay_type="cosine")
  config.grad_clip_norm = 1.0

  eval_pp = (
      f"decode|resize_small({res * 8 // 7})|central_crop({res})"
      "|value_range(-1, 1)"
      "|onehot(1000, key='label', key_result='labels')|keep('image', 'labels')"
  )
  config.evals = ml_collections.ConfigDict()
  config.evals.minival = dict(
      type="classification",
      data=dict(name="imagenet2012", split="train[99%:]"),
      pp=eval_pp,
      batch_size=1024,
      log_steps=2500,
  )
  config.evals.val = dict(
      type="classification",
      data=dict(name="imagenet2012", split="validation"),
      pp=eval_pp,
      batch_size=1024,
      log_steps=2500,
  )
  # A tuple, not a list: only tuples take --config.mesh="[...]".
  config.mesh = (("data", -1),)

  if runlocal:
    config.input.batch_size = 8
    config.input.shuffle_buffer_size = 16
    config.model.variant = "mu/16"
    # Unset, still overridable.
    config.total_epochs = config_dict.placeholder(float)
    config.total_steps = 3
    config.log_training_steps = 1
    config.ckpt_steps = 3
    config.keep_ckpt_steps = config_dict.placeholder(int)
    config.schedule.warmup_steps = 1
    for ev in (config.evals.minival, config.evals.val):
      ev.batch_size = 8
      ev.log_steps = 3
  return config
