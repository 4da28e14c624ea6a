"""plan --topology: the trainer's step compiled by the TPU compiler (libtpu) on this CPU host."""

import importlib.util
import os
import subprocess
import sys

import jax
import ml_collections
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.runtime import flops as flops_lib
from big_vit_lite.planner import assemble
from big_vit_lite.planner import plan
from big_vit_lite.planner import report as plan_report
from big_vit_lite.planner import tpu as tpu_compile
from big_vit_lite.models import vit
import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu (the [tpu] extra) is not installed",
)


def _tiny_config(batch_size=32):
  c = ml_collections.ConfigDict()
  c.total_steps = 10
  c.input = dict(
      data=dict(name="fashion_mnist", split="train"),
      batch_size=batch_size,
      pp="decode(channels=1)|value_range(-1, 1)"
      "|onehot(10, key='label', key_result='labels')",
  )
  c.model = dict(
      variant=None,
      width=64,
      depth=2,
      mlp_dim=256,
      num_heads=4,
      patch_size=4,
      num_classes=10,
      remat_policy=None,
      dtype_mm="auto",
      dropout=0.0,
  )
  c.optax_name = "scale_by_adam"
  c.optax = dict()
  c.lr = 1e-3
  c.wd = 1e-4
  c.schedule = dict(warmup_steps=2, decay_type="cosine")
  c.mesh = (("data", -1),)
  return c


@pytest.mark.parametrize(
    "name, topology, chips, devices, key",
    [
        # Cloud TPU's own names and shapes (cloud.google.com/tpu/docs/v4, v5p, v5e,
        # v6e, v3).
        ("v5p-256", "v5p:4x4x8", 128, 128, "tpu_v5p"),
        ("v5p-128", "v5p:4x4x4", 64, 64, "tpu_v5p"),
        ("v4-32", "v4:2x2x4", 16, 16, "tpu_v4"),
        ("v4-8", "v4:2x2x1", 4, 4, "tpu_v4"),
        ("v5litepod-16", "v5e:4x4", 16, 16, "tpu_v5e"),
        ("v5e-8", "v5e:2x4", 8, 8, "tpu_v5e"),
        ("v6e-256", "v6e:16x16", 256, 256, "tpu_v6e"),
        # v3 counts cores, two JAX devices per chip
        ("v3-32", "v3:4x4", 16, 32, "tpu_v3"),
        ("v5p:8x8x8", "v5p:8x8x8", 512, 512, "tpu_v5p"),
        ("V5E:2x2", "v5e:2x2", 4, 4, "tpu_v5e"),
    ],
)
def test_slice_names_as_cloud_tpu_counts_them(
    name, topology, chips, devices, key
):
  s = tpu_compile.parse_slice(name)
  assert (s.topology, s.chips, s.devices, s.device_key) == (
      topology,
      chips,
      devices,
      key,
  )


@pytest.mark.parametrize(
    "name", ["v7x-8", "v5p-3", "v5p-6", "tpu", "v4:2x2x2x2", "v5e-0"]
)
def test_unknown_slices_are_one_line(name):
  with pytest.raises(
      ValueError, match=r"--topology=.*(unknown TPU slice|not a slice size)"
  ) as e:
    tpu_compile.parse_slice(name)
  assert "\n" not in str(e.value)


def test_mesh_is_resolved_against_the_slice():
  assert assemble.resolve_mesh([("data", -1), ("fsdp", 4)], 64, "x") == dict(
      data=16, fsdp=4
  )
  assert assemble.resolve_mesh([("fsdp", 16)], 16, "x") == dict(fsdp=16)
  for mesh in (
      [("data", 8)],
      [("data", -1), ("fsdp", 3)],
      [("data", -1), ("fsdp", -1)],
  ):
    with pytest.raises(
        ValueError, match=r"does not match v4-32 \(16 devices\)"
    ) as e:
      assemble.resolve_mesh(mesh, 16, "v4-32")
    assert "\n" not in str(e.value)


def test_collectives_are_counted_from_the_hlo():
  # Hand-written lines in the compiled HLO's syntax; sizes by hand.
  hlo = "\n".join(
      [
          "  %all-reduce.1 = (f32[1024]{0}, bf16[8,16]{1,0}) all-reduce(%a, %b), replica_groups={}",
          "  %ag = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[4,8]{1,0} %p), dims={0}",
          "  %agd = f32[16,8]{1,0} all-gather-done(%ag)",
          "  %rs = f32[2,8]{1,0} reduce-scatter(f32[8,8]{1,0} %g), dimensions={0}",
          "  %ar2 = s32[] all-reduce-start(s32[] %x)",
          "  %add = f32[1024]{0} add(%all-reduce.1, %c)",
      ]
  )
  found = flops_lib.collectives(hlo)
  assert found["all-reduce"] == {"count": 2, "bytes": 1024 * 4 + 8 * 16 * 2 + 4}
  assert found["all-gather"] == {"count": 1, "bytes": 16 * 8 * 4}
  assert found["reduce-scatter"] == {"count": 1, "bytes": 2 * 8 * 4}


