"""pyproject.toml declares what trace_jax imports, and nothing it does not."""

import ast
import importlib.metadata
import os
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imports() -> tuple[set[str], set[str]]:
  """(distributions trace_jax's modules import at their top level, those imported only inside
  a function: optional), by the installed packages' module names."""
  by_module = importlib.metadata.packages_distributions()
  top, nested = set(), set()
  for folder, _, files in os.walk(os.path.join(ROOT, "trace_jax")):
    for name in files:
      if not name.endswith(".py"):
        continue
      with open(os.path.join(folder, name)) as f:
        tree = ast.parse(f.read())
      module_level = {id(node) for node in tree.body}
      for node in ast.walk(tree):
        if isinstance(node, ast.Import):
          roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
          roots = [node.module.split(".")[0]]
        else:
          continue
        for root in roots:
          if root in sys.stdlib_module_names or root in ("trace_jax", "__future__"):
            continue
          for dist in by_module.get(root, [root]):
            (top if id(node) in module_level else nested).add(canonicalize_name(dist))
  return top, nested - top


def _declared() -> tuple[set[str], set[str]]:
  """(runtime dependencies, every optional one) of pyproject.toml, by distribution name."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  names = lambda deps: {canonicalize_name(Requirement(d).name) for d in deps}  # noqa: E731
  optional = set().union(*map(names, project["optional-dependencies"].values()))
  return names(project["dependencies"]), optional


def test_every_import_is_declared_and_every_runtime_dependency_imported():
  top, nested = _imports()
  runtime, optional = _declared()
  assert top - runtime == set(), "imported by trace_jax but not a runtime dependency"
  assert nested - runtime - optional == set(), "imported lazily but declared nowhere"
  assert runtime - top - nested == set(), "runtime dependencies trace_jax never imports"
