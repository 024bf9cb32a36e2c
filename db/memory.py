"""In-memory Store: the simulator's and fast tests' storage. Same contract as SQLiteStore."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cleave.db.store import (
    CONNECTED,
    COPIES,
    COUNTED_OUTCOMES,
    OUTRUN,
    REQUEUED,
    RESTARTED,
    TILE_COUNTS,
    WON,
    CheckpointRow,
    ClaimedTile,
    Credit,
    DeviceInfo,
    DeviceRow,
    DeviceStatus,
    GemmRow,
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
    Ranking,
    StepRow,
    Store,
    TileState,
    no_result,
    totals_of,
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
    issue: str = Issued.FIRST  # why its next lease from the queue is issued: first, or "requeued after ..."


class MemoryStore(Store):
    def __init__(self) -> None:
        self._jobs: dict[int, JobRow] = {}
        self._steps: dict[int, dict[int, StepRow]] = {}
        self._devices: dict[int, DeviceRow] = {}
        self._device_job: dict[int, int] = {}
        self._gemms: dict[int, GemmRow] = {}
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

    def _job(self, job_id: int) -> JobRow | None:
        return copy.deepcopy(self._jobs[job_id]) if job_id in self._jobs else None

    def set_job_state(self, job_id: int, state: str, now: float) -> None:
        job = self._jobs[job_id]
        job.state = state
        if state in (JobState.FINISHED, JobState.FAILED):
            job.finished_at = now

    def _record_step(self, job_id: int, row: StepRow) -> None:
        self._steps[job_id][row.step] = row
        self._jobs[job_id].step = row.step

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

    def _set_identity_state(self, identity_id: int, state: str, reason: str, now: float) -> bool:
        if identity_id not in self._identities:
            return False
        row = self._identities[identity_id][0]
        row.state, row.reason, row.last_seen = state, reason, now
        return True

    def _leaderboard(self, limit: int, by: Ranking) -> list[LeaderRow]:
        ranked = [
            (i, t)
            for i, t in self._totals.items()
            if t[0] > 0 and (by == Ranking.GFLOP or t[2] > 0) and self._identities[i][0].state == IdentityState.ACTIVE
        ]
        score = (lambda t: t[0]) if by == Ranking.GFLOP else (lambda t: t[3] / t[2])
        best = sorted(ranked, key=lambda kv: (-score(kv[1]), kv[0]))[:limit]
        return [LeaderRow(i, self._identities[i][0].name, g, int(n), j, m) for i, (g, n, j, m) in best]

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
                    d.name, d.platform, d.cores, d.memory_bytes, d.device, d.gflops = info.values()
                    d.state, d.reason, d.last_seen = DeviceStatus.ONLINE, "", now
                    return d.id
        did = self._id("device")
        self._device_job[did] = job_id
        self._devices[did] = DeviceRow(did, *info.values(), DeviceStatus.ONLINE, now, now, identity_id=identity_id)
        return did

    def _set_device_state(self, device_id: int, state: str, now: float, reason: str) -> bool:
        d = self._devices.get(device_id)
        if d is None:
            return False
        d.state, d.reason, d.last_seen = state, reason, now
        return True

    def _credit(self, device_id: int, credit: Credit, now: float) -> bool:
        d = self._devices.get(device_id)
        if d is None:
            return False
        done, rejected, lost, revoked, gflop, joules, flagged, metered = credit
        d.tiles_done += done
        d.tiles_rejected += rejected
        d.tiles_lost += lost
        d.tiles_revoked += revoked
        d.gflop_verified += gflop
        d.joules += joules
        d.energy_flagged += flagged
        d.gflop_metered += metered
        d.last_seen = now
        if d.identity_id in self._identities and (totals := totals_of(credit)) is not None:
            t = self._totals.setdefault(d.identity_id, [0.0, 0, 0.0, 0.0])
            t[0] += totals[0]
            t[1] += totals[1]
            t[2] += totals[2]
            t[3] += totals[3]
        return True

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

    def _add_gemm(self, gemm: GemmRow, tiles: Sequence[NewTile]) -> list[int]:
        if gemm.id != self._next["gemm"]:
            raise StoreError(f"GEMM id {gemm.id} is not the next id {self._next['gemm']}")
        self._gemms[self._id("gemm")] = gemm
        ids = []
        for t in tiles:
            tid = self._id("tile")
            self._tiles[tid] = _Tile(tid, gemm.id, t.index, t.a_key, t.b_key, t.flops)
            self._queued[tid] = None
            self._leases[tid] = []
            ids.append(tid)
        return ids

    def finish_gemm(self, gemm_id: int, now: float) -> None:
        self._gemms[gemm_id].done_at = now

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
        return None if best is None else self._dequeue(best, device_id, now)

    def lease_tile(self, tile_id: int, device_id: int, now: float) -> ClaimedTile | None:
        t = self._tiles.get(tile_id)
        if t is None or tile_id not in self._queued or device_id in t.barred:
            return None
        return self._dequeue(t, device_id, now)

    def _dequeue(self, t: _Tile, device_id: int, now: float) -> ClaimedTile:
        del self._queued[t.id]
        t.state = TileState.LEASED
        return self._lease(t, device_id, t.issue, now)

    def _claim_copy(self, tile_id: int, device_id: int, issued: str, now: float) -> ClaimedTile | None:
        t = self._tiles.get(tile_id)
        if t is None or t.state != TileState.LEASED or device_id in t.barred:
            return None
        if any(lease.device_id == device_id for lease in self._open(tile_id)):
            return None
        return self._lease(t, device_id, issued, now)

    def _end_lease(
        self, tile_id: int, device_id: int, outcome: str, now: float, reason: str, bar: bool
    ) -> LeaseEnd | None:
        t = self._tiles.get(tile_id)
        mine = [lease for lease in self._open(tile_id) if lease.device_id == device_id] if t else []
        if t is None or not mine:
            return None
        lease = mine[0]
        lease.ended_at, lease.outcome, lease.reason = now, outcome, reason
        won = WON.get(outcome)
        if won is not None:
            t.state = won
            cancelled = []
            for other in self._open(tile_id):
                other.ended_at, other.outcome, other.reason = now, Outcome.CANCELLED, OUTRUN
                cancelled.append(other.device_id)
            return LeaseEnd(False, tuple(cancelled))
        if bar:
            t.barred.add(device_id)
        if self._open(tile_id):
            return LeaseEnd(False)
        self._requeue(t, outcome)
        return LeaseEnd(True)

    def _requeue(self, t: _Tile, outcome: str) -> None:
        t.state, t.issue = TileState.QUEUED, Issued.requeued(outcome)
        self._queued[t.id] = None

    def _taken(self, tile_id: int, device_id: int) -> tuple[_Tile, LeaseRow] | None:
        t = self._tiles.get(tile_id)
        won = [
            lease
            for lease in (self._leases[tile_id] if t else ())
            if lease.device_id == device_id and lease.outcome == Outcome.TAKEN
        ]
        return (t, won[-1]) if t is not None and t.state == TileState.TAKEN and won else None

    def verify_taken(self, results: Sequence[tuple[int, int]], now: float) -> None:
        found = []
        for tile_id, device_id in results:  # all or nothing: each is found before any is written
            taken = self._taken(tile_id, device_id)
            if taken is None:
                raise no_result(tile_id, device_id)
            found.append(taken)
        for t, lease in found:
            t.state, lease.outcome = TileState.VERIFIED, Outcome.VERIFIED

    def _reject_taken(self, tile_id: int, device_id: int, now: float, reason: str, outcome: str) -> None:
        taken = self._taken(tile_id, device_id)
        if taken is None:
            raise no_result(tile_id, device_id)
        t, lease = taken
        lease.outcome, lease.reason = outcome, reason
        t.barred.add(device_id)
        self._requeue(t, outcome)

    def leased_to(self, device_id: int) -> list[int]:
        return sorted(tid for tid in self._tiles if any(lease.device_id == device_id for lease in self._open(tid)))

    def _tile_state(self, tile_id: int) -> str | None:
        t = self._tiles.get(tile_id)
        return None if t is None else t.state

    def _lost_reasons(self, job_id: int) -> Counter[str]:
        reasons: Counter[str] = Counter(
            lease.reason
            for t in self._tiles.values()
            if self._gemms[t.gemm_id].job_id == job_id
            for lease in self._leases[t.id]
            if lease.outcome == Outcome.LOST
        )
        reasons.update(self._pruned_lost.get(job_id, Counter()))
        return reasons

    def tile_counts(self, job_id: int) -> dict[str, int]:
        counts = dict.fromkeys(TILE_COUNTS, 0)
        for t in self._tiles.values():
            if self._gemms[t.gemm_id].job_id != job_id:
                continue
            counts[t.state] += 1
            for lease in self._leases[t.id]:
                if lease.outcome in COUNTED_OUTCOMES:
                    counts[lease.outcome] += 1
                if lease.issued in COPIES:
                    counts[COPIES[lease.issued]] += 1
                elif lease.issued != Issued.FIRST:
                    counts[REQUEUED] += 1
        for key, n in self._pruned.get(job_id, Counter()).items():
            counts[key] += n
        return counts

    def leases(self, tile_id: int) -> list[LeaseRow]:
        return copy.deepcopy(self._leases.get(tile_id, []))

    def _unbar_tile(self, tile_id: int) -> bool:
        t = self._tiles.get(tile_id)
        if t is not None:
            t.barred.clear()
        return t is not None

    # --- checkpoints and resuming
    def add_checkpoint(self, row: CheckpointRow) -> None:
        self._checkpoints.append(row)

    def checkpoints(self, job_id: int) -> list[CheckpointRow]:
        return sorted((c for c in self._checkpoints if c.job_id == job_id), key=lambda c: -c.step)

    def newest_job(self) -> JobRow | None:
        return copy.deepcopy(self._jobs[max(self._jobs)]) if self._jobs else None

    def abandon_unfinished(self, job_id: int | None, now: float) -> int:
        count = 0
        for t in self._tiles.values():
            if job_id is not None and self._gemms[t.gemm_id].job_id != job_id:
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
            if g.job_id == job_id and g.step <= through_step and g.done_at is not None and gid != newest
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
