"""Every notebook in notebooks/ executes top to bottom without an error."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert NOTEBOOKS, "notebooks/ has no .ipynb files"


# 02_guidance trains a small policy (~2 min on 2 cores): `pytest -m slow tests/test_notebooks.py`.
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.name.startswith("02_")
                                  else p for p in NOTEBOOKS], ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
