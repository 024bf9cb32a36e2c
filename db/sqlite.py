"""SQLite Store (sqlite-utils, WAL): the coordinator's production storage.

One connection, used by the coordinator's event-loop thread only (one writer). Every
multi-statement change runs in ``BEGIN IMMEDIATE ... COMMIT``; a tile is claimed with a single
``UPDATE ... RETURNING``. ``synchronous=NORMAL`` under WAL: a power cut may lose the last
transactions but never corrupts the file, and commits cost microseconds, not an fsync.

Group commit (``group_seconds > 0``, as a coordinator runs): the per-tile writes of the hot path
(leases, their ends, credits, GEMM rows) share one transaction that is committed at the end of
the event loop's turn (``defer``), once it is ``group_seconds`` old, at any
``flush()``, by any other write, or at ``close()``. After a group commits, no new one opens
for as long as it held the write lock; hot writes meanwhile commit one by one, with the lock
free between them. Groups therefore hold the lock at most about half the time, and another
process's write (an operator revoking a device) gets in within its busy timeout however busy
the coordinator is. Each call stays atomic on its own (a savepoint inside the group), except
inside ``batch()``, where a verifier batch's calls share one savepoint (the Core settles and
dispatches a batch in it: half the statements of a tile were SAVEPOINT and RELEASE). A crash
loses at most that window of tile bookkeeping, which a restart abandons anyway (its operands
died with the process); writes that must outlive a crash (bans, enrolments, steps, job
states, checkpoints) commit at once, taking the group with them.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from cleave.db.migrations import migrate
from cleave.db.store import (
    COPIES,
    CREDITED,
    OUTRUN,
    REQUEUED,
    RESTARTED,
    TILE_COUNTS,
    TOTALLED,
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

GROUP_SECONDS = 0.05  # a running coordinator's group-commit window (see the module doc)
Row = TypeVar("Row")


def _columns(row: type) -> str:
    """A row type's fields, which its table's columns are named after, in its order."""
    return ", ".join(f.name for f in fields(row))


def _added(columns: Sequence[str]) -> str:
    """An UPDATE's SET that adds a parameter to each column, in their order."""
    return ", ".join(f"{c} = {c} + ?" for c in columns)


def _inserted(cur: sqlite3.Cursor) -> int:
    """The id of the row an INSERT just added (sqlite3 leaves ``lastrowid`` None only when it added none)."""
    if cur.lastrowid is None:
        raise StoreError("an INSERT added no row")
    return cur.lastrowid


# The columns of each row type's table that it reads back, in its fields' order.
_DEVICE_COLS, _JOB_COLS, _STEP_COLS = _columns(DeviceRow), _columns(JobRow), _columns(StepRow)
_LEASE_COLS, _CHECKPOINT_COLS = _columns(LeaseRow), _columns(CheckpointRow)
# credit_device's two updates: the device row's counts, and its identity's totals (the leaderboard's).
_CREDIT = f"UPDATE devices SET {_added(CREDITED)}, last_seen = ? WHERE id = ? RETURNING identity_id"
_TOTAL = f"UPDATE identities SET {_added(TOTALLED)} WHERE id = ?"
_LEASE_ROW = "INSERT INTO leases (tile_id, device_id, leased_at, issued) VALUES (?, ?, ?, ?)"
# An identity's totals are summed over its device rows in every job.
_IDENTITY_SELECT = (
    "SELECT i.id, i.name, i.state, i.reason, i.created_at, i.last_seen, COALESCE(SUM(d.tiles_done), 0),"
    " COALESCE(SUM(d.tiles_rejected), 0), COALESCE(SUM(d.tiles_lost), 0), COALESCE(SUM(d.tiles_revoked), 0),"
    " COALESCE(SUM(d.gflop_verified), 0.0) FROM identities i LEFT JOIN devices d ON d.identity_id = i.id"
)

_CLAIM = """
UPDATE tiles SET state = 'leased', open_leases = 1, attempts = attempts + 1
WHERE id = (
    SELECT id FROM tiles
    WHERE state = 'queued'
      AND NOT EXISTS (SELECT 1 FROM json_each(tiles.barred) WHERE value = :device)
    ORDER BY (a_key IN (SELECT value FROM json_each(:prefer)))
           + (b_key IN (SELECT value FROM json_each(:prefer))) DESC, id
    LIMIT 1
)
RETURNING id, gemm_id, idx, a_key, b_key, attempts, requeue_reason
"""

# One named tile, chosen by the scheduler: still queued, and never to a device barred from it.
_LEASE = """
UPDATE tiles SET state = 'leased', open_leases = 1, attempts = attempts + 1
WHERE id = :tile AND state = 'queued'
  AND NOT EXISTS (SELECT 1 FROM json_each(tiles.barred) WHERE value = :device)
RETURNING id, gemm_id, idx, a_key, b_key, attempts, requeue_reason
"""

