r"""ViT-B/16 pretraining as in the ViT paper, on ImageNet-21k (the ViT-L/16 recipe at size B).

  python -m big_vit_lite.data.prepare imagenet21k --manual_dir=DIR_WITH_THE_TARS   # once
  python -m big_vit_lite.train --config=configs/vit_b16.py --workdir=workdirs/vit_b16

Same recipe as configs/vit_l16.py (Adam 0.9/0.999, batch 4096, weight decay
0.1 in the paper's convention, 10k warmup + linear decay, sigmoid xent,
pre-logits, 90 epochs of ImageNet-21k) with the paper's lr of 1e-3 for B.

Expected result (from the paper, not reproducible on CPU): fine-tuned on
ImageNet-1k at 384px, ViT-B/16 pretrained on ImageNet-21k reaches ~84% top-1.
About 1/3.5 of the compute of L/16 (86M vs 304M params).

Accelerators: meant for a TPU v4-32 (16 chips, 256 images per chip) with remat:
--config.model.remat_policy=nothing_saveable (plan: 9.6 GiB of 32 per chip on the default mesh
fsdp:16, 11.3 on data:16; 33 without remat), or a v5litepod-16 on data:4,fsdp:4 with remat (9.8
of 16 GiB); docs/tpu.md has the commands. The "auto" model settings as configs/vit_l16.py's
ACCELERATOR_KNOBS: bfloat16 matmuls off the CPU, and on a TPU a bfloat16 residual stream and
XLA's attention. The TPU compiler (plan --topology=... --compile, libtpu 0.0.42.1) needs less:
5.1 of 32 GiB per chip on v4-32 (data:16) and 4.1 of 16 GiB on v5litepod-16, both with remat
(6.3 and 5.9 with the defaults before: custom attention, float32 stream); its cost model gives
no step time for v4 and v5e programs. On a v5p-32 (the same 16 chips and batch, with a cost
model) it estimates 178 ms per step with remat, ~1440 img/s per chip, MFU ~33%.

Args: the ones of configs/vit_l16.py (data=i21k|i1k|folder:ROOT, classes=N,
runlocal), e.g. `configs/vit_b16.py:data=i1k` or `configs/vit_b16.py:runlocal`.
"""

from big_vit_lite import config_loading

# configs/vit_l16.py, a module here (config_loading's docstring).
import vit_l16


def get_config(arg=None):
  args = config_loading.parse_arg(arg, **vit_l16.ARGS)
  config = vit_l16.make_config(
      variant="B/16",
      data=args.data,
      classes=args.classes,
      runlocal=args.runlocal,
  )
  config.lr = 1e-3
  config.wd = 0.1 * config.lr
  return config
