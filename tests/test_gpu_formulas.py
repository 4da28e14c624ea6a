"""plan's analytic GPU memory (formulas.gpu_activation_bytes) against XLA's GPU compiler.

The oracle is data: the compiler's peak bytes per GPU (argument + output + temp -
alias, `memory_analysis()`), recorded on 2026-12-06 with jax 0.10.2,
jax-cuda12-plugin 0.10.2 and cuDNN 9.28 on a CPU machine (no GPU) by

  PYTHONPATH=.venv/gpu-compiler python benchmarks/plan_vs_gpu.py --variant=V \
      --depth=N --remat=R [--attention=A]

(configs/vit_l16.py:variant=V as shipped: batch 4096, fsdp:8 on 8x H100, bf16
matmuls, f32 residual stream, cuDNN attention, dropout 0.1, 21,841 classes), and
with --gpu=a100-80gbx8, h200x8 and b200x8 (benchmarks/NOTES.md, "The GPU compiler per
GPU").
Two depths (4 and 6, or 6 and 8) give one block's bytes (their difference); the
full depth is compiled (every remat case, and every case on the H200), or else
extrapolated from the two deepest compiles: good without remat for B/16 (the
H200's B/16 at d4, d6 read 2% high), not for the deeper models (L/16 and H/14: -10% to
+13%) nor with remat (L/16's d6, d8 read the H100's full depth 11% high, the
H200's 36%): benchmarks/NOTES.md, "Full depth".
"""

import functools
import os

import jax
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite.planner import assemble
from big_vit_lite.planner import formulas
from big_vit_lite.planner import gpu
from big_vit_lite.planner import plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL_DEPTH = {"B/16": 12, "L/16": 24, "H/14": 32}
IMAGES_PER_GPU = 512

# (variant, remat_policy) -> {depth: the compiler's peak bytes per GPU}, 8x H100.
# The full depths (12, 24, 32) compiled on 2026-12-06 (later), where the shallow
# pairs had been extrapolated: benchmarks/NOTES.md, "Full depth".
COMPILED = {
    ("B/16", None): {
        4: 18_205_324_364,
        6: 26_152_215_516,
        # plan --gpu=h100x8 --compile of configs/vit_b16.py, 2026-12-05
        # (recorded as 47.15 GiB).
        12: int(47.15 * 2**30),
    },
    ("B/16", "nothing_saveable"): {
        6: 9_790_870_492,
        8: 10_448_925_036,
        12: 11_730_778_420,
    },
    ("L/16", None): {6: 33_867_947_740, 8: 44_071_481_964, 24: 119_006_155_572},
    ("L/16", "nothing_saveable"): {
        6: 14_328_865_500,
        8: 15_107_011_180,
        24: 19_247_117_876,
    },
    ("H/14", None): {4: 38_086_714_956, 6: 54_744_398_044, 32: 256_420_949_300},
    ("H/14", "nothing_saveable"): {
        6: 16_534_959_324,
        8: 17_941_641_324,
        32: 36_752_499_764,
    },
}

# The same compiled for the other GPUs' hosts (--gpu=a100-80gbx8, h200x8, b200x8),
# 2026-12-06: XLA lays the buffers out differently for each (formulas.GPU_FITS).
COMPILED_ON = {
    "h100x8": COMPILED,
    "a100-80gbx8": {
        ("B/16", None): {4: 15_299_385_676, 6: 22_196_227_292},
        ("B/16", "nothing_saveable"): {
            6: 7_183_709_404,
            8: 7_824_834_132,
            12: 9_107_080_500,
        },
        ("L/16", None): {
            6: 29_492_825_564,
            8: 38_710_090_324,
            24: 99_551_486_260,
        },
        ("L/16", "nothing_saveable"): {
            6: 9_450_748_892,
            8: 10_315_006_804,
            24: 18_753_900_084,
        },
        ("H/14", None): {
            4: 32_755_623_756,
            6: 47_807_970_268,
            32: 223_873_700_916,
        },
        ("H/14", "nothing_saveable"): {
            6: 15_064_084_188,
            8: 16_470_766_164,
            32: 38_793_522_996,
        },
    },
    "h200x8": {
        ("B/16", None): {12: 50_609_091_380},
        ("B/16", "nothing_saveable"): {12: 11_988_732_212},
        ("L/16", None): {24: 116_380_913_716},
        ("L/16", "nothing_saveable"): {
            6: 14_606_115_548,
            8: 15_889_283_692,
            24: 19_224_745_524,
        },
        ("H/14", None): {32: 257_082_207_028},
        ("H/14", "nothing_saveable"): {32: 36_730_127_412},
    },
    "b200x8": {
        ("B/16", None): {4: 16_817_344_588, 6: 24_689_722_844},
        ("B/16", "nothing_saveable"): {
            6: 11_675_763_932,
            8: 12_650_354_284,
            12: 16_320_006_708,
        },
        ("L/16", None): {
            6: 33_696_415_452,
            8: 44_049_109_612,
            24: 125_928_670_772,
        },
        ("L/16", "nothing_saveable"): {
            6: 15_219_008_220,
            8: 16_520_118_892,
            24: 20_027_520_564,
        },
        ("H/14", None): {
            4: 38_058_444_364,
            6: 53_234_755_804,
            32: 257_925_654_836,
        },
        ("H/14", "nothing_saveable"): {
            6: 22_877_559_516,
            8: 24_692_579_948,
            32: 36_425_600_308,
        },
    },
}

