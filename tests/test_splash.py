"""attention="splash": Pallas' splash attention kernels (models/splash.py).

The kernels run in Pallas' interpreter here (the CPU); for a TPU they are
compiled by libtpu (the test at the end).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
from jax.sharding import AbstractMesh
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.runtime import flops
from big_vit_lite.planner import plan
from big_vit_lite.runtime import sharding
from big_vit_lite.models import ops
from big_vit_lite.models import splash
from big_vit_lite.models import vit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _qkv(tokens, heads=3, head_dim=8, batch=2, seed=0):
  rng = np.random.default_rng(seed)
  shape = (batch, tokens, heads, head_dim)
  return tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in "qkv")


def _value_and_grads(attention, q, k, v):
  # A weighted sum, so that every output element has its own cotangent.
  weights = jnp.arange(q.shape[-1], dtype=jnp.float32)
  loss = lambda q, k, v: (attention(q, k, v) * weights).sum()
  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("tokens", [5, 130])  # one block; two, the 2nd padded
def test_splash_is_the_custom_attention_forward_and_backward(tokens):
  q, k, v = _qkv(tokens)
  interpreted = lambda q, k, v: splash.splash_attention(q, k, v, interpret=True)
  out = interpreted(q, k, v)
  assert out.shape == q.shape
  np.testing.assert_allclose(out, ops.dot_product_attention(q, k, v), atol=2e-6)
  value, grads = _value_and_grads(interpreted, q, k, v)
  want_value, want_grads = _value_and_grads(ops.dot_product_attention, q, k, v)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_splash_on_a_mesh_splits_the_batch_and_the_heads():
  """Data and tensor parallel (data:2, model:2 on 4 CPU devices): shard_map
  hands each device its examples and heads; the result is the unsharded one."""
  script = textwrap.dedent("""
      import jax
      jax.config.update("jax_num_cpu_devices", 4)
      import flax.linen as nn, jax.numpy as jnp, numpy as np
      from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      from big_vit_lite.runtime import sharding
      from big_vit_lite.models import ops, splash
      rng = np.random.default_rng(0)
      q, k, v = (jnp.asarray(rng.normal(size=(4, 9, 2, 8)), jnp.float32)
                 for _ in "qkv")
      devices = np.array(jax.devices()).reshape(2, 1, 2)
      mesh = Mesh(devices, ("data", "fsdp", "model"))
      with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.DEFAULT_RULES):
        spec = nn.logical_to_mesh_axes(("batch", "seq", "heads", "kv"))
        placed = [jax.device_put(a, NamedSharding(mesh, spec))
                  for a in (q, k, v)]
        out = jax.jit(lambda q, k, v: splash.splash_attention(
            q, k, v, interpret=True))(*placed)
      assert spec == P(("data", "fsdp"), None, "model", None), spec
      assert len(out.sharding.device_set) == 4
      err = np.abs(np.asarray(out) - ops.dot_product_attention(q, k, v)).max()
      print("max error", err)
      assert err < 2e-6
  """)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  run = subprocess.run(
      [sys.executable, "-c", script],
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert "max error" in run.stdout


def _tiny(attention, batch=4):
  """A 2-block model (width 32, 2 heads, 17 tokens) and its gradient's jaxpr,
  traced on a 4-device abstract mesh (data:2, model:2)."""
  model = vit.Model(
      num_classes=10,
      variant=None,
      width=32,
      depth=2,
      mlp_dim=64,
      num_heads=2,
      patch_size=4,
      attention=attention,
  )
  images = jnp.zeros((batch, 16, 16, 3))
  mesh = AbstractMesh((2, 1, 2), ("data", "fsdp", "model"))
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(
      sharding.DEFAULT_RULES
  ):
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), images))
    loss = lambda p: model.apply(p, images)[0].sum()
    return jax.make_jaxpr(jax.grad(loss))(params)


def test_model_flops_count_the_kernels_per_grid_cell_and_device():
  """The jaxpr's model FLOPs with splash: the custom attention's count with its
  attention matmuls at the padded length (17 -> 128 tokens); the backward's
  recomputed Q K^T and dP count as hardware FLOPs only."""
  batch, heads, head_dim, depth = 4, 2, 16, 2
  # One matmul of attention (Q K^T or P V) over the batch, per block.
  one = lambda tokens: 2 * batch * heads * tokens * tokens * head_dim * depth
  custom_model, custom_all = flops.matmul_flops(_tiny("custom"))
  assert custom_model == custom_all  # no remat
  outside_attention = custom_model - 6 * one(17)
  model, hardware = flops.matmul_flops(_tiny("splash"))
  # 2 matmuls forward, 4 backward; 3 more recomputed (Q K^T twice, dP once).
  assert model == pytest.approx(outside_attention + 6 * one(128), rel=2e-3)
  assert hardware == pytest.approx(outside_attention + 9 * one(128), rel=2e-3)


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu (the [tpu] extra) is not installed",
)
def test_a_splash_model_compiles_for_a_tpu_slice():
  sys.path.insert(0, os.path.join(REPO, "tests"))
  import test_tpu_compile  # pylint: disable=g-import-not-at-top

  config = test_tpu_compile._tiny_config()  # pylint: disable=protected-access
  config.model.attention = "splash"
  p = plan.plan_on_slice(config, "data:2,model:2", "v5e:2x2", compile_step=True)
  assert p["tpu_fits"] and p["tpu_est_step_s"] > 0
  # The kernels' matmuls are in the model FLOPs, once per device's shard:
  # the planner's count plus the padding of attention (28 x 28 images in
  # patches of 4 and the class token: 50 -> 128 tokens).
  batch, heads, head_dim, depth = 32, 4, 16, 2
  padding = 6 * 2 * batch * heads * head_dim * depth * (128**2 - 50**2)
  assert p["tpu_model_flops"] == pytest.approx(
      p["flops_per_step"] + padding, rel=0.005
  )
