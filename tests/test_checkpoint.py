"""Checkpointer (orbax): round trip, retention policy, atomicity, load_params sources."""

import glob
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.trainer import resume
from big_vit_lite import train
from trainer_runs import ROOT, run_train


def _state(scale=1.0):
  params = {
      "head": {"kernel": jnp.full((3, 2), scale), "bias": jnp.zeros(2)},
      "embedding": {"kernel": jnp.arange(6.0).reshape(2, 3) * scale},
  }
  return dict(
      params=params,
      opt_state=optax.adam(1e-3).init(params),
      step=jnp.array(5, jnp.int32),
      rng=jax.random.PRNGKey(7),
  )


def _abstract(state):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state,
  )


def test_round_trip_holds_state_data_position_and_config(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  state = _state(2.0)
  cfg = ml_collections.ConfigDict(dict(lr=0.1, model=dict(variant="mu/16")))
  ckpt.save(5, state, {"examples_per_shard": 80, "num_shards": 1}, cfg)
  ckpt.close()

  ckpt = checkpoint.Checkpointer(str(tmp_path))
  assert ckpt.manager.latest_step() == 5
  restored, data_state = ckpt.restore(5, _abstract(_state()))
  assert data_state == {"examples_per_shard": 80, "num_shards": 1}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  # Structure rebuilt.
  assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
  assert ckpt.state_mismatch(5, _abstract(_state())) is None
  other = _state()
  other["params"]["head"]["kernel"] = jnp.zeros((3, 4))
  assert "'params/head/kernel' has shape (3, 2)" in ckpt.state_mismatch(
      5, _abstract(other)
  )

  for src in (str(tmp_path), os.path.join(tmp_path, "checkpoints", "5")):
    params, config = checkpoint.load_params(src)
    np.testing.assert_array_equal(
        params["head"]["kernel"], np.full((3, 2), 2.0)
    )
    assert isinstance(params["head"]["kernel"], np.ndarray)
    assert config.model.variant == "mu/16"


@pytest.mark.parametrize(
    "keep, keep_every, kept",
    [
        (1, None, [6]),
        (2, None, [5, 6]),
        (3, None, [4, 5, 6]),
        (1, 4, [4, 8, 11]),
        (2, 4, [4, 8, 10, 11]),
        (3, 4, [4, 8, 9, 10, 11]),
    ],
)
def test_keeps_last_n_plus_every_kth(tmp_path, keep, keep_every, kept):
  # Every keep value gives another set of steps: keeping one fewer (or one more)
  # shows.
  ckpt = checkpoint.Checkpointer(
      str(tmp_path), keep=keep, keep_every=keep_every, async_save=False
  )
  for step in range(1, 7 if keep_every is None else 12):
    ckpt.save(step, _state(step), {}, None)
  ckpt.close()
  assert checkpoint.complete_steps(str(tmp_path)) == kept


def test_incomplete_save_is_invisible(tmp_path):
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(3, _state(3.0), {}, None)
  ckpt.close()
  # What a kill in the middle of saving step 6 leaves behind: orbax's temporary
  # directory.
  os.makedirs(tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp" / "state")
  assert checkpoint.complete_steps(str(tmp_path))[-1] == 3
  params, _ = checkpoint.load_params(str(tmp_path))
  np.testing.assert_array_equal(params["head"]["kernel"], np.full((3, 2), 3.0))


def test_load_params_from_npz_and_bad_paths(tmp_path):
  path = str(tmp_path / "p.npz")
  np.savez(path, **{"head/kernel": np.ones((2, 2)), "cls": np.zeros((1, 1, 2))})
  params, config = checkpoint.load_params(path)
  assert (
      config is None
      and params["head"]["kernel"].shape == (2, 2)
      and "cls" in params
  )
  with pytest.raises(ValueError, match="does not exist"):
    checkpoint.load_params(str(tmp_path / "missing"))
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match="No complete checkpoint"):
    checkpoint.load_params(str(tmp_path / "empty"))


def _damaged_workdir(workdir, steps=(1, 2)):
  """A workdir whose newest checkpoint lost its OCDBT manifest (e.g. deleted by hand)."""
  ckpt = checkpoint.Checkpointer(str(workdir), async_save=False)
  # Many arrays: orbax opens them all at once, and abandons the rest when one
  # fails.
  params = {
      f"dense_{i}": {"kernel": jnp.full((2, 2), float(i))} for i in range(1000)
  }
  for step in steps:
    ckpt.save(step, dict(params=params), {}, None)
  ckpt.close()
  step_dir = os.path.join(workdir, "checkpoints", str(steps[-1]))
  os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))
  return step_dir


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resume_from_a_damaged_checkpoint_prints_one_line_only(
    tfds_data_dir, tmp_path
):
  # orbax's reads still in flight when it gave up printed "RuntimeError: Event
  # loop is closed" tracebacks (dozens) around the trainer's one line.
  workdir = str(tmp_path / "run")
  step_dir = _damaged_workdir(workdir)
  p = run_train(tfds_data_dir, workdir, timeout=100)
  assert p.returncode == 1, p.stderr[-3000:]
  last = p.stderr.strip().splitlines()[-1]
  assert last.startswith(
      f"big_vit_lite.train: error: Cannot read checkpoint {step_dir} ("
  ), last
  for noise in ("Event loop is closed", "Traceback", "never retrieved"):
    assert noise not in p.stderr, p.stderr[-3000:]


