"""Prometheus metrics: ``GET /metrics`` on the coordinator's own port, in the text format.

Counters and gauges are read from the job's books when scraped (the Core's counts, which the
store keeps, the server's traffic), so they never disagree with ``cleave status``; only the step
times are a histogram observed as each step finishes. A scrape is rendered at most once per
``MIN_INTERVAL`` and served from that copy otherwise, so scraping in a loop costs the event
loop nothing more.

Anyone who reaches the port sees the job-wide series. A scrape with the operator token
(``Authorization: Bearer``) also gets one set of series per device, labelled ``device="NAME #N"``
(the name and number ``cleave status`` shows): at most ``Limits.status_rows`` devices (100),
connected ones first, so a fleet of any size adds a bounded number of series.

On a tier of coordinators (``--world-size``), every series of a rank carries ``rank="R"``, so
one Prometheus scraping every rank keeps them apart.

Needs ``prometheus-client`` (``pip install 'cleave[metrics]'``); without it ``/metrics`` answers
404 with a one-line hint, and training is unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from cleave.wire.codes import JobPhase
from cleave.wire.messages import PROTOCOL_VERSION
from cleave.wire.version import package_version

try:
    from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
except ImportError:  # an optional extra
    CollectorRegistry = None  # type: ignore[assignment,misc]

PATH = "/metrics"
MIN_INTERVAL = 1.0  # seconds between two renderings; scrapes in between get the last one
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TILE_OUTCOMES = ("verified", "rejected", "lost", "cancelled", "revoked", "requeued", "speculative", "expired")
DEVICE_OUTCOMES = (("verified", "tiles_done"), ("rejected", "tiles_rejected"), ("lost", "tiles_lost"),
                   ("revoked", "tiles_revoked"))  # fmt: skip
MISSING = "metrics need prometheus-client: pip install 'cleave[metrics]'\n"


def available() -> bool:
    return CollectorRegistry is not None


class _Books:
    """A collector that reads the job's status when scraped."""

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status

    def describe(self) -> list:  # no help texts to precompute: collect() says everything
        return []

    def collect(self) -> Iterator[Any]:
        s = self.status()
        job, tiles, traffic = s.get("job", {}), s.get("tiles", {}), s.get("traffic", {})
        info = GaugeMetricFamily(
            "cleave_build_info",
            "The coordinator's version and wire protocol (always 1).",
            labels=["version", "protocol"],
        )
        info.add_metric([package_version(), str(PROTOCOL_VERSION)], 1)
        yield info
        phase = GaugeMetricFamily("cleave_job_state", "1 for the job's state, 0 for the others.", labels=["state"])
        for state in JobPhase:
            phase.add_metric([state.value], 1 if job.get("state") == state.value else 0)
        yield phase
        yield GaugeMetricFamily(
            "cleave_job_steps", "Steps the job trains in all (its target).", value=job.get("steps") or 0
        )
        yield CounterMetricFamily("cleave_steps", "Training steps finished.", value=job.get("step") or 0)
        loss = GaugeMetricFamily("cleave_loss", "Loss of the last finished step (NaN before the first).")
        loss.add_metric([], float("nan") if job.get("loss") is None else float(job["loss"]))
        yield loss
        val = GaugeMetricFamily(
            "cleave_val_loss",
            "Held-out loss of the last evaluation (--eval-every; NaN before the first, or without one).",
        )
        val.add_metric([], float("nan") if job.get("val_loss") is None else float(job["val_loss"]))
        yield val
        yield CounterMetricFamily(
            "cleave_tokens", "Tokens trained by this coordinator.", value=s.get("tokens_trained", 0)
        )
        yield GaugeMetricFamily(
            "cleave_tokens_per_second",
            "Tokens trained per second since training began.",
            value=job.get("tokens_per_s") or 0.0,
        )
        outcomes = CounterMetricFamily(
            "cleave_tiles", "Tile leases by outcome, and tiles verified.", labels=["outcome"]
        )
        for outcome in TILE_OUTCOMES:
            outcomes.add_metric([outcome], tiles.get(outcome, 0))
        yield outcomes
        moved = CounterMetricFamily("cleave_bytes", "Websocket frame bytes to and from devices.", labels=["direction"])
        moved.add_metric(["down"], traffic.get("bytes_down", 0))
        moved.add_metric(["up"], traffic.get("bytes_up", 0))
        yield moved
        yield CounterMetricFamily(
            "cleave_relay_bytes",
            "Block bytes the coordinator's devices were told to fetch from relays (served there, not here).",
            value=traffic.get("bytes_relay_out", 0),
        )
        energy = s.get("energy", {})
        joules = CounterMetricFamily(
            "cleave_energy_joules",
            "Energy booked: devices' reports within their kind's band (source capped: claims cut to it) "
            "and the coordinator's own meter, by part and source.",
            labels=["part", "source"],
        )
        for part, key in (("devices", "devices_sources"), ("coordinator", "coordinator_sources")):
            for source, j in sorted(energy.get(key, {}).items()):
                joules.add_metric([part, source], j)
        yield joules
        increment = CounterMetricFamily(
            "cleave_energy_increment_joules",
            "Energy booked on the increment over machines on anyway: devices' booked draw less their idle draw "
            "while holding work (between 0 and the booked), the coordinator's own meter whole.",
            labels=["part"],
        )
        increment.add_metric(["devices"], energy.get("devices_increment_j", 0.0))
        increment.add_metric(["coordinator"], energy.get("coordinator_j", 0.0))
        yield increment
        yield CounterMetricFamily(
            "cleave_co2_grams",
            "Grams of CO2 of the energy booked, at each grid's stated intensity.",
            value=energy.get("gco2", 0.0),
        )
        yield CounterMetricFamily(
            "cleave_energy_flagged", "Device energy reports capped as implausible.", value=energy.get("flagged", 0)
        )
        yield CounterMetricFamily(
            "cleave_verify_seconds",
            "Seconds spent verifying results (Freivalds' check).",
            value=s.get("verify", {}).get("seconds", 0.0),
        )
        yield GaugeMetricFamily(
            "cleave_queue_depth", "Tiles queued, waiting for a device.", value=s.get("queue_depth", 0)
        )
        yield GaugeMetricFamily(
            "cleave_gemms_in_flight", "GEMMs submitted and not yet complete.", value=s.get("gemms_in_flight", 0)
        )
        # One state per device (the store's): the states add up to the devices this job has seen.
        counts = dict(s.get("device_counts", {}))
        connected = counts.pop("connected", 0)
        states = GaugeMetricFamily("cleave_devices", "Devices of this job by state (each in one).", labels=["state"])
        for state, n in sorted(counts.items()):
            states.add_metric([state], n)
        yield states
        yield GaugeMetricFamily("cleave_devices_connected", "Devices connected now.", value=connected)
        yield GaugeMetricFamily(
            "cleave_devices_standby",
            "Devices connected and in standby now: the plans leave them out (each is also online).",
            value=s.get("devices_standby", 0),
        )
        standby = s.get("standby") or {}
        yield CounterMetricFamily(
            "cleave_standby_sent", "Standby messages sent to devices the plans left out.", value=standby.get("sent", 0)
        )
        yield CounterMetricFamily(
            "cleave_wakes_sent", "Wake messages sent to devices in standby.", value=standby.get("woken", 0)
        )
        share = (job.get("gemm_share") or {}).get("share")
        if share is not None:
            yield GaugeMetricFamily(
                "cleave_gemm_share",
                "Share of the model's GEMM FLOPs that can go to devices (the planner decides each GEMM).",
                value=share,
            )


