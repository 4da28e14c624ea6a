"""Registry and parser of the preprocessing language.

A pp string is ops separated by "|", each a Python-like call with literal
arguments: `decode|inception_crop(224)|onehot(1000, key="label")`. Every op
is a factory registered by name; calling it with the string's arguments
returns a function `example_dict -> example_dict` (tf ops, run inside
tf.data's map). New ops are one decorated function in any module imported
by `pp/__init__.py`.
"""
import ast
import difflib
import inspect

_OPS = {}
# big_vision ops that have another name here.
_RENAMED = {"vgg_value_range": "standardize (ImageNet mean/std on 0..255 by default)",
            "random_flip_lr": "flip_lr", "resize_smaller": "resize_small"}


def register(name):
  """Decorator: registers an op factory under `name`."""
  def wrap(factory):
    if name in _OPS:
      raise ValueError(f"pp op {name!r} is registered twice")
    _OPS[name] = factory
    return factory
  return wrap


def known_ops():
  return sorted(_OPS)


def _literal(node, op_text):
  try:
    return ast.literal_eval(node)
  except ValueError:
    raise ValueError(f"pp op {op_text!r}: arguments must be literals "
                     f"(numbers, strings, tuples, lists, None)") from None


def parse_op(op_text):
  """'name(1, k=2)' -> (name, args, kwargs)."""
  try:
    node = ast.parse(op_text.strip(), mode="eval").body
  except SyntaxError:
    raise ValueError(f"pp op {op_text!r} is not valid syntax; write it like "
                     f"'name' or 'name(arg, key=value)'") from None
  if isinstance(node, ast.Name):
    return node.id, (), {}
  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
    args = tuple(_literal(a, op_text) for a in node.args)
    kwargs = {k.arg: _literal(k.value, op_text) for k in node.keywords}
    if None in kwargs:
      raise ValueError(f"pp op {op_text!r}: **kwargs are not supported")
    return node.func.id, args, kwargs
  raise ValueError(f"pp op {op_text!r} is not valid; write it like "
                   f"'name' or 'name(arg, key=value)', and separate ops with '|'")


def build_op(op_text):
  name, args, kwargs = parse_op(op_text)
  if name not in _OPS:
    near = ([_RENAMED[name]] if name in _RENAMED else
            [repr(n) for n in difflib.get_close_matches(name, known_ops(), n=1, cutoff=0.6)])
    hint = f"did you mean {near[0]}? " if near else ""
    raise ValueError(f"unknown pp op {name!r} in {op_text!r}; {hint}known ops: "
                     f"{', '.join(known_ops())}")
  factory = _OPS[name]
  try:
    inspect.signature(factory).bind(*args, **kwargs)
  except TypeError as e:
    raise ValueError(f"pp op {op_text!r}: bad arguments ({e}); signature is "
                     f"{name}{inspect.signature(factory)}") from None
  try:
    return factory(*args, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"pp op {op_text!r}: {e}") from None
