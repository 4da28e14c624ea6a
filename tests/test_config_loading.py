"""config_loading: the --config file and its --config.KEY overrides, config keys read or not."""

import os
import sys

from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.trainer import optim
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


# --------------------------------------------------------------------------
# A config file's argument (FILE.py:ARG) and configs that import each other.


def test_parse_arg_gives_each_value_the_type_of_its_default():
  args = config_loading.parse_arg(
      " runlocal, res=64,lr=0.5,data=folder:/x/y,,mixup=false",
      res=28,
      lr=0.0,
      data="i21k",
      runlocal=False,
      mixup=True,
      scratch=False,
  )
  # Written out by hand: an int, a float, a str with a colon kept whole, bare
  # names True, "false" False, the defaults of the args not given.
  assert args.to_dict() == dict(
      res=64,
      lr=0.5,
      data="folder:/x/y",
      runlocal=True,
      mixup=False,
      scratch=False,
  )
  assert type(args.res) is int and type(args.lr) is float
  assert config_loading.parse_arg(None, res=28).res == 28
  with pytest.raises(AttributeError):  # Frozen: a config cannot change it.
    args.res = 1


@pytest.mark.parametrize(
    "arg,message",
    [
        ("sizes=3", "Unknown config arg 'sizes': use one of res, runlocal."),
        (
            "res=big",
            "Config arg 'res' needs a value of type int (default 28), not 'big'",
        ),
        (
            "res",
            "Config arg 'res' needs a value of type int (default 28), not nothing",
        ),
        ("runlocal=maybe", "write runlocal or runlocal=false."),
    ],
)
def test_parse_arg_refuses_what_it_cannot_read_in_one_line(arg, message):
  with pytest.raises(ValueError) as e:
    config_loading.parse_arg(arg, res=28, runlocal=False)
  assert message in str(e.value) and "\n" not in str(e.value)


def _sibling_configs(tmp_path):
  """A config directory whose child.py imports its sibling sibling_base_cfg.py."""
  (tmp_path / "sibling_base_cfg.py").write_text(
      "import ml_collections\n"
      "def make_config(width):\n"
      "  return ml_collections.ConfigDict(dict(width=width, depth=2))\n"
  )
  (tmp_path / "child.py").write_text(
      "from big_vit_lite.config import config_loading\n"
      "import sibling_base_cfg\n"
      "def get_config(arg=None):\n"
      "  args = config_loading.parse_arg(arg, width=8)\n"
      "  return sibling_base_cfg.make_config(args.width)\n"
  )
  return tmp_path / "child.py"


def test_a_config_imports_the_configs_beside_it(tmp_path, monkeypatch):
  child = _sibling_configs(tmp_path)
  monkeypatch.delitem(sys.modules, "sibling_base_cfg", raising=False)
  # Through the --config flag, from a directory that is not the config's.
  monkeypatch.chdir(os.path.dirname(ROOT))
  config = _parse(f"--config={child}:width=16")
  assert config.to_dict() == dict(width=16, depth=2)
  monkeypatch.delitem(sys.modules, "sibling_base_cfg")
  # As tests and tools load one.
  module = config_loading.config_module(str(child))
  assert module.get_config().to_dict() == dict(width=8, depth=2)
  # Only while it loads.
  assert str(tmp_path) not in sys.path


def test_vit_b16_is_vit_l16_at_size_b():
  """vit_b16.py builds on vit_l16.py (imported as a module): same args, same recipe."""
  configs = os.path.join(ROOT, "configs")
  l16 = config_loading.config_module(os.path.join(configs, "vit_l16.py"))
  b16 = config_loading.config_module(os.path.join(configs, "vit_b16.py"))
  for arg in ("", "data=i1k", "data=folder:/some/root,classes=5,runlocal"):
    expected = l16.get_config(f"variant=B/16,{arg}")
    # The paper's lr for B, its weight decay in the paper's convention.
    expected.lr = 1e-3
    expected.wd = 0.1 * 1e-3
    assert b16.get_config(arg).to_dict() == expected.to_dict(), arg
  with pytest.raises(ValueError, match="use one of data, classes, runlocal"):
    b16.get_config("variant=L/16")
