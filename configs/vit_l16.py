r"""ViT-L/16 pretraining as in the ViT paper (Dosovitskiy et al., ICLR 2021), on ImageNet-21k.

  python -m big_vit_lite.data.prepare imagenet21k --manual_dir=DIR_WITH_THE_TARS   # once
  python -m big_vit_lite.train --config=configs/vit_l16.py --workdir=workdirs/vit_l16

Recipe (paper, Sec. 4.1 and Appendix B.1): Adam b1=0.9 b2=0.999, batch 4096,
weight decay 0.1, 10k linear warmup steps then linear decay, sigmoid
cross-entropy, a "pre_logits" (Dense+tanh) layer before the head, class
token, learned position embedding, dropout 0.1, global gradient clipping at
1, 224x224 inception crops + flips, 90 epochs of ImageNet-21k (fall11,
21,841 classes; the first 51,200 images are held out as "minival").

Expected result (not reproducible on CPU; from the paper, Table 2 / 5): this
checkpoint fine-tuned on ImageNet-1k at 384px reaches ~85.3% top-1 (ViT-L/16
I21k); upstream, minival prec@1 (one of 21k labels) is roughly 45-50% at the
end. It needs a TPU v3-64 / 8xA100-class machine for days: the mesh is FSDP by
default (--config.mesh sets another; `python -m big_vit_lite.plan` first).

Accelerators: meant for a TPU v5p-128 slice (64 chips, 64 images per chip, FSDP over all of
them: the default mesh fsdp:-1). On a TPU the "auto" model settings (ACCELERATOR_KNOBS below)
take bfloat16 matmuls, a bfloat16 residual stream and XLA's attention, the step the TPU
compiler's cost model puts fastest (benchmarks/NOTES.md, "The TPU defaults"); on a GPU
bfloat16 matmuls; on the CPU float32 throughout. The TPU compiler's figures for this config on
v5p-128 (`python -m big_vit_lite.plan --topology=v5p-128 --config=configs/vit_l16.py --compile
--time_by_depth --config.model.scan=True`, libtpu 0.0.42.1; estimates of its cost model):
20.0 of 95 GiB HBM per chip (79% spare; plan 20.8), est. 101 ms per step, ~630 img/s per chip,
MFU ~51%, ~560 chip-hours for the 90 epochs. On a v5p-256 (32 images per chip) 59 ms, ~44%;
on a v5p-512 (16 per chip) 36 ms, ~36%; on a v4-256 plan gives 11.6 of 32 GiB per chip on
data:32,fsdp:4.

Weight decay: the paper's "0.1" was flax.optim's decay (p -= lr * 0.1 * p);
here `wd` is decoupled from lr (big_vision convention, see optim.py), so the
same decay is wd = 0.1 * lr.

Other data (see big_vit_lite/data and the README's data section):
  * another tfds dataset:  --config.input.data.name=imagenet2012 --config.input.data.split=train
    plus --config.model.num_classes=1000 and matching evals (or use arg data=i1k);
  * an image folder (ROOT/{train,val}/CLASS/*.jpg; the minival split is ROOT/val, validation
    or test, the first found): args data=folder:/path/to/ROOT,classes=N.
  * JFT-300M itself is not public: the paper's 7-epoch JFT run is this config
    with that data, total_epochs=7 and lr=4e-4 (L/16).

Args (comma-separated, e.g. `configs/vit_l16.py:variant=H/14,data=i1k`):
  variant=L/16  any ViT variant ("B/16", "H/14", ...).
  data=i21k|i21k_fall11|i21k_winter21|i1k|folder:ROOT   training data (default i21k, the
                fall11 release: 21,841 classes; i21k_winter21: the 2021 release, 19,167
                classes; num_classes and the pp's onehot follow); folders also need classes=N.
  runlocal      3 steps at 32x32 with a tiny model and batch 8 (tests run it
                under tfds.testing.mock_data when the data is not on the machine).
"""

import ml_collections
from ml_collections import config_dict

from big_vit_lite.config import config_knobs
from big_vit_lite.config import config_loading

