"""The code is formatted by pyink with the settings in pyproject.toml (Google
style as flax and jax use it: 2-space indent, 80 columns). To fix a failure:
`pyink big_vit_lite configs tests scripts benchmarks launch setup.py`.
"""

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
FORMATTED = [
    "big_vit_lite",
    "configs",
    "tests",
    "scripts",
    "benchmarks",
    "launch",
    "setup.py",
]


def _pyink(*args, cwd=REPO):
  return subprocess.run(
      [sys.executable, "-m", "pyink", *args],
      cwd=cwd,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )


def test_the_code_is_pyink_formatted():
  result = _pyink("--check", *FORMATTED)
  assert result.returncode == 0, result.stderr[-3000:]


def test_the_check_fails_on_unformatted_code(tmp_path):
  # The project's settings, applied to a file in the old style (4-space indent,
  # a call over 80 columns): pyink must want to change it.
  (tmp_path / "pyproject.toml").write_text(
      (REPO / "pyproject.toml").read_text()
  )
  (tmp_path / "m.py").write_text(
      "def f(x):\n    return dict(alpha=x, beta=x, gamma=x, delta=x, epsilon=x,"
      " zeta=x, eta=x)\n"
  )
  result = _pyink("--check", "m.py", cwd=tmp_path)
  assert result.returncode == 1 and "would reformat" in result.stderr