# The one case outside 10% (plan's error, recorded): the B200's B/16 with remat
# unrolled, 4.8 GiB over the H100's at the same layout (benchmarks/NOTES.md, "Full
# depth"); under scan it is 9.0 GiB, as on the other GPUs (below).
KNOWN_MISSES = {("b200x8", "B/16", "nothing_saveable"): -0.317}

# With remat (nothing_saveable) and the blocks under nn.scan (--scan: what
# docs/gpu.md recommends with remat on a GPU), full depth, 2026-12-06 (session 27):
# host -> {(config, images per GPU): the compiler's peak bytes per GPU}. "vit_l16:V"
# is configs/vit_l16.py:variant=V as above; "vit_s16_i1k" its own recipe (data:8,
# batch 1024, no dropout). The four GPUs' programs agree within 2.5% but for the
# A100's S/16 (8% below).
COMPILED_SCANNED_REMAT = {
    "a100-80gbx8": {
        ("vit_l16:B/16", 512): 9_476_538_540,
        ("vit_l16:L/16", 512): 17_884_037_036,
        ("vit_l16:H/14", 512): 34_936_143_276,
        ("vit_s16_i1k", 128): 1_434_810_968,
    },
    "h100x8": {
        ("vit_l16:B/16", 512): 9_718_953_900,
        ("vit_l16:L/16", 512): 18_125_013_420,
        ("vit_l16:H/14", 512): 34_840_657_324,
        ("vit_s16_i1k", 128): 1_563_159_640,
        # Half the batch: under scan the peak scales with it (B/16 at 256 is 0.51x
        # the one at 512; unrolled, 0.58x on an H100: benchmarks/NOTES.md).
        ("vit_l16:B/16", 256): 4_976_442_796,
        ("vit_l16:L/16", 256): 9_424_554_412,
        ("vit_s16_i1k", 256): 2_747_112_536,
    },
    "h200x8": {
        ("vit_l16:B/16", 512): 9_696_581_548,
        ("vit_l16:L/16", 512): 18_102_641_068,
        ("vit_l16:H/14", 512): 34_818_284_972,
        ("vit_s16_i1k", 128): 1_563_159_128,
    },
    "b200x8": {
        ("vit_l16:B/16", 512): 9_696_581_548,
        ("vit_l16:L/16", 512): 18_102_641_324,
        ("vit_l16:H/14", 512): 34_818_284_972,
        ("vit_s16_i1k", 128): 1_568_545_880,
    },
}

# B/16 as above with --attention=custom and --attention=xla: {depth: peak bytes}.
COMPILED_ATTENTION = {
    "custom": {4: 21_855_492_172, 6: 31_088_521_436},
    "xla": {4: 21_749_820_492, 6: 31_176_328_156},
}

# The model sizes (the ViT paper's Table 1) and tokens at 224 px (a class token).
ARCH = {
    "B/16": (dict(width=768, mlp_dim=3072, num_heads=12), 197),
    "L/16": (dict(width=1024, mlp_dim=4096, num_heads=16), 197),
    "H/14": (dict(width=1280, mlp_dim=5120, num_heads=16), 257),
}


def _compiled_at_full_depth(peaks: dict, depth: int) -> float:
  """The compiler's figure at `depth`: compiled, or extrapolated from its two
  deepest compiles (the blocks are alike, so the peak is affine in the depth).
  """
  if depth in peaks:
    return peaks[depth]
  a, b = sorted(peaks)[-2:]
  return peaks[b] + (depth - b) * (peaks[b] - peaks[a]) / (b - a)


def _shipped(name, remat, scan):
  """configs/vit_l16.py:variant=V ("vit_l16:V") or configs/NAME.py as shipped, with
  remat_policy and scan set."""
  file_name, _, variant = name.partition(":")
  module = config_loading.config_module(
      os.path.join(REPO, "configs", f"{file_name}.py")
  )
  config = module.get_config()
  if variant:
    config = module.get_config(f"variant={variant}")
  config.model.remat_policy = remat
  config.model.scan = scan
  return config


