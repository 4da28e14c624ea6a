"""Config plumbing: the --config flag, unread-key detection, durations.

CLIs define the config flag with `define_config_flag()` (an ml_collections
config file, `FILE.py[:arg]`, locked, overridable with `--config.key=value`).

Config keys nothing reads are errors, not silent no-ops (a typo such as
`config.schedule.warmup_step` would otherwise train with the default). The
trainer wraps its config in `TrackedConfig`, reads every key it uses through
it, hands sub-dicts that another component consumes whole (model kwargs,
evaluator kwargs) over with `.consume()`, and finally calls
`check_all_read()`, which raises one line naming the first unread key.

Durations (total, warmup, cooldown, ...) can be given in steps, epochs,
examples or percent of the total, as `NAME_steps`, `NAME_epochs`,
`NAME_examples`, `NAME_percent`; `get_steps` turns them into steps.

Config files: `get_config(arg)` gets what follows the colon of
`--config=FILE.py:ARG` and reads it with `parse_arg` (`a=1,b`: one parser and
one error message for every config). A config file imports the configs beside
it as plain modules (`import vit_l16` in configs/vit_b16.py): while a config
file runs, the loader (the --config flag, `config_module`) puts its directory
first on sys.path, so configs/ needs no package and works the same from a
checkout and from the wheel (big_vit_lite/configs). Config files do no file
I/O of their own: what they read off disk comes from the library (e.g.
big_vit_lite/trainer/transfer.py for the checkpoint a fine-tuning config starts from).
"""

import contextlib
import difflib
import importlib.util
import math
import os
import re
import sys
import traceback

from absl import flags
from ml_collections import config_dict
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as config_flags_impl


def define_config_flag(
    name="config",
    help_string="Training configuration file (FILE.py[:arg]).",
    flag_values=flags.FLAGS,
):
  """The --config flag; a key set to None in the file must be a `config_dict.placeholder(TYPE)`.

  ml_collections parses `--config.key=value` with the type of the value in
  the file, so a plain None cannot be overridden; a placeholder reads as None
  and carries the type. The value may also name a shipped config (`vit_l16`,
  `demo:runlocal`): see `resolve_config_path`.
  """
  holder = config_flags.DEFINE_config_file(
      name, None, help_string, flag_values=flag_values, lock_config=True
  )
  flag_values[name].parser = _ShippedConfigParser(name=name, lock_config=True)
  return holder


def shipped_configs_dir():
  """The configs that come with the package: big_vit_lite/configs (a wheel), else ./configs.

  The wheel maps the repository's top-level configs/ to big_vit_lite.configs; a checkout or
  an editable install reads configs/ beside the package.
  """
  config_dir = os.path.dirname(os.path.abspath(__file__))
  here = os.path.dirname(config_dir)  # the package, big_vit_lite/
  for d in (
      os.path.join(here, "configs"),
      os.path.join(os.path.dirname(here), "configs"),
  ):
    if os.path.isfile(os.path.join(d, "demo.py")):
      return d
  return None


def shipped_config_names():
  d = shipped_configs_dir()
  files = []
  if d:
    files = os.listdir(d)
  return sorted(
      f[:-3] for f in files if f.endswith(".py") and not f.startswith("_")
  )


def did_you_mean(near):
  """ " (did you mean 'X'?)" for the first of `near`, a list of near names; "" if none."""
  if not near:
    return ""
  return f" (did you mean '{near[0]}'?)"


def resolve_config_path(value):
  """`--config` value -> a file path: a file that exists as given, else a shipped config.

  `vit_l16`, `vit_l16.py` and `configs/vit_l16.py` (the README's spelling, from any directory)
  name the shipped file; `:arg` is kept. A missing file is a one-line ValueError with the
  nearest name ("did you mean 'configs/demo.py'?": among the shipped configs, or the .py
  files of its folder) and the shipped configs; a missing path with no near name goes on
  (and fails as a missing file), except a bare name, which lists the shipped configs.
  """
  path, colon, arg = value.partition(":")
  head, base = os.path.split(path)
  if not path or os.path.exists(path):
    return value
  name = base.removesuffix(".py")
  if head in ("", "configs") and name in shipped_config_names():
    return os.path.join(shipped_configs_dir(), name + ".py") + colon + arg
  if head in ("", "configs"):
    near = difflib.get_close_matches(name, shipped_config_names(), n=1)
    if head:
      near = [os.path.join(head, n + ".py") for n in near]
  elif os.path.isdir(head):
    # A mistyped file name in an existing folder: its .py files.
    files = [f for f in os.listdir(head) if f.endswith(".py")]
    near = [
        os.path.join(head, f)
        for f in difflib.get_close_matches(base, files, n=1)
    ]
  else:
    near = []
  if head and not near:
    return value  # The loader says which file is missing.
  raise ValueError(
      f"'{path}' {_NOT_SHIPPED}{did_you_mean(near)}; shipped: "
      f"{', '.join(shipped_config_names()) or 'none found'}. Give a path to "
      "a .py file or one of those names."
  )


