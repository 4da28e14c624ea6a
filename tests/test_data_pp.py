"""The preprocessing language: parsing, errors, and every op's output."""

import io
import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from big_vit_lite.data import pp

import checks

RNG = np.random.default_rng(0)
IMG = RNG.integers(0, 256, (40, 60, 3), dtype=np.uint8)


def _encode(img, fmt, **kw):
  buf = io.BytesIO()
  Image.fromarray(img).save(buf, fmt, **kw)
  return buf.getvalue()


def run(pp_string, seed=0, **data):
  fn = pp.get_preprocess_fn(pp_string)
  example = {k: tf.constant(v) for k, v in data.items()}
  example["_rng"] = tf.constant([seed, 7], tf.int64)
  return {k: v.numpy() for k, v in fn(example).items()}


def test_full_imagenet_style_string():
  out = run(
      "decode|inception_crop(32)|flip_lr|value_range(-1, 1)|"
      "onehot(10, key='label', key_result='labels')|keep('image', 'labels')",
      image=_encode(IMG, "JPEG"),
      label=3,
  )
  assert set(out) == {"image", "labels", "_rng"}
  assert out["image"].shape == (32, 32, 3) and out["image"].dtype == np.float32
  assert -1 <= out["image"].min() and out["image"].max() <= 1
  np.testing.assert_array_equal(out["labels"], np.eye(10)[3])


@pytest.mark.parametrize(
    "bad, words",
    [
        ("decode|nosuchop(3)", ["nosuchop", "known ops"]),
        ("resize(1, 2, 3, 4, 5, 6)", ["resize", "bad arguments"]),
        ("value_range(x)", ["value_range(x)", "literals"]),
        ("decode(", ["decode(", "syntax"]),
        ("onehot(10, colour='red')", ["onehot", "colour"]),
        ("", ["non-empty"]),
        ("decod|value_range(-1, 1)", ["did you mean 'decode'"]),
        ("decode,value_range(-1, 1)", ["separate ops with '|'"]),
    ],
)
def test_bad_pp_strings_are_one_line_errors_naming_the_op(bad, words):
  with pytest.raises(ValueError) as e:
    pp.get_preprocess_fn(bad)
  msg = str(e.value)
  assert "\n" not in msg
  for w in words:
    assert w in msg


@pytest.mark.parametrize(
    "fmt, mode, channels",
    [
        ("JPEG", "RGB", 3),
        ("PNG", "RGB", 3),
        ("PNG", "L", 3),
        ("JPEG", "CMYK", 3),
        ("PNG", "RGBA", 3),
        ("PNG", "L", 1),
        # tf cannot decode these to that channel count itself (was a mid-run crash):
        ("GIF", "L", 1),
        ("WEBP", "RGB", 1),
        ("BMP", "RGB", 1),
        ("JPEG", "RGB", 4),
    ],
)
def test_decode_formats_and_channels(fmt, mode, channels):
  raw = (
      _encode(np.asarray(Image.fromarray(IMG).convert(mode)), fmt)
      if mode != "CMYK"
      else _encode_cmyk(IMG)
  )
  out = run(f"decode(channels={channels})", image=raw)
  assert (
      out["image"].shape == (40, 60, channels)
      and out["image"].dtype == np.uint8
  )
  if fmt == "PNG" and mode == "RGB":
    np.testing.assert_array_equal(out["image"], IMG)


def _encode_cmyk(img):
  buf = io.BytesIO()
  Image.fromarray(img).convert("CMYK").save(buf, "JPEG", quality=95)
  return buf.getvalue()


def test_decode_passes_through_decoded_grey_and_to_rgb():
  grey = IMG[..., :1]
  out = run("decode", image=grey)
  assert out["image"].shape == (40, 60, 3)
  np.testing.assert_array_equal(out["image"][..., 2], grey[..., 0])
  out = run("to_rgb", image=grey)
  assert out["image"].shape == (40, 60, 3)
  out = run("to_rgb", image=np.concatenate([IMG, IMG[..., :1]], -1))
  np.testing.assert_array_equal(out["image"], IMG)


