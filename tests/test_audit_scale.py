"""Scaling and sharding audit: meshes, rules, plan, bench and multi-process setup as users hit them.

One subprocess with 4 simulated CPU devices checks that a training step gives the same loss and
params on every mesh; the rest runs in-process on abstract meshes (no devices needed).
"""
import os
import re
import socket
import subprocess
import sys
import textwrap

import jax
from jax.sharding import AbstractMesh
import pytest

from big_vit_lite import distributed
from big_vit_lite import grad_accum
from big_vit_lite import plan
from big_vit_lite import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SAME_STEP_ON_EVERY_MESH = textwrap.dedent("""
    import functools
    import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
    from big_vit_lite import grad_accum, losses, sharding
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
    from big_vit_lite import plan
    spec = importlib.util.spec_from_file_location("tiny", "tests/train_config_tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    config = tiny.get_config()
    config.model.width = 18
    p = plan.plan(config, {"fsdp": 4}, "tpu_v4")
    compiled = plan.compiled_stats(config, {"fsdp": 4}, 28)
    args = p["params_bytes_per_device"] + p["opt_bytes_per_device"] + p["batch_bytes_per_device"]
    assert abs(args / compiled["compiled_argument_bytes"] - 1) < 0.01, (args, compiled)
    print("OK")
""")


@pytest.mark.timeout(180)
def test_one_step_is_the_same_on_every_mesh():
  """fsdp:3 (width not divisible: MLP split along its own dim), fsdp:4 and data:2 x model:2
  (heads not divisible: whole) give the loss and params of 1 device."""
  # Optimization level 0: the same program for every mesh, compiled in half the CPU time.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 "
             "--xla_backend_optimization_level=0",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  r = subprocess.run([sys.executable, "-c", _SAME_STEP_ON_EVERY_MESH], env=env, cwd=ROOT,
                     capture_output=True, text=True, timeout=170)
  assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
  assert r.stdout.count("same") == 3
  # What could not be split as the rules say is said, not silently replicated.
  assert "size 5 over model (2): 7 param(s) whole" in r.stderr, r.stderr[-3000:]
  assert "size 20 over fsdp (3): 2 param(s) split along another dim" in r.stderr, r.stderr[-3000:]


# ---------------------------------------------------------------------------- mesh and rules

@pytest.mark.parametrize("mesh_cfg,message", [
    ([("data", 0)], "axis 'data' has size 0; use a positive integer, or -1"),
    ([("data", 2.5)], "axis 'data' has size 2.5"),
    ([("data", "2")], "axis 'data' has size '2'"),
    (("data", -1), "'data' is not an (axis, size) pair (one axis needs a trailing comma"),
    ([("data",)], "('data',) is not an (axis, size) pair"),
    ([("tensor", 1)], "Unknown mesh axis 'tensor' (did you mean 'model'?)"),
    ([("data", 2)], "needs 2 devices but there are 1: use -1 for one axis to take the rest "
                    "(on CPU, config.num_cpu_devices"),
])
def test_mesh_mistakes_are_one_line(mesh_cfg, message):
  with pytest.raises(ValueError) as e:
    sharding.make_mesh(mesh_cfg, devices=jax.devices("cpu")[:1])
  assert message in str(e.value) and "\n" not in str(e.value)


def test_mesh_takes_numpy_sizes_and_the_cli_syntax():
  import numpy as np  # pylint: disable=import-outside-toplevel
  one = jax.devices("cpu")[:1]
  assert dict(sharding.make_mesh([("data", np.int64(1))], devices=one).shape) == {"data": 1}
  assert dict(sharding.make_mesh("data:-1", devices=one).shape) == {"data": 1}


_DATA_FSDP = AbstractMesh((2, 2), ("data", "fsdp"))