_NOT_SHIPPED = "is neither a config file nor a shipped config"


class _ConfigFileError(Exception):
  """A config file that fails to run, as one line (not a ValueError: absl would prefix it)."""


class _ShippedConfigParser(config_flags_impl.ConfigFileFlagParser):
  """ml_collections' config-file parser: reads shipped configs by name too, fails in one line."""

  def parse(self, path):
    path = resolve_config_path(path)
    file = path.split(":", 1)[0]
    try:
      with _siblings_importable(file):
        config = super().parse(path)
    except SyntaxError as e:
      raise _ConfigFileError(
          f"the config file {file} does not parse: {e.msg} at line "
          f"{e.lineno}: {(e.text or '').strip()}"
      ) from None
    except Exception as e:  # pylint: disable=broad-except
      # (Re-raised.)
      if "Error whilst parsing config file" in str(e):
        e = e.__context__
      if isinstance(e, AttributeError) and "get_config" in str(e):
        raise _ConfigFileError(
            f"the config file {file} has no get_config() function: define "
            "get_config(arg=None)."
        ) from None
      lines = [
          f.lineno
          for f in traceback.extract_tb(e.__traceback__)
          if os.path.abspath(f.filename) == os.path.abspath(file)
      ]
      where = ""
      if lines:
        where = f" (line {lines[-1]})"
      raise _ConfigFileError(
          f"the config file {path} failed: {type(e).__name__}: {e}" f"{where}"
      ) from None
    if config is None:
      raise _ConfigFileError(
          f"--{self.name}: get_config() in {file} returned None (a missing "
          "return statement?)."
      )
    # (For _no_such_key: the flag has no value yet when an override fails.)
    self.config = config
    return config


@contextlib.contextmanager
def _siblings_importable(file):
  """The directory of config file `file` first on sys.path while it runs."""
  directory = os.path.dirname(os.path.abspath(file))
  sys.path.insert(0, directory)
  try:
    yield
  finally:
    sys.path.remove(directory)


