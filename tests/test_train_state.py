"""The planner compiles the trainer's own step: the same program, state and shardings.

For every shipped training config (runlocal sizes), the step `train.py` compiles (its real
stages, up to the compile, with a stand-in for the data) and the step the planner
compiles for the same CPU devices (planner.assemble) must be one program: their optimized
HLO, metadata stripped, hashes equal, and the state trees and shardings are equal.
"""

import hashlib
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.runtime import sharding
from big_vit_lite import train
from big_vit_lite.trainer import train_setup
from big_vit_lite.trainer import train_state
from big_vit_lite.data import input_pipeline
from big_vit_lite.models import npz
from big_vit_lite.models import vit
from big_vit_lite.planner import assemble

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
# The stand-in dataset's size (both sides read it: the schedule's constants).
NUM_EXAMPLES = 1000
# A teacher and transfer init of configs/transfer.py's DEMO_MODEL shape
# (fashion_mnist: 28x28x1, 10 classes).
TEACHER = dict(
    variant=None,
    width=128,
    depth=4,
    mlp_dim=512,
    num_heads=2,
    patch_size=7,
    posemb="learn",
    pool_type="gap",
    num_classes=10,
)

# (config argument, image side, channels, classes): the batch the config's input.pp
# gives, written out here (the oracle for the planner's batch_spec). "+ema": the
# demo with what no shipped config sets (an EMA, mixup, microbatches).
CONFIGS = (
    ("demo.py:runlocal", 28, 1, 10),
    ("demo.py:runlocal+ema", 28, 1, 10),
    ("distill.py:runlocal,teacher={npz},feature", 28, 1, 10),
    ("multilabel.py:runlocal", 28, 1, 10),
    ("transfer.py:runlocal,init={npz}", 28, 1, 10),
    ("vit_b16.py:runlocal", 32, 3, 21841),
    ("vit_l16.py:runlocal", 32, 3, 21841),
    ("vit_s16_i1k.py:runlocal", 32, 3, 1000),
)


class _FakeTrainIterator:
  """What read_inputs and make_model take from the train iterator: its size and batch."""

  def __init__(self, batch_spec):
    self.num_examples = NUM_EXAMPLES
    self._spec = batch_spec

  def batch_spec(self):
    return self._spec


class _Compiled(Exception):
  """Stops the trainer once its step is compiled."""


# The tables of source files, functions and stack frames that metadata points into.
_SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def hlo_text(compiled) -> str:
  """The optimized HLO, metadata (source lines, op names, their tables) stripped."""
  text = re.sub(r",?\s*metadata=\{[^}]*\}", "", compiled.as_text())
  return "\n".join(
      line
      for line in text.splitlines()
      if line not in _SOURCE_TABLES and not re.match(r"\d+ ", line)
  )


def hlo_hash(compiled) -> str:
  return hashlib.sha256(hlo_text(compiled).encode()).hexdigest()


@pytest.fixture(scope="module")
def teacher_npz(tmp_path_factory):
  model = vit.Model(**TEACHER)
  params = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 28, 28, 1)))
  path = tmp_path_factory.mktemp("teacher") / "teacher.npz"
  npz.save_npz(jax.device_get(params["params"]), path)
  return str(path)


def _trainer_step(raw_config, workdir, spec, monkeypatch):
  """train.py's own stages up to the compiled step: (compiled, layout)."""
  found = {}

  def compile_and_stop(jitted, args):
    traced = jitted.trace(*args)
    found["compiled"] = traced.lower().compile()
    raise _Compiled()

  def lay_out_state(config, **kw):
    found["layout"] = layout_fn(config, **kw)
    return found["layout"]

  def no_evaluators(config, *args, **kw):
    del args, kw
    config.consume("evals", None)
    return {}

  layout_fn = train.lay_out_state
  with monkeypatch.context() as m:
    m.setattr(
        input_pipeline,
        "make_train_iterator",
        lambda *a, **k: _FakeTrainIterator(spec),
    )
    m.setattr(train_setup, "make_evaluators", no_evaluators)
    m.setattr(train, "lay_out_state", lay_out_state)
    m.setattr(train_state, "compile_step", compile_and_stop)
    with pytest.raises(_Compiled):
      train.train(raw_config, str(workdir))
  return found["compiled"], found["layout"]


def _planner_step(raw_config, res, monkeypatch):
  """The planner's assembly for the trainer's mesh on this host's devices."""
  with monkeypatch.context() as m:
    m.setattr(input_pipeline, "get_num_examples", lambda _: NUM_EXAMPLES)
    mesh = sharding.make_mesh(raw_config.get("mesh", None))
    built = assemble.assemble(raw_config, mesh, res)
    _, compiled = assemble.compile_built(built)
  return compiled, built.layout


@pytest.mark.parametrize("arg,res,channels,classes", CONFIGS)
def test_planner_compiles_the_trainers_step(
    arg, res, channels, classes, teacher_npz, tmp_path, monkeypatch
):
  """Guards against a planner that drifts from the trainer (a second assembly that lacks
  the EMA slot, the distillation teacher or its projection, another schedule or
  sharding): the planner's step must be the trainer's program, state and shardings.
  """
  name, _, config_arg = arg.format(npz=teacher_npz).partition(":")
  config_arg, _, extras = config_arg.partition("+")
  module = config_loading.config_module(str(CONFIG_DIR / name))
  raw_config = module.get_config(config_arg)
  if extras:
    raw_config.ema_decay = 0.99
    raw_config.mixup = dict(mixup_alpha=0.2)
    raw_config.grad_accum_steps = 2
  spec = dict(
      image=jax.ShapeDtypeStruct((8, res, res, channels), jnp.float32),
      labels=jax.ShapeDtypeStruct((8, classes), jnp.float32),
  )
  trainer_compiled, trainer_layout = _trainer_step(
      raw_config, tmp_path / "workdir", spec, monkeypatch
  )
  plan_compiled, plan_layout = _planner_step(raw_config, res, monkeypatch)
  assert jax.tree.structure(plan_layout.state_abstract) == jax.tree.structure(
      trainer_layout.state_abstract
  )
  assert jax.tree.leaves(plan_layout.state_abstract) == jax.tree.leaves(
      trainer_layout.state_abstract
  )
  assert plan_layout.state_sh == trainer_layout.state_sh
  assert hlo_hash(plan_compiled) == hlo_hash(trainer_compiled)
