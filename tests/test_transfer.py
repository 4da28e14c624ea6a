"""Fine-tuning: layer-wise lr decay (loop and scan), configs/transfer.py on a real checkpoint."""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.config import config_loading
from big_vit_lite.trainer import optim
from big_vit_lite.trainer import transfer
from big_vit_lite.models import layout
from big_vit_lite.models import timm
from big_vit_lite.models import vit
from trainer_runs import ROOT

TRANSFER = os.path.join(ROOT, "configs", "transfer.py")
DEPTH = 3


def _params(scan):
  model = vit.Model(
      num_classes=5,
      variant=None,
      width=8,
      depth=DEPTH,
      mlp_dim=16,
      num_heads=2,
      patch_size=7,
      scan=scan,
  )
  return jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 14, 14, 1)))[
          "params"
      ]
  )


def _flat(tree):
  return dict(
      zip(jax.tree.leaves(optim.param_names(tree)), jax.tree.leaves(tree))
  )


@pytest.mark.parametrize("scan", [False, True])
def test_layer_decay_multipliers_per_block(scan):
  params = nn_unbox(_params(scan))
  mults = _flat(optim.layer_decay_mults(params, 0.5))
  shapes = {k: v.shape for k, v in _flat(params).items()}
  # Block i: 0.5 ** (DEPTH - i); embeddings 0.5 ** (DEPTH + 1); head, final norm
  # 1.
  expected_block = 0.5 ** (DEPTH - np.arange(DEPTH))
  for name, m in mults.items():
    if name.startswith("Transformer/encoderblock_"):
      i = int(name.split("/")[1].split("_")[1])
      assert m == expected_block[i], name
    # scan: one per slice of the layers axis
    elif name.startswith("Transformer/encoderblock/"):
      assert np.shape(m) == (DEPTH,) + (1,) * (len(shapes[name]) - 1), name
      np.testing.assert_array_equal(np.ravel(m), expected_block, err_msg=name)
    elif name.split("/")[0] in ("embedding", "cls") or "pos_embedding" in name:
      assert m == 0.5 ** (DEPTH + 1), name
    else:
      assert name.startswith(("head/", "Transformer/encoder_norm/")), name
      assert m == 1.0, name
  blocks = [n for n in mults if "encoderblock" in n]
  # 16 params per block, each with its mult
  assert len(blocks) == 16 * (1 if scan else DEPTH)


@pytest.mark.parametrize("scan", [False, True])
def test_layer_decay_scales_an_optimizer_step(scan):
  """Plain SGD, constant schedule: each param moves by lr * multiplier * grad."""
  params = jax.tree.map(
      lambda x: jnp.zeros(x.shape, x.dtype), nn_unbox(_params(scan))
  )
  cfg = config_loading.TrackedConfig(
      ml_collections.ConfigDict(
          dict(
              lr=0.1,
              wd=0.0,
              optax_name="sgd",
              optax=dict(momentum=None),
              layer_decay=0.5,
              lr_mults=[("head/.*", 2.0)],
              schedule=dict(decay_type="constant"),
          )
      )
  )
  opt = optim.make(cfg, params, total_steps=10)
  grads = jax.tree.map(jnp.ones_like, params)
  new, _ = jax.jit(opt.apply)(params, grads, opt.tx.init(params))
  flat = _flat(new)
  # lr_mults multiply in
  np.testing.assert_allclose(flat["head/kernel"], -0.1 * 2.0)
  np.testing.assert_allclose(flat["Transformer/encoder_norm/scale"], -0.1)
  np.testing.assert_allclose(
      flat["embedding/kernel"], -0.1 * 0.5 ** (DEPTH + 1), rtol=1e-6
  )
  key = "MlpBlock_0/Dense_0/kernel"
  for i in range(DEPTH):
    block = (
        flat[f"Transformer/encoderblock/{key}"][i]
        if scan
        else flat[f"Transformer/encoderblock_{i}/{key}"]
    )
    np.testing.assert_allclose(block, -0.1 * 0.5 ** (DEPTH - i), rtol=1e-6)


def nn_unbox(tree):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  return nn.meta.unbox(tree)


def _load_transfer():
  return config_loading.config_module(TRANSFER)


def _save_run(workdir, step, model, pp):
  """A real training checkpoint of `step`: the params of vit.Model(**model), its run config."""
  params = nn_unbox(
      vit.Model(**model).init(jax.random.PRNGKey(0), jnp.zeros((1, 14, 14, 1)))[
          "params"
      ]
  )
  config = ml_collections.ConfigDict(dict(input=dict(pp=pp), model=model))
  ckpt = checkpoint.Checkpointer(str(workdir), async_save=False)
  ckpt.save(step, dict(params=params), {}, config)
  ckpt.close()


def test_checkpoint_model_reads_a_training_run_off_disk(tmp_path):
  model = dict(
      num_classes=3,
      variant=None,
      width=8,
      depth=1,
      mlp_dim=16,
      num_heads=2,
      patch_size=7,
      stem_channels=(4,),
  )
  wider = dict(model, width=16)
  run = tmp_path / "run"
  _save_run(run, 1, model, "decode(channels=1)|resize(14)|value_range(-1, 1)")
  _save_run(run, 2, wider, "decode(channels=3)|resize(21)|value_range(-1, 1)")
  # The last step of a workdir; a step dir as given. The model as saved (the
  # stem's tuple too: JSON has lists), res and channels from the step's pp.
  assert transfer.checkpoint_model(str(run)) == (wider, 21, 3)
  step_1 = str(run / "checkpoints" / "1")
  assert transfer.checkpoint_model(step_1) == (model, 14, 1)
  # No checkpoint (yet): nothing known.
  os.makedirs(tmp_path / "empty" / "checkpoints")
  for nothing in (tmp_path / "empty", tmp_path / "missing"):
    assert transfer.checkpoint_model(str(nothing)) == (None, None, None)


