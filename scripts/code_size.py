"""Prints the size figures of the library, counted in statements (Python's `ast.stmt` nodes, not
docstrings), so that splitting a long call or a comment costs nothing: statements per
module, the total, modules over 600 (pyink-formatted) lines and functions over 60 statements.

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
    modules[str(p.relative_to(root.parent))] = dict(
        statements=statements,
        lines=total,
        longest=max(funcs, default=(0, ""))[0],
        long_functions=long_functions,
    )
  over_600 = [path for path, m in modules.items() if m["lines"] > 600]
  long_functions = []
  for path, m in modules.items():
    for f in m["long_functions"]:
      long_functions.append(f"{path}:{f}")
  return dict(
      statements=sum(m["statements"] for m in modules.values()),
      modules=modules,
      over_600=over_600,
      long_functions=long_functions,
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


if __name__ == "__main__":
  main(sys.argv[1:])
