"""`python -m big_vit_lite.evaluate` on a short training run's workdir and on an .npz."""

import json
import os
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import jax.numpy as jnp
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite import evaluate
from big_vit_lite.evaluators import classification
from big_vit_lite.evaluators import presets
from big_vit_lite.models import vit
from big_vit_lite.models import loading

import evaluator_fixtures
import forkserver
import trainer_runs
import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, data_dir, timeout, devices=1):
  env = dict(
      os.environ,
      TFDS_DATA_DIR=data_dir,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS=xla_flags.with_devices(devices),
  )
  return subprocess.run(
      forkserver.command([sys.executable, "-m", *args]),
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def demo_workdir(tfds_data_dir):
  workdir, _ = trainer_runs.demo_runlocal(tfds_data_dir)
  return workdir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_evaluate_training_workdir(demo_workdir, tfds_data_dir, tmp_path):
  out = str(tmp_path / "eval")
  p = _run(
      [
          "big_vit_lite.evaluate",
          "--config=configs/fewshot.py:runlocal",
          f"--workdir={out}",
          f"--config.model_init={demo_workdir}",
      ],
      tfds_data_dir,
      timeout=150,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  (row,) = _metrics(out)
  assert row["step"] == 6  # the run's last checkpoint
  for key in (
      "fewshot/mnist10k_1shot",
      "fewshot/mnist10k_5shot",
      "fewshot/animal_mnist_1shot",
      "fewshot/animal_mnist_5shot",
  ):
    assert 0.0 <= row[key] <= 1.0, row
  # A readable table: one line per dataset with a column per shot count.
  assert "1-shot" in p.stdout and "5-shot" in p.stdout
  assert any(
      line.split()[:1] == ["mnist10k"] for line in p.stdout.splitlines()
  ), p.stdout


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  """A random-init RGB ViT saved by vit.save_npz (no config alongside)."""
  return evaluator_fixtures.save_tiny_npz(tmp_path_factory.mktemp("npz"))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_evaluate_npz_linear_probe_on_image_folder(
    tiny_npz, tfds_data_dir, tmp_path
):
  root = evaluator_fixtures.write_image_folder(str(tmp_path / "shapes3"))
  out = str(tmp_path / "eval")
  # Grey PNGs into an RGB model (the pp decodes to 3 channels), on 2 devices,
  # with an odd batch size (padded with masked rows for the mesh).
  p = _run(
      [
          "big_vit_lite.evaluate",
          f"--config=configs/linear_probe.py:channels=3,folder={root}",
          f"--workdir={out}",
          f"--config.model_init={tiny_npz}",
          "--config.evals.linear_probe.batch_size=15",
      ],
      tfds_data_dir,
      timeout=150,
      devices=2,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  (row,) = _metrics(out)
  assert row["step"] == 0
  assert row["linear_probe/shapes3"] > 0.6, row  # 3 easy classes; chance is 1/3
  assert "shapes3" in p.stdout


def _damaged_checkpoint(workdir):
  """A training workdir whose checkpoint lost its OCDBT manifest."""
  ckpt = checkpoint.Checkpointer(str(workdir), async_save=False)
  ckpt.save(
      1,
      dict(params={f"dense_{i}": jnp.zeros((2, 2)) for i in range(100)}),
      {},
      None,
  )
  ckpt.close()
  os.remove(
      os.path.join(workdir, "checkpoints", "1", "state", "manifest.ocdbt")
  )
  return str(workdir)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_evaluate_errors_are_one_line(tiny_npz, tfds_data_dir, tmp_path):
  # 12 train images per class, and 25 shots asked for (the default list would
  # drop it).
  root = evaluator_fixtures.write_image_folder(
      str(tmp_path / "shapes3"), n_test=1
  )
  cases = [
      (
          str(tmp_path / "missing"),
          "configs/fewshot.py:runlocal",
          "does not exist",
      ),
      # The model takes 28x28x3; the pp makes 32x32x1.
      (tiny_npz, "configs/fewshot.py:runlocal,res=32", "resize to 28"),
      # Was a warning and a "shapes3_25shot" fitted on 12 examples per class.
      (
          tiny_npz,
          f"configs/fewshot.py:channels=3,folder={root}",
          "class 0 has only 12 train examples, too few for 25-shot; lower `shots` to at most 12",
          "--config.evals.fewshot.shots=(1, 25)",
      ),
      # Was an AttributeError traceback, among "Event loop is closed" ones.
      (
          _damaged_checkpoint(tmp_path / "damaged"),
          "configs/fewshot.py:runlocal",
          f"Cannot read checkpoint {tmp_path / 'damaged' / 'checkpoints' / '1'} (NOT_FOUND: ",
      ),
  ]
  for src, config, message, *overrides in cases:
    p = _run(
        [
            "big_vit_lite.evaluate",
            f"--config={config}",
            f"--workdir={tmp_path / 'e'}",
            f"--config.model_init={src}",
            *overrides,
        ],
        tfds_data_dir,
        timeout=100,
    )
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("big_vit_lite.evaluate: error: ") and message in last
    ), p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_eval_configs_name_metrics_after_the_folder(tmp_path):
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  del config_flags
  import importlib.util  # pylint: disable=import-outside-toplevel

  def load(name, arg):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(REPO, "configs", name)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)

  root = evaluator_fixtures.write_image_folder(str(tmp_path / "flowers"))
  fs = load("fewshot.py", f"folder={root},res=224,channels=3")
  assert fs.evals.fewshot.datasets.to_dict() == {
      "flowers": dict(name="imagefolder", data_dir=root)
  }
  assert (
      "resize(224)" in fs.evals.fewshot.pp
      and "decode(channels=3)" in fs.evals.fewshot.pp
  )
  lp = load("linear_probe.py", "runlocal")
  assert sorted(lp.evals.linear_probe.datasets) == ["animal_mnist", "mnist10k"]
  with pytest.raises(ValueError, match="Unknown config arg"):
    load("fewshot.py", "shots=3")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_evaluate_two_processes_match_one(tiny_npz, tfds_data_dir, tmp_path):
  # Each process reads its own part of every split; the few-shot samples are
  # drawn from the labels of all processes and forwarded where they live.
  # The numbers must not depend on the process count.
  root = evaluator_fixtures.write_image_folder(str(tmp_path / "shapes3"))
  args = [
      "big_vit_lite.evaluate",
      f"--config=configs/fewshot.py:channels=3,folder={root}",
      "--config.evals.fewshot.batch_size=8",
      "--config.evals.fewshot.shots=(1,10)",
      f"--config.model_init={tiny_npz}",
  ]
  one = _run(
      args + [f"--workdir={tmp_path / 'one'}"], tfds_data_dir, timeout=120
  )
  assert one.returncode == 0, one.stderr[-3000:]
  env = dict(os.environ, TFDS_DATA_DIR=tfds_data_dir, LOCAL_PREFIX_OUTPUT="0")
  two = subprocess.run(
      [
          "launch/local.sh",
          "2",
          "--",
          sys.executable,
          "-m",
          *args,
          f"--workdir={tmp_path / 'two'}",
      ],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=200,
  )
  assert two.returncode == 0, two.stderr[-3000:]
  (row1,), (row2,) = _metrics(str(tmp_path / "one")), _metrics(
      str(tmp_path / "two")
  )
  assert row1 == row2
  assert row1["fewshot/shapes3_10shot"] > 0.5


def test_model_config_is_read_off_any_npz_layout():
  from big_vit_lite import evaluate  # pylint: disable=import-outside-toplevel
  from big_vit_lite.models import layout  # pylint: disable=import-outside-toplevel

  model = vit.Model(num_classes=5, **dict(evaluator_fixtures.TINY_VIT, depth=2))
  params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3)))["params"]
  flat = layout.to_numpy_flat(params)
  want = dict(
      variant=None,
      width=32,
      depth=2,
      mlp_dim=64,
      num_heads=2,
      patch_size=7,
      pool_type="gap",
      posemb="learn",
  )
  assert loading.infer_model_cfg(flat) == want
  assert loading.native_input_shape(flat, None) == (28, 3)
  # The original paper's pre-linen block numbering.
  pre_linen = {
      k.replace(
          "MultiHeadDotProductAttention_0", "MultiHeadDotProductAttention_1"
      ).replace("MlpBlock_0", "MlpBlock_3"): v
      for k, v in flat.items()
  }
  assert loading.infer_model_cfg(pre_linen) == want
  # big_vision: top-level posemb without a class-token row, here with a cls
  # token.
  bv = dict(
      flat,
      cls=np.zeros((1, 1, 32), np.float32),
      pos_embedding=flat["Transformer/posembed_input/pos_embedding"],
  )
  del bv["Transformer/posembed_input/pos_embedding"]
  assert loading.infer_model_cfg(bv)["pool_type"] == "tok"
  assert loading.native_input_shape(bv, None) == (28, 3)
  with pytest.raises(ValueError, match="no ViT params"):
    loading.infer_model_cfg({"dense/kernel": np.zeros((2, 2))})


