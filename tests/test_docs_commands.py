"""Every documented command runs for real: a command in the docs that fails is red CI.

Where commands are found: the fenced blocks tagged bash/sh/shell/console of README.md and
docs/*.md (indented fences in lists too; backslash continuations joined, `#` comments dropped),
and the commands at the top of each config's docstring (configs/*.py: the indented lines that
start with `python`, `bash` or `for`). An `export A=B` line sets the environment of its block's
later commands, a leading `A=B` that of its own command.

Each command is looked up in COMMANDS by the longest prefix of its words (after leading
assignments; a prefix's last word ending in `=`, `:` or `,` also matches a longer word, and a
`--config=FILE` word also matches that file with args, `--config=FILE:ARGS`) and run
by the row's mode:
  run    as written, from the repository root, with tiny settings where it would take long:
         --workdir/--out/--data_dir and the like move into a temporary directory; inputs the
         docs name `workdirs/NAME` (`init=`, `--config.model_init=`, `--model=`, `--src=`, a
         report's workdirs) are a tiny trained workdir made once per module (`demo:runlocal`,
         a few steps: the `trained` fixture), `workdirs/NAME/checkpoints/N` its newest step;
         `runlocal=True` adds the `runlocal` config arg (tiny data and steps); `subs` replaces
         text (e.g. a documented image folder by a tiny one), `extra` appends arguments (later
         absl flags win), `args` replaces them. It must exit 0 (a `data.prepare` also prints
         the dataset's name and split sizes). `trained=True`: the `trained`
         fixture runs this very command (only --workdir differs), so the row checks that run
         instead of starting the same training twice. Lines that run the same thing run once:
         the same argv and assigned variables, less the name of the new --workdir (and of an
         input the `trained` workdir stands in for).
  shell  the same, the documented line run by bash as it is (loops).
  help   `PROGRAM --help` (or `help=`) instead, only where a real run needs what CI has not:
         a GPU, TPU, hosts, a cluster, a cloud account or data that cannot be downloaded here.
         The row says why (`why=`), and a test holds that every help row does.
  tpu    (launch/tpu_vm.sh) as written against tests/test_launch.py's fake gcloud, which
         rejects the flags and images the real one rejects.
  pip    `pip install ...` with --dry-run (it resolves; nothing is installed), reading the
         wheels' metadata only (PIP_DRY_RUN).
  env    `export ...`: sets the environment, nothing to run.
  bucket skipped here: tests/test_bucket.py runs them as written against its
         fake of Cloud Storage (gs://MY_BUCKET served from a local folder).
A command no row matches FAILS (so does a fence without a language: tag it ```text when it is
not a command), so documenting a command means adding its row here, in the block of its area.
Rows with slow=True (over ~30 s) carry @pytest.mark.slow.

Error texts the docs quote are compared with what the program prints: QUOTED_ERRORS holds each
with the command that produces it, and every ```text line or `inline` quote in the docs that
reads like an error (`error:`, `did you mean`) must be one of them.
"""

import ast
import dataclasses
import glob
import hashlib
from importlib import metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from test_launch import FAKE_GCLOUD
from test_packaging import build_tree
import forkserver
import shared_dirs
import trainer_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.relpath(p, REPO)
    for p in glob.glob(os.path.join(REPO, "docs", "*.md"))
)
CONFIGS = sorted(
    os.path.relpath(p, REPO)
    for p in glob.glob(os.path.join(REPO, "configs", "*.py"))
)
SHELL = {"bash", "sh", "shell", "console"}
# A `pip install` row resolves the documented command without installing. fast-deps:
# pip reads each wheel's METADATA with HTTP range requests instead of downloading the
# whole wheel (581 MB for cuBLAS, in the `cuda` extra), and downloads it
# where a server has no ranges. The same resolver picks the same versions
# (`.[cuda]`: 9.5 -> 2.5 s of CPU, 19 -> 6 s wall, 2026-12-06).
PIP_DRY_RUN = ("--dry-run", "-q", "--use-feature=fast-deps")
# The `trained` fixture's steps: few, so that every command on it is quick.
SHARED = "shared dir"


