"""The dtr logger: quiet by default, DTR_DEBUG=1 logs each eviction and replay; warnings are
logged too."""

from __future__ import annotations

import logging

import pytest
import torch

import dtr
from dtr.log import logger

N = 128
TENSOR = N * N * 4


@pytest.fixture(autouse=True)
def restore_logger():
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


def step(limit=6 * TENSOR):
    x = torch.randn(N, N, requires_grad=True)
    with dtr.budget(limit, cost="estimate") as engine:
        y = x * 1
        for _ in range(20):
            y = torch.tanh(y)
        y.sum().backward()
        del y
    return engine.stats()


def debug_records(caplog, word):
    return [r for r in caplog.records if r.name == "dtr" and r.levelno == logging.DEBUG and r.getMessage().startswith(word)]


def test_quiet_by_default(caplog, monkeypatch):
    monkeypatch.delenv("DTR_DEBUG", raising=False)
    stats = step()
    assert stats.evictions > 0
    assert [r for r in caplog.records if r.name == "dtr"] == []


def test_dtr_debug_logs_every_eviction_and_replay(caplog, monkeypatch, capsys):
    monkeypatch.setenv("DTR_DEBUG", "1")
    stats = step()  # the block's start reads DTR_DEBUG
    assert logger.level == logging.DEBUG
    evictions, replays = debug_records(caplog, "evict "), debug_records(caplog, "replay ")
    assert len(evictions) == stats.evictions > 0
    assert len(replays) == stats.rematerializations > 0
    assert "made by aten.tanh.default" in evictions[0].getMessage()
    assert "dtr DEBUG: evict" in capsys.readouterr().err  # DTR_DEBUG's own handler


def test_dtr_debug_0_changes_nothing(caplog, monkeypatch):
    monkeypatch.setenv("DTR_DEBUG", "0")
    step()
    assert logger.level == logging.NOTSET and debug_records(caplog, "evict ") == []


def test_warnings_are_logged(caplog):
    x = torch.randn(N, N, requires_grad=True)
    with pytest.warns(UserWarning, match="replayed at block exit"):
        with dtr.budget(3 * TENSOR, cost="estimate"):
            y = x * 1
            for _ in range(10):
                y = torch.tanh(y)
    y.sum().backward()
    assert any(r.name == "dtr" and r.levelno == logging.WARNING and "replayed at block exit" in r.getMessage()
               for r in caplog.records)
