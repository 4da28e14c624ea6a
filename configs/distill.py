r"""Distillation on the offline data: a small ViT student taught by a demo-config teacher.

  # The teacher: the demo model (configs/demo.py), 1,500 steps.
  python -m big_vit_lite.train --config=configs/distill.py:teacher_run --workdir=workdirs/teacher
  # The student distilled from it, and the same student from scratch, 1,000 steps each:
  python -m big_vit_lite.train --config=configs/distill.py:teacher=workdirs/teacher \
      --workdir=workdirs/student_kd
  python -m big_vit_lite.train --config=configs/distill.py --workdir=workdirs/student_scratch

Expected result (benchmarks/NOTES.md, section "Model options and distillation"):
Fashion-MNIST test prec@1 ("val/prec@1" in metrics.jsonl): teacher 0.773 after 1,500 steps;
at 1,000 steps the distilled student 0.708, the same student from scratch 0.693
(deterministic on a given machine; 2 CPU cores: the teacher's steps ~9 min, each student's
1-3 min depending on the load). With `,feature`: 0.712; with `,token` (class-token pooling):
0.718, against 0.713 for the same `tok` student from scratch
(`--config.model.pool_type=tok`).

Args (comma-separated after the file name):
  teacher=SRC   distil from SRC (a workdir, step dir, .npz or .safetensors); without it the
                student trains from scratch on the labels alone.
  teacher_run   train the teacher instead: the demo model for 1,500 steps.
  feature       with teacher=SRC: also feature distillation (config.distill.feature_weight=1).
  token         with teacher=SRC: a student with a DeiT distillation token (model.distill_token),
                its class head on the labels and its distillation head on the teacher (weight 0.5).
  runlocal      a few steps on configs/demo.py's runlocal data (tests, smoke runs).
"""

from ml_collections import config_dict

from big_vit_lite.config import config_loading  # configs/demo.py, a module here (config_loading's docstring).
import demo


def get_config(arg=None):
  args = config_loading.parse_arg(
      arg,
      teacher="",
      teacher_run=False,
      feature=False,
      token=False,
      runlocal=False,
  )
  if (args.feature or args.token) and not args.teacher:
    raise ValueError(
        "Config args feature and token distil: add teacher=SRC (e.g. "
        "configs/distill.py:teacher=workdirs/teacher,feature)."
    )
  config = demo.make_config(runlocal=args.runlocal)
  config.total_epochs = config_dict.placeholder(float)
  if args.runlocal:
    config.total_steps = 3
  elif args.teacher_run:
    config.total_steps = 1500
  else:
    config.total_steps = 1000
  config.schedule.warmup_steps = 1 if args.runlocal else 200
  config.log_training_steps = 1 if args.runlocal else 100
  config.ckpt_steps = config.total_steps
  config.evals.val.log_steps = config.total_steps
  del config.evals["fewshot"]
  if args.teacher_run:
    return config
  # The student: a quarter of the teacher's width and half its depth (~1/20 of
  # its FLOPs).
  config.model.update(width=64, depth=2, mlp_dim=256, num_heads=2)
  if args.teacher:
    # KL to the teacher's logits on the same augmented batch only (weight 1: no
    # labels), as big_vision's "consistent" distillation; weight 0.75 at T=2
    # gained less (NOTES.md).
    config.distill = dict(teacher=args.teacher, weight=1.0, temperature=1.0)
  if args.feature:
    # The labels' loss and the logits' KL as above, plus the projected
    # pre-logits' squared error to the teacher's.
    config.distill.feature_weight = 1.0
  if args.token:
    # DeiT: the class head learns the labels, the distillation head the teacher
    # (soft, T=1), half and half. Both heads read tokens: no gap pooling.
    config.model.update(distill_token=True, pool_type="tok")
    config.distill.weight = 0.5
  return config
