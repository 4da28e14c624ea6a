"""models/layout.py's readers of a param tree (arch, model_options,
num_prefix) against the options a model was built with: vit.Model's params,
made as shapes only (jax.eval_shape, no compile), for several option sets
chosen so that each option read wrong gives another answer.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from big_vit_lite.models import layout
from big_vit_lite.models import vit

_ARCH = dict(width=16, depth=3, mlp_dim=24, num_heads=2, patch_size=4)


def _flat(**options):
  model = vit.Model(num_classes=5, **_ARCH, **options)
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, 12, 3)))
  )
  return layout.flatten(nn.meta.unbox(shapes["params"]))


@pytest.mark.parametrize(
    "options, pool",
    [
        (dict(pool_type="tok"), "tok"),
        (dict(pool_type="map"), "map"),
        (dict(pool_type="gap", posemb="sincos2d"), "gap"),
    ],
)
def test_arch_reads_the_built_sizes_and_pooling(options, pool):
  """Guards: a size read from the wrong axis of its kernel (heads from the
  head dim, mlp_dim from the width, patch from the channels), depth off by
  one, the pooling of a MAP model or a class-token model misread. Oracle:
  the sizes and pooling the model was built with."""
  flat = _flat(**options)
  got = layout.arch(flat)
  assert got == dict(
      patch=4,
      channels=3,
      width=16,
      depth=3,
      heads=2,
      mlp_dim=24,
      pool_type=pool,
  )
  assert layout.num_prefix(flat) == int(pool == "tok")


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(reg_tokens=2, qk_norm=True, layerscale_init=0.1),
        dict(mlp="swiglu", norm="rmsnorm", parallel_block=True, use_bias=False),
        dict(distill_token=True, pool_type="tok"),
    ],
)
def test_model_options_are_the_built_ones(options):
  """Guards: an option read from a param the option does not make, read
  negated (rmsnorm for a LayerNorm model, parallel for a sequential one), a
  register count of 1, a default option reported (an override the loaded
  config did not ask for). Oracle: the options the model was built with
  (LayerScale's init comes back as 1.0: it is not in the params)."""
  flat = _flat(**options)
  want = {k: v for k, v in options.items() if k != "pool_type"}
  if "layerscale_init" in want:
    want["layerscale_init"] = 1.0
  assert layout.model_options(flat) == want
  # The default pooling is the class token's.
  assert layout.num_prefix(flat) == 1 + int("distill_token" in options)
