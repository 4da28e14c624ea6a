"""Faults found by an audit of the trainer: each ends in one line that says what to do.

A config file whose own code fails, an override under a dict the file lacks, a
workdir whose name orbax cannot keep checkpoints under, Ctrl-C before the first
step, a checkpoint file cut short, and a disk that fills up during a save (the
run before that save survives and resumes). In-process on the tiny config.
"""
import glob
import os
import signal
import subprocess
import sys

from absl import flags
import jax
import jax.numpy as jnp
import pytest

from big_vit_lite import checkpoint
from big_vit_lite import config_loading
from big_vit_lite import metrics
from big_vit_lite import resume
from big_vit_lite import train
from big_vit_lite import train_setup
from trainer_runs import TINY

import train_config_tiny

# A failed restore leaves tensorstore reads whose coroutines are closed when collected (in
# whichever test runs then); the trainer's command line drops them (test_checkpoint.py).
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _config(data_dir, **overrides):
  config = train_config_tiny.get_config()
  config.input.data.data_dir = data_dir
  for key, value in overrides.items():
    config[key] = value
  return config


def _parse(*args):
  sys.argv = ["prog", *args]  # ml_collections reads the --config.KEY overrides from sys.argv.
  sys.modules.pop("config_config", None)  # Else ml_collections runs the file in the last one's.
  fv = flags.FlagValues()
  config_loading.define_config_flag(flag_values=fv)
  return config_loading.parse_flags(["prog", *args], prog="prog", flag_values=fv)


@pytest.fixture(autouse=True)
def _keep_argv(monkeypatch):
  monkeypatch.setattr(sys, "argv", list(sys.argv))


def _one_line_exit(*args):
  with pytest.raises(SystemExit) as e:
    _parse(*args)
  msg = str(e.value.code)
  assert "\n" not in msg and msg.startswith("prog: error: "), msg
  return msg


# ------------------------------------------------------------ command line

def test_override_under_a_dict_the_file_lacks_is_one_line():
  # Was a KeyError traceback: the tiny config has no `optax` dict.
  msg = _one_line_exit(f"--config={TINY}", "--config.optax.mu_dtype=bfloat16")
  assert msg.startswith("prog: error: --config.optax.mu_dtype: the config file has no key "
                        "'optax'."), msg
  msg = _one_line_exit(f"--config={TINY}", "--config.modl.width=32")
  assert "no key 'modl' (did you mean 'model'?)" in msg, msg


def test_override_of_a_none_or_list_key_says_what_to_change():
  # Tiny's model.variant is None, its mesh a list. Was ml_collections' "Type <class 'NoneType'>
  # of field config.model.variant is not supported for overriding. Currently supported types
  # are: dict_keys([<class 'float'>, ...".
  msg = _one_line_exit(f"--config={TINY}", "--config.model.variant=Ti/16")
  assert msg == ("prog: error: --config.model.variant: the config file sets it to None, so its "
                 "type is unknown: make it config_dict.placeholder(TYPE) there (e.g. "
                 "placeholder(str)) to set it from the command line."), msg
  msg = _one_line_exit(f"--config={TINY}", "--config.mesh=fsdp")
  assert msg.startswith("prog: error: --config.mesh: a list cannot be set from the command "
                        "line (a tuple can: --config.mesh='(a, b)'): change it in the config "
                        "file."), msg


@pytest.mark.parametrize("body,expected", [
    # Were tracebacks (NameError, AttributeError, ModuleNotFoundError) ...
    ("def get_config(arg=None):\n  return undefined_name\n",
     "the config file {f} failed: NameError: name 'undefined_name' is not defined (line 2)"),
    ("X = 1\n", "the config file {f} has no get_config() function: define get_config(arg=None)."),
    ("import no_such_module_xyz\n",
     "the config file {f} failed: ModuleNotFoundError: No module named 'no_such_module_xyz' "
     "(line 1)"),
    # ... a ValueError a traceback inside absl's message ...
    ("def get_config(arg=None):\n  raise ValueError(f'Unknown config arg {arg!r}')\n",
     "the config file {f}:bad failed: ValueError: Unknown config arg 'bad' (line 2)"),
    # ... and None "--config is required".
    ("def get_config(arg=None):\n  pass\n",
     "--config: get_config() in {f} returned None (a missing return statement?)."),
])
def test_config_file_whose_code_fails_is_one_line(tmp_path, body, expected):
  path = tmp_path / "cfg.py"
  path.write_text(body)
  arg = f"{path}:bad" if ":bad" in expected else str(path)
  msg = _one_line_exit(f"--config={arg}")
  assert msg == "prog: error: " + expected.format(f=path), msg


