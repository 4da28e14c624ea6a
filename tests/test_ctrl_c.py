"""Ctrl-C on a real trainer process: it saves, says so, and exits at once."""

import signal
import time

import pytest

from big_vit_lite.trainer import checkpoint
from trainer_runs import last_logged_step, start_train, wait_for_step


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_exits_within_5_s_of_its_saved_step_message(
    tfds_data_dir, tmp_path
):
  # The whole split in the shuffle buffer: an interpreter teardown waits in
  # tf.data's iterator destructor while it refills (7 s here for this tiny
  # model, 17-55 s with the demo's).
  workdir = str(tmp_path / "w")
  proc = start_train(
      tfds_data_dir,
      workdir,
      "--config.total_steps=100000",
      "--config.ckpt_steps=1000",
      "--config.input.shuffle_buffer_size=60000",
  )
  try:
    wait_for_step(proc, workdir, 3)
    proc.send_signal(signal.SIGINT)
    # Until the message (the save and the cleanup come first).
    for line in proc.stderr:
      if "interrupted (Ctrl-C): saved step" in line:
        said_at = time.monotonic()
        break
    else:
      pytest.fail(f"no 'saved step' message; exit status {proc.wait()}")
    proc.wait(timeout=60)
    waited = time.monotonic() - said_at
  finally:
    proc.kill()
  assert proc.returncode == 130
  assert waited < 5, f"exited {waited:.1f} s after its message"
  saved = checkpoint.complete_steps(workdir)
  assert len(saved) == 1 and saved[0] == last_logged_step(workdir) >= 3, saved