@dataclasses.dataclass
class Cmd:
  # the command's first words (matched word by word, longest wins)
  prefix: str
  mode: str  # run | shell | help | tpu | pip | env | bucket
  # run: appended arguments (later absl flags win over earlier ones)
  extra: tuple = ()
  args: tuple = None  # run: these arguments instead of the documented ones
  # help: the command to run instead of `PROGRAM --help`
  help: tuple = None
  why: str = ""  # help: what a real run needs that CI has not
  runlocal: bool = False  # run: add the `runlocal` arg to --config
  # run: (documented text, its stand-in) pairs; {images} {folder} {tmp}
  subs: tuple = ()
  # run: give it a copy of the sources to build in, as {tmp}/src
  copy: bool = False
  # run: the `trained` fixture (trainer_runs.demo_runlocal) runs this command
  # as written (only its --workdir differs): the row is checked by that run
  trained: bool = False
  # run: datasets it reads from the shared test data dir besides the offline
  # three, prepared there first (a command must not rely on another test file)
  needs: tuple = ()
  slow: bool = False
  timeout: int = 300


COMMANDS = [
    # README: the two commands. Each sets up the machine first (apt, a new
    # .venv): the suite runs inside the very .venv they would reinstall, so
    # --help here; CI runs scripts/test.sh itself, and scripts/demo.sh's last
    # line is the demo row below.
    Cmd(
        "bash scripts/demo.sh",
        "help",
        why="reinstalls the .venv the suite runs in",
    ),
    Cmd(
        "bash scripts/test.sh",
        "help",
        why="CI's own entry point: it runs this suite",
    ),
    Cmd(
        "bash scripts/setup.sh",
        "help",
        why="reinstalls the .venv the suite runs in",
    ),
    Cmd(
        "bash scripts/wheel_smoke.sh",
        "help",
        why="a second venv from PyPI: CI runs it apart",
    ),
    # Installing.
    Cmd("pip install", "pip", slow=True),
    Cmd(
        "python -m build",
        "run",
        args=("--wheel", "--outdir", "{tmp}/dist", "{tmp}/src"),
        copy=True,
        slow=True,
    ),
    Cmd("export", "env"),
    Cmd("python -c", "run"),
    Cmd("python scripts/code_size.py", "run"),
    # docs/testing.md: mutation testing of one module (one mutant here: every
    # mutant of a module takes minutes). Its two lines (all mutants, and a
    # --sample) are one run: `args` takes the documented module and both
    # lines' flags (a sample of the one mutant --only names).
    Cmd(
        "python scripts/mutate.py",
        "run",
        args=(
            "big_vit_lite/trainer/losses.py",
            "--sample",
            "10",
            "--seed",
            "0",
            "--only",
            "big_vit_lite.trainer.losses.x_get__mutmut_1",
        ),
        slow=True,
    ),
    # docs/testing.md: a test rerun without the fork server.
    Cmd("python -m pytest", "run"),
    # Training (README, docs/training.md, configs/demo.py).
    Cmd(
        "python -m big_vit_lite.train --config=configs/demo.py",
        "run",
        runlocal=True,
        # (runlocal's steps, over a documented N; the pixel baseline, ~6 s of
        # CPU, is checked by the `trained` run of demo:runlocal)
        extra=(
            "--config.total_steps=6",
            "--config.evals.fewshot.pixel_baseline=False",
        ),
        slow=True,
    ),
    Cmd(
        "python -m big_vit_lite.train --config=demo:runlocal",
        "run",
        trained=True,
        slow=True,
    ),
    # configs/demo.py: prepare the three offline sets
    Cmd("for ds in", "shell", slow=True),
    # Data on a bucket (docs/jft_scale.md): run by tests/test_bucket.py.
    Cmd(
        "for ds in fashion_mnist mnist10k animal_mnist; do python -m"
        " big_vit_lite.data.prepare $ds --data_dir=gs:",
        "bucket",
    ),
    Cmd(
        "python -m big_vit_lite.train --config=configs/demo.py --workdir=gs:",
        "bucket",
    ),
    Cmd(
        "python -m big_vit_lite.train --config=configs/vit_b16.py:data=folder:",
        "run",
        runlocal=True,
        subs=(("/data/my_images", "{folder}"),),
        slow=True,
    ),
    Cmd(
        "python -m big_vit_lite.train --config=configs/vit_l16.py",
        "help",
        why="ImageNet-21k (tests/test_configs.py trains its runlocal on tfds mock data)",
    ),
    Cmd(
        "python -m big_vit_lite.train --config=configs/vit_b16.py",
        "help",
        why="ImageNet-21k (tests/test_configs.py trains its runlocal on tfds mock data)",
    ),
    Cmd(
        "python -m big_vit_lite.train --config=configs/vit_s16_i1k.py",
        "help",
        why="ImageNet-1k (tests/test_configs.py trains its runlocal on tfds mock data)",
    ),
    # Fine-tuning (README, docs/training.md, configs/transfer.py): on the tiny
    # trained workdir.
    Cmd(
        "python -m big_vit_lite.train --config=configs/transfer.py",
        "run",
        runlocal=True,
        slow=True,
    ),
    # Evaluation, predict, export, report (README, docs/evaluation.md,
    # docs/models.md, configs).
    Cmd(
        "python -m big_vit_lite.evaluate --config=configs/fewshot.py",
        "run",
        runlocal=True,
        slow=True,
    ),
    Cmd(
        "python -m big_vit_lite.evaluate --config=configs/linear_probe.py",
        "run",
        runlocal=True,
        slow=True,
    ),
    Cmd(
        "python -m big_vit_lite.evaluate --config=configs/classify.py",
        "run",
        runlocal=True,
        slow=True,
    ),
    Cmd(
        "python -m big_vit_lite.predict",
        "run",
        slow=True,
        subs=(
            ("my_images/", "{images}/"),
            ("a.png", "{images}/a.png"),
            ("b.jpg", "{images}/b.jpg"),
        ),
    ),
    Cmd("python -m big_vit_lite.export", "run", slow=True),
    Cmd("python -m big_vit_lite.report", "run", slow=True),
    Cmd(
        "tensorboard --logdir=",
        "help",
        # the `tensorboard` script's own function (tensorboard.main's
        # run_main), run by `python -m`: the fork server's zygote has imported
        # TensorFlow (the script's own process: ~5 s of CPU to print the help)
        help=("python", "-m", "tensorboard.main", "--helpfull"),
        why="a server that runs until stopped",
    ),
    # Data (docs/data.md, configs/vit_*.py). The offline three as written, on
    # the suite's data dir (TFDS_DATA_DIR), where tfds_data_dir prepared them:
    # each prints its splits. Built afresh from their sources by the same
    # command elsewhere: the three by docs/jft_scale.md's loop on a bucket
    # (tests/test_bucket.py's documented_bucket), mnist10k also by the
    # array_record row below.
    Cmd("python -m big_vit_lite.data.prepare fashion_mnist", "run", slow=True),
    Cmd("python -m big_vit_lite.data.prepare mnist10k", "run", slow=True),
    Cmd("python -m big_vit_lite.data.prepare animal_mnist", "run", slow=True),
    Cmd(
        "python -m big_vit_lite.data.prepare imagenet21k",
        "help",
        why="ImageNet-21k's tar files (image-net.org account)",
    ),
    # Speed and planning (docs/performance.md, docs/scale_out.md).
    Cmd("python -m big_vit_lite.plan", "run"),
    # The GPU compiler (docs/gpu.md): the CUDA plugin lives apart from the test
    # venv (scripts/setup.sh); tests/test_gpu_compile.py compiles this path.
    Cmd(
        "python -m big_vit_lite.plan --config=configs/vit_b16.py --gpu=",
        "help",
        why="the CUDA plugin, kept out of the test venv (.venv/gpu-compiler); "
        "tests/test_gpu_compile.py runs this path",
    ),
    # The TPU compiler (docs/tpu.md): a big model on a big slice takes minutes;
    # the same path on a tiny config and slice (the later --topology wins).
    Cmd(
        "python -m big_vit_lite.plan --topology=",
        "run",
        slow=True,
        args=(
            "--config=configs/demo.py:runlocal",
            "--topology=v5e:2x2",
            "--compile",
        ),
    ),
    Cmd(
        "python -m big_vit_lite.bench",
        "run",
        extra=("--batch=2", "--res=32", "--steps=1", "--warmup=0"),
        slow=True,
    ),
    Cmd(
        "bash benchmarks/gpu_bench.sh",
        "help",
        why="one NVIDIA GPU; tests/test_bench.py runs it with --smoke (every group) on the CPU",
    ),
    # JFT-scale data (docs/jft_scale.md): its --data_dir is moved to a fresh
    # dir.
    Cmd(
        "python -m big_vit_lite.data.prepare mnist10k --file_format=array_record",
        "run",
        slow=True,
    ),
    # (--data_dir moves to a fresh dir: the suite's one build of mnist_multilabel
    # from the current code, ~12 s of CPU; tests/test_multilabel.py and the
    # rows below read the shared data dir's copy, prepared once for good)
    Cmd(
        "python -m big_vit_lite.data.prepare mnist_multilabel",
        "run",
        extra=("--data_dir={data}",),
        slow=True,
        timeout=900,
    ),
    Cmd(
        "python -m big_vit_lite.train --config=configs/multilabel.py:runlocal",
        "run",
        needs=("mnist_multilabel",),
        slow=True,
    ),
    Cmd(
        "python -m big_vit_lite.train --config=configs/multilabel.py",
        "run",
        runlocal=True,
        needs=("mnist_multilabel",),
        slow=True,
    ),
    # Distillation (docs/distillation.md, configs/distill.py): the teacher is
    # the tiny trained workdir (`workdirs/teacher` -> the `trained` fixture).
    Cmd(
        "python -m big_vit_lite.train --config=configs/distill.py",
        "run",
        runlocal=True,
        slow=True,
    ),
    Cmd(
        "python benchmarks/resume_seek.py",
        "help",
        why="a benchmark of minutes (200k records)",
    ),
    Cmd(
        "python benchmarks/jpeg_formats.py",
        "help",
        why="a benchmark of minutes",
    ),
    Cmd(
        "python benchmarks/multilabel_baseline.py",
        "help",
        why="a benchmark of minutes",
    ),
    # Scaling out (docs/scale_out.md, docs/gpu.md, docs/tpu.md).
    Cmd("launch/local.sh", "run", slow=True, timeout=600),
    Cmd("launch/multi_gpu.sh", "help", why="several GPU hosts"),
    Cmd(
        "sbatch",
        "help",
        help=("bash", "launch/slurm.sbatch", "--help"),
        why="a SLURM cluster",
    ),
    Cmd("launch/tpu_vm.sh", "tpu"),
    Cmd(
        "python -m big_vit_lite.train --config=vit_b16",
        "help",
        why="a GPU host (docs/gpu.md)",
    ),
    Cmd(
        "python -m big_vit_lite.train --config=vit_l16",
        "help",
        why="a GPU host (docs/gpu.md)",
    ),
]