@pytest.mark.parametrize(
    "op, shape",
    [
        ("resize(16)", (16, 16, 3)),
        ("resize((10, 20))", (10, 20, 3)),
        ("resize_small(20)", (20, 30, 3)),
        ("central_crop(24)", (24, 24, 3)),
        ("central_crop((10, 50))", (10, 50, 3)),
        ("random_crop(12)", (12, 12, 3)),
        ("inception_crop(8)", (8, 8, 3)),
        ("flip_lr", (40, 60, 3)),
        ("pad(2)", (44, 64, 3)),
        ("pad((1, 3))", (42, 66, 3)),
        ("randaug(2, 10)", (40, 60, 3)),
    ],
)
def test_image_op_shapes_keep_uint8(op, shape):
  out = run(op, image=IMG)
  assert out["image"].shape == shape and out["image"].dtype == np.uint8


def test_pad_then_random_crop_translates():
  out = run("pad(2, value=9)", image=IMG)["image"]
  np.testing.assert_array_equal(out[2:-2, 2:-2], IMG)
  assert (out[:2] == 9).all() and (out[:, -2:] == 9).all()


def test_central_crop_is_central_and_resize_keeps_constant_images():
  out = run("central_crop((20, 30))", image=IMG)
  np.testing.assert_array_equal(out["image"], IMG[10:30, 15:45])
  flat = np.full((40, 60, 3), 77, np.uint8)
  assert (run("resize(13)", image=flat)["image"] == 77).all()


def test_fused_decode_and_inception_crop_jpeg_and_png():
  for fmt in ("JPEG", "PNG"):
    out = run("decode_jpeg_and_inception_crop(24)", image=_encode(IMG, fmt))
    assert out["image"].shape == (24, 24, 3) and out["image"].dtype == np.uint8


def test_value_range_and_standardize():
  out = run("value_range(0, 1)", image=np.array([[[0, 255, 51]]], np.uint8))
  np.testing.assert_allclose(out["image"], [[[0, 1, 0.2]]], atol=1e-6)
  out = run(
      "value_range(-1, 1, in_min=0, in_max=10, clip_values=True)",
      image=np.array([-5.0, 5.0, 20.0], np.float32),
  )
  np.testing.assert_allclose(out["image"], [-1, 0, 1])
  out = run(
      "standardize(mean=(1, 2), std=(2, 4))",
      image=np.array([[5.0, 6.0]], np.float32),
  )
  np.testing.assert_allclose(out["image"], [[2, 1]])


def test_onehot_label_smoothing_and_khot():
  out = run("onehot(4, on=0.9, off=0.1, key_result='labels')", label=2)
  np.testing.assert_allclose(out["labels"], [0.1, 0.1, 0.9, 0.1])
  out = run("onehot(5)", label=np.array([0, 3]))
  np.testing.assert_array_equal(out["label"], [1, 0, 0, 1, 0])


def test_keep_copy_rename_drop():
  out = run(
      "copy('label', 'y')|rename('y', 'z')|drop('extra')|keep('z')",
      label=1,
      extra=2,
  )
  assert set(out) == {"z", "_rng"} and out["z"] == 1
  with pytest.raises(ValueError, match="missing|not in"):
    run("keep('nope')", label=1)


def test_random_ops_are_stateless_functions_of_the_seed():
  s = "inception_crop(16)|flip_lr|random_crop(12)|randaug(2, 15)"
  a, b, c = (
      run(s, seed=1, image=IMG),
      run(s, seed=1, image=IMG),
      run(s, seed=2, image=IMG),
  )
  np.testing.assert_array_equal(a["image"], b["image"])
  assert not np.array_equal(a["image"], c["image"])
  # Flip: over many seeds, both outcomes occur, each an exact mirror or the
  # identity.
  outs = [run("flip_lr", seed=i, image=IMG)["image"] for i in range(16)]
  flipped = [np.array_equal(o, IMG[:, ::-1]) for o in outs]
  assert all(f or np.array_equal(o, IMG) for f, o in zip(flipped, outs))
  assert 0 < sum(flipped) < 16


def test_random_op_without_seed_says_how_to_fix():
  fn = pp.get_preprocess_fn("flip_lr")
  with pytest.raises(ValueError, match="ensure_rng"):
    fn({"image": tf.constant(IMG)})
  out = fn(pp.ensure_rng({"image": tf.constant(IMG)}))
  assert out["image"].shape == IMG.shape