def test_model_input_read_off_stem_big_vision_and_sincos_checkpoints():
  from big_vit_lite import evaluate  # pylint: disable=import-outside-toplevel
  from big_vit_lite.models import layout  # pylint: disable=import-outside-toplevel

  kw = dict(evaluator_fixtures.TINY_VIT, stem_channels=(8,))
  abstract = jax.eval_shape(
      vit.Model(num_classes=5, **kw).init,
      jax.random.key(0),
      jnp.zeros((1, 28, 28, 1)),
  )["params"]
  flat = {
      k: np.zeros(v.shape, v.dtype)
      for k, v in layout.flatten(nn.meta.unbox(abstract)).items()
  }
  # A conv-stem model takes grey images: the stem's input channels, not the
  # embedding's (8).
  assert loading.native_input_shape(flat, None) == (28, 1)
  assert loading.infer_model_cfg(flat)["stem_channels"] == (8,)
  # big_vision train checkpoints keep the params under "params/" next to the
  # optimizer.
  bv = {f"params/{k}": v for k, v in flat.items()}
  bv["opt/state/count"] = np.zeros(())
  assert loading.infer_model_cfg(bv)["depth"] == 1
  assert loading.native_input_shape(bv, None) == (28, 1)
  # A non-square grid (4x2 tokens) was taken for a 2x2 one (isqrt).
  with pytest.raises(ValueError, match="8 patch tokens, not a square grid"):
    loading.native_input_shape(
        dict(
            flat,
            **{
                "Transformer/posembed_input/pos_embedding": np.zeros(
                    (1, 8, 32), np.float32
                )
            },
        ),
        None,
    )
  # Trained on 28x63 (a 4x9 grid, 36 tokens as in 6x6): a square run would
  # scramble the posemb.
  import ml_collections  # pylint: disable=import-outside-toplevel

  saved = ml_collections.ConfigDict(
      dict(input=dict(pp="decode(1)|resize((28, 63))|keep('image')"))
  )
  nonsquare = dict(
      flat,
      **{
          "Transformer/posembed_input/pos_embedding": np.zeros(
              (1, 36, 32), np.float32
          )
      },
  )
  with pytest.raises(
      ValueError, match=r"trained on 28x63 images .*square images only"
  ):
    loading.native_input_shape(nonsquare, saved)
  saved.input.pp = "decode(1)|resize(42)|keep('image')"
  assert loading.native_input_shape(nonsquare, saved) == (42, 1)
  # A distillation pp's teacher copy at another size is not the student's image.
  saved.input.pp = "decode(1)|resize(42)|resize((28, 63), outkey='prof')"
  assert loading.native_input_shape(nonsquare, saved) == (42, 1)
  # sincos2d without a saved pp: no fixed resolution (it runs at the eval pp's
  # size).
  del flat["Transformer/posembed_input/pos_embedding"]
  assert loading.native_input_shape(flat, None) == (None, 1)
  saved.input.pp = "decode(1)|inception_crop([24, 24])|keep('image')"
  assert loading.native_input_shape(flat, saved) == (24, 1)


