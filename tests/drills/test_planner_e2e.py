"""The cost planner on loopback with unequal clients: a `cleave join` client at 1 thread and a
test double 4x slower. Real processes, real websockets."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from procs import Coordinator, double, join

from cleave.coordinator.training.loop import TrainConfig, Trainer

pytestmark = pytest.mark.drill  # real processes train through real sockets (README: the parts of the suite)

STEPS = 10
WARMUP = 3  # profiles start from priors; the first steps also warm caches


def _run(tmp: Path, planner: str, *args: str) -> list[dict]:
    tmp.mkdir()
    coord = Coordinator(tmp, "--min-devices", "2", *args, steps=STEPS, planner=planner)
    fast = join(coord.url, "fast")
    slow = double("slowed", coord.url, "slow", "4")
    assert coord.wait() == 0, coord.output
    assert fast.wait() == 0 and slow.wait() == 0
    return coord.rows()


@pytest.mark.alone  # it compares the cost model's predicted step time with the measured one
def test_the_cost_planner_beats_the_uniform_grid_and_predicts_its_step(tmp_path: Path) -> None:
    uniform = _run(tmp_path / "uniform", "uniform")
    cost = _run(tmp_path / "cost", "cost")
    local = [r.loss for r in Trainer(TrainConfig(steps=STEPS)).run()]
    for rows in (uniform, cost):
        for row, want in zip(rows, local, strict=True):
            assert abs(row["loss"] - want) <= 1e-4 * abs(want)
    cost_s = statistics.fmean(r["seconds"] for r in cost[WARMUP:])
    uniform_s = statistics.fmean(r["seconds"] for r in uniform[WARMUP:])
    assert cost_s < uniform_s, (cost_s, uniform_s)
    # Over the steps together: one 40 ms step on a loaded host is off by 40% either way (CI once saw
    # a median per-step error of 26%), while the steps' sum held within 17% of the prediction's.
    predicted = sum(r["predicted_s"] for r in cost[WARMUP:])
    measured = sum(r["seconds"] for r in cost[WARMUP:])
    assert abs(predicted - measured) <= 0.25 * measured, [(r["predicted_s"], r["seconds"]) for r in cost]
