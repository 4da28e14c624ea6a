"""TensorFlow as the package imports it: without Keras and scikit-learn, and still whole.

big_vit_lite/data/__init__.py hides Keras from TensorFlow's own import (its eager
`import keras.src.optimizers`, ~1.5 s of CPU a process); the fork server's zygotes
(tests/forkserver.py's PRELOAD) import the package first for the same saving. The
trainer's TensorBoard writer (logs/metrics.py) uses tf.summary itself: clu's writer
module loads Keras through TensorBoard's hparams plugin (its scalars:
tests/test_tensorboard_resume.py).
"""

import json
import subprocess
import sys
import textwrap

import forkserver

# Run in a fresh interpreter, as a user's process imports (not in a zygote's
# child: its TensorFlow is loaded already).
CHILD = """
    import importlib.util, json, sys
    import big_vit_lite.data

    # flax and etils probe for TensorFlow before the package imports it
    assert importlib.util.find_spec("tensorflow") is not None
    from big_vit_lite.data import input_pipeline  # the package's TensorFlow import
    import tensorflow as tf
    import tensorflow_datasets as tfds

    from big_vit_lite.logs import metrics

    writer = metrics.MetricWriter(sys.argv[2])  # the trainer's TensorBoard scalars
    writer.write(1, dict(loss=0.5))
    writer.close()
    loaded_with_tf = sorted(m for m in ("keras", "sklearn") if m in sys.modules)
    squares = tf.data.Dataset.range(6).map(lambda x: x * x).batch(3)
    (example,) = tfds.load(
        "fashion_mnist", split="test[:1]", data_dir=sys.argv[1], download=False
    ).as_numpy_iterator()
    import keras
    print(json.dumps(dict(
        loaded_with_tf=loaded_with_tf,
        squares=[b.tolist() for b in squares.as_numpy_iterator()],
        image=[list(example["image"].shape), str(example["image"].dtype)],
        label=int(example["label"]),
        none_on_api_paths=None in tf.__path__ or None in tf.compat.v1.__path__,
        tf_keras_is_keras=tf.keras.layers.Dense is keras.layers.Dense,
        keras_optimizer=keras.optimizers.Adam(0.1).learning_rate.numpy().item(),
    )))
"""


def test_tensorflow_loads_without_keras_and_still_works(
    tmp_path, tfds_data_dir
):
  """Guards: TensorFlow's import loading Keras and scikit-learn again (the package's hook
  gone or dropped by a find_spec probe, the zygotes importing TensorFlow before the
  package, or the metrics writer back on clu's); a hook that breaks tf.data,
  tfds, TensorFlow's API paths (a None from blocking `keras` in sys.modules), `tf.keras` or a
  user's own `import keras` afterwards."""
  script = tmp_path / "child.py"
  script.write_text(textwrap.dedent(CHILD))
  proc = subprocess.run(
      [sys.executable, str(script), tfds_data_dir, str(tmp_path / "w")],
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got == dict(
      loaded_with_tf=[],
      squares=[[0, 1, 4], [9, 16, 25]],
      image=[[28, 28, 1], "uint8"],
      label=got["label"],
      none_on_api_paths=False,
      tf_keras_is_keras=True,
      keras_optimizer=0.10000000149011612,
  ), got
  assert 0 <= got["label"] < 10


def test_zygotes_import_the_package_before_tensorflow():
  """Guards: a PRELOAD order that loads TensorFlow first, and with it Keras and scikit-learn
  (~1.5 s of CPU more per zygote)."""
  preload = forkserver.PRELOAD
  assert preload.index("big_vit_lite.data") < preload.index("tensorflow")
  assert preload.index("big_vit_lite.data") < preload.index(
      "tensorflow_datasets"
  )