class _Devices:
    """Per-device series, for the operator's scrapes only."""

    def __init__(self, devices: Callable[[], list[dict[str, Any]]]) -> None:
        self.devices = devices

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        devices = self.devices()
        tiles = CounterMetricFamily(
            "cleave_device_tiles", "Tile leases of a device by how they ended.", labels=["device", "outcome"]
        )
        rate = GaugeMetricFamily(
            "cleave_device_gflops", "A device's GEMM rate (measured from its verified tiles).", labels=["device"]
        )
        work = CounterMetricFamily(
            "cleave_device_verified_gflop", "GFLOP a device computed and the coordinator verified.", labels=["device"]
        )
        up = GaugeMetricFamily("cleave_device_connected", "1 while a device is connected.", labels=["device"])
        seen = GaugeMetricFamily(
            "cleave_device_last_seen_timestamp_seconds", "When a device was last heard (Unix time).", labels=["device"]
        )
        energy = CounterMetricFamily(
            "cleave_device_energy_joules",
            "A device's energy reports as booked (capped ones at their cap).",
            labels=["device"],
        )
        for d in devices:
            label = [str(d.get("label") or d.get("name"))]
            energy.add_metric(label, d.get("joules") or 0.0)
            for outcome, key in DEVICE_OUTCOMES:
                tiles.add_metric([*label, outcome], d.get(key) or 0)
            rate.add_metric(label, d.get("gflops") or 0.0)
            work.add_metric(label, d.get("gflop_verified") or 0.0)
            up.add_metric(label, 1 if d.get("slots") else 0)
            if d.get("last_seen") is not None:
                seen.add_metric(label, d["last_seen"])
        yield from (tiles, rate, work, up, seen, energy)


