"""The hand-written functions under the ViT: attention, LayerNorm and exact GELU.

Each computes what its jax/flax counterpart computes, with a custom backward
pass that is faster on CPU; why, and the measurements: benchmarks/NOTES.md,
section "Model (models/)". `vit` re-exports them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from big_vit_lite.models import splash

# cuDNN's tokens are padded to a multiple of this (see NOTES.md)
CUDNN_SEQ_MULTIPLE = 8


def _normal_cdf(x):
  return 0.5 + 0.5 * jax.lax.erf(x * np.asarray(np.sqrt(0.5), x.dtype))


@jax.custom_vjp
def gelu_exact(x):
  """Exact GELU, x * Phi(x), with erf and a hand-written derivative (nn.gelu's to rounding).

  The backward pass keeps only x and recomputes erf from it.
  """
  return x * _normal_cdf(x)


def _gelu_exact_bwd(x, g):
  # Keeps XLA from merging this erf with the forward's.
  x = jax.lax.optimization_barrier(x)
  pdf = jnp.exp(-0.5 * x * x) * np.asarray(1 / np.sqrt(2 * np.pi), x.dtype)
  return (g * (_normal_cdf(x) + x * pdf),)


gelu_exact.defvjp(lambda x: (gelu_exact(x), x), _gelu_exact_bwd)


def dot_product_attention(q, k, v):
  """softmax(q k^T / sqrt(D/H)) v on (batch, seq, heads, D/H) arrays, with a hand-written backward.

  The same computation as `jax.nn.dot_product_attention`'s XLA path (logits
  and softmax in float32, probabilities cast back to v's dtype), with the heads
  moved next to the batch.
  """
  # (batch, heads, seq, D/H)
  q, k, v = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
  return jnp.swapaxes(_attention_core(q, k, v), 1, 2)


def _head_scale(q):
  return np.asarray(1.0 / np.sqrt(q.shape[-1]), q.dtype)  # 1/sqrt(D/H)


@jax.custom_vjp
def _attention_core(q, k, v):
  return _attention_core_fwd(q, k, v)[0]  # (batch, heads, seq, D/H)


def _transposed_copy(x):
  # A real (seq_k, seq_q) copy: without the barrier XLA folds the transpose into
  # the dot, whose LHS then contracts over its major dim and misses the fast CPU
  # matmul kernels.
  return jax.lax.optimization_barrier(jnp.swapaxes(x, -1, -2))


def _attention_core_fwd(q, k, v):
  q = q * _head_scale(q)  # On q, not on the (larger) logits.
  logits = jnp.einsum(
      "bnqh,bnkh->bnqk", q, k, preferred_element_type=jnp.float32
  )
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bnqk,bnkh->bnqh", probs, v), (q, k, v, probs)


def _attention_core_bwd(res, dout):
  q_scaled, k, v, probs = res
  scale = _head_scale(q_scaled)
  dv = jnp.einsum(
      "bnkq,bnqh->bnkh", _transposed_copy(probs), dout.astype(probs.dtype)
  )
  dp = jnp.einsum(
      "bnqh,bnkh->bnqk", dout, v, preferred_element_type=jnp.float32
  )
  p32 = probs.astype(jnp.float32)
  ds = p32 * (dp - jnp.sum(dp * p32, axis=-1, keepdims=True))  # d(logits)
  dq = jnp.einsum("bnqk,bnkh->bnqh", ds.astype(k.dtype), k) * scale
  dk = jnp.einsum(
      "bnkq,bnqh->bnkh", _transposed_copy(ds.astype(q_scaled.dtype)), q_scaled
  )
  return dq.astype(q_scaled.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


def padded_attention(q, k, v, implementation="cudnn", multiple=None):
  """jax.nn.dot_product_attention on (batch, seq, heads, D/H) with the seq padded.

  q and k/v are zero-padded to a multiple of `multiple` (default CUDNN_SEQ_MULTIPLE) tokens;
  the padded keys are masked (key_value_seq_lengths) and the padded query rows dropped, so
  the result is that of the unpadded attention.
  """
  # (read at each call: a benchmark sets it)
  multiple = multiple or CUDNN_SEQ_MULTIPLE
  (b, t), s = q.shape[:2], k.shape[1]
  pad_t, pad_s = -t % multiple, -s % multiple
  pad = lambda a, n: jnp.pad(a, ((0, 0), (0, n), (0, 0), (0, 0))) if n else a
  lengths = jnp.full((b,), s, jnp.int32) if pad_s else None
  out = jax.nn.dot_product_attention(
      pad(q, pad_t),
      pad(k, pad_s),
      pad(v, pad_s),
      key_value_seq_lengths=lengths,
      implementation=implementation,
  )
  return out[:, :t]


def attention_fn(kind: str):
  """The (batch, seq, heads, D/H) attention function of a resolved kind: custom | xla | cudnn | splash."""
  return {
      "custom": dot_product_attention,
      "cudnn": padded_attention,
      "splash": splash.splash_attention,
      "xla": functools.partial(
          jax.nn.dot_product_attention, implementation="xla"
      ),
  }[kind]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps=1e-6):
  """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32 or wider.

  flax.linen.LayerNorm's function (its fast-variance formula), with a hand-written backward.
  """
  return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
  x_in, dtype = x, jnp.promote_types(x.dtype, jnp.float32)
  x = x.astype(dtype)
  # One pass over x: mean and mean of squares.
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.maximum(
      jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean), 0.0
  )
  rstd = jax.lax.rsqrt(var + eps)
  return (x - mean) * rstd * scale.astype(dtype) + bias.astype(dtype), (
      x_in,
      mean,
      rstd,
      scale,
  )


def _layer_norm_bwd(_eps, res, dy):
  x_in, mean, rstd, scale = res
  xhat = (x_in.astype(mean.dtype) - mean) * rstd
  g = dy * scale.astype(dy.dtype)
  dx = rstd * (
      g
      - jnp.mean(g, axis=-1, keepdims=True)
      - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
  )
  rows = tuple(range(x_in.ndim - 1))
  dscale = jnp.sum(dy * xhat, axis=rows).astype(scale.dtype)
  dbias = jnp.sum(dy, axis=rows).astype(scale.dtype)
  return dx.astype(x_in.dtype), dscale, dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def rms_norm(x, scale, eps=1e-6):
  """x / sqrt(mean(x^2) + eps) * scale over the last axis, in float32 or wider (timm's RmsNorm)."""
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  rstd = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
  return x * rstd * scale.astype(x.dtype)