def test_a_missing_libtpu_is_one_line(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(
      importlib.util,
      "find_spec",
      lambda name, *a: None if name == "libtpu" else real(name, *a),
  )
  with pytest.raises(ValueError, match=r"pip install 'big_vit_lite\[tpu\]'"):
    tpu_compile.slice_devices(tpu_compile.parse_slice("v5e:2x2"))


def test_a_slice_is_planned_and_compiled_with_the_tpu_choices():
  """On this CPU host "auto" would mean float32 and the custom attention; for a
  slice plan decides it for the TPU, in the model that the compile builds, and
  the caller's config is left as it was (guards plan writing into it)."""
  # No attention key: vit.Model's default, "auto".
  config = _tiny_config()
  config.model.dtype_act = "auto"
  before = config.to_dict()
  p = plan.plan_on_slice(config, "data:-1", "v5e:2x2")
  assert (p["dtype_mm"], p["dtype_act"], p["attention"]) == (
      "bfloat16",
      "bfloat16",
      "xla",
  )
  assert config.to_dict() == before
  mesh = jax.sharding.AbstractMesh((4,), ("data",))
  module = assemble.assemble(config, mesh, 16, target="tpu").model.module
  assert (module.dtype_mm, module.dtype_act, module.attention) == (
      "bfloat16",
      "bfloat16",
      "xla",
  )


@needs_libtpu
def test_compiled_on_a_small_slice_through_the_cli_path():
  """v5e:2x2, data parallel: the TPU compiler's figures against hand-countable ones."""
  config = _tiny_config()
  # bf16 matmuls would all-reduce their gradients in bf16
  config.model.dtype_mm = "float32"
  p = plan.plan_on_slice(config, (("data", -1),), "v5e:2x2", compile_step=True)
  assert p["mesh"] == {"data": 4} and p["device"] == "TPU v5e"
  assert p["tpu_peak_bytes"] == (
      p["tpu_argument_bytes"]
      + p["tpu_output_bytes"]
      + p["tpu_temp_bytes"]
      - p["tpu_alias_bytes"]
  )
  # Arguments: the replicated params and Adam's two moments, 8 images, step and
  # rng; the TPU pads small arrays to its tiles, so at most twice that.
  unpadded = p["num_params"] * 4 * 3 + p["batch_bytes_per_device"] + 4 + 8
  assert unpadded <= p["tpu_argument_bytes"] <= 2 * unpadded
  # The donated state comes back in place: the outputs alias the params and
  # moments.
  assert p["tpu_alias_bytes"] >= p["num_params"] * 4 * 3
  assert p["tpu_fits"] and p["tpu_hbm_bytes"] == 16 * 2**30
  # Data parallel: every gradient is all-reduced (as one combined op, plus the
  # loss); no param is gathered or scattered.
  reduced = p["tpu_collectives"]["all-reduce"]["bytes"]
  assert p["num_params"] * 4 <= reduced <= p["num_params"] * 4 + 64
  assert p["tpu_collectives"]["all-gather"]["count"] == 0
  # The jaxpr's model FLOPs: the planner's count of the same matmuls.
  assert p["tpu_model_flops"] == pytest.approx(p["flops_per_step"], rel=0.02)
  assert p["tpu_est_step_s"] > 0
  assert p["tpu_est_img_per_s_per_chip"] == pytest.approx(
      32 / p["tpu_est_step_s"] / 4
  )
  assert 0 < p["tpu_est_mfu"] < 1


@needs_libtpu
def test_step_time_by_depth_matches_the_full_unrolled_compile():
  """--time_by_depth on a scanned model against the oracle it stands in for: the
  cost model's time of the same step unrolled at full depth."""
  config = _tiny_config()
  config.model.depth = 4
  unrolled = plan.plan_on_slice(
      config, (("data", -1),), "v5e:2x2", compile_step=True
  )
  config.model.scan = True
  p = plan.plan_on_slice(
      config,
      (("data", -1),),
      "v5e:2x2",
      compile_step=True,
      time_by_depth=True,
  )
  time_1, time_2 = p["tpu_est_by_depth"]
  assert 0 < time_1 < time_2
  assert p["tpu_est_step_s"] == pytest.approx(time_1 + 3 * (time_2 - time_1))
  assert p["tpu_est_step_s"] == pytest.approx(
      unrolled["tpu_est_step_s"], rel=0.05
  )
  assert p["tpu_est_mfu"] == pytest.approx(unrolled["tpu_est_mfu"], rel=0.05)
  report = "\n".join(plan_report.tpu_lines(p))
  assert "extrapolated to depth 4" in report


@needs_libtpu
def test_a_too_big_batch_does_not_fit():
  config = _tiny_config(batch_size=4 * 65536)
  config.input.pp = config.input.pp.replace(
      "decode(channels=1)", "decode(channels=1)|resize(64)"
  )
  p = plan.plan_on_slice(config, "fsdp:-1", "v5e:2x2", compile_step=True)
  assert p["dtype_mm"] == "bfloat16"  # "auto" on a TPU
  # 65536 images of 64x64 per device: 1 GiB of input alone, activations far
  # more. The compiler refuses such a program; plan reports it and what the
  # compiler said it needs.
  assert not p["tpu_fits"] and "exceeds available HBM" in p["tpu_refused"]
  assert p["tpu_needed_bytes"] > p["tpu_hbm_bytes"]
  assert "does NOT fit" in plan_report.format_report(p)


@needs_libtpu
def test_fsdp_gathers_the_params():
  config = _tiny_config()
  p = plan.plan_on_slice(config, "fsdp:-1", "v5e:2x2", compile_step=True)
  assert p["tpu_fits"] and p["mesh"] == {"fsdp": 4}
  assert p["tpu_collectives"]["all-gather"]["count"] > 0
  assert (
      p["tpu_collectives"]["reduce-scatter"]["count"]
      + p["tpu_collectives"]["all-reduce"]["count"]
      > 0
  )


@pytest.mark.slow
@needs_libtpu
def test_cli_prints_the_report_and_one_line_errors():
  env = dict(os.environ, JAX_PLATFORMS="cpu")

  def run(*args):
    return subprocess.run(
        forkserver.command([sys.executable, "-m", "big_vit_lite.plan", *args]),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )

  proc = run("--config=configs/demo.py", "--topology=v7x-8")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      "plan: --topology=v7x-8: unknown TPU slice; use accelerator names like v5p-256, v4-32, "
      "v5litepod-16, v6e-256 or topologies like v5p:8x8x8, v5e:2x2."
  )
  proc = run(
      "--config=configs/demo.py",
      "--topology=v5p:2x2x1",
      "--compile",
      "--time_by_depth",
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "extrapolated to depth 4)" in proc.stdout  # (the demo's ViT)
  proc = run("--config=configs/demo.py", "--time_by_depth")
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      "plan: --time_by_depth estimates with the TPU compiler: add"
      " --topology=SLICE and --compile"
  )
  proc = run("--config=configs/demo.py", "--topology=v4-32", "--mesh=data:8")
  assert proc.returncode == 1
  assert (
      proc.stderr.strip()
      .splitlines()[-1]
      .startswith(
          "plan: mesh data:8 does not match --topology=v4-32 (16 devices)"
      )
  )


