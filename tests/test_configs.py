"""Every config: documented, defines the required keys, and its `runlocal` variant trains.

The ImageNet configs run on `tfds.testing.mock_data` (random examples for the
real builders), the demo on the offline Fashion-MNIST. In-process, tiny.
"""

import contextlib
import math
import os
import sys
import threading
from unittest import mock

from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.testing import test_utils as tfds_test_utils

from big_vit_lite.config import config_loading
from big_vit_lite.trainer import optim
from big_vit_lite.logs import metrics
from big_vit_lite import train

import forkserver
import trainer_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("demo", "vit_l16", "vit_b16", "vit_s16_i1k", "multilabel")


def _load(name):
  return config_loading.config_module(
      os.path.join(ROOT, "configs", f"{name}.py")
  )


@pytest.mark.parametrize("name", CONFIGS)
def test_config_documents_its_command_and_defines_required_keys(name):
  module = _load(name)
  doc = module.__doc__ or ""
  assert f"python -m big_vit_lite.train --config=configs/{name}.py" in doc
  assert "xpected" in doc  # The result it should reach.
  for arg in (None, "runlocal"):
    config = module.get_config(arg)
    for key in ("total_steps", "ckpt_steps", "log_training_steps"):
      assert key in config, key
  with pytest.raises(ValueError, match="Unknown config arg"):
    module.get_config("no_such_arg")


@pytest.mark.parametrize("name", config_loading.shipped_config_names())
def test_every_config_names_its_args_when_given_an_unknown_one(name):
  """One parser (config_loading.parse_arg) for all: one message, the known args listed."""
  with pytest.raises(ValueError) as e:
    _load(name).get_config("runlocal,no_such_arg=1")
  message = str(e.value)
  assert message.startswith("Unknown config arg 'no_such_arg': use one of ")
  # Every config takes runlocal; the list is the config's own.
  known = message.removeprefix("Unknown config arg 'no_such_arg': use one of ")
  assert "runlocal" in known.rstrip(".").split(", "), message


@pytest.mark.parametrize("name", ["vit_l16", "vit_b16", "vit_s16_i1k"])
def test_total_steps_override_wins_over_epochs(name):
  config = _load(name).get_config()
  assert config.total_steps is None and config.total_epochs
  config.total_steps = 7
  tracked = config_loading.TrackedConfig(config)
  assert config_loading.get_steps("total", tracked, steps_per_epoch=1000.0) == 7
  config.total_steps = None
  assert config_loading.get_steps(
      "total", config_loading.TrackedConfig(config), steps_per_epoch=1000.0
  ) == math.ceil(config.total_epochs * 1000)


def _run_runlocal(config, workdir):
  train.train(config, str(workdir))
  return _trained_rows(config, workdir)


def _trained_rows(config, workdir):
  """The metrics rows of a finished run of `config`: finite losses up to its last step."""
  rows = metrics.read_metrics(str(workdir))
  losses = [r["training_loss"] for r in rows if "training_loss" in r]
  assert losses and all(math.isfinite(l) for l in losses)
  assert rows[-1]["step"] == config.total_steps
  return rows


