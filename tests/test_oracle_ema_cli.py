"""`--params=ema` of the export and predict command lines, on a real training checkpoint.

Oracle: a checkpoint saved here with orbax (trainer/checkpoint.py) whose EMA weights are
drawn apart from its params: the exported .npz must hold the EMA's numbers, and predict's
probabilities must be those of the tiny model applied by hand with flax to the EMA weights
(pixels / 127.5 - 1, softmax in numpy). Until now only the slow end-to-end test_ema.py ran
these flags, so a flag not passed on from a CLI's main went unseen by `-m "not slow"`.
"""

import json
import os
import subprocess
import sys

import numpy as np
from PIL import Image

import checks
import forkserver
from big_vit_lite.models import layout
from big_vit_lite.trainer import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_CLASSES = 5


def _run(args):
  """`python -m ARGS` forked by the fork server; its stdout."""
  proc = subprocess.run(
      forkserver.command([sys.executable, "-m", *args]),
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def _workdir(tmp_path):
  """A run directory with one step: params and their EMA, each random (seeds 0 and 1)."""
  params = checks.vit_params(seed=0, num_classes=NUM_CLASSES)
  ema = checks.vit_params(seed=1, num_classes=NUM_CLASSES)
  workdir = tmp_path / "run"
  ckpt = checkpoint.Checkpointer(str(workdir), async_save=False)
  ckpt.save(5, dict(params=params, ema=ema), {}, None)
  ckpt.close()
  return workdir, params, ema


def test_export_and_predict_read_the_ema_with_params_ema(tmp_path):
  """Guards: export's or predict's `--params` not passed on to the checkpoint read
  (both would write or score the params, silently), and the flag reading the params
  for "ema"."""
  workdir, params, ema = _workdir(tmp_path)

  npz = tmp_path / "ema.npz"
  _run(
      [
          "big_vit_lite.export",
          f"--src={workdir}",
          f"--out={npz}",
          "--params=ema",
      ]
  )
  exported = dict(np.load(npz))
  want = layout.canonicalize(layout.to_numpy_flat(ema))
  assert exported.keys() == want.keys()
  for name, value in want.items():
    np.testing.assert_array_equal(exported[name], value, err_msg=name)
  # The params differ from the EMA in every array, so reading them would show.
  got_params = layout.canonicalize(layout.to_numpy_flat(params))
  assert all(not np.array_equal(got_params[k], want[k]) for k in want)

  pixels = np.random.default_rng(2).integers(0, 256, (16, 16, 3), np.uint8)
  Image.fromarray(pixels).save(tmp_path / "a.png")
  out = _run(
      [
          "big_vit_lite.predict",
          f"--model={workdir}",
          f"--images={tmp_path / 'a.png'}",
          f"--top_k={NUM_CLASSES}",
          "--params=ema",
      ]
  )
  [row] = [
      json.loads(line) for line in out.splitlines() if line.startswith("{")
  ]
  model = checks.tiny_vit(num_classes=NUM_CLASSES)
  by_weights = {}
  for name, weights in (("params", params), ("ema", ema)):
    logits, _ = model.apply(
        {"params": weights}, pixels[None].astype(np.float32) / 127.5 - 1.0
    )
    probs = np.exp(np.float64(logits[0]) - np.max(logits[0]))
    by_weights[name] = probs / probs.sum()
  got = {p["class"]: p["prob"] for p in row["predictions"]}
  want_probs = [by_weights["ema"][c] for c in range(NUM_CLASSES)]
  np.testing.assert_allclose(
      [got[c] for c in range(NUM_CLASSES)], want_probs, atol=1e-5
  )
  # The two sets of weights give different probabilities here.
  assert np.abs(by_weights["ema"] - by_weights["params"]).max() > 1e-3