# The error texts the docs quote, each with the command that prints it. The
# quote may wrap over lines in the docs; whitespace is compared as one space.
QUOTED_ERRORS = [
    (
        "big_vit_lite.train: error: --config.schedule.warmup_step: the config file has no key "
        "'schedule.warmup_step' (did you mean 'warmup_steps'?). Fix the spelling, or add the key to "
        "the config file (a key whose default is None as config_dict.placeholder(TYPE)).",
        [
            "-m",
            "big_vit_lite.train",
            "--config=configs/demo.py:runlocal",
            "--workdir={tmp}/w",
            "--config.schedule.warmup_step=1",
        ],
    ),
    (
        "the config file has no key 'schedule.warmup_step' (did you mean 'warmup_steps'?)",
        [
            "-m",
            "big_vit_lite.train",
            "--config=configs/demo.py:runlocal",
            "--workdir={tmp}/w",
            "--config.schedule.warmup_step=1",
        ],
    ),
    (
        "unknown pp op 'value_rang' in 'value_rang(-1, 1)'; did you mean 'value_range'?",
        [
            "-m",
            "big_vit_lite.train",
            "--config=configs/demo.py:runlocal",
            "--workdir={tmp}/w",
            "--config.input.pp=decode(channels=1)|value_rang(-1, 1)|onehot(10, key_result='labels')",
        ],
    ),
]


