"""The trainer's optimizer, schedule, config and resume, as a big_vision user meets them.

One real (in-process, tiny) run resumed with grad_clip_norm switched off, then
restored with it on again; everything else fails before any compile, or
needs no model.
"""
import logging
import os
import re
import subprocess
import sys
import warnings

from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from big_vit_lite import config_loading
from big_vit_lite import metrics
from big_vit_lite import optim
from big_vit_lite import train
from big_vit_lite import train_setup
from big_vit_lite.models import vit

import checks
import train_config_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(data_dir, arg=None, **overrides):
  config = train_config_tiny.get_config(arg)
  config.input.data.data_dir = data_dir
  config.device_aug, config.model.dropout = None, 0.0  # (A smaller step compiles faster.)
  return checks.set_dotted(config, overrides)


def _saved_opt_state(workdir, step):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # orbax: "Sharding info not provided".
    return ocp.PyTreeCheckpointer().restore(
        os.path.join(workdir, "checkpoints", str(step), "state"))["opt_state"]


# ----------------------------------------------------------------- resume

@pytest.mark.timeout(300)
def test_grad_clip_norm_switched_off_and_on_between_resumes(tfds_data_dir, tmp_path, caplog,
                                                            monkeypatch):
  caplog.set_level(logging.INFO, logger="absl")
  monkeypatch.setenv("TFDS_DATA_DIR", tfds_data_dir)  # The eval data has no data_dir of its own.
  workdir = str(tmp_path / "run")
  # Clipped at 1.0, no evals: the files a run killed during its eval at step 2 leaves.
  train.train(_config(tfds_data_dir, total_steps=2, ckpt_steps=0), workdir)
  # Off, with a model_init that would fail if it were read: a resume does not read it.
  caplog.clear()
  missing = str(tmp_path / "no_such_run")
  train.train(_config(tfds_data_dir, "evals", total_steps=4, ckpt_steps=0, grad_clip_norm=0.0,
                      model_init=missing, **{"evals.val.log_steps": 2}), workdir)
  resumed = [r.getMessage() for r in caplog.records if "Resuming from" in r.getMessage()]
  assert resumed == [f"Resuming from {workdir}/checkpoints/2; config.model_init={missing} is not "
                     "read again (it only initialises a fresh run)"], resumed
  assert any("saved with gradient clipping; this run does not clip" in r.getMessage()
             for r in caplog.records)
  # The eval due at the resumed step, which the stopped run did not log, ran first.
  assert [r["step"] for r in metrics.read_metrics(workdir) if "val/prec@1" in r] == [2, 4]
  # core_hours counts the first attempt's too (it started from 0 again).
  rows = {r["step"]: r for r in metrics.read_metrics(workdir) if "core_hours" in r}
  assert rows[3]["core_hours"] - rows[2]["core_hours"] == pytest.approx(
      rows[3]["step_time"] * os.cpu_count() / 3600, rel=1e-6)
  opt_state = _saved_opt_state(workdir, 4)
  assert len(opt_state) == 2  # (adam, schedule): written without the clip's place.
  assert int(opt_state[0]["inner_state"]["count"]) == 4  # Adam's moments carried over.
  # On again: restores (a finished run's rerun, so no compile) and ends at step 4.
  caplog.clear()
  params = train.train(_config(tfds_data_dir, "evals", total_steps=4, ckpt_steps=0), workdir)
  assert any("saved without gradient clipping; this run clips" in r.getMessage()
             for r in caplog.records)
  assert jax.tree.structure(params) == jax.tree.structure(_tiny_params())
  # After the resumes, metrics.jsonl has each step once, in order (the evals at 4 ran once).
  steps = [r["step"] for r in metrics.read_metrics(workdir) if "training_loss" in r]
  assert steps == [1, 2, 3, 4]
  assert [r["step"] for r in metrics.read_metrics(workdir) if "val/prec@1" in r] == [2, 4]


# ------------------------------------------------ config errors before a compile

def _stop_after_validation(monkeypatch):
  """train.train raises 'validated' once the config passed every check (before the compile)."""
  check = config_loading.TrackedConfig.check_all_read

  def check_then_stop(self):
    check(self)
    raise RuntimeError("validated")
  monkeypatch.setattr(config_loading.TrackedConfig, "check_all_read", check_then_stop)


