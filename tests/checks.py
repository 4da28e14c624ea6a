"""Helpers shared by the test files (not tests themselves)."""
import numpy as np
import pytest

from big_vit_lite.models import layout


def one_line_error(fn, *words, error=ValueError):
  """Calls fn, which must raise `error` with a one-line message holding every word; returns it."""
  with pytest.raises(error) as e:
    fn()
  msg = str(e.value)
  assert "\n" not in msg, msg
  for w in words:
    assert w in msg, msg
  return msg


def set_dotted(config, overrides):
  """config["a"]["b"] = v for each "a.b": v of `overrides`, as --config.a.b=v would."""
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def assert_same_params(a, b):
  """Two param trees (boxed or plain, any device) hold the same names, in order, and bits."""
  fa, fb = layout.to_numpy_flat(a), layout.to_numpy_flat(b)
  assert list(fa) == list(fb)
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)