def test_num_classes_of_an_image_folder_counts_every_split(tmp_path):
  for d in ("train/cat", "train/dog", "test/cat", "test/bird", "test/.hidden"):
    os.makedirs(tmp_path / d)
  (tmp_path / "train" / "notes.txt").write_text("not a class")
  (tmp_path / "README").write_text("not a split")
  # cat, dog, bird.
  assert transfer.num_classes(folder=str(tmp_path)) == 3
  with pytest.raises(ValueError, match="pass classes=K"):
    transfer.num_classes(data="no_such_dataset_here")


def test_transfer_config_reads_the_model_off_an_npz(
    tmp_path, tfds_data_dir, monkeypatch
):
  monkeypatch.setenv("TFDS_DATA_DIR", tfds_data_dir)
  model = vit.Model(
      num_classes=7,
      variant=None,
      width=24,
      depth=2,
      mlp_dim=48,
      num_heads=3,
      patch_size=4,
      pool_type="tok",
      rep_size=16,
  )
  params = nn_unbox(
      model.init(jax.random.PRNGKey(0), jnp.zeros((1, 20, 20, 3)))["params"]
  )
  npz = str(tmp_path / "pre.npz")
  vit.save_npz(params, npz)
  transfer = _load_transfer()
  config = transfer.get_config(f"init={npz},data=animal_mnist")
  m = config.model
  assert (
      m.width,
      m.depth,
      m.mlp_dim,
      m.num_heads,
      m.patch_size,
      m.pool_type,
  ) == (24, 2, 48, 3, 4, "tok")
  # the dataset's classes
  assert m.num_classes == 10 and m.rep_size is False and m.head_zeroinit
  assert config.model_init == npz and list(config.model_load.dont_load) == [
      "head/.*"
  ]
  # Its own resolution and channels; Animal-MNIST (28-px silhouettes, flip-safe)
  # on flips only.
  assert config.input.pp.startswith(
      "decode(channels=3)|resize(20)|flip_lr|value_range"
  )
  assert config.evals.val.pp.startswith(
      "decode(channels=3)|resize(20)|value_range"
  )
  assert config.optax_name == "momentum" and config.grad_clip_norm == 1.0
  # timm's layout: the same model read off it
  st = str(tmp_path / "pre.safetensors")
  flat = {
      k: v
      for k, v in layout.to_numpy_flat(params).items()
      if "pre_logits" not in k
  }
  timm.write_timm(flat, st, image_size=20)
  m2 = transfer.get_config(f"init={st},data=animal_mnist").model
  assert {
      k: m2[k]
      for k in ("width", "depth", "num_heads", "patch_size", "pool_type")
  } == {
      k: m[k]
      for k in ("width", "depth", "num_heads", "patch_size", "pool_type")
  }
  config = transfer.get_config(
      f"init={npz},res=32,opt=adamw,scratch,classes=4,mixup"
  )
  assert "resize(32)" in config.input.pp and "onehot(4," in config.input.pp
  assert (
      config.optax_name == "adamw"
      and config.model_init is None
      and config.mixup.mixup_alpha
  )
  for d in ("train/cat", "train/dog", "test/cat", "test/.hidden"):
    os.makedirs(tmp_path / "pets" / d)
  config = transfer.get_config(f"init={npz},folder={tmp_path}/pets")
  assert (
      config.model.num_classes == 2 and config.input.data.name == "imagefolder"
  )
  # a folder: natural images by default
  assert "|inception_crop(20)|flip_lr|" in config.input.pp
  # The split unset: found (val, validation, then test; here test/).
  assert config.evals.val.data.to_dict() == dict(
      name="imagefolder", data_dir=str(tmp_path / "pets"), split=None
  )
  # a flip changes a digit
  digits = transfer.get_config(f"init={npz},data=mnist10k,classes=10")
  assert digits.input.pp.startswith("decode(channels=3)|resize(20)|value_range")
  # the paper's recipe
  natural = transfer.get_config(f"init={npz},data=cifar10,classes=10")
  assert natural.input.pp.startswith(
      "decode(channels=3)|inception_crop(20)|flip_lr|value_range"
  )
  crop = transfer.get_config(f"init={npz},data=animal_mnist,aug=crop,res=32")
  assert crop.input.pp.startswith(
      "decode(channels=3)|inception_crop(32)|value_range"
  )
  assert transfer.get_config(
      f"init={npz},data=mnist10k,aug=crop_flip"
  ).input.pp.startswith("decode(channels=3)|inception_crop(20)|flip_lr|")
  with pytest.raises(
      ValueError, match="aug=crop_flip, aug=crop, aug=flip or aug=none"
  ):
    transfer.get_config(f"init={npz},aug=rotate")
  with pytest.raises(ValueError, match="opt=sgd or opt=adamw"):
    transfer.get_config("opt=lamb")
  with pytest.raises(ValueError, match="Unknown config arg"):
    transfer.get_config("no_such_arg")
  # No checkpoint there (yet): the demo's architecture; the trainer then stops
  # on model_init.
  config = transfer.get_config(f"init={tmp_path}/missing,runlocal")
  assert (
      config.model.width == transfer.DEMO_MODEL["width"]
      and config.total_steps == 6
  )