def test_custom_rules_override_the_defaults_and_keep_batch_first():
  """vit_l16.py's example override used to drop "batch": activations were then split along
  "embed" over fsdp and every data-parallel device ran the whole batch."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  rules = sharding.make_rules((("embed", "fsdp"), ("mlp", "model"), ("heads", "model")),
                              _DATA_FSDP)
  assert rules[0] == ("batch", ("data", "fsdp"))
  act = nn.logical_to_mesh_axes(("batch", "seq", "embed"), rules)
  assert tuple(act) == (("data", "fsdp"), None, None)
  assert tuple(nn.logical_to_mesh_axes(("embed", "mlp"), rules)) == ("fsdp", None)
  # One name changed (here: no FSDP for params), the others keep their defaults; a dict works.
  rules = dict(sharding.make_rules({"embed": None}, _DATA_FSDP))
  assert rules["embed"] is None and rules["batch"] == ("data", "fsdp")


@pytest.mark.parametrize("rules_cfg,message", [
    ((("embed", "fsdp")), "'embed' is not a (logical axis, mesh axes) pair (one rule needs a "
                          "trailing comma"),
    ([("act_batch", "data")], "unknown logical axis 'act_batch' (did you mean 'batch'?)"),
    ([("embd", "fsdp")], "unknown logical axis 'embd' (did you mean 'embed'?)"),
    ([(".*", 'fsdp(axis="data")')],
     "not param-name regexes as big_vision's sharding_strategy does"),
    ([("embed", 'fsdp(axis="data")')], "big_vision's sharding_strategy (fsdp(axis=...)"),
    ([("mlp", "tensor")], "'mlp' maps to unknown mesh axis 'tensor' (did you mean 'model'?)"),
    ([("batch", ("data", "data"))], "repeats an axis"),
    ([("embed", 4)], "'embed' maps to 4; use a mesh axis name"),
    ("embed:fsdp", "use (logical axis, mesh axes) pairs"),
])
def test_bad_sharding_rules_are_one_line(rules_cfg, message):
  with pytest.raises(ValueError) as e:
    sharding.make_rules(rules_cfg, _DATA_FSDP)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_batch_not_divisible_by_the_devices_is_not_blamed_on_grad_accum():
  with pytest.raises(ValueError, match=r"input.batch_size=6 is not divisible by the 4 devices"):
    grad_accum.check(1, 6, 4)
  with pytest.raises(ValueError, match="grad_accum_steps=4 does not divide the per-device batch"):
    grad_accum.check(4, 8, 4)


# ------------------------------------------------------------------------------------ plan

def _tiny_config(**model):
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("tiny_cfg", os.path.join(ROOT, "tests",
                                                                         "train_config_tiny.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.model.update(model)
  return config


def test_plan_counts_params_the_trainer_cannot_split_as_whole():
  """Width 18 on fsdp:4: the trainer keeps params whole or splits another of their dims
  (sharding.fit_spec); the plan used to divide them 4 ways anyway."""
  p = plan.plan(_tiny_config(width=18), {"fsdp": 4}, "tpu_v4", res=30)
  # The MLP kernels and posemb split 4 ways along their other dim; the rest (76%) whole.
  assert p["params_bytes_per_device"] == 11904 and 4 * p["num_params"] == 16224
  # 30 px with 7 px patches: the same 4 x 4 patches as 28 px, and a note that 2 px are ignored.
  assert p["tokens"] == 16 and p["ignored_px"] == 2
  assert "note: 30 px is not a multiple of the patch size 7" in plan.format_report(p)
  assert p["unsplit_params"] == [
      "size 18 over fsdp (4): 15 param(s) whole, e.g. Transformer/encoder_norm/bias",
      "size 18 over fsdp (4): 3 param(s) split along another dim, e.g. "
      "Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel"]
  assert "note: param dims not divisible" in plan.format_report(p)
  assert "(width 18, depth 1, MLP 32, 2 heads, patch 7)" in plan.format_report(p)
  # Divisible: split 4 ways (all but the 10-class head bias), nothing noted.
  p = plan.plan(_tiny_config(width=16), {"fsdp": 4}, "tpu_v4")
  assert p["params_bytes_per_device"] < 0.3 * 4 * p["num_params"] and not p["unsplit_params"]


def test_plan_shards_optimizer_state_by_path_not_shape():
  """MLP width == model width: the (16,) MLP bias (split over model) and the (16,) LayerNorm
  scales (not split) share a shape; Adam's moments follow their own param."""
  p = plan.plan(_tiny_config(width=16, mlp_dim=16), {"data": 2, "model": 2}, "tpu_v4")
  # scale_by_adam: mu and nu like the params, plus replicated int32 step counts.
  assert 0 < p["opt_bytes_per_device"] - 2 * p["params_bytes_per_device"] <= 16


def test_plan_activations_without_a_tensor_split_that_does_not_divide():
  arch = dict(width=1024, depth=24, mlp_dim=4096, num_heads=16, patch_size=16)
  kw = dict(local_batch=8, tokens=197, mm_bytes=2, remat=False)
  assert plan.activation_bytes(arch, tp=3, **kw) == plan.activation_bytes(arch, tp=1, **kw)
  assert plan.activation_bytes(arch, tp=4, **kw) < plan.activation_bytes(arch, tp=1, **kw)


def test_plan_input_mistakes_are_one_line():
  config = _tiny_config()
  with pytest.raises(ValueError, match=r"--res=0: use a positive image side"):
    plan.image_res(config, 0)
  for mesh_cfg in ([("data", 2.5)], [("tensor", 2)], [("data", 0)]):
    with pytest.raises(ValueError, match=r"config.mesh=.*use distinct data/fsdp/model axes"):
      plan.mesh_from_config(mesh_cfg)
  with pytest.raises(ValueError, match=r"--mesh='tensor:2'.*\(did you mean 'model'\?\)"):
    plan.parse_mesh("tensor:2")


# ----------------------------------------------------------------------------------- bench

