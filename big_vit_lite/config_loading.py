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
"""
import difflib
import math
import os
import re
import sys
import traceback

from absl import flags
from ml_collections import config_dict
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as config_flags_impl


def define_config_flag(name="config", help_string="Training configuration file (FILE.py[:arg]).",
                       flag_values=flags.FLAGS):
  """The --config flag; a key set to None in the file must be a `config_dict.placeholder(TYPE)`.

  ml_collections parses `--config.key=value` with the type of the value in
  the file, so a plain None cannot be overridden; a placeholder reads as None
  and carries the type. The value may also name a shipped config (`vit_l16`,
  `demo:runlocal`): see `resolve_config_path`.
  """
  holder = config_flags.DEFINE_config_file(name, None, help_string, flag_values=flag_values,
                                           lock_config=True)
  flag_values[name].parser = _ShippedConfigParser(name=name, lock_config=True)
  return holder


def shipped_configs_dir():
  """The configs that come with the package: big_vit_lite/configs (a wheel), else ./configs.

  The wheel maps the repository's top-level configs/ to big_vit_lite.configs; a checkout or
  an editable install reads configs/ beside the package.
  """
  here = os.path.dirname(os.path.abspath(__file__))
  for d in (os.path.join(here, "configs"), os.path.join(os.path.dirname(here), "configs")):
    if os.path.isfile(os.path.join(d, "demo.py")):
      return d
  return None


def shipped_config_names():
  d = shipped_configs_dir()
  files = os.listdir(d) if d else []
  return sorted(f[:-3] for f in files if f.endswith(".py") and not f.startswith("_"))


def resolve_config_path(value):
  """`--config` value -> a file path: a file that exists as given, else a shipped config.

  `vit_l16`, `vit_l16.py` and `configs/vit_l16.py` (the README's spelling, from any directory)
  name the shipped file; `:arg` is kept. A bare name that is not shipped is a one-line
  ValueError listing the shipped configs; other paths go on unchanged (and fail as a missing file).
  """
  path, colon, arg = value.partition(":")
  head, base = os.path.split(path)
  if not path or os.path.exists(path) or head not in ("", "configs"):
    return value
  name = base.removesuffix(".py")
  if name in shipped_config_names():
    return os.path.join(shipped_configs_dir(), name + ".py") + colon + arg
  if head:
    return value
  raise ValueError(f"'{path}' {_NOT_SHIPPED} (shipped: "
                   f"{', '.join(shipped_config_names()) or 'none found'}); give a path to a .py "
                   "file or one of those names.")


_NOT_SHIPPED = "is neither a config file nor a shipped config"


class _ShippedConfigParser(config_flags_impl.ConfigFileFlagParser):
  """ml_collections' config-file parser, reading shipped configs by name too."""

  def parse(self, path):
    return super().parse(resolve_config_path(path))


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
  lines = [l.strip() for l in str(error.__cause__ or error).splitlines() if l.strip()]
  return f"Cannot load the {flag} file: {lines[-1] if lines else error}"


def parse_flags(argv, prog="big_vit_lite", flag_values=flags.FLAGS):
  """absl flags parser (`app.run(main, flags_parser=parse_flags)`): one line for a bad override.

  `--config.no_such_key=1` makes ml_collections raise an AttributeError /
  KeyError with three chained tracebacks; a user needs the key's name.
  """
  try:
    parsed = flag_values(argv)
  except Exception as e:  # pylint: disable=broad-except
    message = _flag_error(e, argv, flag_values)
    if message is None:
      raise
    sys.exit(f"{prog}: error: {message}")
  for name in flag_values:  # A config file whose get_config() returned None.
    flag = flag_values[name]
    if (isinstance(flag.parser, config_flags_impl.ConfigFileFlagParser) and flag.present
        and flag.value is None):
      sys.exit(f"{prog}: error: --{name}: get_config() in {config_flags.get_config_filename(flag)} "
               "returned None (a missing return statement?).")
  return parsed


def _flag_error(e, argv, flag_values):
  """The one line for `e`, raised while parsing `argv`; None for an error to raise as it is."""
  if isinstance(e, flags.UnrecognizedFlagError):
    if "." not in e.flagname:
      return f"{e} (--helpfull lists the flags)"
    return _no_such_key(e.flagname, flag_values)
  if isinstance(e, flags.Error):  # What absl's default parser says: a bad value.
    if "Error whilst parsing config file" in str(e):  # get_config raised ValueError/TypeError.
      return _get_config_failed(e)
    unsupported = re.match(r"Type <class '([\w.]+)'> of field (\S+) is not supported", str(e))
    if unsupported:  # ml_collections lists its types; a user needs what to change.
      return _cannot_override(*unsupported.groups())
    # resolve_config_path's line already says what to give.
    return str(e) if _NOT_SHIPPED in str(e) else f"{e} (--helpfull lists the flags)"
  if isinstance(e, SyntaxError):  # Raised while the config file is imported.
    return (f"the config file {e.filename} does not parse: {e.msg} at line {e.lineno}: "
            f"{(e.text or '').strip()}")
  if isinstance(e, OSError):  # --config.KEY=V on a config file that cannot be loaded.
    return _load_error("--config", e)
  if _parse_frame(e) is not None:  # The file's own code failed (NameError, ImportError, ...).
    return _get_config_failed(e, _config_file_arg(argv, flag_values))
  if not isinstance(e, (AttributeError, KeyError)):
    return None
  # ml_collections registers each --config.KEY of sys.argv as a flag; a KEY
  # the file lacks fails when it is applied, with the key in the message.
  message = _innermost_message(e)
  found = re.findall(r"'(\w+)'", message)
  names = [a[2:].split("=", 1)[0] for a in argv[1:] if a.startswith("--") and "." in a]
  # The missing key may be a parent of the one set (--config.optax.b1 without `optax`).
  name = next((n for n in names if found and found[0] in n.split(".")[1:]), None)
  if name is None:
    return None
  close = re.search(r"[Dd]id you mean \"(\w+)\"", message)  # ml_collections' own guess.
  parts = name.split(".")
  missing = ".".join(parts[1:parts.index(found[0], 1) + 1])
  return _no_such_key(name, flag_values, close and close.group(1), missing)


def _cannot_override(type_name, field):
  """One line for --FIELD=V on a field whose type ml_collections cannot parse (None, list)."""
  if type_name == "NoneType":
    return (f"--{field}: the config file sets it to None, so its type is unknown: make it "
            "config_dict.placeholder(TYPE) there (e.g. placeholder(str)) to set it from the "
            "command line.")
  return (f"--{field}: a {type_name} cannot be set from the command line (a tuple can: "
          f"--{field}='(a, b)'): change it in the config file.")


def _parse_frame(error):
  """The frame of ml_collections' ConfigFileFlagParser.parse in `error`'s traceback, or None."""
  return next((f for f in traceback.extract_tb(error.__traceback__)
               if f.name == "parse" and f.filename == config_flags_impl.__file__), None)


def _config_file_arg(argv, flag_values):
  """What argv gives the (first) config-file flag, e.g. 'configs/demo.py:runlocal'."""
  for i, arg in enumerate(argv[1:], 1):
    name, eq, value = arg.lstrip("-").partition("=")
    if (arg.startswith("-") and name in flag_values
        and isinstance(flag_values[name].parser, config_flags_impl.ConfigFileFlagParser)):
      return value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
  return ""


def _get_config_failed(error, flag_value=""):
  """'the config file F failed: NameError: ... (line 3)' for an error raised by a config file.

  ml_collections passes a ValueError or TypeError on as the text of its
  traceback inside absl's error; anything else comes as it was raised.
  """
  if isinstance(error, flags.Error):
    text = str(error)
    what = [l.strip() for l in text.splitlines() if l.strip()][-1]
    frames = re.findall(r'File "([^"]+)", line (\d+)', text)
    flag_value = re.match(r"flag --\w+=(\S+?):? Error whilst", text)
    flag_value = flag_value.group(1) if flag_value else ""
  else:
    what = (f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    frames = [(f.filename, str(f.lineno)) for f in traceback.extract_tb(error.__traceback__)]
    frames = frames[[f[0] for f in frames].index(_parse_frame(error).filename):]
  # Below ml_collections' parser, outside the installed packages: the config file (or its imports).
  own = [f for f in frames if f[0] != config_flags_impl.__file__ and "site-packages" not in f[0]
         and not f[0].startswith("<")]
  name = flag_value or (own[0][0] if own else "")
  where = ""
  if own:
    same_file = os.path.abspath(own[-1][0]) == os.path.abspath(name.split(":", 1)[0])
    where = f" (line {own[-1][1]})" if same_file else f" ({own[-1][0]}, line {own[-1][1]})"
  if isinstance(error, AttributeError) and "get_config" in str(error):
    return f"the config file {name} has no get_config() function: define get_config(arg=None)."
  return f"the config file {name} failed: {what}{where}"


def _no_such_key(flag_name, flag_values, close=None, missing=None):
  """'--config.model.widht: the config file has no key 'model.widht' (did you mean 'width'?)...'

  `missing`: the part of the dotted path that is absent, if not all of it.
  """
  flag, *path = flag_name.split(".")
  if missing is not None:
    path = missing.split(".")
  if close is None:  # Unless ml_collections guessed, guess from the loaded config.
    node = flag_values[flag].value if flag in flag_values else None
    for part in path[:-1]:
      node = node.get(part) if isinstance(node, config_dict.ConfigDict) else None
    keys = list(node.keys()) if isinstance(node, config_dict.ConfigDict) else []
    close = (difflib.get_close_matches(path[-1], keys, n=1, cutoff=0.6) or [None])[0]
  hint = f" (did you mean '{close}'?)" if close else ""
  return (f"--{flag_name}: the config file has no key '{'.'.join(path)}'{hint}. Fix the "
          "spelling, or add the key to the config file (a key whose default is None as "
          "config_dict.placeholder(TYPE)).")


def _innermost_message(error):
  """ml_collections wraps its KeyError message in an AttributeError(KeyError(...))."""
  while isinstance(error, BaseException) and error.args:
    if isinstance(error.args[0], str):
      return error.args[0]
    error = error.args[0]
  return str(error)


class UnreadConfigKeyError(ValueError):
  pass


# Keys people bring from the codebases this one is measured against, and ours for them
# (vision_transformer: accum_steps, grad_norm_clip, base_lr, batch; timm flags: clip_grad,
# weight_decay, epochs, warmup_epochs; Hugging Face / MaxText: gradient_accumulation_steps).
PEER_KEYS = {
    "accum_steps": "grad_accum_steps", "gradient_accumulation_steps": "grad_accum_steps",
    "grad_accum": "grad_accum_steps", "grad_norm_clip": "grad_clip_norm",
    "clip_grad": "grad_clip_norm", "clip_grad_norm": "grad_clip_norm", "base_lr": "lr",
    "learning_rate": "lr", "weight_decay": "wd", "batch": "input.batch_size",
    "batch_size": "input.batch_size", "epochs": "total_epochs", "num_epochs": "total_epochs",
    "warmup_steps": "schedule.warmup_steps", "warmup_epochs": "schedule.warmup_epochs",
    "decay_type": "schedule.decay_type",
    # big_vision's older top-level names.
    "checkpoint_steps": "ckpt_steps", "keep_checkpoint_steps": "keep_ckpt_steps",
    "dataset": "input.data.name", "train_split": "input.data.split", "pp_train": "input.pp",
    "shuffle_buffer_size": "input.shuffle_buffer_size", "prefetch_to_device": "input.prefetch",
    "num_classes": "model.num_classes", "batch_size_eval": "evals.NAME.batch_size",
}

# big_vision keys with nothing to set here.
UNNEEDED_KEYS = {
    "pp_modules": "every preprocessing op is always registered",
    "sharding_strategy": ("a mesh with an 'fsdp' axis (config.mesh) and sharding_rules for "
                          "logical axes"),
}


class TrackedConfig:
  """Read-only view of a ConfigDict that records which keys were read.

  `cfg.key` / `cfg["key"]` / `cfg.get("key", default)` mark `key` read
  (sub-dicts are returned tracked, so only the leaves actually read count);
  `cfg.consume("key")` marks a whole subtree read and returns it untracked.
  """

  def __init__(self, cfg, _prefix="", _log=None, _asked=None):
    # (__setattr__ refuses.) _asked: every key the code asked for, present or not: the
    # candidates for "did you mean".
    self.__dict__.update(_cfg=cfg, _prefix=_prefix, _log=set() if _log is None else _log,
                         _asked=set() if _asked is None else _asked)

  # -- reading
  def _wrap(self, name, value):
    path = self._prefix + name
    if isinstance(value, config_dict.ConfigDict):  # Not read as a whole: its leaves count.
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
          f"Config key '{self._prefix}{name}' is missing: add it to the config file.") from None

  def __getitem__(self, name):
    self._asked.add(self._prefix + name)
    return self._wrap(name, self._cfg[name])

  def __setattr__(self, name, value):
    raise TypeError("TrackedConfig is read-only; change the config file or pass "
                    "--config.KEY=VALUE.")

  def get(self, name, default=None):
    value = self[name] if name in self else None
    return default if value is None else value

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
    return cfg.to_dict() if isinstance(cfg, config_dict.ConfigDict) else dict(cfg)

  @property
  def raw(self):
    return self._cfg

  # -- checking
  def unread_keys(self):
    return [p for p in _leaf_paths(self._cfg, self._prefix) if not self._is_read(p)]

  def _is_read(self, path):
    if path in self._log or "*" in self._log:
      return True
    parts = path.split(".")
    return any(".".join(parts[:i]) + ".*" in self._log for i in range(1, len(parts) + 1))

  def check_all_read(self):
    if unread := self.unread_keys():
      more = f" (and {len(unread) - 1} more: {', '.join(unread[1:4])})" if len(unread) > 1 else ""
      raise UnreadConfigKeyError(f"Config key '{unread[0]}' is set but nothing reads "
                                 f"it{self.hint(unread[0])}{more}: remove it or fix its spelling.")

  def hint(self, path):
    """" (this framework calls it 'X')" for a peer's name, " (did you mean 'X'?)" for a near miss.

    (Or " (not needed here: WHY)" for a big_vision key with nothing to set.)
    """
    if path in PEER_KEYS:
      return f" (this framework calls it '{PEER_KEYS[path]}')"
    if path in UNNEEDED_KEYS:
      return f" (not needed here: {UNNEEDED_KEYS[path]})"
    close = difflib.get_close_matches(path, sorted(self._asked - {path}), n=1, cutoff=0.8)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _leaf_paths(cfg, prefix=""):
  for k, v in cfg.items():
    if isinstance(v, config_dict.ConfigDict):  # (An empty dict says nothing.)
      yield from _leaf_paths(v, f"{prefix}{k}.")
    else:
      yield prefix + k


_UNITS = ("steps", "epochs", "examples", "percent")


def get_steps(name, cfg, *, steps_per_epoch=None, batch_size=None, total_steps=None,
              default=None, required=False):
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
    raise ValueError(f"Set only one of {keys}: they are different ways to give the same duration.")
  if not given:
    if required:
      raise ValueError(f"Set one of {name}_steps or {name}_epochs in the config.")
    return default
  (unit, value), = given.items()
  if unit == "steps":
    return int(value)
  per, what = dict(epochs=(steps_per_epoch, "the dataset size"),
                   examples=(batch_size, "the batch size"),
                   percent=(total_steps, "the total step count"))[unit]
  if not per:
    raise ValueError(f"{name}_{unit} needs {what}; give {name}_steps instead.")
  if unit == "epochs":
    return int(math.ceil(value * per))
  return int(math.ceil(value / per)) if unit == "examples" else int(round(value / 100 * per))
