"""Helpers shared by the test files (not tests themselves)."""
import pytest


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
