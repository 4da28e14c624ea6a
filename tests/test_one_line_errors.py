"""Issue 41's list of tracebacks, silent acceptances and misleading messages: each now one line
saying what was wrong and what to do (or the right behaviour)."""

import json
import os
import pkgutil
import socket
import stat
import subprocess
import sys
import types
import unicodedata

from absl import flags
import jax
import numpy as np
from PIL import Image
import pytest

from big_vit_lite.config import config_loading
from big_vit_lite import export
from big_vit_lite.trainer import transfer
from big_vit_lite.logs import wandb_writer
from big_vit_lite.data import imagefolder
from big_vit_lite.data import sources
from big_vit_lite.evaluators import presets
from big_vit_lite.models import vit

import checks
import timm_reference
import trainer_runs


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
  """wandb "installed" (the check only imports it), no login: no key, an empty netrc."""
  monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
  for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
    monkeypatch.delenv(k, raising=False)
  netrc = tmp_path / "netrc"
  netrc.write_text("")
  monkeypatch.setenv("NETRC", str(netrc))
  return netrc


def test_wandb_online_without_a_login_or_a_server_is_one_line(
    fake_wandb, monkeypatch
):
  """Guards against W&B's default online mode without a login passing the check (it was a
  46-line traceback after the compile) and against an unreachable server doing the same.
  """
  with pytest.raises(
      ValueError, match="needs a login.*wandb login.*mode=offline"
  ):
    wandb_writer.check(dict(project="p"))
  wandb_writer.check(dict(project="p", mode="offline"))  # No login needed.
  monkeypatch.setenv("WANDB_MODE", "offline")
  wandb_writer.check(dict(project="p"))
  monkeypatch.delenv("WANDB_MODE")
  # A login (`wandb login` writes the netrc), and a server: a port that listens.
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  port = server.getsockname()[1]
  fake_wandb.write_text(f"machine 127.0.0.1 login user password {'k' * 40}\n")
  monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
  wandb_writer.check(dict(project="p"))
  server.close()  # Now nothing listens there.
  with pytest.raises(
      ValueError, match="cannot reach http://127.0.0.1.*mode=offline"
  ):
    wandb_writer.check(dict(project="p"))


@pytest.mark.parametrize(
    "field, value", [("drop_path", 1.5), ("drop_path", -0.1), ("dropout", 1.0)]
)
def test_rates_out_of_range_are_refused(field, value):
  """Guards against drop_path=1.5 (or a dropout of 1) being accepted without a word."""
  model = checks.tiny_vit(**{field: value})
  with pytest.raises(
      ValueError, match=rf"{field}={value} is out of range.*\[0, 1\)"
  ):
    jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 16, 16, 3)))


def test_missing_folder_says_so_not_cannot_load_the_config(
    tmp_path, monkeypatch
):
  """Guards against a missing folder= path being reported as "Cannot load the --config file"
  (the config file's os.listdir error read as the file itself missing)."""
  missing = str(tmp_path / "nope")
  with pytest.raises(ValueError, match=f"folder={missing}: no such folder"):
    transfer.num_classes(folder=missing)
  with pytest.raises(ValueError, match="no such folder"):
    presets.folder_datasets(missing)
  fv = flags.FlagValues()
  config_loading.define_config_flag(flag_values=fv)
  argv = ["prog", f"--config=configs/transfer.py:folder={missing}"]
  monkeypatch.setattr(sys, "argv", argv)
  with pytest.raises(SystemExit) as e:
    config_loading.parse_flags(argv, flag_values=fv)
  assert "no such folder" in str(e.value) and "Cannot load" not in str(e.value)


def test_winter21_not_prepared_names_its_own_prepare_command(tmp_path):
  """Guards against the i21k_winter21 hint naming `prepare imagenet21k`, which builds fall11."""
  with pytest.raises(ValueError) as e:
    sources.TfdsSource("imagenet21k/winter21", "full", str(tmp_path))
  assert "big_vit_lite.data.prepare imagenet21k/winter21 " in str(e.value)


