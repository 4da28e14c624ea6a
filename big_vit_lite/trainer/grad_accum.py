"""Gradient accumulation: one optimizer step, its batch run as k microbatches in sequence.

config.grad_accum_steps = k (default 1) splits every global batch into k
microbatches of batch_size / k, runs forward and backward on each inside one
jitted step (a `lax.scan`: one microbatch's activations alive at a time) and
averages their gradients: the update of the full batch for about 1/k of the
activation memory. Microbatch i holds examples i, i+k, i+2k, ... so that each
device keeps its own rows (batch_size / devices must be divisible by k). What
is exactly the same as k = 1 and what differs (summation order, dropout
masks): benchmarks/NOTES.md, section "Trainer, checkpoints, summary, report".
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def check(steps, batch_size, batch_devices):
  """Validates config.grad_accum_steps against the batch; returns it as an int."""
  # the one check every entry point (train, plan, bench) passes through
  if batch_size < 1:
    raise ValueError(f"input.batch_size={batch_size}: use a positive integer.")
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(
        f"grad_accum_steps={steps!r}: use a positive integer (1 = no accumulation)."
    )
  if batch_size % batch_devices:
    raise ValueError(
        f"input.batch_size={batch_size} is not divisible by the {batch_devices} "
        "devices the batch is split over (the mesh's data and fsdp axes): use a "
        f"multiple of {batch_devices * steps}, or a mesh with fewer data/fsdp "
        "devices."
    )
  if batch_size % (steps * batch_devices):
    raise ValueError(
        f"grad_accum_steps={steps} does not divide the per-device batch: input."
        f"batch_size={batch_size} over {batch_devices} device(s) is "
        f"{batch_size / batch_devices:g} per device. Choose grad_accum_steps dividing "
        f"it, or a batch size divisible by {steps * batch_devices}."
    )
  return steps


def split(batch, steps, batch_sharding=None):
  """(B, ...) leaves -> (steps, B / steps, ...); microbatch i = rows i, i+steps, ..."""

  def one(x):
    x = jnp.swapaxes(
        x.reshape((x.shape[0] // steps, steps) + x.shape[1:]), 0, 1
    )
    # the microbatch axis replicated, rows stay where they were
    if batch_sharding is not None:
      x = jax.lax.with_sharding_constraint(
          x, NamedSharding(batch_sharding.mesh, P(None, *batch_sharding.spec))
      )
    return x

  return jax.tree.map(one, batch)


def value_and_grad(
    loss_fn,
    params,
    batch,
    rng,
    steps,
    *,
    batch_sharding=None,
    param_shardings=None,
):
  """(mean loss, mean gradient) of loss_fn(params, batch, rng) over `steps` microbatches.

  loss_fn must return the mean loss over the examples it is given. With steps == 1
  this is exactly `jax.value_and_grad(loss_fn)(params, batch, rng)`.
  param_shardings: the params' shardings, kept for the gradient accumulators
  (under FSDP they must stay sharded, not be gathered whole on every device).
  """
  grad_fn = jax.value_and_grad(loss_fn)
  if steps == 1:
    return grad_fn(params, batch, rng)

  def body(carry, xs):
    (loss_sum, grad_sum), (index, micro) = carry, xs
    if batch_sharding is not None:
      micro = jax.lax.with_sharding_constraint(micro, batch_sharding)
    loss, grads = grad_fn(params, micro, jax.random.fold_in(rng, index))
    grad_sum = jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)
    return (loss_sum + loss.astype(jnp.float32), grad_sum), None

  # Accumulate in float32 whatever the params' dtype: k bf16 additions lose
  # bits.
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  if param_shardings is not None:
    zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
  (loss_sum, grad_sum), _ = jax.lax.scan(
      body,
      (jnp.zeros((), jnp.float32), zeros),
      (jnp.arange(steps), split(batch, steps, batch_sharding)),
  )
  return loss_sum / steps, jax.tree.map(
      lambda s, p: (s / steps).astype(p.dtype), grad_sum, params
  )
