"""Registry and parser of the preprocessing language.

A pp string is ops separated by "|", each a Python-like call with literal
arguments: `decode|inception_crop(224)|onehot(1000, key="label")`. Every op
is a factory registered by name; calling it with the string's arguments
returns a function `example_dict -> example_dict` (tf ops, run inside
tf.data's map). New ops are one decorated function in any module imported
by `pp/__init__.py`, in one of two shapes:

- `@register_image_op("name")`: the factory returns `image -> image` (or
  `(image, seed) -> image` for a random op); the decorator gives the op
  `key` and big_vision's `inkey`/`outkey` (read one key, write another:
  `value_range(outkey="prof")` leaves "image" as it was; a `key` given
  overrides both, as in big_vision).
- `@register("name")`: the factory returns `data -> data`, for ops that read
  or write several keys (keep, copy, onehot).
"""

import ast
import difflib

from big_vit_lite.data.pp.rng import take_seed

_OPS = {}


def register(name):
  """Decorator: registers a factory of `data -> data` ops under `name`."""

  def wrap(factory):
    if name in _OPS:
      raise ValueError(f"pp op {name!r} is registered twice")
    _OPS[name] = factory
    return factory

  return wrap


def register_image_op(name, *, check=None, random=False):
  """Decorator: registers a factory of `image -> image` functions under `name`.

  The factory takes the op's own arguments and returns `fn(image)`, or
  `fn(image, seed)` when `random` (a [2] seed drawn from the example's
  `_rng`, see rng.py). The registered op also takes `key`, `inkey` and
  `outkey` (default "image"): it applies `fn` to the value under `inkey` and
  writes the result under `outkey`; `key` sets both. `check(value, key,
  name)` raises a ValueError for an input `fn` cannot take (e.g. encoded
  bytes before `decode`); it runs before a seed is drawn.
  """

  def wrap(factory):
    def make_op(*args, key=None, inkey="image", outkey="image", **kwargs):
      fn = factory(*args, **kwargs)
      if key is not None:
        inkey = outkey = key

      def op(data):
        image = data[inkey]
        if check is not None:
          check(image, inkey, name)
        if not random:
          return {**data, outkey: fn(image)}
        data, seed = take_seed(data, name)
        return {**data, outkey: fn(image, seed)}

      return op

    register(name)(make_op)
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
  """'name(1, k=2)' -> the op: a function `example_dict -> example_dict`."""
  name, args, kwargs = parse_op(op_text)
  if name not in _OPS:
    near = difflib.get_close_matches(name, known_ops(), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise ValueError(
        f"unknown pp op {name!r} in {op_text!r}; {hint}known ops: "
        f"{', '.join(known_ops())}"
    )
  try:
    return _OPS[name](*args, **kwargs)
  except TypeError as e:
    # A wrong count or name of arguments, or an argument of the wrong type.
    raise ValueError(f"pp op {op_text!r}: bad arguments ({e})") from None
  except ValueError as e:
    raise ValueError(f"pp op {op_text!r}: {e}") from None