@pytest.mark.parametrize("overrides,match", [
    (dict(total_steps=None, total_epochs=0.0),
     r"^config.total_epochs=0.0 gives 0 steps: it must give at least 1.$"),
    (dict(total_steps=None, total_epochs=-1.0), r"^config.total_epochs=-1.0 gives -3750 steps"),
    (dict(total_steps=None, total_epochs=1.0, **{"schedule.warmup_steps": -10}),
     r"^The schedule's warmup is -10 steps: it must be >= 0"),
])
def test_durations_are_checked_in_the_unit_given(tfds_data_dir, tmp_path, monkeypatch,
                                                 overrides, match):
  _stop_after_validation(monkeypatch)
  with pytest.raises(ValueError, match=match):
    train.train(_config(tfds_data_dir, **overrides), str(tmp_path / "w"))


@pytest.mark.parametrize("ckpt_steps,says", [
    (1000, "config.keep_ckpt_steps=1500 is not a multiple of config.ckpt_steps=1000: only the "
           "steps divisible by 3000 are kept (besides the last 3); make it a multiple of ckpt_steps."),
    (500, None),
])
def test_keep_ckpt_steps_that_saves_never_hit_is_said(tfds_data_dir, tmp_path, monkeypatch, caplog,
                                                      ckpt_steps, says):
  caplog.set_level(logging.INFO, logger="absl")
  _stop_after_validation(monkeypatch)
  config = _config(tfds_data_dir, total_steps=6000, ckpt_steps=ckpt_steps)
  config.keep_ckpt_steps = 1500  # Kept every 1500th step? Only saved steps can be.
  with pytest.raises(RuntimeError, match="validated"):
    train.train(config, str(tmp_path / "w"))
  warned = [r.getMessage() for r in caplog.records if "config.keep_ckpt_steps=" in r.getMessage()]
  assert (warned == []) if says is None else (len(warned) == 1 and says in warned[0]), warned


def test_profile_steps_not_a_pair_is_one_line_before_the_compile(tfds_data_dir, tmp_path):
  config = _config(tfds_data_dir)
  config.profile_steps = 5  # Raised "'int' object is not subscriptable" after the compile.
  with pytest.raises(ValueError, match=r"^config.profile_steps=5 must be \(first step, number of "
                                       r"steps\), e.g. \(10, 5\).$"):
    train.train(config, str(tmp_path / "w"))


def test_negative_eval_interval_is_one_line(tfds_data_dir, tmp_path, monkeypatch):
  _stop_after_validation(monkeypatch)
  config = train_config_tiny.get_config("evals")
  config.input.data.data_dir = tfds_data_dir
  config.evals.val.log_steps = -3  # Ran the eval at every 3rd step, silently.
  with pytest.raises(ValueError, match=r"^config.evals.val.log_steps must be >= 0 \(0 or unset: "
                                       r"only at the end\), got -3.$"):
    train.train(config, str(tmp_path / "w"))


# ----------------------------------------------------------- the optimizer

def _cfg(**kw):
  return config_loading.TrackedConfig(ml_collections.ConfigDict(kw))


def _tiny_params():
  model = vit.Model(**train_config_tiny.get_config().model)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1)))["params"]
  return jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype), nn.meta.unbox(shapes))


def _flat(tree):
  return dict(zip(jax.tree.leaves(optim.param_names(tree)), jax.tree.leaves(tree)))


