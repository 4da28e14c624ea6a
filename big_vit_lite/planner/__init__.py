"""The planner: memory, FLOPs and step time of a training config on a mesh, before a run.

`python -m big_vit_lite.plan` (plan.py). It builds the trainer's own model, state layout
and step (assemble.py over train_setup and train_state) and adds analytic figures
(formulas.py) or a compiler's: XLA:CPU on simulated devices (cpu.py), the TPU compiler
for a slice (tpu.py), the GPU compiler for a GPU host (gpu.py). It sits below the trainer in
the import graph: nothing in the trainer imports it.
"""
