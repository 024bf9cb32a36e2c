"""The coordinator's state, behind one interface with two implementations.

``MemoryStore`` (db/memory.py) serves the simulator and fast tests; ``SQLiteStore``
(db/sqlite.py) is production. Both pass one shared test suite (tests/test_store.py).

What lives here: the job, its steps, devices, GEMMs, checkpoints and every tile's lifecycle.
Each lease of a tile is one row: who, when, why it was issued (first, requeued after a loss,
speculative copy, deadline passed) and how it ended (verified, rejected, released, lost,
cancelled), so a tile's whole history can be read back. A tile may have several open leases at
once (a straggler's and its speculative copy); the first verified result wins and the others are
cancelled. Tensor payloads never come here: they stay in the coordinator's memory.

Time is always passed in (``now``, seconds since the epoch) so tests can move the clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from cleave.wire.codes import Name


class TileState(Name):
    """A tile's state. A tile whose last open lease ends other than verified goes back to QUEUED."""

    QUEUED = "queued"
    LEASED = "leased"
    TAKEN = "taken"  # its result is in and waits for its row band's check (checks by band)
    VERIFIED = "verified"
    ABANDONED = "abandoned"  # its coordinator died with the tile's operands; a resumed job recomputes it


class Outcome(Name):
    """How a lease ended."""

    VERIFIED = "verified"
    TAKEN = "taken"  # its result is in, waiting for its band's check: verified or rejected then
    REJECTED = "rejected"  # its result failed verification
    RELEASED = "released"  # the device gave it back (release, pause or leave)
    LOST = "lost"  # the device's connection closed, it went silent or was dropped
    CANCELLED = "cancelled"  # another copy of the tile was verified first
    REVOKED = "revoked"  # the coordinator took it back from a holder long past its deadline


class Issued(Name):
    """Why a lease was issued, besides "requeued after <outcome>" (``requeued``)."""

    FIRST = "first"
    SPECULATIVE = "speculative"  # a copy for a free device while every tile is out
    DEADLINE = "deadline passed"  # a copy of a tile whose holder is late

    @staticmethod
    def requeued(outcome: str) -> str:
        """The issue of a lease whose tile was queued again after a lease ended ``outcome``."""
        return f"requeued after {outcome}"


class IdentityState(Name):
    """An enrolled identity's state. Only an operator turns a banned or revoked one active again."""

    ACTIVE = "active"
    BANNED = "banned"
    REVOKED = "revoked"


class DeviceStatus(Name):
    """A device's row in a job (one per identity per job)."""

    ONLINE = "online"
    PAUSED = "paused"  # connected, its owner needs the machine
    OFFLINE = "offline"
    BANNED = "banned"
    REVOKED = "revoked"


class JobState(Name):
    """A job's state: running while a coordinator trains it (and after that coordinator was killed),
    stopped after Ctrl-C or an error once it had recorded a step, failed when its start ended
    before its first step, finished after its last step."""

    RUNNING = "running"
    STOPPED = "stopped"
    FAILED = "failed"
    FINISHED = "finished"


# What ``tile_counts`` reports: tiles per state, leases per outcome that ended badly, and leases
# per reason of issue (``requeued``: "requeued after ...", ``expired``: a copy past a deadline).
COUNTED_OUTCOMES = (Outcome.REJECTED, Outcome.LOST, Outcome.CANCELLED, Outcome.REVOKED)
TILE_COUNTS = (*TileState, *COUNTED_OUTCOMES, "requeued", Issued.SPECULATIVE.value, "expired")
RESTARTED = "coordinator restarted"  # why a dead run's devices went offline and its leases were lost
RESUMABLE = (JobState.RUNNING, JobState.STOPPED)  # a job a restarted coordinator takes up again
CONNECTED = (DeviceStatus.ONLINE, DeviceStatus.PAUSED)  # rows of devices with a live session


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
    tiles_lost: int = 0
    tiles_revoked: int = 0
    identity_id: int | None = None
    joules: float = 0.0  # its energy reports as booked (engine/energy.py): capped ones at their cap
    energy_flagged: int = 0  # its reports that were capped
    gflop_metered: float = 0.0  # of its verified GFLOP, those its energy reports covered

    @property
    def reliability(self) -> float:
        """Share of its finished work that came back verified (cancelled copies don't count)."""
        return _reliability(self.tiles_done, self.tiles_rejected + self.tiles_lost + self.tiles_revoked)


def _reliability(done: int, failed: int) -> float:
    return done / (done + failed) if done + failed else 1.0


