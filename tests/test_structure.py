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


def _imports(name: str, tree: ast.Module, modules) -> set[str]:
  """The trace_jax modules that module `name` imports anywhere in its source (top level,
  inside functions, under `if`): `from p import x` names module `p.x` if that is a module,
  else module `p`. A package's own __init__, which Python runs before any of its
  submodules, is an edge only where it is imported by name."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names if alias.name in modules)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        if full in modules:
          out.add(full)
        elif node.module in modules:
          out.add(node.module)
  out.discard(name)
  return out


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph` ({module: modules it imports}), or None if it is acyclic."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(node, path):
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt) :] + [nxt]
      if nxt not in state and (found := visit(nxt, path)):
        return found
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node, [])):
      return found
  return None


def test_a_cycle_is_found_where_there_is_one():
  assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
  assert _a_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_among_trace_jax_modules():
  """trace_jax's module graph is acyclic, counting every import in a module's source,
  function-level ones included (not only the top-level imports): no module relies on
  importing another late to break a circle."""
  modules = _modules()
  graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
  assert graph["trace_jax.kernels.gemm"] >= {"trace_jax.kernels.launch"}
  assert _a_cycle(graph) is None, " -> ".join(_a_cycle(graph))


def _public_types(tree: ast.Module) -> list[str]:
  """The public (non-underscore) classes a module defines at its top level, and its public
  type aliases (a CapWords name bound to a subscripted type, `Name = Union[...]`)."""
  names = []
  for node in tree.body:
    if isinstance(node, ast.ClassDef):
      names.append(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Subscript):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names += [t.id for t in targets if isinstance(t, ast.Name) and not t.id.isupper()]
  return [name for name in names if not name.startswith("_")]


def test_public_type_names_are_unique():
  """No two modules define a public class (or type alias) of the same name: a name says
  which thing it is wherever it is imported."""
  where: dict[str, list[str]] = {}
  for module, tree in _modules().items():
    for name in _public_types(tree):
      where.setdefault(name, []).append(module)
  assert {"QArray", "Guidance", "SiteKey", "Rollout"} <= set(where)
  assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}
