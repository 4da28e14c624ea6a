"""`python -m big_vit_lite.plan --config=...`: the planner's command line.

The planner lives in big_vit_lite/planner/ (plan.py: the plan and its CLI; formulas.py,
report.py, assemble.py: the trainer's own model, state and step; cpu.py, tpu.py, gpu.py:
the XLA:CPU, TPU and GPU compilers' targets); this module keeps the command where it always was.
"""

if __name__ == "__main__":
  from big_vit_lite.planner import plan  # pylint: disable=g-import-not-at-top

  plan.run()