def test_evaluate_headless_and_sincos_npz_in_process(tmp_path):
  import ml_collections  # pylint: disable=import-outside-toplevel
  from big_vit_lite import evaluate  # pylint: disable=import-outside-toplevel

  root = evaluator_fixtures.write_image_folder(
      str(tmp_path / "shapes3"), n_train=2, n_test=4
  )

  # Random values of the right shapes (cheaper than an eager init).
  def save(num_classes, posemb):
    model = vit.Model(
        num_classes=num_classes, **evaluator_fixtures.TINY_VIT, posemb=posemb
    )
    abstract = jax.eval_shape(
        model.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1))
    )
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: rng.normal(0, 0.1, a.shape).astype(a.dtype),
        nn.meta.unbox(abstract["params"]),
    )
    path = str(tmp_path / f"m{num_classes}.npz")
    vit.save_npz(params, path)
    return path

  def config(src):
    return ml_collections.ConfigDict(
        dict(
            model_init=src,
            evals=dict(
                val=dict(
                    type="classification",
                    data=dict(name="imagefolder", data_dir=root, split="test"),
                    pp=presets.eval_pp(28, channels=1),
                    batch_size=8,
                )
            ),
        )
    )

  # No head: the "logits" would be the features, so prec@1 would mean nothing.
  with pytest.raises(ValueError, match="no classification head"):
    evaluate.evaluate(config(save(0, "learn")), str(tmp_path / "e0"))
  # A sincos2d .npz has no posemb to read the resolution off; it used to be
  # refused.
  results = evaluate.evaluate(config(save(3, "sincos2d")), str(tmp_path / "e3"))
  assert 0.0 <= results["val"]["prec@1"] <= 1.0 and results["val"]["loss"] > 0


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
  return evaluator_fixtures.write_image_folder(
      str(tmp_path_factory.mktemp("f") / "shapes3"), n_train=4, n_test=3
  )


