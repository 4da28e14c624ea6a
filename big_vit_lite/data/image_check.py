"""Cheap validity checks of encoded images, so bad files are skipped up front.

A decode error inside tf.data would stop a run, and dropping examples there
would break exact resume; so sources check images before they enter the
pipeline: Pillow parses the header, and JPEGs and GIFs must be complete (an
end marker after the JPEG's scan, the GIF's trailer), which catches
truncated downloads and copies. PNGs are read whole to check their chunks'
CRCs (tf fails on a damaged one; a damaged JPEG mostly decodes, with a
warning).

tf decodes JPEG, PNG and GIF right; the other formats are "convert" (Pillow
reads them): tf has no decoder for TIFF, ..., misreads palette and RLE BMPs
and fails on 1-, 4- and 16-bit ones, and decodes no animated or transparent
WebP to RGB.
"""

import io
import os

from PIL import Image

TAIL_BYTES = 64
TF_FORMATS = ("JPEG", "PNG", "GIF")  # tf.io.decode_image reads these right


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


def check(fileobj):
  """(status, reason) of an encoded image: "ok", "convert" (tf cannot decode it right: read
  it with Pillow) or "bad" (unreadable or truncated). Reads the header and the tail only.
  """
  try:
    with Image.open(fileobj) as im:
      fmt, size = im.format, im.size
      if fmt == "PNG":
        im.verify()  # every chunk's CRC: tf stops on a damaged PNG
  except Exception as e:  # pylint: disable=broad-except
    return "bad", f"{type(e).__name__}: {e}"
  if min(size) < 1:
    return "bad", f"empty image {size}"
  fileobj.seek(max(0, fileobj.seek(0, os.SEEK_END) - TAIL_BYTES))
  tail = fileobj.read()
  if fmt == "JPEG" and b"\xff\xd9" not in tail and not _jpeg_complete(fileobj):
    return "bad", "truncated JPEG (no end-of-image marker)"
  if fmt == "GIF" and not tail.rstrip(b"\x00").endswith(b";"):
    return "bad", "truncated GIF (no trailer)"
  if fmt not in TF_FORMATS:
    return "convert", f"{fmt}, which tf does not decode right"
  return "ok", ""


def bytes_problem(data):
  """Reason why encoded image bytes are unusable as they are (tf cannot read them right), or
  None if they look fine."""
  status, reason = check(io.BytesIO(data))
  return None if status == "ok" else reason
