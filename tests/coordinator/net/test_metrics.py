"""Prometheus metrics: scraped over real HTTP on the coordinator's port during a real job with
two `cleave join` clients, and checked against the store's own rows."""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from procs import TOKEN, join  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from cleave.coordinator.config import CoordinatorConfig  # noqa: E402
from cleave.coordinator.engine.live_plan import Planner  # noqa: E402
from cleave.coordinator.job import serve_job  # noqa: E402
from cleave.coordinator.net import metrics as metrics_mod  # noqa: E402
from cleave.coordinator.net.server import Server  # noqa: E402
from cleave.coordinator.training.loop import StepResult, TrainConfig  # noqa: E402

STEPS = 12


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class _Checker:
    """A Reporter that, at every step (on the event loop, so nothing moves meanwhile), renders the
    metrics afresh and compares them with the store's rows and the server's counters."""

    def __init__(self) -> None:
        self.server: Server | None = None
        self.checked = 0

    def listening(self, info: Any) -> None: ...
    def note(self, text: str) -> None: ...
    def waiting(self, have: int, want: int) -> None: ...
    def finished(self, results: list[StepResult], status: dict) -> None: ...

    def step(self, result: StepResult, status: dict) -> None:
        assert self.server is not None
        core = self.server.core
        got = _samples(prometheus_client.generate_latest(self.server.metrics.registry).decode())
        rows = core.store.recount(core.job_id)  # from the rows themselves
        for outcome in metrics_mod.TILE_OUTCOMES:
            assert got[("cleave_tiles_total", (("outcome", outcome),))] == rows[outcome], outcome
        assert got[("cleave_queue_depth", ())] == rows["queued"]
        assert got[("cleave_steps_total", ())] == result.step
        assert got[("cleave_loss", ())] == pytest.approx(result.loss)
        assert got[("cleave_tokens_total", ())] == result.step * result.tokens
        assert got[("cleave_step_seconds_count", ())] == result.step
        assert got[("cleave_step_seconds_sum", ())] > 0
        assert got[("cleave_verify_seconds_total", ())] == pytest.approx(core.checks.seconds)
        assert got[("cleave_tokens_per_second", ())] == pytest.approx(core.progress.tokens_per_s)
        assert got[("cleave_bytes_total", (("direction", "down"),))] == self.server.traffic.bytes_down
        assert got[("cleave_bytes_total", (("direction", "up"),))] == self.server.traffic.bytes_up
        for state, n in core.store.device_states(core.job_id).items():
            assert got[("cleave_devices", (("state", state),))] == n
        self.checked += 1


def _scrape(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


@pytest.mark.drill
def test_metrics_are_scraped_over_http_during_a_job_and_agree_with_the_store(tmp_path: Path) -> None:
    checker = _Checker()
    cfg = CoordinatorConfig(
        train=TrainConfig(steps=STEPS),
        port=0,
        db=str(tmp_path / "m.db"),
        token=TOKEN,
        min_devices=2,
        planner=Planner.UNIFORM,
    )

    async def run() -> tuple[list, list]:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[str] = loop.create_future()
        job = asyncio.create_task(
            serve_job(cfg, checker, ready=ready.set_result, on_start=lambda s: setattr(checker, "server", s))
        )
        url = await ready
        http = url.replace("ws://", "http://")
        clients = [join(url, f"m{i}") for i in range(2)]
        scrapes = []
        while not job.done():
            try:
                scrapes.append(await asyncio.to_thread(_scrape, http + "/metrics?format=text"))
            except urllib.error.URLError:  # refused only because the job ended meanwhile
                await asyncio.wait_for(asyncio.shield(job), 10)
                break
            if len(scrapes) == 1:  # a path nobody serves is still no websocket: 426, as before
                assert (await asyncio.to_thread(_scrape, http + "/no-such-page"))[0] == 426
            await asyncio.sleep(0.2)
        await job
        return scrapes, [c.wait() for c in clients]

    scrapes, codes = asyncio.run(run())
    assert codes == [0, 0] and checker.checked == STEPS
    assert all(status == 200 for status, _, _ in scrapes)
    served = [_samples(text) for _, _, text in scrapes]
    assert served and all(ctype == prometheus_client.CONTENT_TYPE_LATEST for status, ctype, _ in scrapes)
    steps = [m[("cleave_steps_total", ())] for m in served]
    assert steps == sorted(steps) and steps[-1] > 0  # it moved while we watched, never backwards
    verified = [m[("cleave_tiles_total", (("outcome", "verified"),))] for m in served]
    assert verified == sorted(verified) and verified[-1] > 0


def test_a_coordinator_without_prometheus_client_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_mod, "CollectorRegistry", None)
    status, ctype, body = metrics_mod.Metrics(lambda: {}).render()
    assert status == 404 and b"pip install 'cleave[metrics]'" in body and ctype.startswith("text/plain")


