"""Properties of trace_jax's source as a whole, read with `ast` (nothing is imported)."""

import ast
import pathlib

import trace_jax

_ROOT = pathlib.Path(trace_jax.__file__).parent


def _modules() -> dict[str, ast.Module]:
  """{dotted module name: its parsed source} for every module of trace_jax."""
  out = {}
  for path in sorted(_ROOT.rglob("*.py")):
    parts = ("trace_jax",) + path.relative_to(_ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = ast.parse(path.read_text(), filename=str(path))
  return out


def test_modules_are_found():
  modules = _modules()
  assert {"trace_jax", "trace_jax.model.sites", "trace_jax.kernels.dispatch"} <= set(modules)
  assert len(modules) > 50


def test_no_module_level_getattr():
  """Module attributes are written down: no module computes them on access with a
  module-level `__getattr__` (grep would find no definition)."""
  found = [
    name
    for name, tree in _modules().items()
    for node in tree.body
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__getattr__"
  ]
  assert found == []
