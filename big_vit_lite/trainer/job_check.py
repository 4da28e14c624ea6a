"""The whole training job checked before its first step, and `train --check`.

By the time `check_job` runs, the trainer has read every config key (unread
keys are errors), opened the training data and every eval's datasets and
splits (a missing one stops there), checked config.wandb (wandb_writer.check:
installed, logged in or offline, reachable) and the model's ranges
(vit.Model.check). What is left, and checked here, is what only the pieces
together say: that each eval feeds the model the images it is built for (the
size and channels the train pp gives), that the train images make at least
one patch, and that config.init_head_bias has a head to set. Each failure is
one line naming the config key to change.

`python -m big_vit_lite.train ... --check` runs these checks and the first
compile of the step, then prints "ok" and the run's shapes (`describe`) and
exits without training or writing a checkpoint.
"""

import jax

from big_vit_lite.data import input_pipeline


def check_job(*, inputs, model, settings):
  """One-line ValueError for the first of these mismatches (module docstring)."""
  image_shape = tuple(model.image_shape)
  check_train_images(image_shape, model.module.arch()["patch_size"])
  check_head_bias(model.init_head_bias, model.module)
  for name, (evaluator, _, _) in settings.evaluators.items():
    for what, iterable in eval_inputs(evaluator):
      shapes = iterable.example_shapes()
      if "image" not in shapes:
        continue  # The evaluator says what it lacks.
      check_eval_images(name, what, shapes["image"][0], image_shape)


def check_train_images(image_shape, patch_size):
  height, width = image_shape[:2]
  if height < patch_size or width < patch_size:
    raise ValueError(
        f"config.input.pp gives {_size(image_shape)} images, smaller than one "
        f"{patch_size}x{patch_size} patch (config.model.patch_size): resize "
        "them larger in config.input.pp or use a smaller patch_size."
    )


def check_head_bias(init_head_bias, module):
  if init_head_bias is not None and not module.num_classes:
    raise ValueError(
        f"config.init_head_bias={init_head_bias} is set but the model has no "
        "head (config.model.num_classes=0): remove init_head_bias, or give "
        "the model its classes."
    )


def eval_inputs(evaluator):
  """(what, input_pipeline.EvalIterable) of each split the evaluator feeds the model."""
  # fewshot, linear_probe: {dataset: (train data, test data, pp)}.
  datasets = getattr(evaluator, "datasets", None)
  if isinstance(datasets, dict):
    batch = jax.process_count()
    for dataset, (train_cfg, test_cfg, pp) in datasets.items():
      for data_cfg in (train_cfg, test_cfg):
        iterable = input_pipeline.make_eval_iterator(data_cfg, pp, batch)
        yield f"dataset {dataset}, {iterable.name}", iterable
    return
  # classification, multilabel: one split.
  batches = getattr(evaluator, "batches", None)
  if isinstance(batches, input_pipeline.EvalIterable):
    yield batches.name, batches


def check_eval_images(name, what, eval_shape, image_shape):
  """The images of eval `name` (from `what`) against the model's input."""
  eval_shape, image_shape = tuple(eval_shape), tuple(image_shape)
  if eval_shape == image_shape:
    return
  if eval_shape[:2] != image_shape[:2]:
    side = image_shape[0]
    todo = (
        f"make both one size: resize({side}) in config.evals.{name}.pp, or "
        f"resize({eval_shape[0]}) in config.input.pp"
    )
  else:
    channels = image_shape[-1]
    todo = (
        f"decode(channels={channels}) in config.evals.{name}.pp, or "
        f"decode(channels={eval_shape[-1]}) in config.input.pp"
    )
  raise ValueError(
      f"config.evals.{name} ({what}) gives {_size(eval_shape)} images but the "
      f"model is built for {_size(image_shape)}, what config.input.pp gives: "
      f"{todo}."
  )


def _size(shape):
  """(56, 56, 1) -> '56x56x1'."""
  return "x".join(str(d) for d in shape)


def describe(*, inputs, model, settings, params_abstract):
  """The "ok" line of `train --check`: the run's shapes."""
  evals = []
  for name, (evaluator, every, _) in settings.evaluators.items():
    shapes = [
        iterable.example_shapes() for _, iterable in eval_inputs(evaluator)
    ]
    sizes = sorted({_size(s["image"][0]) for s in shapes if "image" in s})
    evals.append(f"{name} {'/'.join(sizes)} every {every} steps")
  labels = model.batch_spec["labels"].shape[-1]
  params = sum(x.size for x in jax.tree.leaves(params_abstract))
  return (
      f"ok: train batch {inputs.batch_size} x {_size(model.image_shape)} "
      f"images, {labels} classes, {inputs.total_steps} steps; model "
      f"{params:,} params; evals: {'; '.join(evals) or 'none'}; the step "
      "compiles"
  )
