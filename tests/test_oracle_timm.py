"""models/timm.py (our params <-> timm's VisionTransformer state dicts) against
real timm (PyTorch, CPU), in-process, both ways:

- ours -> timm: our random params written by write_timm, loaded into the timm
  class its metadata names with strict=True; timm's logits in eval and in
  train mode are ours, and timm's gradients, read back through from_timm, are
  jax's gradients of the same loss (so every transposed, reshaped or
  concatenated tensor is mapped by the right rule, in both directions);
- timm -> ours: a timm model's own initial weights (perturbed, so that no
  tensor is zero or one) read by read_timm give our model timm's logits.

Each case turns on several block options, so a name or a split of one option
that is wrong shows in that case's numbers. Skipped where torch or timm is
missing (timm_reference.require; a failure in CI).
"""

import json
import os
import pkgutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from big_vit_lite.models import layout
from big_vit_lite.models import timm

import checks
import timm_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
try:
  import timm_parity  # pylint: disable=g-import-not-at-top
finally:
  sys.path.pop(0)

SMALL = dict(width=16, mlp_dim=24, num_classes=3)
# benchmarks/timm_parity.py's all-options cases: the serial block's options
# and registers (with global average pooling), the parallel block's with
# the MAP head, and a plain block with DeiT's two tokens and heads.
CASES = {
    "all_serial_gap": dict(timm_parity.OPTIONS["all_serial"], pool_type="gap"),
    "all_parallel_map": timm_parity.OPTIONS["all_parallel_map"],
    "distill_token": timm_parity.OPTIONS["distill_token"],
}
IMAGES = np.asarray(
    jax.random.uniform(jax.random.key(9), (2, 16, 16, 3), minval=-1, maxval=1)
)
COTANGENT = np.array(jax.random.normal(jax.random.key(1), (2, 3)))


def _timm_model(path):
  """timm's model for a write_timm file, from its metadata as a user builds it."""
  _, torch = timm_reference.require()
  import safetensors  # pylint: disable=import-outside-toplevel
  import safetensors.torch  # pylint: disable=import-outside-toplevel

  with safetensors.safe_open(str(path), "np") as f:
    meta = f.metadata()
  kwargs = json.loads(meta["timm_kwargs"])
  for k, v in json.loads(meta.get("timm_classes", "{}")).items():
    kwargs[k] = pkgutil.resolve_name(v)
  model = pkgutil.resolve_name(meta["timm_class"])(**kwargs)
  model.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
  return model, meta, torch


def _torch_logits_and_grads(model, torch, train):
  model.train(train)
  model.zero_grad()
  nchw = torch.from_numpy(np.ascontiguousarray(IMAGES.transpose(0, 3, 1, 2)))
  logits = model(nchw)
  (logits * torch.from_numpy(COTANGENT)).sum().backward()
  # (timm's ParallelScalingBlock without qkv_bias keeps a zero MLP bias
  # that ours has not: from_timm refuses a nonzero one.)
  grads = {
      k: p.grad.numpy()
      for k, p in model.named_parameters()
      if not k.endswith(".mlp_bias")
  }
  return logits.detach().numpy(), grads


