"""The knobs every shipped training config has, at their off values, so that the command line
can set each on every config (`--config.model.drop_path=0.1`, `--config.wandb.project=NAME`).

Config files build `config.model` with `vit_model(...)` and add the trainer's knobs with
`config.update(trainer_knobs())`; tests/test_config_knobs.py holds that every knob is settable
on every training config and that the model knobs sit at vit.Model's own defaults (so a config
that gains a knob trains the same bits). Light on purpose (no jax): config files import it.
"""

from ml_collections import config_dict


def vit_block_options():
  """vit.Model's block options at their off values, for a training config's model dict, so that
  the command line can set each (--config.model.qk_norm=True): register tokens, QK-norm,
  LayerScale, SwiGLU MLP, RMSNorm, parallel attention+MLP blocks (ViT-22B), bias-free
  projections (docs/vit_options.md), and the distillation token."""
  return dict(
      reg_tokens=0,
      qk_norm=False,
      # None: no LayerScale; e.g. 1e-5
      layerscale_init=config_dict.placeholder(float),
      mlp="gelu",  # "gelu" | "swiglu"
      norm="layernorm",  # "layernorm" | "rmsnorm"
      parallel_block=False,
      use_bias=True,
      # DeiT's distillation token and head (with config.distill;
      # docs/distillation.md).
      distill_token=False,
  )


def vit_model(**fields):
  """A training config's `config.model`: `fields` over every knob of vit.Model at the model's
  own default, so that the command line can set each on every config
  (--config.model.drop_path=0.1): the matmul and residual-stream dtypes, scan, remat,
  attention, dropout, drop_path, gelu, and the block options (vit_block_options).
  """
  knobs = dict(
      dtype_mm="float32",  # "auto" | "float32" | "bfloat16"
      # the residual stream between blocks; "bfloat16" halves its traffic
      dtype_act="float32",  # "auto" | "float32" | "bfloat16"
      # True: the blocks under nn.scan (compiles one block; params stacked)
      scan=False,
      # None: no remat; a jax.checkpoint_policies name, e.g. "nothing_saveable"
      remat_policy=config_dict.placeholder(str),
      # "auto" | "custom" | "xla" | "cudnn" | "splash" (vit.py's docstring)
      attention="auto",
      dropout=0.0,
      # stochastic depth of the last block (linear from 0 in depth)
      drop_path=0.0,
      gelu="exact",  # "exact" | "tanh"
      **vit_block_options(),
  )
  # A None among `fields` (a checkpoint's saved model config) keeps the knob's
  # typed placeholder: a plain None could not be set from the command line.
  fields = {k: v for k, v in fields.items() if v is not None or k not in knobs}
  return dict(knobs, **fields)


def trainer_knobs():
  """The trainer's knobs that every training config has (config.update(trainer_knobs())),
  unset or off, so that the command line can set each: gradient accumulation, an EMA of
  the weights, profiled steps, and Weights & Biases (wandb_writer.py; unset: none).
  """
  return dict(
      # The batch as N sequential microbatches per step (same update, ~1/N of
      # the activation memory): --config.grad_accum_steps=4.
      grad_accum_steps=1,
      # e.g. 0.9999; --config.evals.NAME.use_ema=True scores it.
      ema_decay=config_dict.placeholder(float),
      # Steps traced by jax.profiler, e.g. --config.profile_steps="(10, 11)".
      profile_steps=config_dict.placeholder(tuple),
      # --config.wandb.project=NAME starts logging to W&B.
      wandb=dict(
          project=config_dict.placeholder(str),
          entity=config_dict.placeholder(str),
          name=config_dict.placeholder(str),
          group=config_dict.placeholder(str),
          tags=config_dict.placeholder(tuple),
          notes=config_dict.placeholder(str),
          mode=config_dict.placeholder(
              str
          ),  # "online" | "offline" | "disabled"
      ),
  )
