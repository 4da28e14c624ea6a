"""TensorBoard after a resume: the steps a killed run logged past its last checkpoint show once.

metrics.jsonl is trimmed to the resumed step; TensorBoard event files cannot
be edited, so the resumed run writes TensorBoard's restart marker
(SessionLog START) and TensorBoard itself drops the orphaned events. Checked
the way a user sees it: with the EventAccumulator TensorBoard serves from
(plugin_event_accumulator; the older event_accumulator module never purges
tensor summaries, which is what TF2 / clu scalars are).
"""

import collections
import math

import numpy as np
import pytest
from tensorboard.backend.event_processing import plugin_event_accumulator as event_accumulator
from tensorboard.util import tensor_util

from big_vit_lite.logs import metrics
from trainer_runs import KILLED_AFTER, read_losses, tiny_killed_twice


def _tensorboard_scalars(workdir, purge=True):
  """{tag: [(step, value), ...]} as TensorBoard shows them (purge=True is its default)."""
  acc = event_accumulator.EventAccumulator(
      str(workdir),
      size_guidance={event_accumulator.TENSORS: 0},
      purge_orphaned_data=purge,
  )
  acc.Reload()
  return {
      tag: [
          (e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
          for e in acc.Tensors(tag)
      ]
      for tag in acc.Tags()["tensors"]
  }


def test_resumed_writer_replaces_orphaned_steps_in_tensorboard(tmp_path):
  writer = metrics.MetricWriter(tmp_path)
  writer.start_run(None)
  for step in range(1, 7):
    writer.write(step, {"loss": float(step)})
  writer.close()  # Then "killed"; the last checkpoint was step 3.

  writer = metrics.MetricWriter(tmp_path)
  writer.start_run(3)
  for step in range(4, 7):
    writer.write(step, {"loss": 10.0 + step})
  writer.close()

  assert [r["loss"] for r in metrics.read_metrics(tmp_path)] == [
      1,
      2,
      3,
      14,
      15,
      16,
  ]
  assert _tensorboard_scalars(tmp_path)["loss"] == [
      (1, 1.0),
      (2, 2.0),
      (3, 3.0),
      (4, 14.0),
      (5, 15.0),
      (6, 16.0),
  ]
  # Without TensorBoard's purge the orphans are there: the marker is what
  # removes them.
  assert len(_tensorboard_scalars(tmp_path, purge=False)["loss"]) == 9


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_and_resume_shows_each_step_once_in_tensorboard(tfds_data_dir):
  """The tiny run killed after step 100 and again after step 161, then run to the end
  (trainer_runs.tiny_killed_twice, shared with test_train.py): two restarts, each leaving
  the killed run's steps past its checkpoint orphaned in the event files."""
  workdir, resumed_from, _ = tiny_killed_twice(tfds_data_dir)
  assert KILLED_AFTER == (100, 161)
  # Usually 80 and 160; 40 and 120 when a busy machine had not committed the
  # async save at the kill.
  first, second = resumed_from
  assert first in (40, 80) and second in (120, 160), resumed_from

  rows = metrics.read_metrics(workdir)
  assert sorted(read_losses(workdir)) == list(range(1, 301))
  # What the resumed run logged, per tag and step (metrics.jsonl is already
  # trimmed).
  expected = collections.defaultdict(dict)
  for row in rows:
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        expected[k][row["step"]] = v

  raw = _tensorboard_scalars(workdir, purge=False)
  orphans = [
      s
      for s, n in collections.Counter(
          s for s, _ in raw["training_loss"]
      ).items()
      if n > 1
  ]
  # The killed runs' steps past their checkpoints are in their files too.
  assert orphans and min(orphans) == first + 1, (resumed_from, orphans)
  assert second + 1 in orphans, (resumed_from, orphans)

  shown = _tensorboard_scalars(workdir)
  assert set(shown) == set(expected)
  for tag, points in shown.items():
    steps = [s for s, _ in points]
    assert len(steps) == len(set(steps)), (
        tag,
        [s for s in steps if steps.count(s) > 1][:5],
    )
    assert sorted(steps) == sorted(expected[tag]), tag
    for step, value in points:  # float32 in TensorBoard.
      assert math.isclose(
          value, np.float32(expected[tag][step]), rel_tol=1e-6
      ), (tag, step)
  # Timing differs between the runs, so the values come from the resumed one.
  assert any(s > 100 for s, _ in shown["step_time"])
