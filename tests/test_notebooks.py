"""Every notebook runs top to bottom on the simulated CPU devices, within its time bound."""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT = 120  # seconds; each notebook takes well under a minute on a 2-core CPU


def test_notebooks_exist_and_are_stored_without_outputs():
  assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]
  for path in NOTEBOOKS:
    cells = nbformat.read(path, as_version=4).cells
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in cells if c.cell_type == "code"), path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
  """The kernel inherits this process's environment: 8 simulated CPU devices (conftest.py)."""
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                 resources={"metadata": {"path": str(path.parent)}}).execute()
