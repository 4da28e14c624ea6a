"""Mutation testing of one module against the tests that cover it (mutmut 3).

  python scripts/mutate.py big_vit_lite/trainer/losses.py [--max-children 1]
  python scripts/mutate.py big_vit_lite/trainer/optim.py --sample 40 [--seed 0]

What it does: mutmut plants one small bug at a time in the module (an operator
flipped, a constant changed, an argument dropped...) and runs the module's tests
on each; a mutant the tests pass on is a bug they would miss. The tests of each
module are listed in pyproject.toml, [tool.big_vit_lite.mutation_tests] (the
module's own unit tests and its tests/test_oracle_*.py); the mutmut settings
all modules share are [tool.mutmut] there.

mutmut reads its settings from the pyproject.toml of the folder it runs in, so
each module gets a scratch folder, .mutate/<module>/ (git-ignored): links to
the package, the tests and pytest.ini, and a pyproject.toml holding the shared
settings plus this module's only_mutate and test selection. mutmut writes its
mutants/ there. A run starts afresh (the old scratch folder is removed), so a
row of docs/testing.md's table is reproduced by one command.

At the end it prints the module's counts (killed, survived, no tests, timeout,
equivalent) and the score killed / (killed + survived + no tests), and lists
the survivors; `--show` prints each survivor's diff. A survivor that no test
can tell from the original (an equivalent mutant) is listed with the reason in
pyproject.toml, [tool.big_vit_lite.equivalent_mutants], and left out of the
score; mutmut numbers the mutants of a function in order, so an edit of the
function renumbers them (check the list after one).

`--sample N` tests a seeded random sample of N of the module's mutants (of
those `--only` names, if given) where testing all of them would take hours:
the score of a sample comes with its 95% Wilson interval, and a row of the
table from it reads "sampled N of M". Sampling mutants is an established way to
cut the cost (Acree 1980; Wong and Mathur 1995: a 10% sample keeps most of
the adequacy of the whole set).
"""

import argparse
import collections
import contextlib
import fcntl
import fnmatch
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tomllib

from mutmut.mutation.file_mutation import mutate_file_contents
from mutmut.utils.format_utils import get_mutant_name
import scipy.stats

REPO = pathlib.Path(__file__).resolve().parent.parent
# docs/: tests that run the commands and ops the docs show read it (mutmut's
# mutants/ copy holds only what [tool.mutmut] also_copy names); benchmarks/:
# timm_reference's torchvision stand-in, for the tests against real timm.
LINKED = (
    "big_vit_lite",
    "tests",
    "configs",
    "docs",
    "benchmarks",
    "pytest.ini",
)