@pytest.mark.parametrize("kw,message", [
    (dict(mode=[]), "--mode=: use train and/or infer"),
    (dict(mode=["train", "eval"]), "--mode=train,eval: use train and/or infer"),
    (dict(calib_n=0), "--calib_n=0: must be at least 1"),
    (dict(num_classes=0), "--num_classes=0: must be at least 1"),
    (dict(peak_tflops=-1.0), "--peak_tflops=-1.0: use the device's positive datasheet peak"),
    # The JSON line would say variant mu/8 for an S/16 (the flag's value, not the model's).
    (dict(model_kw={"variant": "S/16"}), "--model_kw sets 'variant': use --variant instead"),
    (dict(model_kw={"remat_policy": "nothing_saveable"}), "use --remat instead"),
])
def test_bench_flag_mistakes_are_one_line(kw, message):
  from big_vit_lite import bench  # pylint: disable=import-outside-toplevel
  kw = dict(dict(model_kw={}), **kw)
  with pytest.raises(ValueError) as e:
    bench.check_args(["mu/8"], [4], kw.pop("model_kw"), res=16, steps=1, warmup=0, **kw)
  assert message in str(e.value)


def test_bench_mesh_and_model_mistakes_are_one_line():
  from big_vit_lite import bench  # pylint: disable=import-outside-toplevel
  from big_vit_lite.models import vit  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh([("data", 1)], devices=jax.devices("cpu")[:1])
  with pytest.raises(ValueError, match=r"--num_cpu_devices=2 without --mesh times one device: "
                                       r"add --mesh=data:-1"):
    bench.check_mesh_args(None, [4], 1, "", 2)
  with pytest.raises(ValueError, match=r"--grad_accum=3: grad_accum_steps=3 does not divide"):
    bench.check_mesh_args(mesh, [4], 3, "data:1", None)
  bench.check_mesh_args(mesh, [4], 2, "data:1", None)
  with pytest.raises(ValueError, match=r"mu/8: Width 32 is not divisible by num_heads=5"):
    bench.check_model(vit.Model(num_classes=10, variant="mu/8", num_heads=5), 16, "mu/8")


@pytest.mark.timeout(60)
def test_bench_cli_bad_remat_is_one_line_not_a_traceback():
  r = subprocess.run([sys.executable, "-m", "big_vit_lite.bench", "--variant=mu/8", "--res=16",
                      "--remat=bogus"], cwd=ROOT, capture_output=True, text=True, timeout=50,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith("bench: mu/8: Unknown remat_policy='bogus'")


# ------------------------------------------------------------------------------ distributed

@pytest.mark.parametrize("address,message", [
    ("localhost:abc", "port 'abc' is not a number in 1..65535"),
    ("localhost:99999", "port '99999' is not a number"),
    ("localhost:0", "port '0' is not a number"),
    ("http://10.0.0.1:8476", "no scheme or spaces"),
    ("10.0.0.1:8476 ", "no scheme or spaces"),
    (":8476", "must be HOST:PORT"),
])
def test_bad_coordinator_address_is_one_line(address, message):
  env = dict(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
  with pytest.raises(ValueError, match=re.escape(message)):
    distributed.describe_environment(env)
  env["JAX_COORDINATOR_ADDRESS"] = "[::1]:8476"  # IPv6 literals are fine.
  assert distributed.describe_environment(env)["coordinator_address"] == "[::1]:8476"


def test_coordinator_port_in_use_is_one_line(monkeypatch):
  """jax 0.10 logs 'Failed to add port to server' and then dies of SIGSEGV."""
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    for k, v in dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                     JAX_PROCESS_ID="0").items():
      monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=f"process 0 cannot serve on port {port} of this host"):
      distributed.initialize()


@pytest.mark.timeout(60)
def test_missing_peer_ends_with_one_line_after_the_join_timeout():
  """JAX_NUM_PROCESSES=2 but only process 0 started: jax waited 300 s, then aborted with a C++
  stack trace."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
             JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="0", BVL_INIT_TIMEOUT_S="1")
  r = subprocess.run([sys.executable, "-c", "from big_vit_lite import distributed; "
                      "distributed.initialize(); print('joined')"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=50)
  assert r.returncode == 1 and "joined" not in r.stdout
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("jax.distributed: process 0 of 2 waited 1 s for all processes to join"), \
      r.stderr[-2000:]
  assert "$BVL_INIT_TIMEOUT_S" in last


@pytest.mark.timeout(60)
def test_hang_guard_startup_limit_zero_means_none():
  """BVL_HANG_STARTUP_TIMEOUT_S=0 (0 turns BVL_HANG_TIMEOUT_S off) killed the job at once."""
  script = ("import sys, time\nfrom big_vit_lite import distributed\n"
            "guard = distributed.HangGuard(0.3, startup_timeout_s=0, stream=sys.stdout)\n"
            "time.sleep(0.8)\nprint('alive')\nguard.tick(1)\ntime.sleep(1.0)\nprint('still')\n")
  r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                     timeout=50, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  # No limit before the first tick; after it, the guard's own 0.3 s.
  assert "alive" in r.stdout and "still" not in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
  assert r.returncode == distributed.HANG_EXIT_CODE


def test_plan_device_names_as_people_write_them():
  for name, key in (("H100", "h100"), ("v5e", "tpu_v5e"), ("TPU-v4", "tpu_v4"), ("a100", "a100")):
    assert plan.resolve_device(name) == key
  with pytest.raises(ValueError, match=r"--device='tpu_v9': known devices are tpu_v2"):
    plan.resolve_device("tpu_v9")
