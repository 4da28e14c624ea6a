"""Every shipped training config takes the same command-line knobs (config_knobs.vit_model,
config_knobs.trainer_knobs)."""

import dataclasses
import subprocess
import sys
from unittest import mock

from absl import flags
import pytest

from big_vit_lite.config import config_knobs
from big_vit_lite.config import config_loading
from big_vit_lite.logs import wandb_writer
from big_vit_lite.models import vit

import trainer_runs

# Every training config (the others, classify/fewshot/linear_probe, are evaluate's).
TRAINING_CONFIGS = (
    "demo:runlocal",
    "distill:runlocal",
    "multilabel:runlocal",
    "transfer:runlocal",
    "vit_b16:runlocal",
    "vit_l16:runlocal",
    "vit_s16_i1k:runlocal",
)
# (--config.KEY=TEXT, the value the config must then hold)
KNOBS = (
    ("wandb.project", "my-vits", "my-vits"),
    ("wandb.mode", "offline", "offline"),
    ("wandb.tags", "('a', 'b')", ("a", "b")),
    ("ema_decay", "0.999", 0.999),
    ("profile_steps", "(3, 4)", (3, 4)),
    ("grad_accum_steps", "2", 2),
    ("model.dtype_mm", "bfloat16", "bfloat16"),
    ("model.dtype_act", "bfloat16", "bfloat16"),
    ("model.scan", "true", True),
    ("model.remat_policy", "nothing_saveable", "nothing_saveable"),
    ("model.attention", "xla", "xla"),
    ("model.dropout", "0.1", 0.1),
    ("model.drop_path", "0.1", 0.1),
    ("model.gelu", "tanh", "tanh"),
    ("model.reg_tokens", "4", 4),
    ("model.qk_norm", "true", True),
    ("model.layerscale_init", "1e-5", 1e-5),
    ("model.mlp", "swiglu", "swiglu"),
    ("model.norm", "rmsnorm", "rmsnorm"),
    ("model.parallel_block", "true", True),
    ("model.use_bias", "false", False),
    ("model.distill_token", "true", True),
)


def _parse_cli(config_arg, *overrides):
  flag_values = flags.FlagValues()
  config_loading.define_config_flag(flag_values=flag_values)
  argv = ["prog", f"--config=configs/{config_arg.replace(':', '.py:', 1)}"]
  argv += list(overrides)
  with mock.patch.object(sys, "argv", argv):  # config_flags reads sys.argv.
    flag_values(argv)
  return flag_values.config


def _get(cfg, path):
  for part in path.split("."):
    cfg = cfg[part]
  return cfg


@pytest.mark.parametrize("config_arg", TRAINING_CONFIGS)
def test_every_knob_is_settable_on_every_training_config(config_arg):
  """Guards against a config lacking a knob ("the config file has no key" for
  --config.wandb.project on the demo, --config.ema_decay on transfer) or holding one in a
  form the command line cannot set (a plain None)."""
  overrides = [f"--config.{key}={text}" for key, text, _ in KNOBS]
  cfg = _parse_cli(config_arg, *overrides)
  for key, _, want in KNOBS:
    assert _get(cfg, key) == want, (config_arg, key)


def test_model_knobs_sit_at_the_models_own_defaults():
  """Guards against a shared knob default that differs from vit.Model's (the configs that
  gained a knob would then train other bits), against a model field with no knob.
  """
  fields = {f.name: f.default for f in dataclasses.fields(vit.Model)}
  knobs = config_knobs.vit_model()
  for key, value in knobs.items():
    assert fields[key] == value, key
  architecture = {
      "num_classes",
      "variant",
      "width",
      "depth",
      "mlp_dim",
      "num_heads",
      "patch_size",
      "posemb",
      "pool_type",
      "rep_size",
      "head_zeroinit",
      "stem_channels",
      "parent",
      "name",
  }
  assert set(fields) - architecture == set(knobs)


def test_unset_wandb_keys_are_no_wandb():
  """Guards against the unset wandb keys every config has starting (or requiring) W&B."""
  unset = config_knobs.trainer_knobs()["wandb"]
  cfg = _parse_cli("demo:runlocal")
  assert wandb_writer.configured(cfg.wandb) is None
  wandb_writer.check(cfg.wandb)  # No project needed, no wandb installed.
  assert set(unset) == set(wandb_writer.KEYS)
  cfg = _parse_cli("demo:runlocal", "--config.wandb.project=p")
  assert wandb_writer.configured(cfg.wandb) == {"project": "p"}


@pytest.mark.slow
def test_knobs_set_on_the_demo_are_read_by_the_trainer(tfds_data_dir, tmp_path):
  """Guards against a knob the trainer accepts but does not read (an unread key is an
  error before the compile), with every model knob off its default at once."""
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "big_vit_lite.train",
          "--config=configs/demo.py:runlocal",
          "--check",
          "--config.ema_decay=0.99",
          "--config.grad_accum_steps=2",
          "--config.profile_steps=(3,)",
          "--config.model.scan=True",
          "--config.model.remat_policy=nothing_saveable",
          "--config.model.dropout=0.1",
          "--config.model.drop_path=0.1",
          "--config.model.gelu=tanh",
          "--config.model.reg_tokens=1",
          "--config.model.qk_norm=True",
          "--config.model.layerscale_init=1e-5",
          "--config.model.mlp=swiglu",
          "--config.model.norm=rmsnorm",
          "--config.model.use_bias=False",
      ],
      env=trainer_runs.env_for(tfds_data_dir),
      cwd=trainer_runs.ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().splitlines()[-1].startswith("ok: ")
