"""Registry and parser of the preprocessing language.

A pp string is ops separated by "|", each a Python-like call with literal
arguments: `decode|inception_crop(224)|onehot(1000, key="label")`. Every op
is a factory registered by name; calling it with the string's arguments
returns a function `example_dict -> example_dict` (tf ops, run inside
tf.data's map). New ops are one decorated function in any module imported
by `pp/__init__.py`.

Ops with `key="image"` also take big_vision's `inkey`/`outkey`: read one
key, write another (`value_range(outkey="prof")` leaves "image" as it
was); a `key` given overrides both, as in big_vision.
"""

import ast
import difflib
import inspect

_OPS = {}


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
    raise ValueError(
        f"pp op {op_text!r}: arguments must be literals "
        f"(numbers, strings, tuples, lists, None)"
    ) from None


def parse_op(op_text):
  """'name(1, k=2)' -> (name, args, kwargs)."""
  try:
    node = ast.parse(op_text.strip(), mode="eval").body
  except SyntaxError:
    raise ValueError(
        f"pp op {op_text!r} is not valid syntax; write it like "
        f"'name' or 'name(arg, key=value)'"
    ) from None
  if isinstance(node, ast.Name):
    return node.id, (), {}
  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
    args = tuple(_literal(a, op_text) for a in node.args)
    kwargs = {k.arg: _literal(k.value, op_text) for k in node.keywords}
    return node.func.id, args, kwargs
  raise ValueError(
      f"pp op {op_text!r} is not valid; write it like "
      f"'name' or 'name(arg, key=value)', and separate ops with '|'"
  )


def build_op(op_text):
  name, args, kwargs = parse_op(op_text)
  if name not in _OPS:
    near = difflib.get_close_matches(name, known_ops(), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ValueError(
        f"unknown pp op {name!r} in {op_text!r}; {hint}known ops: "
        f"{', '.join(known_ops())}"
    )
  factory = _OPS[name]
  sig = inspect.signature(factory)
  io = {}
  if "key" in sig.parameters and sig.parameters["key"].default == "image":
    io = {k: kwargs.pop(k, None) for k in ("inkey", "outkey")}
  try:
    bound = sig.bind(*args, **kwargs)
  except TypeError as e:
    raise ValueError(
        f"pp op {op_text!r}: bad arguments ({e}); signature is " f"{name}{sig}"
    ) from None
  inkey, outkey = io.get("inkey"), io.get("outkey")
  # (a `key` given overrides both)
  if (inkey or outkey) and "key" not in bound.arguments:
    kwargs["key"] = inkey = inkey or "image"
    outkey = outkey or "image"
  try:
    op = factory(*args, **kwargs)
  except (TypeError, ValueError) as e:
    raise ValueError(f"pp op {op_text!r}: {e}") from None
  if "key" in bound.arguments or inkey == outkey:
    return op

  # `op` reads and writes `inkey`: its result goes under `outkey` instead
  def in_out(data):
    out = op(data)
    return {**out, outkey: out[inkey], inkey: data[inkey]}

  return in_out
