"""The trainer under faults a user meets: each ends in one line that says what to do, and no
user data is lost or overwritten.

In-process (`train.train`) on the tiny config, so that the errors raised
before the step compiles cost no compile and the one run that trains compiles
once: a Ctrl-C'd run, then resumes of its workdir with a changed model, a
changed optimizer and a damaged checkpoint.
"""

import os
import shutil
import signal
import subprocess
import sys
import threading

from absl import flags
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.config import config_loading
from big_vit_lite.logs import metrics
from big_vit_lite.runtime import paths
from big_vit_lite import train
from big_vit_lite.trainer import train_loop
from big_vit_lite.trainer import train_setup
from trainer_runs import TINY

import checks
import train_config_tiny


def _config(data_dir, **overrides):
  config = train_config_tiny.get_config()
  config.input.data.data_dir = data_dir
  return checks.set_dotted(config, overrides)


# ------------------------------------------------------------ command line


def _parse(*args):
  # ml_collections registers the --config.KEY of sys.argv as flags when the flag
  # is defined.
  sys.argv = ["prog", *args]
  fv = flags.FlagValues()
  config_loading.define_config_flag(flag_values=fv)
  return fv, config_loading.parse_flags(
      ["prog", *args], prog="prog", flag_values=fv
  )


@pytest.fixture(autouse=True)
def _keep_argv(monkeypatch):
  monkeypatch.setattr(sys, "argv", list(sys.argv))


def test_unknown_override_key_is_one_line_naming_it():
  with pytest.raises(SystemExit) as e:
    _parse(f"--config={TINY}", "--config.model.widht=32")
  msg = str(e.value.code)
  assert "\n" not in msg and msg.startswith(
      "prog: error: --config.model.widht:"
  ), msg
  assert "no key 'model.widht' (did you mean 'width'?)" in msg, msg
  with pytest.raises(SystemExit, match="no key 'keep_ckpts'.*placeholder"):
    # Read by the trainer, absent in the file.
    _parse(f"--config={TINY}", "--config.keep_ckpts=3")
  fv, _ = _parse(f"--config={TINY}", "--config.total_steps=7")
  assert fv.config.total_steps == 7


def test_missing_config_file_is_one_line(tmp_path):
  missing = str(tmp_path / "nope.py")
  fv, _ = _parse(f"--config={missing}")
  with pytest.raises(ValueError) as e:
    config_loading.loaded(fv.config)
  assert (
      str(e.value)
      == f"Cannot load the --config file: [Errno 2] No such file or directory: '{missing}'"
  )
  with pytest.raises(
      SystemExit, match="Cannot load the --config file: .*No such file"
  ):
    # An override makes ml_collections read it.
    _parse(f"--config={missing}", "--config.lr=0.1")