def test_randaug_changes_images():
  outs = [run("randaug(2, 10)", seed=i, image=IMG)["image"] for i in range(6)]
  assert sum(not np.array_equal(o, IMG) for o in outs) >= 4


# big_vision parity: its pp strings run here and give its tensors (values
# computed with its definitions, written out as plain tf calls).


def _bv_resize(img, hw, method="bilinear", antialias=False):
  out = tf.image.resize(img, hw, method=method, antialias=antialias)
  return tf.cast(tf.clip_by_value(out, 0, 255), tf.uint8).numpy()  # truncates


def test_big_vision_eval_string_gives_big_vision_tensors():
  img = RNG.integers(0, 256, (45, 67, 3), dtype=np.uint8)
  out = run(
      "decode|resize_small(20)|central_crop(16)|value_range(-1,1)",
      image=_encode(img, "PNG"),
  )["image"]
  small = _bv_resize(img, (20, 30), "area")  # 67 * 20 / 45 = 29.8 -> 30
  want = small[2:18, 7:23] / 255 * 2 - 1
  # was up to 2/255 off: resizes rounded
  np.testing.assert_allclose(out, want, atol=1e-6)


@pytest.mark.parametrize(
    "op, method, antialias",
    [
        ("resize((20, 30))", "bilinear", False),
        ("resize((20, 30), 'bicubic')", "bicubic", False),
        ("resize((20, 30), antialias=True)", "bilinear", True),
        ("resize((80, 90), 'lanczos3')", "lanczos3", False),
    ],
)
def test_resize_truncates_like_big_vision(op, method, antialias):
  hw = (20, 30) if "20" in op else (80, 90)
  np.testing.assert_array_equal(
      run(op, image=IMG)["image"], _bv_resize(IMG, hw, method, antialias)
  )


def test_resize_long_and_central_crop_without_size():
  # area, antialias=True by default
  out = run("resize_long(30)", image=IMG)["image"]
  np.testing.assert_array_equal(out, _bv_resize(IMG, (20, 30), "area", True))
  np.testing.assert_array_equal(
      run("central_crop", image=IMG)["image"], IMG[:, 10:50]
  )
  np.testing.assert_array_equal(
      run("central_crop()", image=IMG[:35])["image"], IMG[:35, 12:47]
  )


def test_inception_crop_takes_big_vision_positional_args():
  a = run("inception_crop(8, 5, 100, 'nearest', True)", image=IMG)["image"]
  b = run(
      "inception_crop(8, area_min=5, method='nearest', antialias=True)",
      image=IMG,
  )["image"]
  np.testing.assert_array_equal(a, b)


def test_vgg_value_range_and_per_channel_value_range():
  out = run("vgg_value_range", image=np.full((1, 1, 3), 255, np.uint8))["image"]
  np.testing.assert_allclose(
      out[0, 0],
      (1 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225]),
      rtol=1e-6,
  )
  out = run(
      "value_range(0, 1, in_min=[0, 10, 0], in_max=[255, 20, 2])",
      image=np.array([[[51, 15, 1]]], np.uint8),
  )["image"]
  np.testing.assert_allclose(out, [[[0.2, 0.5, 0.5]]], rtol=1e-6)
  # numpy says it in one line
  with pytest.raises(ValueError, match="broadcast"):
    pp.get_preprocess_fn("value_range(0, 1, in_min=[0, 0], in_max=[1, 2, 3])")


def test_inkey_outkey():
  out = run(
      "value_range(outkey='prof')|resize(4, inkey='prof', outkey='small')",
      image=IMG,
  )
  np.testing.assert_array_equal(out["image"], IMG)  # the input stays as it was
  np.testing.assert_allclose(out["prof"], IMG / 127.5 - 1, atol=1e-6)
  assert out["small"].shape == (4, 4, 3) and out["small"].dtype == np.float32
  out = run(
      "flip_lr(inkey='image', outkey='image', key='x')", x=IMG, image=IMG[:1]
  )
  assert out["image"].shape == (1, 60, 3)  # key overrides both
  with pytest.raises(ValueError, match="bad arguments"):
    pp.get_preprocess_fn("onehot(10, inkey='label')")


