"""The coordinator's state, behind one interface with two implementations.

``MemoryStore`` (db/memory.py) serves the simulator and fast tests; ``SQLiteStore``
(db/sqlite.py) is production. Both pass one shared test suite (tests/test_store.py).

What lives here: the job, its steps, devices, GEMMs and every tile's lifecycle. Each lease of a
tile is one row (who, when leased, when it ended, and how: verified, rejected, released, lost),
so a tile's whole history can be read back. Tensor payloads never come here: they stay in the
coordinator's memory.

Time is always passed in (``now``, seconds since the epoch) so tests can move the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

# Tile states. A rejected, released or lost lease puts its tile back to QUEUED.
QUEUED, LEASED, VERIFIED = "queued", "leased", "verified"
# Lease outcomes.
OUTCOMES = ("verified", "rejected", "released", "lost")


class StoreError(RuntimeError):
    """A store call that cannot be honoured (unknown id, tile not leased to that device...)."""


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    platform: str = ""
    cores: int = 1
    memory_bytes: int = 0
    device: str = "cpu"
    gflops: float = 0.0


@dataclass
class DeviceRow:
    id: int
    name: str
    platform: str
    cores: int
    memory_bytes: int
    device: str
    gflops: float
    state: str
    joined_at: float
    last_seen: float
    tiles_done: int = 0
    tiles_rejected: int = 0
    gflop_verified: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class NewTile:
    """A tile to queue. Keys name its input blocks as devices cache them."""

    index: int
    a_key: str
    b_key: str
    flops: int


@dataclass(frozen=True)
class ClaimedTile:
    id: int
    gemm_id: int
    index: int
    a_key: str
    b_key: str
    attempt: int


@dataclass
class JobRow:
    id: int
    name: str
    config: dict[str, Any]
    state: str
    step: int
    steps: int
    created_at: float
    finished_at: float | None = None


@dataclass
class LeaseRow:
    tile_id: int
    device_id: int
    leased_at: float
    ended_at: float | None
    outcome: str | None
    reason: str = ""


@dataclass
class StepRow:
    step: int
    loss: float
    tokens: int
    seconds: float
    at: float
    extra: dict[str, Any] = field(default_factory=dict)


class Store(Protocol):
    """Everything the coordinator persists. All writes are atomic per call."""

    # --- job and steps
    def create_job(self, name: str, config: dict[str, Any], steps: int, now: float) -> int: ...
    def job(self, job_id: int) -> JobRow: ...
    def set_job_state(self, job_id: int, state: str, now: float) -> None: ...
    def record_step(
        self, job_id: int, step: int, loss: float, tokens: int, seconds: float, now: float,
        extra: dict[str, Any] | None = None,
    ) -> None: ...
    def steps(self, job_id: int) -> list[StepRow]: ...

    # --- devices
    def add_device(self, job_id: int, info: DeviceInfo, now: float) -> int: ...
    def set_device_state(self, device_id: int, state: str, now: float, reason: str = "") -> None: ...
    def credit_device(self, device_id: int, *, verified: int, rejected: int, gflop: float, now: float) -> None: ...
    def devices(self, job_id: int) -> list[DeviceRow]:
        """The devices that joined this job (each connection is one device row)."""
        ...

    # --- GEMMs and tiles
    def next_gemm_id(self) -> int:
        """The id the next ``add_gemm`` must use (block keys are derived from it first)."""
        ...
    def add_gemm(
        self, gemm_id: int, job_id: int, step: int, kind: str, shape: tuple[int, int, int],
        tiles: Sequence[NewTile], now: float,
    ) -> list[int]:
        """Record a GEMM and queue its tiles; returns the tile ids."""
        ...
    def finish_gemm(self, gemm_id: int, now: float) -> None: ...
    def claim_tile(self, device_id: int, prefer: Sequence[str], now: float) -> ClaimedTile | None:
        """Lease the best queued tile to ``device_id``: one holding the most of the blocks in
        ``prefer`` (already on the device), then the oldest. Never a tile the device failed."""
        ...
    def end_lease(self, tile_id: int, device_id: int, outcome: str, now: float, reason: str = "") -> None:
        """Close the device's open lease on the tile. ``verified`` finishes the tile; any other
        outcome queues it again (``rejected`` also bars that device from it)."""
        ...
    def release_device(self, device_id: int, outcome: str, now: float, reason: str = "") -> list[int]:
        """End every open lease of a device (it left or was lost); returns the re-queued tile ids."""
        ...
    def leased_to(self, device_id: int) -> list[int]: ...
    def tile_state(self, tile_id: int) -> str: ...
    def tile_counts(self, job_id: int) -> dict[str, int]:
        """A job's ``queued``, ``leased`` and ``verified`` tiles and its ``rejected`` leases."""
        ...
    def leases(self, tile_id: int) -> list[LeaseRow]: ...
    def close(self) -> None: ...
