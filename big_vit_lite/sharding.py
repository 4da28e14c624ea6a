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
serves every mesh.
"""
import math

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


def make_mesh(mesh_cfg=(("data", -1),), devices=None):
  """[(axis, size), ...] -> jax Mesh with Auto axis types; one size may be -1 (the rest).

  Auto (not jax.make_mesh's default Explicit) axis types: Flax linen's
  logical constraints only work with Auto.
  """
  devices = jax.devices() if devices is None else devices
  mesh_cfg = [tuple(a) for a in (mesh_cfg or (("data", -1),))]
  names = [a for a, _ in mesh_cfg]
  sizes = [int(s) for _, s in mesh_cfg]
  for name in names:
    if name not in MESH_AXES:
      raise ValueError(f"Unknown mesh axis '{name}': use {', '.join(MESH_AXES)}.")
  if len(set(names)) != len(names):
    raise ValueError(f"Mesh axes repeat in {mesh_cfg}.")
  n = len(devices)
  if sizes.count(-1) > 1:
    raise ValueError(f"At most one mesh axis may have size -1, got {mesh_cfg}.")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n % known:
      raise ValueError(f"Mesh {mesh_cfg}: {n} devices are not divisible by {known}.")
    sizes[sizes.index(-1)] = n // known
  if math.prod(sizes) != n:
    raise ValueError(f"Mesh {mesh_cfg} needs {math.prod(sizes)} devices but there are {n}: "
                     "use -1 for one axis to take the rest.")
  return jax.make_mesh(tuple(sizes), tuple(names), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(names))


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


def make_rules(rules_cfg, mesh):
  """Config rules (or the defaults) restricted to the mesh's axes, as a tuple for Flax."""
  rules = DEFAULT_RULES if rules_cfg is None else [tuple(r) for r in rules_cfg]
  out = []
  for logical, axes in rules:
    if axes is None:
      out.append((logical, None))
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in axes:
      if a not in MESH_AXES:
        raise ValueError(f"sharding_rules: '{logical}' maps to unknown mesh axis '{a}'; "
                         f"use {', '.join(MESH_AXES)} or None.")
    axes = tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)
    out.append((logical, axes if len(axes) > 1 else (axes[0] if axes else None)))
  return tuple(out)


def unbox(tree):
  """nn.Partitioned boxes -> their values, without adding sharding constraints.

  (`nn.meta.unbox` constrains each value to its logical sharding, which fails on
  ShapeDtypeStructs under `jax.set_mesh`.)
  """
  return jax.tree.map(
      lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.meta.AxisMetadata) else x,
      tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def logical_shardings(boxed_abstract, mesh, rules):
  """Shardings of a tree whose leaves are (abstract) nn.Partitioned boxes or plain arrays.

  Plain (unannotated) leaves are replicated. A dim whose mesh axes do not divide it
  is left unsharded (e.g. 10 classes on 4 devices) instead of failing.
  """
  specs = nn.get_partition_spec(boxed_abstract)
  mesh_specs = nn.logical_to_mesh(specs, rules)
  shapes = unbox(boxed_abstract)

  def fit(spec, x):
    if not isinstance(spec, P):
      spec = P()
    dims = list(spec) + [None] * (len(x.shape) - len(spec))
    for i, axes in enumerate(dims):
      if axes is None:
        continue
      size = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
      if x.shape[i] % size:
        dims[i] = None
    return NamedSharding(mesh, P(*dims))
  return jax.tree.map(fit, mesh_specs, shapes, is_leaf=lambda s: isinstance(s, P) or s is None)


def like_params_shardings(tree_abstract, params_abstract, params_shardings, mesh):
  """Shardings for a tree that mirrors the params somewhere inside (optimizer state).

  A leaf whose dict-key path ends with a param's path and has the param's
  shape (Adam's mu/nu, momentum) gets that param's sharding; everything else
  (step counters, Adafactor's factored row/column statistics) is replicated.
  """
  param_leaves = jax.tree_util.tree_leaves_with_path(params_abstract)
  shard_leaves = jax.tree.leaves(params_shardings)
  by_path = {_dict_keys(p): (tuple(x.shape), s) for (p, x), s in zip(param_leaves, shard_leaves)}

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
  total = 0
  for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(abstract)):
    shard = s.shard_shape(tuple(x.shape))
    total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
  return total