def test_decode_precise_and_grey_from_colour_jpeg():
  raw = _encode(IMG, "JPEG")
  out = run("decode(precise=True)", image=raw)["image"]
  np.testing.assert_array_equal(
      out, tf.io.decode_jpeg(raw, dct_method="INTEGER_ACCURATE")
  )
  assert not np.array_equal(out, run("decode", image=raw)["image"])
  # libjpeg's own grey, as tf.io.decode_image(channels=1) (was RGB -> grey, off
  # by up to 3).
  big = np.asarray(Image.fromarray(IMG).resize((120, 80)))
  raw = _encode(big, "JPEG", quality=95)
  np.testing.assert_array_equal(
      run("decode(1)", image=raw)["image"], tf.io.decode_image(raw, channels=1)
  )


@pytest.mark.parametrize(
    "pp_string,hw",
    [
        (
            "decode|inception_crop(224)|flip_lr|value_range(-1, 1)|onehot(10)",
            (224, 224),
        ),
        ("decode|resize_small(256)|central_crop(224)", (224, 224)),
        ("decode|resize((28, 63))", (28, 63)),
        ("decode|pad(2)|random_crop(28)", (28, 28)),
        ("decode|resize(40)|central_crop()", (40, 40)),
        (
            "resize(28)|value_range(0, 1)",
            (28, 28),
        ),  # tfds images decoded upstream
        # A distillation pp: the teacher's copy is resized after the student's
        # image.
        (
            "decode|resize(64)|copy('image', 'prof')|resize(32, key='prof')",
            (64, 64),
        ),
        ("decode|resize(64)|resize(32, outkey='prof')", (64, 64)),
        ("decode|resize_small(256)", None),  # depends on each image
        ("decode|keep('texts')", None),
    ],
)
def test_output_hw_follows_the_image_key(pp_string, hw):
  assert pp.output_hw(pp_string) == hw


_one_line_error = checks.one_line_error


def test_grey_images_without_a_channel_axis_decode_to_what_was_asked():
  # e.g. a tfds Tensor feature
  grey = RNG.integers(0, 256, (5, 7), dtype=np.uint8)
  out = run("decode", image=grey)["image"]  # was [5, 3]: the first 3 columns
  assert out.shape == (5, 7, 3)
  np.testing.assert_array_equal(out[..., 1], grey)
  assert run("decode(1)", image=grey)["image"].shape == (5, 7, 1)
  assert run("to_rgb", image=grey)["image"].shape == (5, 7, 3)
  # flip_lr on [H, W] flipped it upside down.
  _one_line_error(
      lambda: run("flip_lr", image=grey), "flip_lr", "[H, W, C]", "decode"
  )


def test_decoded_images_get_the_channels_asked_for():
  rgba = RNG.integers(0, 256, (5, 7, 4), dtype=np.uint8)
  # was 4 channels
  assert run("decode(1)", image=rgba)["image"].shape == (5, 7, 1)
  rgb = rgba[..., :3]
  out = run("decode(4)", image=rgb)["image"]  # was 3 channels
  np.testing.assert_array_equal(out[..., :3], rgb)
  assert (out[..., 3] == 255).all()
  np.testing.assert_array_equal(
      run("decode(1)", image=rgba[..., :2])["image"], rgba[..., :1]
  )


def test_standardize_takes_one_value_for_every_channel():
  out = run(
      "decode(1)|standardize(127.5, 127.5)",
      image=tf.io.encode_png(
          # was "'int' has no len()"
          np.full((2, 2, 1), 255, np.uint8)
      ).numpy(),
  )["image"]
  assert out.shape == (2, 2, 1) and np.allclose(out, 1)


def test_images_with_a_side_under_3_pixels_do_not_stop_resize_long_or_randaug():
  banner = RNG.integers(0, 256, (1, 50, 3), dtype=np.uint8)
  # was 0 rows: error
  assert run("resize_long(4)", image=banner)["image"].shape == (1, 4, 3)
  fn = pp.get_preprocess_fn("randaug(4, 10)")
  # 80 draws of 16 ops: sharpness (its 3x3 filter failed) among them
  for seed in range(20):
    example = {
        "image": tf.constant(banner[:, :2]),
        "_rng": tf.constant([seed, 0], tf.int64),
    }
    assert fn(example)["image"].shape == (1, 2, 3)