def _toml_value(value):
  """TOML for the value types [tool.mutmut] uses (str, bool, number, list)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float)):
    return repr(value)
  if isinstance(value, str):
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
  if isinstance(value, list):
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"
  raise TypeError(f"cannot write {value!r} as TOML")


def module_settings(module):
  """The [tool.mutmut] settings for mutating `module` alone with its tests."""
  with open(REPO / "pyproject.toml", "rb") as f:
    tool = tomllib.load(f)["tool"]
  tests_by_module = tool["big_vit_lite"]["mutation_tests"]
  if module not in tests_by_module:
    known = "\n  ".join(sorted(tests_by_module))
    sys.exit(
        f"error: no tests listed for {module} in pyproject.toml"
        " [tool.big_vit_lite.mutation_tests]; add a row (the module's own"
        f" tests). Modules listed:\n  {known}"
    )
  tests = tests_by_module[module]
  missing = [t for t in tests if not (REPO / t.split("::")[0]).exists()]
  if missing:
    sys.exit(f"error: {module}'s tests do not exist: {missing}")
  settings = dict(tool["mutmut"])
  if "preload_modules_file" in settings:
    preload = REPO / settings["preload_modules_file"]
    settings["preload_modules_file"] = str(preload)
  settings["only_mutate"] = [module]
  settings["pytest_add_cli_args_test_selection"] = tests
  return settings


def equivalent_mutants():
  """{mutant name: why no test can tell it from the original} (pyproject.toml)."""
  with open(REPO / "pyproject.toml", "rb") as f:
    tool = tomllib.load(f)["tool"]
  return tool["big_vit_lite"].get("equivalent_mutants", {})


def scratch_dir(module):
  """.mutate/<module>/, the folder mutmut runs in for `module`."""
  return REPO / ".mutate" / module.replace("/", "__").removesuffix(".py")


@contextlib.contextmanager
def module_lock(module):
  """Held while a run uses the module's scratch folder.

  A second run of the same module (another terminal, or two rows of the docs
  test on two xdist workers) would remove the folder under the first one's
  mutmut, whose clean tests then fail: it waits for the first instead.
  """
  lock_path = scratch_dir(module).with_suffix(".lock")
  lock_path.parent.mkdir(exist_ok=True)
  with open(lock_path, "w") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      print(
          f"waiting for another run of scripts/mutate.py on {module}"
          f" (it holds {lock_path})",
          flush=True,
      )
      fcntl.flock(lock, fcntl.LOCK_EX)
    yield


def prepare_scratch(module):
  """.mutate/<module>/: links to the repo's files and this module's settings."""
  scratch = scratch_dir(module)
  shutil.rmtree(scratch, ignore_errors=True)
  scratch.mkdir(parents=True)
  for name in LINKED:
    (scratch / name).symlink_to(REPO / name)
  lines = ["[tool.mutmut]"]
  for key, value in module_settings(module).items():
    lines.append(f"{key} = {_toml_value(value)}")
  (scratch / "pyproject.toml").write_text("\n".join(lines) + "\n")
  return scratch


def read_results(scratch):
  """{mutant name: status} from `mutmut results --all true`."""
  out = subprocess.run(
      [_mutmut(), "results", "--all", "true"],
      cwd=scratch,
      capture_output=True,
      text=True,
      check=True,
  ).stdout
  statuses = {}
  for line in out.splitlines():
    name, sep, status = line.strip().rpartition(": ")
    if sep:
      statuses[name] = status
  return statuses


def mutant_names(module):
  """The names mutmut gives the mutants of `module`, in its order.

  The same call `mutmut run` makes to write the mutated copy, so the names
  match those of a run (mutate_only_covered_lines is off in [tool.mutmut]).
  """
  source = (REPO / module).read_text()
  mutated = mutate_file_contents(module, source)
  return [
      get_mutant_name(pathlib.Path(module), n) for n in mutated.mutant_names
  ]


def sample_mutants(names, size, seed):
  """A seeded random sample of `size` of `names` (all of them if fewer)."""
  if size >= len(names):
    return list(names)
  return sorted(random.Random(seed).sample(sorted(names), size))


def wilson_interval(killed, tested):
  """The 95% Wilson score interval of the kill rate of a sample."""
  interval = scipy.stats.binomtest(killed, tested).proportion_ci(
      confidence_level=0.95, method="wilson"
  )
  return interval.low, interval.high


# The frames of mutmut's progress spinner (a line of its log starts with one).
SPINNER = tuple("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏")


def _mutmut():
  return str(pathlib.Path(sys.executable).parent / "mutmut")


def mutate_and_report(module, selected, max_children, sampled, show):
  """Runs mutmut on `module` (the mutants `selected`, or all), prints the table
  row's counts (with the Wilson interval where `sampled`) and the survivors
  (their diffs where `show`); returns mutmut's exit status."""
  scratch = prepare_scratch(module)
  env = dict(os.environ)
  # mutmut puts its mutated copy first on sys.path; a PYTHONPATH naming this
  # checkout would not hurt the tests in-process, but keep it out of the way.
  env.pop("PYTHONPATH", None)
  log = scratch / "mutmut.log"
  print(f"mutating {module} (mutmut's output: {log})", flush=True)
  command = [_mutmut(), "run", "--max-children", str(max_children)]
  if selected:
    command.extend(selected)
  with open(log, "w") as f:
    run = subprocess.run(
        command,
        cwd=scratch,
        env=env,
        stdout=f,
        stderr=subprocess.STDOUT,
        check=False,
    )
  if run.returncode:
    # mutmut redraws a spinner line many times a second: keep the rest (the
    # failing clean test's output, mutmut's own error).
    lines = log.read_text().splitlines()
    kept = [line for line in lines if not line.lstrip().startswith(SPINNER)]
    print("\n".join(kept[-60:]))
  statuses = read_results(scratch)
  equivalent = equivalent_mutants()
  for name, status in statuses.items():
    if status == "survived" and name in equivalent:
      statuses[name] = "equivalent"
  counts = collections.Counter(statuses.values())
  # A mutant no listed test runs ("no tests") is one they would miss; a
  # timeout (the mutant made the tests hang) is one they catch.
  killed = counts["killed"] + counts["timeout"]
  survived = counts["survived"] + counts["no tests"]
  print()
  print(
      f"{module}: {len(statuses)} mutants, "
      + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
  )
  tested = killed + survived
  if tested:
    score = killed / tested
    print(
        f"score = killed / (killed + survived + no tests) = {killed}/"
        f"{tested} = {score:.1%}"
    )
  if tested and sampled:
    low, high = wilson_interval(killed, tested)
    print(
        f"sampled {len(selected)} of {len(statuses)}: 95% Wilson interval"
        f" {low:.1%} to {high:.1%}"
    )
  for name, status in sorted(statuses.items()):
    if status == "not checked":
      continue
    if status == "equivalent":
      print(f"  equivalent: {name} ({equivalent[name]})")
    elif status != "killed":
      print(f"  {status}: {name}")
      if show:
        diff = subprocess.run(
            [_mutmut(), "show", name],
            cwd=scratch,
            capture_output=True,
            text=True,
            check=False,
        )
        print(diff.stdout)
  return run.returncode


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("module", help="e.g. big_vit_lite/trainer/losses.py")
  parser.add_argument(
      "--max-children",
      type=int,
      default=1,
      help="mutants tested at once (default 1: each runs jax on all cores)",
  )
  parser.add_argument(
      "--show", action="store_true", help="print each survivor's diff"
  )
  parser.add_argument(
      "--only",
      metavar="GLOB",
      action="append",
      help=(
          "test only the mutants named so, e.g. 'big_vit_lite.trainer.losses.x_get*'"
          " (repeatable; the others are reported 'not checked')"
      ),
  )
  parser.add_argument(
      "--sample",
      metavar="N",
      type=int,
      help=(
          "test a seeded random sample of N mutants (of those --only names);"
          " the score comes with its 95%% Wilson interval"
      ),
  )
  parser.add_argument(
      "--seed",
      type=int,
      default=0,
      help="the seed of --sample's draw (default 0)",
  )
  args = parser.parse_args()
  module = args.module.removeprefix("./")
  if not (REPO / module).is_file():
    sys.exit(f"error: {module} is not a file of this repository")
  if args.sample is not None and args.sample < 1:
    sys.exit(f"error: --sample {args.sample}: give a number of mutants >= 1")
  selected = args.only
  if args.sample is not None:
    names = mutant_names(module)
    if args.only:
      names = [
          n for n in names if any(fnmatch.fnmatch(n, g) for g in args.only)
      ]
    if not names:
      sys.exit(f"error: no mutants of {module} match --only {args.only}")
    selected = sample_mutants(names, args.sample, args.seed)
    print(
        f"sampled {len(selected)} of {len(names)} mutants (seed {args.seed})",
        flush=True,
    )
  with module_lock(module):
    returncode = mutate_and_report(
        module,
        selected,
        args.max_children,
        sampled=args.sample is not None,
        show=args.show,
    )
  sys.exit(returncode)


if __name__ == "__main__":
  main()