# ``_LEASE`` for a batch of (tile, device) pairs, each tile once.
_LEASE_MANY = """
UPDATE tiles SET state = 'leased', open_leases = 1, attempts = attempts + 1
WHERE tiles.id IN (SELECT json_extract(value, '$[0]') FROM json_each(:pairs)) AND tiles.state = 'queued'
  AND NOT EXISTS (
    SELECT 1 FROM json_each(tiles.barred) AS b, json_each(:pairs) AS p
    WHERE json_extract(p.value, '$[0]') = tiles.id AND b.value = json_extract(p.value, '$[1]')
  )
RETURNING id, gemm_id, idx, a_key, b_key, attempts, requeue_reason
"""

# One more copy of an outstanding tile, for a device that holds none and never failed it.
_CLAIM_COPY = """
UPDATE tiles SET open_leases = open_leases + 1, attempts = attempts + 1
WHERE id = :tile AND state = 'leased'
  AND NOT EXISTS (SELECT 1 FROM json_each(tiles.barred) WHERE value = :device)
  AND NOT EXISTS (SELECT 1 FROM leases WHERE tile_id = :tile AND device_id = :device AND ended_at IS NULL)
RETURNING id, gemm_id, idx, a_key, b_key, attempts
"""

# The GEMMs ``prune_gemms`` deletes (a condition on ``gemms g``), and its deletes, children first.
# Each finds its rows by index (gemms by job and step, tiles by GEMM, leases by tile), as do the
# foreign-key checks they make: tests/db/test_store.py reads their query plans.
_PRUNED = "g.job_id = :job AND g.step <= :through AND g.done_at IS NOT NULL AND g.id < :newest"
_PRUNED_IDS = f"SELECT g.id FROM gemms g WHERE {_PRUNED}"
PRUNE_DELETES = (
    f"DELETE FROM leases WHERE tile_id IN (SELECT id FROM tiles WHERE gemm_id IN ({_PRUNED_IDS}))",
    f"DELETE FROM tiles WHERE gemm_id IN ({_PRUNED_IDS})",
    f"DELETE FROM gemms WHERE id IN ({_PRUNED_IDS})",
)


