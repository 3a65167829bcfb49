"""A job's worker prepares the host AdamW kernel before it trains, and says so."""

from __future__ import annotations

import pytest

from pstar_core.kernels import adam
from service.worker import loop as worker


class _Events:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.phases: list[str] = []

    def event(self, message: str, **_data) -> None:
        self.events.append(message)

    def phase(self, detail: str) -> None:
        self.phases.append(detail)


def test_a_worker_on_a_cpu_nothing_prepared_measures_before_training_and_says_so(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PSTAR_EXT_DIR", str(tmp_path))  # a new CPU type: nothing on disk
    monkeypatch.delenv("PSTAR_ADAM_BACKEND", raising=False)
    # and no compiler there: the build really fails (with or without one on this machine)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(adam, "_ext_module", None)
    monkeypatch.setattr(adam, "_ext_failed", False)
    monkeypatch.setattr(adam, "_MEASURE_ELEMS", 1 << 16)
    rep = _Events()
    worker.prepare_kernels(rep)
    assert rep.phases == ["preparing kernels"]
    assert len(rep.events) == 2
    assert "not prepared for this CPU" in rep.events[0]
    assert "could not be built (torch's fused AdamW runs)" in rep.events[1]
    assert " s (" in rep.events[1]  # the time it took
    assert adam.prepared()
    again = _Events()
    worker.prepare_kernels(again)  # the next job on this node: nothing to do or say
    assert again.events == []
    assert again.phases == []


@pytest.mark.parametrize("backend", ["fused", "torch"])
def test_a_forced_backend_needs_no_preparation(monkeypatch, backend):
    monkeypatch.setenv("PSTAR_ADAM_BACKEND", backend)
    rep = _Events()
    worker.prepare_kernels(rep)
    assert rep.events == []
