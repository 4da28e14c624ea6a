"""scripts/same_bits.py: two runs are the same when their losses, evals and saved leaves are."""

import importlib.util
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "same_bits", REPO / "scripts" / "same_bits.py"
)
same_bits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(same_bits)


def _run(root, loss=1.25, step_time=0.04, checksum=123):
  root.mkdir()
  rows = [
      {"step": 10, "training_loss": loss, "step_time": step_time, "mfu": 0.3},
      {"step": 10, "val/prec@1": 0.5},
  ]
  (root / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in rows)
  )
  sums = root / "checkpoints" / "10" / "checksums"
  sums.mkdir(parents=True)
  (sums / "metadata").write_text(
      json.dumps({"params/head/bias": ["float32", checksum]})
  )
  return str(root)


def test_timing_may_differ_losses_and_leaves_may_not(tmp_path):
  base = _run(tmp_path / "a")
  assert not same_bits.differences(base, _run(tmp_path / "b", step_time=0.09))
  assert same_bits.main([base, _run(tmp_path / "c", step_time=0.5)]) == 0
  loss = same_bits.differences(
      base, _run(tmp_path / "d", loss=1.2500000000000002)
  )
  assert loss and "metrics.jsonl line 1" in loss[0]
  leaf = same_bits.differences(base, _run(tmp_path / "e", checksum=124))
  assert leaf == ["checkpoint 10: 1 leaves differ, e.g. params/head/bias"]
  assert same_bits.main([base, str(tmp_path / "e")]) == 1
