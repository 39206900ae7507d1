"""The experiments/ scripts as modules, each loaded once per process: absl's flags are
global, and a script's flags can be defined only once (tests in one worker share them)."""

import functools
import importlib.util
import os

from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def load_script(name: str):
  """(experiments/<name>.py as a module, {flag: default} of the flags it defines)."""
  before = set(flags.FLAGS)
  spec = importlib.util.spec_from_file_location(
    f"{name}_script", os.path.join(ROOT, "experiments", f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, {n: flags.FLAGS[n].default for n in set(flags.FLAGS) - before}