def finite_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """A step's extra fields as strict JSON holds them: a non-finite float (a diverged held-out
    loss) becomes None, as the metrics file writes it, so SQLite's json functions read every row."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return {k: clean(v) for k, v in value.items()} if isinstance(value, dict) else value

    return clean(dict(extra or {}))


@dataclass
class IdentityRow:
    """An enrolled device: its credential's owner. Credit, bans and reliability belong here; its
    totals are summed over the device rows it had in every job."""

    id: int
    name: str
    state: str
    reason: str
    created_at: float
    last_seen: float
    tiles_done: int = 0
    tiles_rejected: int = 0
    tiles_lost: int = 0
    tiles_revoked: int = 0
    gflop_verified: float = 0.0

    @property
    def reliability(self) -> float:
        return _reliability(self.tiles_done, self.tiles_rejected + self.tiles_lost + self.tiles_revoked)


@dataclass(frozen=True)
class LeaderRow:
    identity_id: int
    name: str
    gflop: float
    tiles: int
    joules: float = 0.0  # booked over every job
    gflop_metered: float = 0.0  # of ``gflop``, those energy reports covered

    @property
    def gflop_per_j(self) -> float | None:
        """Verified GFLOP its energy reports covered, per booked joule (None: no energy booked).
        Work no report covered is left out: it cannot make a device look efficient."""
        return self.gflop_metered / self.joules if self.joules > 0 else None


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
    issued: str = Issued.FIRST


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
    issued: str = Issued.FIRST


@dataclass(frozen=True)
class LeaseEnd:
    requeued: bool  # the tile went back to the queue (no other copy is out)
    cancelled: tuple[int, ...] = ()  # devices whose copies were cancelled by this verified result


@dataclass(frozen=True)
class CheckpointRow:
    job_id: int
    step: int
    path: str
    sha256: str
    bytes: int
    created_at: float


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
        self,
        job_id: int,
        step: int,
        loss: float,
        tokens: int,
        seconds: float,
        now: float,
        extra: dict[str, Any] | None = None,
    ) -> None: ...
    def steps(self, job_id: int) -> list[StepRow]: ...

    # --- identities and settings
    def enrol(self, name: str, key: bytes, now: float) -> int:
        """A new identity, active, holding the stored key of its secret; returns its id."""
        ...

    def identity(self, identity_id: int) -> IdentityRow | None: ...
    def identity_key(self, identity_id: int) -> bytes | None: ...
    def identities(self, limit: int = 1000) -> list[IdentityRow]:
        """Newest first."""
        ...

    def identity_states(self, identity_ids: Sequence[int]) -> dict[int, str]: ...
    def set_identity_state(self, identity_id: int, state: str, reason: str, now: float) -> None: ...
    def leaderboard(self, limit: int = 10, by: str = "gflop") -> list[LeaderRow]:
        """Verified GFLOP, tiles and booked joules per active identity over every job, best first
        (a banned or revoked one is not ranked: the leaderboard is public). ``by``: ``gflop``, or
        ``gflop_per_j`` (metered GFLOP per booked joule; only identities with energy booked)."""
        ...

    def identity_total(self, identity_id: int) -> tuple[float, int]:
        """Verified GFLOP and tiles of one identity over every job."""
        ...

    def setting(self, key: str) -> str | None: ...
    def set_setting(self, key: str, value: str) -> None: ...
    def changed(self) -> bool:
        """True when another process wrote to the store since the last call (an operator's
        revoke, unban or token rotation)."""
        ...

    # --- devices
    def add_device(self, job_id: int, info: DeviceInfo, now: float, identity_id: int | None = None) -> int:
        """The device row of ``identity_id`` in this job, created or brought back online (one
        row per identity per job, however often it reconnects); a new row when no identity."""
        ...

    def set_device_state(self, device_id: int, state: str, now: float, reason: str = "") -> None: ...
    def credit_device(
        self,
        device_id: int,
        *,
        verified: int = 0,
        rejected: int = 0,
        lost: int = 0,
        revoked: int = 0,
        gflop: float = 0.0,
        joules: float = 0.0,
        energy_flagged: int = 0,
        gflop_metered: float = 0.0,
        now: float,
    ) -> None: ...
    def devices(self, job_id: int, *, states: Sequence[str] | None = None, limit: int | None = None) -> list[DeviceRow]:
        """The devices of this job (in ``states`` if given), by id, at most ``limit``."""
        ...

    def device_states(self, job_id: int) -> dict[str, int]:
        """How many of this job's devices are in each recorded state."""
        ...

    # --- GEMMs and tiles
    def next_gemm_id(self) -> int:
        """The id the next ``add_gemm`` must use (block keys are derived from it first)."""
        ...

    def add_gemm(
        self,
        gemm_id: int,
        job_id: int,
        step: int,
        kind: str,
        shape: tuple[int, int, int],
        tiles: Sequence[NewTile],
        now: float,
    ) -> list[int]:
        """Record a GEMM and queue its tiles; returns the tile ids."""
        ...

    def finish_gemm(self, gemm_id: int, now: float) -> None: ...
    def claim_tile(self, device_id: int, prefer: Sequence[str], now: float) -> ClaimedTile | None:
        """(Tests and tools; the coordinator's scheduler picks tiles itself, ``lease_tile``.)
        Lease the best queued tile to ``device_id``: one holding the most of the blocks in
        ``prefer`` (already on the device), then the oldest. Never a tile the device failed."""
        ...

    def lease_tile(self, tile_id: int, device_id: int, now: float) -> ClaimedTile | None:
        """Lease the queued tile the scheduler chose to ``device_id``; None when it is not queued
        or the device is barred from it."""
        ...

    def lease_tiles(self, leases: Sequence[tuple[int, int]], now: float) -> list[ClaimedTile | None]:
        """``lease_tile`` for each (tile, device) in order, written together (one statement per
        batch where the store can): the scheduler's leases of one dispatch."""
        return [self.lease_tile(tile_id, device_id, now) for tile_id, device_id in leases]

    def claim_copy(self, tile_id: int, device_id: int, issued: str, now: float) -> ClaimedTile | None:
        """Lease one more copy of an outstanding tile (speculation, or its deadline passed), unless
        the device already holds one or failed it. ``issued`` says why."""
        ...

    def end_lease(
        self, tile_id: int, device_id: int, outcome: str, now: float, reason: str = "", bar: bool = False
    ) -> LeaseEnd:
        """Close the device's open lease on the tile. ``verified`` finishes the tile and cancels
        its other copies; ``taken`` does the same but leaves the tile ``taken`` until its band's
        check (``verify_taken``, ``reject_taken``); otherwise the tile is queued again once no copy is out. ``rejected``
        (or ``bar``) also bars that device from the tile."""
        ...

    def release_device(self, device_id: int, outcome: str, now: float, reason: str = "") -> list[int]:
        """End every open lease of a device (it left or was lost); returns the tiles re-queued."""
        ...

    def verify_taken(self, results: Sequence[tuple[int, int]], now: float) -> None:
        """The (tile, device) results ``taken`` for their band passed its check: their leases and
        tiles become ``verified``, all in one write."""
        ...

    def reject_taken(
        self, tile_id: int, device_id: int, now: float, reason: str, outcome: str = Outcome.REJECTED
    ) -> None:
        """A result ``taken`` for its band is not used: its lease ends ``rejected`` (it failed the
        check) or ``revoked`` (its device was banned first), the tile is queued again and that
        device barred from it."""
        ...

    def leased_to(self, device_id: int) -> list[int]: ...
    def tile_state(self, tile_id: int) -> str: ...
    def lost_reasons(self, job_id: int, limit: int = 8) -> dict[str, int]:
        """Why a job's leases were lost: reason -> leases, the most common ``limit`` reasons."""
        ...

    def tile_counts(self, job_id: int) -> dict[str, int]:
        """A job's ``queued``, ``leased`` and ``verified`` tiles, and its leases that were
        ``rejected``, ``lost``, ``cancelled``, ``revoked``, issued ``requeued``, ``speculative`` or
        ``expired`` (a copy issued because a deadline passed)."""
        ...

    def leases(self, tile_id: int) -> list[LeaseRow]: ...

    # --- checkpoints and resuming
    def unbar_tile(self, tile_id: int) -> None:
        """Every device may take the tile again (it had been failed by every device there was)."""
        ...

    def add_checkpoint(self, row: CheckpointRow) -> None: ...
    def checkpoints(self, job_id: int) -> list[CheckpointRow]:
        """Newest first."""
        ...

    def newest_job(self) -> JobRow | None:
        """The job created last, whatever its state; None in a database without jobs."""
        ...

    def resumable_job(self) -> JobRow | None:
        """The newest job, if its coordinator was killed (``running``) or stopped (``stopped``);
        a job that finished, or whose start failed before training (``failed``), is not."""
        ...

    def mark_devices_offline(self, reason: str) -> None:
        """Devices recorded online by a coordinator that is gone are offline, whatever they say."""
        ...

    def truncate_steps(self, job_id: int, after: int) -> None:
        """Forget steps after ``after`` (they are computed again from a checkpoint)."""
        ...

    def abandon_unfinished(self, job_id: int | None, now: float) -> int:
        """A (re)started coordinator: unfinished tiles of ``job_id`` (None: of every job) are
        abandoned, since their operands died with the last coordinator, and their open leases
        end as lost. Returns how many tiles."""
        ...

    def prune_gemms(self, job_id: int, through_step: int) -> int:
        """Delete the rows of ``job_id``'s finished GEMMs (``done_at`` set) of steps up to
        ``through_step``: their leases, tiles and GEMM rows, in one write (``--prune-steps``). What
        they counted is kept per job, so ``tile_counts`` and ``lost_reasons`` read the same after,
        also once recounted from the rows. The newest GEMM of the store is always kept (the next
        GEMM id, from which block keys derive, must never go back). Returns the GEMMs deleted."""
        ...

    def flush(self) -> None:
        """Make every write so far durable (a store may group hot-path writes; see db/sqlite.py)."""
        ...

    def batch(self) -> AbstractContextManager[None]:
        """Hot-path writes of one batch (a verifier batch settled and dispatched) as one unit:
        the calls inside it share one savepoint instead of one each (db/sqlite.py)."""
        ...

    def close(self) -> None: ...
