"""Mesh construction and logical-axis rules -> shardings (DP / FSDP / TP)."""

import os
import subprocess
import sys
import textwrap

import jax
from jax.sharding import AbstractMesh
import pytest

from big_vit_lite.runtime import sharding

import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mesh_sizes_and_errors():
  n = jax.device_count()
  mesh = sharding.make_mesh([("data", -1)])
  assert mesh.shape["data"] == n
  assert sharding.batch_axes(mesh) == ("data",)
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(
      ValueError, match="use distinct axes of data, fsdp, model"
  ):
    sharding.make_mesh([("batch", -1)])
  with pytest.raises(ValueError, match="does not fit"):
    sharding.make_mesh([("data", n + 1)])
  with pytest.raises(ValueError, match="-1 for at most one axis"):
    sharding.make_mesh([("data", -1), ("fsdp", -1)])


def test_rules_drop_axes_the_mesh_lacks():
  mesh = sharding.make_mesh([("data", -1)])
  rules = dict(sharding.make_rules(None, mesh))
  # No fsdp/model axis: replicated.
  assert rules["embed"] is None and rules["mlp"] is None
  with pytest.raises(
      ValueError, match="'embed' maps to \\('tensor',\\); use a mesh axis"
  ):
    sharding.make_rules([("embed", "tensor")], mesh)


_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, flax.linen as nn, optax
    from jax.sharding import PartitionSpec as P
    from big_vit_lite.runtime import sharding
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
  env = dict(
      os.environ,
      XLA_FLAGS=xla_flags.with_devices(8),
      JAX_PLATFORMS="cpu",
      PYTHONPATH=ROOT,
  )
  r = subprocess.run(
      [sys.executable, "-c", _SCRIPT],
      env=env,
      capture_output=True,
      text=True,
      timeout=110,
  )
  assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]


_SAME_STEP_ON_EVERY_MESH = textwrap.dedent("""
    import functools
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
    from big_vit_lite.trainer import grad_accum, losses
    from big_vit_lite.runtime import sharding
    from big_vit_lite.models import vit

    def run(model_kw, mesh_cfg, devices=None):
      mesh = sharding.make_mesh(mesh_cfg, devices=devices)
      rules = sharding.make_rules(None, mesh)
      model = vit.Model(num_classes=10, variant=None, depth=1, patch_size=7, pool_type="gap",
                        dropout=0.0, remat_policy=None, **model_kw)
      # Plain SGD: no optimizer state to compile, and updates linear in the gradients (Adam would
      # turn the rounding noise of gradients that are ~0, like the key bias's, into lr-sized steps).
      tx = optax.sgd(0.5)
      rng = jax.random.PRNGKey(0)
      images = np.random.RandomState(0).normal(size=(12, 28, 28, 1)).astype(np.float32)
      labels = np.eye(10, dtype=np.float32)[np.arange(12) % 10]
      with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(lambda r: model.init(r, images[:1])["params"], rng)
        params_sh = sharding.logical_shardings(boxed, mesh, rules)
        params = jax.device_put(INIT, params_sh)
        batch_sh = sharding.batch_sharding(mesh)
        batch = jax.device_put({"image": images, "labels": labels}, batch_sh)

        def loss_fn(p, b, r):
          logits, _ = model.apply({"params": p}, b["image"], train=True, rngs={"dropout": r})
          return losses.softmax_xent(logits, b["labels"])

        @functools.partial(jax.jit, out_shardings=(params_sh, sharding.replicated(mesh)))
        def step(params, batch):
          loss, grads = grad_accum.value_and_grad(loss_fn, params, batch, rng, 1,
                                                  batch_sharding=batch_sh,
                                                  param_shardings=params_sh)
          updates, _ = tx.update(grads, tx.init(params), params)
          return optax.apply_updates(params, updates), loss

        out = []
        for _ in range(2):
          params, loss = step(params, batch)
          out.append(float(loss))
      return out, jax.device_get(params), sharding.describe(params_sh, INIT)

    # Width 20 splits 4 ways, not 3 (the MLP kernels' 42 take fsdp:3 instead); 5 heads do not
    # split 2 ways (they stay whole), the MLP's 42 do.
    ARCH = dict(width=20, num_heads=5, mlp_dim=42)
    INIT = jax.device_get(sharding.unbox(jax.jit(vit.Model(
        num_classes=10, variant=None, depth=1, patch_size=7, pool_type="gap", **ARCH).init)(
            jax.random.PRNGKey(0), np.zeros((1, 28, 28, 1)))["params"]))
    ref_losses, ref_params, whole = run(ARCH, [("data", 1)], devices=jax.devices()[:1])
    for mesh, n, per_device in [([("fsdp", 3)], 3, 0.8), ([("fsdp", 4)], 4, 0.27),
                                ([("data", 2), ("model", 2)], 4, 0.85)]:
      losses_, params, size = run(ARCH, mesh, devices=jax.devices()[:n])
      assert size <= per_device * whole, (mesh, size, whole)
      np.testing.assert_allclose(losses_, ref_losses, rtol=1e-5, err_msg=str(mesh))
      for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(mesh))
      print("same", mesh, losses_)

    # The planner's per-device state on a mesh that cannot split width 18 four ways: what XLA
    # compiles for the same step (it used to fail to compile there, and to count 1/4 of it).
    import importlib.util
    from big_vit_lite.planner import cpu
    from big_vit_lite.planner import plan
    spec = importlib.util.spec_from_file_location("tiny", "tests/train_config_tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    config = tiny.get_config()
    config.model.width = 18
    p = plan.plan(config, {"fsdp": 4}, "tpu_v4")
    compiled = cpu.compiled_stats(config, {"fsdp": 4}, 28)
    args = p["params_bytes_per_device"] + p["opt_bytes_per_device"] + p["batch_bytes_per_device"]
    assert abs(args / compiled["compiled_argument_bytes"] - 1) < 0.01, (args, compiled)
    print("OK")
""")


