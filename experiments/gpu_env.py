"""What the GPU window runs on, checked before anything else (the first step of gpu_window.sh).

  python experiments/gpu_env.py --require_gpu   # exit 3 off a GPU
  python experiments/gpu_env.py                 # any backend (the CPU smoke run)

Prints the Python, jax, jaxlib, flax and orbax-checkpoint versions and `jax.devices()`.
Exit status: 0 ready; 3 a package the sections import is missing, or (--require_gpu) the
backend is not a GPU; 4 flax or orbax-checkpoint lies outside the bounds pyproject.toml
verifies (the last line names them, and gpu_window.sh installs the carried wheels). It
imports nothing of trace_jax, so it runs where trace_jax cannot be imported.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import sys
import tomllib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The distributions the sections import, by module name (tests/test_gpu_window.py checks
# every import of the sections against experiments/gpu_image_packages.txt).
NEEDED = {
  "jax": "jax",
  "jaxlib": "jaxlib",
  "flax": "flax",
  "optax": "optax",
  "orbax": "orbax-checkpoint",
  "numpy": "numpy",
  "absl": "absl-py",
  "ml_dtypes": "ml-dtypes",
}
BOUNDED = ("flax", "orbax-checkpoint")  # installed from carried wheels when out of bounds


def bounds(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> dict[str, list[str]]:
  """{distribution: its specifiers} for BOUNDED, from pyproject's dependencies."""
  with open(pyproject, "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
  found = {}
  for dep in deps:
    name = re.match(r"[A-Za-z0-9_.\-]+", dep).group(0)
    if name in BOUNDED:
      found[name] = [s.strip() for s in dep[len(name) :].split(",") if s.strip()]
  return found


def _version_tuple(version: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def satisfies(version: str, specifiers: list[str]) -> bool:
  """Whether `version` meets each of `specifiers` (>=, <, <=, >, ==, != on release numbers)."""
  ops = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
  }
  have = _version_tuple(version)
  for spec in specifiers:
    op = next(o for o in ops if spec.startswith(o))
    want = _version_tuple(spec[len(op) :])
    width = max(len(have), len(want))
    pad = lambda v: v + (0,) * (width - len(v))  # noqa: E731
    if not ops[op](pad(have), pad(want)):
      return False
  return True


def out_of_bounds(versions: dict[str, str | None], limits: dict[str, list[str]]) -> list[str]:
  """The bounded distributions whose installed version (None: missing) misses its bounds."""
  return [n for n, spec in limits.items() if versions.get(n) and not satisfies(versions[n], spec)]


def _version(distribution: str) -> str | None:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return None


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--require_gpu", action="store_true", help="Exit 3 off a GPU.")
  args = parser.parse_args(argv)
  versions = {d: _version(d) for d in ("jax", "jaxlib", "flax", "orbax-checkpoint")}
  print(f"python {sys.version.split()[0]}; " + ", ".join(f"{d} {v}" for d, v in versions.items()))
  missing = [d for m, d in NEEDED.items() if importlib.util.find_spec(m) is None]
  if missing:
    print(f"gpu_env: missing packages {missing}: the sections import them; nothing ran")
    return 3
  import jax  # noqa: PLC0415 (after the package check)

  devices = jax.devices()
  print(f"backend {jax.default_backend()}; devices {devices}")
  if args.require_gpu and jax.default_backend() != "gpu":
    print(f"gpu_env: --require_gpu, but the backend is {jax.default_backend()!r}; nothing ran")
    return 3
  bad = out_of_bounds(versions, bounds())
  if bad:
    print("gpu_env: outside the verified bounds: " + " ".join(bad))
    return 4
  return 0


if __name__ == "__main__":
  sys.exit(main())
