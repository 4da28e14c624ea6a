"""Optimizer and learning-rate schedules from the config (optax).

The update of a parameter p with gradient g at step t (counting from 0) is

    u = base_optimizer(clip(g))                         # adam / sgd-momentum / adafactor
    p <- p - lr * lr_mult(p) * s(t) * u - wd * wd_mult(p) * s(t) * p

where s(t) in [0, 1] is the schedule (warmup, then decay, optional cooldown).
As in big_vision, `wd` is *decoupled from lr*: it is multiplied by the
schedule but not by `lr`, so the paper's "Adam with weight decay 0.1" at lr
1e-3 (flax.optim semantics: p -= lr * wd * p) is `wd = 1e-4` here.

Config keys (big_vision names):
  optax_name: "scale_by_adam" | "adam" | "adamw" (all the same transform here:
      decay is always the decoupled one above), "sgd" / "momentum",
      "adafactor" (big_vision's ViT variant: factored second moment with a
      capped decay, optional block-RMS clipping and bf16 momentum); big_vision's
      "big_vision.scale_by_adafactor", "big_vision.momentum_hp" and "big_vision.sgd".
  optax: kwargs of that optimizer, e.g. dict(b1=0.9, b2=0.999, mu_dtype="bfloat16").
  lr, wd, grad_clip_norm (the global norm of the trainable params' gradients, as in
      big_vision; unset or 0: no clipping; may change between a run and its resume,
      the clip keeps no state),
  wd_mults: [(regex, mult)], first match wins, default [(".*/kernel$", 1.0)]
      (decay weight matrices, not biases / norms / embeddings of size 1).
  lr_mults: [(regex, mult)], first match wins, default all 1.
  layer_decay: layer-wise lr decay (BEiT, DeiT-III, timm's `layer_decay`), e.g. 0.75; unset
      or 1: none. With depth L, block i (0-based) gets lr_mult decay^(L - i), the patch
      embedding, conv stem, cls token and posemb decay^(L + 1), everything else (the final
      norm, the head, pre_logits, a MAP head) 1. With scan=True the stacked blocks get one
      multiplier per slice of the layers axis. It multiplies lr_mults and scales the lr
      only (wd is decoupled from lr, see above).
  schedule: dict(decay_type=..., warmup_steps=..., ...) for all params, or a
      list [(regex, dict | None)] for per-parameter schedules; None freezes
      the matching parameters (no optimizer state, params kept bit-identical).
Parameter names are "/"-joined paths, e.g. "Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel".
A regex must match the whole name, and every regex given must be the first match
of at least one parameter (else it is a typo, or shadowed by an earlier one): an error.
Why the schedules are not optax's: benchmarks/NOTES.md, section "Config, optimizer, sharding,
distributed".
"""

import dataclasses
import math
import re
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from big_vit_lite.config import config_loading


def _dtype(value):
  """A config's dtype ("bfloat16", jnp.bfloat16 or None) -> a jnp dtype or None."""
  return None if value is None else jnp.dtype(value)


