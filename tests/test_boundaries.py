"""Project boundaries: the engine and the planner stay torch-free, and CI runs exactly the
README's test command."""

import re
from pathlib import Path

from fresh_process import run_python

ROOT = Path(__file__).resolve().parents[1]


def _imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return run_python(code).strip() == "True"


def test_engine_does_not_import_torch():
    assert not _imports_torch("dtr.core")


def test_simulator_does_not_import_torch():
    # Sweeps over recorded traces run without torch (and its import time).
    assert not _imports_torch("dtr.sim")


def test_explain_timelines_advisor_and_plots_do_not_import_torch():
    # Reading traces, drawing them and picking a budget need no torch.
    assert not _imports_torch("dtr.explain, dtr.timeline, dtr.advisor, dtr.figures, dtr.log")


def test_planner_does_not_import_torch():
    assert not _imports_torch("dtr.planner")


def test_public_api_does_import_torch_when_used():
    assert _imports_torch("dtr.scope")


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2, "the README opens with exactly two commands"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [block[1]]
