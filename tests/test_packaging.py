"""Packaging: setup.py's ranges against the lock, the wheel's contents, shipped configs by name.

CI also installs the wheel with the newest versions the ranges allow, on Python 3.12, and
trains with it (scripts/wheel_smoke.sh); these tests are the cheap part, run with the suite.
"""

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "requirements", "lock.txt")


def _setup_kwargs(monkeypatch):
  """The keyword arguments setup.py passes to setuptools.setup()."""
  seen = {}
  monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
  monkeypatch.chdir(REPO)
  exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__name__": "__main__"})  # pylint: disable=exec-used
  return seen


def _lock():
  pins = {}
  for line in open(LOCK):
    line = line.split("#", 1)[0].strip()
    if line:
      name, version = line.split("==")
      pins[canonicalize_name(name)] = version
  return pins


def _lower_bound(req):
  lows = [s.version for s in req.specifier if s.operator == ">="]
  assert len(lows) == 1, f"{req}: give one lower bound (>=), the tested version"
  return lows[0]


def test_ranges_start_at_the_locked_versions(monkeypatch):
  kw, lock = _setup_kwargs(monkeypatch), _lock()
  reqs = [Requirement(r) for r in kw["install_requires"]]
  reqs += [
      Requirement(r)
      for extra, rs in kw["extras_require"].items()
      for r in rs
      # jax's accelerator wheels: not on this CPU
      if extra not in ("cuda", "cuda13", "tpu")
  ]
  for req in reqs:
    assert not any(
        s.operator == "==" for s in req.specifier
    ), f"{req}: a range, not a pin"
    name = canonicalize_name(req.name)
    assert (
        name in lock
    ), f"{req.name} is not in requirements/lock.txt: add what the tests ran with"
    assert (
        _lower_bound(req) == lock[name]
    ), f"{req}: its lower bound should be the locked {lock[name]}"
  # the same jax range as the core requirement
  # (tpu also brings the gcs extra: TPU VMs keep their workdirs on gs://.)
  for extra in ("cuda", "cuda13", "tpu"):
    req = Requirement(kw["extras_require"][extra][0])
    jax = next(r for r in reqs if r.name == "jax")
    assert req.name == "jax" and req.specifier == jax.specifier, req


def test_python_requires_is_what_the_locked_jax_needs(monkeypatch):
  """python_requires' floor is jax's, the interpreter running the suite is inside the range."""
  kw = _setup_kwargs(monkeypatch)
  ours = SpecifierSet(kw["python_requires"])
  jax_needs = SpecifierSet(
      importlib.metadata.metadata("jax")["Requires-Python"]
  )
  floor = lambda spec: min(
      Version(s.version) for s in spec if s.operator == ">="
  )
  assert floor(ours) == floor(jax_needs), (ours, jax_needs)
  assert ours.contains(".".join(map(str, sys.version_info[:3])))


def test_the_suite_runs_on_the_lock():
  """What scripts/setup.sh installed (pip install -c requirements/lock.txt) is the lock."""
  wrong = []
  for name, version in _lock().items():
    try:
      installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
    # (A local label as in torch's 2.13.0+cpu wheel: the lock's 2.13.0 matches
    # it, as for pip.)
    if installed != version and installed.split("+")[0] != version:
      wrong.append(f"{name} {installed} (lock: {version})")
  assert not wrong, (
      "installed versions differ from requirements/lock.txt (rerun scripts/setup.sh, "
      f"or regenerate the lock after a tested bump): {wrong}"
  )


def build_tree(dst):
  """What `python -m build` reads, copied to `dst`: a build writes build/ and *.egg-info/ into its
  source tree, and two at once in the checkout (test files run in parallel) would clash.
  """
  for name in ("setup.py", "README.md", "LICENSE"):
    shutil.copy(os.path.join(REPO, name), dst)
  for name in ("big_vit_lite", "configs"):
    shutil.copytree(
        os.path.join(REPO, name),
        os.path.join(dst, name),
        ignore=shutil.ignore_patterns("__pycache__"),
    )
  return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  out = tmp_path_factory.mktemp("dist")
  src = build_tree(tmp_path_factory.mktemp("src"))
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "build",
          "--wheel",
          "--outdir",
          str(out),
          str(src),
      ],
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  (path,) = glob.glob(str(out / "big_vit_lite-*.whl"))
  return path


def test_wheel_ships_configs_license_and_extras(wheel):
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    meta = z.read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))
    ).decode()
  configs = sorted(
      os.path.basename(p)
      for p in glob.glob(os.path.join(REPO, "configs", "*.py"))
  )
  missing = [c for c in configs if f"big_vit_lite/configs/{c}" not in names]
  assert not missing, f"configs missing from the wheel: {missing}"
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
  assert "Apache License" in open(os.path.join(REPO, "LICENSE")).read(200)
  for extra in ("cuda", "cuda13", "tpu", "report", "test"):
    assert f"Provides-Extra: {extra}" in meta
  assert re.search(r"^Requires-Python: >=3\.11", meta, re.M)


def _run(args, cwd, *, forked=False, **env):
  """`python ARGS` in `cwd`; forked=True: through the fork server (the checkout's package)."""
  cmd = [sys.executable, *args]
  if forked:
    cmd = forkserver.command(cmd)
  return subprocess.run(
      cmd,
      cwd=cwd,
      env=dict(os.environ, **env),
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )


def test_installed_wheel_finds_its_configs_by_name(wheel, tmp_path):
  """The wheel's package, imported from outside the checkout, reads --config=demo:runlocal."""
  site = tmp_path / "site"
  proc = _run(
      ["-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel],
      tmp_path,
  )
  assert proc.returncode == 0, proc.stderr
  run_dir = tmp_path / "elsewhere"
  run_dir.mkdir()
  code = (
      "import big_vit_lite.config.config_loading as c; print(c.__file__); "
      "print(c.resolve_config_path('demo:runlocal')); print(c.resolve_config_path('configs/vit_l16.py'))"
  )
  proc = _run(["-c", code], run_dir, PYTHONPATH=str(site))
  assert proc.returncode == 0, proc.stderr
  module, demo, vit_l16 = proc.stdout.split()
  assert (
      module.startswith(str(site))
      and demo == f"{site}/big_vit_lite/configs/demo.py:runlocal"
  )
  assert vit_l16 == f"{site}/big_vit_lite/configs/vit_l16.py"
  proc = _run(
      [
          "-m",
          "big_vit_lite.plan",
          "--config=demo:runlocal",
          "--mesh=data:1",
          "--json",
      ],
      run_dir,
      PYTHONPATH=str(site),
  )
  assert (
      proc.returncode == 0 and '"fits": true' in proc.stdout.splitlines()[-1]
  ), proc.stderr[-2000:]


def test_checkout_and_editable_install_find_configs_by_name(tmp_path):
  code = "import big_vit_lite.config.config_loading as c; print(c.resolve_config_path('vit_b16:runlocal'))"
  # the .venv's editable install, from another directory
  proc = _run(["-c", code], tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert (
      proc.stdout.strip()
      == os.path.join(REPO, "configs", "vit_b16.py") + ":runlocal"
  )
  own = tmp_path / "mine.py"
  own.write_text("def get_config(arg=None):\n  return None\n")
  from big_vit_lite.config import config_loading  # pylint: disable=import-outside-toplevel
  # a path stays a path
  assert config_loading.resolve_config_path(f"{own}:x") == f"{own}:x"


def test_an_unknown_config_name_is_one_line_listing_the_shipped_ones(tmp_path):
  proc = _run(
      ["-m", "big_vit_lite.plan", "--config=vit_l32", "--mesh=data:1"],
      tmp_path,
      forked=True,
  )
  last = proc.stderr.strip().splitlines()[-1]
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  shipped = ", ".join(
      sorted(
          n[:-3]
          for n in os.listdir(os.path.join(REPO, "configs"))
          if n.endswith(".py") and not n.startswith("_")
      )
  )
  assert "vit_l16" in shipped and "demo" in shipped
  assert last == (
      "plan: error: flag --config=vit_l32: 'vit_l32' is neither a config file nor a "
      f"shipped config (did you mean 'vit_l16'?); shipped: {shipped}. Give a path "
      "to a .py file or one of those names."
  ), last


@pytest.mark.parametrize(
    "python_version,expected",
    [
        # Ubuntu 22.04, no apt-get
        ("3.10.12", "need Python 3.11-3.13 (python3 is Python 3.10.12)"),
        # Debian without python3-venv
        ("3.11.2", "python3 cannot make a virtualenv (no ensurepip)"),
    ],
)
def test_setup_says_in_one_line_what_is_missing(
    tmp_path, python_version, expected
):
  """scripts/setup.sh on a machine with only an old python3 (or no venv module) and no apt-get."""
  work = tmp_path / "checkout"
  shutil.copytree(os.path.join(REPO, "scripts"), work / "scripts")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  supported = python_version.startswith("3.11")
  (bin_dir / "python3").write_text(
      "#!/bin/sh\n"
      f'case "$*" in --version) echo "Python {python_version}" ;;\n'
      f"  *ensurepip*) exit 1 ;;\n  *version_info*) exit {0 if supported else 1} ;;\n  *) exit 1 ;;\nesac\n"
  )
  (bin_dir / "python3").chmod(0o755)
  # no apt-get, no dpkg, no python3.1x
  for tool in ("bash", "dirname", "grep", "id"):
    (bin_dir / tool).symlink_to(shutil.which(tool))
  proc = subprocess.run(
      [shutil.which("bash"), str(work / "scripts" / "setup.sh")],
      env={"PATH": str(bin_dir)},
      capture_output=True,
      text=True,
      timeout=60,
      check=False,
  )
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert (
      "no apt-get" in proc.stderr and expected in proc.stderr.splitlines()[-1]
  ), proc.stderr


def test_offline_sources_without_npm_or_apt_say_what_to_install(tmp_path):
  """No npm (a fresh Debian): the script apt-installs Debian's npm; without apt-get, one line."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("bash", "dirname", "grep", "id", "mkdir"):
    (bin_dir / tool).symlink_to(shutil.which(tool))
  env = {
      "PATH": str(bin_dir),
      "HOME": str(tmp_path),
      "BVL_SOURCES_DIR": str(tmp_path / "sources"),
  }
  proc = subprocess.run(
      [
          shutil.which("bash"),
          os.path.join(REPO, "scripts", "fetch_offline_sources.sh"),
      ],
      env=env,
      capture_output=True,
      text=True,
      timeout=60,
      check=False,
  )
  have_fmnist = os.path.isfile(
      "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"
  )
  wanted = "npm" if have_fmnist else "dataset-fashion-mnist"
  assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
      f"apt_install.sh: this machine has no apt-get; install {wanted} (or their equivalents) and rerun"
  )
