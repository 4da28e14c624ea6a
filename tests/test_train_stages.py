"""The trainer's stages one by one through their public functions, in train._train's order."""

import contextlib
import copy
import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite.config import config_loading
from big_vit_lite import train
from big_vit_lite.trainer import train_setup
from big_vit_lite.trainer import train_step
from big_vit_lite.data import mixup as mixup_lib

import checks
import train_config_tiny


def _tiny(tfds_data_dir, **overrides):
  raw = train_config_tiny.get_config()
  raw.input.data.data_dir = tfds_data_dir
  raw.update(overrides)
  return raw


def _build(config, workdir, cleanup):
  """train._train's stages up to the settings, through the public functions.

  The mesh and the logical-axis rules stay set until `cleanup` closes.
  """
  job = train_setup.start_job(config, workdir, cleanup)
  inputs = train_setup.read_inputs(config, mesh=job.mesh, seed=job.seed)
  model = train_setup.make_model(
      config,
      batch_spec=inputs.train_iter.batch_spec(),
      mesh=job.mesh,
      rules=job.rules,
  )
  cleanup.enter_context(jax.set_mesh(job.mesh))
  cleanup.enter_context(nn.logical_axis_rules(job.rules))
  layout = train.lay_out_state(config, job=job, inputs=inputs, model=model)
  # Reads the rest: no key left.
  settings = train_setup.read_settings(
      config,
      model=model.module,
      ema=layout.ema,
      mesh=job.mesh,
      dur=inputs.dur,
  )
  return job, inputs, model, layout, settings


def _update_fn(job, inputs, model, layout):
  return train_step.make_update_fn(
      model=model.module,
      opt=layout.opt,
      loss_fn=model.loss_fn,
      accum_steps=inputs.accum_steps,
      mixup_fn=model.mixup_fn,
      device_aug_fn=model.device_aug_fn,
      ema=layout.ema,
      batch_sharding=job.batch_sh,
      param_shardings=layout.params_sh,
  )


def _equal(tree_a, tree_b):
  same = jax.tree.map(np.array_equal, tree_a, tree_b)
  return all(jax.tree.leaves(same))


def test_build_stages_give_a_state_that_matches_its_layout_and_a_deterministic_step(
    tfds_data_dir, tmp_path
):
  config = config_loading.TrackedConfig(_tiny(tfds_data_dir))
  with contextlib.ExitStack() as cleanup:
    job, inputs, model, layout, settings = _build(
        config, str(tmp_path / "w"), cleanup
    )
    counts = (
        inputs.total_steps,
        inputs.log_steps,
        inputs.ckpt_steps,
        inputs.batch_size,
    )
    assert counts == (12, 1, 4, 16)
    # The stages' values are built whole: none can be changed afterwards.
    with pytest.raises(dataclasses.FrozenInstanceError):
      layout.opt = None
    state = train.init_state(
        job=job, model=model, layout=layout, settings=settings
    )
    same = jax.tree.map(
        lambda x, a: (x.shape, x.dtype, x.sharding)
        == (a.shape, a.dtype, a.sharding),
        state,
        layout.state_abstract,
    )
    assert all(jax.tree.leaves(same))
    update_fn = _update_fn(job, inputs, model, layout)
    rng = np.random.RandomState(0)
    batch = {
        k: jnp.asarray(rng.uniform(-1, 1, (16,) + v.shape[1:]), v.dtype)
        for k, v in model.batch_spec.items()
    }
    s1, m1 = jax.jit(update_fn)(state, batch)
    s2, m2 = jax.jit(update_fn)(state, batch)
    # compile_step's executable computes the same step (sharded as the
    # trainer runs it), and counts its FLOPs.
    jitted = jax.jit(
        update_fn,
        in_shardings=(layout.state_sh, job.batch_sh),
        out_shardings=(layout.state_sh, job.repl),
    )
    step_fn, flops = train.compile_step(
        jitted, job=job, inputs=inputs, model=model, layout=layout
    )
    batch = jax.device_put(batch, job.batch_sh)
    s3, m3 = step_fn(state, batch)
  assert int(s1["step"]) == 1 and np.isfinite(float(m1["training_loss"]))
  # Random numbers: (seed, step).
  assert float(m1["training_loss"]) == float(m2["training_loss"])
  assert _equal(s1["params"], s2["params"])
  assert float(m3["training_loss"]) == float(m1["training_loss"])
  assert _equal(s3["params"], s1["params"])
  assert flops["step_flops"] > 0