def param_names(tree):
  """Tree of '/'-joined path strings, same structure as `tree`."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: jax.tree_util.keystr(path, simple=True, separator="/"),
      tree,
  )


def tree_by_regex(tree, rules, default, what, check_used=True):
  """Maps each leaf name to the value of the first (regex, value) whose regex matches fully.

  check_used: a ValueError when a regex is the first match of no leaf (a typo, a
  leading '/', a regex matching only part of the names: else silently ignored).
  """
  try:
    compiled = [(re.compile(r), v) for r, v in rules]
  except re.error as e:
    raise ValueError(
        f"{what}: '{e.pattern}' is not a valid regex ({e})."
    ) from None
  used = set()

  def lookup(name):
    for i, (r, v) in enumerate(compiled):
      if r.fullmatch(name):
        used.add(i)
        return v
    if default is _REQUIRED:
      raise ValueError(
          f"Parameter '{name}' matches no regex of {what}: add a catch-all "
          "('.*', ...)."
      )
    return default

  names = param_names(tree)
  out = jax.tree.map(lookup, names)
  unused = [r.pattern for i, (r, _) in enumerate(compiled) if i not in used]
  if check_used and unused:
    raise ValueError(
        f"{what}: the regex '{unused[0]}' is the first match of no parameter (names "
        f"look like '{jax.tree.leaves(names)[0]}'; a regex matches whole names and "
        "the first match wins): fix, move or remove it."
    )
  return out


_REQUIRED = object()
FROZEN = -1  # Schedule group index of frozen parameters.


# --------------------------------------------------------------------------
# Schedules.

DECAY_TYPES = ("cosine", "linear", "polynomial", "rsqrt", "stair", "constant")


def make_schedule(sched, *, total_steps, steps_per_epoch=None, batch_size=None):
  """A schedule dict -> fn(step) -> multiplier in [0, 1] (jnp-traceable).

  sched keys: decay_type ("cosine" (the default) | "linear" | "polynomial" | "rsqrt" |
  "stair" | "constant"), warmup_{steps|epochs|examples|percent}, cooldown_{...} (linear to 0 at
  the end), min_lr / linear_end / end (multiplier at the end for cosine / linear /
  polynomial), power (polynomial: end + (1 - end) * (1 - progress) ** power; 1 is linear),
  timescale, shift (rsqrt: s = 1/sqrt(1 + (t - warmup + shift) / timescale)),
  steps + mults (stair: the multiplier becomes mults[i] once step >= steps[i]; steps are
  absolute training steps, increasing), mult (big_vision's: the whole schedule times
  mult, e.g. a smaller lr for one group of a list schedule).
  """
  dur = dict(
      steps_per_epoch=steps_per_epoch,
      batch_size=batch_size,
      total_steps=total_steps,
  )
  warmup = config_loading.get_steps("warmup", sched, default=0, **dur)
  cooldown = config_loading.get_steps("cooldown", sched, default=0, **dur)
  decay_type = sched.get("decay_type", None)
  # A big_vision config ported as it is would decay unexpectedly.
  if decay_type is None:
    logging.warning(
        "The schedule sets no decay_type: cosine decay (big_vision's default is a "
        "constant: decay_type='constant')."
    )
    decay_type = "cosine"
  # The multiplier at the end: big_vision's `end`, or `linear_end`, or `min_lr`.
  end = float(
      sched.get("end", sched.get("linear_end", sched.get("min_lr", 0.0)))
  )
  timescale, shift, power, group_mult = (
      float(sched.get(k, v))
      for k, v in (
          ("timescale", 10_000),
          ("shift", 0),
          ("power", 1.0),
          ("mult", 1.0),
      )
  )
  stair_steps, stair_mults = (
      list(sched.get(k, None) or ()) for k in ("steps", "mults")
  )
  for key, steps in (("warmup", warmup), ("cooldown", cooldown)):
    if steps < 0:
      raise ValueError(
          f"The schedule's {key} is {steps} steps: it must be >= 0."
      )
  if warmup + cooldown > total_steps:
    # Quick runs (--config.total_steps=N) shorten a config: scale the phases
    # down rather than refuse, but say so.
    scale = total_steps / (warmup + cooldown)
    logging.warning(
        "warmup (%d) + cooldown (%d) steps exceed total_steps (%d): scaling them "
        "by %.3f.",
        warmup,
        cooldown,
        total_steps,
        scale,
    )
    warmup, cooldown = int(warmup * scale), int(cooldown * scale)
  if decay_type not in DECAY_TYPES:
    raise ValueError(
        f"Unknown schedule decay_type '{decay_type}': use {', '.join(DECAY_TYPES)}."
    )
  if decay_type == "stair" and (
      not stair_steps
      or len(stair_steps) != len(stair_mults)
      or sorted(stair_steps) != stair_steps
  ):
    raise ValueError(
        f"decay_type='stair' needs steps (increasing) and as many mults, got "
        f"steps={stair_steps} mults={stair_mults}: e.g. "
        f"steps=[30_000, 60_000], mults=[0.1, 0.01]"
    )

  def fn(step):
    step = jnp.asarray(step, jnp.float32)
    progress = jnp.clip(
        (step - warmup) / max(1, total_steps - warmup), 0.0, 1.0
    )
    if decay_type == "cosine":
      mult = end + (1.0 - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    elif decay_type == "linear":
      mult = 1.0 - (1.0 - end) * progress
    elif decay_type == "polynomial":
      mult = end + (1.0 - end) * (1.0 - progress) ** power
    elif decay_type == "rsqrt":
      mult = jax.lax.rsqrt(
          1.0 + (jnp.maximum(step - warmup, 0.0) + shift) / timescale
      )
    elif decay_type == "stair":
      # How many boundaries the step has reached picks the multiplier (1 before
      # the first).
      reached = jnp.sum(step >= jnp.asarray(stair_steps, jnp.float32))
      mult = jnp.asarray([1.0] + stair_mults, jnp.float32)[reached]
    else:
      mult = jnp.ones_like(step)
    if warmup:
      mult = mult * jnp.minimum(1.0, step / warmup)
    if cooldown:
      mult = mult * jnp.clip((total_steps - step) / cooldown, 0.0, 1.0)
    return mult * group_mult if group_mult != 1.0 else mult

  return fn


# --------------------------------------------------------------------------
# Base optimizers (the direction u, before lr, schedule and decay).

OPTAX_NAMES = (
    "scale_by_adam",
    "adam",
    "adamw",
    "sgd",
    "momentum",
    "adafactor",
    "big_vision.scale_by_adafactor",
    "big_vision.momentum_hp",
    "big_vision.sgd",
)


def _base_optimizer(name, kw):
  kw = dict(kw)
  if name in ("scale_by_adam", "adam", "adamw"):
    kw["mu_dtype"] = _dtype(kw.get("mu_dtype"))
    return optax.scale_by_adam(**kw)
  if name in ("sgd", "momentum", "big_vision.momentum_hp"):
    if name != "sgd":
      kw.setdefault("momentum", 0.9)
    # big_vision's name and default for the dtype.
    if name == "big_vision.momentum_hp":
      kw.setdefault("accumulator_dtype", kw.pop("dtype", "bfloat16"))
    return _momentum(**kw)
  if name == "big_vision.sgd":
    return optax.identity(**kw)
  if name in ("adafactor", "big_vision.scale_by_adafactor"):
    return scale_by_adafactor(**kw)
  raise ValueError(
      f"Unknown optax_name '{name}': use one of {', '.join(OPTAX_NAMES)}."
  )


def _momentum(momentum=None, nesterov=False, accumulator_dtype=None):
  """SGD's direction: the gradient (no momentum), or optax.trace of it."""
  if not momentum:
    return optax.identity()
  return optax.trace(
      decay=momentum,
      nesterov=nesterov,
      accumulator_dtype=_dtype(accumulator_dtype),
  )


