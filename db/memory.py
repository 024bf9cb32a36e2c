"""In-memory Store: the simulator's and fast tests' storage. Same contract as SQLiteStore."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from cleave.db.store import (
    CONNECTED,
    COUNTED_OUTCOMES,
    RESTARTED,
    RESUMABLE,
    TILE_COUNTS,
    CheckpointRow,
    ClaimedTile,
    DeviceInfo,
    DeviceRow,
    DeviceStatus,
    IdentityRow,
    IdentityState,
    Issued,
    JobRow,
    JobState,
    LeaderRow,
    LeaseEnd,
    LeaseRow,
    NewTile,
    Outcome,
    StepRow,
    TileState,
    finite_extra,
)
from cleave.wire.errors import StoreError


@dataclass
class _Tile:
    id: int
    gemm_id: int
    index: int
    a_key: str
    b_key: str
    flops: int
    state: str = TileState.QUEUED
    attempts: int = 0
    barred: set[int] = field(default_factory=set)
    requeue_reason: str | None = None


class MemoryStore:
    def __init__(self) -> None:
        self._jobs: dict[int, JobRow] = {}
        self._steps: dict[int, dict[int, StepRow]] = {}
        self._devices: dict[int, DeviceRow] = {}
        self._device_job: dict[int, int] = {}
        self._gemms: dict[int, dict[str, Any]] = {}
        self._tiles: dict[int, _Tile] = {}
        self._queued: dict[int, None] = {}  # insertion-ordered set of queued tile ids
        self._leases: dict[int, list[LeaseRow]] = {}
        self._checkpoints: list[CheckpointRow] = []
        self._identities: dict[int, tuple[IdentityRow, bytes]] = {}
        self._settings: dict[str, str] = {}
        # Identities that had verified work or booked energy: [GFLOP, tiles, joules, metered GFLOP]
        # over every job (the leaderboard's totals, kept by credit_device as SQLite's are).
        self._totals: dict[int, list[float]] = {}
        self._next = {"job": 1, "device": 1, "gemm": 1, "tile": 1, "identity": 1}
        # What prune_gemms deleted, per job: tile counts and lost reasons, added back when counted.
        self._pruned: dict[int, Counter[str]] = {}
        self._pruned_lost: dict[int, Counter[str]] = {}

    def _id(self, kind: str) -> int:
        self._next[kind] += 1
        return self._next[kind] - 1

    # --- job and steps
    def mark_devices_offline(self, reason: str) -> None:
        for d in self._devices.values():
            if d.state in CONNECTED:
                d.state, d.reason = DeviceStatus.OFFLINE, reason

    def create_job(self, name: str, config: dict[str, Any], steps: int, now: float) -> int:
        self.mark_devices_offline(RESTARTED)
        jid = self._id("job")
        self._jobs[jid] = JobRow(jid, name, copy.deepcopy(config), JobState.RUNNING, 0, steps, now)
        self._steps[jid] = {}
        return jid

    def job(self, job_id: int) -> JobRow:
        if job_id not in self._jobs:
            raise StoreError(f"no job {job_id}")
        return copy.deepcopy(self._jobs[job_id])

    def set_job_state(self, job_id: int, state: str, now: float) -> None:
        job = self._jobs[job_id]
        job.state = state
        if state in (JobState.FINISHED, JobState.FAILED):
            job.finished_at = now

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
        self._steps[job_id][step] = StepRow(step, loss, tokens, seconds, now, finite_extra(extra))
        self._jobs[job_id].step = step

    def steps(self, job_id: int) -> list[StepRow]:
        return [copy.deepcopy(s) for _, s in sorted(self._steps.get(job_id, {}).items())]

    def truncate_steps(self, job_id: int, after: int) -> None:
        self._steps[job_id] = {k: v for k, v in self._steps[job_id].items() if k <= after}
        self._jobs[job_id].step = min(self._jobs[job_id].step, after)

    # --- identities and settings
    def enrol(self, name: str, key: bytes, now: float) -> int:
        iid = self._id("identity")
        self._identities[iid] = (IdentityRow(iid, name, IdentityState.ACTIVE, "", now, now), bytes(key))
        return iid

    def identity(self, identity_id: int) -> IdentityRow | None:
        if identity_id not in self._identities:
            return None
        row = copy.copy(self._identities[identity_id][0])
        for d in self._devices.values():
            if d.identity_id == identity_id:
                row.tiles_done += d.tiles_done
                row.tiles_rejected += d.tiles_rejected
                row.tiles_lost += d.tiles_lost
                row.tiles_revoked += d.tiles_revoked
                row.gflop_verified += d.gflop_verified
        return row

    def identity_key(self, identity_id: int) -> bytes | None:
        entry = self._identities.get(identity_id)
        return entry[1] if entry else None

    def identities(self, limit: int = 1000) -> list[IdentityRow]:
        rows = [self.identity(i) for i in sorted(self._identities, reverse=True)[:limit]]
        return [r for r in rows if r is not None]

    def identity_states(self, identity_ids: Sequence[int]) -> dict[int, str]:
        return {i: self._identities[i][0].state for i in identity_ids if i in self._identities}

    def set_identity_state(self, identity_id: int, state: str, reason: str, now: float) -> None:
        if state not in tuple(IdentityState):
            raise StoreError(f"an identity cannot be {state!r}")
        if identity_id not in self._identities:
            raise StoreError(f"no identity {identity_id}")
        row = self._identities[identity_id][0]
        row.state, row.reason, row.last_seen = state, reason, now

    def leaderboard(self, limit: int = 10, by: str = "gflop") -> list[LeaderRow]:
        if by not in ("gflop", "gflop_per_j"):
            raise StoreError(f"a leaderboard ranks by gflop or gflop_per_j, not {by!r}")
        ranked = [
            (i, t)
            for i, t in self._totals.items()
            if t[0] > 0 and (by == "gflop" or t[2] > 0) and self._identities[i][0].state == IdentityState.ACTIVE
        ]
        score = (lambda t: t[0]) if by == "gflop" else (lambda t: t[3] / t[2])
        best = sorted(ranked, key=lambda kv: (-score(kv[1]), kv[0]))[:limit]
        return [LeaderRow(i, self._identities[i][0].name, g, int(n), j, m) for i, (g, n, j, m) in best]

    def identity_total(self, identity_id: int) -> tuple[float, int]:
        row = self.identity(identity_id)
        return (row.gflop_verified, row.tiles_done) if row else (0.0, 0)

    def setting(self, key: str) -> str | None:
        return self._settings.get(key)

    def set_setting(self, key: str, value: str) -> None:
        self._settings[key] = value

    def changed(self) -> bool:
        return False  # nobody else writes to memory

    # --- devices
    def add_device(self, job_id: int, info: DeviceInfo, now: float, identity_id: int | None = None) -> int:
        if identity_id is not None:
            if identity_id in self._identities:
                self._identities[identity_id][0].last_seen = now
            for d in self._devices.values():
                if d.identity_id == identity_id and self._device_job[d.id] == job_id:
                    d.name, d.platform, d.cores, d.memory_bytes, d.device, d.gflops = (
                        info.name,
                        info.platform,
                        info.cores,
                        info.memory_bytes,
                        info.device,
                        info.gflops,
                    )
                    d.state, d.reason, d.last_seen = DeviceStatus.ONLINE, "", now
                    return d.id
        did = self._id("device")
        self._device_job[did] = job_id
        self._devices[did] = DeviceRow(
            did,
            info.name,
            info.platform,
            info.cores,
            info.memory_bytes,
            info.device,
            info.gflops,
            DeviceStatus.ONLINE,
            now,
            now,
            identity_id=identity_id,
        )
        return did

    def _device(self, device_id: int) -> DeviceRow:
        if device_id not in self._devices:
            raise StoreError(f"no device {device_id}")
        return self._devices[device_id]

    def set_device_state(self, device_id: int, state: str, now: float, reason: str = "") -> None:
        d = self._device(device_id)
        d.state, d.reason, d.last_seen = state, reason, now

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
        d = self._device(device_id)
        d.tiles_done += verified
        d.tiles_rejected += rejected
        d.tiles_lost += lost
        d.tiles_revoked += revoked
        d.gflop_verified += gflop
        d.joules += joules
        d.energy_flagged += energy_flagged
        d.gflop_metered += gflop_metered
        d.last_seen = now
        if d.identity_id in self._identities and (verified or gflop or joules or gflop_metered):
            t = self._totals.setdefault(d.identity_id, [0.0, 0, 0.0, 0.0])
            t[0] += gflop
            t[1] += verified
            t[2] += joules
            t[3] += gflop_metered

    def devices(self, job_id: int, *, states: Sequence[str] | None = None, limit: int | None = None) -> list[DeviceRow]:
        rows = [
            copy.copy(d)
            for _, d in sorted(self._devices.items())
            if self._device_job[d.id] == job_id and (states is None or d.state in states)
        ]
        return rows if limit is None else rows[:limit]

    def device_states(self, job_id: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self._devices.values():
            if self._device_job[d.id] == job_id:
                out[d.state] = out.get(d.state, 0) + 1
        return out

    # --- GEMMs and tiles
    def next_gemm_id(self) -> int:
        return self._next["gemm"]

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
        if gemm_id != self._next["gemm"]:
            raise StoreError(f"GEMM id {gemm_id} is not the next id {self._next['gemm']}")
        gid = self._id("gemm")
        self._gemms[gid] = {"job_id": job_id, "step": step, "kind": kind, "shape": shape, "done": None}
        ids = []
        for t in tiles:
            tid = self._id("tile")
            self._tiles[tid] = _Tile(tid, gid, t.index, t.a_key, t.b_key, t.flops)
            self._queued[tid] = None
            self._leases[tid] = []
            ids.append(tid)
        return ids

    def finish_gemm(self, gemm_id: int, now: float) -> None:
        self._gemms[gemm_id]["done"] = now

    def _open(self, tile_id: int) -> list[LeaseRow]:
        return [lease for lease in self._leases[tile_id] if lease.ended_at is None]

    def _lease(self, t: _Tile, device_id: int, issued: str, now: float) -> ClaimedTile:
        t.attempts += 1
        self._leases[t.id].append(LeaseRow(t.id, device_id, now, None, None, "", issued))
        return ClaimedTile(t.id, t.gemm_id, t.index, t.a_key, t.b_key, t.attempts, issued)

    def claim_tile(self, device_id: int, prefer: Sequence[str], now: float) -> ClaimedTile | None:
        wanted = set(prefer)
        best: _Tile | None = None
        best_score = -1
        for tid in sorted(self._queued):
            t = self._tiles[tid]
            if device_id in t.barred:
                continue
            score = (t.a_key in wanted) + (t.b_key in wanted)
            if score > best_score:
                best, best_score = t, score
                if score == 2:
                    break
        if best is None:
            return None
        del self._queued[best.id]
        best.state = TileState.LEASED
        issued = Issued.FIRST if best.requeue_reason is None else Issued.requeued(best.requeue_reason)
        return self._lease(best, device_id, issued, now)

    def lease_tile(self, tile_id: int, device_id: int, now: float) -> ClaimedTile | None:
        t = self._tiles.get(tile_id)
        if t is None or tile_id not in self._queued or device_id in t.barred:
            return None
        del self._queued[tile_id]
        t.state = TileState.LEASED
        issued = Issued.FIRST if t.requeue_reason is None else Issued.requeued(t.requeue_reason)
        return self._lease(t, device_id, issued, now)

    def lease_tiles(self, leases: Sequence[tuple[int, int]], now: float) -> list[ClaimedTile | None]:
        return [self.lease_tile(tile_id, device_id, now) for tile_id, device_id in leases]

    def claim_copy(self, tile_id: int, device_id: int, issued: str, now: float) -> ClaimedTile | None:
        if issued not in (Issued.SPECULATIVE, Issued.DEADLINE):
            raise StoreError(f"a copy is issued as {Issued.SPECULATIVE!r} or {Issued.DEADLINE!r}, not {issued!r}")
        t = self._tiles.get(tile_id)
        if t is None or t.state != TileState.LEASED or device_id in t.barred:
            return None
        if any(lease.device_id == device_id for lease in self._open(tile_id)):
            return None
        return self._lease(t, device_id, issued, now)

    def end_lease(
        self, tile_id: int, device_id: int, outcome: str, now: float, reason: str = "", bar: bool = False
    ) -> LeaseEnd:
        if outcome not in tuple(Outcome) or outcome == Outcome.CANCELLED:
            raise StoreError(f"a lease cannot be ended as {outcome!r}")
        t = self._tiles.get(tile_id)
        mine = [lease for lease in self._open(tile_id) if lease.device_id == device_id] if t else []
        if t is None or not mine:
            raise StoreError(f"tile {tile_id} is not leased to device {device_id}")
        lease = mine[0]
        lease.ended_at, lease.outcome, lease.reason = now, outcome, reason
        if outcome in (Outcome.VERIFIED, Outcome.TAKEN):
            t.state = TileState.VERIFIED if outcome == Outcome.VERIFIED else TileState.TAKEN
            cancelled = []
            for other in self._open(tile_id):
                other.ended_at, other.outcome, other.reason = now, Outcome.CANCELLED, "another copy was verified first"
                cancelled.append(other.device_id)
            return LeaseEnd(False, tuple(cancelled))
        if outcome == Outcome.REJECTED or bar:
            t.barred.add(device_id)
        if self._open(tile_id):
            return LeaseEnd(False)
        t.state, t.requeue_reason = TileState.QUEUED, outcome
        self._queued[tile_id] = None
        return LeaseEnd(True)

    def _taken(self, tile_id: int, device_id: int) -> tuple[_Tile, LeaseRow]:
        t = self._tiles.get(tile_id)
        won = [
            lease
            for lease in (self._leases[tile_id] if t else ())
            if lease.device_id == device_id and lease.outcome == Outcome.TAKEN
        ]
        if t is None or t.state != TileState.TAKEN or not won:
            raise StoreError(f"tile {tile_id} has no result of device {device_id} waiting for its band")
        return t, won[-1]

    def verify_taken(self, results: Sequence[tuple[int, int]], now: float) -> None:
        found = [self._taken(tile_id, device_id) for tile_id, device_id in results]  # all or nothing
        for t, lease in found:
            t.state, lease.outcome = TileState.VERIFIED, Outcome.VERIFIED

    def reject_taken(
        self, tile_id: int, device_id: int, now: float, reason: str, outcome: str = Outcome.REJECTED
    ) -> None:
        if outcome not in (Outcome.REJECTED, Outcome.REVOKED):
            raise StoreError(f"a result waiting for its band cannot be ended as {outcome!r}")
        t, lease = self._taken(tile_id, device_id)
        lease.outcome, lease.reason = outcome, reason
        t.state, t.requeue_reason = TileState.QUEUED, outcome
        t.barred.add(device_id)
        self._queued[tile_id] = None

    def release_device(self, device_id: int, outcome: str, now: float, reason: str = "") -> list[int]:
        return [
            tid for tid in self.leased_to(device_id) if self.end_lease(tid, device_id, outcome, now, reason).requeued
        ]

    def leased_to(self, device_id: int) -> list[int]:
        return sorted(tid for tid in self._tiles if any(lease.device_id == device_id for lease in self._open(tid)))

    def tile_state(self, tile_id: int) -> str:
        if tile_id not in self._tiles:
            raise StoreError(f"no tile {tile_id}")
        return self._tiles[tile_id].state

    def lost_reasons(self, job_id: int, limit: int = 8) -> dict[str, int]:
        reasons: Counter[str] = Counter(
            lease.reason
            for t in self._tiles.values()
            if self._gemms[t.gemm_id]["job_id"] == job_id
            for lease in self._leases[t.id]
            if lease.outcome == Outcome.LOST
        )
        reasons.update(self._pruned_lost.get(job_id, Counter()))
        return dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))[:limit])

    def tile_counts(self, job_id: int) -> dict[str, int]:
        counts = dict.fromkeys(TILE_COUNTS, 0)
        for t in self._tiles.values():
            if self._gemms[t.gemm_id]["job_id"] != job_id:
                continue
            counts[t.state] += 1
            for lease in self._leases[t.id]:
                if lease.outcome in COUNTED_OUTCOMES:
                    counts[lease.outcome] += 1
                if lease.issued.startswith("requeued"):
                    counts["requeued"] += 1
                elif lease.issued == Issued.SPECULATIVE:
                    counts["speculative"] += 1
                elif lease.issued == Issued.DEADLINE:
                    counts["expired"] += 1
        for key, n in self._pruned.get(job_id, Counter()).items():
            counts[key] += n
        return counts

    def leases(self, tile_id: int) -> list[LeaseRow]:
        return copy.deepcopy(self._leases.get(tile_id, []))

    def unbar_tile(self, tile_id: int) -> None:
        if tile_id not in self._tiles:
            raise StoreError(f"no tile {tile_id}")
        self._tiles[tile_id].barred.clear()

    # --- checkpoints and resuming
    def add_checkpoint(self, row: CheckpointRow) -> None:
        self._checkpoints.append(row)

    def checkpoints(self, job_id: int) -> list[CheckpointRow]:
        return sorted((c for c in self._checkpoints if c.job_id == job_id), key=lambda c: -c.step)

    def newest_job(self) -> JobRow | None:
        return copy.deepcopy(self._jobs[max(self._jobs)]) if self._jobs else None

    def resumable_job(self) -> JobRow | None:
        if not self._jobs:
            return None
        newest = self._jobs[max(self._jobs)]
        return copy.deepcopy(newest) if newest.state in RESUMABLE else None

    def abandon_unfinished(self, job_id: int | None, now: float) -> int:
        count = 0
        for t in self._tiles.values():
            if job_id is not None and self._gemms[t.gemm_id]["job_id"] != job_id:
                continue
            if t.state not in (TileState.QUEUED, TileState.LEASED, TileState.TAKEN):
                continue
            for lease in self._leases[t.id]:  # a result waiting for its band died with its coordinator
                if lease.ended_at is None or lease.outcome == Outcome.TAKEN:
                    lease.ended_at, lease.outcome, lease.reason = now, Outcome.LOST, RESTARTED
            self._queued.pop(t.id, None)
            t.state = TileState.ABANDONED
            count += 1
        return count

    def prune_gemms(self, job_id: int, through_step: int) -> int:
        newest = max(self._gemms, default=0)
        ids = {
            gid
            for gid, g in self._gemms.items()
            if g["job_id"] == job_id and g["step"] <= through_step and g["done"] is not None and gid != newest
        }
        if not ids:
            return 0
        before, lost = self.tile_counts(job_id), self.lost_reasons(job_id, limit=1 << 62)
        for tid in [tid for tid, t in self._tiles.items() if t.gemm_id in ids]:
            del self._tiles[tid], self._leases[tid]
            self._queued.pop(tid, None)
        for gid in ids:
            del self._gemms[gid]
        # What the deleted rows counted is what the remaining ones no longer do.
        after, lost_after = self.tile_counts(job_id), self.lost_reasons(job_id, limit=1 << 62)
        self._pruned.setdefault(job_id, Counter()).update({k: before[k] - after[k] for k in TILE_COUNTS})
        self._pruned_lost.setdefault(job_id, Counter()).update(Counter(lost) - Counter(lost_after))
        return len(ids)

    def flush(self) -> None:
        pass

    @contextmanager
    def batch(self) -> Iterator[None]:
        yield  # every call is atomic on its own here already

    def close(self) -> None:
        pass