def _commands(text):
  """[(line, words, raw)] of the shell commands in `text` (one fenced block or docstring part)."""
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
      out.append((start, words, pending.split(" #")[0].strip()))
    pending = ""
  return out


def _doc_commands(doc):
  """(commands, untagged fences) of one markdown file; a command is (doc, line, words, env, raw)."""
  cmds, untagged = [], []
  text = open(os.path.join(REPO, doc), encoding="utf-8").read()
  fence = r"^( *)```(\S*)[^\n]*\n(.*?)^\1```"
  for m in re.finditer(fence, text, re.S | re.M):
    line = text[: m.start()].count("\n") + 2
    if not m.group(2):
      untagged.append(f"{doc}:{line - 1}")
    elif m.group(2) in SHELL:
      exported = {}
      for i, words, raw in _commands(textwrap.dedent(m.group(3))):
        cmds.append((doc, line + i, words, dict(exported), raw))
        if words[0] == "export":
          exported.update(_split_env(words[1:])[0])
  return cmds, untagged


def _config_commands(path):
  """The commands at the top of a config's docstring (indented lines: python, bash, for)."""
  source = open(os.path.join(REPO, path), encoding="utf-8").read()
  doc = ast.get_docstring(ast.parse(source), clean=False) or ""
  first = source.index(doc.splitlines()[0]) if doc else 0
  offset = source[:first].count("\n") + 1
  lines, cmds = doc.splitlines(), []
  i = 0
  while i < len(lines):
    if re.match(r"^ +(python|bash|for) ", lines[i]):
      block = [lines[i].strip()]
      while block[-1].endswith("\\") and i + 1 < len(lines):
        i += 1
        block.append(lines[i].strip())
      for _, words, raw in _commands("\n".join(block)):
        cmds.append((path, offset + i - len(block) + 1, words, {}, raw))
    i += 1
  return cmds