def test_config_file_with_a_syntax_error_is_one_line(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config(arg=None):\n  return dict(lr=0.1,\n")
  with pytest.raises(SystemExit) as e:
    _parse(f"--config={bad}")
  msg = str(e.value.code)
  assert "\n" not in msg and msg.startswith(
      f"prog: error: the config file {bad} does not parse:"
  ), msg


# ------------------------------------------------- errors before any compile


@pytest.mark.parametrize(
    "key,value,match",
    [
        (
            "total_steps",
            0,
            "config.total_steps must be a positive number of steps, got 0",
        ),
        ("total_steps", -5, "config.total_steps must be a positive"),
        (
            "log_training_steps",
            0,
            "config.log_training_steps must be a positive",
        ),
        # Orbax would delete every one.
        ("keep_ckpts", 0, "config.keep_ckpts must be a positive"),
        (
            "keep_ckpt_steps",
            0,
            "config.keep_ckpt_steps must be a positive.*leave it unset",
        ),
        ("keep_ckpt_steps", -1, "config.keep_ckpt_steps must be a positive"),
    ],
)
def test_nonsense_step_counts_are_one_line_errors(
    tfds_data_dir, tmp_path, key, value, match
):
  with pytest.raises(ValueError, match=match):
    train.train(_config(tfds_data_dir, **{key: value}), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w" / "config.json")


def test_train_pp_without_labels_is_one_line(tfds_data_dir, tmp_path):
  pp = "decode(1)|value_range(-1, 1)|keep('image', 'label')"
  with pytest.raises(
      ValueError,
      match=r"the train pp gives \{'image': 'float32\[28, 28, 1\]', "
      r"'label': 'int64\[\]'\}: .*onehot\(K, key='label'",
  ):
    train.train(_config(tfds_data_dir, **{"input.pp": pp}), str(tmp_path / "w"))
  # Class ids.
  pp = "decode(1)|value_range(-1, 1)|rename('label', 'labels')|keep('image', 'labels')"
  with pytest.raises(
      ValueError,
      match=r"'labels': 'int64\[\]'\}: the step needs 'image' and "
      "one-hot float 'labels'",
  ):
    train.train(_config(tfds_data_dir, **{"input.pp": pp}), str(tmp_path / "w"))


def test_workdir_that_is_a_file_or_locked(tfds_data_dir, tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("my notes\n")
  with pytest.raises(train.TrainingError, match="File exists"):
    train.train(_config(tfds_data_dir), str(afile))
  assert afile.read_text() == "my notes\n"
  workdir = tmp_path / "busy"
  workdir.mkdir()
  with paths.lock_workdir(workdir):  # What a running trainer holds.
    with pytest.raises(
        ValueError,
        match=rf"Another trainer \(pid {os.getpid()} .*--workdir {workdir}",
    ):
      train.train(_config(tfds_data_dir), str(workdir))
  assert os.listdir(workdir) == [".lock"]


# ------------------------------------- Ctrl-C, then resumes of that workdir


def _interrupt_at(workdir, step, stop):
  """Sends this process SIGINT once `workdir` has logged `step` (as Ctrl-C would).

  Never after `stop` is set: a stray SIGINT would end the whole pytest session.
  """

  def run():
    while not stop.wait(0.02):
      try:
        if any(r["step"] >= step for r in metrics.read_metrics(workdir)):
          os.kill(os.getpid(), signal.SIGINT)
          return
      except (OSError, ValueError):
        pass

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return thread


@pytest.mark.timeout(240)
# A failed restore leaves tensorstore reads whose callbacks find orbax's event
# loop closed.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_saves_then_changed_or_damaged_resumes_fail_clearly(
    tfds_data_dir, tmp_path
):
  workdir = str(tmp_path / "run")
  handler_before = signal.getsignal(signal.SIGINT)
  stop = threading.Event()
  thread = _interrupt_at(workdir, 3, stop)
  try:
    with pytest.raises(
        train.TrainingInterrupted,
        match="saved step \\d+ .* run the same command",
    ):
      train.train(
          _config(tfds_data_dir, total_steps=100_000, ckpt_steps=0), workdir
      )
  # Not pytest's own Ctrl-C: the trainer did not handle it.
  except KeyboardInterrupt:
    pytest.fail(
        "Ctrl-C stopped the trainer with KeyboardInterrupt instead of a save"
    )
  finally:
    stop.set()
    thread.join()
  # Handlers are put back.
  assert signal.getsignal(signal.SIGINT) is handler_before
  saved = checkpoint.complete_steps(workdir)
  assert len(saved) == 1 and 3 <= saved[0] < 100_000, saved
  assert metrics.read_metrics(workdir)[-1]["step"] == saved[0]
  config_json = open(os.path.join(workdir, "config.json")).read()

  # Another model width: one line naming the array, before compiling.
  with pytest.raises(train.TrainingError) as e:
    train.train(
        _config(
            tfds_data_dir,
            total_steps=100_000,
            ckpt_steps=0,
            **{"model.width": 32},
        ),
        workdir,
    )
  msg = str(e.value)
  assert "\n" not in msg and "Cannot resume from" in msg, msg
  assert (
      "'params/" in msg
      and "(16,) in the checkpoint, (32,) in this config" in msg
  ), msg
  # The changed key, from the checkpoint's config; no model_init advice (another
  # width's params cannot initialise this model either).
  assert (
      "config keys changed since the checkpoint: model.width 16 -> 32)" in msg
  ), msg
  assert (
      "Use a new --workdir, or undo the change." in msg
      and "model_init" not in msg
  ), msg
  # Another optimizer: its params can start a new run, as the line says.
  with pytest.raises(
      train.TrainingError, match="Cannot resume from .*opt_state"
  ) as e:
    train.train(
        _config(
            tfds_data_dir, total_steps=100_000, ckpt_steps=0, optax_name="sgd"
        ),
        workdir,
    )
  msg = str(e.value)
  assert "optax_name scale_by_adam -> sgd" in msg, msg
  model_init = msg.split("config.model_init=")[1].split(" ")[0]
  fresh = str(tmp_path / "fresh")
  train.train(
      _config(
          tfds_data_dir,
          total_steps=1,
          ckpt_steps=0,
          optax_name="sgd",
          model_init=model_init,
      ),
      fresh,
  )
  assert checkpoint.complete_steps(fresh) == [1]
  # The failed attempts left the run's config.json and checkpoint alone.
  assert open(os.path.join(workdir, "config.json")).read() == config_json
  assert checkpoint.complete_steps(workdir) == saved

  # A checkpoint damaged after it was committed (a file deleted): says which and
  # what to do.
  step_dir = os.path.join(workdir, "checkpoints", str(saved[0]))
  # An older good one.
  shutil.copytree(step_dir, os.path.join(workdir, "checkpoints", "1"))
  os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))
  with pytest.raises(train.TrainingError) as e:
    train.train(
        _config(tfds_data_dir, total_steps=100_000, ckpt_steps=0), workdir
    )
  msg = str(e.value)
  assert "\n" not in msg and f"Cannot read checkpoint {step_dir}" in msg, msg
  assert (
      f"move it out of {os.path.dirname(step_dir)}" in msg
      and "resume from step 1" in msg
  ), msg


# ------------------------------------------- final evals after a late stop


@pytest.mark.timeout(240)
def test_final_evals_run_on_a_resume_that_missed_them(
    tfds_data_dir, tmp_path, monkeypatch
):
  """A run killed after its final checkpoint but before its final evals logged them."""
  # The eval data has no data_dir of its own.
  monkeypatch.setenv("TFDS_DATA_DIR", tfds_data_dir)
  workdir = str(tmp_path / "run")

  def run_and_read(arg):
    config = train_config_tiny.get_config(arg)
    config.input.data.data_dir = tfds_data_dir
    config.total_steps, config.ckpt_steps = 2, 0
    train.train(config, workdir)
    return [r for r in metrics.read_metrics(workdir) if "val/prec@1" in r]

  # What a kill during the final eval leaves: the final checkpoint, no eval
  # line. (Made by a run without evals: the same files, without compiling the
  # evaluator here.)
  assert not run_and_read(None)
  evals = run_and_read("evals")
  assert [r["step"] for r in evals] == [2] and 0 <= evals[0][
      "val/prec@1"
  ] <= 1, evals
  assert metrics.read_metrics(workdir)[-1] == evals[0]


def test_only_the_final_evals_not_logged_run_again(tmp_path):
  writer = metrics.MetricWriter(tmp_path, tensorboard=False)
  writer.write(12, {"training_loss": 1.0})
  writer.write(12, {"val/prec@1": 0.5, "val/loss": 1.0})
  # An earlier step does not count.
  writer.write(6, {"fewshot/mnist10k_10shot": 0.3})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 12, "fewsh')  # Torn by a kill.
  evaluators = {"val": None, "fewshot": None}
  assert train_loop.evals_not_logged(writer, evaluators, 12) == ["fewshot"]
  assert train_loop.evals_not_logged(writer, evaluators, 13) == [
      "val",
      "fewshot",
  ]


# ------------------------------------------------------------- model_init


@pytest.mark.timeout(240)
def test_model_init_posemb_resampled_to_a_non_square_grid(
    tfds_data_dir, tmp_path
):
  """A 4x4-grid checkpoint fine-tuned at 28x63 (a 4x9 grid: 36 tokens, as many as 6x6)."""
  import jax
  import numpy as np
  from big_vit_lite.models import layout
  from big_vit_lite.models import vit

  config = _config(tfds_data_dir, total_steps=1, ckpt_steps=0, lr=0.0, wd=0.0)
  config.input.pp = config.input.pp.replace("|flip_lr", "|resize((28, 63))")
  src = jax.eval_shape(
      vit.Model(**config.model).init,
      jax.random.key(0),
      np.zeros((1, 28, 28, 1)),
  )
  rng = np.random.default_rng(0)
  src = jax.tree.map(
      lambda s: rng.normal(0, 0.1, s.shape).astype(s.dtype), src["params"]
  )
  vit.save_npz(src, tmp_path / "init.npz")
  config.model_init = str(tmp_path / "init.npz")
  config.device_aug = None
  train.train(config, str(tmp_path / "w"))
  got, _ = checkpoint.load_params(str(tmp_path / "w"))
  grid4 = layout.to_numpy_flat(src)["Transformer/posembed_input/pos_embedding"]
  # A second implementation as the oracle: resample itself would hide a
  # transposed grid.
  np.testing.assert_allclose(
      got["Transformer"]["posembed_input"]["pos_embedding"],
      checks.posemb_resized(grid4, (4, 4), (4, 9)),
      atol=1e-5,
  )


@pytest.mark.timeout(240)
def test_a_failing_eval_keeps_the_checkpoint_saved_just_before(
    tfds_data_dir, tmp_path, monkeypatch
):
  """An eval that raises right after an async save: the save still completes (and commits)."""
  from big_vit_lite.evaluators import classification

  def boom(self, params):
    raise RuntimeError("eval failed")

  monkeypatch.setenv("TFDS_DATA_DIR", tfds_data_dir)
  monkeypatch.setattr(classification.Evaluator, "run", boom)
  config = train_config_tiny.get_config("evals")
  config.input.data.data_dir = tfds_data_dir
  config.total_steps, config.ckpt_steps = 12, 6
  workdir = str(tmp_path / "w")
  with pytest.raises(RuntimeError, match="eval failed"):
    train.train(config, workdir)
  # Read at once: nothing may still be writing step 6 once train has returned.
  assert checkpoint.complete_steps(workdir) == [6]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "name,reason",
    [
        ("run[lr=1e-3]", "'[...]' (orbax globs the path"),
        ("a\\b", "a backslash (tensorstore reads it as '/')"),
    ],
)
def test_workdir_orbax_cannot_keep_checkpoints_under_is_refused(
    tfds_data_dir, tmp_path, name, reason
):
  # Such a run trained to the end, then no checkpoint of it could be read.
  workdir = tmp_path / name
  with pytest.raises(ValueError) as e:
    train.train(_config(tfds_data_dir), str(workdir))
  assert str(e.value).startswith(f"--workdir {workdir} has {reason}"), e.value
  assert str(e.value).endswith("use a directory name without it."), e.value
  assert not workdir.exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_before_the_first_step_is_one_line(
    tfds_data_dir, tmp_path, monkeypatch
):
  """Ctrl-C while the run starts (reading the data, restoring, compiling): no traceback."""
  make_iterator = train_setup.input_pipeline.make_train_iterator

  def interrupted(*args, **kwargs):
    # Python's own handler: KeyboardInterrupt.
    os.kill(os.getpid(), signal.SIGINT)
    return make_iterator(*args, **kwargs)

  monkeypatch.setattr(
      train_setup.input_pipeline, "make_train_iterator", interrupted
  )
  # (xdist workers ignore it.)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(train.TrainingInterrupted) as e:
      train.train(_config(tfds_data_dir), str(tmp_path))
  except KeyboardInterrupt:
    pytest.fail(
        "Ctrl-C before the first step ended in a KeyboardInterrupt traceback"
    )
  finally:
    signal.signal(signal.SIGINT, previous)
  assert str(e.value) == (
      f"interrupted (Ctrl-C); no checkpoint was saved in "
      f"{tmp_path}/checkpoints: run the same command to start again."
  )


