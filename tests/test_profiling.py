"""config.profile_steps: jax.profiler traces of chosen training steps, under the workdir."""

import glob
import gzip
import json
import os
import re

import pytest

from big_vit_lite.trainer import profiling
from big_vit_lite import train

import checks
import train_config_tiny

# The compiled train step as the profiler names its calls (a jitted `update`,
# `train_step`...).
STEP_EVENT = re.compile(r"PjitFunction\(jit\(\w*(update|step)\w*\)\)")


def _step_calls(trace_events):
  """How many step calls a trace holds: its events' start times, nested ones merged (1 ms)."""
  starts = sorted(
      e["ts"]
      for e in trace_events
      if e.get("ph") == "X" and STEP_EVENT.fullmatch(str(e.get("name")))
  )
  return sum(
      1 for i, ts in enumerate(starts) if i == 0 or ts - starts[i - 1] > 1000
  )


def test_profile_steps_trace_only_those_steps_where_tensorboard_finds_them(
    tfds_data_dir, tmp_path
):
  raw = train_config_tiny.get_config()
  raw.input.data.data_dir = tfds_data_dir
  raw.total_steps, raw.ckpt_steps = 6, 0
  raw.profile_steps = [2, 3, 5]  # Two traces: steps 2-3, and step 5.
  workdir = tmp_path / "w"
  train.train(raw, str(workdir))
  # TensorBoard (--logdir=WORKDIR) finds RUN/plugins/profile/<time>/*.xplane.pb
  # under it.
  runs = {
      os.path.basename(r): glob.glob(os.path.join(r, "plugins", "profile", "*"))
      for r in glob.glob(str(workdir / "profile" / "*"))
  }
  assert sorted(runs) == ["step_2", "step_5"], runs
  calls = {}
  for name, (session,) in runs.items():
    assert glob.glob(os.path.join(session, "*.xplane.pb")), session
    with gzip.open(os.path.join(session, "perfetto_trace.json.gz")) as f:
      trace = json.load(f)
    calls[name] = _step_calls(
        trace["traceEvents"] if isinstance(trace, dict) else trace
    )
  assert calls == {"step_2": 2, "step_5": 1}


@pytest.mark.parametrize("value", [0, -3, [2, "x"], 2.5, [True]])
def test_bad_profile_steps_are_one_line(value):
  checks.one_line_error(
      lambda: profiling.parse_steps(value),
      "config.profile_steps=",
      "give training step numbers >= 1",
  )


def test_profile_steps_forms():
  assert profiling.parse_steps(None) == ()
  assert profiling.parse_steps(7) == (7,)
  assert profiling.parse_steps([9, 3, 3]) == (3, 9)