@pytest.fixture(scope="module")
def grey_npz(tmp_path_factory):
  """A random 3-class TINY_VIT for 28x28 grey images, saved by vit.save_npz."""
  path = str(tmp_path_factory.mktemp("npz") / "tiny.npz")
  model = vit.Model(num_classes=3, **evaluator_fixtures.TINY_VIT)
  vit.save_npz(evaluator_fixtures.random_params(model), path)
  return path


def _start(args, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen(
      [sys.executable, "-m", "big_vit_lite.evaluate", *args],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


@pytest.mark.timeout(120)
def test_ctrl_c_is_one_line_exit_130_and_keeps_finished_evals(
    grey_npz, shapes, tmp_path
):
  config = tmp_path / "two_evals.py"
  config.write_text(
      "import ml_collections\n"
      "from big_vit_lite.evaluators import presets\n"
      "def get_config(arg=None):\n"
      "  c = ml_collections.ConfigDict()\n"
      "  c.model_init = ml_collections.config_dict.placeholder(str)\n"
      f"  c.evals = dict(fs=presets.fewshot(28, channels=1, folder={shapes!r}, shots=(1,),\n"
      "                                    num_seeds=1, batch_size=8),\n"
      f"                 lp=presets.linear_probe(28, channels=1, folder={shapes!r},\n"
      "                                         batch_size=8))\n"
      "  return c\n"
  )
  out = str(tmp_path / "out")
  common = [f"--config={config}", f"--config.model_init={grey_npz}"]
  # Both at once: the interpreter start-up dominates.
  early = _start([*common, f"--workdir={tmp_path / 'early'}"], tmp_path)
  # The presets spell out l2_regs, so it can be set from the command line (was
  # "the config file has no key 'evals.lp.l2_regs'").
  late = _start(
      [*common, f"--workdir={out}", "--config.evals.lp.l2_regs=(0.001,)"],
      tmp_path,
  )
  time.sleep(1.0)
  early.send_signal(signal.SIGINT)  # During the imports (they take seconds).
  late_err = []
  for line in late.stderr:  # Ctrl-C once the second eval has started.
    late_err.append(line)
    if "Running eval lp" in line:
      late.send_signal(signal.SIGINT)
      break
  late_err += late.stderr.readlines()
  late.wait(timeout=60)
  early_err = early.communicate(timeout=60)[1]
  for proc, err in ((early, early_err), (late, "".join(late_err))):
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("big_vit_lite.evaluate: interrupted (Ctrl-C)")
    ), err[-2000:]
  last = "".join(late_err).strip().splitlines()[-1]
  # The finished eval's numbers, nothing of the interrupted one.
  (row,) = _metrics(out)
  if "during evals.lp; the results of fs were written to" not in last:
    # A Ctrl-C that lands in a gc callback is deferred to the end of the running
    # eval.
    assert "(Ctrl-C); the results of fs, lp were written to" in last, last
    row.pop("lp/shapes3")
  assert set(row) == {"step", "fs/shapes3_1shot"}
  assert not os.path.exists(tmp_path / "early")


def test_failed_and_repeated_evaluations_keep_one_line_per_step(
    grey_npz, shapes, tmp_path, monkeypatch
):
  out = str(tmp_path / "out")
  folder = dict(name="imagefolder", data_dir=shapes)
  pp = "decode(channels=1)|value_range(-1, 1)|keep('image', 'label')"

  def config():
    return ml_collections.ConfigDict(
        dict(
            model_init=grey_npz,
            model_name="vit",
            evals=dict(
                # big_vision: an entry named after its type needs no `type`; log_percent
                # is the trainer's; model_name="vit" was an unread-key error.
                fewshot=dict(
                    datasets={"s": folder},
                    pp=pp,
                    shots=(1,),
                    num_seeds=1,
                    batch_size=8,
                    log_percent=0.1,
                ),
                val=dict(
                    type="classification",
                    data=dict(folder, split="test"),
                    pp=pp,
                    batch_size=8,
                ),
            ),
        )
    )

  # Was an AttributeError traceback.
  with pytest.raises(
      ValueError, match="evals.fewshot must be a dict of the eval's settings"
  ):
    evaluate.evaluate(
        ml_collections.ConfigDict(
            dict(model_init=grey_npz, evals=dict(fewshot="x"))
        ),
        out,
    )
  # Was a FileExistsError traceback after all the evals had run: now before
  # them.
  (tmp_path / "a_file").write_text("")
  for bad in ("a_file", "a_file/sub"):
    with pytest.raises(OSError, match="a_file"):
      evaluate.evaluate(config(), str(tmp_path / bad))

  def failing_run(self, params):
    del self, params
    raise ValueError("broken.")

  with monkeypatch.context() as m:
    m.setattr(classification.Evaluator, "run", failing_run)
    with pytest.raises(
        ValueError,
        match=r"^evals.val: broken; the results of fewshot were "
        r"written to .*metrics.jsonl\.$",
    ):
      evaluate.evaluate(config(), out)
  assert [set(r) for r in _metrics(out)] == [{"step", "fewshot/s_1shot"}]
  # Run again: the step's numbers are replaced, not appended (was a second line
  # with fewshot's keys); other lines (a training run's, other steps) stay as
  # they were.
  with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    f.write(
        '{"step": 5, "training_loss": 1.5}\n{"step": 0, "val/prec@1": 0.5, "note": 1}\n'
    )
  results = evaluate.evaluate(config(), out)
  rows = _metrics(out)
  assert rows[:2] == [
      {"step": 5, "training_loss": 1.5},
      {"step": 0, "note": 1},
  ], rows
  assert len(rows) == 3 and rows[2]["val/prec@1"] == results["val"]["prec@1"]
  assert set(rows[2]) == {"step", "fewshot/s_1shot", "val/prec@1", "val/loss"}
