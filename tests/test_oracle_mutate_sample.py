"""scripts/mutate.py --sample: the draw and the interval a sampled table row reports."""

import importlib.util
import math
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "mutate", REPO / "scripts" / "mutate.py"
)
mutate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutate)


def test_wilson_interval_matches_the_hand_worked_formula():
  """Guards against the wrong interval on a sampled row: the normal (Wald) one,
  which is 0 wide at 100% and can leave [0, 1]; a 90% or 99% level; the
  bounds swapped. Oracle: Wilson's closed form worked by hand with z = 1.96."""
  z = 1.959963984540054
  for killed, tested in [(4, 4), (30, 40), (0, 5)]:
    p = killed / tested
    centre = (p + z * z / (2 * tested)) / (1 + z * z / tested)
    half = (z / (1 + z * z / tested)) * math.sqrt(
        p * (1 - p) / tested + z * z / (4 * tested * tested)
    )
    low, high = mutate.wilson_interval(killed, tested)
    assert math.isclose(low, max(centre - half, 0.0), abs_tol=1e-9)
    assert math.isclose(high, min(centre + half, 1.0), abs_tol=1e-9)
  # All 4 killed: the lower bound is n / (n + z^2), not 100%.
  assert math.isclose(
      mutate.wilson_interval(4, 4)[0], 4 / (4 + z * z), rel_tol=1e-9
  )


def test_sample_is_seeded_distinct_and_from_the_module():
  """Guards against a sample that changes between runs of one seed (a row
  no one can reproduce), repeats a mutant, ignores the seed, or names mutants
  mutmut does not make. Oracle: the module's mutant names as mutmut lists
  them, counted by name pattern."""
  names = mutate.mutant_names("big_vit_lite/trainer/losses.py")
  assert len(names) == len(set(names))
  assert all(n.startswith("big_vit_lite.trainer.losses.x_") for n in names)
  assert all("__mutmut_" in n for n in names)
  first = mutate.sample_mutants(names, 10, seed=0)
  assert first == mutate.sample_mutants(list(reversed(names)), 10, seed=0)
  assert len(set(first)) == 10 and set(first) <= set(names)
  assert first != mutate.sample_mutants(names, 10, seed=1)
  assert sorted(mutate.sample_mutants(names, len(names) + 5, 0)) == sorted(
      names
  )


def test_a_second_run_of_a_module_waits_for_the_first(monkeypatch, tmp_path):
  """Guards: two runs on one module sharing .mutate/<module>/ (the second's
  prepare_scratch removed the folder under the first's mutmut, whose clean
  tests failed: 28 mutants, 28 not checked, exit 1; seen in CI when two docs
  rows ran on two xdist workers)."""
  import threading  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(mutate, "REPO", tmp_path)
  module = "big_vit_lite/trainer/losses.py"
  events = []
  second_entered = threading.Event()

  def second_run():
    with mutate.module_lock(module):
      events.append("second runs")
      second_entered.set()

  with mutate.module_lock(module):
    events.append("first runs")
    thread = threading.Thread(target=second_run)
    thread.start()
    # The second waits while the first holds the lock.
    assert not second_entered.wait(timeout=0.5)
    events.append("first done")
  thread.join(timeout=10)
  assert events == ["first runs", "first done", "second runs"]
  # Another module's run does not wait.
  with mutate.module_lock(module), mutate.module_lock("big_vit_lite/ema.py"):
    pass