def config_module(path):
  """The config file at `path` as a module, loaded as the --config flag loads it.

  For tests and tools that call `get_config` themselves: the configs beside it
  are importable while it loads (see the module docstring).
  """
  name = "config_" + os.path.basename(path).removesuffix(".py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  with _siblings_importable(path):
    spec.loader.exec_module(module)
  return module


def parse_arg(arg, **defaults):
  """A config file's argument, "res=224,runlocal", -> a FrozenConfigDict over `defaults`.

  Items are comma-separated; a bare name means True. Each value takes the
  type of its default (bool, int, float, str: a default fixes the type, so
  none is None). An unknown name, or a value that is not of its type, is a
  one-line ValueError naming the known args.
  """
  values = dict(defaults)
  for item in (arg or "").split(","):
    item = item.strip()
    if not item:
      continue
    name, has_value, text = item.partition("=")
    if name not in defaults:
      raise ValueError(
          f"Unknown config arg '{name}': use one of {', '.join(defaults)}."
      )
    if not has_value:  # the bare name
      text = None
    values[name] = _arg_value(name, text, defaults[name])
  return config_dict.FrozenConfigDict(values)


def _arg_value(name, text, default):
  """`text` (None: the bare name) read as the type of `default`."""
  kind = type(default)
  if kind is bool:
    if text is None or text.lower() in ("true", "1"):
      return True
    if text.lower() in ("false", "0"):
      return False
  elif text is not None:
    try:
      return kind(text)
    except ValueError:
      pass
  given = "nothing" if text is None else repr(text)
  spelling = f"{name}=VALUE"
  if kind is bool:
    spelling = f"{name} or {name}=false"
  raise ValueError(
      f"Config arg '{name}' needs a value of type {kind.__name__} (default "
      f"{default!r}), not {given}: write {spelling}."
  )


def loaded(config, flag="--config"):
  """`config` if its file loaded; else a one-line ValueError saying why.

  ml_collections defers a file it cannot open (missing, unreadable) until the
  config is first used, then raises a multi-line IOError from deep inside.
  """
  if config is None or isinstance(config, config_dict.ConfigDict):
    return config
  try:
    config.keys()  # ml_collections' _ErrorConfig: raises the deferred error.
  except OSError as e:
    raise ValueError(_load_error(flag, e)) from None
  return config


def _load_error(flag, error):
  lines = [
      l.strip() for l in str(error.__cause__ or error).splitlines() if l.strip()
  ]
  reason = error
  if lines:
    reason = lines[-1]
  return f"Cannot load the {flag} file: {reason}"


def parse_flags(argv, prog="big_vit_lite", flag_values=flags.FLAGS):
  """absl flags parser (`app.run(main, flags_parser=parse_flags)`): one line for a bad override.

  `--config.no_such_key=1` makes ml_collections raise an AttributeError /
  KeyError with three chained tracebacks; a user needs the key's name.
  """
  if any(a in HELP_ARGS for a in argv[1:]):
    print(usage(prog, argv[0], flag_values))
    sys.exit(0)
  try:
    return flag_values(argv)
  except Exception as e:  # pylint: disable=broad-except
    message = _flag_error(e, argv, flag_values)
    if message is None:
      raise
    sys.exit(f"{prog}: error: {message}")


HELP_ARGS = ("--help", "-h", "-?", "--helpshort")


def usage(prog, main_file, flag_values=flags.FLAGS):
  """A user's help: what the command does (the first line of its docstring), its own flags,
  and how config keys are set."""
  main = sys.modules.get("__main__")
  doc = (getattr(main, "__doc__", None) or prog).strip().splitlines()[0]
  lines = [doc, "", f"usage: python -m {prog} [flags]", ""]
  # The command's own flags; --config is defined here, in this module.
  own = {f.name: f for f in flag_values.get_key_flags_for_module(main_file)}
  if "config" in flag_values:
    own["config"] = flag_values["config"]
  for flag in sorted(own.values(), key=lambda f: f.name):
    if flag.name.startswith("help"):
      continue
    default = ""
    if flag.default is not None:
      default = f" (default: {flag.default})"
    lines.append(f"  --{flag.name}: {flag.help}{default}")
  if "config" in flag_values:
    lines += [
        "",
        "  --config.KEY=VALUE sets any key of the config file, e.g. "
        "--config.total_steps=1000.",
    ]
  lines.append("  --helpfull lists every flag, those of the libraries too.")
  return "\n".join(lines)


def _flag_error(e, argv, flag_values):
  """The one line for `e`, raised while parsing `argv`; None for an error to raise as it is."""
  if isinstance(e, _ConfigFileError):
    return str(e)
  # --config.KEY=V on a config file that cannot be loaded.
  if isinstance(e, OSError):
    return _load_error("--config", e)
  # ml_collections registers each --config.KEY of sys.argv as a flag; a KEY the
  # file lacks fails when it is applied (AttributeError / KeyError) or is an
  # unknown flag.
  if isinstance(e, flags.UnrecognizedFlagError):
    names = [e.flagname]
  else:
    flag_args = [a for a in argv[1:] if a.startswith("-")]
    names = [a.lstrip("-").split("=", 1)[0] for a in flag_args]
  for name in names:
    if "." in name and (message := _no_such_key(name, flag_values)):
      return message
  if not isinstance(e, flags.Error):
    return None
  unsupported = re.match(
      r"Type <class '([\w.]+)'> of field (\S+) is not supported", str(e)
  )
  # ml_collections lists its types; a user needs what to change.
  if unsupported:
    return (
        f"--{unsupported.group(2)}: its type ({unsupported.group(1)}) "
        "cannot be set from the command line: make it a "
        "config_dict.placeholder(TYPE) (a list: a tuple) in the file."
    )
  # resolve_config_path's line already says what to give.
  if _NOT_SHIPPED in str(e):
    return str(e)
  return f"{e} (--helpfull lists the flags)"


def _no_such_key(flag_name, flag_values):
  """'--config.model.widht: the config file has no key 'model.widht' (did you mean 'width'?)...'

  None if the file has every key of the dotted path.
  """
  flag, *path = flag_name.split(".")
  node = None
  if flag in flag_values:
    node = getattr(flag_values[flag].parser, "config", None)
  for i, part in enumerate(path):
    if not isinstance(node, config_dict.ConfigDict):
      return None
    if part not in node:
      close = difflib.get_close_matches(
          part, list(node.keys()), n=1, cutoff=0.8
      )
      return (
          f"--{flag_name}: the config file has no key "
          f"'{'.'.join(path[:i + 1])}'{did_you_mean(close)}. Fix the spelling, or add the "
          "key to the config file (a key whose default is None as "
          "config_dict.placeholder(TYPE))."
      )
    node = node[part]
  return None


class UnreadConfigKeyError(ValueError):
  pass


class TrackedConfig:
  """Read-only view of a ConfigDict that records which keys were read.

  `cfg.key` / `cfg["key"]` / `cfg.get("key", default)` mark `key` read
  (sub-dicts are returned tracked, so only the leaves actually read count);
  `cfg.consume("key")` marks a whole subtree read and returns it untracked.
  """

  def __init__(self, cfg, _prefix="", _log=None, _asked=None):
    # (__setattr__ refuses.) _asked: every key the code asked for, present or
    # not: the candidates for "did you mean".
    if _log is None:
      _log = set()
    if _asked is None:
      _asked = set()
    self.__dict__.update(_cfg=cfg, _prefix=_prefix, _log=_log, _asked=_asked)

  # -- reading
  def _wrap(self, name, value):
    path = self._prefix + name
    # Not read as a whole: its leaves count.
    if isinstance(value, config_dict.ConfigDict):
      return TrackedConfig(value, path + ".", self._log, self._asked)
    self._log.add(path)
    return value

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    try:
      return self[name]
    except KeyError:
      raise AttributeError(
          f"Config key '{self._prefix}{name}' is missing: add it to the "
          "config file."
      ) from None

  def __getitem__(self, name):
    self._asked.add(self._prefix + name)
    return self._wrap(name, self._cfg[name])

  def __setattr__(self, name, value):
    raise TypeError(
        "TrackedConfig is read-only; change the config file or pass "
        "--config.KEY=VALUE."
    )

  def get(self, name, default=None):
    if name not in self or self[name] is None:
      return default
    return self[name]

  def __contains__(self, name):
    self._asked.add(self._prefix + name)
    return name in self._cfg

  def keys(self):
    return list(self._cfg.keys())

  def items(self):
    return [(k, self[k]) for k in self.keys()]

  def consume(self, name=None, default=None):
    """Marks `name` (or this whole dict) and everything under it read; returns it as is."""
    if name is None:
      self._log.add(self._prefix + "*")
      return self._cfg
    if name not in self:
      return default
    self._log.update((self._prefix + name, self._prefix + name + ".*"))
    value = self._cfg[name]
    return default if value is None else value

  def to_dict(self):
    """A plain dict of this subtree, all of it marked read."""
    cfg = self.consume()
    if isinstance(cfg, config_dict.ConfigDict):
      return cfg.to_dict()
    return dict(cfg)

  @property
  def raw(self):
    return self._cfg

  # -- checking
  def unread_keys(self):
    return [
        p for p in _leaf_paths(self._cfg, self._prefix) if not self._is_read(p)
    ]

  def _is_read(self, path):
    if path in self._log or "*" in self._log:
      return True
    parts = path.split(".")
    return any(
        ".".join(parts[:i]) + ".*" in self._log
        for i in range(1, len(parts) + 1)
    )

  def check_all_read(self):
    if unread := self.unread_keys():
      more = ""
      if len(unread) > 1:
        more = f" (and {len(unread) - 1} more: {', '.join(unread[1:4])})"
      raise UnreadConfigKeyError(
          f"Config key '{unread[0]}' is set but nothing reads "
          f"it{self.hint(unread[0])}{more}: remove it or fix its spelling."
      )

  def hint(self, path):
    """ " (did you mean 'X'?)" for a near miss of a key the code asked for."""
    close = difflib.get_close_matches(
        path, sorted(self._asked - {path}), n=1, cutoff=0.8
    )
    return did_you_mean(close)


def _leaf_paths(cfg, prefix=""):
  for k, v in cfg.items():
    if isinstance(v, config_dict.ConfigDict):  # (An empty dict says nothing.)
      yield from _leaf_paths(v, f"{prefix}{k}.")
    else:
      yield prefix + k


_UNITS = ("steps", "epochs", "examples", "percent")


def get_steps(
    name,
    cfg,
    *,
    steps_per_epoch=None,
    batch_size=None,
    total_steps=None,
    default=None,
    required=False,
):
  """`NAME_steps|_epochs|_examples|_percent` in `cfg` -> a number of steps.

  For `name == "total"`, `total_steps` wins over the others (so that
  `--config.total_steps=N` shortens an epoch-based config); otherwise at most
  one may be set. Every candidate key is read (marked used).
  """
  values = {u: cfg.get(f"{name}_{u}") for u in _UNITS}
  given = {u: v for u, v in values.items() if v is not None}
  if name == "total" and "steps" in given:
    given = {"steps": given["steps"]}
  if len(given) > 1:
    keys = ", ".join(f"{name}_{u}" for u in given)
    raise ValueError(
        f"Set only one of {keys}: they are different ways to give the same "
        "duration."
    )
  if not given:
    if required:
      raise ValueError(
          f"Set one of {name}_steps or {name}_epochs in the config."
      )
    return default
  ((unit, value),) = given.items()
  if unit == "steps":
    return int(value)
  per, what = dict(
      epochs=(steps_per_epoch, "the dataset size"),
      examples=(batch_size, "the batch size"),
      percent=(total_steps, "the total step count"),
  )[unit]
  if not per:
    raise ValueError(f"{name}_{unit} needs {what}; give {name}_steps instead.")
  if unit == "epochs":
    return int(math.ceil(value * per))
  if unit == "examples":
    return int(math.ceil(value / per))
  return int(round(value / 100 * per))
