"""The coordinator's state, behind one interface with two implementations.

``MemoryStore`` (db/memory.py) serves the simulator and fast tests; ``SQLiteStore``
(db/sqlite.py) is production. Both pass one shared test suite (tests/db/test_store.py). ``Store``,
their base class, holds what the two share: argument checks, defaults, the arithmetic of credit
and the shape of rows; each keeps behind the ``_``-prefixed hooks only what is its own (dicts or
SQL).

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
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cleave.wire.codes import Name
from cleave.wire.errors import StoreError


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


class Ranking(Name):
    """What a leaderboard ranks by."""

    GFLOP = "gflop"  # verified GFLOP
    GFLOP_PER_J = "gflop_per_j"  # metered GFLOP per booked joule (only identities with energy booked)


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
REQUEUED = "requeued"  # the key of leases issued "requeued after ..."
COPIES: dict[str, str] = {Issued.SPECULATIVE: Issued.SPECULATIVE.value, Issued.DEADLINE: "expired"}  # a copy's key
TILE_COUNTS = (*TileState, *COUNTED_OUTCOMES, REQUEUED, *COPIES.values())
ENDINGS = frozenset(Outcome) - {Outcome.CANCELLED}  # how end_lease may end a lease (the store cancels)
# The outcomes whose result wins the tile (its other copies are cancelled), and the state they leave it in.
WON: dict[str, TileState] = {Outcome.VERIFIED: TileState.VERIFIED, Outcome.TAKEN: TileState.TAKEN}
UNUSED = (Outcome.REJECTED, Outcome.REVOKED)  # how reject_taken may end a result waiting for its band
OUTRUN = "another copy was verified first"  # why a cancelled lease ended
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

    def values(self) -> tuple[str, str, int, int, str, float]:
        """Its fields in the order a device row holds them (DeviceRow, the devices table)."""
        return (self.name, self.platform, self.cores, self.memory_bytes, self.device, self.gflops)


class Credited:
    """A row's finished work: a device's in one job, or an identity's over every job."""

    tiles_done: int
    tiles_rejected: int
    tiles_lost: int
    tiles_revoked: int

    @property
    def reliability(self) -> float:
        """Share of its finished work that came back verified (cancelled copies don't count)."""
        failed = self.tiles_rejected + self.tiles_lost + self.tiles_revoked
        return self.tiles_done / (self.tiles_done + failed) if self.tiles_done + failed else 1.0


# What credit_device adds to a device row, in the order its hook takes them (DeviceRow's fields),
# and to its identity's totals over every job (the leaderboard's), in theirs.
CREDITED = (
    "tiles_done",
    "tiles_rejected",
    "tiles_lost",
    "tiles_revoked",
    "gflop_verified",
    "joules",
    "energy_flagged",
    "gflop_metered",
)
TOTALLED = ("gflop_verified", "tiles_done", "joules", "gflop_metered")
Credit = tuple[int, int, int, int, float, float, int, float]  # CREDITED's values
Totals = tuple[float, int, float, float]  # TOTALLED's values


def totals_of(credit: Credit) -> Totals | None:
    """What a device's credit adds to its identity's totals; None when it moves none of them
    (failures alone: no verified work or booked energy). Asked only of a device with an identity."""
    done, _, _, _, gflop, joules, _, metered = credit
    return (gflop, done, joules, metered) if done or gflop or joules or metered else None


@dataclass
class DeviceRow(Credited):
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