@contextlib.contextmanager
def _mock_data_confined_to_this_thread(**kwargs):
  """`tfds.testing.mock_data` whose file-system redirect only affects the thread using tfds.

  Under mock_data every `builder.as_dataset` runs inside tfds' `MockFs`, which
  patches epath and tf.io.gfile process-wide so that every absolute path
  points into a throwaway temporary directory. Orbax's async save writes from
  a background thread; when an evaluator builds its dataset while a save is
  in flight, the save's files land in that directory and vanish ("No
  ArrayMetadata found"). Real data never uses MockFs. Here the redirect
  applies only to the thread that entered MockFs (the one calling tfds).
  """
  original = tfds_test_utils.mock_gfile

  def confined_mock_gfile(**fns):
    owner = threading.get_ident()

    def confine(fn):
      def maybe_redirect(original_fn, *args, **kw):
        if threading.get_ident() == owner:
          return fn(original_fn, *args, **kw)
        return original_fn(*args, **kw)

      return maybe_redirect

    return original(**{name: confine(fn) for name, fn in fns.items()})

  with mock.patch.object(
      tfds_test_utils, "mock_gfile", confined_mock_gfile
  ), tfds.testing.mock_data(**kwargs):
    yield


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["vit_l16", "vit_b16", "vit_s16_i1k"])
def test_imagenet_configs_runlocal_train_on_mock_data(name, tmp_path):
  config = _load(name).get_config("runlocal")
  assert config.get("ckpt_async", True)  # Async saves, as in real runs.
  with _mock_data_confined_to_this_thread(num_examples=16):
    rows = _run_runlocal(config, tmp_path)
  eval_keys = {
      k for r in rows for k in r if "/" in k and not k.startswith("img/")
  }
  for eval_name in config.evals:
    assert any(k.startswith(f"{eval_name}/") for k in eval_keys), (
        eval_name,
        eval_keys,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_runlocal_trains_on_offline_data(tfds_data_dir):
  """The suite's shared run of demo:runlocal (trainer_runs.demo_runlocal)."""
  workdir, _ = trainer_runs.demo_runlocal(tfds_data_dir)
  rows = _trained_rows(_load("demo").get_config("runlocal"), workdir)
  keys = {k for r in rows for k in r}
  assert "val/prec@1" in keys and any(k.startswith("fewshot/") for k in keys)
  # Each few-shot metric beside its raw-pixel baseline (pixel_baseline=True).
  assert {"fewshot/mnist10k_1shot", "fewshot/mnist10k_1shot_pixels"} <= keys
  assert os.path.exists(os.path.join(workdir, "config.json"))


# --------------------------------------------------------------------------
# Command-line overrides of keys that are None in the file.
# ml_collections parses `--config.key=value` with the type of the value in the
# file; a plain None has no type and cannot be overridden (only a
# `config_dict.placeholder(TYPE)`, which reads as None, can). Every key that is
# None in any config (with or without its smoke arg) must take an override.

CLI_CONFIGS = CONFIGS + ("fewshot", "linear_probe")
# A command-line value per field type, and what the config must then hold.
CLI_VALUES = {
    int: ("7", 7),
    float: ("0.5", 0.5),
    str: ("some/dir", "some/dir"),
    bool: ("true", True),
    tuple: ("(('embed', 'fsdp'),)", (("embed", "fsdp"),)),
}


def _parse_cli(config_arg, *overrides):
  """The config that `--config=CONFIG_ARG --config.k=v ...` gives the trainer's flag."""
  flag_values = flags.FlagValues()
  config_loading.define_config_flag(flag_values=flag_values)
  argv = ["prog", f"--config={config_arg}", *overrides]
  # config_flags reads the overrides from sys.argv.
  with mock.patch.object(sys, "argv", argv):
    flag_values(argv)
  return flag_values.config


def _leaves(cfg, prefix=""):
  for k in cfg.keys():
    v = cfg[k]
    if isinstance(v, config_dict.ConfigDict):
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield prefix + k, v, cfg.get_type(k)


def _get(cfg, path):
  for part in path.split("."):
    cfg = cfg[part]
  return cfg


def _none_keys_not_overridable(config_arg):
  """Keys that are None in the config but reject (or mangle) `--config.KEY=VALUE`."""
  failures = []
  for key, value, field_type in _leaves(_parse_cli(config_arg)):
    if value is not None:
      continue
    if field_type not in CLI_VALUES:
      failures.append(f"{key} (type {field_type.__name__})")
      continue
    text, expected = CLI_VALUES[field_type]
    try:
      got = _get(_parse_cli(config_arg, f"--config.{key}={text}"), key)
    except flags.Error as e:
      failures.append(f"{key} ({e})")
      continue
    if got != expected:
      failures.append(f"{key} (got {got!r})")
  return failures


@pytest.mark.parametrize("arg", ["", ":runlocal"])
@pytest.mark.parametrize("name", CLI_CONFIGS)
def test_none_valued_keys_can_be_overridden_from_the_command_line(name, arg):
  failures = _none_keys_not_overridable(
      os.path.join(ROOT, "configs", f"{name}.py{arg}")
  )
  assert not failures, (
      f"configs/{name}.py{arg}: None-valued keys that --config.KEY=VALUE "
      f"cannot set (use config_dict.placeholder(TYPE)): {failures}"
  )


def test_the_override_check_catches_a_plain_none(tmp_path):
  path = tmp_path / "cfg.py"
  path.write_text(
      "from ml_collections import config_dict\n"
      "def get_config():\n"
      "  return config_dict.ConfigDict(dict(\n"
      "      plain=None, typed=config_dict.placeholder(int), sub=dict(d=None)))\n"
  )
  assert [f.split(" ")[0] for f in _none_keys_not_overridable(str(path))] == [
      "plain",
      "sub.d",
  ]


@pytest.mark.parametrize("name", ["vit_l16", "vit_b16", "vit_s16_i1k"])
def test_total_steps_from_the_command_line_on_epoch_configs(name):
  path = os.path.join(ROOT, "configs", f"{name}.py")
  assert _parse_cli(path).total_steps is None
  config = _parse_cli(
      path, "--config.total_steps=5", "--config.total_epochs=0.5"
  )
  assert (config.total_steps, config.total_epochs) == (5, 0.5)
  assert (
      config_loading.get_steps(
          "total", config_loading.TrackedConfig(config), steps_per_epoch=100.0
      )
      == 5
  )


# demo sets no mesh.
@pytest.mark.parametrize("name", [n for n in CLI_CONFIGS if n != "demo"])
def test_mesh_from_the_command_line(name):
  # The form docs/scale_out.md and the configs document; ml_collections only
  # parses it into a field that holds a tuple (a list field rejects overrides).
  config = _parse_cli(
      os.path.join(ROOT, "configs", f"{name}.py"),
      "--config.mesh=[('data', -1), ('fsdp', 2)]",
  )
  assert [tuple(a) for a in config.mesh] == [("data", -1), ("fsdp", 2)]


@pytest.mark.parametrize(
    "extra,hint",
    [
        (
            dict(schedule=dict(decay_type="cosine", warmup_step=5)),
            "(did you mean 'schedule.warmup_steps'?)",
        ),
        (dict(lr_mult=[("head/.*", 10.0)]), "(did you mean 'lr_mults'?)"),
        # no hint invented
        (dict(zzz_unrelated=1), ": remove it"),
    ],
)
def test_unread_key_error_names_what_was_meant(extra, hint):
  """The optimizer reads its keys through the tracked config; what it never read is named."""
  raw = ml_collections.ConfigDict(
      dict(lr=1e-3, wd=1e-4, schedule=dict(decay_type="cosine"))
  )
  for k, v in extra.items():
    if isinstance(v, dict):
      raw[k].update(v)
    else:
      raw[k] = v
  config = config_loading.TrackedConfig(raw)
  params = {"head": {"kernel": jax.ShapeDtypeStruct((2, 3), jnp.float32)}}
  optim.make(config, params, total_steps=10, steps_per_epoch=5.0, batch_size=4)
  with pytest.raises(config_loading.UnreadConfigKeyError) as e:
    config.check_all_read()
  message = str(e.value)
  assert "\n" not in message and "is set but nothing reads it" in message
  assert hint in message, message
  if hint == ": remove it":
    assert "did you mean" not in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "cli,extra",
    [
        ("big_vit_lite.plan", ["--mesh=data:8"]),
        ("big_vit_lite.evaluate", ["--workdir=UNUSED"]),
    ],
)
def test_other_clis_say_config_file_mistakes_in_one_line(cli, extra, tmp_path):
  import subprocess  # pylint: disable=g-import-not-at-top

  cfg = "configs/vit_l16.py" if cli.endswith("plan") else "configs/fewshot.py"
  extra = [a.replace("UNUSED", str(tmp_path / "out")) for a in extra]
  cases = [
      (
          [f"--config={tmp_path}/nope.py"],
          "Cannot load the --config file: [Errno 2]",
      ),
      (
          [f"--config={cfg}", "--config.model_int=x"],
          "--config.model_int: the config file " "has no key 'model_int'",
      ),
  ]
  for args, want in cases:
    p = subprocess.run(
        forkserver.command([sys.executable, "-m", cli, *args, *extra]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert want in p.stderr.strip().splitlines()[-1], p.stderr[-500:]
