"""Device mesh and logical-axis rules -> NamedSharding.

The model names the axes of its params and activations logically ("embed",
"mlp", "heads", "batch", ...; see models/vit.py). The config maps those names
to mesh axes with `sharding_rules`; the same model code then runs
  * data parallel:   mesh [("data", -1)], params replicated;
  * FSDP:            mesh [("fsdp", -1)] (or data x fsdp): params and optimizer
                     state split along "embed" over "fsdp", gathered per layer;
  * tensor parallel: a "model" axis splitting "mlp" and "heads".
A rule maps a logical name to a mesh axis, a tuple of mesh axes, or None
(replicated). Flax assigns each mesh axis at most once per array, in rule
order: so "batch" comes first and takes ("data", "fsdp") for activations,
and "embed" -> "fsdp" then only applies to params (which have no batch axis).
Rules naming mesh axes the mesh does not have are dropped, so one rule set
serves every mesh. `config.sharding_rules` replaces the default rule of each
logical name it names, in that rule's place (so "batch" keeps coming first);
the names it leaves out keep their defaults. A param dim that its mesh axes do
not divide is not split along them: FSDP's axes move to another dim of that
param they divide, the others leave it whole, and a warning says which (fit_spec).
"""

import difflib
import math
import operator

from absl import logging
import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ("data", "fsdp", "model")
BATCH_AXES = ("data", "fsdp")

DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("seq", None),
    ("patch", None),
    ("vocab", None),
    ("classes", None),
    ("layers", None),
)
_LOGICAL_NAMES = tuple(name for name, _ in DEFAULT_RULES)


def parse_mesh(spec):
  """'data:2,fsdp:-1' -> [("data", 2), ("fsdp", -1)]; '' or None -> None."""
  if not spec:
    return None
  pairs = [part.strip().partition(":") for part in str(spec).split(",")]
  try:
    return [(name.strip(), int(size)) for name, _, size in pairs]
  except ValueError:
    raise ValueError(
        f"mesh {spec!r}: expected axis:size pairs, e.g. 'data:-1' or "
        "'data:2,fsdp:-1'"
    ) from None


def make_mesh(mesh_cfg=(("data", -1),), devices=None):
  """[(axis, size), ...] -> jax Mesh with Auto axis types; one size may be -1 (the rest).

  mesh_cfg may also be a string, 'data:2,fsdp:-1'. Auto (not jax.make_mesh's
  default Explicit) axis types: Flax linen's logical constraints only work with Auto.
  """
  if devices is None:
    devices = jax.devices()
  if isinstance(mesh_cfg, str):
    mesh_cfg = parse_mesh(mesh_cfg)
  try:
    mesh_cfg = [
        (name, operator.index(size))
        for name, size in mesh_cfg or (("data", -1),)
    ]
  except (TypeError, ValueError):
    raise ValueError(
        f"mesh {mesh_cfg!r}: use (axis, integer size) pairs, e.g. (('data', -1),) "
        "(one axis needs the trailing comma) or (('data', 2), ('fsdp', -1))."
    ) from None
  names, sizes = [a for a, _ in mesh_cfg], [s for _, s in mesh_cfg]
  if (
      not set(names) <= set(MESH_AXES)
      or len(set(names)) < len(names)
      or sizes.count(-1) > 1
      or any(s < 1 and s != -1 for s in sizes)
  ):
    raise ValueError(
        f"mesh {mesh_cfg}: use distinct axes of {', '.join(MESH_AXES)} (an unknown "
        "or repeated one is not) with positive sizes, or -1 for at most one axis."
    )
  n = len(devices)
  if -1 in sizes:
    sizes[sizes.index(-1)] = n // math.prod(s for s in sizes if s != -1)
  if math.prod(sizes) != n:
    raise ValueError(
        f"mesh {mesh_cfg} does not fit the {n} devices (sizes {sizes}): use -1 for "
        "one axis to take the rest (on CPU, config.num_cpu_devices splits the CPU "
        "into more devices)."
    )
  return jax.make_mesh(
      tuple(sizes),
      tuple(names),
      devices=devices,
      axis_types=(jax.sharding.AxisType.Auto,) * len(names),
  )