# ------------------------------------------------------------------ workdir

@pytest.mark.parametrize("name,reason", [("run[lr=1e-3]", "'[...]' (orbax globs the path"),
                                         ("a\\b", "a backslash (tensorstore reads it as '/')")])
def test_workdir_orbax_cannot_keep_checkpoints_under_is_refused(tfds_data_dir, tmp_path, name,
                                                                reason):
  # Such a run trained to the end, then no checkpoint of it could be read.
  workdir = tmp_path / name
  with pytest.raises(ValueError) as e:
    train.train(_config(tfds_data_dir), str(workdir))
  assert str(e.value).startswith(f"--workdir {workdir} has {reason}"), e.value
  assert str(e.value).endswith("use a directory name without it."), e.value
  assert not workdir.exists()
  with pytest.raises(ValueError) as e:
    checkpoint.Checkpointer(str(workdir))  # What the other processes of a multi-host run make.
  assert str(e.value).startswith(f"Checkpoints cannot be saved under {workdir}/checkpoints: its "
                                 f"path has {reason}"), e.value


def test_checkpoints_path_that_is_a_file_is_one_line(tfds_data_dir, tmp_path):
  (tmp_path / "checkpoints").write_text("notes\n")
  with pytest.raises(ValueError) as e:  # Was a NotADirectoryError traceback, after 4 steps.
    train.train(_config(tfds_data_dir), str(tmp_path))
  assert str(e.value) == (f"{tmp_path}/checkpoints is not a directory: move that file away, "
                          "checkpoints are saved there.")
  assert (tmp_path / "checkpoints").read_text() == "notes\n"


# ------------------------------------------------------------------ Ctrl-C