def test_scrapes_in_a_loop_render_at_most_once_a_second() -> None:
    calls = []
    now = [0.0]
    m = metrics_mod.Metrics(lambda: calls.append(1) or {}, clock=lambda: now[0])
    for _ in range(50):
        assert m.render()[0] == 200
    now[0] += 1.0
    m.render()
    assert len(calls) == 2


def test_a_rank_of_a_tier_labels_every_series_with_its_rank() -> None:
    """Before it has joined a tier a coordinator's series have no rank label; once it is rank 1,
    every series of a scrape (the books, the step histogram, the operator's per-device ones) has
    rank="1", so one Prometheus scraping every rank keeps them apart."""
    devices = [{"label": "laptop #3", "tiles_done": 5, "gflops": 2.0, "slots": 2, "last_seen": 1.0}]
    m = metrics_mod.Metrics(lambda: {"job": {"state": "training", "step": 2}}, devices=lambda: devices)
    m.step(0.5)
    plain = [s for f in text_string_to_metric_families(m.render(operator=True)[2].decode()) for s in f.samples]
    assert plain and not any("rank" in s.labels for s in plain)
    m.rank = 1
    m.step(0.25)  # (a new step: the cached scrape is dropped)
    ranked = [s for f in text_string_to_metric_families(m.render(operator=True)[2].decode()) for s in f.samples]
    assert {s.name for s in ranked} == {s.name for s in plain}
    assert all(s.labels.get("rank") == "1" for s in ranked), [s for s in ranked if s.labels.get("rank") != "1"]
    assert any(s.name == "cleave_device_tiles_total" and s.labels["device"] == "laptop #3" for s in ranked)


def test_the_held_out_loss_is_a_gauge_nan_until_the_first_evaluation() -> None:
    """``cleave_val_loss``: the last evaluation's held-out loss; NaN before one (or without
    --eval-every), as ``cleave_loss`` is before the first step. promtool (where installed) passes
    both expositions."""
    job = {"state": "training", "step": 4, "steps": 20, "loss": 4.25}
    for status, want in (({"job": job}, None), ({"job": {**job, "val_loss": 4.5, "val_step": 4}}, 4.5)):
        text = metrics_mod.Metrics(lambda status=status: status).render()[2].decode()
        assert "# HELP cleave_val_loss Held-out loss of the last evaluation" in text
        assert "# TYPE cleave_val_loss gauge" in text
        got = _samples(text)[("cleave_val_loss", ())]
        assert math.isnan(got) if want is None else got == want
        if shutil.which("promtool"):
            run = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
            assert run.returncode == 0 and not run.stdout.strip() and not run.stderr.strip(), run.stdout + run.stderr


def test_the_energy_on_the_increment_is_a_counter_by_part_next_to_the_whole() -> None:
    """``cleave_energy_increment_joules``: devices' booked draw less their idle draw, and the
    coordinator's own whole, read from the books as ``cleave_energy_joules`` is."""
    energy = {
        "devices_sources": {"rapl": 900.0},
        "coordinator_sources": {"estimate": 500.0},
        "coordinator_j": 500.0,
        "devices_increment_j": 882.0,
    }
    text = metrics_mod.Metrics(lambda: {"energy": energy}).render()[2].decode()
    assert "# HELP cleave_energy_increment_joules_total Energy booked on the increment" in text
    got = _samples(text)
    assert got[("cleave_energy_increment_joules_total", (("part", "devices"),))] == 882.0
    assert got[("cleave_energy_increment_joules_total", (("part", "coordinator"),))] == 500.0
    assert got[("cleave_energy_joules_total", (("part", "devices"), ("source", "rapl")))] == 900.0
