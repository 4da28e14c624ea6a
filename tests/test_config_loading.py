"""config_loading: the --config file and its --config.KEY overrides, config keys read or not."""

import os
import sys

from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite import config_loading
from big_vit_lite import optim
from big_vit_lite.models import vit
from trainer_runs import ROOT, TINY

import checks

_cfg = checks.tracked_config


def _parse(*args):
  """The TrackedConfig of `prog *args` (sys.argv is restored by _keep_argv)."""
  # ml_collections reads the --config.KEY overrides from sys.argv.
  sys.argv = ["prog", *args]
  # Else ml_collections runs the file in the last one's.
  sys.modules.pop("config_config", None)
  fv = flags.FlagValues()
  config_loading.define_config_flag(flag_values=fv)
  config_loading.parse_flags(["prog", *args], prog="prog", flag_values=fv)
  return config_loading.TrackedConfig(fv.config)


@pytest.fixture(autouse=True)
def _keep_argv(monkeypatch):
  monkeypatch.setattr(sys, "argv", list(sys.argv))


def _one_line_exit(*args):
  with pytest.raises(SystemExit) as e:
    _parse(*args)
  msg = str(e.value.code)
  assert "\n" not in msg and msg.startswith("prog: error: "), msg
  return msg


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_override_under_a_dict_the_file_lacks_is_one_line():
  # Was a KeyError traceback: the tiny config has no `optax` dict.
  msg = _one_line_exit(f"--config={TINY}", "--config.optax.mu_dtype=bfloat16")
  assert msg.startswith(
      "prog: error: --config.optax.mu_dtype: the config file has no key "
      "'optax'."
  ), msg
  msg = _one_line_exit(f"--config={TINY}", "--config.modl.width=32")
  assert "no key 'modl' (did you mean 'model'?)" in msg, msg


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_override_of_a_none_or_list_key_says_what_to_change():
  # Tiny's model.variant is None, its mesh a list. Was ml_collections' "Type
  # <class 'NoneType'> of field config.model.variant is not supported for
  # overriding. Currently supported types are: dict_keys([<class 'float'>, ...".
  msg = _one_line_exit(f"--config={TINY}", "--config.model.variant=Ti/16")
  assert msg == (
      "prog: error: --config.model.variant: its type (NoneType) cannot be set from the "
      "command line: make it a config_dict.placeholder(TYPE) (a list: a tuple) in the "
      "file."
  ), msg
  msg = _one_line_exit(f"--config={TINY}", "--config.mesh=fsdp")
  assert msg.startswith(
      "prog: error: --config.mesh: its type (list) cannot be set"
  ), msg


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "body,expected",
    [
        # Were tracebacks (NameError, AttributeError, ModuleNotFoundError) ...
        (
            "def get_config(arg=None):\n  return undefined_name\n",
            "the config file {f} failed: NameError: name 'undefined_name' is not defined (line 2)",
        ),
        (
            "X = 1\n",
            "the config file {f} has no get_config() function: define get_config(arg=None).",
        ),
        (
            "import no_such_module_xyz\n",
            "the config file {f} failed: ModuleNotFoundError: No module named 'no_such_module_xyz' "
            "(line 1)",
        ),
        # ... a ValueError a traceback inside absl's message ...
        (
            "def get_config(arg=None):\n  raise ValueError(f'Unknown config arg {arg!r}')\n",
            "the config file {f}:bad failed: ValueError: Unknown config arg 'bad' (line 2)",
        ),
        # ... and None "--config is required".
        (
            "def get_config(arg=None):\n  pass\n",
            "--config: get_config() in {f} returned None (a missing return statement?).",
        ),
    ],
)
def test_config_file_whose_code_fails_is_one_line(tmp_path, body, expected):
  path = tmp_path / "cfg.py"
  path.write_text(body)
  arg = f"{path}:bad" if ":bad" in expected else str(path)
  msg = _one_line_exit(f"--config={arg}")
  assert msg == "prog: error: " + expected.format(f=path), msg


@pytest.mark.parametrize("name", ["vit_l16", "vit_b16", "vit_s16_i1k"])
def test_vit_configs_validate_with_total_steps_1(name):
  """`--config=configs/NAME.py --config.total_steps=1`: parses, and its optimizer builds on the
  full-size model (shapes only) with a finite learning rate."""
  config = _parse(
      f"--config={ROOT}/configs/{name}.py", "--config.total_steps=1"
  )
  assert config_loading.get_steps("total", config, steps_per_epoch=1000.0) == 1
  model = vit.Model(**config.consume("model").to_dict())
  params = jax.eval_shape(
      model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3))
  )["params"]
  opt = optim.make(config, nn.meta.unbox(params), total_steps=1)
  assert np.isfinite(float(opt.lr_fn(0))) and float(opt.lr_fn(0)) >= 0


def test_demo_takes_an_epoch_count_from_the_command_line():
  """The demo set total_steps, which won over --config.total_epochs=E: E was ignored."""
  demo = os.path.join(ROOT, "configs", "demo.py")
  per_epoch = 60_000 / 64
  assert (
      config_loading.get_steps(
          "total",
          _parse(f"--config={demo}"),
          # Its 32 epochs.
          steps_per_epoch=per_epoch,
      )
      == 30_000
  )
  config = _parse(f"--config={demo}", "--config.total_epochs=2")
  assert (
      config_loading.get_steps("total", config, steps_per_epoch=per_epoch)
      == 1875
  )
  config = _parse(
      f"--config={demo}", "--config.total_epochs=2", "--config.total_steps=7"
  )
  assert (
      config_loading.get_steps("total", config, steps_per_epoch=per_epoch) == 7
  )