def test_damaged_checkpoint_reads_are_one_line_errors_and_nothing_else(
    tmp_path,
):
  # In a child process: orbax's abandoned reads report from tensorstore's
  # threads any time later, up to the process's exit (here after 1 s).
  step_dir = _damaged_workdir(tmp_path)
  child = (
      "import sys, time\n"
      "from big_vit_lite.trainer import checkpoint\n"
      "for read in (lambda: checkpoint.load_params(sys.argv[1]),\n"
      "             lambda: checkpoint.Checkpointer(sys.argv[1]).state_mismatch(2, {})) * 2:\n"
      "  try:\n"
      "    read()\n"
      "  except Exception as e:\n"
      "    print(f'{type(e).__name__}: {e}', file=sys.stderr)\n"
      "time.sleep(1)\n"
  )
  p = subprocess.run(
      [sys.executable, "-c", child, str(tmp_path)],
      capture_output=True,
      text=True,
      timeout=100,
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
  )
  for noise in ("Event loop is closed", "Traceback", "never retrieved"):
    assert noise not in p.stderr, p.stderr[-3000:]
  lines = [
      l
      for l in p.stderr.splitlines()
      if l.endswith("does not exist") or "if it is damaged" in l
  ]
  assert len(lines) == 4, p.stderr[-3000:]
  # load_params (evaluate, model_init): was an AttributeError ('NoneType' object
  # has no attribute 'tree').
  older = os.path.join(tmp_path, "checkpoints", "1")
  for line in lines[::2]:
    assert line.startswith(
        f"ValueError: Cannot read checkpoint {step_dir} (NOT_FOUND: "
    ), lines
    assert line.endswith(
        f"does not exist); if it is damaged, pass an older step ({older})."
    ), lines
    assert "tensorstore_spec" not in line, lines
  # The trainer's resume check: the reason, not "its state/ holds no readable
  # array metadata".
  for line in lines[1::2]:
    assert (
        line.startswith("ValueError: NOT_FOUND: ") and ".zarray" in line
    ), lines


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_checkpoint_file_cut_short_names_the_array_not_a_tensorstore_repr(
    tmp_path,
):
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  state = {"params": {"a": jnp.arange(4000.0), "b": jnp.ones((50, 50))}}
  for step in (1, 2):
    ckpt.save(step, state, {}, None)
  ckpt.close()
  data = glob.glob(
      str(tmp_path / "checkpoints" / "2" / "state" / "**" / "d" / "*"),
      recursive=True,
  )
  os.truncate(max(data, key=os.path.getsize), 100)  # params/a, cut short.
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state,
  )
  with pytest.raises(train.TrainingError) as e:
    resume.restore(checkpoint.Checkpointer(str(tmp_path)), 2, abstract)
  msg = str(e.value)
  # Was "(Encountered error while reading array index: ... See full TensorStore
  # details: <bound method pybind11_detail_function_record_v1_...spec of
  # TensorStore({...".
  assert msg.startswith(
      f"Cannot read checkpoint {tmp_path}/checkpoints/2 (OUT_OF_RANGE: Error "
      'reading "params.a/0"'
  ), msg
  assert "TensorStore details" not in msg and msg.endswith(
      "to resume from step 1."
  ), msg


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_flipped_bytes_in_a_checkpoint_do_not_resume_silently(tmp_path):
  # Random floats: zstd stores them as they are, so the flip changes values, not
  # the format.
  ckpt = checkpoint.Checkpointer(str(tmp_path), async_save=False)
  state = {
      "params": {
          "a": jax.random.normal(jax.random.key(0), (4000,)),
          "b": jnp.ones(3),
      }
  }
  for step in (1, 2):
    ckpt.save(step, state, {}, None)
  ckpt.close()
  data = glob.glob(
      str(tmp_path / "checkpoints" / "2" / "state" / "**" / "d" / "*"),
      recursive=True,
  )
  with open(max(data, key=os.path.getsize), "r+b") as f:
    f.seek(5000)
    f.write(b"\xff" * 4)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state,
  )
  # Was restored as it was, params/a changed.
  with pytest.raises(train.TrainingError) as e:
    resume.restore(checkpoint.Checkpointer(str(tmp_path)), 2, abstract)
  assert str(e.value).startswith(
      f"Cannot read checkpoint {tmp_path}/checkpoints/2 ('params/a' "
      "does not match the checksum saved with it); if it is damaged, "
      f"move it out of {tmp_path}/checkpoints"
  ), e.value
  restored, _ = resume.restore(
      checkpoint.Checkpointer(str(tmp_path)), 1, abstract
  )
  assert jnp.array_equal(restored["params"]["a"], state["params"]["a"])
  # model_init, evaluate and export read it too.
  with pytest.raises(ValueError) as e:
    checkpoint.load_params(str(tmp_path))
  assert str(e.value) == (
      f"Cannot read checkpoint {tmp_path}/checkpoints/2 ('params/a' does not "
      "match the checksum saved with it); if it is damaged, pass an older "
      f"step ({tmp_path}/checkpoints/1)."
  )