def documented():
  """Every documented command (doc, line, words, env, raw), and the fences with no language."""
  cmds, untagged = [], []
  for doc in DOCS:
    c, u = _doc_commands(doc)
    cmds += c
    untagged += u
  for path in CONFIGS:
    cmds += _config_commands(path)
  return cmds, untagged


def _split_env(words):
  env = {}
  while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
    k, v = words[0].split("=", 1)
    env[k], words = v, words[1:]
  return env, words


def _matches(prefix_words, words):
  if (
      len(prefix_words) > len(words)
      or words[: len(prefix_words) - 1] != prefix_words[:-1]
  ):
    return False
  last, word = prefix_words[-1], words[len(prefix_words) - 1]
  # a --config file takes args after ':'
  return (
      word == last
      or word.startswith(last + ":")
      or (last[-1] in "=:," and word.startswith(last))
  )


def lookup(words):
  """The COMMANDS row whose prefix matches most words (then most characters), or None."""
  _, words = _split_env(words)
  matching = [row for row in COMMANDS if _matches(row.prefix.split(), words)]
  return max(
      matching,
      key=lambda row: (len(row.prefix.split()), len(row.prefix)),
      default=None,
  )


CMDS, UNTAGGED = documented()


def test_every_fence_has_a_language():
  assert (
      not UNTAGGED
  ), f"fenced blocks without a language (```bash or ```text): {UNTAGGED}"


def test_every_documented_command_is_in_the_table():
  unknown = [
      f"{d}:{l}: {shlex.join(w)}" for d, l, w, _, _ in CMDS if lookup(w) is None
  ]
  assert not unknown, (
      "documented commands with no row in tests/test_docs_commands.py's COMMANDS "
      "(add one, see the docstring): " + "; ".join(unknown)
  )


def test_config_docstring_commands_are_found():
  """The scan of the config docstrings sees their commands (a scan that finds none checks none)."""
  found = {d for d, _, _, _, _ in CMDS if d.startswith("configs/")}
  missing = set(CONFIGS) - found
  assert (
      not missing
  ), f"configs whose docstring command was not found: {missing}"


