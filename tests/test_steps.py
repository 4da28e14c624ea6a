"""Our orbax training checkpoints as model sources (models/steps.py).

Loading and exporting a workdir or step dir, a workdir that training writes meanwhile, and the
grid and image size that a workdir's saved config says.
"""

import json

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from big_vit_lite.trainer import checkpoint
from big_vit_lite import evaluate
from big_vit_lite import export
from big_vit_lite.evaluators import presets
from big_vit_lite.models import layout
from big_vit_lite.models import vit

import checks
import evaluator_fixtures


@pytest.mark.timeout(120)
def test_load_and_export_from_training_checkpoint(tmp_path):
  checkpoint = pytest.importorskip("big_vit_lite.trainer.checkpoint")
  # The trainer may train with scan: load/export convert it.
  params = checks.vit_params(boxed=True, scan=True)
  ckpt = checkpoint.Checkpointer(str(tmp_path / "work"), async_save=False)
  ckpt.save(3, {"params": nn.meta.unbox(params)}, {"epoch": 0})
  ckpt.close()
  # newest step
  loop = vit.load(checks.vit_params(boxed=True, seed=1), tmp_path / "work")
  want = layout.unstack_layers(layout.to_numpy_flat(params))
  assert set(layout.to_numpy_flat(loop)) == set(want)
  for k, v in layout.to_numpy_flat(loop).items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)
  summary = export.export(
      str(tmp_path / "work" / "checkpoints" / "3"),
      str(tmp_path / "m.npz"),
      "npz",
  )
  assert summary["format"] == "npz"
  checks.assert_same_params(
      vit.load(checks.vit_params(boxed=True, seed=2), tmp_path / "m.npz"), loop
  )


def test_evaluate_reads_a_workdir_that_training_writes_meanwhile(
    tmp_path, monkeypatch
):
  # Training saves step 2 (here: diverged, NaN) while evaluate runs on step 1.
  # evaluate read step 1's params, then resolved the workdir again for the step
  # number and read it again for the model: step 2's NaNs were evaluated.
  root = evaluator_fixtures.write_image_folder(
      str(tmp_path / "shapes3"), n_train=2, n_test=4
  )
  kw = dict(evaluator_fixtures.TINY_VIT, num_classes=3)
  params = checks.vit_params(hw=(28, 28), channels=1, **kw)
  work = str(tmp_path / "work")
  ckpt = checkpoint.Checkpointer(work, async_save=False)
  ckpt.save(1, {"params": params}, {})
  load_params = checkpoint.load_params

  def load_while_training(src, *args, **kwargs):
    out = load_params(src, *args, **kwargs)
    if 2 not in ckpt.all_steps():
      ckpt.save(
          2,
          {"params": jax.tree.map(lambda a: np.full_like(a, np.nan), params)},
          {},
      )
    return out

  monkeypatch.setattr(checkpoint, "load_params", load_while_training)
  config = ml_collections.ConfigDict(
      dict(
          model_init=work,
          evals=dict(
              val=dict(
                  type="classification",
                  data=dict(name="imagefolder", data_dir=root, split="test"),
                  pp=presets.eval_pp(28, channels=1),
                  batch_size=8,
              )
          ),
      )
  )
  results = evaluate.evaluate(config, str(tmp_path / "eval"))
  ckpt.close()
  assert np.isfinite(results["val"]["loss"])
  with open(tmp_path / "eval" / "metrics.jsonl") as f:
    assert json.loads(f.readline())["step"] == 1


def _posemb_grid(params):
  return layout.to_numpy_flat(params)[checks.POSEMB][:, 1:]


def test_posemb_of_a_workdir_is_resampled_from_the_grid_it_was_trained_on(
    tmp_path, caplog
):
  # 6x6 and 4x9 grids both have 36 tokens: loading one into the other
  # (fine-tuning a square run on 16x36 images, or the reverse) kept the rows as
  # they were, laid out on the wrong grid. A training workdir's pp says its
  # grid.
  def workdir(name, hw):
    params = checks.vit_params(hw=hw)
    ckpt = checkpoint.Checkpointer(str(tmp_path / name), async_save=False)
    ckpt.save(
        1,
        {"params": params},
        {},
        ml_collections.ConfigDict(
            dict(
                input=dict(
                    pp=f"decode(3)|resize({hw})|value_range(-1, 1)|keep('image', 'label')"
                )
            )
        ),
    )
    ckpt.close()
    return params

  square = _posemb_grid(workdir("square", (24, 24)))
  got = _posemb_grid(
      vit.load(
          checks.vit_shapes(hw=(16, 36)), tmp_path / "square", grid_hw=(4, 9)
      )
  )
  np.testing.assert_allclose(
      got, checks.posemb_resized(square, (6, 6), (4, 9)), atol=1e-5
  )
  wide = _posemb_grid(workdir("wide", (16, 36)))
  got = _posemb_grid(
      vit.load(
          checks.vit_shapes(hw=(24, 24)), tmp_path / "wide", grid_hw=(6, 6)
      )
  )
  np.testing.assert_allclose(
      got, checks.posemb_resized(wide, (4, 9), (6, 6)), atol=1e-5
  )
  # Same grid: exact.
  got = _posemb_grid(
      vit.load(
          checks.vit_shapes(hw=(16, 36)), tmp_path / "wide", grid_hw=(4, 9)
      )
  )
  np.testing.assert_array_equal(got, wide)
  # An .npz does not say its grid: equal counts keep their rows, with a warning.
  vit.save_npz(checks.vit_params(hw=(16, 36)), tmp_path / "wide.npz")
  with caplog.at_level("WARNING"):
    got = _posemb_grid(
        vit.load(
            checks.vit_shapes(hw=(16, 36)),
            tmp_path / "wide.npz",
            grid_hw=(4, 9),
        )
    )
  np.testing.assert_array_equal(got, wide)
  assert "36 posemb rows for the model's 4x9 grid as they are" in caplog.text


def test_timm_export_of_a_sincos_workdir_takes_the_trained_size(tmp_path):
  # A sincos2d model has no posemb param to size timm's pos_embed by: a training
  # workdir's pp says the size, where --res was demanded.
  params = checks.vit_params(hw=(24, 24), posemb="sincos2d", pool_type="gap")
  ckpt = checkpoint.Checkpointer(str(tmp_path / "work"), async_save=False)
  ckpt.save(
      3,
      {"params": params},
      {},
      ml_collections.ConfigDict(
          dict(
              input=dict(
                  pp="decode(3)|resize(24)|value_range(-1, 1)|keep('image', 'label')"
              )
          )
      ),
  )
  ckpt.close()
  summary = export.export(
      str(tmp_path / "work"), str(tmp_path / "s.safetensors")
  )
  assert summary["timm_kwargs"]["img_size"] == 24
  images = jax.random.uniform(
      jax.random.key(1), (2, 24, 24, 3), minval=-1, maxval=1
  )
  back = vit.load(
      checks.vit_shapes(hw=(24, 24), pool_type="gap"),
      tmp_path / "s.safetensors",
  )
  np.testing.assert_allclose(
      jax.jit(checks.tiny_vit(pool_type="gap").apply)(
          {"params": nn.meta.unbox(back)}, images
      )[0],
      jax.jit(checks.tiny_vit(pool_type="gap", posemb="sincos2d").apply)(
          {"params": params}, images
      )[0],
      atol=1e-6,
  )
