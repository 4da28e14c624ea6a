"""Out-of-memory errors from XLA, told to the user in one line with what to change.

XLA reports a failed allocation as a runtime error whose text depends on the
backend ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate N bytes"
on GPU/TPU, "INTERNAL: ... Out of memory allocating N bytes" on CPU), buried in
a long traceback. The job entry points turn it into one line that says how
much was asked for and which config keys trade memory for something else.
"""

import re

import jax

_OOM = re.compile(r"out of memory|resource_exhausted", re.IGNORECASE)
_BYTES = re.compile(
    r"allocat\w*\s+([\d.]+)\s*([KMGT]i?B|bytes|B)?", re.IGNORECASE
)
_UNITS = {
    "": 1,
    "b": 1,
    "bytes": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def is_oom(err: BaseException) -> bool:
  """True for XLA's out-of-memory runtime errors (any backend)."""
  return isinstance(err, jax.errors.JaxRuntimeError) and bool(
      _OOM.search(str(err))
  )


def requested_bytes(err: BaseException):
  """The size of the allocation that failed, in bytes, where XLA's message says it."""
  m = _BYTES.search(str(err))
  if not m:
    return None
  return float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


TRAIN_ADVICE = (
    "Lower input.batch_size or raise grad_accum_steps (same batch in sequential "
    "microbatches), set model.remat_policy='nothing_saveable', or split params and optimizer "
    "state with an fsdp mesh axis; `python -m big_vit_lite.plan --config=... --mesh=...` "
    "estimates the memory per device without running."
)
EVAL_ADVICE = (
    "Lower the evals' batch_size (--config.evals.NAME.batch_size=...) or evaluate on "
    "more devices."
)


def message(
    err: BaseException,
    *,
    what: str,
    batch_size=None,
    devices=None,
    grad_accum_steps=None,
    advice=TRAIN_ADVICE,
) -> str:
  """One line: what ran out of memory, how much was asked, and the knobs that help."""
  asked = ""
  if asked_bytes := requested_bytes(err):
    asked = f" (an allocation of {asked_bytes / 2**30:.2f} GiB failed)"
  detail = []
  if batch_size and devices:
    detail.append(f"{batch_size // devices:,} per device")
  if batch_size and (grad_accum_steps or 1) > 1:
    detail.append(f"{grad_accum_steps} microbatches")
  where = ""
  if batch_size:
    where = f" at input.batch_size={batch_size}"
  if detail:
    where += f" ({', '.join(detail)})"
  return f"out of memory during {what}{where}{asked}. {advice}"