@pytest.mark.timeout(180)
def test_one_step_is_the_same_on_every_mesh():
  """fsdp:3 (width not divisible: MLP split along its own dim), fsdp:4 and data:2 x model:2
  (heads not divisible: whole) give the loss and params of 1 device."""
  env = dict(
      os.environ,
      XLA_FLAGS=xla_flags.with_devices(4),
      JAX_PLATFORMS="cpu",
      PYTHONPATH=ROOT,
      TF_CPP_MIN_LOG_LEVEL="2",
  )
  r = subprocess.run(
      [sys.executable, "-c", _SAME_STEP_ON_EVERY_MESH],
      env=env,
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=170,
  )
  assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
  assert r.stdout.count("same") == 3
  # What could not be split as the rules say is said, not silently replicated.
  assert "size 5 over model (2): 7 param(s) whole" in r.stderr, r.stderr[-3000:]
  assert (
      "size 20 over fsdp (3): 2 param(s) split along another dim" in r.stderr
  ), r.stderr[-3000:]


@pytest.mark.parametrize(
    "mesh_cfg,message",
    [
        (
            [("data", 0)],
            "use distinct axes of data, fsdp, model (an unknown or repeated one is not) "
            "with positive sizes, or -1 for at most one axis.",
        ),
        ([("data", 2.5)], "use (axis, integer size) pairs"),
        ([("data", "2")], "use (axis, integer size) pairs"),
        (("data", -1), "(one axis needs the trailing comma)"),
        ([("data",)], "use (axis, integer size) pairs"),
        ([("tensor", 1)], "use distinct axes of data, fsdp, model"),
        (
            [("data", 2)],
            "does not fit the 1 devices (sizes [2]): use -1 for one axis to take the rest "
            "(on CPU, config.num_cpu_devices",
        ),
    ],
)
def test_mesh_mistakes_are_one_line(mesh_cfg, message):
  with pytest.raises(ValueError) as e:
    sharding.make_mesh(mesh_cfg, devices=jax.devices("cpu")[:1])
  assert message in str(e.value) and "\n" not in str(e.value)


def test_mesh_takes_numpy_sizes_and_the_cli_syntax():
  import numpy as np  # pylint: disable=import-outside-toplevel

  one = jax.devices("cpu")[:1]
  assert dict(
      sharding.make_mesh([("data", np.int64(1))], devices=one).shape
  ) == {"data": 1}
  assert dict(sharding.make_mesh("data:-1", devices=one).shape) == {"data": 1}


_DATA_FSDP = AbstractMesh((2, 2), ("data", "fsdp"))


def test_custom_rules_override_the_defaults_and_keep_batch_first():
  """vit_l16.py's example override used to drop "batch": activations were then split along
  "embed" over fsdp and every data-parallel device ran the whole batch."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  rules = sharding.make_rules(
      (("embed", "fsdp"), ("mlp", "model"), ("heads", "model")), _DATA_FSDP
  )
  assert rules[0] == ("batch", ("data", "fsdp"))
  act = nn.logical_to_mesh_axes(("batch", "seq", "embed"), rules)
  assert tuple(act) == (("data", "fsdp"), None, None)
  assert tuple(nn.logical_to_mesh_axes(("embed", "mlp"), rules)) == (
      "fsdp",
      None,
  )
  # One name changed (here: no FSDP for params), the others keep their defaults;
  # a dict works.
  rules = dict(sharding.make_rules({"embed": None}, _DATA_FSDP))
  assert rules["embed"] is None and rules["batch"] == ("data", "fsdp")


@pytest.mark.parametrize(
    "rules_cfg,message",
    [
        (
            (("embed", "fsdp")),
            "use (logical axis, mesh axes) pairs, e.g. (('embed', 'fsdp'),) (one "
            "rule needs the trailing comma)",
        ),
        (
            [("act_batch", "data")],
            "unknown logical axis 'act_batch' (did you mean 'batch'?)",
        ),
        (
            [("embd", "fsdp")],
            "unknown logical axis 'embd' (did you mean 'embed'?)",
        ),
        (
            [("mlp", "tensor")],
            "'mlp' maps to ('tensor',); use a mesh axis (data, fsdp, model)",
        ),
        ([("batch", ("data", "data"))], "a tuple of distinct ones"),
        ([("embed", 4)], "'embed' maps to 4; use a mesh axis"),
        ("embed:fsdp", "use (logical axis, mesh axes) pairs"),
    ],
)
def test_bad_sharding_rules_are_one_line(rules_cfg, message):
  with pytest.raises(ValueError) as e:
    sharding.make_rules(rules_cfg, _DATA_FSDP)
  assert message in str(e.value) and "\n" not in str(e.value)
