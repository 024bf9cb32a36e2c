"""Prometheus metrics: ``GET /metrics`` on the coordinator's own port, in the text format.

Counters and gauges are read from the job's books when scraped (the Core's counts, which the
store keeps, the server's traffic), so they never disagree with ``cleave status``; only the step
times are a histogram observed as each step finishes. A scrape is rendered at most once per
``MIN_INTERVAL`` and served from that copy otherwise, so scraping in a loop costs the event
loop nothing more. Only job-wide aggregates: no device names, addresses or identities.

Needs ``prometheus-client`` (``pip install 'cleave[metrics]'``); without it ``/metrics`` answers
404 with a one-line hint, and training is unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

try:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import CONTENT_TYPE_LATEST
except ImportError:  # an optional extra
    CollectorRegistry = None  # type: ignore[assignment,misc]

PATH = "/metrics"
MIN_INTERVAL = 1.0  # seconds between two renderings; scrapes in between get the last one
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TILE_OUTCOMES = ("verified", "rejected", "lost", "cancelled", "revoked", "requeued", "speculative", "expired")
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
        yield CounterMetricFamily("cleave_steps", "Training steps finished.", value=job.get("step") or 0)
        loss = GaugeMetricFamily("cleave_loss", "Loss of the last finished step (NaN before the first).")
        loss.add_metric([], float("nan") if job.get("loss") is None else float(job["loss"]))
        yield loss
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
        states = GaugeMetricFamily("cleave_devices", "Devices of this job by state.", labels=["state"])
        for state, n in sorted(s.get("device_counts", {}).items()):
            states.add_metric([state], n)
        yield states
        share = (job.get("gemm_share") or {}).get("share")
        if share is not None:
            yield GaugeMetricFamily(
                "cleave_gemm_share",
                "Share of the model's GEMM FLOPs that can go to devices (the planner decides each GEMM).",
                value=share,
            )


class Metrics:
    """The coordinator's registry: the books collector and the step-time histogram."""

    def __init__(self, status: Callable[[], dict[str, Any]], clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._cached: tuple[float, bytes] | None = None
        self.registry = None
        if not available():
            return
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Books(status))
        self.step_seconds = Histogram(
            "cleave_step_seconds", "Wall seconds of each training step.", buckets=STEP_BUCKETS, registry=self.registry
        )

    def step(self, seconds: float) -> None:
        if self.registry is not None:
            self.step_seconds.observe(seconds)
            self._cached = None  # a step's figures show at the next scrape

    def render(self) -> tuple[int, str, bytes]:
        """(HTTP status, content type, body) of a scrape."""
        if self.registry is None:
            return 404, "text/plain; charset=utf-8", MISSING.encode()
        now = self.clock()
        if self._cached is None or now - self._cached[0] >= MIN_INTERVAL:
            self._cached = (now, generate_latest(self.registry))
        return 200, CONTENT_TYPE_LATEST, self._cached[1]