@pytest.mark.parametrize(
    "pp_string, image, words",
    [
        ("resize(4)", b"bytes", ["resize got encoded image bytes", "'image'"]),
        (
            "value_range(inkey='prof')",
            b"bytes",
            ["value_range got encoded image bytes under 'prof'", "decode"],
        ),
        ("vgg_value_range", b"bytes", ["got encoded image bytes", "decode"]),
        (
            "decode_jpeg_and_inception_crop(8, key='x')",
            IMG,
            ["needs the encoded image bytes under 'x'", "remove the 'decode'"],
        ),
        (
            "randaug",
            IMG.astype(np.float32),
            ["randaug needs uint8 RGB images", "float32"],
        ),
        ("pad(2, inkey='prof')", IMG[..., 0], ["pad needs an image [H, W, C]"]),
    ],
)
def test_image_op_input_checks_name_the_op_and_the_key_read(
    pp_string, image, words
):
  # Also true of the ops before the key-handling decorator (issue 35): the
  # messages did not change, and they name the key the op reads (inkey).
  _one_line_error(
      lambda: run(pp_string, image=image, prof=image, x=image), *words
  )


def test_register_image_op_gives_key_handling_a_check_and_a_seed():
  # Plain image -> image functions; the decorator does the key plumbing.
  checked, seeds = [], []

  def check(image, key, name):
    checked.append((key, name))
    if image.dtype == tf.string:
      raise ValueError(f"no bytes under {key!r}")

  @pp.register_image_op("_test_scale", check=check)
  def get_scale(factor):
    return lambda image: image * factor

  @pp.register_image_op("_test_noise", random=True)
  def get_noise():
    def noise(image, seed):
      seeds.append(seed)
      return image + tf.cast(seed[1], image.dtype)

    return noise

  x, y = np.int64([1, 2]), np.int64([10, 20])
  try:
    out = run("_test_scale(3)", image=x, y=y)
    np.testing.assert_array_equal(out["image"], [3, 6])
    out = run("_test_scale(3, outkey='z')", image=x)
    np.testing.assert_array_equal(out["image"], x)  # the input stays
    np.testing.assert_array_equal(out["z"], [3, 6])
    out = run("_test_scale(3, inkey='y')", image=x, y=y)
    np.testing.assert_array_equal(out["image"], [30, 60])
    np.testing.assert_array_equal(out["y"], y)
    out = run(
        "_test_scale(3, key='y', inkey='image', outkey='z')", image=x, y=y
    )
    assert "z" not in out  # key overrides both
    np.testing.assert_array_equal(out["y"], [30, 60])
    np.testing.assert_array_equal(out["image"], x)
    assert checked == [
        ("image", "_test_scale"),
        ("image", "_test_scale"),
        ("y", "_test_scale"),
        ("y", "_test_scale"),
    ]
    _one_line_error(
        lambda: run("_test_scale(2, inkey='y')", y=b"raw"),
        "_test_scale(2, inkey='y')",
        "no bytes under 'y'",
    )
    _one_line_error(
        lambda: pp.get_preprocess_fn("_test_scale"), "bad arguments"
    )
    # Two random ops: the example's seed [0, 7], then the advanced [0, 8].
    out = run("_test_noise|_test_noise(outkey='z')", image=x)
    np.testing.assert_array_equal(out["image"], x + 7)
    np.testing.assert_array_equal(out["z"], x + 7 + 8)
    np.testing.assert_array_equal(out["_rng"], [0, 9])
    np.testing.assert_array_equal(np.stack(seeds), [[0, 7], [0, 8]])
  finally:
    for name in ("_test_scale", "_test_noise"):
      pp.registry._OPS.pop(name)  # pylint: disable=protected-access


def test_the_op_written_in_docs_data_md_runs():
  docs = (pathlib.Path(__file__).parents[1] / "docs" / "data.md").read_text()
  (example,) = re.findall(r"```python\n(.*?)```", docs, re.S)
  try:
    exec(example, {})  # pylint: disable=exec-used
    out = run("invert(outkey='inverted')", image=IMG)
    np.testing.assert_array_equal(out["inverted"], 255 - IMG)
    np.testing.assert_array_equal(out["image"], IMG)
  finally:
    pp.registry._OPS.pop("invert", None)  # pylint: disable=protected-access
