"""Every command shown in README.md and docs/*.md runs: a documented command that fails is red CI.

How: each fenced block tagged bash/sh/shell is cut into commands (backslash continuations
joined, `#` comments dropped); an `export A=B` line sets the environment of the block's later
commands, a leading `A=B` that of its own command. Each command is looked up in COMMANDS by the
longest prefix of its words (after leading assignments) and then, by the row's mode:
  run   it runs as written, from the repository root, with its --workdir/--out/--data_dir moved
        into a temporary directory and the row's `extra` arguments appended (tiny overrides), or
        `args` in place of its own; it must exit 0;
  help  its program runs with only `--help` (absl programs print their flags and exit 1, the
        scripts exit 0): for commands that need a GPU, hosts, a cluster or real ImageNet;
  tpu   (launch/tpu_vm.sh) it runs as written against tests/test_launch.py's fake gcloud,
        which rejects the flags and images the real one rejects;
  pip   `pip install ...` runs with --dry-run (it resolves; nothing is installed);
  env   `export ...`: sets the environment, nothing to run.
A command no row matches FAILS (so does a fence without a language: tag it ```text when it is
not a command), so documenting a command means adding its row here, e.g.
  Cmd("python -m big_vit_lite.predict", "help"),
  Cmd("python -m big_vit_lite.report --workdir=", "run", extra=["--out=report.html"], slow=True),
Rows with slow=True (over ~30 s) carry @pytest.mark.slow.
"""
import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from test_launch import FAKE_GCLOUD
from test_packaging import build_tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
SHELL = {"bash", "sh", "shell", "console"}


@dataclasses.dataclass
class Cmd:
  prefix: str              # the command's first words (matched word by word, longest wins)
  mode: str                # run | help | tpu | pip | env
  extra: tuple = ()        # run: appended arguments (later absl flags win over earlier ones)
  args: tuple = None       # run: these arguments instead of the documented ones
  help: tuple = None       # help: the command to run instead of `PROGRAM --help`
  copy: bool = False       # run: give it a copy of the sources to build in, as {tmp}/src
  slow: bool = False
  timeout: int = 300


COMMANDS = [
    # README: the two commands (each sets up the machine first: --help here, since the suite runs
    # inside the very .venv they would reinstall; CI runs scripts/test.sh itself).
    Cmd("bash scripts/demo.sh", "help"),
    Cmd("bash scripts/test.sh", "help"),
    Cmd("bash scripts/setup.sh", "help"),
    Cmd("bash scripts/wheel_smoke.sh", "help"),
    # Installing.
    Cmd("pip install", "pip", slow=True),
    Cmd("python -m build", "run", args=("--wheel", "--outdir", "{tmp}/dist", "{tmp}/src"), copy=True),
    Cmd("export", "env"),
    # The jobs. A line with placeholders (FILE, DIR, ...) is syntax: --help.
    Cmd("python -m big_vit_lite.train", "help"),
    Cmd("python -m big_vit_lite.train --config=configs/demo.py:runlocal", "run", slow=True),
    Cmd("python -m big_vit_lite.train --config=demo:runlocal", "run", slow=True),
    Cmd("python -m big_vit_lite.evaluate", "help"),
    Cmd("python -m big_vit_lite.export", "help"),
    # Seeing a run: the report runs on a real trainer workdir in tests/test_report.py.
    Cmd("python -m big_vit_lite.report", "help"),
    Cmd("python -m big_vit_lite.predict", "help"),  # runs on a real checkpoint in test_predict.py
    Cmd("tensorboard --logdir=", "help", help=("tensorboard", "--helpfull")),
    Cmd("python -m big_vit_lite.plan", "run"),
    # The TPU compiler (docs/tpu.md): a big model on a big slice takes minutes; the same path on
    # a tiny config and slice (the later --topology wins).
    Cmd("python -m big_vit_lite.plan --topology=", "run", slow=True,
        args=("--config=configs/demo.py:runlocal", "--topology=v5e:2x2", "--compile")),
    Cmd("python -m big_vit_lite.bench", "run", extra=("--batch=2", "--res=32", "--steps=1", "--warmup=0"),
        slow=True),
    Cmd("python -c", "run"),
    Cmd("python scripts/code_size.py", "run"),
    Cmd("python -m big_vit_lite.data.prepare fashion_mnist", "run", extra=("--data_dir={data}",)),
    Cmd("python -m big_vit_lite.data.prepare mnist10k", "run", extra=("--data_dir={data}",)),
    Cmd("python -m big_vit_lite.data.prepare animal_mnist", "run", extra=("--data_dir={data}",)),
    Cmd("python -m big_vit_lite.data.prepare imagenet21k", "help"),
    # Scaling out (docs/scale_out.md, docs/gpu.md, docs/tpu.md).
    Cmd("launch/local.sh", "run", slow=True, timeout=600),
    Cmd("launch/multi_gpu.sh", "help"),
    Cmd("sbatch", "help", help=("bash", "launch/slurm.sbatch", "--help")),
    Cmd("launch/tpu_vm.sh", "tpu"),
    Cmd("bash benchmarks/gpu_bench.sh", "run", args=("--smoke",), slow=True),
]


def _commands(text):
  """[(line, words)] of the shell commands in `text` (one fenced block)."""
  out, pending, start = [], "", 0
  for i, line in enumerate(text.splitlines()):
    if not pending:
      start = i
    pending += line
    if pending.endswith("\\"):
      pending = pending[:-1] + " "
      continue
    words = shlex.split(pending, comments=True)
    if words:
      out.append((start, words))
    pending = ""
  return out


