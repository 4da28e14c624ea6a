"""Host batches -> global jax.Arrays on the mesh, with device prefetch.

Every process passes its host-local batch; `jax.make_array_from_process_local_data`
stitches them into one global array whose leading (batch) dimension is
sharded over the mesh's batch axes ("data" and "fsdp", where present), in
process order -- which is shard order, so the global batch is exactly the
one DESIGN.md's data-order contract describes.
"""

import atexit
import queue
import threading
import weakref

import jax
import numpy as np

from big_vit_lite.runtime import sharding
from big_vit_lite.data import count


def put_batch(local_batch, mesh):
  """dict of host-local np arrays -> dict of global jax.Arrays sharded on the batch axes."""
  out = {}
  for key, value in local_batch.items():
    value = np.asarray(value)
    if value.dtype.kind in "OSU":
      raise ValueError(
          f"batch key {key!r} holds {value.dtype} data, which cannot go to a "
          f"device; drop it in the pp string (keep('image', 'labels'))"
      )
    out[key] = jax.make_array_from_process_local_data(
        sharding.batch_sharding(mesh), value
    )
  return out


class _Prefetcher:
  """Iterator of device batches, filled `size` ahead by a background thread (size 0: each
  batch is put on device when asked for, no thread).

  `get_state()` gives the source iterator's state as of the last batch
  *returned* (not the ones prefetched ahead), so checkpointing it resumes
  exactly after the last batch the trainer consumed.
  """

  _END = object()

  def __init__(self, iterator, size, mesh):
    self._it, self._mesh, self._size = iterator, mesh, size
    self._has_state = hasattr(iterator, "get_state")
    self._state = iterator.get_state() if self._has_state else None
    if size:
      self._queue = queue.Queue(maxsize=size)
      self._stop = threading.Event()
      self._thread = threading.Thread(
          target=self._fill, daemon=True, name="device_prefetch"
      )
      self._thread.start()
      _LIVE.add(self)

  def _fill(self):
    try:
      for batch in self._it:
        item = (
            put_batch(batch, self._mesh),
            self._it.get_state() if self._has_state else None,
        )
        while not self._stop.is_set():
          try:
            self._queue.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
        if self._stop.is_set():
          return
      self._queue.put((self._END, None))
    except BaseException as e:  # pylint: disable=broad-except
      self._queue.put((e, None))  # re-raised in the consumer's thread

  def __iter__(self):
    return self

  def __next__(self):
    if not self._size:
      item = put_batch(next(self._it), self._mesh)
      self._state = self._it.get_state() if self._has_state else None
      return item
    item, state = self._queue.get()
    if item is self._END or isinstance(item, BaseException):
      # the thread is gone: a later next() must not block
      self._queue.put((item, None))
      if item is self._END:
        raise StopIteration
      raise item
    self._state = state
    return item

  def get_state(self):
    if not self._has_state:
      raise TypeError(f"{type(self._it).__name__} has no get_state()")
    return self._state

  def close(self):
    """Stops the thread (also done at exit: a thread killed inside TF aborts Python)."""
    if not self._size:
      return
    self._stop.set()
    while self._thread.is_alive():
      try:
        self._queue.get_nowait()
      except queue.Empty:
        pass
      self._thread.join(timeout=0.1)


_LIVE = weakref.WeakSet()


@atexit.register
def _close_all():
  for p in list(_LIVE):
    p.close()


def prefetch(iterator, size, mesh):
  """Iterator of global device batches, `size` batches ahead (0: none).

  Set the source iterator's state (set_state) *before* wrapping it; then
  checkpoint `prefetcher.get_state()`, which is the position after the
  last batch returned, whatever was prefetched.
  """
  if size is None:
    size = 0
  size = count(size, "device prefetch size", 0)
  return _Prefetcher(iterator, size, mesh)