def _shipped(name, arg=None):
  path = os.path.join(REPO, "configs", f"{name}.py")
  return config_loading.config_module(path).get_config(arg)


@pytest.mark.parametrize("name", ["vit_l16", "vit_b16", "vit_s16_i1k"])
def test_training_configs_expose_the_accelerator_knobs(name):
  """--config.model.KEY=... needs the key in the config; "auto" is bf16 off the CPU only."""
  model = _shipped(name).model
  for key in (
      "dtype_mm",
      "dtype_act",
      "scan",
      "remat_policy",
      "attention",
      "drop_path",
  ):
    assert key in model, key
  assert model.dtype_mm == "auto"
  # this CPU
  assert vit.Model(**model.to_dict()).resolved_dtype_mm() == "float32"
  assert [vit.resolve_dtype_mm("auto", p) for p in ("cpu", "gpu", "tpu")] == [
      "float32",
      "bfloat16",
      "bfloat16",
  ]
  assert vit.resolve_dtype_mm("float32", "tpu") == "float32"
  # The residual stream and the attention: the TPU's choice only on a TPU.
  assert model.dtype_act == "auto"
  assert model.attention == "auto"
  assert [vit.resolve_dtype_act("auto", p) for p in ("cpu", "gpu", "tpu")] == [
      "float32",
      "float32",
      "bfloat16",
  ]
  assert vit.resolve_dtype_act("float32", "tpu") == "float32"
  shipped = vit.Model(**model.to_dict())
  # (On a GPU plan assumes CUDA: cuDNN takes bf16 matmuls and D/H = 64.)
  assert [shipped.resolved_attention(p) for p in ("cpu", "gpu", "tpu")] == [
      "custom",
      "cudnn",
      "xla",
  ]
  assert shipped.resolved_attention() == "custom"  # this CPU
  assert shipped.resolved_dtype_act() == "float32"


@pytest.mark.parametrize(
    "arg, name, classes",
    [
        ("", "imagenet21k", 21841),
        ("data=i21k_fall11", "imagenet21k/fall11", 21841),
        # the builder's winter21 synsets
        ("data=i21k_winter21", "imagenet21k/winter21", 19167),
    ],
)
def test_the_imagenet21k_release_is_an_arg(arg, name, classes):
  for config_name in ("vit_l16", "vit_b16"):
    config = _shipped(config_name, arg)
    assert config.input.data.name == config.evals.minival.data.name == name
    assert config.model.num_classes == classes
    for pp in (config.input.pp, config.evals.minival.pp):
      assert f"onehot({classes}," in pp