class _Ranked:
    """Another registry's series, each with this coordinator's ``rank`` label once it has one."""

    def __init__(self, inner: Any, rank: Callable[[], int | None]) -> None:
        self.inner = inner
        self.rank = rank

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        rank = self.rank()
        for family in self.inner.collect():
            if rank is not None:
                family.samples = [s._replace(labels={**s.labels, "rank": str(rank)}) for s in family.samples]
            yield family


class Metrics:
    """The coordinator's registries: the books collector and the step-time histogram for every
    scrape, the per-device collector for the operator's. ``rank``: set once this coordinator is a
    rank of a tier; every series then carries it."""

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        clock: Callable[[], float] = time.monotonic,
        devices: Callable[[], list[dict[str, Any]]] = list,
    ) -> None:
        """``status``: the job's books (``report.books``); ``devices``: the status document's
        device rows (``report.status``, bounded by ``Limits.status_rows``)."""
        self.clock = clock
        self.rank: int | None = None
        self._cached: dict[bool, tuple[float, bytes]] = {}
        self.registry = None
        if not available():
            return
        disable_created_metrics()  # a histogram's _created series would read as a stray gauge
        books = CollectorRegistry(auto_describe=False)
        books.register(_Books(status))
        self.step_seconds = Histogram(
            "cleave_step_seconds", "Wall seconds of each training step.", buckets=STEP_BUCKETS, registry=books
        )
        per_device = CollectorRegistry(auto_describe=False)
        per_device.register(_Devices(devices))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Ranked(books, lambda: self.rank))
        self.devices = CollectorRegistry(auto_describe=False)
        self.devices.register(_Ranked(per_device, lambda: self.rank))

    def step(self, seconds: float) -> None:
        if self.registry is not None:
            self.step_seconds.observe(seconds)
            self._cached.clear()  # a step's figures show at the next scrape

    def render(self, operator: bool = False) -> tuple[int, str, bytes]:
        """(HTTP status, content type, body) of a scrape; ``operator``: with per-device series."""
        if self.registry is None:
            return 404, "text/plain; charset=utf-8", MISSING.encode()
        now = self.clock()
        cached = self._cached.get(operator)
        if cached is None or now - cached[0] >= MIN_INTERVAL:
            body = generate_latest(self.registry) + (generate_latest(self.devices) if operator else b"")
            cached = self._cached[operator] = (now, body)
        return 200, CONTENT_TYPE_LATEST, cached[1]
