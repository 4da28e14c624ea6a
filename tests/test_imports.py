"""The package's import graph: no cycle (function-level imports count), models/ below the rest."""

import ast
import pathlib

import big_vit_lite

ROOT = pathlib.Path(big_vit_lite.__file__).parent


def _module_name(path):
  parts = path.relative_to(ROOT.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph():
  """{module: set of big_vit_lite modules it imports anywhere in its source}."""
  modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: from the package, up level-1
          base = ".".join(
              package.split(".")[: len(package.split(".")) - node.level + 1]
              + ([base] if base else [])
          )
        # `from pkg import mod` imports pkg.mod when that is a module.
        targets = [
            f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
            for a in node.names
        ]
      else:
        continue
      for t in targets:
        # `import a.b.c` of a name inside a module
        while t and t not in modules:
          t = t.rpartition(".")[0]
        if t and t != name:
          deps.add(t)
    graph[name] = deps
  return graph


def _cycle(graph):
  """One import cycle as a list of modules, or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for dep in sorted(graph[node]):
      if state.get(dep) == "open":
        return stack[stack.index(dep) :] + [dep]
      if dep not in state:
        found = visit(dep)
        if found:
          return found
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_no_import_cycle():
  graph = _graph()
  # the walk sees imports
  assert "big_vit_lite.models.formats" in graph["big_vit_lite.models.vit"]
  cycle = _cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_models_depend_on_nothing_above_them():
  # Package __init__s are imported on the way to any module, so they are no
  # "dependency".
  # (sharding.py: the mesh and logical-axis plumbing, which the checkpoint
  # loader (models/loading.py) places params with.)
  allowed = (
      "big_vit_lite.models",
      "big_vit_lite.runtime.paths",
      "big_vit_lite.runtime.sharding",
      "big_vit_lite.data.pp",
  )
  for name, deps in _graph().items():
    if name.startswith("big_vit_lite.models"):
      above = sorted(
          d
          for d in deps
          if d != "big_vit_lite"
          and not any(d == a or d.startswith(a + ".") for a in allowed)
      )
      assert (
          not above
      ), f"{name} imports {above}: models/ must not depend on the rest"


def test_the_planner_sits_below_nothing_of_the_trainer():
  """Guards the layering: the planner (big_vit_lite/planner/) builds on the trainer's
  modules; nothing but the `python -m big_vit_lite.plan` entry imports it."""
  graph = _graph()
  assert (
      "big_vit_lite.trainer.train_state"
      in graph["big_vit_lite.planner.assemble"]
  )
  for name, deps in graph.items():
    if name.startswith("big_vit_lite.planner") or name == "big_vit_lite.plan":
      continue
    planner = sorted(d for d in deps if d.startswith("big_vit_lite.planner"))
    assert not planner, f"{name} imports the planner: {planner}"
