r"""A tiny training config for the trainer's tests (not a test module itself).

  python -m big_vit_lite.train --config=tests/train_config_tiny.py:mesh=fsdp --workdir=/tmp/w

Args: mesh=data|fsdp|model (default data; model = data x 2-way tensor parallel),
evals (add a classification eval), init=SRC (model_init from SRC, head not loaded),
wandb (config.wandb, offline: written under the workdir).
A 1-block width-16 ViT on 28x28 Fashion-MNIST, batch 16: steps take milliseconds,
so the tests measure the trainer's behaviour, not the model.
"""

import ml_collections


def get_config(arg=None):
  args = dict(
      a.split("=", 1) if "=" in a else (a, True)
      for a in (arg or "").split(",")
      if a
  )
  config = ml_collections.ConfigDict()
  config.seed = 3
  config.input = dict(
      data=dict(name="fashion_mnist", split="train", data_dir=None),
      batch_size=16,
      pp=(
          "decode(channels=1)|flip_lr|value_range(-1, 1)"
          "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')"
      ),
      shuffle_buffer_size=64,
      prefetch=2,
  )
  # Shifts/flips in the jitted step too: the kill/resume and 8-device tests
  # cover them.
  config.device_aug = dict(translate=1, fill=-1.0, flip_lr=True)
  config.model_name = "vit"
  config.model = dict(
      variant=None,
      width=16,
      depth=1,
      mlp_dim=32,
      num_heads=2,
      patch_size=7,
      pool_type="gap",
      num_classes=10,
      remat_policy=None,
      dropout=0.1,
  )
  config.loss = "softmax_xent"
  config.grad_accum_steps = 1
  config.total_steps = 12
  config.optax_name = "scale_by_adam"
  config.lr = 1e-3
  config.wd = 1e-4
  config.schedule = dict(warmup_steps=2, decay_type="cosine")
  config.grad_clip_norm = 1.0
  config.log_training_steps = 1
  config.ckpt_steps = 4
  config.num_cpu_devices = ml_collections.config_dict.placeholder(int)
  # --config.report=True: the report at each eval (test_report.py).
  config.report = False
  mesh = args.get("mesh", "data")
  config.mesh = (
      [(mesh, -1)] if mesh != "model" else [("data", -1), ("model", 2)]
  )
  if "init" in args:
    config.model_init = args["init"]
    config.model_load = dict(dont_load=["head/.*"])
  if "wandb" in args:
    config.wandb = dict(project="bvl-tests", mode="offline")
  if "evals" in args:
    config.evals = dict(
        val=dict(
            type="classification",
            data=dict(name="fashion_mnist", split="test[:200]"),
            pp=(
                "decode(channels=1)|value_range(-1, 1)"
                "|onehot(10, key='label', key_result='labels')|keep('image', 'labels')"
            ),
            batch_size=100,
            log_steps=6,
        )
    )
  return config
