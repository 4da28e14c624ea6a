"""The train state's layout and the jitted step, assembled once: for train, bench and plan.

    layout = lay_out(model=model, mesh=mesh, rules=rules, seed=seed, make_opt=..., ema=...)
    step = jit_step(model=model, layout=layout, mesh=mesh, accum_steps=k)
    traced, compiled = compile_step(step, step_args(model=..., layout=..., mesh=..., ...))
    memory = flops.program_memory(compiled)  # flops.py: the one reader of its memory

`model` is train_setup.make_model's Model (the module, loss, mixup, device augmentation and
the distillation teacher); `mesh` a Mesh over real devices or abstract TPU/GPU ones, or an
AbstractMesh (layout only). The optimizer comes in made (`make_opt`: optim.make for the
trainer's config, a fixed AdamW for bench): this module reads no config, and imports
without ml_collections (bench runs on a GPU host that has only jax, flax and optax). The trainer compiles what this module builds, and so does
`plan --compile` for a TPU slice or a GPU host: tests/test_train_state.py holds the two to
the same optimized program for every shipped config.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from big_vit_lite.runtime import sharding
from big_vit_lite.trainer import ema as ema_lib
from big_vit_lite.trainer import train_step


@dataclasses.dataclass(frozen=True)
class Model:
  """The model, its loss and augmentations, and the batch it is trained on (train_setup.make_model's)."""

  model_mod: object  # The module of the model family (load()).
  model_kw: object  # config.model
  module: nn.Module
  loss_fn: object
  init_head_bias: float | None
  mixup_fn: object
  device_aug_fn: object
  batch_spec: dict
  image_shape: tuple
  init_params: object  # rng -> boxed params (logical axis names attached).
  distill: object  # distill.Teacher (config.distill) or None


@dataclasses.dataclass(frozen=True)
class Layout:
  """The state's shapes and shardings, its optimizer and EMA: all before any array exists."""

  rng_init: jax.Array
  rng_train: jax.Array
  params_abstract: object
  params_sh: object
  opt: object  # make_opt(params_abstract): optim.make's Optimizer
  opt_abstract: object
  opt_sh: object
  ema: object  # ema.Ema or None
  state_sh: dict
  state_abstract: dict  # ShapeDtypeStructs with their shardings.


def lay_out(
    *, model, mesh, rules, seed, make_opt, ema=None, unsplit=None
) -> Layout:
  """Shapes and shardings of params, optimizer state (and EMA), without computing any.

  make_opt: abstract params -> the optimizer (optim.make's Optimizer: tx, apply, lr_fn);
  ema: ema.Ema (config.ema_decay) or None; unsplit: a list that collects the param dims
  the mesh does not divide (else they are logged as a warning).
  """
  rng_init, rng_train = jax.random.split(jax.random.PRNGKey(seed))
  boxed_abstract = jax.eval_shape(model.init_params, rng_init)
  params_sh = sharding.logical_shardings(
      boxed_abstract, mesh, rules, unsplit=unsplit
  )
  params_abstract = sharding.unbox(boxed_abstract)
  opt = make_opt(params_abstract)
  opt_abstract = jax.eval_shape(opt.tx.init, params_abstract)
  opt_sh = sharding.like_params_shardings(
      opt_abstract, params_abstract, params_sh, mesh
  )
  repl = sharding.replicated(mesh)
  state_sh = dict(params=params_sh, opt_state=opt_sh, step=repl, rng=repl)
  state_shapes = dict(
      params=params_abstract,
      opt_state=opt_abstract,
      step=jax.ShapeDtypeStruct((), jnp.int32),
      rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
  )
  # An EMA of the weights in the state, if configured.
  if ema:
    state_sh[ema_lib.KEY] = params_sh
    state_shapes[ema_lib.KEY] = params_abstract
  state_abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      state_shapes,
      state_sh,
  )
  return Layout(
      rng_init=rng_init,
      rng_train=rng_train,
      params_abstract=params_abstract,
      params_sh=params_sh,
      opt=opt,
      opt_abstract=opt_abstract,
      opt_sh=opt_sh,
      ema=ema,
      state_sh=state_sh,
      state_abstract=state_abstract,
  )


def jit_step(*, model, layout, mesh, accum_steps):
  """The training step (train_step.make_update_fn), jitted with the state's shardings.

  (state, batch[, teacher_params]) -> (new state, measurements); the state is donated.
  Call (and trace) it under jax.set_mesh(mesh) and the run's nn.logical_axis_rules.
  """
  batch_sh = sharding.batch_sharding(mesh)
  repl = sharding.replicated(mesh)
  update_fn = train_step.make_update_fn(
      model=model.module,
      opt=layout.opt,
      loss_fn=model.loss_fn,
      accum_steps=accum_steps,
      mixup_fn=model.mixup_fn,
      device_aug_fn=model.device_aug_fn,
      ema=layout.ema,
      distill=model.distill,
      batch_sharding=batch_sh,
      param_shardings=layout.params_sh,
  )
  in_shardings = (layout.state_sh, batch_sh)
  if model.distill:
    # The teacher's params: a third argument, so never in the saved state.
    in_shardings += (None,)
  # Donating the state lets XLA update it in place.
  return jax.jit(
      update_fn,
      in_shardings=in_shardings,
      out_shardings=(layout.state_sh, repl),
      donate_argnums=(0,),
  )


def step_args(*, model, layout, mesh, batch_size) -> tuple:
  """The step's arguments as ShapeDtypeStructs with their shardings: what compiles it.

  The batch has the train iterator's keys and dtypes (model.batch_spec) at the global
  batch size; with a distillation teacher, its params come third.
  """
  batch_sh = sharding.batch_sharding(mesh)
  batch_abstract = {
      k: jax.ShapeDtypeStruct(
          (batch_size,) + v.shape[1:], v.dtype, sharding=batch_sh
      )
      for k, v in model.batch_spec.items()
  }
  args = (layout.state_abstract, batch_abstract)
  if model.distill:
    args += (model.distill.abstract(),)
  return args


def compile_step(jitted_step, args, compiler_options=None):
  """(traced, compiled) of the jitted step for `args` (step_args').

  compiler_options: XLA options for this compile ({"xla_...": value}), or None.
  """
  traced = jitted_step.trace(*args)
  return traced, traced.lower().compile(compiler_options)
