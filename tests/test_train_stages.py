"""The trainer's stages one by one, in process (train.py's _train calls them in this order)."""

import contextlib
import copy
import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from big_vit_lite import checkpoint
from big_vit_lite import config_loading
from big_vit_lite import train
from big_vit_lite import train_setup

import checks
import train_config_tiny


def _tiny(tfds_data_dir, **overrides):
  raw = train_config_tiny.get_config()
  raw.input.data.data_dir = tfds_data_dir
  raw.update(overrides)
  return raw


def test_build_stages_give_a_state_that_matches_its_layout_and_a_deterministic_step(
    tfds_data_dir, tmp_path
):
  config = config_loading.TrackedConfig(_tiny(tfds_data_dir))
  with contextlib.ExitStack() as cleanup:
    run = train._setup(config, str(tmp_path / "w"), cleanup)  # pylint: disable=protected-access
    train_setup.read_input_and_schedule(config, run)
    assert (run.total_steps, run.log_steps, run.ckpt_steps, run.batch_size) == (
        12,
        1,
        4,
        16,
    )
    parts = train._make_model(config, run)  # pylint: disable=protected-access
    with jax.set_mesh(run.mesh):
      train._lay_out_state(config, run, parts)  # pylint: disable=protected-access
      # Reads the rest: no key left.
      settings = train_setup.read_settings(config, run, parts)
      state = train._init_state(run, parts, settings)  # pylint: disable=protected-access
      same = jax.tree.map(
          lambda x, a: (x.shape, x.dtype, x.sharding)
          == (a.shape, a.dtype, a.sharding),
          state,
          parts.state_abstract,
      )
      assert all(jax.tree.leaves(same))
      update = jax.jit(train._make_update(run, parts))  # pylint: disable=protected-access
      batch = {
          k: jnp.asarray(
              np.random.RandomState(0).uniform(-1, 1, (16,) + v.shape[1:]),
              v.dtype,
          )
          for k, v in parts.batch_spec.items()
      }
      (s1, m1), (s2, m2) = update(state, batch), update(state, batch)
    assert int(s1["step"]) == 1 and np.isfinite(float(m1["training_loss"]))
    # Random numbers: (seed, step).
    assert float(m1["training_loss"]) == float(m2["training_loss"])
    assert all(
        jax.tree.leaves(
            jax.tree.map(np.array_equal, s1["params"], s2["params"])
        )
    )


def test_restore_or_init_resumes_the_newest_checkpoint_and_compile_skips_a_finished_run(
    tfds_data_dir, tmp_path
):
  workdir = str(tmp_path / "w")
  # Saves step 4 (ckpt_steps=4).
  train.train(_tiny(tfds_data_dir, total_steps=4), workdir)
  raw = _tiny(tfds_data_dir, total_steps=4)
  config = config_loading.TrackedConfig(raw)
  # pylint: disable=protected-access
  with contextlib.ExitStack() as cleanup:
    run = train._setup(config, workdir, cleanup)
    train_setup.read_input_and_schedule(config, run)
    parts = train._make_model(config, run)
    with jax.set_mesh(run.mesh), nn.logical_axis_rules(run.rules):
      train._lay_out_state(config, run, parts)
      settings = train_setup.read_settings(config, run, parts)
      state, resume_step, _ = train._restore_or_init(
          raw, run, parts, settings, cleanup
      )
      compiled, _ = train._compile(
          run, parts, train._make_update(run, parts), resume_step
      )
  assert resume_step == 4 and int(state["step"]) == 4
  saved, _ = checkpoint.load_params(workdir)
  assert all(
      jax.tree.leaves(
          jax.tree.map(np.array_equal, jax.device_get(state["params"]), saved)
      )
  )
  assert compiled is None  # total_steps reached: nothing to compile.


def test_read_settings_parses_the_knobs_and_rejects_a_key_nothing_reads():
  run = types.SimpleNamespace(
      mesh=None, dur=dict(steps_per_epoch=10, batch_size=4, total_steps=20)
  )
  parts = types.SimpleNamespace(model=None, ema=None)
  config = config_loading.TrackedConfig(
      ml_collections.ConfigDict(
          dict(model_load=dict(dont_load=["head/.*"]), ckpt_async=False)
      )
  )
  s = train_setup.read_settings(config, run, parts)
  assert (s.evaluators, s.dont_load) == ({}, ("head/.*",))
  assert (s.ckpt_async, s.report, s.eval_at_start) == (False, False, False)
  config = config_loading.TrackedConfig(
      ml_collections.ConfigDict(dict(eval_at_sart=True))
  )
  with pytest.raises(config_loading.UnreadConfigKeyError, match="eval_at_sart"):
    train_setup.read_settings(config, run, parts)


_one_line_error = checks.one_line_error


def test_big_vision_and_timm_mixup_configs():
  # big_vision's vit_i1k config: was "unexpected keyword argument 'fold_in'".
  mix = train_setup.make_mixup(dict(p=0.2, fold_in=None))  # pylint: disable=protected-access
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
    _one_line_error(lambda cfg=cfg: train_setup.make_mixup(cfg), *words)  # pylint: disable=W0212


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
      lambda: train._make_model(checks.tracked_config(model_name="vitt"), None),
      "model_name='vitt'",
      "only 'vit'",
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
      lambda: train_setup.read_input_and_schedule(config, run=None),
      f"The config sets no config.{key}:",
      "configs/demo.py",
  )
