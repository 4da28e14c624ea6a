"""Cheap validity checks of encoded images, so bad files are skipped up front.

A decode error inside tf.data would stop a run, and dropping examples there
would break exact resume; so sources check images before they enter the
pipeline: Pillow parses the header, and JPEG/PNG files must end with their
end marker (which catches truncated downloads and copies).
"""
import io

from PIL import Image

_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
TAIL_BYTES = 64


def tail_problem(fmt, tail):
  """Reason why a file of format `fmt` ending in `tail` is truncated, or None."""
  if fmt == "JPEG" and b"\xff\xd9" not in tail:
    return "truncated JPEG (no end-of-image marker)"
  if fmt == "PNG" and not tail.endswith(_PNG_END):
    return "truncated PNG (no IEND chunk)"
  return None


def header(fileobj):
  """(format, (width, height)) from the header; raises if Pillow cannot parse it."""
  with Image.open(fileobj) as im:
    return im.format, im.size


def bytes_problem(data):
  """Reason why encoded image bytes are unusable, or None if they look fine."""
  try:
    fmt, size = header(io.BytesIO(data))
  except Exception as e:  # pylint: disable=broad-except
    return f"unreadable header ({type(e).__name__})"
  if min(size) < 1:
    return f"empty image {size}"
  return tail_problem(fmt, data[-TAIL_BYTES:])
