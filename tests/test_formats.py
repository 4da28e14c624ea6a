"""The one load/save entry over every checkpoint format (models/formats.py).

Damaged files of each format are one-line errors; the export CLI goes through it.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from big_vit_lite import export
from big_vit_lite.models import vit
from big_vit_lite.models import loading

import checks


def test_damaged_checkpoint_files_are_one_line_errors(tmp_path):
  # Each was a raw BadZipFile / EOFError / TypeError / SafetensorError
  # traceback.
  vit.save_npz(checks.vit_params(), tmp_path / "good.npz")
  data = (tmp_path / "good.npz").read_bytes()
  np.save(tmp_path / "a.npy", np.zeros(3))
  files = {
      "truncated.npz": (data[: len(data) // 2], "damaged or truncated"),
      "empty.npz": (b"", "not an .npz (zip) file"),
      "array.npz": (
          (tmp_path / "a.npy").read_bytes(),
          "not an .npz (zip) file",
      ),
      "text.npz": (b"no zip here\n", "not an .npz (zip) file"),
      "empty.safetensors": (b"", "not a readable safetensors file"),
      "bad.safetensors": (
          b"\x10" + b"\x00" * 7 + b"{oops",
          "not a readable safetensors file",
      ),
  }
  abstract = checks.vit_shapes()
  for name, (content, message) in files.items():
    path = tmp_path / name
    path.write_bytes(content)
    for what, fn in (
        ("vit.load", lambda: vit.load(abstract, path)),
        ("export", lambda: export.export(str(path), str(tmp_path / "o.npz"))),
        ("evaluate", lambda: loading.read_source(str(path))),
    ):
      with pytest.raises(ValueError, match=re.escape(message)) as e:
        fn()
      assert "\n" not in str(e.value) and name in str(e.value), (
          what,
          str(e.value),
      )


@pytest.mark.timeout(180)
def test_export_cli(tmp_path):
  params = checks.vit_params(boxed=True)
  vit.save_npz(params, tmp_path / "src.npz")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run(
      [
          sys.executable,
          "-m",
          "big_vit_lite.export",
          f"--src={tmp_path / 'src.npz'}",
          f"--out={tmp_path / 'm.safetensors'}",
          "--format=timm",
      ],
      capture_output=True,
      text=True,
      env=env,
      timeout=170,
  )
  assert run.returncode == 0, run.stderr
  assert '"global_pool": "token"' in run.stdout
  fresh = checks.vit_params(boxed=True, seed=1)
  checks.assert_same_params(vit.load(fresh, tmp_path / "m.safetensors"), params)
  # In process for the npz format and the error path (saves a second interpreter
  # start).
  export.export(str(tmp_path / "src.npz"), str(tmp_path / "copy.npz"), "npz")
  checks.assert_same_params(vit.load(fresh, tmp_path / "copy.npz"), params)
  bad = subprocess.run(
      [
          sys.executable,
          "-m",
          "big_vit_lite.export",
          "--src=/nonexistent.npz",
          f"--out={tmp_path / 'x.npz'}",
      ],
      capture_output=True,
      text=True,
      env=env,
      timeout=170,
  )
  assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0
  assert "does not exist" in bad.stderr
