"""The trainer's own model, state layout and step, assembled for a plan on any mesh.

    built = assemble(config, mesh, res, target="tpu")   # mesh: Mesh or AbstractMesh
    traced, compiled = compile_built(built)              # a Mesh of real or abstract devices

No second builder: the model comes from train_setup.make_model (its checks included: the
model name, splash off a TPU, float labels, the distillation teacher) and the state and the
jitted step from train_state, as train.py builds them. What the trainer reads from its
input pipeline the plan makes up: the batch's keys and shapes (float images of the
training size, one-hot float labels), and the dataset's size for the schedule where the
data cannot be read here. The config is read through a TrackedConfig, never written.
"""

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from big_vit_lite.config import config_loading
from big_vit_lite.trainer import grad_accum
from big_vit_lite.runtime import flops as flops_lib
from big_vit_lite.runtime import sharding
from big_vit_lite.trainer import train_setup
from big_vit_lite.trainer import train_state
from big_vit_lite.data import input_pipeline

# Examples per epoch where the dataset cannot be read here (an ImageNet not
# prepared on the planning machine): only the schedule's constants depend on it.
STAND_IN_EXAMPLES = 10**9


@dataclasses.dataclass(frozen=True)
class Built:
  """The trainer's pieces for one mesh: train_setup.Model, train_state.Layout and more."""

  model: object  # train_setup.Model
  layout: object  # train_state.Layout
  mesh: object
  rules: object
  batch_size: int
  accum_steps: int
  unsplit: list  # The param dims the mesh axes do not divide (sharding.py).


def first_line(error) -> str:
  """The first line of a compiler's or plugin's error (its type's name if it is empty)."""
  text = str(error).strip()
  if not text:
    return type(error).__name__
  return text.splitlines()[0]


def image_channels(config) -> int:
  """Channels of the training images: `channels=N` of a decode op in input.pp, else 3."""
  found = re.findall(r"channels\s*=\s*(\d+)", str(config.input.get("pp", "")))
  if found:
    return int(found[-1])
  return 3


def batch_spec(config, res: int) -> dict:
  """The train iterator's batch_spec() as the plan takes it: float images, one-hot labels."""
  num_classes = int(config.model.get("num_classes", 0) or 0)
  shape = (1, res, res, image_channels(config))
  return dict(
      image=jax.ShapeDtypeStruct(shape, jnp.float32),
      labels=jax.ShapeDtypeStruct((1, num_classes), jnp.float32),
  )


def num_examples(input_cfg) -> int:
  """The training split's size, or STAND_IN_EXAMPLES where it cannot be read here."""
  try:
    return input_pipeline.get_num_examples(input_cfg["data"])
  # Any reason the dataset is not readable here (not prepared, no access).
  except Exception:  # pylint: disable=broad-except
    return STAND_IN_EXAMPLES


def assemble(raw_config, mesh, res: int, target=None) -> Built:
  """The trainer's model and state layout for `mesh`, images res x res.

  target: None to build what runs on `mesh`'s own (real) devices, as train.py does; else
  the platform planned for ("tpu", "gpu", "cpu"): "auto" model settings decided for it,
  a distillation teacher's params abstract (train_setup.make_model's `target`).
  """
  config = config_loading.TrackedConfig(raw_config)
  rules = sharding.make_rules(config.get("sharding_rules", None), mesh)
  input_cfg = config.consume("input")
  batch_size = int(input_cfg["batch_size"])
  accum_steps = grad_accum.check(
      config.get("grad_accum_steps", 1),
      batch_size,
      sharding.batch_devices(mesh),
  )
  model = train_setup.make_model(
      config,
      batch_spec=batch_spec(raw_config, res),
      mesh=mesh,
      rules=rules,
      target=target,
  )
  dur = train_setup.read_duration(
      config, batch_size=batch_size, num_examples=num_examples(input_cfg)
  )
  unsplit = []
  layout = train_setup.lay_out(
      config,
      model=model,
      mesh=mesh,
      rules=rules,
      seed=int(config.get("seed", 0)),
      dur=dur,
      unsplit=unsplit,
  )
  return Built(
      model=model,
      layout=layout,
      mesh=mesh,
      rules=rules,
      batch_size=batch_size,
      accum_steps=accum_steps,
      unsplit=unsplit,
  )


def compile_built(built: Built, compiler_options=None):
  """(traced, compiled) of the trainer's step (train_state.jit_step) for `built`.

  compiler_options: XLA options for this compile (the GPU target's), or None.
  """
  with jax.set_mesh(built.mesh), nn.logical_axis_rules(built.rules):
    step = train_state.jit_step(
        model=built.model,
        layout=built.layout,
        mesh=built.mesh,
        accum_steps=built.accum_steps,
    )
    args = train_state.step_args(
        model=built.model,
        layout=built.layout,
        mesh=built.mesh,
        batch_size=built.batch_size,
    )
    return train_state.compile_step(step, args, compiler_options)


def compile_on(
    config, mesh: dict, devices, res: int, target=None, options=None
):
  """The trainer's step compiled for `mesh` ({axis: size}) over `devices` (real or
  abstract): (built, traced, compiled, memory), memory as flops.program_memory reads it.

  target, options: assemble's target and compile_built's compiler options.
  """
  jmesh = sharding.make_mesh(list(mesh.items()), devices)
  built = assemble(config, jmesh, res, target=target)
  traced, compiled = compile_built(built, options)
  return built, traced, compiled, flops_lib.program_memory(compiled)


def resolve_mesh(mesh: list, n_devices: int, what: str) -> dict:
  """[(axis, size)] with at most one -1 -> {axis: size} covering exactly n_devices."""
  pairs = [(str(axis), int(size)) for axis, size in mesh]
  known = math.prod(size for _, size in pairs if size != -1)
  if (
      sum(size == -1 for _, size in pairs) == 1
      and known
      and n_devices % known == 0
  ):
    pairs = [
        (axis, n_devices // known if size == -1 else size)
        for axis, size in pairs
    ]
  sizes = dict(pairs)
  if math.prod(sizes.values()) != n_devices or min(sizes.values()) < 1:
    text = ",".join(f"{axis}:{size}" for axis, size in pairs)
    raise ValueError(
        f"mesh {text} does not match {what} ({n_devices} devices): pass e.g. "
        f"--mesh=data:{n_devices} or --mesh=data:-1,fsdp:{min(n_devices, 8)}"
    )
  return sizes