def test_every_help_row_says_why():
  vague = [row.prefix for row in COMMANDS if row.mode == "help" and not row.why]
  assert (
      not vague
  ), f"rows that only run --help without saying why a real run cannot: {vague}"


def _params():
  out = []
  for doc, line, words, block_env, raw in CMDS:
    row = lookup(words)
    if row is None or row.mode in ("env", "bucket"):
      continue
    marks = [pytest.mark.slow] if row.slow else []
    out.append(
        pytest.param(
            doc,
            line,
            words,
            block_env,
            raw,
            row,
            id=f"{doc}:{line}:{' '.join(words)[:50]}",
            marks=marks,
        )
    )
  return out


def _redirect(words, tmp):
  """--workdir / --out / --data_dir / --manual_dir values moved under `tmp` (kept distinct)."""
  out = []
  for w in words:
    m = re.fullmatch(r"(--(?:workdir|out|outdir|data_dir|manual_dir))=(.+)", w)
    if m and not m.group(2).startswith("gs://"):
      w = f"{m.group(1)}={tmp}/out/{m.group(2).strip('/').replace('/', '_')}"
    out.append(w)
  return out


def _inputs(words, trained):
  """`workdirs/NAME[/checkpoints/N]` inputs -> the trained workdir (its newest step)."""
  root, step = trained
  words = [
      re.sub(r"workdirs/\w+/checkpoints/\d+", f"{root}/checkpoints/{step}", w)
      for w in words
  ]
  return [re.sub(r"workdirs/\w+", root, w) for w in words]


def _with_runlocal(words):
  out = []
  for w in words:
    if w.startswith("--config=") and "runlocal" not in w:
      w += ",runlocal" if ":" in w else ":runlocal"
    out.append(w)
  return out


@pytest.fixture(scope="module")
def fake_gcloud(tmp_path_factory):
  d = tmp_path_factory.mktemp("gcloud")
  (d / "bin").mkdir()
  (d / "bin" / "gcloud").write_text(f"#!{sys.executable}" + FAKE_GCLOUD)
  (d / "bin" / "gcloud").chmod(0o755)
  return d


@pytest.fixture(scope="module")
def trained(tfds_data_dir):
  """(workdir, newest step) of a real `demo:runlocal` training run: the docs' `workdirs/NAME`."""
  return trainer_runs.demo_runlocal(tfds_data_dir)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
  """A folder of a few small images (a PNG and a JPEG among them): the docs' `my_images/`."""
  d = tmp_path_factory.mktemp("images")
  rng = np.random.default_rng(0)
  for name in ("a.png", "b.jpg", "c.png"):
    Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(
        d / name
    )
  return str(d)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """An image folder ROOT/{train,val}/CLASS/*.jpg of 10 classes: the docs' `/data/my_images`."""
  root = tmp_path_factory.mktemp("my_images")
  rng = np.random.default_rng(0)
  for split, n in (("train", 3), ("val", 2)):
    for c in range(10):
      os.makedirs(root / split / f"class{c}")
      for i in range(n):
        pixels = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / split / f"class{c}" / f"{i}.jpg")
  return str(root)


def _run_once(key, cmd, **kwargs):
  """subprocess.run(cmd, **kwargs) once per pytest run for each `key`, later calls get its result:
  a command documented twice runs once, also when both xdist workers meet it (conftest.py deals
  this file's tests to both)."""
  name = "docs_command_" + hashlib.sha1(repr(key).encode()).hexdigest()[:16]

  def run(folder):
    proc = subprocess.run(
        forkserver.command(cmd),
        capture_output=True,
        text=True,
        check=False,
        **kwargs,
    )
    with open(os.path.join(folder, "result.json"), "w") as f:
      json.dump(
          dict(
              returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr
          ),
          f,
      )

  with open(
      os.path.join(shared_dirs.built_once(name, run), "result.json")
  ) as f:
    result = json.load(f)
  return subprocess.CompletedProcess(
      cmd, result["returncode"], result["stdout"], result["stderr"]
  )


