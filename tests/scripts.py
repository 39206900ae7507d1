"""The experiments/ scripts as modules in this process.

absl's flags are global, and a flag can be defined only once, so:
- `load_script` loads a script once per process and keeps its flags (tests in one worker
  share them);
- `refusal` loads a script afresh with every other script's flags set aside, parses its
  flags, runs its main, and puts the flags back as they were: scripts that share flag
  names (--workdir, --out) can each be checked in one process.
"""

import contextlib
import functools
import importlib.util
import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
_REGISTRIES = ("__flags", "__hiddenflags", "__flags_by_module", "__flags_by_module_id")
_REGISTRIES += ("__key_flags_by_module",)
_ABSL_FLAGS = frozenset(flags.FLAGS)  # absl's own (--help, --verbosity, ...), before any script


def _copy(registry):
  """A registry's copy, one level deep: its dict's lists, or its set."""
  if isinstance(registry, dict):
    return {k: list(v) if isinstance(v, list) else v for k, v in registry.items()}
  return set(registry)


def _exec(name: str, module_name: str):
  """experiments/<name>.py executed as a module, with experiments/ on sys.path while it
  imports, as when it runs as a script (it may import its sibling scripts)."""
  spec = importlib.util.spec_from_file_location(
    module_name, os.path.join(EXPERIMENTS, f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, EXPERIMENTS)
  try:
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(EXPERIMENTS)
  return module


@functools.lru_cache(maxsize=None)
def load_script(name: str):
  """(experiments/<name>.py as a module, {flag: default} of the flags it defines)."""
  before = set(flags.FLAGS)
  module = _exec(name, f"{name}_script")
  return module, {n: flags.FLAGS[n].default for n in set(flags.FLAGS) - before}


@contextlib.contextmanager
def _alone(name: str):
  """experiments/<name>.py loaded afresh, with no other script's flags defined; every flag
  registry is restored after, parsed state included (unparsed)."""
  registry = flags.FLAGS.__dict__
  saved = {key: _copy(registry[key]) for key in _REGISTRIES}
  for flag_name in set(flags.FLAGS) - _ABSL_FLAGS:
    delattr(flags.FLAGS, flag_name)
  try:
    yield _exec(name, f"{name}_in_process")
  finally:
    flags.FLAGS.unparse_flags()
    registry.update(saved)


def refusal(name: str, *argv: str) -> str:
  """The message experiments/<name>.py refuses `argv` with, in this process: a flag's parse
  error (absl's flags.Error), or the UsageError or ValueError its main raises. Fails if main
  returns."""
  with _alone(name) as script:
    parse = getattr(script, "parse_flags", None)
    try:
      if parse is not None:
        parse([f"{name}.py", *argv])
      else:
        flags.FLAGS([f"{name}.py", *argv])
      script.main([f"{name}.py"])
    except (flags.Error, app.UsageError, ValueError) as error:
      return str(error)
  raise AssertionError(f"experiments/{name}.py accepted {list(argv)}")
