"""SQLite Store (sqlite-utils, WAL): the coordinator's production storage.

One connection, used by the coordinator's event-loop thread only (one writer). Every
multi-statement change runs in ``BEGIN IMMEDIATE ... COMMIT``; a tile is claimed with a single
``UPDATE ... RETURNING``. ``synchronous=NORMAL`` under WAL: a power cut may lose the last
transactions but never corrupts the file, and commits cost microseconds, not an fsync.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import sqlite_utils

from db.migrations import migrate
from db.store import (
    LEASED, OUTCOMES, QUEUED, VERIFIED, ClaimedTile, DeviceInfo, DeviceRow, JobRow, LeaseRow,
    NewTile, StepRow, StoreError,
)

_CLAIM = """
UPDATE tiles SET state = 'leased', device_id = :device, attempts = attempts + 1
WHERE id = (
    SELECT id FROM tiles
    WHERE state = 'queued'
      AND NOT EXISTS (SELECT 1 FROM json_each(tiles.barred) WHERE value = :device)
    ORDER BY (a_key IN (SELECT value FROM json_each(:prefer)))
           + (b_key IN (SELECT value FROM json_each(:prefer))) DESC, id
    LIMIT 1
)
RETURNING id, gemm_id, idx, a_key, b_key, attempts
"""


class SQLiteStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"cannot open database {self.path}: {exc}") from None
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=5000")
        self.db = sqlite_utils.Database(conn)
        self.conn = conn
        migrate(self.db)

    @contextmanager
    def atomic(self) -> Iterator[sqlite3.Connection]:
        if self.conn.in_transaction:  # nested: a savepoint
            self.conn.execute("SAVEPOINT nested")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK TO nested")
                raise
            self.conn.execute("RELEASE nested")
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def _one(self, sql: str, params: Any = ()) -> tuple | None:
        return self.conn.execute(sql, params).fetchone()

    # --- job and steps
    def create_job(self, name: str, config: dict[str, Any], steps: int, now: float) -> int:
        # Devices of earlier jobs in this file are gone whatever their last recorded state.
        self.conn.execute(
            "UPDATE devices SET state = 'offline', reason = 'coordinator restarted' WHERE state = 'online'"
        )
        cur = self.conn.execute(
            "INSERT INTO jobs (name, config, state, step, steps, created_at) VALUES (?, ?, 'running', 0, ?, ?)",
            (name, json.dumps(config, sort_keys=True), steps, now),
        )
        return int(cur.lastrowid)

    def job(self, job_id: int) -> JobRow:
        row = self._one(
            "SELECT id, name, config, state, step, steps, created_at, finished_at FROM jobs WHERE id = ?", (job_id,)
        )
        if row is None:
            raise StoreError(f"no job {job_id}")
        return JobRow(row[0], row[1], json.loads(row[2]), row[3], row[4], row[5], row[6], row[7])

    def set_job_state(self, job_id: int, state: str, now: float) -> None:
        done = now if state in ("finished", "failed") else None
        self.conn.execute(
            "UPDATE jobs SET state = ?, finished_at = COALESCE(?, finished_at) WHERE id = ?", (state, done, job_id)
        )

    def record_step(
        self, job_id: int, step: int, loss: float, tokens: int, seconds: float, now: float,
        extra: dict[str, Any] | None = None,
    ) -> None:
        with self.atomic() as c:
            c.execute(
                "INSERT OR REPLACE INTO steps (job_id, step, loss, tokens, seconds, at, extra) VALUES (?,?,?,?,?,?,?)",
                (job_id, step, loss, tokens, seconds, now, json.dumps(extra or {}, sort_keys=True)),
            )
            c.execute("UPDATE jobs SET step = ? WHERE id = ?", (step, job_id))

    def steps(self, job_id: int) -> list[StepRow]:
        rows = self.conn.execute(
            "SELECT step, loss, tokens, seconds, at, extra FROM steps WHERE job_id = ? ORDER BY step", (job_id,)
        )
        return [StepRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    # --- devices
    def add_device(self, job_id: int, info: DeviceInfo, now: float) -> int:
        cur = self.conn.execute(
            "INSERT INTO devices (job_id, name, platform, cores, memory_bytes, device, gflops, state, joined_at,"
            " last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, 'online', ?, ?)",
            (job_id, info.name, info.platform, info.cores, info.memory_bytes, info.device, info.gflops, now, now),
        )
        return int(cur.lastrowid)

    def set_device_state(self, device_id: int, state: str, now: float, reason: str = "") -> None:
        cur = self.conn.execute(
            "UPDATE devices SET state = ?, reason = ?, last_seen = ? WHERE id = ?", (state, reason, now, device_id)
        )
        if cur.rowcount != 1:
            raise StoreError(f"no device {device_id}")

    def credit_device(self, device_id: int, *, verified: int, rejected: int, gflop: float, now: float) -> None:
        cur = self.conn.execute(
            "UPDATE devices SET tiles_done = tiles_done + ?, tiles_rejected = tiles_rejected + ?,"
            " gflop_verified = gflop_verified + ?, last_seen = ? WHERE id = ?",
            (verified, rejected, gflop, now, device_id),
        )
        if cur.rowcount != 1:
            raise StoreError(f"no device {device_id}")

    def devices(self, job_id: int) -> list[DeviceRow]:
        cols = "id, name, platform, cores, memory_bytes, device, gflops, state, joined_at, last_seen," \
               " tiles_done, tiles_rejected, gflop_verified, reason"
        return [DeviceRow(*r) for r in self.conn.execute(
            f"SELECT {cols} FROM devices WHERE job_id = ? ORDER BY id", (job_id,)
        )]

    # --- GEMMs and tiles
    def next_gemm_id(self) -> int:
        row = self._one("SELECT COALESCE(MAX(id), 0) + 1 FROM gemms")
        return int(row[0]) if row else 1

    def add_gemm(
        self, gemm_id: int, job_id: int, step: int, kind: str, shape: tuple[int, int, int],
        tiles: Sequence[NewTile], now: float,
    ) -> list[int]:
        with self.atomic() as c:
            m, n, k = shape
            gid = int(c.execute(
                "INSERT INTO gemms (id, job_id, step, kind, m, n, k, tiles, created_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (gemm_id, job_id, step, kind, m, n, k, len(tiles), now),
            ).lastrowid)
            ids = [
                int(r[0]) for r in (
                    c.execute(
                        "INSERT INTO tiles (gemm_id, idx, a_key, b_key, flops, state, queued_at) "
                        "VALUES (?,?,?,?,?, 'queued', ?) RETURNING id",
                        (gid, t.index, t.a_key, t.b_key, t.flops, now),
                    ).fetchone()
                    for t in tiles
                )
            ]
        return ids

    def finish_gemm(self, gemm_id: int, now: float) -> None:
        self.conn.execute("UPDATE gemms SET done_at = ? WHERE id = ?", (now, gemm_id))

    def claim_tile(self, device_id: int, prefer: Sequence[str], now: float) -> ClaimedTile | None:
        with self.atomic() as c:
            row = c.execute(_CLAIM, {"device": device_id, "prefer": json.dumps(list(prefer))}).fetchone()
            if row is None:
                return None
            c.execute("INSERT INTO leases (tile_id, device_id, leased_at) VALUES (?, ?, ?)", (row[0], device_id, now))
        return ClaimedTile(row[0], row[1], row[2], row[3], row[4], row[5])

    def end_lease(self, tile_id: int, device_id: int, outcome: str, now: float, reason: str = "") -> None:
        if outcome not in OUTCOMES:
            raise StoreError(f"unknown lease outcome {outcome!r}")
        with self.atomic() as c:
            if outcome == "verified":
                cur = c.execute(
                    "UPDATE tiles SET state = 'verified', device_id = NULL, done_at = ? "
                    "WHERE id = ? AND state = 'leased' AND device_id = ?", (now, tile_id, device_id),
                )
            else:
                barred = "json_insert(barred, '$[#]', :device)" if outcome == "rejected" else "barred"
                cur = c.execute(
                    f"UPDATE tiles SET state = 'queued', device_id = NULL, barred = {barred} "
                    "WHERE id = :tile AND state = 'leased' AND device_id = :device",
                    {"tile": tile_id, "device": device_id},
                )
            if cur.rowcount != 1:
                raise StoreError(f"tile {tile_id} is not leased to device {device_id}")
            c.execute(
                "UPDATE leases SET ended_at = ?, outcome = ?, reason = ? "
                "WHERE tile_id = ? AND device_id = ? AND ended_at IS NULL",
                (now, outcome, reason, tile_id, device_id),
            )

    def release_device(self, device_id: int, outcome: str, now: float, reason: str = "") -> list[int]:
        with self.atomic():
            ids = self.leased_to(device_id)
            for tid in ids:
                self.end_lease(tid, device_id, outcome, now, reason)
        return ids

    def leased_to(self, device_id: int) -> list[int]:
        return [r[0] for r in self.conn.execute(
            "SELECT id FROM tiles WHERE state = 'leased' AND device_id = ? ORDER BY id", (device_id,)
        )]

    def tile_state(self, tile_id: int) -> str:
        row = self._one("SELECT state FROM tiles WHERE id = ?", (tile_id,))
        if row is None:
            raise StoreError(f"no tile {tile_id}")
        return str(row[0])

    def tile_counts(self, job_id: int) -> dict[str, int]:
        counts = {QUEUED: 0, LEASED: 0, VERIFIED: 0, "rejected": 0}
        for state, n in self.conn.execute(
            "SELECT t.state, COUNT(*) FROM tiles t JOIN gemms g ON g.id = t.gemm_id WHERE g.job_id = ? GROUP BY t.state",
            (job_id,),
        ):
            counts[state] = n
        row = self._one(
            "SELECT COUNT(*) FROM leases l JOIN tiles t ON t.id = l.tile_id JOIN gemms g ON g.id = t.gemm_id "
            "WHERE g.job_id = ? AND l.outcome = 'rejected'", (job_id,),
        )
        counts["rejected"] = int(row[0]) if row else 0
        return counts

    def leases(self, tile_id: int) -> list[LeaseRow]:
        return [LeaseRow(*r) for r in self.conn.execute(
            "SELECT tile_id, device_id, leased_at, ended_at, outcome, reason FROM leases WHERE tile_id = ? ORDER BY id",
            (tile_id,),
        )]

    def close(self) -> None:
        self.conn.close()