def batch_axes(mesh):
  """The mesh axes the batch dimension is split over ("data", "fsdp" where present)."""
  return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def batch_devices(mesh):
  """How many ways the batch is split: the product of the batch axes (1 without a mesh)."""
  if mesh is None:
    return 1
  return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def batch_sharding(mesh):
  return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh):
  return NamedSharding(mesh, P())


def _rule_pairs(rules_cfg):
  """config.sharding_rules (pairs, or a dict) -> [(logical, axes tuple or None)], checked."""
  if hasattr(rules_cfg, "items"):
    rules_cfg = list(rules_cfg.items())
  try:
    pairs = [(logical, axes) for logical, axes in rules_cfg]
  except (TypeError, ValueError):
    raise ValueError(
        f"sharding_rules={rules_cfg!r}: use (logical axis, mesh axes) pairs, e.g. "
        "(('embed', 'fsdp'),) (one rule needs the trailing comma)."
    ) from None
  checked = []
  for logical, axes in pairs:
    if logical not in _LOGICAL_NAMES:
      near = difflib.get_close_matches(str(logical), _LOGICAL_NAMES, n=1)
      hint = ""
      if near:
        hint = f" (did you mean {near[0]!r}?)"
      raise ValueError(
          f"sharding_rules: unknown logical axis {logical!r}{hint}; the model's logical "
          f"axes are {', '.join(_LOGICAL_NAMES)}."
      )
    if isinstance(axes, str):
      axes = (axes,)
    if axes is not None and (
        not isinstance(axes, (list, tuple))
        or len(set(axes)) < len(axes)
        or not set(axes) <= set(MESH_AXES)
    ):
      raise ValueError(
          f"sharding_rules: {logical!r} maps to {axes!r}; use a mesh axis "
          f"({', '.join(MESH_AXES)}), a tuple of distinct ones, or None."
      )
    if axes is not None:
      axes = tuple(axes)
    checked.append((logical, axes))
  return checked


def as_axes(axes) -> tuple:
  """A rule's mesh axes as a tuple: None -> (), "fsdp" -> ("fsdp",)."""
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


def make_rules(rules_cfg, mesh):
  """The default rules with config.sharding_rules over them, restricted to the mesh's axes.

  A config rule replaces the default of the logical name it names, in the default's
  place (rule order decides which logical axis of an array gets a mesh axis first:
  "batch" must stay ahead of "embed", or activations would be split along "embed"
  over fsdp and repeated on every data-parallel device). Several config rules for one
  name are tried in their order. Returns a tuple for Flax.
  """
  named = {}
  if rules_cfg is not None:
    for logical, axes in _rule_pairs(rules_cfg):
      named.setdefault(logical, []).append(axes)
  out = []
  for logical, default in DEFAULT_RULES:
    for axes in named.get(logical, [default]):
      # Only the mesh's axes of size > 1 shard; a single axis is named
      # alone, none is None (replicated).
      used = [a for a in as_axes(axes) if a in mesh.axis_names]
      used = tuple(a for a in used if mesh.shape[a] > 1)
      if len(used) > 1:
        out.append((logical, used))
      elif used:
        out.append((logical, used[0]))
      else:
        out.append((logical, None))
  return tuple(out)


def unbox(tree):
  """nn.Partitioned boxes -> their values, without adding sharding constraints.

  (`nn.meta.unbox` constrains each value to its logical sharding, which fails on
  ShapeDtypeStructs under `jax.set_mesh`.)
  """

  def value(x):
    if isinstance(x, nn.meta.AxisMetadata):
      return x.unbox(apply_constraint=False)
    return x

  return jax.tree.map(
      value, tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)
  )


