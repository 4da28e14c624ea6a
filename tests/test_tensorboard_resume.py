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
import re
import signal

import numpy as np
import pytest
from tensorboard.backend.event_processing import plugin_event_accumulator as event_accumulator
from tensorboard.util import tensor_util

from big_vit_lite.logs import metrics
from trainer_runs import read_losses, run_train, start_train, wait_for_step


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
def test_sigkill_and_resume_shows_each_step_once_in_tensorboard(
    tfds_data_dir, tmp_path
):
  workdir = str(tmp_path / "run")
  args = ("--config.total_steps=300", "--config.ckpt_steps=40")
  proc = start_train(tfds_data_dir, workdir, *args)
  # Steps 81..100+ are past the last checkpoint.
  wait_for_step(proc, workdir, 100)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=30)
  r = run_train(tfds_data_dir, workdir, *args)
  assert r.returncode == 0, r.stderr[-3000:]
  # Usually 80; 40 when a busy machine had not committed the async save of 80 at
  # the kill.
  resumed = int(re.search(r"Resuming from \S+/(\d+)", r.stderr).group(1))
  assert resumed in (40, 80), resumed

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
  # The killed run's steps past the checkpoint are in its file too.
  assert orphans and min(orphans) == resumed + 1, (resumed, orphans)

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
