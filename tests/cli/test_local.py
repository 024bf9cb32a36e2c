"""A job served with local client processes (``cleave train --local``, ``cleave demo``, the
Python API's ``serve_with_local_clients``): when every client is gone before the job ends, the
job stops with the reason rather than wait for devices that will never come."""

from __future__ import annotations

import asyncio
import time

import pytest

from cleave.cli.local import serve_with_local_clients
from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.job import Listening
from cleave.coordinator.training.loop import StepResult, TrainConfig
from cleave.wire.errors import CleaveError


class Quiet:
    """A reporter that keeps what the job said."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.listened = False

    def listening(self, info: Listening) -> None:
        self.listened = True

    def note(self, text: str) -> None:
        self.notes.append(text)

    def waiting(self, have: int, want: int) -> None: ...
    def step(self, result: StepResult, status: dict) -> None: ...
    def finished(self, results: list[StepResult], status: dict) -> None: ...


def test_a_job_whose_local_clients_all_exit_stops_with_the_reason(tmp_path) -> None:  # noqa: ANN001
    cfg = CoordinatorConfig(
        train=TrainConfig(model="tiny", steps=2), port=0, db=str(tmp_path / "job.db"), token="j" * 22,
        operator_token="o" * 22, checkpoint_every=0,
    )  # fmt: skip
    reporter = Quiet()
    start = time.monotonic()
    # --threads 0 is refused by every client at once: none ever joins the job, which waits for one.
    with pytest.raises(CleaveError, match=r"every local client exited \(codes \[2\]\) and the job did not end"):
        asyncio.run(serve_with_local_clients(cfg, reporter, clients=1, threads=0, exit_timeout=1.0, quiet_clients=True))
    assert reporter.listened, "the job listened: the clients were started for it"
    assert time.monotonic() - start < 60
