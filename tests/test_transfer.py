"""Fine-tuning: layer-wise lr decay (loop and scan), configs/transfer.py on a real checkpoint."""
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite import checkpoint
from big_vit_lite import config_loading
from big_vit_lite import optim
from big_vit_lite.models import vit
from tests import trainer_runs

ROOT = trainer_runs.ROOT
TRANSFER = os.path.join(ROOT, "configs", "transfer.py")
DEPTH = 3


def _params(scan):
  model = vit.Model(num_classes=5, variant=None, width=8, depth=DEPTH, mlp_dim=16, num_heads=2,
                    patch_size=7, scan=scan)
  return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                           jnp.zeros((1, 14, 14, 1)))["params"])


def _flat(tree):
  return dict(zip(jax.tree.leaves(optim.param_names(tree)), jax.tree.leaves(tree)))


@pytest.mark.parametrize("scan", [False, True])
def test_layer_decay_multipliers_per_block(scan):
  params = nn_unbox(_params(scan))
  mults = _flat(optim.layer_decay_mults(params, 0.5))
  shapes = {k: v.shape for k, v in _flat(params).items()}
  # Block i: 0.5 ** (DEPTH - i); embeddings 0.5 ** (DEPTH + 1); head, final norm 1.
  expected_block = 0.5 ** (DEPTH - np.arange(DEPTH))
  for name, m in mults.items():
    if name.startswith("Transformer/encoderblock_"):
      i = int(name.split("/")[1].split("_")[1])
      assert m == expected_block[i], name
    elif name.startswith("Transformer/encoderblock/"):  # scan: one per slice of the layers axis
      assert np.shape(m) == (DEPTH,) + (1,) * (len(shapes[name]) - 1), name
      np.testing.assert_array_equal(np.ravel(m), expected_block, err_msg=name)
    elif name.split("/")[0] in ("embedding", "cls") or "pos_embedding" in name:
      assert m == 0.5 ** (DEPTH + 1), name
    else:
      assert name.startswith(("head/", "Transformer/encoder_norm/")), name
      assert m == 1.0, name
  blocks = [n for n in mults if "encoderblock" in n]
  assert len(blocks) == 16 * (1 if scan else DEPTH)  # 16 params per block, each with its mult


@pytest.mark.parametrize("scan", [False, True])
def test_layer_decay_scales_an_optimizer_step(scan):
  """Plain SGD, constant schedule: each param moves by lr * multiplier * grad."""
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), nn_unbox(_params(scan)))
  cfg = config_loading.TrackedConfig(ml_collections.ConfigDict(dict(
      lr=0.1, wd=0.0, optax_name="sgd", optax=dict(momentum=None), layer_decay=0.5,
      lr_mults=[("head/.*", 2.0)], schedule=dict(decay_type="constant"))))
  opt = optim.make(cfg, params, total_steps=10)
  grads = jax.tree.map(jnp.ones_like, params)
  new, _ = jax.jit(opt.apply)(params, grads, opt.tx.init(params))
  flat = _flat(new)
  np.testing.assert_allclose(flat["head/kernel"], -0.1 * 2.0)  # lr_mults multiply in
  np.testing.assert_allclose(flat["Transformer/encoder_norm/scale"], -0.1)
  np.testing.assert_allclose(flat["embedding/kernel"], -0.1 * 0.5 ** (DEPTH + 1), rtol=1e-6)
  key = "MlpBlock_0/Dense_0/kernel"
  for i in range(DEPTH):
    block = (flat[f"Transformer/encoderblock/{key}"][i] if scan
             else flat[f"Transformer/encoderblock_{i}/{key}"])
    np.testing.assert_allclose(block, -0.1 * 0.5 ** (DEPTH - i), rtol=1e-6)


def nn_unbox(tree):
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  return nn.meta.unbox(tree)


def test_layer_decay_out_of_range_is_one_line():
  params = nn_unbox(_params(False))
  with pytest.raises(ValueError, match=r"layer_decay=1.5 must be in \(0, 1\]"):
    optim.layer_decay_mults(params, 1.5)