def scale_by_adafactor(
    min_dim_size_to_factor=32,
    decay_rate=0.8,
    decay_offset=0,
    beta2_cap=0.999,
    clipping_threshold=None,
    momentum=0.9,
    dtype_momentum="bfloat16",
    eps=1e-30,
):
  """Adafactor as used for ViT in "Scaling Vision Transformers" (big_vision).

  Factored second moment (row/column statistics for matrices with both dims
  >= min_dim_size_to_factor) with decay 1 - (t+1)^-decay_rate capped at
  beta2_cap, optional clipping of each update's RMS, and first-moment
  momentum kept in bf16. No relative step size and no parameter scaling.
  """

  def decay_rate_fn(step, exponent):
    t = jnp.asarray(step, jnp.float32) + 1.0
    return jnp.minimum(beta2_cap, 1.0 - t ** (-exponent))

  parts = [
      optax.scale_by_factored_rms(
          decay_rate=decay_rate,
          step_offset=decay_offset,
          min_dim_size_to_factor=min_dim_size_to_factor,
          epsilon=eps,
          decay_rate_fn=decay_rate_fn,
      )
  ]
  if clipping_threshold is not None:
    parts.append(optax.clip_by_block_rms(clipping_threshold))
  if momentum is not None:
    parts.append(
        optax.ema(
            momentum, debias=False, accumulator_dtype=_dtype(dtype_momentum)
        )
    )
  return optax.chain(*parts)


# --------------------------------------------------------------------------
# lr, schedule, decoupled weight decay and multipliers in one transform.


def _scale_by_lr_and_decay(
    lr, sched_fns, group_tree, lr_mult_tree, wd, wd_mult_tree
):
  """u -> -(lr * lr_mult * s_g(t)) * u - wd * wd_mult * s_g(t) * p, group g per param."""

  def update_fn(updates, state, params):
    s = [f(state.count) for f in sched_fns]

    def one(u, p, g, lm, wm):
      # Frozen: the caller keeps the old value; no update needed.
      if g == FROZEN:
        return jnp.zeros_like(u)
      out = -(lr * lm) * s[g] * u
      if wd and wm:
        out = out - (wd * wm) * s[g] * p.astype(out.dtype)
      return out.astype(u.dtype)

    updates = jax.tree.map(
        one, updates, params, group_tree, lr_mult_tree, wd_mult_tree
    )
    return updates, optax.ScaleByScheduleState(
        count=optax.safe_int32_increment(state.count)
    )

  init_fn = lambda _: optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))  # noqa: E731
  return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(eq=False)