def logical_shardings(boxed_abstract, mesh, rules, *, unsplit=None):
  """Shardings of a tree whose leaves are (abstract) nn.Partitioned boxes or plain arrays.

  Plain (unannotated) leaves are replicated. A dim whose mesh axes do not divide it
  (width 18 on fsdp=4) is not split there instead of failing (fit_spec: FSDP's axes
  move to another dim they divide, if any). Such dims are summarised, one line per
  case, into the list `unsplit` where one is given, and otherwise logged as one warning.
  """
  mesh_specs = nn.logical_to_mesh(nn.get_partition_spec(boxed_abstract), rules)
  found = []

  def fit(path, spec, x):
    spec = fit_spec(
        spec, x.shape, mesh.shape, found, "/".join(_dict_keys(path))
    )
    return NamedSharding(mesh, spec)

  out = jax.tree_util.tree_map_with_path(
      fit,
      mesh_specs,
      unbox(boxed_abstract),
      is_leaf=lambda s: isinstance(s, P) or s is None,
  )
  found = _summarize(found)
  if unsplit is not None:
    unsplit.extend(found)
  elif found:
    logging.warning(
        "Sharding: param dims not divisible by their mesh axes: %s",
        "; ".join(found),
    )
  return out


def _summarize(found):
  """[(param, dim size, axes, n, moved)] -> one note per case: what, how many, an example."""
  groups = {}
  for name, size, axes, n, moved in found:
    what = "whole"
    if moved is not None:
      what = "split along another dim"
    groups.setdefault((size, axes, n, what), []).append(name)
  return [
      f"size {size} over {axes} ({n}): {len(names)} param(s) {what}, e.g. "
      f"{names[0]}"
      for (size, axes, n, what), names in groups.items()
  ]


def fit_spec(spec, shape, axis_sizes, unsplit=None, name="array"):
  """`spec` (a mesh PartitionSpec, or None) made to fit an array of `shape`.

  A dim that its mesh axes do not divide is left unsharded. Storage-only axes (no "model"
  among them: FSDP's) then move to the largest other unsharded dim they divide, as
  big_vision's fsdp strategy picks a dim (ViT-g's width 1408 does not split 256 ways, its
  MLP's 6144 does); what finds no such dim stays whole. Each case is noted in the list
  `unsplit` as (name, dim size, axes, their size, dim moved to or None), if given.
  """
  if not isinstance(spec, P):
    spec = P()
  dims = list(spec) + [None] * (len(shape) - len(spec))
  dropped = []
  for i, axes in enumerate(dims):
    if axes is None:
      continue
    names = as_axes(axes)
    size = math.prod(axis_sizes[a] for a in names)
    if shape[i] % size:
      dims[i] = None
      dropped.append((i, axes, names, size))
  for i, axes, names, size in dropped:
    free = [
        j
        for j in range(len(shape))
        if j != i
        and dims[j] is None
        and shape[j] >= size
        and shape[j] % size == 0
    ]
    moved = None
    if free and "model" not in names:
      moved = max(free, key=lambda j: shape[j])
    if moved is not None:
      dims[moved] = axes
    if unsplit is not None:
      unsplit.append((name, shape[i], "x".join(names), size, moved))
  return P(*dims)


def like_params_shardings(
    tree_abstract, params_abstract, params_shardings, mesh
):
  """Shardings for a tree that mirrors the params somewhere inside (optimizer state).

  A leaf whose dict-key path ends with a param's path and has the param's
  shape (Adam's mu/nu, momentum) gets that param's sharding; everything else
  (step counters, Adafactor's factored row/column statistics) is replicated.
  """
  by_path = {
      _dict_keys(p): (tuple(x.shape), s)
      for (p, x), s in zip(
          jax.tree_util.tree_leaves_with_path(params_abstract),
          jax.tree.leaves(params_shardings),
      )
  }

  def pick(path, leaf):
    keys = _dict_keys(path)
    for i in range(len(keys)):
      hit = by_path.get(keys[i:])
      if hit is not None and hit[0] == tuple(leaf.shape):
        return hit[1]
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(pick, tree_abstract)


def _dict_keys(path):
  return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def describe(shardings, abstract):
  """Per-device bytes of a tree under its shardings (for the log / tests)."""
  return sum(
      int(np.prod(s.shard_shape(tuple(x.shape)))) * np.dtype(x.dtype).itemsize
      for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract))
  )
