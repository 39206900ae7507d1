"""Under the suite's own pytest configuration (two xdist workers, one file each, per-test
timeouts), a test that kills its worker or runs past its time fails alone: the tests after
it in its file, and the other files, still run."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CRASHING = """
import os
import signal
import time

def test_before():
  pass

def test_segfaults():
  os.kill(os.getpid(), signal.SIGSEGV)

def test_between():
  pass

def test_hangs():
  time.sleep(120)

def test_after():
  pass
"""


def test_a_crash_and_a_timeout_fail_their_tests_and_the_run_goes_on(tmp_path):
  (tmp_path / "conftest.py").write_text(
    "from tests.xdist_crash import pytest_xdist_make_scheduler  # noqa: F401\n"
  )
  (tmp_path / "test_crashing.py").write_text(textwrap.dedent(_CRASHING))
  (tmp_path / "test_other.py").write_text("def test_one():\n  pass\n\ndef test_two():\n  pass\n")
  run = subprocess.run(
    [sys.executable, "-m", "pytest", "-c", os.path.join(ROOT, "pyproject.toml")]
    + ["--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-o", "timeout=2", str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT),
    cwd=tmp_path,
  )
  out = run.stdout
  failed = sorted(line.split()[1] for line in out.splitlines() if line.startswith("FAILED "))
  assert failed == ["test_crashing.py::test_hangs", "test_crashing.py::test_segfaults"], out
  assert "2 failed, 5 passed" in out, out[-3000:]
  assert "maximum crashed workers reached" not in out


def test_the_suite_uses_the_crash_scheduler_and_a_timeout():
  """The suite's conftest installs the scheduler; its ini options set a per-test limit."""
  import tomllib  # noqa: PLC0415

  from tests import conftest, xdist_crash  # noqa: PLC0415

  assert conftest.pytest_xdist_make_scheduler is xdist_crash.pytest_xdist_make_scheduler
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  options = project["tool"]["pytest"]["ini_options"]
  assert options["timeout"] > 0 and options["timeout_method"] == "thread"
  assert any(
    d.startswith("pytest-timeout") for d in project["project"]["optional-dependencies"]["dev"]
  )