def test_ctrl_c_before_the_first_step_is_one_line(tfds_data_dir, tmp_path, monkeypatch):
  """Ctrl-C while the run starts (reading the data, restoring, compiling): no traceback."""
  make_iterator = train_setup.input_pipeline.make_train_iterator

  def interrupted(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Python's own handler: KeyboardInterrupt.
    return make_iterator(*args, **kwargs)

  monkeypatch.setattr(train_setup.input_pipeline, "make_train_iterator", interrupted)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (xdist workers ignore it.)
  try:
    with pytest.raises(train.TrainingInterrupted) as e:
      train.train(_config(tfds_data_dir), str(tmp_path))
  except KeyboardInterrupt:
    pytest.fail("Ctrl-C before the first step ended in a KeyboardInterrupt traceback")
  finally:
    signal.signal(signal.SIGINT, previous)
  assert str(e.value) == (f"interrupted (Ctrl-C); no checkpoint was saved in "
                          f"{tmp_path}/checkpoints: run the same command to start again.")


# -------------------------------------------------------- damaged checkpoint

def test_checkpoint_file_cut_short_names_the_array_not_a_tensorstore_repr(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  state = {"params": {"a": jnp.arange(4000.0), "b": jnp.ones((50, 50))}}
  for step in (1, 2):
    ckpt.save(step, state, {}, None)
  ckpt.close()
  data = glob.glob(str(tmp_path / "checkpoints" / "2" / "state" / "**" / "d" / "*"), recursive=True)
  os.truncate(max(data, key=os.path.getsize), 100)  # params/a, cut short.
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  with pytest.raises(train.TrainingError) as e:
    resume.restore(checkpoint.Checkpointer(str(tmp_path)), 2, abstract)
  msg = str(e.value)
  # Was "(Encountered error while reading array index: ... See full TensorStore details:
  # <bound method pybind11_detail_function_record_v1_...spec of TensorStore({...".
  assert msg.startswith(f"Cannot read checkpoint {tmp_path}/checkpoints/2 (OUT_OF_RANGE: Error "
                        'reading "params.a/0"'), msg
  assert "TensorStore details" not in msg and msg.endswith("to resume from step 1."), msg


# ----------------------------------------------------------------- disk full

@pytest.fixture
def small_disk(tmp_path):
  """A 4 MiB tmpfs (root only), unmounted afterwards."""
  mount = tmp_path / "disk"
  mount.mkdir()
  p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                     capture_output=True, text=True, check=False)
  if p.returncode:
    pytest.skip(f"cannot mount a tmpfs: {p.stderr.strip()}")
  yield mount
  subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_disk_full_keeps_the_last_checkpoint_then_resumes(tfds_data_dir, small_disk, monkeypatch):
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
    assert (f"the last complete checkpoint is step {last_step} in {workdir}/checkpoints: free "
            "space on the disk of --workdir") in msg, msg
    assert msg.endswith("run the same command to resume."), msg
    assert checkpoint.complete_steps(workdir) == [4, 8][:last_step // 4]
    filler.unlink()  # The user frees space and runs the same command.

  save = checkpoint.Checkpointer.save

  def fill_disk_then_save(self, step, *args, **kwargs):
    if step == 8:
      self.wait()  # Step 4 is saved.
      fill_disk()
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint.Checkpointer, "save", fill_disk_then_save)
  expect_disk_full(_config(tfds_data_dir), 4)  # Was orbax's RESOURCE_EXHAUSTED error.
  monkeypatch.setattr(checkpoint.Checkpointer, "save", save)

  write = metrics.MetricWriter.write

  def fill_disk_then_write(self, step, *args, **kwargs):
    if step == 10:
      fill_disk()
    return write(self, step, *args, **kwargs)

  monkeypatch.setattr(metrics.MetricWriter, "write", fill_disk_then_write)
  # Was an OSError traceback (metrics.jsonl), or TensorFlow's (TensorBoard's events).
  expect_disk_full(_config(tfds_data_dir, ckpt_async=False), 8)
  monkeypatch.setattr(metrics.MetricWriter, "write", write)

  train.train(_config(tfds_data_dir), workdir)
  assert checkpoint.complete_steps(workdir) == [4, 8, 12]
  steps = [r["step"] for r in metrics.read_metrics(workdir) if "training_loss" in r]
  assert steps == list(range(1, 13)), steps

def test_flipped_bytes_in_a_checkpoint_do_not_resume_silently(tmp_path):
  # Random floats: zstd stores them as they are, so the flip changes values, not the format.
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  state = {"params": {"a": jax.random.normal(jax.random.key(0), (4000,)), "b": jnp.ones(3)}}
  for step in (1, 2):
    ckpt.save(step, state, {}, None)
  ckpt.close()
  data = glob.glob(str(tmp_path / "checkpoints" / "2" / "state" / "**" / "d" / "*"), recursive=True)
  with open(max(data, key=os.path.getsize), "r+b") as f:
    f.seek(5000)
    f.write(b"\xff" * 4)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  with pytest.raises(train.TrainingError) as e:  # Was restored as it was, params/a changed.
    resume.restore(checkpoint.Checkpointer(str(tmp_path)), 2, abstract)
  assert str(e.value).startswith(f"Cannot read checkpoint {tmp_path}/checkpoints/2 ('params/a' "
                                 "does not match the checksum saved with it); if it is damaged, "
                                 f"move it out of {tmp_path}/checkpoints"), e.value
  restored, _ = resume.restore(checkpoint.Checkpointer(str(tmp_path)), 1, abstract)
  assert jnp.array_equal(restored["params"]["a"], state["params"]["a"])
  # model_init, evaluate and export read it too.
  with pytest.raises(ValueError) as e:
    checkpoint.load_params(str(tmp_path))
  assert str(e.value) == (f"Cannot read checkpoint {tmp_path}/checkpoints/2 ('params/a' does not "
                          "match the checksum saved with it); if it is damaged, pass an older "
                          f"step ({tmp_path}/checkpoints/1).")
