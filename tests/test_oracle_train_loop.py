"""The train loop's cadence and its throughput figures, by hand, in-process (no model, no data)."""

import os
import types

import jax
import jax.numpy as jnp
import pytest

from big_vit_lite.logs import console
from big_vit_lite.logs import metrics
from big_vit_lite.trainer import train_loop


class _Clock:
  """time.perf_counter, set by hand."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_throughput_leaves_out_the_compile_and_the_paused_evals(monkeypatch):
  """Guards: img/sec and step time over wall time that includes the evals and
  checkpoints between pause() and resume() (the paused seconds not subtracted,
  or subtracted again at the next tick), the first tick (the compile) counted
  as training, core-hours from wall time or without the earlier attempts',
  ETA from the steps done instead of the steps left. Oracle: a clock set by
  hand, the figures worked out below."""
  clock = _Clock()
  # Only metrics.py's clock: other threads of the process keep the real one.
  monkeypatch.setattr(
      metrics, "time", types.SimpleNamespace(perf_counter=clock)
  )
  chrono = metrics.Chrono(
      total_steps=100,
      global_batch=32,
      step_flops=1e9,
      peak_flops_total=1e11,
      core_hours_before=0.5,
  )
  cores = chrono.num_devices
  if jax.devices()[0].platform == "cpu":
    cores = os.cpu_count() * jax.process_count()
  clock.now = 5.0  # The compile and the first step: no figures yet.
  assert chrono.tick(0) == {}
  clock.now = 7.0  # Steps 1-10 in 2 s.
  first = chrono.tick(10)
  chrono.pause()
  clock.now = 10.0  # A 3 s eval.
  chrono.resume()
  clock.now = 11.0  # Steps 11-15 in 1 s.
  second = chrono.tick(15)
  clock.now = 13.0  # Steps 16-20 in 2 s, nothing paused.
  third = chrono.tick(20)
  for got, step_time, step, trained in (
      (first, 0.2, 10, 2.0),
      (second, 0.2, 15, 3.0),
      (third, 0.4, 20, 5.0),
  ):
    assert got["step_time"] == pytest.approx(step_time)
    assert got["img/sec"] == pytest.approx(32 / step_time)
    assert got["img/sec/device"] == pytest.approx(
        32 / step_time / chrono.num_devices
    )
    assert got["eta_hours"] == pytest.approx((100 - step) * step_time / 3600)
    assert got["core_hours"] == pytest.approx(0.5 + trained * cores / 3600)
    assert got["mfu"] == pytest.approx(1e9 / step_time / 1e11)
  assert third["uptime_hours"] == pytest.approx(13.0 / 3600)


class _Writer:

  def __init__(self):
    self.rows = []

  def write(self, step, row):
    self.rows.append((step, row))

  def close(self):
    pass


class _Checkpointer:
  directory = "ckpts"

  def __init__(self):
    self.saved = []

  def save(self, step, state, data_state, config):
    self.saved.append((step, data_state))

  def close(self):
    pass

  def wait(self):
    pass


class _Evaluator:

  def __init__(self, name, calls):
    self.name, self.calls = name, calls

  def run(self, params):
    self.calls.append((self.name, float(params["step"])))
    return {"score": 1.0}


class _Batches:
  """The train batches: batch i is step i's, and the position is the count returned."""

  def __init__(self):
    self.returned = 0

  def __next__(self):
    self.returned += 1
    return self.returned

  def get_state(self):
    return {"position": self.returned}


def _loop(*, total_steps, log_steps, ckpt_steps, evals):
  """A Loop whose step, data, checkpointer, writer and evals are fakes that record calls."""
  loop = object.__new__(train_loop.Loop)
  calls = []
  loop.inputs = types.SimpleNamespace(
      total_steps=total_steps,
      log_steps=log_steps,
      ckpt_steps=ckpt_steps,
      steps_per_epoch=4.0,
  )
  loop.settings = types.SimpleNamespace(
      evaluators={
          name: (_Evaluator(name, calls), every, "params")
          for name, every in evals.items()
      },
      eval_at_start=False,
  )
  loop.job = types.SimpleNamespace(writer=_Writer())
  loop.checkpointer = _Checkpointer()
  loop.batches = _Batches()
  losses = {s: jax.device_put(jnp.float32(s)) for s in range(total_steps + 1)}

  increment = jax.jit(lambda x: x + 1)  # (The loop forbids implicit transfers.)

  def step_fn(state, batch):
    # The params record the step whose update they hold; the loss is the batch's number.
    new = {"params": {"step": increment(state["params"]["step"])}}
    return new, {"training_loss": losses[batch]}

  loop.step_fn = step_fn
  loop.state = {"params": {"step": jax.device_put(jnp.float32(0))}}
  loop.first_step, loop.resume_step, loop.last_saved = 0, None, None
  loop.data_state = loop.raw_config = None
  loop.summary = types.SimpleNamespace(evaluated=lambda: None, status=None)
  loop.progress = console.Progress(every_s=1e9)
  loop.chrono = types.SimpleNamespace(
      tick=lambda step: {}, pause=lambda: None, resume=lambda: None
  )
  loop.preemption = types.SimpleNamespace(
      reached=lambda step: False, interrupted=False
  )
  loop.guard = types.SimpleNamespace(tick=lambda step: None)
  loop.profiler = types.SimpleNamespace(
      before=lambda step: None, after=lambda step, measured: None
  )
  return loop, calls


def test_logs_checkpoints_and_evals_fall_on_their_steps_and_on_the_last():
  """Guards: the cadence off by one (an eval, a log row or a checkpoint at
  step 0 or one step late, `step % every` before `step += 1`), the last step
  not logged, not evaluated or not saved when total_steps is not a multiple
  of the interval (a finished run whose final numbers and checkpoint are
  missing), an eval of the params before the step's update, a checkpoint
  with the data position of another step, the logged loss average over the
  wrong steps. Oracle: the steps worked out by hand for 10 steps, log every
  4, checkpoint every 3, evals every 4 and 5."""
  loop, calls = _loop(
      total_steps=10, log_steps=4, ckpt_steps=3, evals={"val": 4, "fs": 5}
  )
  loop.run()
  rows = loop.job.writer.rows
  train_rows = [(s, r) for s, r in rows if "training_loss" in r]
  assert [
      (s, r["training_loss"], r["training_loss_avg"], r["epoch"])
      for s, r in train_rows
  ] == [
      (4, 4.0, pytest.approx(2.5), 1.0),  # steps 1-4
      (8, 8.0, pytest.approx(6.5), 2.0),  # steps 5-8
      (10, 10.0, pytest.approx(9.5), 2.5),  # steps 9-10: the last
  ]
  eval_rows = [(s, sorted(r)) for s, r in rows if "training_loss" not in r]
  assert eval_rows == [
      (4, ["val/score"]),
      (5, ["fs/score"]),
      (8, ["val/score"]),
      (10, ["val/score"]),
      (10, ["fs/score"]),
  ]
  assert loop.checkpointer.saved == [
      (3, {"position": 3}),
      (6, {"position": 6}),
      (9, {"position": 9}),
      (10, {"position": 10}),
  ]
  # Each eval scores the params after its step's update.
  assert calls == [
      ("val", 4.0),
      ("fs", 5.0),
      ("val", 8.0),
      ("val", 10.0),
      ("fs", 10.0),
  ]
