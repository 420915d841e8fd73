"""dtr_ext against the pure-Python DPs (identical results), and how dtr.planner finds or misses it."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dtr.planner import HAS_NATIVE, Chain, _native, offload, rotor
from dtr.planner.discretize import to_units

needs_native = pytest.mark.skipif(not HAS_NATIVE, reason="dtr_ext is not built, or DTR_PUREPYTHON=1")


@st.composite
def problems(draw, max_stages):
    """A chain with float times (any difference in the order of additions would show) and a budget."""
    L = draw(st.integers(1, max_stages))
    times = st.lists(st.floats(0, 10, allow_nan=False, allow_infinity=False), min_size=L, max_size=L)
    sizes = st.lists(st.integers(0, 1000), min_size=L, max_size=L)
    out = draw(sizes)
    chain = Chain(draw(times), draw(times), out, [o + s for o, s in zip(out, draw(sizes))], draw(sizes),
                  draw(sizes), draw(st.integers(0, 1000)))
    budget = draw(st.integers(1, 6 * 1000 * L))
    return chain, budget


@needs_native
@settings(max_examples=150, deadline=None)
@given(problem=problems(max_stages=14), slots=st.integers(1, 300))
def test_rotor_tables_are_identical(problem, slots):
    chain, budget = problem
    units = to_units(chain, budget, slots)
    available = slots - units.x[0]
    if available < 0:
        return
    args = (*rotor.times(chain), *(np.array(v, dtype=np.int64) for v in units), available)
    value_py, choice_py = _native.backend("python").rotor_table(*args)
    value_c, choice_c = _native.backend("native").rotor_table(*args)
    assert value_py == value_c or (np.isinf(value_py) and np.isinf(value_c))
    np.testing.assert_array_equal(choice_py, choice_c)


@needs_native
@settings(max_examples=150, deadline=None)
@given(problem=problems(max_stages=7), levels=st.integers(1, 25), bandwidth=st.floats(0.01, 1e4))
def test_combined_plans_are_identical(problem, levels, bandwidth):
    chain, budget = problem
    python = offload.combined_plan(chain, budget, levels, bandwidth, _native.backend("python").combined_dp)
    native = offload.combined_plan(chain, budget, levels, bandwidth, _native.backend("native").combined_dp)
    assert python == native


def test_auto_backend_follows_has_native():
    assert _native.backend("auto").name == ("native" if HAS_NATIVE else "python")
    with pytest.raises(ValueError, match="backend='fast'"):
        _native.backend("fast")


def _run(code, **env):
    return subprocess.run([sys.executable, "-W", "always", "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, check=True)


def test_purepython_env_disables_the_extension_silently():
    done = _run("import dtr.planner as p; from dtr.planner import _native\n"
                "assert not p.HAS_NATIVE\n"
                "try: _native.backend('native')\n"
                "except ValueError as e: assert 'DTR_PUREPYTHON=1' in str(e)\n"
                "else: raise AssertionError('native backend under DTR_PUREPYTHON=1')",
                DTR_PUREPYTHON="1")
    assert "Warning" not in done.stderr


def test_missing_extension_warns_once_and_falls_back():
    done = _run("import sys; sys.modules['dtr_ext._planner'] = None\n"
                "import dtr.planner, dtr.planner.solve\n"
                "assert not dtr.planner.HAS_NATIVE\n"
                "chain = dtr.planner.Chain([1] * 4, [1] * 4, [20] * 4, [30] * 4, [0] * 4, [0] * 4, 20)\n"
                "assert dtr.planner.solve(chain, 150).peak <= 150  # store-all needs 180",
                DTR_PUREPYTHON="0")
    assert done.stderr.count("RuntimeWarning") == 1
    assert "dtr_ext is not available" in done.stderr