class Optimizer:
  """What `make` returns: the optax transform plus what the trainer needs around it."""

  tx: optax.GradientTransformation
  # step -> learning rate of the first schedule group (for logging).
  lr_fn: Callable
  frozen_mask: Any  # Tree of bools: True = keep bit-identical.
  clipped: bool = False  # Whether the chain starts with the gradient clip.

  def apply(self, params, grads, opt_state):
    updates, opt_state = self.tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    # Frozen params: the old arrays themselves (p + 0 would turn -0.0 into
    # +0.0).
    new = jax.tree.map(
        lambda frozen, old, n: old if frozen else n,
        self.frozen_mask,
        params,
        new,
    )
    return new, opt_state


def clip_relayout(opt_state, clipped, to_clipped):
  """`opt_state` (arrays or shapes) of a chain with(out) the gradient clip, for one without (with).

  grad_clip_norm may change between a run and its resume: the clip keeps no
  state (optax.EmptyState), so the arrays stay the same; only the positions of
  the chain's other transforms move by one.
  """
  if clipped == to_clipped:
    return opt_state
  if to_clipped:
    return (optax.EmptyState(),) + tuple(opt_state)
  if not isinstance(opt_state[0], optax.EmptyState):
    raise ValueError(
        f"The optimizer state does not start with the clip's: {opt_state[0]!r}"
    )
  return tuple(opt_state)[1:]


def _clip_by_global_norm(max_norm, trainable):
  """optax.clip_by_global_norm of the trainable params' gradients (as big_vision's).

  The gradients of frozen params (which the update ignores) must not count in
  the norm: fine-tuning a head on a frozen body would clip the head's steps by
  the body's gradients. Keeps no state (optax.EmptyState) either way.
  """
  clip = optax.clip_by_global_norm(max_norm)
  if all(jax.tree.leaves(trainable)):
    return clip

  def update_fn(updates, state, params=None):
    updates = jax.tree.map(
        lambda t, u: u if t else jnp.zeros_like(u), trainable, updates
    )
    return clip.update(updates, state, params)

  return optax.GradientTransformation(clip.init, update_fn)


