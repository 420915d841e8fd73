"""Data-parallel training under ``dtr.budget``: two gloo processes on CPU.

Collectives run once inside a block and are never replayed (Note [Collectives] in
dtr/eager/ops.py); FSDP2's gathers and reductions run untracked, and the ops that read a
gathered parameter are retired before FSDP frees it (Note [FSDP2] in
dtr/eager/data_parallel.py). Each worker trains a model eagerly and under dtr in the same
process, same seeds and same per-rank data, and saves both runs' gradients (after backward)
and parameters (after ``optimizer.step()``) for every step; the tests here compare them bit for
bit on every rank. The worker is in ``dtr/testing/distributed.py``.

One process pair runs all DDP cases (starting processes costs seconds: torch is imported in
each), another all FSDP2 cases. Processes rendezvous through a file in a temporary directory
(no TCP port to collide on) and are killed if they outlive a deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from dtr.testing.distributed import Case, fully_shard_api, launch, mismatches, worker  # noqa: E402

WORLD = 2
TIMEOUT = 180  # seconds per process pair; a normal run takes a few (generous for loaded CI)

DDP_CASES = {
    c.name: c
    for c in (
        Case("unlimited", fraction=None),
        Case("default"),
        Case("bucket_view", options={"gradient_as_bucket_view": True}, optimizer="adam"),
        Case("no_sync", micro_batches=2),
        Case("zero_grad_none", set_to_none=True, optimizer="adam"),
    )
}
GATHERED = {"reshard_after_forward": False}  # what lets dtr evict under FSDP2 (Note [FSDP2])
FSDP2_CASES = {
    c.name: c
    for c in (
        Case("fsdp2_unlimited", "fsdp2", fraction=None),  # FSDP2's default: reshard after forward
        Case("fsdp2_gathered", "fsdp2", GATHERED, optimizer="adam"),
        Case("fsdp2_accumulation", "fsdp2", GATHERED, micro_batches=2),
        Case("fsdp2_zero_grad_none", "fsdp2", GATHERED, set_to_none=True, optimizer="adam"),
        Case("fsdp2_reshard_budget", "fsdp2", fraction=0.5),  # last: it raises on every rank
    )
}


def _run(fn, tmp: Path, *args):
    """Run ``fn`` on ``WORLD`` ranks; the folder it wrote its results to, and the error it
    failed with (None if it did not), for the tests to report when their results are missing."""
    out = tmp / "out"
    out.mkdir()
    try:
        launch(fn, (WORLD, tmp / "store", out, *args), WORLD, TIMEOUT)
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
    return _run(worker, tmp_path_factory.mktemp("ddp"), list(DDP_CASES.values()))


@pytest.fixture(scope="module")
def fsdp2_results(tmp_path_factory):
    try:
        fully_shard_api()
    except ImportError as e:
        pytest.skip(f"FSDP2 (fully_shard) is not in torch {torch.__version__}: {e}")
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        # torch 2.4.1's FSDP2 (torch.distributed._composable.fsdp only) makes CUDA streams in
        # its first forward, so it cannot run in these CPU processes; the public fully_shard of
        # later torch picks its streams by device.
        pytest.skip(f"FSDP2 in torch {torch.__version__} needs CUDA streams; these ranks run on CPU")
    return _run(worker, tmp_path_factory.mktemp("fsdp2"), list(FSDP2_CASES.values()))


def _check(results, cases, case):
    out, error = results
    for rank, result in enumerate(_load(out, case, error)):
        assert "error" not in result, f"rank {rank}: {result['error']}"
        diff = mismatches(result["eager"], result["dtr"])
        assert not diff, f"rank {rank}: {diff}"
        if cases[case].fraction is not None:
            assert result["stats"]["evictions"] > 0, f"rank {rank}: no evictions at {result['budget']} bytes"
            assert result["stats"]["peak_resident_bytes"] <= result["budget"], f"rank {rank}"
        if cases[case].set_to_none:  # each block's gradients are new, and charged once each
            assert result["stats"]["gradient_bytes"] == result["grad_bytes"], f"rank {rank}"


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_matches_eager(ddp_results, case):
    """DDP's gradients and parameters under dtr equal eager's bit for bit on every rank, every
    step; under a budget of half the peak every rank evicts."""
    _check(ddp_results, DDP_CASES, case)


@pytest.mark.parametrize("case", [c for c in FSDP2_CASES if c != "fsdp2_reshard_budget"])
def test_fsdp2_matches_eager(fsdp2_results, case):
    """FSDP2's gradients and parameters (local shards) under dtr equal eager's bit for bit on
    every rank, every step: unlimited with FSDP2's defaults, and with the parameters kept
    gathered until backward at half the peak, where every rank evicts;
    with gradient accumulation (no gradient sync but in the last micro-batch) and with
    ``zero_grad()``'s default."""
    _check(fsdp2_results, FSDP2_CASES, case)


def test_fsdp2_reshard_after_forward_is_explained(fsdp2_results):
    """With FSDP2's default ``reshard_after_forward=True``, what a layer computed from its
    parameters cannot be recomputed once they are freed, so half the peak is out of reach in
    this MLP: every rank raises ``OutOfBudgetError`` (no rank left waiting), after a warning
    that says how to let dtr evict."""
    out, error = fsdp2_results
    for rank, result in enumerate(_load(out, "fsdp2_reshard_budget", error)):
        assert result.get("error", "").startswith("OutOfBudgetError"), f"rank {rank}: {result.get('error')}"
        assert any("reshard_after_forward=False" in w for w in result["warnings"]), f"rank {rank}: {result['warnings']}"