class SQLiteStore(Store):
    def __init__(
        self,
        path: str | Path,
        *,
        group_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        defer: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        if not 0.0 <= group_seconds <= 1.0:
            raise ValueError(f"group_seconds must be in [0, 1], got {group_seconds}")
        self.path = str(path)
        self.group_seconds = group_seconds
        self._clock = clock
        self._group_since: float | None = None  # when the open group transaction began
        self._depth = 0  # atomic blocks open inside this call chain
        self._in_batch = False  # inside batch(): hot-path writes share its savepoint
        self._commit_after = False  # a write inside the batch must commit as soon as it ends
        self._cool_until = -math.inf  # no group before then (see _grouped)
        self._closed = False
        # Given ``flush`` when a group opens: a server passes its loop's ``call_soon``, so the group
        # commits at the end of the loop's turn and the write lock is free while it waits on sockets.
        self._defer = defer
        try:
            # Created private: it holds token hashes and the devices' stored keys. SQLite gives
            # its -wal and -shm files the same permissions.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
        except (sqlite3.DatabaseError, OSError) as exc:
            raise StoreError(f"cannot open database {self.path}: {exc}") from None
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        conn.execute("PRAGMA busy_timeout=5000")
        self.db = sqlite_utils.Database(conn)
        self.conn = conn
        migrate(self.db)
        # Tile counts per job, kept current by every write below (this store is the only writer):
        # the status a dashboard asks for every second must not scan a million rows.
        self._counts: dict[int, Counter[str]] = {}
        self._lost: dict[int, Counter[str]] = {}  # the same, of why leases were lost (status.lost_reasons)
        self._states: dict[int, Counter[str]] = {}  # the same, of the devices' states (status.device_counts)
        self._gemm_job: dict[int, int] = {}
        self._data_version = self._version()

    @contextmanager
    def atomic(self) -> Iterator[sqlite3.Connection]:
        """One write that commits at once (with any group it joins), or rolls back alone."""
        if self._depth or self.conn.in_transaction:  # nested, or joining an open group
            with self._savepoint():
                yield self.conn
            if not self._depth:
                self.flush()
            elif self._in_batch:  # durable once the batch is
                self._commit_after = True
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        finally:
            self._depth -= 1
        self.conn.execute("COMMIT")

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hot-path writes of one batch: inside it, each call is no longer a savepoint of its own
        (SAVEPOINT and RELEASE were half the statements of a tile's lease, end and credit). A
        call that fails inside a batch may leave its earlier statements (each statement is
        atomic); the coordinator stops the job on any such failure, and a restart abandons the
        window's tile bookkeeping anyway. Nothing written is rolled back when the batch's body
        raises: a ban or a step recorded in it stands. Writes that must outlive a crash (bans,
        steps) commit as the batch ends."""
        if self._in_batch:
            yield
            return
        failed: BaseException | None = None
        try:
            with self._grouped():
                self._in_batch = True
                try:
                    yield
                except BaseException as exc:  # keep what was written; raised again below
                    failed = exc
                finally:
                    self._in_batch = False
        finally:
            commit, self._commit_after = self._commit_after, False
        if commit:
            self.flush()
        if failed is not None:
            raise failed

    @contextmanager
    def _grouped(self) -> Iterator[sqlite3.Connection]:
        """A hot-path write: atomic on its own, committed with the group (see the module doc)."""
        if self._in_batch:  # the batch's savepoint holds it
            yield self.conn
            return
        if not self.group_seconds or self._depth:
            with self.atomic() as c:
                yield c
            return
        if not self.conn.in_transaction:
            now = self._clock()
            if now < self._cool_until:  # the lock's other half: one transaction per write, gaps between
                with self.atomic() as c:
                    yield c
                return
            self.conn.execute("BEGIN IMMEDIATE")
            self._group_since = now
            if self._defer is not None:
                self._defer(self.flush)
        with self._savepoint():
            yield self.conn
        if self._group_since is not None and self._clock() - self._group_since >= self.group_seconds:
            self.flush()

    @contextmanager
    def _savepoint(self) -> Iterator[None]:
        self.conn.execute("SAVEPOINT part")
        self._depth += 1
        try:
            yield
        except BaseException as exc:
            if not self.conn.in_transaction:  # SQLite rolled back the whole group (disk full, I/O)
                self._group_since = None
                raise StoreError(f"a write failed and took its transaction with it: {exc}") from exc
            self.conn.execute("ROLLBACK TO part")
            self.conn.execute("RELEASE part")
            raise
        finally:
            self._depth -= 1
        self.conn.execute("RELEASE part")

    def flush(self) -> None:
        """Commit the open group of hot-path writes, if any."""
        if self._closed:  # a flush scheduled before close() ran late
            return
        if self.conn.in_transaction and not self._depth:
            self.conn.execute("COMMIT")
            if self._group_since is not None:  # no new group for as long as this one held the lock
                now = self._clock()
                self._cool_until = now + (now - self._group_since)
        self._group_since = None

    def _write(self, sql: str, params: Any = (), *, grouped: bool = False) -> sqlite3.Cursor:
        with self._grouped() if grouped else self.atomic() as c:
            return c.execute(sql, params)

    def _one(self, sql: str, params: Any = ()) -> tuple | None:
        return self.conn.execute(sql, params).fetchone()

    def _all(self, row: Callable[..., Row], sql: str, params: Any = ()) -> list[Row]:
        """Every row ``sql`` selects, as ``row`` (its columns in the row type's order)."""
        return [row(*r) for r in self.conn.execute(sql, params)]

    # --- job and steps
    def mark_devices_offline(self, reason: str) -> None:
        self._write("UPDATE devices SET state = 'offline', reason = ? WHERE state IN ('online', 'paused')", (reason,))
        self._states.clear()  # a bulk change: counted again when asked

    def create_job(self, name: str, config: dict[str, Any], steps: int, now: float) -> int:
        with self.atomic() as c:
            # Devices of earlier jobs in this file are gone whatever their last recorded state.
            self.mark_devices_offline(RESTARTED)
            cur = c.execute(
                "INSERT INTO jobs (name, config, state, step, steps, created_at) VALUES (?, ?, 'running', 0, ?, ?)",
                (name, json.dumps(config, sort_keys=True), steps, now),
            )
            return _inserted(cur)

    def _job(self, job_id: int) -> JobRow | None:
        row = self._one(f"SELECT {_JOB_COLS} FROM jobs WHERE id = ?", (job_id,))
        return None if row is None else JobRow(row[0], row[1], json.loads(row[2]), *row[3:])

    def set_job_state(self, job_id: int, state: str, now: float) -> None:
        done = now if state in (JobState.FINISHED, JobState.FAILED) else None
        self._write(
            "UPDATE jobs SET state = ?, finished_at = COALESCE(?, finished_at) WHERE id = ?", (state, done, job_id)
        )

    def _record_step(self, job_id: int, row: StepRow) -> None:
        with self.atomic() as c:
            c.execute(
                f"INSERT OR REPLACE INTO steps (job_id, {_STEP_COLS}) VALUES (?,?,?,?,?,?,?)",
                (job_id, row.step, row.loss, row.tokens, row.seconds, row.at, json.dumps(row.extra, sort_keys=True)),
            )
            c.execute("UPDATE jobs SET step = ? WHERE id = ?", (row.step, job_id))

    def steps(self, job_id: int) -> list[StepRow]:
        rows = self.conn.execute(f"SELECT {_STEP_COLS} FROM steps WHERE job_id = ? ORDER BY step", (job_id,))
        return [StepRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5])) for r in rows]

    # --- identities and settings
    def enrol(self, name: str, key: bytes, now: float) -> int:
        cur = self._write(
            "INSERT INTO identities (name, key, state, reason, created_at, last_seen) VALUES (?, ?, ?, '', ?, ?)",
            (name, key, IdentityState.ACTIVE, now, now),
        )
        return _inserted(cur)

    def identity(self, identity_id: int) -> IdentityRow | None:
        row = self._one(f"{_IDENTITY_SELECT} WHERE i.id = ? GROUP BY i.id", (identity_id,))
        return IdentityRow(*row) if row is not None else None

    def identity_key(self, identity_id: int) -> bytes | None:
        row = self._one("SELECT key FROM identities WHERE id = ?", (identity_id,))
        return bytes(row[0]) if row is not None else None

    def identities(self, limit: int = 1000) -> list[IdentityRow]:
        return self._all(IdentityRow, f"{_IDENTITY_SELECT} GROUP BY i.id ORDER BY i.id DESC LIMIT ?", (limit,))

    def identity_states(self, identity_ids: Sequence[int]) -> dict[int, str]:
        return {
            int(i): str(state)
            for i, state in self.conn.execute(
                "SELECT id, state FROM identities WHERE id IN (SELECT value FROM json_each(?))",
                (json.dumps(list(identity_ids)),),
            )
        }

    def _set_identity_state(self, identity_id: int, state: str, reason: str, now: float) -> bool:
        cur = self._write(
            "UPDATE identities SET state = ?, reason = ?, last_seen = ? WHERE id = ?", (state, reason, now, identity_id)
        )
        return cur.rowcount == 1

    def _leaderboard(self, limit: int, by: Ranking) -> list[LeaderRow]:
        order = {Ranking.GFLOP: "gflop_verified DESC", Ranking.GFLOP_PER_J: "(gflop_metered / joules) DESC"}[by]
        # The identities' totals (kept by credit_device) in one of m005's partial indexes: an
        # index-ordered LIMIT, the same work at a thousand identities and at a million.
        where = "gflop_verified > 0" + (" AND joules > 0" if by == Ranking.GFLOP_PER_J else "")
        index = f"idx_identities_rank_{by}"  # named: without statistics the planner may sort another
        return [
            LeaderRow(int(r[0]), r[1], float(r[2]), int(r[3]), float(r[4]), float(r[5]))
            for r in self.conn.execute(
                f"SELECT id, name, gflop_verified, tiles_done, joules, gflop_metered FROM identities INDEXED BY {index}"
                f" WHERE state = ? AND {where} ORDER BY {order}, id LIMIT ?",
                (IdentityState.ACTIVE, limit),
            )
        ]

    def identity_total(self, identity_id: int) -> tuple[float, int]:
        # Two sums off idx_devices_identity: half the time of the whole row ``identity`` reads.
        row = self._one(
            "SELECT COALESCE(SUM(gflop_verified), 0.0), COALESCE(SUM(tiles_done), 0) FROM devices"
            " WHERE identity_id = ?",
            (identity_id,),
        )
        assert row is not None
        return float(row[0]), int(row[1])

    def setting(self, key: str) -> str | None:
        row = self._one("SELECT value FROM settings WHERE key = ?", (key,))
        return str(row[0]) if row is not None else None

    def set_setting(self, key: str, value: str) -> None:
        self._write(
            "INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def _version(self) -> int:
        row = self._one("PRAGMA data_version")
        return int(row[0]) if row is not None else 0

    def changed(self) -> bool:
        # data_version moves only when another connection commits: our own writes never count.
        version = self._version()
        moved, self._data_version = version != self._data_version, version
        return moved

    # --- devices
    def add_device(self, job_id: int, info: DeviceInfo, now: float, identity_id: int | None = None) -> int:
        values = info.values()
        with self.atomic() as c:
            if identity_id is not None:
                row = c.execute(
                    "SELECT id, state FROM devices WHERE job_id = ? AND identity_id = ?", (job_id, identity_id)
                ).fetchone()
                if row is not None:
                    self._count_state(job_id, row[1], DeviceStatus.ONLINE)
                    c.execute(
                        "UPDATE devices SET name = ?, platform = ?, cores = ?, memory_bytes = ?, device = ?,"
                        " gflops = ?, state = 'online', reason = '', last_seen = ? WHERE id = ?",
                        (*values, now, row[0]),
                    )
                    c.execute("UPDATE identities SET last_seen = ? WHERE id = ?", (now, identity_id))
                    return int(row[0])
                c.execute("UPDATE identities SET last_seen = ? WHERE id = ?", (now, identity_id))
            cur = c.execute(
                "INSERT INTO devices (job_id, name, platform, cores, memory_bytes, device, gflops, state, joined_at,"
                " last_seen, identity_id) VALUES (?, ?, ?, ?, ?, ?, ?, 'online', ?, ?, ?)",
                (job_id, *values, now, now, identity_id),
            )
            self._count_state(job_id, None, DeviceStatus.ONLINE)
            return _inserted(cur)

    def _set_device_state(self, device_id: int, state: str, now: float, reason: str) -> bool:
        with self.atomic() as c:
            row = c.execute("SELECT job_id, state FROM devices WHERE id = ?", (device_id,)).fetchone()
            if row is None:
                return False
            c.execute(
                "UPDATE devices SET state = ?, reason = ?, last_seen = ? WHERE id = ?", (state, reason, now, device_id)
            )
            self._count_state(row[0], row[1], state)
            return True

    def _count_state(self, job_id: int, old: str | None, new: str) -> None:
        counts = self._states.get(job_id)
        if counts is not None:  # jobs nobody asked about are counted from the rows when asked
            if old is not None:
                counts[str(old)] -= 1
            counts[str(new)] += 1

    def _credit(self, device_id: int, credit: Credit, now: float) -> bool:
        with self._grouped() as c:
            row = c.execute(_CREDIT, (*credit, now, device_id)).fetchone()
            if row is None:
                return False
            if row[0] is not None and (totals := totals_of(credit)) is not None:
                c.execute(_TOTAL, (*totals, row[0]))
            return True

    def devices(self, job_id: int, *, states: Sequence[str] | None = None, limit: int | None = None) -> list[DeviceRow]:
        if states is not None and limit is not None:
            # One index range per state, each in id order (idx_devices_job_state ends in the rowid),
            # merged: a status lists ``limit`` rows without sorting the job's every row.
            rows = heapq.merge(
                *(
                    self.conn.execute(
                        f"SELECT {_DEVICE_COLS} FROM devices WHERE job_id = ? AND state = ? ORDER BY id LIMIT ?",
                        (job_id, str(state), limit),
                    ).fetchall()
                    for state in dict.fromkeys(states)
                )
            )
            return [DeviceRow(*r) for r in itertools.islice(rows, limit)]
        where = "job_id = ?"
        params: list[Any] = [job_id]
        if states is not None:
            where += " AND state IN (SELECT value FROM json_each(?))"
            params.append(json.dumps(list(states)))
        params.append(-1 if limit is None else limit)
        return self._all(DeviceRow, f"SELECT {_DEVICE_COLS} FROM devices WHERE {where} ORDER BY id LIMIT ?", params)

    def device_states(self, job_id: int) -> dict[str, int]:
        if job_id not in self._states:  # counted once from the rows, then kept by every state change
            self._states[job_id] = Counter(
                {
                    str(state): int(n)
                    for state, n in self.conn.execute(
                        "SELECT state, COUNT(*) FROM devices WHERE job_id = ? GROUP BY state", (job_id,)
                    )
                }
            )
        return {state: n for state, n in self._states[job_id].items() if n}

    # --- GEMMs and tiles
    def next_gemm_id(self) -> int:
        row = self._one("SELECT COALESCE(MAX(id), 0) + 1 FROM gemms")
        return int(row[0]) if row else 1

    def _add_gemm(self, gemm: GemmRow, tiles: Sequence[NewTile]) -> list[int]:
        with self._grouped() as c:
            m, n, k = gemm.shape
            gid = _inserted(
                c.execute(
                    "INSERT INTO gemms (id, job_id, step, kind, m, n, k, tiles, created_at) VALUES (?,?,?,?,?,?,?,?,?)",
                    (gemm.id, gemm.job_id, gemm.step, gemm.kind, m, n, k, len(tiles), gemm.created_at),
                )
            )
            self._gemm_job[gid] = gemm.job_id
            self._count(gid, TileState.QUEUED, len(tiles))
            ids = [
                int(r[0])
                for r in (
                    c.execute(
                        "INSERT INTO tiles (gemm_id, idx, a_key, b_key, flops, state, queued_at) "
                        "VALUES (?,?,?,?,?, 'queued', ?) RETURNING id",
                        (gid, t.index, t.a_key, t.b_key, t.flops, gemm.created_at),
                    ).fetchone()
                    for t in tiles
                )
            ]
        return ids

    def finish_gemm(self, gemm_id: int, now: float) -> None:
        self._write("UPDATE gemms SET done_at = ? WHERE id = ?", (now, gemm_id), grouped=True)

    def _job_of(self, gemm_id: int) -> int:
        if gemm_id not in self._gemm_job:
            row = self._one("SELECT job_id FROM gemms WHERE id = ?", (gemm_id,))
            self._gemm_job[gemm_id] = int(row[0]) if row else -1
        return self._gemm_job[gemm_id]

    def _count(self, gemm_id: int, key: str, delta: int = 1) -> None:
        counts = self._counts.get(self._job_of(gemm_id))
        if counts is not None:  # jobs nobody asked about are counted from scratch when asked
            counts[key] += delta

    def _dequeued(self, row: tuple) -> ClaimedTile:
        """The tile a lease took from the queue (its row as ``_CLAIM`` returns it), counted."""
        issued = Issued.FIRST if row[6] is None else Issued.requeued(row[6])
        self._count(row[1], TileState.QUEUED, -1)
        self._count(row[1], TileState.LEASED)
        if row[6] is not None:
            self._count(row[1], REQUEUED)
        return ClaimedTile(row[0], row[1], row[2], row[3], row[4], row[5], issued)

    def claim_tile(self, device_id: int, prefer: Sequence[str], now: float) -> ClaimedTile | None:
        return self._from_queue(_CLAIM, {"device": device_id, "prefer": json.dumps(list(prefer))}, device_id, now)

    def lease_tile(self, tile_id: int, device_id: int, now: float) -> ClaimedTile | None:
        return self._from_queue(_LEASE, {"tile": tile_id, "device": device_id}, device_id, now)

    def _from_queue(self, sql: str, params: dict, device_id: int, now: float) -> ClaimedTile | None:
        """Lease the queued tile ``sql`` picks (one UPDATE ... RETURNING), with its lease row."""
        with self._grouped() as c:
            row = c.execute(sql, params).fetchone()
            if row is None:
                return None
            tile = self._dequeued(row)
            c.execute(_LEASE_ROW, (tile.id, device_id, now, tile.issued))
            return tile

    def lease_tiles(self, leases: Sequence[tuple[int, int]], now: float) -> list[ClaimedTile | None]:
        """One UPDATE for the batch's tiles and one INSERT for its lease rows (a tile appears once
        in a dispatch's first leases: the scheduler leases a queued tile once)."""
        if len(leases) < 2 or len({tile_id for tile_id, _ in leases}) < len(leases):  # a tile twice: in order
            return [self.lease_tile(tile_id, device_id, now) for tile_id, device_id in leases]
        with self._grouped() as c:
            rows = {
                row[0]: row
                for row in c.execute(_LEASE_MANY, {"pairs": json.dumps([list(pair) for pair in leases])}).fetchall()
            }
            out: list[ClaimedTile | None] = []
            inserts = []
            for tile_id, device_id in leases:
                row = rows.pop(tile_id, None)
                if row is None:
                    out.append(None)
                    continue
                tile = self._dequeued(row)
                inserts.append((tile_id, device_id, now, tile.issued))
                out.append(tile)
            c.executemany(_LEASE_ROW, inserts)
        return out

    def _claim_copy(self, tile_id: int, device_id: int, issued: str, now: float) -> ClaimedTile | None:
        with self._grouped() as c:
            row = c.execute(_CLAIM_COPY, {"tile": tile_id, "device": device_id}).fetchone()
            if row is None:
                return None
            self._count(row[1], COPIES[issued])
            c.execute(_LEASE_ROW, (row[0], device_id, now, issued))
            return ClaimedTile(row[0], row[1], row[2], row[3], row[4], row[5], issued)

    def _end_lease(
        self, tile_id: int, device_id: int, outcome: str, now: float, reason: str, bar: bool
    ) -> LeaseEnd | None:
        with self._grouped() as c:
            cur = c.execute(
                "UPDATE leases SET ended_at = ?, outcome = ?, reason = ? "
                "WHERE tile_id = ? AND device_id = ? AND ended_at IS NULL",
                (now, outcome, reason, tile_id, device_id),
            )
            if cur.rowcount != 1:
                return None
            won = WON.get(outcome)
            if won is not None:
                (gemm_id,) = c.execute(
                    "UPDATE tiles SET state = ?, open_leases = 0, done_at = ? WHERE id = ? RETURNING gemm_id",
                    (won.value, now, tile_id),
                ).fetchone()
                cancelled = c.execute(
                    "UPDATE leases SET ended_at = ?, outcome = 'cancelled', reason = ? "
                    "WHERE tile_id = ? AND ended_at IS NULL RETURNING device_id",
                    (now, OUTRUN, tile_id),
                ).fetchall()
                self._count(gemm_id, TileState.LEASED, -1)
                self._count(gemm_id, won)
                self._count(gemm_id, Outcome.CANCELLED, len(cancelled))
                return LeaseEnd(False, tuple(r[0] for r in cancelled))
            barred = "json_insert(barred, '$[#]', :device)" if bar else "barred"
            state, gemm_id = c.execute(
                f"UPDATE tiles SET open_leases = open_leases - 1, barred = {barred}, "
                "state = CASE WHEN open_leases = 1 THEN 'queued' ELSE state END, "
                "requeue_reason = CASE WHEN open_leases = 1 THEN :outcome ELSE requeue_reason END "
                "WHERE id = :tile RETURNING state, gemm_id",
                {"tile": tile_id, "device": device_id, "outcome": outcome},
            ).fetchone()
            if outcome in (Outcome.REJECTED, Outcome.LOST, Outcome.REVOKED):
                self._count(gemm_id, outcome)
            if outcome == Outcome.LOST and (lost := self._lost.get(self._job_of(gemm_id))) is not None:
                lost[reason] += 1
            if state == TileState.QUEUED:
                self._count(gemm_id, TileState.LEASED, -1)
                self._count(gemm_id, TileState.QUEUED)
            return LeaseEnd(state == TileState.QUEUED)

    def verify_taken(self, results: Sequence[tuple[int, int]], now: float) -> None:
        if not results:
            return
        pairs = json.dumps([list(r) for r in results])
        with self._grouped() as c:
            leases = c.execute(
                "UPDATE leases SET outcome = 'verified' WHERE tile_id IN (SELECT json_extract(value, '$[0]') "
                "FROM json_each(:pairs)) AND outcome = 'taken' AND EXISTS (SELECT 1 FROM json_each(:pairs) AS p "
                "WHERE json_extract(p.value, '$[0]') = leases.tile_id "
                "AND json_extract(p.value, '$[1]') = leases.device_id)",
                {"pairs": pairs},
            ).rowcount
            gemms = c.execute(
                "UPDATE tiles SET state = 'verified' WHERE id IN (SELECT json_extract(value, '$[0]') "
                "FROM json_each(:pairs)) AND state = 'taken' RETURNING gemm_id",
                {"pairs": pairs},
            ).fetchall()
            if leases != len(results) or len(gemms) != len(results):  # a bug: its write is undone, or the job stops
                raise StoreError(f"{len(results) - min(leases, len(gemms))} of {len(results)} results were not taken")
            for (gemm_id,) in gemms:
                self._count(gemm_id, TileState.TAKEN, -1)
                self._count(gemm_id, TileState.VERIFIED)

    def _reject_taken(self, tile_id: int, device_id: int, now: float, reason: str, outcome: str) -> None:
        with self._grouped() as c:
            cur = c.execute(
                "UPDATE leases SET outcome = :outcome, reason = :reason WHERE id = (SELECT max(id) FROM leases "
                "WHERE tile_id = :tile AND device_id = :device AND outcome = 'taken')",
                {"outcome": outcome, "reason": reason, "tile": tile_id, "device": device_id},
            )
            row = c.execute(
                "UPDATE tiles SET state = 'queued', requeue_reason = :outcome, done_at = NULL, queued_at = :now, "
                "barred = json_insert(barred, '$[#]', :device) WHERE id = :tile AND state = 'taken' "
                "RETURNING gemm_id",
                {"outcome": outcome, "now": now, "tile": tile_id, "device": device_id},
            ).fetchone()
            if cur.rowcount != 1 or row is None:  # raised inside: its savepoint undoes both updates
                raise no_result(tile_id, device_id)
            self._count(row[0], TileState.TAKEN, -1)
            self._count(row[0], TileState.QUEUED)
            self._count(row[0], outcome)

    def leased_to(self, device_id: int) -> list[int]:
        return [
            r[0]
            for r in self.conn.execute(
                "SELECT tile_id FROM leases WHERE device_id = ? AND ended_at IS NULL ORDER BY tile_id", (device_id,)
            )
        ]

    def _tile_state(self, tile_id: int) -> str | None:
        row = self._one("SELECT state FROM tiles WHERE id = ?", (tile_id,))
        return None if row is None else str(row[0])

    def _lost_reasons(self, job_id: int) -> Counter[str]:
        if job_id not in self._lost:  # counted once from the rows (and what was pruned), then kept by end_lease
            lost = self._lost_counted("g.job_id = :job", {"job": job_id})
            for reason, n in self.conn.execute("SELECT reason, n FROM pruned_lost WHERE job_id = ?", (job_id,)):
                lost[str(reason)] += int(n)
            self._lost[job_id] = lost
        return self._lost[job_id]

    def tile_counts(self, job_id: int) -> dict[str, int]:
        if job_id not in self._counts:
            self._counts[job_id] = Counter(self.recount(job_id))
        return {key: self._counts[job_id][key] for key in TILE_COUNTS}

    def recount(self, job_id: int) -> dict[str, int]:
        """Tile counts from the rows themselves and what pruning took from them (the running
        counters must always agree)."""
        counts = self._counted("g.job_id = :job", {"job": job_id})
        for key, n in self.conn.execute("SELECT key, n FROM pruned_counts WHERE job_id = ?", (job_id,)):
            counts[key] = counts.get(key, 0) + int(n)
        return counts

    def _counted(self, gemms: str, params: dict[str, Any]) -> dict[str, int]:
        """Tile counts of the rows of the GEMMs ``gemms`` picks (a condition on ``gemms g``)."""
        counts = dict.fromkeys(TILE_COUNTS, 0)
        for state, n in self.conn.execute(
            f"SELECT t.state, COUNT(*) FROM tiles t JOIN gemms g ON g.id = t.gemm_id WHERE {gemms} GROUP BY t.state",
            params,
        ):
            counts[state] = n
        row = self._one(
            "SELECT"
            " COALESCE(SUM(l.outcome = 'rejected'), 0), COALESCE(SUM(l.outcome = 'lost'), 0),"
            " COALESCE(SUM(l.outcome = 'cancelled'), 0), COALESCE(SUM(l.outcome = 'revoked'), 0),"
            " COALESCE(SUM(l.issued LIKE 'requeued%'), 0),"
            " COALESCE(SUM(l.issued = :spec), 0), COALESCE(SUM(l.issued = :deadline), 0) "
            f"FROM leases l JOIN tiles t ON t.id = l.tile_id JOIN gemms g ON g.id = t.gemm_id WHERE {gemms}",
            {**params, "spec": Issued.SPECULATIVE, "deadline": Issued.DEADLINE},
        )
        assert row is not None
        for name, value in zip(TILE_COUNTS[len(TileState) :], row):
            counts[name] = int(value)
        return counts

    def _lost_counted(self, gemms: str, params: dict[str, Any]) -> Counter[str]:
        """Why the leases of the GEMMs ``gemms`` picks were lost: reason -> leases."""
        return Counter(
            {
                str(reason): int(n)
                for reason, n in self.conn.execute(
                    "SELECT l.reason, COUNT(*) FROM leases l JOIN tiles t ON t.id = l.tile_id "
                    f"JOIN gemms g ON g.id = t.gemm_id WHERE {gemms} AND l.outcome = :lost GROUP BY l.reason",
                    {**params, "lost": Outcome.LOST.value},
                )
            }
        )

    def leases(self, tile_id: int) -> list[LeaseRow]:
        return self._all(LeaseRow, f"SELECT {_LEASE_COLS} FROM leases WHERE tile_id = ? ORDER BY id", (tile_id,))

    def _unbar_tile(self, tile_id: int) -> bool:
        return self._write("UPDATE tiles SET barred = '[]' WHERE id = ?", (tile_id,)).rowcount == 1

    # --- checkpoints and resuming
    def add_checkpoint(self, row: CheckpointRow) -> None:
        self._write(
            f"INSERT INTO checkpoints ({_CHECKPOINT_COLS}) VALUES (?, ?, ?, ?, ?, ?)",
            (row.job_id, row.step, row.path, row.sha256, row.bytes, row.created_at),
        )

    def checkpoints(self, job_id: int) -> list[CheckpointRow]:
        return self._all(
            CheckpointRow,
            f"SELECT {_CHECKPOINT_COLS} FROM checkpoints WHERE job_id = ? ORDER BY step DESC, id DESC",
            (job_id,),
        )

    def newest_job(self) -> JobRow | None:
        row = self._one("SELECT id FROM jobs ORDER BY id DESC LIMIT 1")
        return self.job(int(row[0])) if row is not None else None

    def truncate_steps(self, job_id: int, after: int) -> None:
        with self.atomic() as c:
            c.execute("DELETE FROM steps WHERE job_id = ? AND step > ?", (job_id, after))
            c.execute("UPDATE jobs SET step = MIN(step, ?) WHERE id = ?", (after, job_id))

    def abandon_unfinished(self, job_id: int | None, now: float) -> int:
        jobs = "(SELECT id FROM gemms WHERE job_id = :job OR :job IS NULL)"
        with self.atomic() as c:
            # A result waiting for its band's check died with its coordinator: lost too.
            c.execute(
                "UPDATE leases SET ended_at = :now, outcome = :lost, reason = :why "
                "WHERE (ended_at IS NULL OR outcome = 'taken') "
                f"AND tile_id IN (SELECT id FROM tiles WHERE gemm_id IN {jobs})",
                {"now": now, "job": job_id, "lost": Outcome.LOST.value, "why": RESTARTED},
            )
            cur = c.execute(
                "UPDATE tiles SET state = 'abandoned', open_leases = 0 WHERE state IN ('queued', 'leased', 'taken') "
                f"AND gemm_id IN {jobs}",
                {"job": job_id},
            )
            self._counts.clear()  # a bulk change: count again when asked
            self._lost.clear()
            return cur.rowcount

    def prune_gemms(self, job_id: int, through_step: int) -> int:
        # The rows go and their pages return to SQLite's free list, which later inserts reuse:
        # the file stops growing once it holds the steps kept (no VACUUM here: it rewrites the file).
        with self.atomic() as c:
            (newest,) = c.execute("SELECT COALESCE(MAX(id), 0) FROM gemms").fetchone()
            params = {"job": job_id, "through": through_step, "newest": newest}
            ids = [int(r[0]) for r in c.execute(_PRUNED_IDS, params)]
            if not ids:
                return 0
            counts = {key: n for key, n in self._counted(_PRUNED, params).items() if n}
            lost = self._lost_counted(_PRUNED, params)
            c.executemany(
                "INSERT INTO pruned_counts (job_id, key, n) VALUES (?, ?, ?) "
                "ON CONFLICT (job_id, key) DO UPDATE SET n = n + excluded.n",
                [(job_id, str(key), n) for key, n in counts.items()],
            )
            c.executemany(
                "INSERT INTO pruned_lost (job_id, reason, n) VALUES (?, ?, ?) "
                "ON CONFLICT (job_id, reason) DO UPDATE SET n = n + excluded.n",
                [(job_id, reason, n) for reason, n in lost.items()],
            )
            for delete in PRUNE_DELETES:
                c.execute(delete, params)
        for gid in ids:  # the running counters still hold what the rows held: nothing to change there
            self._gemm_job.pop(gid, None)
        return len(ids)

    def close(self) -> None:
        self.flush()
        self._closed = True
        self.conn.close()