def _command(row, words, raw, tmp_path, request, data):
  """(the argv to run for a documented command, what it runs: for a `run` row the same argv
  before this test's folders fill in its placeholders, its new --workdir unnamed; else None).
  """
  n = len(row.prefix.split())
  if row.mode == "help":
    return list(row.help) if row.help else words[:n] + ["--help"], None
  if row.mode == "pip":
    pip = [sys.executable, "-m", "pip", "install", *PIP_DRY_RUN] + words[2:]
    return pip, None
  if row.mode == "shell":
    return ["bash", "-c", raw], None
  rest = list(row.args) if row.args is not None else words[n:] + list(row.extra)
  cmd = _redirect(words[:n] + rest, "{tmp}")
  if row.runlocal:
    cmd = _with_runlocal(cmd)
  if any("workdirs/" in w for w in cmd):
    cmd = _inputs(cmd, request.getfixturevalue("trained"))
  fill = {"{tmp}": str(tmp_path), "{data}": data}
  for old, new in row.subs:
    for key in ("images", "folder"):
      if "{" + key + "}" in new:
        fill["{" + key + "}"] = request.getfixturevalue(key)
    cmd = [w.replace(old, new) for w in cmd]
  runs = [
      re.sub(r"^--workdir=\{tmp\}/.*", "--workdir={tmp}/NEW", w) for w in cmd
  ]
  for key, value in fill.items():
    cmd = [w.replace(key, value) for w in cmd]
  return cmd, runs


def test_the_tensorboard_script_runs_what_its_row_runs():
  """The `tensorboard` row runs `python -m tensorboard.main --helpfull` through
  the fork server: the script the docs name must be installed beside this
  Python and call that module's run_main. Guards: a docs command whose program
  is missing (the console script not installed) passing its row."""
  (script,) = metadata.entry_points(group="console_scripts", name="tensorboard")
  assert script.value == "tensorboard.main:run_main"
  on_path = shutil.which("tensorboard", path=os.path.dirname(sys.executable))
  assert on_path, "no tensorboard script beside " + sys.executable


@pytest.mark.parametrize("doc,line,words,block_env,raw,row", _params())
def test_documented_command_runs(
    doc,
    line,
    words,
    block_env,
    raw,
    row,
    tmp_path,
    fake_gcloud,
    tfds_data_dir,
    request,
):
  env_vars, words = _split_env(words)
  if row.trained:
    # The fixture's build asserts exit 0; the same command, or no check.
    config, *others = words[3:]
    assert config == f"--config={trainer_runs.DEMO_RUNLOCAL}" and all(
        w.startswith("--workdir=") for w in others
    ), (
        f"{doc}:{line}: the `trained` fixture runs `--config="
        f"{trainer_runs.DEMO_RUNLOCAL} --workdir=DIR`, not {shlex.join(words)}:"
        " update trainer_runs.demo_runlocal or drop the row's trained=True"
    )
    request.getfixturevalue("trained")
    return
  env = dict(os.environ, TFDS_DATA_DIR=tfds_data_dir)
  env.update(block_env)
  env.update(env_vars)
  # `python` = this venv's, through the fork server (tests/forkserver.py)
  env["PATH"] = f"{os.path.dirname(sys.executable)}:{env['PATH']}"
  if forkserver.enabled():
    env["PATH"] = f"{forkserver.bin_dir()}:{env['PATH']}"
  # where --out / --workdir go (a file's folder must exist)
  (tmp_path / "out").mkdir()
  if row.copy:
    build_tree((tmp_path / "src").mkdir() or tmp_path / "src")
  cmd, runs = _command(row, words, raw, tmp_path, request, tfds_data_dir)
  for name in row.needs:
    request.getfixturevalue("prepare_in_test_data")(name)
  if row.mode == "tpu":
    env.update(
        PATH=f"{fake_gcloud / 'bin'}:{env['PATH']}",
        FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.log"),
        HOME=str(tmp_path / "home"),
        TPU_NAME=env.get("TPU_NAME", "docs-test"),
        ZONE=env.get("ZONE", "us-central2-b"),
    )
  # benchmarks/gpu_bench.sh writes its JSON there
  env.setdefault("OUT", str(tmp_path))
  if cmd[0] == "python":
    cmd[0] = sys.executable
  elif cmd[0].endswith(".sh") or cmd[0].endswith(".sbatch"):
    cmd = ["bash"] + cmd
  # The same command documented twice runs once (the help and pip lines, and
  # identical runs); so does a row whose `args` replace the documented ones
  # (the plan --topology lines: the row's later --topology wins), and a run
  # that differs from another only in the name of its new workdir or of an
  # input the `trained` workdir stands in for (`--workdir=workdirs/probe` with
  # `--config.model_init=workdirs/demo`, and `workdirs/probe_pre3k` with
  # `workdirs/pre3k`): the same program, arguments and environment.
  assigned = tuple(sorted({**block_env, **env_vars}.items()))
  if row.mode == "run" and row.args is not None:
    key = (row.mode, row.prefix, row.args, assigned)
  elif row.mode == "run":
    key = (row.mode, tuple(runs), assigned)
  elif row.mode == "shell":
    key = (row.mode, tuple(words), assigned)
  else:
    key = tuple(cmd)
  if row.mode == "tpu":
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=row.timeout,
        check=False,
    )
  else:
    proc = _run_once(key, cmd, cwd=REPO, env=env, timeout=row.timeout)
  out = proc.stdout + proc.stderr
  where = f"{doc}:{line}: {shlex.join(cmd)}\n{out[-3000:]}"
  if row.mode == "help" and cmd[-1] == "--help" and cmd[0] == sys.executable:
    # absl: 1
    assert (
        proc.returncode in (0, 1) and "Traceback" not in out and "--" in out
    ), where
  else:
    assert proc.returncode == 0, where
  if row.mode == "run" and row.prefix.startswith(
      "python -m big_vit_lite.data.prepare "
  ):
    # what it prepared: the dataset's name and its splits' sizes
    name = row.prefix.split()[3]
    assert re.search(rf"^{name}: {{'\w+': [1-9]", proc.stdout, re.M), where


