"""Pallas splash attention (TPU flash attention) on the ViT's (batch, seq, heads, D/H) arrays.

`vit.Model(attention="splash")`: softmax(q k^T / sqrt(D/H)) v computed block by
block in TPU kernels (jax.experimental.pallas.ops.tpu.splash_attention), which
keep no (seq x seq) probabilities for the backward pass. The kernels take the
sequence in blocks of BLOCK tokens: the tokens are zero-padded to a multiple
(197 -> 256), the padded keys are masked by segment ids (real tokens 0,
padding 1) and the padded query rows are dropped, so the result is that of the
unpadded attention.

The kernels run per device: under a mesh (`jax.set_mesh` with flax's logical
axis rules, as the trainer, plan and bench run the model) through shard_map over
the batch and head axes. They compile for a TPU only; `interpret=True` runs
them in Pallas' interpreter on any backend (slow: the tests).
"""

import functools

import flax.linen as nn
import jax
from jax.experimental.pallas.ops.tpu import splash_attention as splash
import jax.numpy as jnp
import numpy as np

# The kernels' q and kv block: the sequence is padded to a multiple of it.
BLOCK = 128


def _kernel(heads: int, seq: int, interpret: bool):
  """The splash kernel of one example: (heads, seq, D/H) q, k, v -> out."""
  mask = splash.MultiHeadMask([splash.FullMask((seq, seq))] * heads)
  sizes = splash.BlockSizes(
      block_q=BLOCK,
      block_kv=BLOCK,
      block_kv_compute=BLOCK,
      block_q_dkv=BLOCK,
      block_kv_dkv=BLOCK,
      block_kv_dkv_compute=BLOCK,
      block_q_dq=BLOCK,
      block_kv_dq=BLOCK,
  )
  return splash.make_splash_mha(
      mask,
      block_sizes=sizes,
      head_shards=1,
      q_seq_shards=1,
      interpret=interpret,
  )


def _on_device(q, k, v, interpret: bool):
  """splash_attention on one device's arrays."""
  batch, tokens, heads, head_dim = q.shape
  padded = tokens + (-tokens % BLOCK)

  def kernel_layout(a):  # (batch, heads, padded, D/H)
    a = jnp.pad(a, ((0, 0), (0, padded - tokens), (0, 0), (0, 0)))
    return jnp.swapaxes(a, 1, 2)

  # The kernels take q already scaled by 1/sqrt(D/H).
  q = q * np.asarray(1.0 / np.sqrt(head_dim), q.dtype)
  segments = (jnp.arange(padded) >= tokens).astype(jnp.int32)
  segment_ids = splash.SegmentIds(q=segments, kv=segments)
  kernel = _kernel(heads, padded, interpret)
  out = jax.vmap(kernel, in_axes=(0, 0, 0, None))(
      kernel_layout(q),
      kernel_layout(k),
      kernel_layout(v),
      segment_ids,
  )
  return jnp.swapaxes(out, 1, 2)[:, :tokens]


def splash_attention(q, k, v, *, interpret: bool = False):
  """dot_product_attention (ops.py) by the splash kernels: (batch, seq, heads, D/H)."""
  on_device = functools.partial(_on_device, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return on_device(q, k, v)
  # The trainer's placement of these arrays (flax's logical axis rules).
  spec = nn.logical_to_mesh_axes(("batch", "seq", "heads", "kv"))
  return jax.shard_map(
      on_device,
      mesh=mesh,
      in_specs=(spec, spec, spec),
      out_specs=spec,
      check_vma=False,
  )(q, k, v)
