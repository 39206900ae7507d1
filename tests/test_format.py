"""The code stays formatted and lint-clean: CI runs exactly `pytest`, so drift fails here."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
  "args", [("format", "--check", "--diff", "."), ("check", ".")], ids=["format", "check"]
)
def test_ruff_passes(args):
  # ruff comes with the dev extra (pyproject.toml); its settings are [tool.ruff] there.
  result = subprocess.run(
    [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, (
    f"`ruff {' '.join(args)}` failed; run `ruff format . && ruff check --fix .`:\n"
    f"{result.stdout[-4000:]}{result.stderr[-2000:]}"
  )
