"""The README and docs/ name what exists: every relative link resolves, every repository path
they name in backticks is there, and every `python experiments/X.py ...` command the README
names parses (its script's own flags, as absl reads them)."""

import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = ("trace_jax/", "experiments/", "tests/", "docs/", "notebooks/")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")


def _ids(path):
  return str(path.relative_to(ROOT))


def _named_paths(text: str) -> set[str]:
  """Repository paths named in backticks: `trace_jax/...`, `experiments/...`, ... (not ones
  with placeholders, globs or format fields)."""
  out = set()
  for code in CODE.findall(text):
    for token in code.split():
      token = token.strip(".,;:()'\"")
      token = token.split("::")[0]
      if token.startswith(TOP) and not re.search(r"[<>*{}$\[\]]|\.\.\.", token):
        out.add(token.split("=")[-1] if "=" in token else token)
  return out


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_relative_link_resolves(page):
  missing = []
  for target in LINK.findall(page.read_text()):
    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
      continue
    if not (page.parent / target.split("#")[0]).exists():
      missing.append(target)
  assert not missing, f"{_ids(page)} links to what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_ids)
def test_every_named_path_exists(page):
  missing = sorted(p for p in _named_paths(page.read_text()) if not (ROOT / p).exists())
  assert not missing, f"{_ids(page)} names paths that do not exist: {missing}"


def _readme_commands() -> dict[str, list[list[str]]]:
  """{script: [argv, ...]} of every `python experiments/X.py ...` line the README names."""
  text = (ROOT / "README.md").read_text().replace("\\\n", " ")
  commands: dict[str, list[list[str]]] = {}
  for line in text.splitlines():
    for match in re.finditer(r"python (experiments/\w+\.py)([^`#\n]*)", line):
      argv = [a for a in shlex.split(match.group(2)) if a not in ("&&",)]
      commands.setdefault(match.group(1), []).append(argv)
  return commands


PARSE = textwrap.dedent("""
    import importlib.util, json, sys
    from absl import flags
    spec = importlib.util.spec_from_file_location("script", sys.argv[1])
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    failures = []
    for argv in json.loads(sys.argv[2]):
      flags.FLAGS.unparse_flags()
      try:
        flags.FLAGS([sys.argv[1], *argv])
      except flags.Error as e:
        failures.append(f"{argv}: {e}")
    print(json.dumps(failures))
""")


def test_every_readme_command_parses():
  import json

  commands = _readme_commands()
  assert "experiments/rl.py" in commands  # the main job is named
  processes = {
    script: subprocess.Popen(
      [sys.executable, "-c", PARSE, str(ROOT / script), json.dumps(argvs)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      cwd=ROOT,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    for script, argvs in commands.items()
  }
  problems = {}
  for script, process in processes.items():
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, f"{script}: {err[-2000:]}"
    failures = json.loads(out.strip().splitlines()[-1])
    if failures:
      problems[script] = failures
  assert not problems, problems


def test_the_readme_is_short():
  assert len((ROOT / "README.md").read_text().splitlines()) <= 250
