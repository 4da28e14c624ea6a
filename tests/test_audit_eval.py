"""Evaluation audit: the evaluate CLI and the evaluators the way a big_vision user hits them.

Ctrl-C, big_vision's evaluator keys, few-shot against scikit-learn's ridge,
labels the train split lacks, linear-probe l2 values, headless models in
training, data errors when an evaluator is built, and metrics.jsonl after a
failed or repeated evaluation.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from big_vit_lite import evaluate
from big_vit_lite import sharding
from big_vit_lite.data import input_pipeline
from big_vit_lite.evaluators import classification
from big_vit_lite.evaluators import features
from big_vit_lite.evaluators import fewshot
from big_vit_lite.evaluators import get_evaluator_cls
from big_vit_lite.evaluators import linear_probe
from big_vit_lite.models import vit

import evaluator_fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE = 2**40  # A class id far beyond any sensible class count.
PP = "decode(channels=1)|value_range(-1, 1)|keep('image', 'label')"


class BvlEvalLabels(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """8x8 images of classes 0, 1, 3 (no 2), plus test splits with odd labels."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "image": tfds.features.Image(shape=(8, 8, 1)),
        "label": tfds.features.Scalar(np.int64)}))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples([0, 1, 3] * 6, 0),
            "test": self._generate_examples([0, 1, 3] * 4, 1),
            "train_huge": self._generate_examples([0, 1, 3] * 6, 0, offset=HUGE),
            "test_huge": self._generate_examples([0, 1, 3] * 4, 1, offset=HUGE),
            "test_unlabelled": self._generate_examples([0, 1, -1, 3], 2),
            "test_unseen": self._generate_examples([0, 1, 2, 3], 3)}

  def _generate_examples(self, labels, seed, offset=0):  # pylint: disable=arguments-differ
    rng = np.random.default_rng(seed)
    for i, label in enumerate(labels):
      image = rng.integers(0, 60, (8, 8, 1))
      image[:, 2 * (label % 4):2 * (label % 4) + 2] += 150  # a bar per class
      yield i, {"image": image.astype(np.uint8),
                "label": label + offset if label >= 0 else label}


@pytest.fixture(scope="module")
def labels_data(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  BvlEvalLabels(data_dir=data_dir).download_and_prepare()
  return data_dir


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh([("data", -1)])


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
  return evaluator_fixtures.write_image_folder(str(tmp_path_factory.mktemp("f") / "shapes3"),
                                               n_train=4, n_test=3)


def _random_params(model):
  """Random values of the right shapes (cheaper than an eager init)."""
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.1, a.shape), a.dtype),
                      nn.meta.unbox(abstract["params"]))


@pytest.fixture(scope="module")
def tiny_npz(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("npz") / "tiny.npz")
  vit.save_npz(_random_params(vit.Model(num_classes=3, **evaluator_fixtures.TINY_VIT)), path)
  return path


def pixels(params, images):
  del params
  flat = images.reshape(images.shape[0], -1)
  return flat, {"pre_logits": flat}