@pytest.mark.parametrize("case", list(CASES))
def test_timm_runs_our_export_and_we_run_timms_weights(tmp_path, case):
  """Guards: a tensor of the conversion transposed, reshaped or split the
  wrong way (q/k/v into heads, the fused kv of the MAP head, a parallel
  block's in_proj of MLP and q/k/v, SwiGLU's gate and value), a norm's bias
  written for RMSNorm or lost for LayerNorm, an option's kwarg not said to
  timm (qk_norm, init_values, norm_layer, mlp_layer, block_fn, qkv_bias,
  reg_tokens, global_pool, class_token, fc_norm, the DeiT class), the class
  token's or the registers' posemb rows misplaced, a head not read back.
  Oracle: real timm's forward (eval and train mode) and its autograd."""
  opts = dict(SMALL, **CASES[case])
  model = checks.tiny_vit(**opts)
  params = checks.vit_params(seed=3, **opts)
  path = tmp_path / "m.safetensors"
  timm.write_timm(params, path, image_size=16)
  theirs, meta, torch = _timm_model(path)

  def logits(p):
    return model.apply({"params": p}, IMAGES)[0]

  apply = jax.jit(logits)
  ours = apply(params)
  loss_grad = jax.jit(jax.grad(lambda p: jnp.sum(logits(p) * COTANGENT)))
  our_grads = layout.to_numpy_flat(loss_grad(params))
  for train in (False, True):
    logits, grads = _torch_logits_and_grads(theirs, torch, train)
    np.testing.assert_allclose(logits, ours, atol=2e-5, rtol=2e-5)
  # timm adds pos_embed rows to the registers, which from_timm folds into
  # them: their gradient is the registers' own, which would come back twice.
  n_prefix = int("cls_token" in grads) + int("dist_token" in grads)
  n_reg = CASES[case].get("reg_tokens", 0)
  grads["pos_embed"][:, n_prefix : n_prefix + n_reg] = 0
  back = timm.from_timm(grads, num_heads=2, grid_tokens=16)
  assert sorted(back) == sorted(our_grads)
  for k, g in our_grads.items():
    np.testing.assert_allclose(back[k], g, atol=5e-5, rtol=1e-4, err_msg=k)

  # timm -> ours: timm's own init, perturbed, through a file.
  torch.manual_seed(0)
  with torch.no_grad():
    for k, p in theirs.named_parameters():
      if not k.endswith(".mlp_bias"):
        p.add_(0.2 * torch.randn_like(p))
  sd = {k: v.numpy() for k, v in theirs.state_dict().items()}
  sd_path = tmp_path / "theirs.safetensors"
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  # The metadata of our file: the same architecture.
  save_file(sd, str(sd_path), metadata=meta)
  flat = timm.read_timm(sd_path, None)
  want, _ = _torch_logits_and_grads(theirs.eval(), torch, False)
  np.testing.assert_allclose(
      apply(layout.unflatten(flat)), want, atol=2e-5, rtol=2e-5
  )


def test_refusals_and_the_image_size_a_file_says(tmp_path):
  """Guards: a model timm cannot build exported anyway (a convolutional
  stem, a pre-logits layer, a parallel block with SwiGLU, DeiT with
  registers) or refused without saying what to do, a non-square model's
  grid guessed square, the image size written to the file not read back
  (evaluate would run a non-square export at a square size). Oracle: the
  docstrings' rules; the sizes written."""
  refused = [
      (dict(stem_channels=(4,)), ("convolutional stem", "stem_channels")),
      (dict(rep_size=True), ("pre-logits", "rep_size")),
      (
          dict(parallel_block=True, mlp="swiglu"),
          ("ParallelScalingBlock", "mlp='gelu'"),
      ),
      (
          dict(distill_token=True, reg_tokens=1),
          ("VisionTransformerDistilled", "reg_tokens=0"),
      ),
      (dict(posemb="sincos2d"), ("no learned posemb", "(--res)")),
  ]
  for kw, words in refused:
    params = checks.vit_params(**kw)
    checks.one_line_error(lambda p=params: timm.to_timm(p), *words)
  wide = checks.vit_params(hw=(16, 32))
  checks.one_line_error(
      lambda: timm.to_timm(wide), "32 grid tokens", "(--res=HxW)"
  )
  for size, want in ((16, (16, 16)), ((16, 32), (16, 32))):
    params = wide
    if size == 16:
      params = checks.vit_params()
    path = tmp_path / f"{want[1]}.safetensors"
    kwargs = timm.write_timm(params, path, image_size=size)
    assert kwargs["img_size"] == size
    assert timm.timm_image_size(path) == want
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "bare.safetensors"))
  assert timm.timm_image_size(tmp_path / "bare.safetensors") is None
  # The format tag Hugging Face's loaders require of a PyTorch file
  # (transformers refuses another), as safetensors.torch writes it.
  with safe_open(str(path), "np") as f:
    assert f.metadata()["format"] == "pt"
  # A file that is not one: the reader's reason in the one line.
  (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
  msg = checks.one_line_error(
      lambda: timm.read_timm(tmp_path / "bad.safetensors", 2),
      "not a readable safetensors file (",
      "copy or export it again",
  )
  assert "(None)" not in msg and "()" not in msg, msg
