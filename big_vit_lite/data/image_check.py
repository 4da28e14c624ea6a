"""Cheap validity checks of encoded images, so bad files are skipped up front.

A decode error inside tf.data would stop a run, and dropping examples there
would break exact resume; so sources check images before they enter the
pipeline: Pillow parses the header, and files must be complete (a JPEG's
end marker after its scan, a GIF's trailer, a BMP's pixel rows), which
catches truncated downloads and copies. PNGs are read whole to check their
chunks' CRCs (tf fails on a damaged one; a damaged JPEG mostly decodes,
with a warning).

tf decodes only plain BMPs right: 24/32-bit or 8-bit grey, uncompressed,
of exactly the announced size. It reads an 8-bit palette image's indices
as grey (wrong colours, no error), ignores RLE compression, and fails on
1-, 4- and 16-bit images and on files with trailing bytes. It decodes a
WebP only to its own channel count (an RGBA one not to RGB), and an animated
WebP not at all (decode(0) corrupts memory and aborts the process). Those,
and the formats tf has no decoder for (TIFF, ...), are "convert": Pillow
reads them.
"""
import io
import os

from PIL import Image

TAIL_BYTES = 64
_HEAD_BYTES = 64
TF_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "WEBP")  # tf.io.decode_image reads these


def tail_problem(fmt, tail):
  """Reason why a file of format `fmt` ending in `tail` may be truncated, or None.

  (PNGs are checked whole by Pillow's verify, which also accepts bytes after IEND.)
  """
  if fmt == "JPEG" and b"\xff\xd9" not in tail:
    return "truncated JPEG (no end-of-image marker)"
  if fmt == "GIF" and not tail.rstrip(b"\x00").endswith(b";"):
    return "truncated GIF (no trailer)"
  return None


def _jpeg_complete(fileobj):
  """True when an end-of-image marker follows the image's first scan.

  For JPEGs without one in their last bytes: cameras and phones append data
  after it (tf reads those). A truncated file has none after the scan: scan
  data never holds FF D9, and an EXIF thumbnail's comes before the scan.
  """
  fileobj.seek(2)
  while True:
    marker = fileobj.read(4)
    if len(marker) < 4 or marker[0] != 0xFF:
      return False
    if marker[1] == 0xFF:  # fill byte
      fileobj.seek(-3, os.SEEK_CUR)
    elif marker[1] == 0xDA:  # start of scan
      return fileobj.read().find(b"\xff\xd9") >= 0
    else:
      fileobj.seek(int.from_bytes(marker[2:], "big") - 2, os.SEEK_CUR)


def _le(data, start, size):
  return int.from_bytes(data[start:start + size], "little", signed=True)


def _plain_bmp(head, length, mode):
  """True when tf's BMP decoder reads this file right (see the module docstring)."""
  if len(head) < 34 or _le(head, 14, 4) < 40:  # OS/2 headers put the size elsewhere
    return False
  width, height, bpp, compression = _le(head, 18, 4), _le(head, 22, 4), _le(head, 28, 2), \
      _le(head, 30, 4)
  if compression != 0 or not (bpp in (24, 32) or (bpp == 8 and mode == "L")):
    return False
  row = (bpp * width + 31) // 32 * 4
  return length == _le(head, 10, 4) + row * abs(height)


def check(fileobj):
  """(status, reason) of an encoded image: "ok", "convert" (tf cannot decode it right: read
  it with Pillow) or "bad" (unreadable or truncated). Reads the header and the tail only."""
  try:
    with Image.open(fileobj) as im:
      fmt, size, mode = im.format, im.size, im.mode
      animated = fmt == "WEBP" and getattr(im, "n_frames", 1) > 1  # (a GIF's would scan it)
      if fmt == "PNG":
        im.verify()  # every chunk's CRC: tf stops on a damaged PNG
  except Exception as e:  # pylint: disable=broad-except
    return "bad", f"{type(e).__name__}: {e}"
  if min(size) < 1:
    return "bad", f"empty image {size}"
  fileobj.seek(0)
  head = fileobj.read(_HEAD_BYTES)
  length = fileobj.seek(0, os.SEEK_END)
  fileobj.seek(max(0, length - TAIL_BYTES))
  problem = tail_problem(fmt, fileobj.read())
  if problem and not (fmt == "JPEG" and _jpeg_complete(fileobj)):
    return "bad", problem
  if fmt not in TF_FORMATS:
    return "convert", f"{fmt}, which tf cannot decode"
  if fmt == "BMP" and not _plain_bmp(head, length, mode):
    return "convert", f"a BMP ({mode}) that tf does not decode right"
  if fmt == "WEBP" and (animated or "A" in mode):
    return "convert", "an animated or transparent WebP, which tf cannot decode to RGB"
  return "ok", ""


def bytes_problem(data):
  """Reason why encoded image bytes are unusable as they are (tf cannot read them right), or
  None if they look fine."""
  status, reason = check(io.BytesIO(data))
  return None if status == "ok" else reason
