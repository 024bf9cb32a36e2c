"""In-memory Store: the simulator's and fast tests' storage. Same contract as SQLiteStore."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

from db.store import (
    LEASED, OUTCOMES, QUEUED, VERIFIED, ClaimedTile, DeviceInfo, DeviceRow, JobRow, LeaseRow,
    NewTile, StepRow, StoreError,
)


@dataclass
class _Tile:
    id: int
    gemm_id: int
    index: int
    a_key: str
    b_key: str
    flops: int
    state: str = QUEUED
    device_id: int | None = None
    attempts: int = 0
    barred: set[int] = field(default_factory=set)


class MemoryStore:
    def __init__(self) -> None:
        self._jobs: dict[int, JobRow] = {}
        self._steps: dict[int, list[StepRow]] = {}
        self._devices: dict[int, DeviceRow] = {}
        self._device_job: dict[int, int] = {}
        self._gemms: dict[int, dict[str, Any]] = {}
        self._tiles: dict[int, _Tile] = {}
        self._queued: dict[int, None] = {}  # insertion-ordered set of queued tile ids
        self._leases: dict[int, list[LeaseRow]] = {}
        self._next = {"job": 1, "device": 1, "gemm": 1, "tile": 1}

    def _id(self, kind: str) -> int:
        self._next[kind] += 1
        return self._next[kind] - 1

    # --- job and steps
    def create_job(self, name: str, config: dict[str, Any], steps: int, now: float) -> int:
        jid = self._id("job")
        self._jobs[jid] = JobRow(jid, name, copy.deepcopy(config), "running", 0, steps, now)
        self._steps[jid] = []
        return jid

    def job(self, job_id: int) -> JobRow:
        if job_id not in self._jobs:
            raise StoreError(f"no job {job_id}")
        return copy.deepcopy(self._jobs[job_id])

    def set_job_state(self, job_id: int, state: str, now: float) -> None:
        job = self._jobs[job_id]
        job.state = state
        if state in ("finished", "failed"):
            job.finished_at = now

    def record_step(
        self, job_id: int, step: int, loss: float, tokens: int, seconds: float, now: float,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self._steps[job_id].append(StepRow(step, loss, tokens, seconds, now, dict(extra or {})))
        self._jobs[job_id].step = step

    def steps(self, job_id: int) -> list[StepRow]:
        return sorted(copy.deepcopy(self._steps.get(job_id, [])), key=lambda s: s.step)

    # --- devices
    def add_device(self, job_id: int, info: DeviceInfo, now: float) -> int:
        did = self._id("device")
        self._device_job[did] = job_id
        self._devices[did] = DeviceRow(
            did, info.name, info.platform, info.cores, info.memory_bytes, info.device, info.gflops,
            "online", now, now,
        )
        return did

    def _device(self, device_id: int) -> DeviceRow:
        if device_id not in self._devices:
            raise StoreError(f"no device {device_id}")
        return self._devices[device_id]

    def set_device_state(self, device_id: int, state: str, now: float, reason: str = "") -> None:
        d = self._device(device_id)
        d.state, d.reason, d.last_seen = state, reason, now

    def credit_device(self, device_id: int, *, verified: int, rejected: int, gflop: float, now: float) -> None:
        d = self._device(device_id)
        d.tiles_done += verified
        d.tiles_rejected += rejected
        d.gflop_verified += gflop
        d.last_seen = now

    def devices(self, job_id: int) -> list[DeviceRow]:
        return [copy.copy(d) for d in self._devices.values() if self._device_job[d.id] == job_id]

    # --- GEMMs and tiles
    def next_gemm_id(self) -> int:
        return self._next["gemm"]

    def add_gemm(
        self, gemm_id: int, job_id: int, step: int, kind: str, shape: tuple[int, int, int],
        tiles: Sequence[NewTile], now: float,
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
        best.state, best.device_id = LEASED, device_id
        best.attempts += 1
        self._leases[best.id].append(LeaseRow(best.id, device_id, now, None, None))
        return ClaimedTile(best.id, best.gemm_id, best.index, best.a_key, best.b_key, best.attempts)

    def end_lease(self, tile_id: int, device_id: int, outcome: str, now: float, reason: str = "") -> None:
        if outcome not in OUTCOMES:
            raise StoreError(f"unknown lease outcome {outcome!r}")
        t = self._tiles.get(tile_id)
        if t is None or t.state != LEASED or t.device_id != device_id:
            raise StoreError(f"tile {tile_id} is not leased to device {device_id}")
        lease = self._leases[tile_id][-1]
        lease.ended_at, lease.outcome, lease.reason = now, outcome, reason
        t.device_id = None
        if outcome == "verified":
            t.state = VERIFIED
            return
        if outcome == "rejected":
            t.barred.add(device_id)
        t.state = QUEUED
        self._queued[tile_id] = None

    def release_device(self, device_id: int, outcome: str, now: float, reason: str = "") -> list[int]:
        ids = self.leased_to(device_id)
        for tid in ids:
            self.end_lease(tid, device_id, outcome, now, reason)
        return ids

    def leased_to(self, device_id: int) -> list[int]:
        return sorted(t.id for t in self._tiles.values() if t.state == LEASED and t.device_id == device_id)

    def tile_state(self, tile_id: int) -> str:
        if tile_id not in self._tiles:
            raise StoreError(f"no tile {tile_id}")
        return self._tiles[tile_id].state

    def tile_counts(self, job_id: int) -> dict[str, int]:
        counts = {QUEUED: 0, LEASED: 0, VERIFIED: 0, "rejected": 0}
        for t in self._tiles.values():
            if self._gemms[t.gemm_id]["job_id"] == job_id:
                counts[t.state] += 1
                counts["rejected"] += sum(1 for lease in self._leases[t.id] if lease.outcome == "rejected")
        return counts

    def leases(self, tile_id: int) -> list[LeaseRow]:
        return copy.deepcopy(self._leases.get(tile_id, []))

    def close(self) -> None:
        pass