@pytest.mark.parametrize("key,value,match", [
    # Regexes that apply to no parameter were ignored without a word.
    ("schedule", [(".*", dict(decay_type="cosine")), ("head/.*", None)],
     r"config.schedule: the regex 'head/.\*' applies to no parameter: an earlier regex matches "
     r"them first \(e.g. 'head/bias', by '.\*'; the first match wins\)"),
    ("schedule", [("/head/.*", None), (".*", dict())],
     r"the regex '/head/.\*' matches no parameter \(the names look like '.*', without a leading"),
    ("wd_mults", [(".*/kernel", 1.0), ("pos_embedding", 0.1)],
     r"config.wd_mults: the regex 'pos_embedding' matches no whole parameter name, only part of "
     r"e.g. 'Transformer/posembed_input/pos_embedding'"),
    ("lr_mults", [("head/(", 2.0)], r"config.lr_mults: 'head/\(' is not a valid regex"),
    ("schedule", [dict(decay_type="cosine")], r"config.schedule must be a list of \(regex, value\)"),
    ("schedule", [(".*", dict(warmup_step=3))],  # (As a dict schedule's typo is told.)
     r"'warmup_step' in the schedule for '.\*' is not a schedule key \(did you mean 'warmup_steps'"),
    # Negative multipliers ascended the loss / grew the weights.
    ("lr_mults", [("head/.*", -1.0)], r"multiplier of 'head/.\*' is -1.0; it must be a number >= 0 "
                                      r"\(to freeze parameters use config.schedule with None\)"),
    ("wd_mults", [(".*", -0.5)], r"config.wd_mults: the multiplier of '.\*' is -0.5"),
    # Schedules whose lr went negative, infinite or NaN.
    ("schedule", dict(warmup_steps=-5), r"The schedule's warmup is -5 steps: it must be >= 0"),
    ("schedule", dict(cooldown_steps=-5), r"The schedule's cooldown is -5 steps: it must be >= 0"),
    ("schedule", dict(decay_type="polynomial", power=-1.0), r"The schedule's power is -1.0"),
    ("schedule", dict(decay_type="rsqrt", timescale=0), r"The schedule's timescale is 0.0"),
    ("schedule", dict(decay_type="stair", steps=[3], mults=[-1.0]), r"The schedule's mults is"),
    ("schedule", dict(decay_type="linear", linear_end=-0.1), r"linear_end \(min_lr, end\) is -0.1"),
    # Unknown optax keys and dtypes: a TypeError / KeyError with a traceback.
    ("optax", dict(beta2=0.95), r"config.optax.beta2 is not an option of optax_name="
                                r"'scale_by_adam': its options are b1, b2, eps, eps_root, mu_dtype"),
    ("optax", dict(weight_decay=0.1), r"weight_decay is .* \(set config.wd instead\)"),
    ("optax", dict(mu_dtype="bfloat61"), r"config.optax.mu_dtype='bfloat61' is not a float dtype"),
    ("optax", dict(mu_dtype="int8"), r"config.optax.mu_dtype='int8' is not a float dtype"),
])
def test_ignored_or_harmful_optimizer_settings_are_one_line_errors(key, value, match):
  with pytest.raises(ValueError, match=match) as e:
    optim.make(_cfg(lr=1e-3, wd=1e-4, **{key: value}), _tiny_params(), total_steps=10)
  assert "\n" not in str(e.value)


def test_infinite_lr_or_wd_is_one_line():
  for key in ("lr", "wd"):  # The first step made every param inf or NaN.
    with pytest.raises(ValueError, match=f"^config.{key}=inf must be finite.$"):
      optim.make(_cfg(**{key: float("inf")}), _tiny_params(), total_steps=10)
  optim.make(_cfg(grad_clip_norm=float("inf")), _tiny_params(), total_steps=10)  # No clipping.


def test_big_vision_optimizer_and_schedule_keys():
  params = _tiny_params()
  # big_vision's schedule keys: `end` (= linear_end), `shift` (rsqrt), `mult` (per group).
  lin = optim.make_schedule(_cfg(decay_type="linear", end=0.1), total_steps=100)
  np.testing.assert_allclose(lin(100), 0.1, atol=1e-6)
  rs = optim.make_schedule(_cfg(decay_type="rsqrt", timescale=100, shift=300), total_steps=10**6)
  np.testing.assert_allclose([rs(0), rs(100)], [0.5, 1 / np.sqrt(5)], rtol=1e-6)
  opt = optim.make(_cfg(lr=1.0, schedule=[("head/.*", dict(decay_type="constant", mult=0.1)),
                                          (".*", dict(decay_type="constant"))]),
                   params, total_steps=10)
  np.testing.assert_allclose(opt.lr_fn(3), 0.1, rtol=1e-6)  # The first group's.
  # big_vision's optimizer names and dtype spellings.
  for name, kw in (("big_vision.momentum_hp", {}), ("big_vision.sgd", {}),
                   ("big_vision.scale_by_adafactor", dict(dtype_momentum=jnp.bfloat16)),
                   ("scale_by_adam", dict(mu_dtype="bf16")),
                   ("scale_by_adam", dict(mu_dtype=jnp.bfloat16))):
    opt = optim.make(_cfg(lr=1e-3, optax_name=name, optax=kw), params, total_steps=10)
    leaves = jax.tree.leaves(opt.tx.init(params))
    if name == "big_vision.sgd":
      assert len(leaves) == 1  # The schedule's step count: no optimizer state.
    else:  # Momentum in bf16 (big_vision's default for momentum_hp and adafactor).
      assert jnp.dtype(jnp.bfloat16) in {x.dtype for x in leaves}, name


