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


_SLOW_REPLACEMENT = """
import os
import time

from tests.xdist_crash import pytest_xdist_make_scheduler  # noqa: F401


def pytest_collection_modifyitems(items):
  if os.environ.get("PYTEST_XDIST_WORKER") not in ("gw0", "gw1"):  # a replacement worker
    open(os.path.join(os.path.dirname(__file__), "replacement_collecting"), "w").close()
    time.sleep(4)
"""

_CRASH_NOW = """
import os
import signal

def test_segfaults():
  os.kill(os.getpid(), signal.SIGSEGV)

def test_after():
  pass
"""

_CRASH_WHILE_THE_REPLACEMENT_COLLECTS = """
import os
import signal
import time

def test_segfaults_later():
  marker = os.path.join(os.path.dirname(__file__), "replacement_collecting")
  while not os.path.exists(marker):
    time.sleep(0.05)
  time.sleep(0.5)
  os.kill(os.getpid(), signal.SIGSEGV)

def test_after():
  pass
"""


def test_a_crash_while_a_replacement_worker_collects_fails_only_its_test(tmp_path):
  """The second crash comes while the first crash's replacement worker is still collecting:
  the run goes on, and each crash fails its own test."""
  (tmp_path / "conftest.py").write_text(textwrap.dedent(_SLOW_REPLACEMENT))
  (tmp_path / "test_a.py").write_text(textwrap.dedent(_CRASH_NOW))
  (tmp_path / "test_b.py").write_text(textwrap.dedent(_CRASH_WHILE_THE_REPLACEMENT_COLLECTS))
  run = subprocess.run(
    [sys.executable, "-m", "pytest", "-c", os.path.join(ROOT, "pyproject.toml")]
    + ["--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(tmp_path)],
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT),
    cwd=tmp_path,
  )
  out = run.stdout + run.stderr
  assert "INTERNALERROR" not in out, out[-3000:]
  failed = sorted(line.split()[1] for line in out.splitlines() if line.startswith("FAILED "))
  assert failed == ["test_a.py::test_segfaults", "test_b.py::test_segfaults_later"], out[-3000:]
  assert "2 failed, 2 passed" in out, out[-3000:]


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
