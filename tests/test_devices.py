"""The shared device table: jax device_kind strings map to the right chip."""

import types

import pytest

from big_vit_lite.runtime import devices


@pytest.mark.parametrize(
    "kind,name",
    [
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("TPU v4", "TPU v4"),
        ("TPU v5 lite", "TPU v5e"),
        ("TPU v5", "TPU v5p"),
        ("TPU v6 lite", "TPU v6e"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", None),  # not an L4
        ("cpu", None),
    ],
)
def test_lookup(kind, name):
  spec = devices.lookup(kind)
  assert (spec.name if spec else None) == name


def test_datasheet_peak():
  h200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
  assert devices.datasheet_peak(h200, "bfloat16") == 989e12
  # TF32, JAX's default precision
  assert devices.datasheet_peak(h200, "float32") == 494.5e12
  cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
  assert devices.datasheet_peak(cpu) is None
