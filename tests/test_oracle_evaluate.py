"""Which weights `evaluate` reads, recorded where it reads them (no eval runs)."""

import ml_collections
import pytest

from big_vit_lite import evaluate
from big_vit_lite.models import loading


class _Read(Exception):
  """Stops evaluate at its checkpoint read: what is checked is what it asked for."""


def test_use_ema_reads_the_runs_ema_and_otherwise_its_params(
    monkeypatch, tmp_path
):
  """Guards: `--config.use_ema=True` not reaching the checkpoint read
  (evaluate scores the raw params and reports them as the EMA's), or the
  EMA read when it is off. Oracle: the documented contract (DESIGN.md:
  evals take use_ema=True; the checkpoint item `ema`), on the key handed to
  loading.load_model, recorded there."""
  asked = []

  def load_model(src, key, *unused_args, **unused_kw):
    asked.append((src, key))
    raise _Read()

  monkeypatch.setattr(loading, "load_model", load_model)
  src = str(tmp_path / "run")
  evals = dict(
      val=dict(
          type="classification",
          data=dict(name="imagefolder", data_dir=str(tmp_path), split="test"),
          pp="decode|value_range(-1, 1)",
      )
  )
  for use_ema in (True, False, None):
    config = dict(model_init=src, evals=evals)
    if use_ema is not None:
      config["use_ema"] = use_ema
    with pytest.raises(_Read):
      evaluate.evaluate(ml_collections.ConfigDict(config), str(tmp_path / "o"))
  assert asked == [(src, "ema"), (src, "params"), (src, "params")]
