"""Checkpoint to model: a ViT and its params from a workdir, step directory, .npz or .safetensors.

    loaded = loading.load_model(SRC, "params", config, mesh, rules)
    logits, out = loaded.predict_fn(loaded.params, images)

The library's loader: evaluate, predict, export, transfer and distillation read their
models through it. The model comes from the run's saved config where there is one, else
from the param shapes (any layout `layout.canonicalize` reads: ours, big_vision's,
vision_transformer's, timm's).
"""

import math
import types

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp

from big_vit_lite.runtime import paths
from big_vit_lite.runtime import sharding
from big_vit_lite.models import formats
from big_vit_lite.models import layout
from big_vit_lite.models import steps
from big_vit_lite.models import timm
from big_vit_lite.models import vit


def read_source(src, key="params"):
  """SRC -> (canonical flat "a/b/c" params, saved config or None, checkpoint step).

  key "ema": a training checkpoint's EMA of the weights. Read once (the params that go
  into the model): a run writing steps meanwhile cannot mix one step's config in another's.
  """
  src = paths.resolve(src)  # Local or on a bucket (gs://...).
  if not src.is_dir():
    if key != "params":
      raise ValueError(
          f"{src} is a file holding one set of params, no EMA: pass a training "
          "workdir or step directory to read a run's EMA weights."
      )
    # (canonical, whatever wrote the file)
    return formats.read_params(src), None, 0
  src = steps.resolve_step_dir(src)
  params, config = steps.load_params(src, key)
  flat = layout.canonicalize(layout.to_numpy_flat(params))
  step = 0
  if src.name.isdigit():
    step = int(src.name)
  return flat, config, step


def infer_model_cfg(flat):
  """vit.Model kwargs read off the param shapes (any layout `layout.canonicalize` reads)."""
  flat = layout.canonicalize(flat)
  a = layout.arch(flat)
  if not {"patch", "heads", "mlp_dim"} <= a.keys():
    raise ValueError(
        "model_init holds no ViT params (no patch embedding, attention or MLP)."
    )
  posemb = "sincos2d"  # (no params)
  if any(k.endswith("pos_embedding") for k in flat):
    posemb = "learn"
  cfg = dict(
      variant=None,
      width=a["width"],
      depth=a["depth"],
      mlp_dim=a["mlp_dim"],
      num_heads=a["heads"],
      patch_size=a["patch"],
      pool_type=a["pool_type"],
      posemb=posemb,
  )
  cfg.update(layout.model_options(flat))
  if "pre_logits/kernel" in flat:
    cfg["rep_size"] = int(flat["pre_logits/kernel"].shape[1])
  stem = []  # The conv stem's output channels, if any.
  while f"stem/conv_{len(stem)}/kernel" in flat:
    stem.append(int(flat[f"stem/conv_{len(stem)}/kernel"].shape[3]))
  if stem:
    cfg["stem_channels"] = tuple(stem)
  return cfg


def native_input_shape(flat, saved_config, hw=None):
  """(res, channels) the model was trained at, from the param shapes.

  hw: the (h, w) it was trained at when known otherwise (a timm export's metadata); else
  the saved config's training pp tells, if any. res is None for a sincos2d model of unknown
  training size: it runs at whatever size the eval pp gives.
  """
  flat = layout.canonicalize(flat)
  patch = flat["embedding/kernel"].shape[0]
  # The image goes into the stem, if any.
  channels = int(
      flat.get("stem/conv_0/kernel", flat["embedding/kernel"]).shape[2]
  )
  from_pp = hw is None
  hw = hw or steps.trained_hw(saved_config, flat)
  if hw and hw[0] != hw[1]:
    # A 4x9 grid has as many tokens as a 6x6 one: run square, its posemb would
    # be scrambled.
    said = "its timm metadata"
    if from_pp:
      said = f"its pp: {str(saved_config.input.pp)!r}"
    raise ValueError(
        f"The checkpoint was trained on {hw[0]}x{hw[1]} images ({said}): evaluate "
        "runs square images only."
    )
  posemb = flat.get("Transformer/posembed_input/pos_embedding")
  # sincos posemb has no params: the training pp's size, if known.
  if posemb is None and hw:
    return hw[0], channels
  if posemb is None:
    return None, channels
  # canonical: a row for each of cls and dist iff there is one
  tokens = posemb.shape[1] - layout.num_prefix(flat)
  side = math.isqrt(tokens)
  if side * side != tokens:
    raise ValueError(
        f"The checkpoint's position embedding has {tokens} patch tokens, not a "
        "square grid: evaluate runs square images only."
    )
  if hw and hw[0] // patch == side:
    # Also when the patch does not divide it (So400m/14, 384).
    return hw[0], channels
  return side * patch, channels