DATA = {
    # name, train split, minival split, classes
    # = i21k_fall11
    "i21k": ("imagenet21k", "full[51200:]", "full[:51200]", 21841),
    "i21k_fall11": (
        "imagenet21k/fall11",
        "full[51200:]",
        "full[:51200]",
        21841,
    ),
    "i21k_winter21": (
        "imagenet21k/winter21",
        "full[51200:]",
        "full[:51200]",
        19167,
    ),
    "i1k": ("imagenet2012", "train[:99%]", "train[99%:]", 1000),
}


# What an accelerator user tunes, settable as --config.model.KEY=VALUE
# (vit.Model's fields). The rule for "auto": matmuls in bfloat16 wherever the
# backend is not the CPU (GPU, TPU) and in float32 on the CPU; the residual
# stream in bfloat16 on a TPU only; attention cuDNN on a CUDA GPU, XLA's on a
# TPU, the custom one on the CPU. Params, LayerNorm and softmax stay float32.
ACCELERATOR_KNOBS = dict(
    dtype_mm="auto",  # "auto" | "float32" | "bfloat16"
    # the residual stream between blocks; "bfloat16" halves its traffic
    dtype_act="auto",  # "auto" | "float32" | "bfloat16"
    # True: the blocks under nn.scan (compiles one block; params stacked)
    scan=False,
    # "auto" | "custom" | "xla" | "cudnn" | "splash" (vit.py's docstring)
    attention="auto",
    # stochastic depth of the last block (linear from 0 in depth)
    drop_path=0.0,
    gelu="exact",  # "exact" | "tanh"
)


def data_source(data, classes=0):
  """(train data dict, minival data dict, num_classes) for the `data` arg."""
  if data.startswith("folder:"):
    if not classes:
      raise ValueError(
          "data=folder:ROOT needs classes=N (the number of class folders)."
      )
    root = data.split(":", 1)[1]
    return (
        dict(name="imagefolder", split="train", data_dir=root),
        # Unset: found, ROOT/val, validation or test (imagefolder.EVAL_SPLITS);
        # --config.evals.minival.data.split=NAME names another.
        dict(
            name="imagefolder",
            split=config_dict.placeholder(str),
            data_dir=root,
        ),
        int(classes),
    )
  if data not in DATA:
    raise ValueError(
        f"Unknown data '{data}': use one of {', '.join(DATA)} or folder:ROOT."
    )
  name, train_split, minival_split, classes = DATA[data]
  # data_dir: a placeholder (None: $TFDS_DATA_DIR, else tfds' default) so that
  # --config.input.data.data_dir=DIR can set it (a plain None cannot be
  # overridden).
  return (
      dict(name=name, split=train_split, data_dir=config_dict.placeholder(str)),
      dict(
          name=name, split=minival_split, data_dir=config_dict.placeholder(str)
      ),
      classes,
  )


# The args of this config (less variant) and of configs/vit_b16.py.
ARGS = dict(data="i21k", classes=0, runlocal=False)


def get_config(arg=None):
  args = config_loading.parse_arg(arg, variant="L/16", **ARGS)
  return make_config(
      variant=args.variant,
      data=args.data,
      classes=args.classes,
      runlocal=args.runlocal,
  )


