"""The notebooks in notebooks/ run top to bottom, each in under a minute, on this venv's Python.

Each runs in a fresh kernel of ``sys.executable`` (ipykernel, from the test extra), through a
kernel spec written to a temporary directory that only this test's ``JUPYTER_PATH`` names:
nothing is registered with Jupyter, and a "python3" kernel installed elsewhere on the machine
cannot be picked up instead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
KERNEL = "dtr-tests"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    return root


def test_there_are_four_notebooks_stored_without_outputs():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb", "02_dynamic_models.ipynb", "03_what_if.ipynb", "04_plans_and_swapping.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=60, resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails
    assert time.perf_counter() - start < 60