def test_num_classes_counts_nfc_and_nfd_spellings_once(tmp_path):
  """Guards against transfer.num_classes counting a class spelt NFC in one split and NFD (a
  macOS copy) in another twice, where the image folder reads one class."""
  nfc, nfd = (unicodedata.normalize(f, "café") for f in ("NFC", "NFD"))
  assert nfc != nfd
  for split, name in (("train", nfc), ("val", nfd), ("train", "dog")):
    os.makedirs(tmp_path / split / name)
    image = np.zeros((4, 4, 3), np.uint8)
    Image.fromarray(image).save(tmp_path / split / name / "a.png")
  # Counted by hand: café and dog.
  assert transfer.num_classes(folder=str(tmp_path)) == 2
  source = imagefolder.ImageFolderSource(str(tmp_path), "train")
  assert len(source.class_names) == 2


@pytest.mark.parametrize(
    "given, meant",
    [
        ("configs/dmeo.py", "configs/demo.py"),
        ("dmeo", "demo"),
        ("configs/transfr.py:runlocal", "configs/transfer.py"),
        ("tests/train_config_tiy.py", "tests/train_config_tiny.py"),
    ],
)
def test_mistyped_config_path_gets_did_you_mean(given, meant, monkeypatch):
  """Guards against a mistyped --config path ending in "Cannot load the --config file" with
  no near name."""
  monkeypatch.chdir(trainer_runs.ROOT)
  with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
    config_loading.resolve_config_path(given)


def test_train_help_is_a_users_help_and_exits_0():
  """Guards against `train --help` exiting 1 with the developer docstring and no --config."""
  r = subprocess.run(
      [sys.executable, "-m", "big_vit_lite.train", "--help"],
      env=trainer_runs.env_for(""),
      cwd=trainer_runs.ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("Pretrain a ViT")
  for flag in ("--config:", "--workdir:", "--check:", "--config.KEY=VALUE"):
    assert flag in r.stdout, flag
  assert "Reads top to bottom" not in r.stdout  # The developer docstring.


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_exported_safetensors_get_the_umasks_mode(tmp_path, umask, mode):
  """Guards against the export being written 0600 (safetensors' own mode) whatever the umask."""
  vit.save_npz(checks.vit_params(), tmp_path / "m.npz")
  old = os.umask(umask)
  try:
    export.export(str(tmp_path / "m.npz"), str(tmp_path / "m.safetensors"))
  finally:
    os.umask(old)
  assert stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode) == mode


@pytest.mark.parametrize(
    "options",
    [
        dict(qk_norm=True, reg_tokens=2, norm="rmsnorm", use_bias=False),
        dict(mlp="swiglu", layerscale_init=0.5),
    ],
)
def test_timm_metadata_builds_the_model_as_kwargs(tmp_path, options):
  """Guards against the stored timm metadata failing as constructor kwargs (mlp_layer as a
  string; the class-choosing "distilled" among them): real timm builds the model from it
  and loads the weights strictly."""
  timm, _ = timm_reference.require()
  import safetensors  # pylint: disable=import-outside-toplevel
  import safetensors.torch  # pylint: disable=import-outside-toplevel

  vit.save_npz(checks.vit_params(**options), tmp_path / "m.npz")
  path = str(tmp_path / "m.safetensors")
  export.export(str(tmp_path / "m.npz"), path)
  with safetensors.safe_open(path, "np") as f:
    meta = f.metadata()
  kwargs = json.loads(meta["timm_kwargs"])
  classes = {
      k: pkgutil.resolve_name(v)
      for k, v in json.loads(meta.get("timm_classes", "{}")).items()
  }
  cls = pkgutil.resolve_name(meta["timm_class"])
  assert cls is timm.models.vision_transformer.VisionTransformer
  if "mlp" not in options:
    assert not classes
  model = cls(**kwargs, **classes)
  model.load_state_dict(safetensors.torch.load_file(path), strict=True)
