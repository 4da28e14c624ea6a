"""A resumed run's hours in the summary and the report, by hand from a written workdir."""

import json

import pytest

from big_vit_lite import report


def test_a_resumed_attempt_longer_than_the_first_adds_its_hours(tmp_path):
  """Guards: attempts split only where uptime starts again lower (not at
  summary.json's resumed steps), so a resumed attempt that ran longer than
  the one before is read as the same attempt and its hours replace the
  first's (summary's `hours`, the report's hours axis); the report's hours
  of a later attempt offset by the earlier attempt's shortest uptime, not
  its last. Oracle: worked by hand: attempt 1 logs steps 1-2 at 0.1 and
  0.2 h and is resumed from step 2; attempt 2 logs steps 3-4 at 0.3 and
  0.5 h of its own uptime: 0.7 h in all, steps 3-4 at 0.5 and 0.7 h."""
  rows = [
      dict(step=1, training_loss=2.0, uptime_hours=0.1),
      dict(step=2, training_loss=1.8, uptime_hours=0.2),
      dict(step=3, training_loss=1.6, uptime_hours=0.3),
      dict(step=4, training_loss=1.4, uptime_hours=0.5),
  ]
  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows)
  )
  attempts = [dict(start_step=0), dict(start_step=2)]
  (tmp_path / "summary.json").write_text(json.dumps(dict(attempts=attempts)))
  run = report.load(tmp_path)
  assert run["stats"]["hours"] == pytest.approx(0.7)
  assert run["hours"] == pytest.approx([0.1, 0.2, 0.5, 0.7])
  assert run["resume_hours"] == pytest.approx([0.2])