def test_restore_or_init_resumes_the_newest_checkpoint(tfds_data_dir, tmp_path):
  workdir = str(tmp_path / "w")
  # Saves step 4 (ckpt_steps=4).
  train.train(_tiny(tfds_data_dir, total_steps=4), workdir)
  raw = _tiny(tfds_data_dir, total_steps=4)
  config = config_loading.TrackedConfig(raw)
  with contextlib.ExitStack() as cleanup:
    job, inputs, model, layout, settings = _build(config, workdir, cleanup)
    start = train.restore_or_init(
        raw,
        job=job,
        inputs=inputs,
        model=model,
        layout=layout,
        settings=settings,
        cleanup=cleanup,
    )
    restored = jax.device_get(start.state["params"])
  assert start.step == 4 and int(start.state["step"]) == 4
  saved, _ = checkpoint.load_params(workdir)
  assert _equal(restored, saved)


def test_a_finished_run_started_again_compiles_nothing(
    tfds_data_dir, tmp_path, monkeypatch
):
  workdir = str(tmp_path / "w")
  train.train(_tiny(tfds_data_dir, total_steps=4), workdir)

  def no_compile(*args, **kwargs):
    raise AssertionError("compiled a step for a finished run")

  monkeypatch.setattr(train, "compile_step", no_compile)
  params = train.train(_tiny(tfds_data_dir, total_steps=4), workdir)
  saved, _ = checkpoint.load_params(workdir)
  assert _equal(jax.device_get(params), saved)


def test_read_settings_parses_the_knobs_and_rejects_a_key_nothing_reads():
  dur = dict(steps_per_epoch=10, batch_size=4, total_steps=20)
  config = config_loading.TrackedConfig(
      ml_collections.ConfigDict(
          dict(model_load=dict(dont_load=["head/.*"]), ckpt_async=False)
      )
  )
  s = train_setup.read_settings(
      config, model=None, ema=None, mesh=None, dur=dur
  )
  assert (s.evaluators, s.dont_load) == ({}, ("head/.*",))
  assert (s.ckpt_async, s.report, s.eval_at_start) == (False, False, False)
  config = config_loading.TrackedConfig(
      ml_collections.ConfigDict(dict(eval_at_sart=True))
  )
  with pytest.raises(config_loading.UnreadConfigKeyError, match="eval_at_sart"):
    train_setup.read_settings(config, model=None, ema=None, mesh=None, dur=dur)


_one_line_error = checks.one_line_error


def test_big_vision_and_timm_mixup_configs():
  # big_vision's vit_i1k config: was "unexpected keyword argument 'fold_in'".
  mix = mixup_lib.make_mixup(dict(p=0.2, fold_in=None))
  _, labels = mix(
      jax.random.PRNGKey(1),
      np.zeros((4, 2, 2, 1), np.float32),
      np.eye(4, dtype=np.float32),
  )
  assert np.allclose(labels.sum(-1), 1) and not np.allclose(labels, np.eye(4))
  for cfg, words in (
      (dict(p=0.2, fold_in="device"), ["fold_in=None"]),
      (dict(mixup_alpha=0.8, label_smoothing=0.1), ["label_smoothing"]),
      # was: off, silently
      (dict(mixup_alpha=-0.2), ["mixup_alpha", ">= 0"]),
  ):
    _one_line_error(lambda cfg=cfg: mixup_lib.make_mixup(cfg), *words)


_cfg = checks.tracked_config


