"""Models, found by name: `config.model_name = "vit"` -> `big_vit_lite.models.vit`.

A model module provides `Model` (a Flax linen module whose `apply(..., train=)`
returns `(logits, out)`), `load(init_params, path, model_cfg, dont_load=())`
and `save_npz(params, path)`. Add a model by adding a module here.
`vit` computes with the hand-written attention, LayerNorm and GELU of `ops`.
Checkpoint formats: `formats` (the load/save entry) over `npz`, `timm` and
`steps` (our orbax training checkpoints); `layout` and `posemb` are shared.
"""