def documented():
  """Every documented command: (file, line, words, block env), and the fences with no language.

  The block env: what the block's `export` lines before the command set.
  """
  cmds, untagged = [], []
  for doc in DOCS:
    text = open(os.path.join(REPO, doc), encoding="utf-8").read()
    for m in re.finditer(r"^```(\S*)[^\n]*\n(.*?)^```", text, re.S | re.M):
      line = text[:m.start()].count("\n") + 2
      if not m.group(1):
        untagged.append(f"{doc}:{line - 1}")
      elif m.group(1) in SHELL:
        exported = {}
        for i, words in _commands(m.group(2)):
          cmds.append((doc, line + i, words, dict(exported)))
          if words[0] == "export":
            exported.update(_split_env(words[1:])[0])
  return cmds, untagged


def _split_env(words):
  env = {}
  while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
    k, v = words[0].split("=", 1)
    env[k], words = v, words[1:]
  return env, words


def lookup(words):
  """The COMMANDS row whose prefix matches most words, or None."""
  _, words = _split_env(words)
  best = None
  for row in COMMANDS:
    p = row.prefix.split()
    if words[:len(p)] == p or (len(p) <= len(words) and words[:len(p) - 1] == p[:-1]
                               and words[len(p) - 1].startswith(p[-1]) and p[-1].endswith("=")):
      if best is None or len(p) > len(best.prefix.split()):
        best = row
  return best


CMDS, UNTAGGED = documented()


def test_every_fence_has_a_language():
  assert not UNTAGGED, f"fenced blocks without a language (```bash or ```text): {UNTAGGED}"


def test_every_documented_command_is_in_the_table():
  unknown = [f"{d}:{l}: {shlex.join(w)}" for d, l, w, _ in CMDS if lookup(w) is None]
  assert not unknown, ("documented commands with no row in tests/test_docs_commands.py's COMMANDS "
                       "(add one, see the docstring): " + "; ".join(unknown))


def _params():
  out = []
  for doc, line, words, block_env in CMDS:
    row = lookup(words)
    if row is None or row.mode == "env":
      continue
    marks = [pytest.mark.slow] if row.slow else []
    out.append(pytest.param(doc, line, words, block_env, row, id=f"{doc}:{line}:{' '.join(words)[:50]}", marks=marks))
  return out


def _fill(arg, tmp, data):
  return arg.replace("{tmp}", str(tmp)).replace("{data}", data)


def _redirect(words, tmp):
  """--workdir / --out / --data_dir / --manual_dir values moved under `tmp` (paths kept distinct)."""
  out = []
  for w in words:
    m = re.fullmatch(r"(--(?:workdir|out|outdir|data_dir|manual_dir))=(.+)", w)
    if m and not m.group(2).startswith("gs://"):
      w = f"{m.group(1)}={tmp}/out/{m.group(2).strip('/').replace('/', '_')}"
    out.append(w)
  return out


_RUNS = {}


@pytest.fixture(scope="module")
def fake_gcloud(tmp_path_factory):
  d = tmp_path_factory.mktemp("gcloud")
  (d / "bin").mkdir()
  (d / "bin" / "gcloud").write_text(f"#!{sys.executable}" + FAKE_GCLOUD)
  (d / "bin" / "gcloud").chmod(0o755)
  return d


@pytest.mark.parametrize("doc,line,words,block_env,row", _params())
def test_documented_command_runs(doc, line, words, block_env, row, tmp_path, fake_gcloud, tfds_data_dir):
  env_vars, words = _split_env(words)
  env = dict(os.environ, TFDS_DATA_DIR=tfds_data_dir)
  env.update(block_env)
  env.update(env_vars)
  env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"  # `python` = this venv's
  n = len(row.prefix.split())
  if row.copy:
    build_tree((tmp_path / "src").mkdir() or tmp_path / "src")
  if row.mode == "help":
    cmd = list(row.help) if row.help else words[:n] + ["--help"]
  elif row.mode == "pip":
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "-q"] + words[2:]
  else:
    rest = list(row.args) if row.args is not None else words[n:] + list(row.extra)
    cmd = _redirect(words[:n] + [_fill(a, tmp_path, tfds_data_dir) for a in rest], tmp_path)
  if row.mode == "tpu":
    env.update(PATH=f"{fake_gcloud / 'bin'}:{env['PATH']}", FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.log"),
               HOME=str(tmp_path / "home"), TPU_NAME=env.get("TPU_NAME", "docs-test"),
               ZONE=env.get("ZONE", "us-central2-b"))
  env.setdefault("OUT", str(tmp_path))  # benchmarks/gpu_bench.sh writes its JSON there
  if cmd[0] == "python":
    cmd[0] = sys.executable
  elif cmd[0].endswith(".sh") or cmd[0].endswith(".sbatch"):
    cmd = ["bash"] + cmd
  once = row.mode in ("help", "pip")  # the same --help or pip line documented twice runs once
  proc = _RUNS.get(tuple(cmd)) if once else None
  if proc is None:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=row.timeout, check=False)
    if once:
      _RUNS[tuple(cmd)] = proc
  out = proc.stdout + proc.stderr
  where = f"{doc}:{line}: {shlex.join(cmd)}\n{out[-3000:]}"
  if row.mode == "help" and cmd[-1] == "--help" and cmd[0] == sys.executable:
    assert proc.returncode in (0, 1) and "Traceback" not in out and "--" in out, where  # absl exits 1
  else:
    assert proc.returncode == 0, where