def test_an_eval_entry_named_after_its_type_needs_no_type(monkeypatch):
  built = []

  def fake_cls(type_name):
    return (
        lambda predict_fn, mesh, **kw: built.append((type_name, kw))
        or type_name
    )

  monkeypatch.setattr(train_setup.evaluators_lib, "get_evaluator_cls", fake_cls)
  config = _cfg(
      evals=ml_collections.ConfigDict(
          {"classification": {"batch_size": 8}, "val": {"type": "fewshot"}}
      )
  )
  out = train_setup.make_evaluators(config, model=None, mesh=None)
  assert built == [
      ("classification", {"batch_size": 8}),
      ("fewshot", {}),
  ], built
  assert set(out) == {"classification", "val"}


def test_unknown_model_name_is_one_line():
  # (It was a ModuleNotFoundError traceback from importlib.)
  checks.one_line_error(
      lambda: train_setup.make_model(
          checks.tracked_config(model_name="vitt"),
          batch_spec=None,
          mesh=None,
          rules=None,
      ),
      "model_name='vitt'",
      "only 'vit'",
  )


def test_splash_attention_off_a_tpu_is_one_line():
  # (It was jax's "Only interpret mode is supported on CPU backend" traceback
  # at the first step.)
  checks.one_line_error(
      lambda: train_setup.make_model(
          checks.tracked_config(
              model=dict(variant="mu/16", num_classes=10, attention="splash")
          ),
          batch_spec=None,
          mesh=None,
          rules=None,
      ),
      "model.attention='splash' runs Pallas TPU kernels",
      "this backend is cpu",
  )


def _losses(workdir):
  rows = [
      json.loads(line)
      for line in open(f"{workdir}/metrics.jsonl")
      if line.strip()
  ]
  return [r["training_loss"] for r in rows if "training_loss" in r]


# Each source of randomness in the step alone: a key made constant (the step's,
# or one source's) draws the same dropout masks / shifts / mixes at every step.
RANDOM_SOURCES = {
    "dropout": dict(device_aug=None),
    "device_aug": dict(model_dropout=0.0),
    "mixup": dict(
        device_aug=None,
        model_dropout=0.0,
        mixup=dict(mixup_alpha=1.0, cutmix_alpha=0.0, switch_prob=0.0),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(RANDOM_SOURCES))
def test_each_step_draws_new_random_numbers_and_a_rerun_the_same(
    tfds_data_dir, tmp_path, source
):
  # The same 16 examples in the same order at every step (a 16-example split, no
  # shuffle) and lr = 0 (the params never change): the steps' losses differ only
  # by the step's random numbers. They must differ from step to step and be the
  # same when the run is repeated.
  raw = _tiny(tfds_data_dir, total_steps=3, ckpt_steps=0, lr=0.0, wd=0.0)
  overrides = RANDOM_SOURCES[source]
  raw.device_aug = overrides.get("device_aug", raw.device_aug)
  raw.model.dropout = overrides.get("model_dropout", raw.model.dropout)
  if "mixup" in overrides:
    raw.mixup = overrides["mixup"]
  # (zero logits: the same loss whatever the input)
  raw.model.head_zeroinit = False
  raw.input.data.split = "train[:16]"
  raw.input.shuffle_buffer_size = 0
  # (flips on the host: random per epoch)
  raw.input.pp = raw.input.pp.replace("|flip_lr", "")
  runs = [str(tmp_path / name) for name in ("a", "b")]
  for workdir in runs:
    train.train(copy.deepcopy(raw), workdir)
  first, rerun = _losses(runs[0]), _losses(runs[1])
  assert len(first) == 3 and len(set(first)) == 3, first
  assert rerun == first


@pytest.mark.parametrize(
    "input_cfg, key",
    [
        (None, "input"),
        (dict(pp="decode"), "input.batch_size"),
    ],
)
def test_a_config_without_input_is_one_line(input_cfg, key):
  # Was an AttributeError traceback ('NoneType' object has no attribute
  # 'batch_size').
  given = {} if input_cfg is None else {"input": input_cfg}
  config = checks.tracked_config(total_steps=2, **given)
  checks.one_line_error(
      lambda: train_setup.read_inputs(config, mesh=None, seed=0),
      f"The config sets no config.{key}:",
      "configs/demo.py",
  )