def build_model(config, flat, saved_config):
  """(vit.Model, kwargs) from the saved run config or the param shapes + overrides."""
  if saved_config is not None and "model" in saved_config:
    model_cfg = saved_config.model.to_dict()
    source = "the checkpoint's saved config"
  else:
    model_cfg = infer_model_cfg(flat)
    source = "the param shapes"
  # big_vision's eval configs say model_name="vit" too: read, not an unread-key
  # error.
  if config.get("model_name", "vit") != "vit":
    raise ValueError(
        f"model_name={config.model_name!r}: only 'vit' is supported."
    )
  overrides = {
      k: v for k, v in config.consume("model", {}).items() if v is not None
  }
  model_cfg.update(overrides)
  model_cfg["num_classes"] = 0  # no head: the pre-logits
  if "head/kernel" in flat:
    model_cfg["num_classes"] = int(flat["head/kernel"].shape[1])
  # Evaluation never uses dropout or remat.
  model_cfg.update(dropout=0.0, drop_path=0.0, remat_policy=None)
  if overrides:
    source = f"{source} with overrides {overrides}"
  logging.info("Model from %s: %s", source, model_cfg)
  try:
    return vit.Model(**model_cfg), model_cfg
  except TypeError as e:
    raise ValueError(f"Bad model config {model_cfg}: {e}") from None


def make_predict_fn(model, res, channels, patch=1):
  """predict_fn(params, images) -> (logits, out), checking the image shape first.

  Images must have `channels` and, unless res is None, the patch grid of res x res
  images (a /14 model made for 384 px takes 378 to 391 px).
  """

  def predict_fn(params, images):
    _, h, w, c = images.shape
    if c != channels or (
        res is not None and (h // patch, w // patch) != (res // patch,) * 2
    ):
      want = f"{channels} channels:"
      example = f"channels={channels}"
      if res is not None:
        want = f"{res}x{res}x{channels}: resize to {res} and"
        example = f"res={res},channels={channels}"
      raise ValueError(
          f"The eval pp gives {h}x{w}x{c} images but the model takes {want} decode "
          f"with channels={channels} in the pp (e.g. configs/fewshot.py:{example})."
      )
    return model.apply(
        {"params": params}, images.astype(jnp.float32), train=False
    )

  return predict_fn


def load_model(src, key, config, mesh, rules, default_res=None, place=True):
  """Reads SRC once (see read_source) and places its params on `mesh`, sharded by `rules`.

  place=False: the params as ShapeDtypeStructs with their shardings, placed nowhere (the
  planner's teacher, for a mesh of abstract TPU or GPU devices).

  config: the eval config, whose `model` entries override the checkpoint's; default_res:
  the size to run at when the model does not say one (a sincos2d model's). Returns a
  namespace: params (on the mesh), predict_fn (make_predict_fn's), model_cfg, res (None:
  any size), channels, step (the checkpoint's; 0 for a file) and saved_config (or None).
  """
  flat, saved_config, step = read_source(src, key)
  model, model_cfg = build_model(config, flat, saved_config)
  timm_hw = None
  if str(src).endswith(".safetensors"):
    timm_hw = timm.timm_image_size(src)
  res, channels = native_input_shape(flat, saved_config, timm_hw)
  res = res or default_res
  logging.info(
      "Model input: %sx%sx%d; checkpoint step %d.",
      res or "any",
      res or "any",
      channels,
      step,
  )
  patch = int(flat["embedding/kernel"].shape[0])
  # (sincos2d of unknown size: no size-dependent params)
  init_res = res or patch
  abstract = jax.eval_shape(
      lambda: model.init(
          jax.random.PRNGKey(0), jnp.zeros((1, init_res, init_res, channels))
      )["params"]
  )
  try:  # The params read above, not the source again (see read_source).
    loaded = layout.merge(abstract, flat)
  except ValueError as e:
    raise ValueError(f"Cannot load {src}: {e}") from None
  shardings = sharding.logical_shardings(abstract, mesh, rules)
  if place:
    params = jax.device_put(nn.meta.unbox(loaded), shardings)
  else:
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        sharding.unbox(abstract),
        shardings,
    )
  return types.SimpleNamespace(
      params=params,
      predict_fn=make_predict_fn(model, res, channels, patch),
      model_cfg=model_cfg,
      res=res,
      channels=channels,
      step=step,
      saved_config=saved_config,
  )
