"""Prints the size figures of the library, counted in statements (Python's `ast.stmt` nodes, not
docstrings), so that splitting a long call or a comment costs nothing: statements per
module, the total, modules over 600 (pyink-formatted) lines and functions over 60 statements;
and two style measures: conditional expressions (`a if c else b`) per 1,000 statements, with
those passed straight as a call's argument listed, and private names (`_x`) one of the
package's modules takes from another.

Usage: python scripts/code_size.py [PACKAGE_DIR] [--json]
"""

import ast
import json
import pathlib
import sys

FUNCTION_LIMIT = 60  # statements


def _is_docstring(node):
  return (
      isinstance(node, ast.Expr)
      and isinstance(node.value, ast.Constant)
      and isinstance(node.value.value, str)
  )


def _statements(tree):
  """The statements in `tree` (itself included), docstrings left out."""
  count = 0
  for node in ast.walk(tree):
    if isinstance(node, ast.stmt) and not _is_docstring(node):
      count += 1
  return count


def conditional_expressions(tree):
  """(how many conditional expressions `tree` holds, the line of each one that is passed
  straight as a call's argument: `f(a if c else b)`, `f(x=a if c else b)`)."""
  count, as_arguments = 0, []
  for node in ast.walk(tree):
    if isinstance(node, ast.IfExp):
      count += 1
    if isinstance(node, ast.Call):
      arguments = list(node.args) + [k.value for k in node.keywords]
      for arg in arguments:
        if isinstance(arg, ast.Starred):
          arg = arg.value
        if isinstance(arg, ast.IfExp):
          as_arguments.append(arg.lineno)
  return count, sorted(as_arguments)


def _is_private(name):
  return name.startswith("_") and not name.startswith("__")


def private_imports(tree, package="big_vit_lite"):
  """(line, name) of each private name taken from another of `package`'s modules:
  `from package.m import _x`, or `m._x` where `m` was imported from `package`.
  """
  found, modules = [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      if node.level == 0 and not (node.module or "").startswith(package):
        continue
      for alias in node.names:
        if _is_private(alias.name):
          found.append((node.lineno, alias.name))
        modules.add(alias.asname or alias.name)
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith(package):
          modules.add(alias.asname or alias.name)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _is_private(node.attr):
      owner = ast.unparse(node.value)
      if owner in modules or owner.startswith(package + "."):
        found.append((node.lineno, f"{owner}.{node.attr}"))
  return sorted(found)


def measure(path):
  """(statements, all lines, [(statements in a function, name)]) of one file.

  A function's count includes its own `def` and the functions nested in it.
  """
  src = pathlib.Path(path).read_text()
  tree = ast.parse(src)
  funcs = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      funcs.append((_statements(node), node.name))
  return _statements(tree), len(src.splitlines()), funcs


def report(root):
  root = pathlib.Path(root)
  modules = {}
  for p in sorted(root.rglob("*.py")):
    statements, total, funcs = measure(p)
    long_functions = []
    for n, name in sorted(funcs, reverse=True):
      if n > FUNCTION_LIMIT:
        long_functions.append(f"{name} ({n})")
    tree = ast.parse(p.read_text())
    conditionals, as_arguments = conditional_expressions(tree)
    modules[str(p.relative_to(root.parent))] = dict(
        statements=statements,
        lines=total,
        longest=max(funcs, default=(0, ""))[0],
        long_functions=long_functions,
        conditionals=conditionals,
        conditional_arguments=as_arguments,
        private_imports=private_imports(tree),
    )
  over_600 = [path for path, m in modules.items() if m["lines"] > 600]
  long_functions, conditional_arguments, private = [], [], []
  for path, m in modules.items():
    for f in m["long_functions"]:
      long_functions.append(f"{path}:{f}")
    for line in m["conditional_arguments"]:
      conditional_arguments.append(f"{path}:{line}")
    for line, name in m["private_imports"]:
      private.append(f"{path}:{line} {name}")
  statements = sum(m["statements"] for m in modules.values())
  conditionals = sum(m["conditionals"] for m in modules.values())
  return dict(
      statements=statements,
      modules=modules,
      over_600=over_600,
      long_functions=long_functions,
      conditionals=conditionals,
      conditionals_per_1000=1000 * conditionals / max(statements, 1),
      conditional_arguments=conditional_arguments,
      private_imports=private,
  )


def main(argv):
  args = [a for a in argv if not a.startswith("--")]
  root = (
      args[0]
      if args
      else pathlib.Path(__file__).resolve().parent.parent / "big_vit_lite"
  )
  r = report(root)
  if "--json" in argv:
    print(json.dumps(r))
    return
  for path, m in sorted(
      r["modules"].items(), key=lambda kv: kv[1]["statements"]
  ):
    print(f"{m['statements']:6d} {m['lines']:6d}  {path}")
  print(f"statements: {r['statements']} in {len(r['modules'])} modules")
  print("modules over 600 lines:", ", ".join(r["over_600"]) or "none")
  print(
      f"functions over {FUNCTION_LIMIT} statements:",
      ", ".join(r["long_functions"]) or "none",
  )
  print(
      f"conditional expressions: {r['conditionals']} "
      f"({r['conditionals_per_1000']:.1f} per 1,000 statements); as a call's "
      "argument:",
      ", ".join(r["conditional_arguments"]) or "none",
  )
  print(
      "private names imported across modules:",
      ", ".join(r["private_imports"]) or "none",
  )


if __name__ == "__main__":
  main(sys.argv[1:])
