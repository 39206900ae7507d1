"""Every notebook in notebooks/ executes top to bottom without an error."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert NOTEBOOKS, "notebooks/ has no .ipynb files"


# Each runs within a minute on 2 cores: 01 and 02 compute on the `tiny` preset (02: a 20-step
# SFT, one FP4 rollout, the training path under three guidance modes; under -m slow, the
# longest), 03 reads the committed experiments/results/arms.
SLOW = {"02_guidance.ipynb"}


@pytest.mark.parametrize(
  "path",
  [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p for p in NOTEBOOKS],
  ids=[p.name for p in NOTEBOOKS],
)
def test_notebook_executes(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()
  errors = [
    o
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.get("outputs", [])
    if o.get("output_type") == "error"
  ]
  assert not errors