@functools.lru_cache(maxsize=None)
def _assembled(name, remat, scan, per_gpu):
  """A shipped recipe (_shipped) at per_gpu images per GPU on its mesh with the -1
  axis over 8 GPUs: (config, mesh, the trainer's assembly for the GPU), made once
  (the slow part: tracing the model and optimizer) and shared by the hosts, whose
  GPUs differ but not the mesh."""
  config = _shipped(name, remat, scan)
  config.input.batch_size = per_gpu * 8
  mesh = assemble.resolve_mesh(config.mesh, 8, "8 GPUs")
  abstract_mesh = jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))
  built = assemble.assemble(
      config, abstract_mesh, plan.image_res(config), "gpu"
  )
  return config, mesh, built


def _planned(name, remat, scan, per_gpu, host):
  """What `plan --gpu=HOST` gives for the recipe (plan_on_gpus' plan: the host's GPU)."""
  config, mesh, built = _assembled(name, remat, scan, per_gpu)
  device_key = gpu.GPUS[gpu.parse_host(host).gpu].device_key
  return plan.plan(config, mesh, device_key, built=built)


# Between depths 4 and 6 (or 6 and 8) the compiled peak grows 1.16-1.21x as fast
# as the residuals it holds (B/16, L/16, H/14 on an H100); over the full depth
# 1.13x (formulas.GPU_HEAP_PACKING): the heap packs the deeper programs tighter.
SHALLOW_PACKING = 1.18


def test_gpu_block_bytes_are_the_compilers_bytes_per_block():
  """Guards the per-block terms of gpu_block_bytes (a residual dropped or counted
  twice, the wrong dtype, cuDNN's padding or the dropout masks lost, the TPU's f32
  logits counted for XLA's attention): one block's bytes by the formula, times the
  shallow programs' heap packing, within 10% of the compiler's increase per block
  without remat (two depths' difference) for B/16, L/16, H/14 with cuDNN's
  attention, and B/16 with the custom and XLA's attention.
  """
  cases = [
      (variant, "cudnn", COMPILED[(variant, None)]) for variant in ARCH
  ] + [("B/16", kind, peaks) for kind, peaks in COMPILED_ATTENTION.items()]
  for variant, attention, peaks in cases:
    arch, tokens = ARCH[variant]
    a, b = sorted(peaks)[:2]
    per_block = (peaks[b] - peaks[a]) / (b - a)
    block = formulas.gpu_block_bytes(
        arch,
        tokens=tokens,
        mm_bytes=2,
        dropout=True,
        opts=dict(attention=attention, dtype_act="float32"),
    )
    got = SHALLOW_PACKING * block * IMAGES_PER_GPU
    assert got == pytest.approx(per_block, rel=0.10), (variant, attention)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", sorted(COMPILED_ON))
def test_plan_is_within_10_percent_of_the_gpu_compiler_on_each_gpu(host):
  """Guards plan's whole GPU figure (state, batch, gathered weights, activations
  and the remat terms) and its per-GPU fit (formulas.GPU_FITS: the A100's program
  packs tighter than the H100's, 0.95 against 1.13; with the H100's constants plan
  read its L/16 and H/14 18-23% high): each shipped-recipe model compiled for the host within 10% of the
  compiler's peak per GPU, with and without remat (the fix for plan's 2.5-2.8x
  overestimate with the formulas fitted to XLA:CPU)."""
  for (variant, remat), peaks in COMPILED_ON[host].items():
    # Compiled unrolled (scan=False) on fsdp:8, as the configs ship.
    p = _planned(f"vit_l16:{variant}", remat, False, IMAGES_PER_GPU, host)
    assert p["local_batch"] == IMAGES_PER_GPU and p["attention"] == "cudnn"
    want = _compiled_at_full_depth(peaks, FULL_DEPTH[variant])
    error = p["total_bytes_per_device"] / want - 1
    known = KNOWN_MISSES.get((host, variant, remat))
    if known is None:
      assert abs(error) <= 0.10, (variant, remat, error)
    else:
      # As recorded in benchmarks/NOTES.md and docs/gpu.md, until it is fixed.
      assert error == pytest.approx(known, abs=0.01), (variant, remat, error)


@pytest.mark.parametrize("host", sorted(COMPILED_SCANNED_REMAT))
def test_plan_is_within_10_percent_of_the_gpu_compiler_with_remat_under_scan(
    host,
):
  """Guards plan's remat figure for the blocks under nn.scan
  (formulas.GPU_SCAN_REMAT_LIVE_BLOCKS, one constant for every GPU: the scanned
  programs agree across GPUs where the unrolled ones do not): each shipped
  pretraining recipe with remat and scan within 10% of the compiler's peak per
  GPU, at two batches on an H100. With the unrolled programs' constants (1.4 blocks
  on the H100, H200 and B200) plan read these rows 8-15% high.
  """
  for (name, per_gpu), want in COMPILED_SCANNED_REMAT[host].items():
    p = _planned(name, "nothing_saveable", True, per_gpu, host)
    assert p["local_batch"] == per_gpu and p["attention"] == "cudnn"
    error = p["total_bytes_per_device"] / want - 1
    assert abs(error) <= 0.10, (name, per_gpu, error)