def _read(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


# ---------------------------------------------------------------- Ctrl-C

def _start(args, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-m", "big_vit_lite.evaluate", *args], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(120)
def test_ctrl_c_is_one_line_exit_130_and_keeps_finished_evals(tiny_npz, shapes, tmp_path):
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
      "  return c\n")
  out = str(tmp_path / "out")
  common = [f"--config={config}", f"--config.model_init={tiny_npz}"]
  # Both at once: the interpreter start-up dominates.
  early = _start([*common, f"--workdir={tmp_path / 'early'}"], tmp_path)
  # The presets spell out l2_regs, so it can be set from the command line (was "the config
  # file has no key 'evals.lp.l2_regs'").
  late = _start([*common, f"--workdir={out}", "--config.evals.lp.l2_regs=(0.001,)"], tmp_path)
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
    assert err.strip().splitlines()[-1].startswith(
        "big_vit_lite.evaluate: interrupted (Ctrl-C)"), err[-2000:]
  last = "".join(late_err).strip().splitlines()[-1]
  (row,) = _read(out)  # The finished eval's numbers, nothing of the interrupted one.
  if "during evals.lp; the results of fs were written to" not in last:
    # A Ctrl-C that lands in a gc callback is deferred to the end of the running eval.
    assert "(Ctrl-C); the results of fs, lp were written to" in last, last
    row.pop("lp/shapes3")
  assert set(row) == {"step", "fs/shapes3_1shot"}
  assert not os.path.exists(tmp_path / "early")


# ---------------------------------------------------------------- big_vision's keys

def test_big_vision_evaluator_keys_and_types_name_ours(mesh):
  cases = [
      (classification.Evaluator, dict(data={}, pp_fn="decode"),
       "evaluator key 'pp_fn' (this framework calls it 'pp') is unknown"),
      (fewshot.Evaluator, dict(l2_reg=2.0**10), "(this framework calls it 'l2_regs'"),
      (fewshot.Evaluator, dict(pp_train="decode"), "(this framework calls it 'pp'"),
      (fewshot.Evaluator, dict(display_first=[("imagenet", 10)]),
       "the printed table shows every dataset"),
      (classification.Evaluator, dict(data={}, pp="", cache_final=True),
       "big_vision's input caching; not needed here"),
      (classification.Evaluator, dict(data={}, pp="", label_key="labels"),
       "rename the key in the pp"),
      (linear_probe.Evaluator, dict(loss_name="softmax_xent"), "only the classification eval"),
      (fewshot.Evaluator, dict(data_dir="/data"), "datasets.NAME.data_dir"),
      (fewshot.Evaluator, dict(shotz=(1,)), "(did you mean 'shots'?)"),
  ]
  for cls, kwargs, message in cases:
    with pytest.raises(TypeError) as e:
      cls(pixels, mesh=mesh, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
  # A whole big_vision fewshot_lsr entry: every key named at once, in one line.
  with pytest.raises(TypeError, match=r"^evaluator keys 'l2_reg' \(this framework calls it "
                     r"'l2_regs'.*\), 'pp_train' \(.*\), 'pp_eval' \(.*\), 'display_first' "
                     r"\(.*\) are unknown; it takes batch_size, datasets, l2_regs"):
    fewshot.Evaluator(pixels, mesh=mesh, l2_reg=2.0**10, pp_train="x", pp_eval="x",
                      display_first=[])
  with pytest.raises(ValueError, match="big_vision's 'fewshot_lsr' is 'fewshot' here"):
    get_evaluator_cls("fewshot_lsr")
  with pytest.raises(ValueError, match="proj.* evaluators have no counterpart"):
    get_evaluator_cls("proj.image_text.discriminative_classifier")
  # big_vision's dataset tuples (tfds name, train split, test split) are taken as they are.
  ((train, test, pp),) = features.dataset_cfgs({"pets": ("oxford_iiit_pet", "train", "test")},
                                               "PP", "x", "y").values()
  assert (train, test, pp) == (dict(name="oxford_iiit_pet", split="train"),
                               dict(name="oxford_iiit_pet", split="test"), "PP")


# ---------------------------------------------------------------- few-shot numbers

def _split(data, split):
  batches = list(input_pipeline.make_eval_iterator(dict(data, split=split), PP, 200))
  x = np.concatenate([b["image"].reshape(len(b["image"]), -1) for b in batches])
  y = np.concatenate([b["label"] for b in batches])
  keep = np.concatenate([b["_mask"] for b in batches]).astype(bool)
  return x[keep].astype(np.float64), y[keep]


def test_fewshot_equals_scikit_learn_ridge_with_brute_force_leave_one_out(tfds_data_dir, mesh):
  sk = pytest.importorskip("sklearn.linear_model")
  data = dict(name="animal_mnist", data_dir=tfds_data_dir)
  regs = (0.25, 16.0, 1024.0)
  ev = fewshot.Evaluator(pixels, mesh=mesh, pp=PP, shots=(1, 3), num_seeds=2, l2_regs=regs,
                         batch_size=64, datasets={"a": dict(data, train_split="train[:150]",
                                                            test_split="test[:200]")})
  got = ev.run({})
  x_tr, y_tr = _split(data, "train[:150]")
  x_te, y_te = _split(data, "test[:200]")
  classes = np.unique(y_tr)
  onehot = lambda y: 2.0 * (y[:, None] == classes) - 1.0
  for shot in (1, 3):
    accs = []
    for seed in range(2):
      rng = np.random.default_rng(seed)  # The documented sampling: a seeded prefix per class.
      rows = np.concatenate([rng.permutation(np.flatnonzero(y_tr == c))[:3][:shot]
                             for c in classes])
      x, y = x_tr[rows], y_tr[rows]
      mean, std = x.mean(0), x.std(0)
      std[std < 1e-6 * std.max()] = 1.0
      z, z_te = (x - mean) / std, (x_te - mean) / std
      best = None
      for l2 in regs:  # Leave-one-out by refitting without each row.
        loo = np.stack([sk.Ridge(alpha=l2).fit(np.delete(z, i, 0), np.delete(onehot(y), i, 0))
                        .predict(z[i:i + 1])[0] for i in range(len(y))])
        key = (-np.mean(classes[loo.argmax(1)] == y), np.mean((loo - onehot(y))**2), -l2)
        best = min(best or (key, l2), (key, l2))
      pred = sk.Ridge(alpha=best[1]).fit(z, onehot(y)).predict(z_te)
      accs.append(np.mean(classes[pred.argmax(1)] == y_te))
    assert got[f"a_{shot}shot"] == pytest.approx(np.mean(accs), abs=1e-9), shot
  assert got["a_3shot"] > 0.15


# ---------------------------------------------------------------- labels

def test_test_labels_the_train_split_lacks_stop_with_one_line(labels_data, mesh):
  data = dict(name="bvl_eval_labels", data_dir=labels_data)
  def evaluators(train, test):
    ds = {"t": dict(data, train_split=train, test_split=test)}
    return (fewshot.Evaluator(pixels, mesh=mesh, datasets=ds, pp=PP, shots=(2,), num_seeds=2,
                              batch_size=8),
            linear_probe.Evaluator(pixels, mesh=mesh, datasets=ds, pp=PP, batch_size=8,
                                   max_iter=50))
  # Were a silent accuracy over examples no classifier could get right.
  for test, message, ev in (
      ("test_unlabelled", "labels -1: negative labels (-1: an unlabelled", 0),
      ("test_unseen", "labels 2: classes the train split lacks", 1)):
    with pytest.raises(ValueError, match=re.escape(f"1 of 4 test examples have {message}")):
      evaluators("train", test)[ev].run({})
  # Class ids need not be small (was a bincount / one-hot of 2**40 + 4 columns; the linear
  # probe goes through the same class_ids).
  small = evaluators("train", "test")[0].run({})["t_2shot"]
  huge = evaluators("train_huge", "test_huge")[0].run({})["t_2shot"]
  assert huge == small > 0.5, (small, huge)


# ---------------------------------------------------------------- settings

def test_linear_probe_l2_and_fewshot_counts_are_checked(labels_data, mesh):
  ds = {"t": dict(name="bvl_eval_labels", data_dir=labels_data)}
  lp = lambda **kw: linear_probe.Evaluator(pixels, mesh=mesh, datasets=ds, pp=PP,
                                           batch_size=8, **kw)
  # NaN / inf reported chance accuracy; a single number was a TypeError.
  for regs in ((float("nan"),), (1e-3, float("inf")), (-1.0,), ()):
    with pytest.raises(ValueError, match="l2_regs must be finite numbers >= 0"):
      lp(l2_regs=regs)
  assert lp(l2_regs=1e-3).l2_regs == (1e-3,)
  with pytest.raises(ValueError, match="max_iter must be a positive integer; got 0"):
    lp(max_iter=0)
  fs = lambda **kw: fewshot.Evaluator(pixels, mesh=mesh, datasets=ds, pp=PP, batch_size=8, **kw)
  assert fs(shots=2, num_seeds=1).shots == (2,)  # Was "'int' object is not iterable".
  # "25" became shots (2, 5), 2.5 became 2 and 1.5 seeds became 1.
  for kw in (dict(shots="25"), dict(shots=(2.5,)), dict(shots=(True,)),
             dict(shots=(2,), num_seeds=1.5)):
    with pytest.raises(ValueError, match="must be (a )?positive integers?"):
      fs(**kw)


def test_data_errors_stop_when_the_evaluator_is_built(shapes, mesh):
  # A trainer builds its evaluators before it trains: these used to surface at
  # the first eval (after hours of training).
  folder = dict(name="imagefolder", data_dir=shapes)
  with pytest.raises(ValueError, match="no folder .*validation"):
    classification.Evaluator(pixels, mesh=mesh, data=dict(folder, split="validation"), pp=PP)
  with pytest.raises(ValueError, match="unknown pp op 'resise'"):
    linear_probe.Evaluator(pixels, mesh=mesh, datasets={"s": folder},
                           pp="decode|resise(8)|keep('image', 'label')")
  with pytest.raises(ValueError, match="no folder .*val"):
    fewshot.Evaluator(pixels, mesh=mesh, datasets={"s": folder}, pp=PP, shots=(1,),
                      test_split="val")


def test_classification_of_a_headless_model_in_training_is_refused(shapes, mesh):
  model = vit.Model(num_classes=0, **evaluator_fixtures.TINY_VIT)
  params = _random_params(model)
  predict_fn = lambda p, x: model.apply({"params": p}, x, train=False)
  ev = classification.Evaluator(predict_fn, mesh=mesh, pp=PP, batch_size=4,
                                data=dict(name="imagefolder", data_dir=shapes, split="test"))
  # Was a prec@1 of the 32 features' argmax against the labels.
  with pytest.raises(ValueError, match="no classification head"):
    ev.run(params)


# ---------------------------------------------------------------- metrics.jsonl

def test_failed_and_repeated_evaluations_keep_one_line_per_step(tiny_npz, shapes, tmp_path,
                                                                monkeypatch):
  out = str(tmp_path / "out")
  folder = dict(name="imagefolder", data_dir=shapes)

  def config():
    return ml_collections.ConfigDict(dict(model_init=tiny_npz, model_name="vit", evals=dict(
        # big_vision: an entry named after its type needs no `type`; log_percent is the
        # trainer's; model_name="vit" was an unread-key error.
        fewshot=dict(datasets={"s": folder}, pp=PP, shots=(1,), num_seeds=1, batch_size=8,
                     log_percent=0.1),
        val=dict(type="classification", data=dict(folder, split="test"), pp=PP,
                 batch_size=8))))

  # Was an AttributeError traceback.
  with pytest.raises(ValueError, match="evals.fewshot must be a dict of the eval's settings"):
    evaluate.evaluate(ml_collections.ConfigDict(dict(model_init=tiny_npz, evals=dict(
        fewshot="x"))), out)
  # Was a FileExistsError traceback after all the evals had run.
  (tmp_path / "a_file").write_text("")
  for bad in ("a_file", "a_file/sub"):
    with pytest.raises(ValueError, match="a_file (exists and )?is not a"):
      evaluate.evaluate(config(), str(tmp_path / bad))

  def failing_run(self, params):
    del self, params
    raise ValueError("broken.")
  with monkeypatch.context() as m:
    m.setattr(classification.Evaluator, "run", failing_run)
    with pytest.raises(ValueError, match=r"^evals.val: broken; the results of fewshot were "
                       r"written to .*metrics.jsonl\.$"):
      evaluate.evaluate(config(), out)
  assert [set(r) for r in _read(out)] == [{"step", "fewshot/s_1shot"}]
  # Run again: the step's numbers are replaced, not appended (was a second line with
  # fewshot's keys); other lines (a training run's, other steps) stay as they were.
  with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    f.write('{"step": 5, "training_loss": 1.5}\n{"step": 0, "val/prec@1": 0.5, "note": 1}\n')
  results = evaluate.evaluate(config(), out)
  rows = _read(out)
  assert rows[:2] == [{"step": 5, "training_loss": 1.5}, {"step": 0, "note": 1}], rows
  assert len(rows) == 3 and rows[2]["val/prec@1"] == results["val"]["prec@1"]
  assert set(rows[2]) == {"step", "fewshot/s_1shot", "val/prec@1", "val/loss"}


def test_classification_counts_hits_under_label_smoothing_and_skips_unlabelled_rows(shapes,
                                                                                      mesh):
  def always_class_0(params, images):
    del params
    logits = jnp.zeros((images.shape[0], 3)).at[:, 0].set(1.0)
    return logits, {"pre_logits": logits}
  smoothed = ("decode(channels=1)|onehot(3, key='label', key_result='labels', on=0.9, off=0.05)"
              "|keep('image', 'labels')")
  ev = classification.Evaluator(always_class_0, mesh=mesh, pp=smoothed, batch_size=4,
                                data=dict(name="imagefolder", data_dir=shapes, split="test"))
  assert ev.run({})["prec@1"] == pytest.approx(1 / 3)  # Was 1.0: every off=0.05 was a "hit".
  # ImageNet-ReaL style k-hot rows: one with no label at all counts nowhere (as in big_vision);
  # the 2-label row is a hit for either of its classes.
  labels = jnp.array([[1.0, 0, 0], [0, 1, 1], [0, 0, 0]])
  logits = jnp.array([[5.0, 0, 0], [0, 0, 5.0], [5.0, 0, 0]])
  sums = classification.batch_sums(logits, labels, jnp.ones(3), "sigmoid_xent")
  assert (float(sums["correct@1"]), float(sums["count"])) == (2.0, 2.0)


def test_features_too_big_for_host_memory_stop_at_the_first_batch(shapes, mesh, monkeypatch):
  monkeypatch.setattr(features, "available_host_bytes", lambda: 10_000)
  ev = linear_probe.Evaluator(pixels, mesh=mesh, pp=PP, batch_size=4,
                              datasets={"s": dict(name="imagefolder", data_dir=shapes)})
  # 12 train rows x 784 float32 pixels: ~37 KB, twice (batches, then concatenated).
  with pytest.raises(ValueError, match=r"'pre_logits' features \(token_pool='mean': 784 numbers "
                     r"per example\) of 12 examples need 0.07 MiB .*use token_pool='mean'"):
    ev.run({})


def test_linear_probe_out_of_device_memory_names_its_own_knobs(shapes, mesh, monkeypatch):
  from big_vit_lite.evaluators import logistic  # pylint: disable=import-outside-toplevel
  def out_of_memory(*args, **kwargs):
    del args, kwargs
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                     "allocate 81604378624 bytes.")
  monkeypatch.setattr(logistic, "fit", out_of_memory)
  ev = linear_probe.Evaluator(pixels, mesh=mesh, pp=PP, batch_size=4,
                              datasets={"s": dict(name="imagefolder", data_dir=shapes)})
  # Was evaluate's generic advice to lower the eval batch size, which changes nothing here.
  with pytest.raises(ValueError, match=r"fitting 12 examples x 784 features, 3 classes, 5 l2 "
                     r"values at once; use fewer l2_regs, token_pool='mean'"):
    ev.run({})
