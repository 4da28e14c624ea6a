r"""ViT-B/16 pretraining as in the ViT paper, on ImageNet-21k (the ViT-L/16 recipe at size B).

  python -m big_vit_lite.data.prepare imagenet21k --manual_dir=DIR_WITH_THE_TARS   # once
  python -m big_vit_lite.train --config=configs/vit_b16.py --workdir=workdirs/vit_b16

Same recipe as configs/vit_l16.py (Adam 0.9/0.999, batch 4096, weight decay
0.1 in the paper's convention, 10k warmup + linear decay, sigmoid xent,
pre-logits, 90 epochs of ImageNet-21k) with the paper's lr of 1e-3 for B.

Expected result (from the paper, not reproducible on CPU): fine-tuned on
ImageNet-1k at 384px, ViT-B/16 pretrained on ImageNet-21k reaches ~84% top-1.
About 1/3.5 of the compute of L/16 (86M vs 304M params).

Accelerators: meant for a TPU v4-32 (16 chips, 256 images per chip), which needs remat (plan:
35 GiB of 32 per chip without it): --config.model.remat_policy=dots_saveable (it recomputes no
matmul; the TPU compiler: 19.1 of 32 GiB per chip on data:16, plan 22.7) or nothing_saveable
(5.1 GiB, plan 7.9); or a v5litepod-16 on data:4,fsdp:4 with
--config.model.remat_policy=dots_with_no_batch_dims_saveable (12.5 of 16 GiB, plan 14.2).
docs/tpu.md has the commands. The "auto" model settings as configs/vit_l16.py's
ACCELERATOR_KNOBS: bfloat16 matmuls off the CPU, and on a TPU a bfloat16 residual stream and
XLA's attention. The compiler's cost model gives no step time for v4 and v5e programs; on a
v5p-32 (the same 16 chips and batch) it estimates 156 ms per step with dots_saveable (~1640
img/s per chip, MFU ~38%) and 178 ms with nothing_saveable (~33%).

Args: the ones of configs/vit_l16.py (data=i21k|i1k|folder:ROOT, classes=N,
runlocal), e.g. `configs/vit_b16.py:data=i1k` or `configs/vit_b16.py:runlocal`.
"""

from big_vit_lite.config import config_loading  # configs/vit_l16.py, a module here (config_loading's docstring).
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