# -- Quoted error texts.


def _norm(text):
  return " ".join(text.split())


def _quotes_like_errors():
  """(doc, text) of each quoted error-like text: ```text lines and `inline` spans."""
  out = []
  for doc in DOCS:
    text = open(os.path.join(REPO, doc), encoding="utf-8").read()
    for m in re.finditer(r"^ *```text[^\n]*\n(.*?)^ *```", text, re.S | re.M):
      out += [
          (doc, line.strip())
          for line in m.group(1).splitlines()
          if re.search(r"error:|did you mean", line)
      ]
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.S | re.M)
    for m in re.finditer(r"`([^`]+)`", prose, re.S):
      if re.search(r"error:|did you mean", m.group(1)):
        out.append((doc, _norm(m.group(1))))
  return out


def test_every_quoted_error_is_checked():
  known = [_norm(quote) for quote, _ in QUOTED_ERRORS]
  unchecked = [
      f"{doc}: {q}" for doc, q in _quotes_like_errors() if _norm(q) not in known
  ]
  assert not unchecked, (
      "error texts quoted in the docs with no QUOTED_ERRORS entry (add the "
      "command that prints it): " + "; ".join(unchecked)
  )


@pytest.mark.slow
@pytest.mark.parametrize(
    "quote,argv", QUOTED_ERRORS, ids=[q[:40] for q, _ in QUOTED_ERRORS]
)
def test_quoted_error_is_what_the_program_prints(
    quote, argv, tmp_path, tfds_data_dir
):
  docs = _norm(
      " ".join(
          open(os.path.join(REPO, d), encoding="utf-8").read() for d in DOCS
      )
  )
  assert (
      _norm(quote) in docs
  ), f"no doc quotes {quote!r} any more: drop its QUOTED_ERRORS entry"
  cmd = [sys.executable] + [a.replace("{tmp}", str(tmp_path)) for a in argv]
  proc = _run_once(
      tuple(argv),
      cmd,
      cwd=REPO,
      env=dict(os.environ, TFDS_DATA_DIR=tfds_data_dir),
      timeout=300,
  )
  out = _norm(proc.stdout + proc.stderr)
  assert proc.returncode != 0 and _norm(quote) in out, (
      shlex.join(cmd),
      out[-2000:],
  )
