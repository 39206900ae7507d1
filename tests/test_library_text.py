"""Library modules say what the code does and leave the caller's choices alone: none names
the work item that asked for it, and none picks matplotlib's backend (a notebook user's
inline backend would be switched off at import); scripts choose one. Tests and scripts say
what they check and measure, not which work item asked for it."""

import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "trace_jax"
MODULES = sorted(PACKAGE.rglob("*.py"))
ROOT = PACKAGE.parent
ISSUE = re.compile(r"\bissues? \d+|\bissue \d+'s|\(issue\b|\bthe issue\b", re.IGNORECASE)
SCRIPTS = [p for d in ("tests", "experiments") for p in sorted((ROOT / d).rglob("*.py"))]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_library_module_names_no_issue_and_sets_no_backend(path):
  text = path.read_text()
  assert not ISSUE.findall(text), f"{path} names an issue: {ISSUE.findall(text)}"
  assert "matplotlib.use(" not in text, f"{path} sets matplotlib's backend"


def test_tests_and_scripts_name_no_issue():
  this = pathlib.Path(__file__).resolve()
  found = {
    str(p.relative_to(ROOT)): ISSUE.findall(p.read_text())
    for p in SCRIPTS
    if p.resolve() != this and ISSUE.search(p.read_text())
  }
  assert len(SCRIPTS) > 100, len(SCRIPTS)
  assert not found, f"these name an issue: {found}"


def test_importing_the_report_keeps_the_backend(tmp_path):
  import subprocess
  import sys

  code = (
    "import matplotlib; matplotlib.use('svg'); import trace_jax.run.report, "
    "trace_jax.studies.compare, trace_jax.studies.seeds, trace_jax.studies.staleness; "
    "print(matplotlib.get_backend())"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "svg"