def make_config(*, variant, data, classes, runlocal):
  """The paper's recipe for ViT-`variant`; configs/vit_b16.py builds on it."""
  train_data, minival_data, num_classes = data_source(data, classes)
  res = 224
  config = ml_collections.ConfigDict()
  config.seed = 0

  config.input = dict(
      data=train_data,
      batch_size=4096,
      pp=(
          f"decode_jpeg_and_inception_crop({res})|flip_lr|value_range(-1, 1)"
          f"|onehot({num_classes}, key='label', key_result='labels')"
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
  config.keep_ckpt_steps = 50_000
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
      variant=variant,
      num_classes=num_classes,
      pool_type="tok",
      posemb="learn",
      rep_size=True,
      dropout=0.1,
      head_zeroinit=True,
      # No remat: at 64 images per chip (v5p-128) L/16 needs
      # 20 of 95 GiB without it (the TPU compiler), and remat
      # costs ~20% of the step. With more images per device
      # `plan` says when 'nothing_saveable' is needed.
      **ACCELERATOR_KNOBS,
  )
  config.loss = "sigmoid_xent"
  # Start from another run / an .npz instead of random init:
  # --config.model_init=SRC (a training workdir, a checkpoint step dir or a
  # vision_transformer .npz); dont_load: regexes of params to keep from init,
  # e.g. "('head/.*',)".
  config.model_init = config_dict.placeholder(str)
  config.model_load = dict(dont_load=())
  # Sigmoid heads start at p ~ 5e-5 per class: stable start.
  config.init_head_bias = -10.0

  config.optax_name = "scale_by_adam"
  config.optax = dict(b1=0.9, b2=0.999)
  config.lr = 1e-3
  config.wd = 0.1 * config.lr  # The paper's 0.1, decoupled (see the docstring).
  config.schedule = dict(warmup_steps=10_000, decay_type="linear")
  config.grad_clip_norm = 1.0

  eval_pp = (
      f"decode|resize_small({res * 8 // 7})|central_crop({res})"
      "|value_range(-1, 1)"
      f"|onehot({num_classes}, key='label', key_result='labels')"
      "|keep('image', 'labels')"
  )
  config.evals = ml_collections.ConfigDict()
  config.evals.minival = dict(
      type="classification",
      data=minival_data,
      pp=eval_pp,
      batch_size=1024,
      loss_name="sigmoid_xent",
      log_steps=10_000,
  )
  # The paper's few-shot linear probe; here on the offline datasets (swap in
  # any tfds datasets with `datasets=dict(NAME=dict(name=...))`).
  config.evals.fewshot = dict(
      type="fewshot",
      datasets=dict(
          mnist10k=dict(name="mnist10k"), animal_mnist=dict(name="animal_mnist")
      ),
      pp=(
          f"decode(channels=3)|resize({res})|value_range(-1, 1)"
          "|keep('image', 'label')"
      ),
      shots=(1, 5, 10, 25),
      batch_size=1024,
      log_steps=25_000,
  )

  # One global batch of 4096 needs many devices: FSDP over all of them (params,
  # gradients and optimizer state split, the batch too) by default, the layout
  # the TPU compiler's cost model puts fastest for L/16 on 128 chips (65 ms
  # against data parallel's 72, at 8.5 GiB per chip against 14.3); plain data
  # parallel: --config.mesh="[('data', -1)]", or mixed, e.g. "[('data', -1),
  # ('fsdp', 8)]" (see `python -m big_vit_lite.plan`). A tuple, not a list:
  # only tuples take --config.mesh="[...]".
  config.mesh = (("fsdp", -1),)
  # None: sharding.DEFAULT_RULES; override with e.g.
  # --config.sharding_rules="(('embed', 'fsdp'), ('mlp', 'model'), ('heads',
  # 'model'))".
  config.sharding_rules = config_dict.placeholder(tuple)

  if runlocal:
    _runlocal(config, num_classes)
  return config


def _runlocal(config, num_classes):
  """A few steps on tiny images with a tiny model, for tests and smoke runs."""
  res = 32
  config.input.batch_size = 8
  config.input.shuffle_buffer_size = 16
  config.input.pp = (
      f"decode_jpeg_and_inception_crop({res})|flip_lr|value_range(-1, 1)"
      f"|onehot({num_classes}, key='label', key_result='labels')"
      "|keep('image', 'labels')"
  )
  config.model.variant = "mu/16"
  # Unset, still overridable.
  config.total_epochs = config_dict.placeholder(float)
  config.total_steps = 3
  config.log_training_steps = 1
  config.ckpt_steps = 3
  config.keep_ckpt_steps = config_dict.placeholder(int)
  config.schedule.warmup_steps = 1
  config.evals.minival.pp = (
      f"decode|resize({res})|value_range(-1, 1)"
      f"|onehot({num_classes}, key='label', key_result='labels')"
      "|keep('image', 'labels')"
  )
  config.evals.minival.batch_size = 8
  config.evals.minival.log_steps = 3
  config.evals.fewshot.pp = (
      f"decode(channels=3)|resize({res})|value_range(-1, 1)"
      "|keep('image', 'label')"
  )
  config.evals.fewshot.shots = (1,)
  config.evals.fewshot.num_seeds = 1
  config.evals.fewshot.batch_size = 8
  config.evals.fewshot.log_steps = 3
