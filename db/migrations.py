"""Schema migrations: named functions, applied once each, recorded in ``_migrations``."""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlite_utils

Migration = Callable[[sqlite_utils.Database], None]
MIGRATIONS: list[tuple[str, Migration]] = []


def migration(fn: Migration) -> Migration:
    MIGRATIONS.append((fn.__name__, fn))
    return fn


@migration
def m001_initial(db: sqlite_utils.Database) -> None:
    db.table("jobs").create(
        {
            "id": int,
            "name": str,
            "config": str,
            "state": str,
            "step": int,
            "steps": int,
            "created_at": float,
            "finished_at": float,
        },
        pk="id",
        not_null={"name", "config", "state"},
    )
    db.table("steps").create(
        {"job_id": int, "step": int, "loss": float, "tokens": int, "seconds": float, "at": float, "extra": str},
        pk=("job_id", "step"),
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db.table("devices").create(
        {
            "id": int,
            "job_id": int,
            "name": str,
            "platform": str,
            "cores": int,
            "memory_bytes": int,
            "device": str,
            "gflops": float,
            "state": str,
            "joined_at": float,
            "last_seen": float,
            "tiles_done": int,
            "tiles_rejected": int,
            "tiles_lost": int,
            "gflop_verified": float,
            "reason": str,
        },
        pk="id",
        defaults={"tiles_done": 0, "tiles_rejected": 0, "tiles_lost": 0, "gflop_verified": 0.0, "reason": ""},
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db.table("gemms").create(
        {
            "id": int,
            "job_id": int,
            "step": int,
            "kind": str,
            "m": int,
            "n": int,
            "k": int,
            "tiles": int,
            "created_at": float,
            "done_at": float,
        },
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
    )
    db.table("tiles").create(
        {
            "id": int,
            "gemm_id": int,
            "idx": int,
            "a_key": str,
            "b_key": str,
            "flops": int,
            "state": str,
            "open_leases": int,
            "attempts": int,
            "barred": str,
            "requeue_reason": str,
            "queued_at": float,
            "done_at": float,
        },
        pk="id",
        foreign_keys=[("gemm_id", "gemms", "id")],
        defaults={"attempts": 0, "open_leases": 0, "barred": "[]"},
    )
    db.table("tiles").create_index(["state", "id"])
    db.table("leases").create(
        {
            "id": int,
            "tile_id": int,
            "device_id": int,
            "leased_at": float,
            "ended_at": float,
            "outcome": str,
            "reason": str,
            "issued": str,
        },
        pk="id",
        foreign_keys=[("tile_id", "tiles", "id")],
        defaults={"reason": "", "issued": "first"},
    )
    db.table("leases").create_index(["tile_id"])
    db.table("leases").create_index(["device_id", "ended_at"])
    db.table("checkpoints").create(
        {"id": int, "job_id": int, "step": int, "path": str, "sha256": str, "bytes": int, "created_at": float},
        pk="id",
        foreign_keys=[("job_id", "jobs", "id")],
    )


@migration
def m002_identities(db: sqlite_utils.Database) -> None:
    """Enrolled identities (credit, bans and reliability belong to them), settings such as the
    token hashes, and one device row per identity per job."""
    db.table("identities").create(
        {"id": int, "name": str, "key": bytes, "state": str, "reason": str, "created_at": float, "last_seen": float},
        pk="id",
        not_null={"name", "key", "state"},
        defaults={"state": "active", "reason": ""},
    )
    db.table("settings").create({"key": str, "value": str}, pk="key", not_null={"value"})
    db.execute("ALTER TABLE devices ADD COLUMN identity_id INTEGER REFERENCES identities(id)")
    db.execute("ALTER TABLE devices ADD COLUMN tiles_revoked INTEGER NOT NULL DEFAULT 0")
    db.execute("CREATE UNIQUE INDEX idx_devices_job_identity ON devices (job_id, identity_id)")
    db.execute("CREATE INDEX idx_devices_identity ON devices (identity_id)")
    db.execute("CREATE INDEX idx_devices_job_state ON devices (job_id, state)")


@migration
def m003_energy(db: sqlite_utils.Database) -> None:
    """Each device row's energy as booked (joules, capped reports at their cap) and how many of
    its reports were capped: the leaderboard ranks by verified GFLOP per joule."""
    db.execute("ALTER TABLE devices ADD COLUMN joules REAL NOT NULL DEFAULT 0.0")
    db.execute("ALTER TABLE devices ADD COLUMN energy_flagged INTEGER NOT NULL DEFAULT 0")


@migration
def m004_energy_metered(db: sqlite_utils.Database) -> None:
    """Of each device row's verified GFLOP, those its energy reports covered: the leaderboard's
    GFLOP per joule divides these, so work no report covered cannot flatter a device."""
    db.execute("ALTER TABLE devices ADD COLUMN gflop_metered REAL NOT NULL DEFAULT 0.0")


@migration
def m005_identity_totals(db: sqlite_utils.Database) -> None:
    """Each identity's totals over every job, kept by ``credit_device`` beside its device rows',
    and two partial indexes in the leaderboard's orders: a public status ranks with an
    index-ordered LIMIT, whatever the number of identities, and an identity that never had
    verified work is in neither index (it costs a leaderboard nothing)."""
    for column, kind in (("gflop_verified", "REAL"), ("tiles_done", "INTEGER"), ("joules", "REAL"),
                         ("gflop_metered", "REAL")):  # fmt: skip
        db.execute(f"ALTER TABLE identities ADD COLUMN {column} {kind} NOT NULL DEFAULT 0")
    db.execute(
        "UPDATE identities SET (gflop_verified, tiles_done, joules, gflop_metered) = (SELECT"
        " COALESCE(SUM(d.gflop_verified), 0.0), COALESCE(SUM(d.tiles_done), 0), COALESCE(SUM(d.joules), 0.0),"
        " COALESCE(SUM(d.gflop_metered), 0.0) FROM devices d WHERE d.identity_id = identities.id)"
    )
    db.execute(
        "CREATE INDEX idx_identities_rank_gflop ON identities (state, gflop_verified DESC, id) WHERE gflop_verified > 0"
    )
    db.execute(
        "CREATE INDEX idx_identities_rank_gflop_per_j ON identities (state, (gflop_metered / joules) DESC, id)"
        " WHERE gflop_verified > 0 AND joules > 0"
    )


@migration
def m006_pruning(db: sqlite_utils.Database) -> None:
    """What ``--prune-steps`` deleted, per job: the tile counts and lost reasons its GEMM, tile and
    lease rows held, which ``recount`` and ``lost_reasons`` add back, so a job's books read the
    same after its old rows are gone. The indexes let the pruning's deletes (and the foreign-key
    checks they make) find a step's GEMMs, a GEMM's tiles and a tile's leases without a scan."""
    db.table("pruned_counts").create(
        {"job_id": int, "key": str, "n": int}, pk=("job_id", "key"), foreign_keys=[("job_id", "jobs", "id")]
    )
    db.table("pruned_lost").create(
        {"job_id": int, "reason": str, "n": int}, pk=("job_id", "reason"), foreign_keys=[("job_id", "jobs", "id")]
    )
    db.execute("CREATE INDEX IF NOT EXISTS idx_gemms_job_step ON gemms (job_id, step)")
    db.execute("CREATE INDEX IF NOT EXISTS idx_tiles_gemm ON tiles (gemm_id)")


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply pending migrations; returns the names applied."""
    if "_migrations" not in db.table_names():
        db.table("_migrations").create({"name": str, "applied_at": float}, pk="name")
    done = {r["name"] for r in db.table("_migrations").rows}
    applied = []
    for name, fn in MIGRATIONS:
        if name in done:
            continue
        with db.conn:
            fn(db)
            db.table("_migrations").insert({"name": name, "applied_at": time.time()})
        applied.append(name)
    return applied