def test_schedule_without_decay_type_says_it_decays(caplog):
  """big_vision's default decay_type is a constant; here cosine: a ported config must hear it."""
  caplog.set_level(logging.WARNING, logger="absl")
  f = optim.make_schedule(_cfg(warmup_steps=2), total_steps=10)
  np.testing.assert_allclose([f(2), f(10)], [1.0, 0.0], atol=1e-6)
  assert any("sets no decay_type: cosine decay (big_vision's default is a constant" in
             r.getMessage() for r in caplog.records)


def test_weight_decay_reaches_weight_matrices_only_by_default():
  """The README's `wd_mults` default: kernels decay; biases, LayerNorm, cls, posemb do not."""
  params = _tiny_params()
  opt = optim.make(_cfg(lr=0.0, wd=0.1, optax_name="sgd"), params, total_steps=10)
  new, _ = jax.jit(opt.apply)(params, jax.tree.map(jnp.zeros_like, params), opt.tx.init(params))
  decayed = sorted(k for k, v in _flat(new).items() if not np.array_equal(v, _flat(params)[k]))
  assert decayed == sorted(k for k in _flat(params) if k.endswith("/kernel")), decayed
  assert "head/bias" not in decayed and "Transformer/encoder_norm/scale" not in decayed


def test_gradient_clip_ignores_the_gradients_of_frozen_params():
  """A head fine-tuned on a frozen body: the body's gradients clipped the head's steps away."""
  params = {"head": {"kernel": jnp.ones((3, 2))}, "body": {"kernel": jnp.ones((4, 3))}}
  grads = {"head": {"kernel": jnp.full((3, 2), 0.01)}, "body": {"kernel": jnp.full((4, 3), 100.0)}}
  heads = []
  for clip in (1.0, 0.0):
    opt = optim.make(_cfg(lr=1.0, optax_name="sgd", grad_clip_norm=clip,
                          schedule=[("body/.*", None), (".*", dict(decay_type="constant"))]),
                     params, total_steps=10)
    state = opt.tx.init(params)
    assert isinstance(state[0], optax.EmptyState) == bool(clip)  # The layout resumes rely on.
    new, _ = opt.apply(params, grads, state)
    heads.append(np.asarray(new["head"]["kernel"]))
    np.testing.assert_array_equal(new["body"]["kernel"], params["body"]["kernel"])
  np.testing.assert_array_equal(heads[0], heads[1])  # |head grad| < 1: the clip does nothing.
  np.testing.assert_allclose(heads[0], 0.99, rtol=1e-6)


def test_clip_relayout_round_trips_the_optimizer_state():
  params = _tiny_params()
  clipped = optim.make(_cfg(grad_clip_norm=1.0), params, total_steps=10)
  plain = optim.make(_cfg(), params, total_steps=10)
  state = clipped.tx.init(params)
  as_plain = optim.clip_relayout(state, True, False)
  assert jax.tree.structure(as_plain) == jax.tree.structure(plain.tx.init(params))
  back = optim.clip_relayout(as_plain, False, True)
  assert jax.tree.structure(back) == jax.tree.structure(state)


# ----------------------------------------------------------------- configs

def _parse(path, *overrides, monkeypatch):
  argv = ["prog", f"--config={path}", *overrides]
  monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv.
  fv = flags.FlagValues()
  config_loading.define_config_flag(flag_values=fv)
  config_loading.parse_flags(argv, prog="prog", flag_values=fv)
  return config_loading.TrackedConfig(fv.config)