def make(config, params, *, total_steps, steps_per_epoch=None, batch_size=None):
  """Builds the Optimizer from the (tracked) config for a params tree (arrays or shapes)."""
  name = config.get("optax_name", "scale_by_adam")
  optax_kw = (
      config.optax.to_dict()
      if "optax" in config and config.optax is not None
      else {}
  )
  lr, wd = float(config.get("lr", 1e-3)), float(config.get("wd", 0.0) or 0.0)
  clip = config.get("grad_clip_norm", None)
  for key, value in (("lr", lr), ("wd", wd), ("grad_clip_norm", clip or 0.0)):
    # (a negative lr ascends, a NaN wd is a NaN loss)
    if not 0 <= float(value) < math.inf:
      raise ValueError(f"config.{key}={value} must be a finite number >= 0.")
  wd_mults = config.get("wd_mults", None)
  # (The default is checked on no model.)
  check_wd_mults = wd_mults is not None and wd > 0
  wd_mults = [(".*/kernel$", 1.0)] if wd_mults is None else wd_mults
  lr_mults = config.get("lr_mults", None) or []
  # (a negative one trains its params by gradient ascent)
  _check_mults("lr_mults", lr_mults)
  _check_mults("wd_mults", wd_mults)

  sched_cfg = config.schedule if "schedule" in config else None
  groups = (
      sched_cfg
      if isinstance(sched_cfg, (list, tuple))
      else [
          (".*", {"decay_type": "constant"} if sched_cfg is None else sched_cfg)
      ]
  )
  dur = dict(
      total_steps=total_steps,
      steps_per_epoch=steps_per_epoch,
      batch_size=batch_size,
  )
  sched_fns, group_of = [], []
  for regex, s in groups:
    group_of.append((regex, FROZEN if s is None else len(sched_fns)))
    if s is not None:
      # The trainer checks the keys of config.schedule; those of a dict in a
      # list, this.
      tracked = hasattr(s, "consume")
      reader = (
          s
          if tracked
          else config_loading.TrackedConfig(ml_collections.ConfigDict(s))
      )
      sched_fns.append(make_schedule(reader, **dur))
      unread = [] if tracked else reader.unread_keys()
      if unread:
        raise ValueError(
            f"Config key '{unread[0]}' in the schedule for '{regex}' is not a "
            f"schedule key{reader.hint(unread[0])}: remove it or fix its spelling."
        )
  if not sched_fns:
    raise ValueError(
        "Every schedule group is frozen (None): nothing would train."
    )
  group_tree = tree_by_regex(params, group_of, _REQUIRED, "config.schedule")
  frozen_mask = jax.tree.map(lambda g: g == FROZEN, group_tree)
  lr_mult_tree = tree_by_regex(params, lr_mults, 1.0, "config.lr_mults")
  decay = config.get("layer_decay", None)
  if decay is not None and not 0 <= float(decay) < math.inf:
    raise ValueError(
        f"config.layer_decay={decay} must be >= 0 (e.g. 0.75; 1 or unset: no "
        "decay): a negative one flips the sign of every other layer's updates."
    )
  if decay is not None and float(decay) != 1.0:
    lr_mult_tree = jax.tree.map(
        lambda a, b: a * b,
        lr_mult_tree,
        layer_decay_mults(params, float(decay)),
    )
  wd_mult_tree = tree_by_regex(
      params, wd_mults, 0.0, "config.wd_mults", check_wd_mults
  )
  trainable = jax.tree.map(lambda f: not f, frozen_mask)

  parts = [_clip_by_global_norm(float(clip), trainable)] if clip else []
  # masked: frozen params get no optimizer state (e.g. fine-tuning only a head).
  parts += [
      optax.masked(_base_optimizer(name, optax_kw), trainable),
      _scale_by_lr_and_decay(
          lr, sched_fns, group_tree, lr_mult_tree, wd, wd_mult_tree
      ),
  ]
  return Optimizer(
      optax.chain(*parts),
      lambda step: lr * sched_fns[0](step),
      frozen_mask,
      clipped=bool(clip),
  )


def _check_mults(key, rules):
  """config.lr_mults / wd_mults: (regex, multiplier) pairs with finite multipliers >= 0."""
  for rule in rules:
    if len(rule) != 2 or not 0 <= float(rule[1]) < math.inf:
      raise ValueError(
          f"config.{key}: {tuple(rule)} must be a (regex, multiplier) pair with a "
          "finite multiplier >= 0 (0 switches it off for those params)."
      )


_BLOCK = re.compile(r"Transformer/encoderblock(?:_(\d+))?/.*")
_EMBED = re.compile(
    r"(embedding|stem|cls|Transformer/posembed_input|pos_embedding)(/.*)?"
)


def layer_decay_mults(params, decay):
  """Tree of lr multipliers for layer-wise decay (see `layer_decay` above).

  Floats, except for scan-stacked blocks: an array (L, 1, ...) that broadcasts
  over each leaf's stacked axis.
  """
  names, leaves = jax.tree.leaves(param_names(params)), jax.tree.leaves(params)
  blocks = [
      int(m.group(1)) for m in map(_BLOCK.fullmatch, names) if m and m.group(1)
  ]
  stacked = [
      x.shape[0]
      for n, x in zip(names, leaves)
      if n.startswith("Transformer/encoderblock/")
  ]
  if blocks:
    depth = max(blocks) + 1
  elif stacked:
    depth = stacked[0]
  else:
    depth = 0
  if not depth:
    raise ValueError(
        "config.layer_decay needs a ViT with Transformer/encoderblock params."
    )

  def mult(name, x):
    m = _BLOCK.fullmatch(name)
    if m and m.group(1):
      return decay ** (depth - int(m.group(1)))
    if m:  # scan: one multiplier per block along the leading axis.
      per_block = decay ** (depth - np.arange(depth, dtype=np.float32))
      return per_block.reshape((depth,) + (1,) * (len(x.shape) - 1))
    return decay ** (depth + 1) if _EMBED.fullmatch(name) else 1.0

  return jax.tree.map(mult, param_names(params), params)
