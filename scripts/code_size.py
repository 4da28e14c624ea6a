"""Prints the size figures of the library: code lines per module (not blank, not a docstring,
not a comment-only line), the total, modules over 500 lines and functions over 80 lines.

Usage: python scripts/code_size.py [PACKAGE_DIR] [--json]
"""
import ast
import json
import pathlib
import sys


def _docstring_lines(tree):
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      first = node.body[0] if node.body else None
      if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)):
        lines.update(range(first.lineno, first.end_lineno + 1))
  return lines


def measure(path):
  """(code lines, all lines, [(function length, name)]) of one Python file."""
  src = pathlib.Path(path).read_text()
  tree = ast.parse(src)
  doc = _docstring_lines(tree)
  code = sum(1 for i, line in enumerate(src.splitlines(), 1)
             if line.strip() and not line.strip().startswith("#") and i not in doc)
  funcs = [(n.end_lineno - n.lineno + 1, n.name) for n in ast.walk(tree)
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
  return code, len(src.splitlines()), funcs


def report(root):
  root = pathlib.Path(root)
  modules = {}
  for p in sorted(root.rglob("*.py")):
    code, total, funcs = measure(p)
    modules[str(p.relative_to(root.parent))] = dict(
        code=code, lines=total, longest=max(funcs, default=(0, ""))[0],
        long_functions=[f"{name} ({n})" for n, name in sorted(funcs, reverse=True) if n > 80])
  return dict(code_lines=sum(m["code"] for m in modules.values()), modules=modules,
              over_500=[p for p, m in modules.items() if m["lines"] > 500],
              functions_over_80=[f"{p}:{f}" for p, m in modules.items() for f in m["long_functions"]])


def main(argv):
  args = [a for a in argv if not a.startswith("--")]
  root = args[0] if args else pathlib.Path(__file__).resolve().parent.parent / "big_vit_lite"
  r = report(root)
  if "--json" in argv:
    print(json.dumps(r))
    return
  for path, m in sorted(r["modules"].items(), key=lambda kv: kv[1]["code"]):
    print(f"{m['code']:6d} {m['lines']:6d}  {path}")
  print(f"code lines: {r['code_lines']} in {len(r['modules'])} modules")
  print("modules over 500 lines:", ", ".join(r["over_500"]) or "none")
  print("functions over 80 lines:", ", ".join(r["functions_over_80"]) or "none")


if __name__ == "__main__":
  main(sys.argv[1:])
