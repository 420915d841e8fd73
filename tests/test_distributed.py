"""Data-parallel training under ``dtr.budget``: two gloo processes on CPU.

Collectives run once inside a block and are never replayed (Note [Collectives] in
dtr/eager/ops.py). Each worker trains a model eagerly and under dtr in the same process, same
seeds and same per-rank data, and saves both runs' gradients (after backward) and parameters
(after ``optimizer.step()``) for every step; the tests here compare them bit for bit on every
rank. The workers are in ``dtr/testing/distributed.py``.

One process pair runs all DDP cases (starting processes costs seconds: torch is imported in
each), another FSDP2, which dtr refuses with a clear error (dtr/eager/data_parallel.py). Processes rendezvous through a file in a temporary directory (no TCP
port to collide on) and are killed if they outlive a deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from dtr.testing.distributed import DDPCase, ddp_worker, fsdp2_worker, fully_shard_api, launch, mismatches  # noqa: E402

WORLD = 2
TIMEOUT = 180  # seconds per process pair; a normal run takes a few (generous for loaded CI)

CASES = {
    c.name: c
    for c in (
        DDPCase("unlimited", fraction=None),
        DDPCase("default"),
        DDPCase("bucket_view", ddp_kwargs={"gradient_as_bucket_view": True}, optimizer="adam"),
        DDPCase("no_sync", micro_batches=2),
        DDPCase("zero_grad_none", set_to_none=True, optimizer="adam"),
    )
}


def _run(worker, tmp: Path, *args):
    """Run ``worker`` on ``WORLD`` ranks; the folder it wrote its results to, and the error it
    failed with (None if it did not), for the tests to report when their results are missing."""
    out = tmp / "out"
    out.mkdir()
    try:
        launch(worker, (WORLD, tmp / "store", out, *args), WORLD, TIMEOUT)
    except Exception as e:
        return out, e
    return out, None


def _load(out: Path, name: str, error) -> list:
    """Every rank's results for ``name``; fails with the workers' error when one is missing."""
    paths = [out / f"{name}.rank{r}.pt" for r in range(WORLD)]
    if not all(p.exists() for p in paths):
        pytest.fail(f"no results for {name!r}: the workers failed with\n{error}")
    return [torch.load(p) for p in paths]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _run(ddp_worker, tmp_path_factory.mktemp("ddp"), list(CASES.values()))


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_matches_eager(ddp_results, case):
    """DDP's gradients and parameters under dtr equal eager's bit for bit on every rank, every
    step; under a budget of half the peak every rank evicts."""
    out, error = ddp_results
    for rank, result in enumerate(_load(out, case, error)):
        diff = mismatches(result["eager"], result["dtr"])
        assert not diff, f"rank {rank}: {diff}"
        if CASES[case].fraction is not None:
            assert result["stats"]["evictions"] > 0, f"rank {rank}: no evictions at {result['budget']} bytes"


@pytest.fixture(scope="module")
def fsdp2_results(tmp_path_factory):
    try:
        fully_shard_api()
    except ImportError as e:
        pytest.skip(f"FSDP2 (fully_shard) is not in torch {torch.__version__}: {e}")
    out, error = _run(fsdp2_worker, tmp_path_factory.mktemp("fsdp2"))
    if error is not None and not (out / "fsdp2.rank0.pt").exists():
        # Without dtr at all: this torch's FSDP2 does not run on CPU with gloo.
        pytest.skip(f"FSDP2 does not run on CPU with gloo in torch {torch.__version__}: {error}")
    return out, error


def test_fsdp2_is_refused_clearly(fsdp2_results):
    """FSDP2 frees its unsharded parameters after each forward by resizing their storage, which
    dtr cannot see: a forward in a block raises a ``DTRError`` that says so on every rank,
    before any all-gather (no rank is left waiting), with the parameters untouched."""
    out, error = fsdp2_results
    for rank, result in enumerate(_load(out, "fsdp2", error)):
        assert "FSDP2 (fully_shard) is not supported" in result.get("error", ""), f"rank {rank}: {result.get('error')}"
        assert result["unchanged"], f"rank {rank}: the refused forward changed parameters"