@pytest.fixture
def small_disk(tmp_path):
  """A 4 MiB tmpfs (root only), unmounted afterwards."""
  mount = tmp_path / "disk"
  mount.mkdir()
  p = subprocess.run(
      ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
      capture_output=True,
      text=True,
      check=False,
  )
  if p.returncode:
    pytest.skip(f"cannot mount a tmpfs: {p.stderr.strip()}")
  yield mount
  subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_disk_full_keeps_the_last_checkpoint_then_resumes(
    tfds_data_dir, small_disk, monkeypatch
):
  """The disk fills up (another job, logs) during a save, then between saves; each time the
  run stops with one line naming the checkpoint a rerun resumes from."""
  workdir = str(small_disk / "run")
  filler = small_disk / "filler"

  def fill_disk():
    with open(filler, "wb") as f:
      try:
        while True:
          f.write(b"\0" * 65536)
          f.flush()
      except OSError:
        pass

  def expect_disk_full(config, last_step):
    with pytest.raises(train.TrainingError) as e:
      train.train(config, workdir)
    msg = str(e.value)
    assert "\n" not in msg and "no space left on device" in msg.lower(), msg
    assert (
        f"the last complete checkpoint is step {last_step} in {workdir}/checkpoints: free "
        "space on the disk of --workdir"
    ) in msg, msg
    assert msg.endswith("run the same command to resume."), msg
    assert checkpoint.complete_steps(workdir) == [4, 8][: last_step // 4]
    filler.unlink()  # The user frees space and runs the same command.

  save = checkpoint.Checkpointer.save

  def fill_disk_then_save(self, step, *args, **kwargs):
    if step == 8:
      self.wait()  # Step 4 is saved.
      fill_disk()
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.Checkpointer, "save", fill_disk_then_save)
  # Was orbax's RESOURCE_EXHAUSTED error.
  expect_disk_full(_config(tfds_data_dir), 4)
  monkeypatch.setattr(checkpoint.Checkpointer, "save", save)

  write = metrics.MetricWriter.write

  def fill_disk_then_write(self, step, *args, **kwargs):
    if step == 10:
      fill_disk()
    return write(self, step, *args, **kwargs)

  monkeypatch.setattr(metrics.MetricWriter, "write", fill_disk_then_write)
  # Was an OSError traceback (metrics.jsonl), or TensorFlow's (TensorBoard's
  # events).
  expect_disk_full(_config(tfds_data_dir, ckpt_async=False), 8)
  monkeypatch.setattr(metrics.MetricWriter, "write", write)

  train.train(_config(tfds_data_dir), workdir)
  assert checkpoint.complete_steps(workdir) == [4, 8, 12]
  steps = [
      r["step"] for r in metrics.read_metrics(workdir) if "training_loss" in r
  ]