def finite_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    """A step's extra fields as strict JSON holds them: a non-finite float (a diverged held-out
    loss) becomes None, as the metrics file writes it, so SQLite's json functions read every row."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return {k: clean(v) for k, v in value.items()} if isinstance(value, dict) else value

    return clean(dict(extra or {}))


@dataclass
class IdentityRow(Credited):
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


@dataclass
class GemmRow:
    """A GEMM as recorded; ``done_at`` is set when it finished."""

    id: int
    job_id: int
    step: int
    kind: str
    shape: tuple[int, int, int]
    created_at: float
    done_at: float | None = None


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


T = TypeVar("T")


def _found(row: T | None, what: str, key: int) -> T:
    """``row``, or the error of an unknown id."""
    if row is None:
        raise StoreError(f"no {what} {key}")
    return row


def no_result(tile_id: int, device_id: int) -> StoreError:
    """What ``verify_taken`` and ``reject_taken`` raise for a result that is not waiting."""
    return StoreError(f"tile {tile_id} has no result of device {device_id} waiting for its band")


class Store(ABC):
    """Everything the coordinator persists. All writes are atomic per call.

    The public methods are the interface. Where both stores follow one rule (an argument checked,
    an unknown id refused, credit split between a device and its identity, a row built), the
    method here applies it and calls its ``_``-prefixed hook, which only reads or writes."""

    # --- job and steps
    @abstractmethod
    def create_job(self, name: str, config: dict[str, Any], steps: int, now: float) -> int: ...

    def job(self, job_id: int) -> JobRow:
        return _found(self._job(job_id), "job", job_id)

    @abstractmethod
    def _job(self, job_id: int) -> JobRow | None: ...

    @abstractmethod
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
    ) -> None:
        self._record_step(job_id, StepRow(step, loss, tokens, seconds, now, finite_extra(extra)))

    @abstractmethod
    def _record_step(self, job_id: int, row: StepRow) -> None:
        """Keep the step's row (replacing one of the same step) and make it the job's step."""

    @abstractmethod
    def steps(self, job_id: int) -> list[StepRow]: ...

    # --- identities and settings
    @abstractmethod
    def enrol(self, name: str, key: bytes, now: float) -> int:
        """A new identity, active, holding the stored key of its secret; returns its id."""

    @abstractmethod
    def identity(self, identity_id: int) -> IdentityRow | None: ...

    @abstractmethod
    def identity_key(self, identity_id: int) -> bytes | None: ...

    @abstractmethod
    def identities(self, limit: int = 1000) -> list[IdentityRow]:
        """Newest first."""

    @abstractmethod
    def identity_states(self, identity_ids: Sequence[int]) -> dict[int, str]: ...

    def set_identity_state(self, identity_id: int, state: str, reason: str, now: float) -> None:
        if state not in tuple(IdentityState):
            raise StoreError(f"an identity cannot be {state!r}")
        if not self._set_identity_state(identity_id, state, reason, now):
            raise StoreError(f"no identity {identity_id}")

    @abstractmethod
    def _set_identity_state(self, identity_id: int, state: str, reason: str, now: float) -> bool:
        """False when there is no such identity."""

    def leaderboard(self, limit: int = 10, by: str = Ranking.GFLOP) -> list[LeaderRow]:
        """Verified GFLOP, tiles and booked joules per active identity over every job, best first
        (a banned or revoked one is not ranked: the leaderboard is public). ``by``: ``gflop``, or
        ``gflop_per_j`` (metered GFLOP per booked joule; only identities with energy booked)."""
        if by not in tuple(Ranking):
            raise StoreError(f"a leaderboard ranks by gflop or gflop_per_j, not {by!r}")
        return self._leaderboard(limit, Ranking(by))

    @abstractmethod
    def _leaderboard(self, limit: int, by: Ranking) -> list[LeaderRow]: ...

    def identity_total(self, identity_id: int) -> tuple[float, int]:
        """Verified GFLOP and tiles of one identity over every job (its row's, ``identity``)."""
        row = self.identity(identity_id)
        return (float(row.gflop_verified), int(row.tiles_done)) if row is not None else (0.0, 0)

    @abstractmethod
    def setting(self, key: str) -> str | None: ...

    @abstractmethod
    def set_setting(self, key: str, value: str) -> None: ...

    @abstractmethod
    def changed(self) -> bool:
        """True when another process wrote to the store since the last call (an operator's
        revoke, unban or token rotation)."""

    # --- devices
    @abstractmethod
    def add_device(self, job_id: int, info: DeviceInfo, now: float, identity_id: int | None = None) -> int:
        """The device row of ``identity_id`` in this job, created or brought back online (one
        row per identity per job, however often it reconnects); a new row when no identity."""

    def set_device_state(self, device_id: int, state: str, now: float, reason: str = "") -> None:
        if not self._set_device_state(device_id, state, now, reason):
            raise StoreError(f"no device {device_id}")

    @abstractmethod
    def _set_device_state(self, device_id: int, state: str, now: float, reason: str) -> bool:
        """False when there is no such device."""

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
    ) -> None:
        """Add to a device row's counts and, where verified work or booked energy moved them, to
        its identity's totals over every job (the leaderboard's)."""
        credit = (verified, rejected, lost, revoked, gflop, joules, energy_flagged, gflop_metered)
        if not self._credit(device_id, credit, now):
            raise StoreError(f"no device {device_id}")

    @abstractmethod
    def _credit(self, device_id: int, credit: Credit, now: float) -> bool:
        """Add ``credit`` (CREDITED) to the device row, seen ``now``, and ``totals_of(credit)``, if
        any, to its identity's, if it has one. False when there is no such device."""

    @abstractmethod
    def devices(self, job_id: int, *, states: Sequence[str] | None = None, limit: int | None = None) -> list[DeviceRow]:
        """The devices of this job (in ``states`` if given), by id, at most ``limit``."""

    @abstractmethod
    def device_states(self, job_id: int) -> dict[str, int]:
        """How many of this job's devices are in each recorded state."""

    # --- GEMMs and tiles
    @abstractmethod
    def next_gemm_id(self) -> int:
        """The id the next ``add_gemm`` must use (block keys are derived from it first)."""

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
        return self._add_gemm(GemmRow(gemm_id, job_id, step, kind, shape, now), tiles)

    @abstractmethod
    def _add_gemm(self, gemm: GemmRow, tiles: Sequence[NewTile]) -> list[int]: ...

    @abstractmethod
    def finish_gemm(self, gemm_id: int, now: float) -> None: ...

    @abstractmethod
    def claim_tile(self, device_id: int, prefer: Sequence[str], now: float) -> ClaimedTile | None:
        """(Tests and tools; the coordinator's scheduler picks tiles itself, ``lease_tile``.)
        Lease the best queued tile to ``device_id``: one holding the most of the blocks in
        ``prefer`` (already on the device), then the oldest. Never a tile the device failed."""

    @abstractmethod
    def lease_tile(self, tile_id: int, device_id: int, now: float) -> ClaimedTile | None:
        """Lease the queued tile the scheduler chose to ``device_id``; None when it is not queued
        or the device is barred from it."""

    def lease_tiles(self, leases: Sequence[tuple[int, int]], now: float) -> list[ClaimedTile | None]:
        """``lease_tile`` for each (tile, device) in order, written together (one statement per
        batch where the store can): the scheduler's leases of one dispatch."""
        return [self.lease_tile(tile_id, device_id, now) for tile_id, device_id in leases]

    def claim_copy(self, tile_id: int, device_id: int, issued: str, now: float) -> ClaimedTile | None:
        """Lease one more copy of an outstanding tile (speculation, or its deadline passed), unless
        the device already holds one or failed it. ``issued`` says why."""
        if issued not in COPIES:
            raise StoreError(f"a copy is issued as {' or '.join(repr(str(i)) for i in COPIES)}, not {issued!r}")
        return self._claim_copy(tile_id, device_id, issued, now)

    @abstractmethod
    def _claim_copy(self, tile_id: int, device_id: int, issued: str, now: float) -> ClaimedTile | None: ...

    def end_lease(
        self, tile_id: int, device_id: int, outcome: str, now: float, reason: str = "", bar: bool = False
    ) -> LeaseEnd:
        """Close the device's open lease on the tile. ``verified`` finishes the tile and cancels
        its other copies; ``taken`` does the same but leaves the tile ``taken`` until its band's
        check (``verify_taken``, ``reject_taken``); otherwise the tile is queued again once no copy is out. ``rejected``
        (or ``bar``) also bars that device from the tile."""
        if outcome not in ENDINGS:
            raise StoreError(f"a lease cannot be ended as {outcome!r}")
        end = self._end_lease(tile_id, device_id, outcome, now, reason, bar or outcome == Outcome.REJECTED)
        if end is None:
            raise StoreError(f"tile {tile_id} is not leased to device {device_id}")
        return end

    @abstractmethod
    def _end_lease(
        self, tile_id: int, device_id: int, outcome: str, now: float, reason: str, bar: bool
    ) -> LeaseEnd | None:
        """End the lease (a winning one's tile becomes ``WON[outcome]``, its other copies ending
        ``cancelled`` for ``OUTRUN``), ``bar`` the device from the tile; None when it held none."""

    def release_device(self, device_id: int, outcome: str, now: float, reason: str = "") -> list[int]:
        """End every open lease of a device (it left or was lost); returns the tiles re-queued."""
        with self.atomic():
            return [
                tid
                for tid in self.leased_to(device_id)
                if self.end_lease(tid, device_id, outcome, now, reason).requeued
            ]

    @abstractmethod
    def verify_taken(self, results: Sequence[tuple[int, int]], now: float) -> None:
        """The (tile, device) results ``taken`` for their band passed its check: their leases and
        tiles become ``verified``, all in one write."""

    def reject_taken(
        self, tile_id: int, device_id: int, now: float, reason: str, outcome: str = Outcome.REJECTED
    ) -> None:
        """A result ``taken`` for its band is not used: its lease ends ``rejected`` (it failed the
        check) or ``revoked`` (its device was banned first), the tile is queued again and that
        device barred from it."""
        if outcome not in UNUSED:
            raise StoreError(f"a result waiting for its band cannot be ended as {outcome!r}")
        self._reject_taken(tile_id, device_id, now, reason, outcome)

    @abstractmethod
    def _reject_taken(self, tile_id: int, device_id: int, now: float, reason: str, outcome: str) -> None:
        """Raises ``no_result`` (having written nothing) when the device has no result of the tile
        waiting for its band."""

    @abstractmethod
    def leased_to(self, device_id: int) -> list[int]: ...

    def tile_state(self, tile_id: int) -> str:
        return _found(self._tile_state(tile_id), "tile", tile_id)

    @abstractmethod
    def _tile_state(self, tile_id: int) -> str | None: ...

    def lost_reasons(self, job_id: int, limit: int = 8) -> dict[str, int]:
        """Why a job's leases were lost: reason -> leases, the most common ``limit`` reasons."""
        return dict(sorted(self._lost_reasons(job_id).items(), key=lambda kv: (-kv[1], kv[0]))[:limit])

    @abstractmethod
    def _lost_reasons(self, job_id: int) -> Mapping[str, int]:
        """Every reason of the job's lost leases, with those pruning deleted: reason -> leases."""

    @abstractmethod
    def tile_counts(self, job_id: int) -> dict[str, int]:
        """A job's ``queued``, ``leased`` and ``verified`` tiles, and its leases that were
        ``rejected``, ``lost``, ``cancelled``, ``revoked``, issued ``requeued``, ``speculative`` or
        ``expired`` (a copy issued because a deadline passed)."""

    @abstractmethod
    def leases(self, tile_id: int) -> list[LeaseRow]: ...

    def unbar_tile(self, tile_id: int) -> None:
        """Every device may take the tile again (it had been failed by every device there was)."""
        if not self._unbar_tile(tile_id):
            raise StoreError(f"no tile {tile_id}")

    @abstractmethod
    def _unbar_tile(self, tile_id: int) -> bool:
        """False when there is no such tile."""

    # --- checkpoints and resuming
    @abstractmethod
    def add_checkpoint(self, row: CheckpointRow) -> None: ...

    @abstractmethod
    def checkpoints(self, job_id: int) -> list[CheckpointRow]:
        """Newest first."""

    @abstractmethod
    def newest_job(self) -> JobRow | None:
        """The job created last, whatever its state; None in a database without jobs."""

    def resumable_job(self) -> JobRow | None:
        """The newest job, if its coordinator was killed (``running``) or stopped (``stopped``);
        a job that finished, or whose start failed before training (``failed``), is not."""
        job = self.newest_job()
        return job if job is not None and job.state in RESUMABLE else None

    @abstractmethod
    def mark_devices_offline(self, reason: str) -> None:
        """Devices recorded online by a coordinator that is gone are offline, whatever they say."""

    @abstractmethod
    def truncate_steps(self, job_id: int, after: int) -> None:
        """Forget steps after ``after`` (they are computed again from a checkpoint)."""

    @abstractmethod
    def abandon_unfinished(self, job_id: int | None, now: float) -> int:
        """A (re)started coordinator: unfinished tiles of ``job_id`` (None: of every job) are
        abandoned, since their operands died with the last coordinator, and their open leases
        end as lost. Returns how many tiles."""

    @abstractmethod
    def prune_gemms(self, job_id: int, through_step: int) -> int:
        """Delete the rows of ``job_id``'s finished GEMMs (``done_at`` set) of steps up to
        ``through_step``: their leases, tiles and GEMM rows, in one write (``--prune-steps``). What
        they counted is kept per job, so ``tile_counts`` and ``lost_reasons`` read the same after,
        also once recounted from the rows. The newest GEMM of the store is always kept (the next
        GEMM id, from which block keys derive, must never go back). Returns the GEMMs deleted."""

    def atomic(self) -> AbstractContextManager[object]:
        """Several writes as one (SQLite: one transaction); a store without transactions makes
        each write as it comes."""
        return nullcontext()

    def flush(self) -> None:  # noqa: B027 (nothing to do where no write waits)
        """Make every write so far durable (a store may group hot-path writes; see db/sqlite.py)."""

    def batch(self) -> AbstractContextManager[None]:
        """Hot-path writes of one batch (a verifier batch settled and dispatched) as one unit:
        the calls inside it share one savepoint instead of one each (db/sqlite.py)."""
        return nullcontext()

    def close(self) -> None:  # noqa: B027 (nothing to let go of in memory)
        """Let go of the storage, every write flushed first."""
