"""Scaling audit: plan and bench as users hit them (meshes, rules and distributed setup are
tested in test_sharding.py and test_multiprocess.py)."""
import os
import subprocess
import sys

import jax
import pytest

from big_vit_lite import plan
from big_vit_lite import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_plan_device_names_as_people_write_them():
  for name, key in (("H100", "h100"), ("v5e", "tpu_v5e"), ("TPU-v4", "tpu_v4"), ("a100", "a100")):
    assert plan.resolve_device(name) == key
  with pytest.raises(ValueError, match=r"--device='tpu_v9': known devices are tpu_v2"):
    plan.resolve_device("tpu_v9")
