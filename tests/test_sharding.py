"""Mesh construction and logical-axis rules -> shardings (DP / FSDP / TP)."""
import os
import subprocess
import sys
import textwrap

import jax
import pytest

from big_vit_lite import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mesh_sizes_and_errors():
  n = jax.device_count()
  mesh = sharding.make_mesh([("data", -1)])
  assert mesh.shape["data"] == n
  assert sharding.batch_axes(mesh) == ("data",)
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="Unknown mesh axis"):
    sharding.make_mesh([("batch", -1)])
  with pytest.raises(ValueError, match="needs"):
    sharding.make_mesh([("data", n + 1)])
  with pytest.raises(ValueError, match="At most one"):
    sharding.make_mesh([("data", -1), ("fsdp", -1)])


def test_rules_drop_axes_the_mesh_lacks():
  mesh = sharding.make_mesh([("data", -1)])
  rules = dict(sharding.make_rules(None, mesh))
  assert rules["embed"] is None and rules["mlp"] is None  # No fsdp/model axis: replicated.
  with pytest.raises(ValueError, match="unknown mesh axis"):
    sharding.make_rules([("embed", "tensor")], mesh)


_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, flax.linen as nn, optax
    from jax.sharding import PartitionSpec as P
    from big_vit_lite import sharding
    from big_vit_lite.models import vit
    mesh = sharding.make_mesh([("fsdp", 4), ("model", 2)])
    rules = sharding.make_rules(None, mesh)
    model = vit.Model(num_classes=10, variant=None, width=16, depth=1, mlp_dim=32, num_heads=2,
                      patch_size=7)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      boxed = jax.eval_shape(lambda r: model.init(r, jnp.zeros((4, 28, 28, 1)))["params"],
                             jax.random.PRNGKey(0))
      sh = sharding.logical_shardings(boxed, mesh, rules)
      params = sharding.unbox(boxed)
      opt = jax.eval_shape(optax.adam(1e-3).init, params)
      opt_sh = sharding.like_params_shardings(opt, params, sh, mesh)
    blk = "Transformer", "encoderblock_0"
    get = lambda t, *path: __import__("functools").reduce(lambda a, k: a[k], path, t)
    specs = dict(
        mlp_in=get(sh, *blk, "MlpBlock_0", "Dense_0", "kernel").spec,
        query=get(sh, *blk, "MultiHeadDotProductAttention_0", "query", "kernel").spec,
        head=get(sh, "head", "kernel").spec,
        mu_mlp_in=get(opt_sh[0].mu, *blk, "MlpBlock_0", "Dense_0", "kernel").spec,
        count=opt_sh[0].count.spec)
    print(specs)
    assert specs["mlp_in"] == P("fsdp", "model"), specs
    assert specs["query"] == P("fsdp", "model", None), specs
    assert specs["head"] == P("fsdp", None), specs   # 10 classes: not split
    assert specs["mu_mlp_in"] == specs["mlp_in"], specs  # Adam moments follow their params.
    assert specs["count"] == P(), specs
    assert sharding.describe(sh, params) * 4 < sum(x.size * 4 for x in jax.tree.leaves(params))
    print("OK")
""")


@pytest.mark.timeout(120)
def test_fsdp_and_tensor_parallel_specs_on_8_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                     timeout=110)
  assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
