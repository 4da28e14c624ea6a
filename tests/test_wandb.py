"""config.wandb: a real trainer's run in W&B's offline mode, read back from the files it wrote."""

import glob
import json
import os
import struct

import pytest

from big_vit_lite.logs import metrics
from big_vit_lite.logs import wandb_writer
import trainer_runs


def test_bad_configs_are_one_line():
  with pytest.raises(ValueError, match=r"unknown keys \['projet'\]"):
    wandb_writer.check(dict(projet="x"))
  with pytest.raises(ValueError, match="needs a project"):
    wandb_writer.check(dict(mode="offline"))
  wandb_writer.check(None)  # Not configured: nothing to check.


def _records(path):
  """The protobuf records of an offline run's .wandb file (a leveldb-style log of 32 KiB
  blocks, each record chunk with a 7-byte header: crc32, length, type)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top

  data = open(path, "rb").read()
  assert data[:4] == b":W&B"
  block, pos, pending, out = 32768, 7, b"", []
  while pos + 7 <= len(data):
    left = block - pos % block
    _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
    if left < 7 or (kind == 0 and length == 0):  # The block's zero padding.
      pos += left
      continue
    pending += data[pos + 7 : pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):  # FULL or LAST: a whole record.
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      out.append(record)
      pending = b""
  return out


def _read_run(path):
  """(run id, config, history rows, final summary) of one offline run file."""
  run_id, config, history, summary = None, {}, [], {}
  for r in _records(path):
    kind = r.WhichOneof("record_type")
    key = lambda item: item.key or "/".join(item.nested_key)
    if kind == "run":
      run_id = r.run.run_id
      config |= {key(i): json.loads(i.value_json) for i in r.run.config.update}
    elif kind == "config":
      config |= {key(i): json.loads(i.value_json) for i in r.config.update}
    elif kind == "history":
      history.append({key(i): json.loads(i.value_json) for i in r.history.item})
    elif kind == "summary":
      summary |= {key(i): json.loads(i.value_json) for i in r.summary.update}
  return run_id, config, history, summary


def _logged(history):
  return [
      {k: v for k, v in h.items() if not k.startswith("_")} for h in history
  ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offline_run_holds_the_metrics_config_and_summary_and_resumes(
    tfds_data_dir, tmp_path, monkeypatch
):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  workdir = str(tmp_path / "run")
  config = trainer_runs.TINY + ":wandb"
  p = trainer_runs.run_train(
      tfds_data_dir, workdir, "--config.total_steps=8", config=config
  )
  assert p.returncode == 0, p.stderr[-3000:]
  first = glob.glob(
      os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")
  )
  assert len(first) == 1
  run_id, config_seen, history, summary = _read_run(first[0])
  assert (
      run_id == open(os.path.join(workdir, wandb_writer.ID_FILE)).read().strip()
  )
  assert config_seen["lr"] == 1e-3 and config_seen["model"]["width"] == 16
  rows = metrics.read_metrics(workdir)
  # Every metrics.jsonl row, with the same values (W&B adds its own "_" keys).
  assert _logged(history) == rows
  assert summary["status"] == "finished" and summary["step"] == 8
  assert summary["training_loss"] == rows[-1]["training_loss"]
  # The same command with more steps resumes the run from step 8: the same W&B
  # run goes on.
  p = trainer_runs.run_train(
      tfds_data_dir, workdir, "--config.total_steps=12", config=config
  )
  assert p.returncode == 0, p.stderr[-3000:]
  files = glob.glob(
      os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb")
  )
  second = [f for f in files if f not in first]
  assert len(second) == 1
  resumed_id, _, resumed_history, resumed_summary = _read_run(second[0])
  assert resumed_id == run_id
  assert [h["step"] for h in _logged(resumed_history)] == [9, 10, 11, 12]
  assert _logged(resumed_history) == metrics.read_metrics(workdir)[8:]
  assert (
      resumed_summary["step"] == 12 and resumed_summary["status"] == "finished"
  )