@pytest.mark.parametrize("name", ["vit_l16", "vit_b16", "vit_s16_i1k"])
def test_vit_configs_validate_with_total_steps_1(name, monkeypatch):
  """`--config=configs/NAME.py --config.total_steps=1`: parses, and its optimizer builds on the
  full-size model (shapes only) with a finite learning rate."""
  config = _parse(os.path.join(ROOT, "configs", f"{name}.py"), "--config.total_steps=1",
                  monkeypatch=monkeypatch)
  assert config_loading.get_steps("total", config, steps_per_epoch=1000.0) == 1
  model = vit.Model(**config.consume("model").to_dict())
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 224, 224, 3)))["params"]
  opt = optim.make(config, nn.meta.unbox(params), total_steps=1)
  assert np.isfinite(float(opt.lr_fn(0))) and float(opt.lr_fn(0)) >= 0


def test_demo_takes_an_epoch_count_from_the_command_line(monkeypatch):
  """The demo set total_steps, which won over --config.total_epochs=E: E was ignored."""
  demo = os.path.join(ROOT, "configs", "demo.py")
  per_epoch = 60_000 / 64
  assert config_loading.get_steps("total", _parse(demo, monkeypatch=monkeypatch),
                                  steps_per_epoch=per_epoch) == 30_000  # Its 32 epochs.
  config = _parse(demo, "--config.total_epochs=2", monkeypatch=monkeypatch)
  assert config_loading.get_steps("total", config, steps_per_epoch=per_epoch) == 1875
  config = _parse(demo, "--config.total_epochs=2", "--config.total_steps=7", monkeypatch=monkeypatch)
  assert config_loading.get_steps("total", config, steps_per_epoch=per_epoch) == 7


@pytest.mark.parametrize("key,hint", [
    ("checkpoint_steps", "(this framework calls it 'ckpt_steps')"),
    ("pp_train", "(this framework calls it 'input.pp')"),
    ("prefetch_to_device", "(this framework calls it 'input.prefetch')"),
    ("pp_modules", "(not needed here: every preprocessing op is always registered)"),
    ("batch_size_eval", "(this framework calls it 'evals.NAME.batch_size')"),
    ("sharding_strategy", "(not needed here: a mesh with an 'fsdp' axis"),
])
def test_big_vision_top_level_keys_get_our_names(key, hint):
  config = _cfg(**{key: 1})
  with pytest.raises(config_loading.UnreadConfigKeyError, match=re.escape(hint)):
    config.check_all_read()


def test_an_eval_entry_that_is_not_a_dict_is_one_line():
  config = _cfg(evals=ml_collections.ConfigDict({"fewshot": "x"}))
  with pytest.raises(ValueError, match=r"config.evals.fewshot must be a dict .* got 'x'"):
    train_setup.make_evaluators(config, model=None, mesh=None)


def test_an_eval_entry_named_after_its_type_needs_no_type(monkeypatch):
  built = []

  def fake_cls(type_name):
    return lambda predict_fn, mesh, **kw: built.append((type_name, kw)) or type_name
  monkeypatch.setattr(train_setup.evaluators_lib, "get_evaluator_cls", fake_cls)
  config = _cfg(evals=ml_collections.ConfigDict({"classification": {"batch_size": 8},
                                                 "val": {"type": "fewshot"}}))
  out = train_setup.make_evaluators(config, model=None, mesh=None)
  assert built == [("classification", {"batch_size": 8}), ("fewshot", {})], built
  with pytest.raises(ValueError, match="config.evals.mine needs a `type`"):
    train_setup.make_evaluators(_cfg(evals=ml_collections.ConfigDict({"mine": {}})), None, None)
  assert set(out) == {"classification", "val"}


# ----------------------------------------------------------- launch scripts

@pytest.mark.parametrize("script", ["local.sh", "multi_gpu.sh", "tpu_vm.sh"])
def test_launch_scripts_help_is_their_documentation_and_exits_0(script):
  proc = subprocess.run(["bash", os.path.join(ROOT, "launch", script), "--help"],
                        capture_output=True, text=True, timeout=30, check=False)
  assert proc.returncode == 0 and not proc.stderr, proc.stderr
  assert "Environment" in proc.stdout or "--coordinator" in proc.stdout, proc.stdout[:200]


def test_multi_gpu_empty_num_hosts_is_named():
  proc = subprocess.run(["bash", os.path.join(ROOT, "launch", "multi_gpu.sh"), "--num_hosts=",
                         "--host_id=1", "--coordinator=h:1", "--gpus=1", "--", "true"],
                        capture_output=True, text=True, timeout=30, check=False)
  assert proc.returncode == 2
  assert "must be integers, got '' and '1'" in proc.stderr, proc.stderr
