"""One test suite, run against both Store implementations."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from cleave.db.memory import MemoryStore
from cleave.db.migrations import migrate
from cleave.db.sqlite import SQLiteStore
from cleave.db.store import RESTARTED, CheckpointRow, DeviceInfo, Issued, LeaderRow, NewTile, Outcome, Store
from cleave.wire.errors import StoreError


@pytest.fixture(params=["memory", "sqlite", "sqlite-grouped"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    # "sqlite-grouped": as a coordinator runs it, hot-path writes sharing one transaction (a
    # window no test reaches, so only flush() and durable writes commit them).
    s: Store = (
        MemoryStore()
        if request.param == "memory"
        else SQLiteStore(tmp_path / "s.db", group_seconds=0.0 if request.param == "sqlite" else 1.0)
    )
    yield s
    s.close()


def _counts(store: Store, job: int) -> dict[str, int]:
    counts = store.tile_counts(job)
    return {k: counts[k] for k in ("queued", "leased", "verified", "rejected")}


def _gemm(store: Store, job: int, n: int = 3) -> tuple[int, list[int]]:
    gid = store.next_gemm_id()
    tiles = [NewTile(i, f"{gid}.a{i}", f"{gid}.b", 100) for i in range(n)]
    return gid, store.add_gemm(gid, job, 1, "fwd", (n, 1, 1), tiles, now=10.0)


def test_job_and_steps(store: Store) -> None:
    job = store.create_job("tiny", {"lr": 0.1}, steps=5, now=1.0)
    store.record_step(job, 1, 5.5, 512, 0.1, now=2.0, extra={"devices": 2})
    store.record_step(job, 2, 5.0, 512, 0.1, now=3.0)
    row = store.job(job)
    assert (row.name, row.config, row.steps, row.step, row.state) == ("tiny", {"lr": 0.1}, 5, 2, "running")
    assert [(s.step, s.loss) for s in store.steps(job)] == [(1, 5.5), (2, 5.0)]
    assert store.steps(job)[0].extra == {"devices": 2}
    store.set_job_state(job, "finished", now=4.0)
    assert store.job(job).finished_at == 4.0
    with pytest.raises(StoreError):
        store.job(999)


def test_a_steps_held_out_loss_is_kept_and_a_diverged_one_is_stored_as_null(store: Store) -> None:
    job = store.create_job("j", {}, 3, 0.0)
    store.record_step(job, 1, 5.0, 8, 0.1, 1.0, extra={"devices": 2})
    store.record_step(job, 2, 4.5, 8, 0.1, 2.0, extra={"val_loss": 4.75, "eval_s": 0.25})
    store.record_step(job, 3, 4.0, 8, 0.1, 3.0, extra={"val_loss": float("nan"), "sources": {"x": float("inf")}})
    assert [r.extra.get("val_loss") for r in store.steps(job)] == [None, 4.75, None]
    assert store.steps(job)[2].extra == {"val_loss": None, "sources": {"x": None}}  # strict JSON, as the metrics file
    if isinstance(store, SQLiteStore):  # every row reads with SQLite's own JSON functions
        query = "SELECT step, json_extract(extra, '$.val_loss') FROM steps WHERE job_id = ? ORDER BY step"
        assert store.conn.execute(query, (job,)).fetchall() == [(1, None), (2, 4.75), (3, None)]


def test_devices_are_credited(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("laptop", "Linux", 4, 1 << 30, "cpu", 50.0), now=1.0)
    store.credit_device(d, verified=2, rejected=1, gflop=0.5, now=2.0)
    store.set_device_state(d, "offline", now=3.0, reason="left")
    (row,) = store.devices(job)
    assert store.devices(store.create_job("next", {}, 1, 5.0)) == []
    assert (row.name, row.tiles_done, row.tiles_rejected, row.gflop_verified) == ("laptop", 2, 1, 0.5)
    assert (row.state, row.reason, row.last_seen) == ("offline", "left", 3.0)
    with pytest.raises(StoreError):
        store.credit_device(99, verified=1, rejected=0, gflop=0.0, now=1.0)


def test_claims_oldest_tile_first_and_each_tile_once(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    gid, ids = _gemm(store, job)
    claimed = [store.claim_tile(d, [], now=11.0) for _ in range(4)]
    assert [c.id for c in claimed[:3] if c] == ids
    assert claimed[3] is None
    assert claimed[0] is not None and claimed[0].a_key == f"{gid}.a0" and claimed[0].attempt == 1
    assert _counts(store, job) == {"queued": 0, "leased": 3, "verified": 0, "rejected": 0}


def test_claim_prefers_tiles_whose_blocks_the_device_holds(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    gid, ids = _gemm(store, job, n=4)
    c = store.claim_tile(d, [f"{gid}.a2", f"{gid}.b"], now=11.0)
    assert c is not None and c.id == ids[2]


def test_verified_lease_finishes_tile_and_records_history(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, ids = _gemm(store, job, n=1)
    store.claim_tile(d, [], now=11.0)
    store.end_lease(ids[0], d, "verified", now=12.0)
    assert store.tile_state(ids[0]) == "verified"
    (lease,) = store.leases(ids[0])
    assert (lease.device_id, lease.leased_at, lease.ended_at, lease.outcome) == (d, 11.0, 12.0, "verified")
    with pytest.raises(StoreError):  # a finished lease cannot end twice
        store.end_lease(ids[0], d, "verified", now=13.0)


def test_rejected_tile_is_requeued_and_barred_from_that_device(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    bad, good = store.add_device(job, DeviceInfo("bad"), 0.0), store.add_device(job, DeviceInfo("good"), 0.0)
    _, ids = _gemm(store, job, n=1)
    store.claim_tile(bad, [], now=11.0)
    store.end_lease(ids[0], bad, "rejected", now=12.0, reason="Freivalds")
    assert store.tile_state(ids[0]) == "queued"
    assert store.claim_tile(bad, [], now=13.0) is None
    again = store.claim_tile(good, [], now=13.0)
    assert again is not None and again.id == ids[0] and again.attempt == 2
    assert store.tile_counts(job)["rejected"] == 1
    assert [(lease.outcome, lease.issued) for lease in store.leases(ids[0])] == [
        ("rejected", "first"),
        (None, "requeued after rejected"),
    ]
    assert store.tile_counts(job)["requeued"] == 1


def test_release_device_requeues_all_its_tiles(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d, other = store.add_device(job, DeviceInfo("a"), 0.0), store.add_device(job, DeviceInfo("b"), 0.0)
    _, ids = _gemm(store, job, n=3)
    store.claim_tile(d, [], now=11.0)
    store.claim_tile(d, [], now=11.0)
    store.claim_tile(other, [], now=11.0)
    assert store.leased_to(d) == ids[:2]
    assert store.release_device(d, "lost", now=12.0, reason="socket closed") == ids[:2]
    assert store.leased_to(d) == []
    assert _counts(store, job) == {"queued": 2, "leased": 1, "verified": 0, "rejected": 0}
    assert store.leases(ids[0])[0].outcome == "lost"
    # A lost device is not barred: the tile may go back to it if it returns.
    assert store.claim_tile(d, [], now=13.0) is not None


def test_end_lease_checks_ownership_and_outcome(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d, other = store.add_device(job, DeviceInfo("a"), 0.0), store.add_device(job, DeviceInfo("b"), 0.0)
    _, ids = _gemm(store, job, n=1)
    store.claim_tile(d, [], now=11.0)
    with pytest.raises(StoreError):
        store.end_lease(ids[0], other, "verified", now=12.0)
    with pytest.raises(StoreError):
        store.end_lease(ids[0], d, "exploded", now=12.0)
    with pytest.raises(StoreError):
        store.tile_state(12345)


def test_unknown_ids_and_bad_arguments_are_refused_alike_and_write_nothing(store: Store) -> None:
    """Both stores take these checks from their base class: the same one-line error, nothing written."""
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, (tile,) = _gemm(store, job, n=1)
    store.claim_tile(d, [], now=11.0)
    refused: list[tuple[Callable[[], object], str]] = [
        (lambda: store.job(99), "no job 99"),
        (lambda: store.tile_state(99), "no tile 99"),
        (lambda: store.unbar_tile(99), "no tile 99"),
        (lambda: store.set_device_state(99, "offline", 12.0), "no device 99"),
        (lambda: store.credit_device(99, verified=1, now=12.0), "no device 99"),
        (lambda: store.set_identity_state(99, "banned", "", 12.0), "no identity 99"),
        (lambda: store.set_identity_state(99, "asleep", "", 12.0), "an identity cannot be 'asleep'"),
        (lambda: store.leaderboard(by="tiles"), "a leaderboard ranks by gflop or gflop_per_j, not 'tiles'"),
        (lambda: store.claim_copy(tile, d, "first", 12.0), "issued as 'speculative' or 'deadline passed', not 'first'"),
        (lambda: store.end_lease(tile, d, "cancelled", 12.0), "a lease cannot be ended as 'cancelled'"),
        (lambda: store.end_lease(99, d, "verified", 12.0), f"tile 99 is not leased to device {d}"),
        (lambda: store.reject_taken(tile, d, 12.0, "x", outcome="lost"), "cannot be ended as 'lost'"),
        (lambda: store.reject_taken(tile, d, 12.0, "x"), f"tile {tile} has no result of device {d} waiting"),
    ]
    for call, message in refused:
        with pytest.raises(StoreError, match=re.escape(message)):
            call()
    assert store.tile_state(tile) == "leased" and store.leased_to(d) == [tile]
    assert [lease.outcome for lease in store.leases(tile)] == [None]
    assert store.devices(job)[0].tiles_done == 0 and store.tile_counts(job)["leased"] == 1


def test_gemm_ids_are_handed_out_in_order(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    first, _ = _gemm(store, job)
    assert store.next_gemm_id() == first + 1
    with pytest.raises(Exception):  # noqa: B017 - each store refuses in its own way
        store.add_gemm(first, job, 1, "fwd", (1, 1, 1), [], now=1.0)  # taken


def test_counts_are_per_job(store: Store) -> None:
    j1, j2 = store.create_job("1", {}, 1, 0.0), store.create_job("2", {}, 1, 0.0)
    _gemm(store, j1, n=2)
    _gemm(store, j2, n=5)
    assert store.tile_counts(j1)["queued"] == 2 and store.tile_counts(j2)["queued"] == 5


def test_sqlite_state_survives_reopen_and_migrations_run_once(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    s = SQLiteStore(path)
    job = s.create_job("j", {"seed": 1}, 3, 0.0)
    s.record_step(job, 1, 4.0, 10, 0.1, 1.0)
    s.close()
    again = SQLiteStore(path)
    assert again.job(job).config == {"seed": 1} and again.steps(job)[0].loss == 4.0
    assert migrate(again.db) == []
    assert again.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again.close()


def test_sqlite_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="cannot open database"):
        SQLiteStore(path)


def test_a_copy_of_an_outstanding_tile_and_the_first_verified_result_wins(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    slow, fast, third = (store.add_device(job, DeviceInfo(n), 0.0) for n in ("slow", "fast", "third"))
    _, (tile,) = _gemm(store, job, n=1)
    store.claim_tile(slow, [], now=11.0)
    copy = store.claim_copy(tile, fast, Issued.SPECULATIVE, now=12.0)
    assert copy is not None and copy.id == tile and copy.issued == Issued.SPECULATIVE and copy.attempt == 2
    assert store.claim_copy(tile, fast, Issued.SPECULATIVE, now=12.0) is None  # one copy per device
    assert store.claim_copy(tile, slow, Issued.DEADLINE, now=12.0) is None
    assert store.claim_copy(tile, third, Issued.DEADLINE, now=12.5) is not None
    end = store.end_lease(tile, fast, "verified", now=13.0)
    assert not end.requeued and sorted(end.cancelled) == sorted([slow, third])
    assert store.tile_state(tile) == "verified"
    assert [(lease.device_id, lease.outcome) for lease in store.leases(tile)] == [
        (slow, "cancelled"),
        (fast, "verified"),
        (third, "cancelled"),
    ]
    with pytest.raises(StoreError):  # the straggler's late result finds no open lease
        store.end_lease(tile, slow, "verified", now=14.0)
    counts = store.tile_counts(job)
    assert (counts["speculative"], counts["expired"], counts["cancelled"]) == (1, 1, 2)
    assert store.claim_copy(tile, slow, Issued.SPECULATIVE, now=15.0) is None  # finished tiles get no copies


def test_a_tile_is_requeued_only_when_its_last_copy_fails(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    a, b = store.add_device(job, DeviceInfo("a"), 0.0), store.add_device(job, DeviceInfo("b"), 0.0)
    _, (tile,) = _gemm(store, job, n=1)
    store.claim_tile(a, [], now=1.0)
    store.claim_copy(tile, b, Issued.DEADLINE, now=2.0)
    assert store.end_lease(tile, a, "lost", now=3.0).requeued is False
    assert store.tile_state(tile) == "leased"
    assert store.release_device(b, "lost", now=4.0) == [tile]
    assert store.tile_state(tile) == "queued"
    with pytest.raises(StoreError):
        store.claim_copy(tile, a, "because", now=5.0)


def test_copies_are_never_issued_for_queued_tiles_or_to_barred_devices(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    a, b = store.add_device(job, DeviceInfo("a"), 0.0), store.add_device(job, DeviceInfo("b"), 0.0)
    _, (tile,) = _gemm(store, job, n=1)
    assert store.claim_copy(tile, a, Issued.SPECULATIVE, now=1.0) is None  # queued: claim it instead
    store.claim_tile(a, [], now=1.0)
    store.claim_copy(tile, b, Issued.SPECULATIVE, now=1.5)
    store.end_lease(tile, b, "rejected", now=2.0)
    assert store.claim_copy(tile, b, Issued.SPECULATIVE, now=3.0) is None


def test_checkpoints_are_listed_newest_first(store: Store) -> None:
    job = store.create_job("j", {}, 10, 0.0)
    for step in (5, 10):
        store.add_checkpoint(CheckpointRow(job, step, f"/c/{step}.pt", "ab" * 32, 100 + step, float(step)))
    assert [c.step for c in store.checkpoints(job)] == [10, 5]
    assert store.checkpoints(job + 1) == []


def test_a_job_whose_coordinator_died_can_be_resumed(store: Store) -> None:
    done = store.create_job("done", {}, 1, 0.0)
    store.set_job_state(done, "finished", 1.0)
    assert store.resumable_job() is None
    job = store.create_job("crashed", {"seed": 3}, 10, 2.0)
    d = store.add_device(job, DeviceInfo("a"), 2.0)
    for step in range(1, 8):
        store.record_step(job, step, 5.0 - step / 10, 10, 0.1, 3.0)
    _, ids = _gemm(store, job, n=3)
    store.claim_tile(d, [], now=4.0)
    store.end_lease(ids[0], d, "verified", now=4.5)
    store.claim_tile(d, [], now=4.6)
    resumable = store.resumable_job()
    assert resumable is not None and resumable.id == job and resumable.config == {"seed": 3}
    store.set_job_state(job, "stopped", 5.0)  # Ctrl-C on the coordinator: still resumable
    assert store.resumable_job() is not None
    store.set_job_state(job, "failed", 5.0)  # a start that never trained: not resumed
    assert store.resumable_job() is None
    store.set_job_state(job, "running", 5.0)
    assert store.abandon_unfinished(job, now=9.0) == 2
    assert store.abandon_unfinished(job, now=9.5) == 0  # already abandoned
    assert store.claim_tile(d, [], now=9.5) is None  # the dead run's tiles are never handed out
    assert store.leases(ids[1])[-1].outcome == "lost"
    assert store.tile_counts(job)["abandoned"] == 2
    store.truncate_steps(job, after=5)
    assert [s.step for s in store.steps(job)] == [1, 2, 3, 4, 5] and store.job(job).step == 5
    store.record_step(job, 6, 4.0, 10, 0.1, 10.0)
    assert store.steps(job)[-1].loss == 4.0


def test_only_the_newest_job_is_resumed(store: Store) -> None:
    old = store.create_job("old", {}, 10, 0.0)
    store.set_job_state(old, "stopped", 1.0)
    new = store.create_job("new", {}, 10, 2.0)
    store.set_job_state(new, "finished", 3.0)
    assert store.resumable_job() is None


def test_the_newest_job_is_the_last_created_whatever_its_state(store: Store) -> None:
    assert store.newest_job() is None
    store.create_job("old", {"model": "tiny"}, 10, 0.0)
    new = store.create_job("new", {"model": "small"}, 10, 2.0)
    store.set_job_state(new, "finished", 3.0)
    newest = store.newest_job()
    assert newest is not None and (newest.id, newest.name, newest.config) == (new, "new", {"model": "small"})


def test_device_reliability_counts_verified_against_failed_work(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    (row,) = store.devices(job)
    assert row.reliability == 1.0
    store.credit_device(d, verified=6, rejected=1, lost=1, gflop=1.0, now=1.0)
    (row,) = store.devices(job)
    assert row.tiles_lost == 1 and row.reliability == 0.75


def test_sqlite_running_counts_always_equal_a_recount(tmp_path: Path) -> None:
    """Random claims, copies, verdicts, losses and releases: the counters never drift."""
    import random

    store = SQLiteStore(tmp_path / "counts.db")
    rng = random.Random(5)
    job = store.create_job("j", {}, 1, 0.0)
    devices = [store.add_device(job, DeviceInfo(f"d{i}"), 0.0) for i in range(4)]
    assert store.tile_counts(job)["queued"] == 0  # counters now live
    open_leases: list[tuple[int, int]] = []
    for step in range(400):
        op = rng.random()
        now = float(step)
        if op < 0.15:
            _gemm(store, job, n=rng.randint(1, 4))
        elif op < 0.45:
            dev = rng.choice(devices)
            claimed = store.claim_tile(dev, [], now)
            if claimed:
                open_leases.append((claimed.id, dev))
        elif op < 0.55 and open_leases:
            tile, _ = rng.choice(open_leases)
            dev = rng.choice(devices)
            copy = store.claim_copy(tile, dev, rng.choice([Issued.SPECULATIVE, Issued.DEADLINE]), now)
            if copy:
                open_leases.append((tile, dev))
        elif op < 0.9 and open_leases:
            tile, dev = open_leases.pop(rng.randrange(len(open_leases)))
            outcome = rng.choice(["verified", "verified", "rejected", "lost", "released"])
            store.end_lease(tile, dev, outcome, now)
            if outcome == "verified":
                open_leases = [(t, d) for t, d in open_leases if t != tile]
        elif open_leases:
            dev = rng.choice(devices)
            store.release_device(dev, "lost", now)
            open_leases = [(t, d) for t, d in open_leases if d != dev]
        assert store.tile_counts(job) == store.recount(job), f"drift after operation {step}"
    store.abandon_unfinished(job, 500.0)
    assert store.tile_counts(job) == store.recount(job)
    store.close()


def test_a_start_abandons_every_dead_jobs_tiles(store: Store) -> None:
    """A tile left queued by a killed run must never be handed to the next job."""
    old = store.create_job("old", {}, 1, 0.0)
    _gemm(store, old, n=2)
    store.set_job_state(old, "failed", 1.0)
    assert store.abandon_unfinished(None, now=2.0) == 2
    new = store.create_job("new", {}, 1, 3.0)
    d = store.add_device(new, DeviceInfo("a"), 3.0)
    assert store.claim_tile(d, [], now=4.0) is None
    _, (fresh,) = _gemm(store, new, n=1)
    claimed = store.claim_tile(d, [], now=5.0)
    assert claimed is not None and claimed.id == fresh


def test_identities_own_their_device_rows_credit_and_state(store: Store) -> None:
    alice = store.enrol("alice", b"k" * 32, now=1.0)
    mallory = store.enrol("alice", b"m" * 32, now=1.5)  # same name, another identity
    assert alice != mallory and store.identity_key(alice) == b"k" * 32 and store.identity_key(999) is None
    first = store.create_job("first", {}, 1, 2.0)
    d1 = store.add_device(first, DeviceInfo("alice"), 2.0, identity_id=alice)
    assert store.add_device(first, DeviceInfo("alice-laptop"), 3.0, identity_id=alice) == d1  # a reconnect
    store.credit_device(d1, verified=3, rejected=1, gflop=1.5, now=3.0)
    second = store.create_job("second", {}, 1, 4.0)
    d2 = store.add_device(second, DeviceInfo("alice"), 4.0, identity_id=alice)
    assert d2 != d1
    store.credit_device(d2, verified=1, revoked=2, gflop=0.5, now=5.0)
    m = store.add_device(second, DeviceInfo("alice"), 4.0, identity_id=mallory)
    store.credit_device(m, verified=1, gflop=0.25, now=5.0)

    row = store.identity(alice)
    assert row is not None
    assert (row.name, row.state, row.tiles_done, row.tiles_rejected, row.tiles_revoked, row.gflop_verified) == (
        "alice",
        "active",
        4,
        1,
        2,
        2.0,
    )
    assert row.reliability == 4 / 7
    assert store.identity_total(alice) == (2.0, 4)
    board = store.leaderboard()
    assert [(r.identity_id, r.name, r.gflop, r.tiles) for r in board] == [
        (alice, "alice", 2.0, 4),
        (mallory, "alice", 0.25, 1),
    ]
    assert [d.name for d in store.devices(first)] == ["alice-laptop"]  # the row keeps the latest hello
    assert store.identity(999) is None

    store.set_identity_state(alice, "banned", "results failed verification", now=6.0)
    assert store.identity_states([alice, mallory, 999]) == {alice: "banned", mallory: "active"}
    assert [r.identity_id for r in store.leaderboard()] == [mallory]  # banned or revoked: not ranked
    assert [i.id for i in store.identities()] == [mallory, alice]  # newest first
    with pytest.raises(StoreError):
        store.set_identity_state(alice, "sleepy", "", now=6.0)
    with pytest.raises(StoreError):
        store.set_identity_state(999, "active", "", now=6.0)


def test_device_listing_is_filtered_and_bounded(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    ids = [store.add_device(job, DeviceInfo(f"d{i}"), 0.0) for i in range(5)]
    for d in ids[:3]:
        store.set_device_state(d, "offline", 1.0, "left")
    assert store.device_states(job) == {"offline": 3, "online": 2}
    assert [d.id for d in store.devices(job, states=["online"])] == ids[3:]
    assert [d.id for d in store.devices(job, limit=2)] == ids[:2]


def test_settings_are_upserted(store: Store) -> None:
    assert store.setting("join") is None
    store.set_setting("join", "a")
    store.set_setting("join", "b")
    assert store.setting("join") == "b"


def test_sqlite_notices_writes_from_other_processes_only(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    store.set_setting("x", "1")
    assert not store.changed()  # its own writes
    other = SQLiteStore(tmp_path / "s.db")
    other.set_setting("x", "2")
    other.close()
    assert store.changed() and not store.changed()
    assert store.setting("x") == "2"
    store.close()


def test_revoked_leases_are_counted(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, (tile, *_) = _gemm(store, job)
    store.claim_tile(d, [], 1.0)
    assert store.end_lease(tile, d, "revoked", 2.0, "held past its deadline").requeued
    counts = store.tile_counts(job)
    assert counts["revoked"] == 1 and counts["queued"] == 3


def test_the_sqlite_file_is_private(tmp_path: Path) -> None:
    import stat

    store = SQLiteStore(tmp_path / "private.db")
    store.set_setting("join_token_sha256", "00")
    assert stat.S_IMODE((tmp_path / "private.db").stat().st_mode) == 0o600
    store.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _seen_by_another_process(path: Path, job: int) -> dict[str, int]:
    other = SQLiteStore(path)
    try:
        return other.recount(job)
    finally:
        other.close()


def test_group_commit_holds_hot_writes_until_the_window_or_a_flush(tmp_path: Path) -> None:
    clock = _Clock()
    path = tmp_path / "g.db"
    store = SQLiteStore(path, group_seconds=0.05, clock=clock)
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, tiles = _gemm(store, job, n=4)
    assert _seen_by_another_process(path, job)["queued"] == 0  # the GEMM's rows wait in the group
    store.lease_tile(tiles[0], d, 1.0)
    clock.now = 0.06  # the group is older than its window: the next hot write commits it
    store.lease_tile(tiles[1], d, 1.0)
    assert _seen_by_another_process(path, job)["leased"] == 2
    store.lease_tile(tiles[2], d, 1.0)  # as long after as the group held the lock: one by one
    assert _seen_by_another_process(path, job)["leased"] == 3
    clock.now = 0.2  # then grouped again
    store.end_lease(tiles[0], d, "verified", 2.0)
    store.credit_device(d, verified=1, gflop=1.0, now=2.0)
    assert _seen_by_another_process(path, job)["verified"] == 0
    store.flush()  # the server's tick
    assert _seen_by_another_process(path, job)["verified"] == 1
    assert _seen_by_another_process(path, job) == store.recount(job)
    store.close()


def test_a_durable_write_commits_the_group_and_close_flushes(tmp_path: Path) -> None:
    path = tmp_path / "g.db"
    store = SQLiteStore(path, group_seconds=1.0)
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, tiles = _gemm(store, job, n=2)
    store.lease_tile(tiles[0], d, 1.0)
    store.record_step(job, 1, 2.0, 8, 0.1, 3.0)  # a step is durable at once, with the group before it
    assert _seen_by_another_process(path, job)["leased"] == 1
    store.lease_tile(tiles[1], d, 1.0)
    store.close()
    assert _seen_by_another_process(path, job)["leased"] == 2


def test_a_failed_write_in_a_group_rolls_back_alone(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "g.db", group_seconds=1.0)
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, tiles = _gemm(store, job, n=2)
    store.lease_tile(tiles[0], d, 1.0)
    with pytest.raises(StoreError):
        store.end_lease(tiles[1], d, "verified", 2.0)  # never leased: refused, nothing written
    with pytest.raises(StoreError):
        store.credit_device(999, verified=1, now=2.0)
    store.end_lease(tiles[0], d, "verified", 2.0)
    store.flush()
    assert store.recount(job) == store.tile_counts(job)
    assert (store.recount(job)["verified"], store.recount(job)["queued"]) == (1, 1)
    assert [lease.outcome for lease in store.leases(tiles[0])] == ["verified"]
    store.close()


@pytest.mark.parametrize("group_seconds", [0.0, 1.0])
def test_a_batch_writes_under_one_savepoint_and_commits_durable_writes_as_it_ends(
    tmp_path: Path, group_seconds: float
) -> None:
    """store.batch(): the hot-path calls inside it share one savepoint (SAVEPOINT and RELEASE were
    half of a tile's statements); what they write is what they write one by one; a durable
    write inside it (a ban, a step) is committed as the batch ends, not later with the group."""
    path = tmp_path / "b.db"
    store = SQLiteStore(path, group_seconds=group_seconds, clock=lambda: 100.0)  # no timing on a loaded host
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, tiles = _gemm(store, job, n=4)
    store.flush()
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    with store.batch():
        for t in tiles:
            store.lease_tile(t, d, 1.0)
        for t in tiles[:3]:
            store.end_lease(t, d, "verified", 2.0)
        store.credit_device(d, verified=3, gflop=3.0, now=2.0)
        with store.batch():  # nested: the same batch
            store.record_step(job, 1, 2.0, 8, 0.1, 3.0)
        assert _seen_by_another_process(path, job)["verified"] == 0  # not before the batch ends
    store.conn.set_trace_callback(None)
    # The batch's savepoint (and at most one of the durable write's): 11 calls, not 22 savepoints.
    assert 1 <= sum(q.startswith("SAVEPOINT") for q in statements) <= 2
    assert _seen_by_another_process(path, job) == store.recount(job) == {**store.recount(job), "verified": 3}
    assert store.recount(job)["leased"] == 1
    assert [row.tiles_done for row in store.devices(job)] == [3]
    store.close()


def test_a_batch_that_raises_keeps_what_it_wrote_and_the_next_batch_starts_clean(tmp_path: Path) -> None:
    """The coordinator stops the job on any failure inside a batch, but what the batch wrote
    stands (a ban or a step recorded before the failure must not be rolled back with it)."""
    path = tmp_path / "b.db"
    # A clock that stands still: no group ages past its window and no cool-off after a commit
    # follows from how long a loaded host took (the second batch must open a group of its own).
    store = SQLiteStore(path, group_seconds=1.0, clock=lambda: 100.0)
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, tiles = _gemm(store, job, n=2)
    with pytest.raises(RuntimeError, match="a bug"), store.batch():
        store.lease_tile(tiles[0], d, 1.0)
        store.record_step(job, 1, 2.0, 8, 0.1, 3.0)  # durable
        raise RuntimeError("a bug in the Core")
    assert _seen_by_another_process(path, job)["leased"] == 1  # committed as the batch ended
    other = SQLiteStore(path)
    assert [row.step for row in other.steps(job)] == [1]
    other.close()
    with store.batch():
        store.lease_tile(tiles[1], d, 1.0)
    assert store.recount(job)["leased"] == 2 and store.conn.in_transaction  # a hot write: with the group
    store.close()
    assert _seen_by_another_process(path, job)["leased"] == 2


def test_group_window_is_bounded() -> None:
    with pytest.raises(ValueError, match="group_seconds"):
        SQLiteStore(":memory:", group_seconds=5.0)


def test_another_process_writes_while_a_busy_coordinator_groups_its_commits(tmp_path: Path) -> None:
    """An operator's revoke must not wait out the coordinator's group commits: they hold the
    write lock for at most about half the time, one event-loop turn at a time."""
    import asyncio
    import threading
    import time

    path = tmp_path / "busy.db"
    # As a server opens it: each group commits at the end of its event loop's turn.
    store = SQLiteStore(path, group_seconds=1.0, defer=lambda flush: asyncio.get_running_loop().call_soon(flush))
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    stop, busy = threading.Event(), threading.Event()
    writes = 0

    async def coordinator() -> None:
        nonlocal writes
        while not stop.is_set():
            for _ in range(20):  # a turn's results: their credits
                store.credit_device(d, verified=1, now=1.0)
                writes += 1
            busy.set()
            await asyncio.sleep(0)
        store.flush()

    thread = threading.Thread(target=asyncio.run, args=(coordinator(),))
    thread.start()
    try:
        assert busy.wait(10)
        operator = SQLiteStore(path)  # `cleave devices revoke` in another process
        started = time.monotonic()
        operator.set_setting("revoked", "yes")
        waited = time.monotonic() - started
        operator.close()
    finally:
        stop.set()
        thread.join(10)
    # Starved, it would wait out SQLite's busy timeout; held off by one whole group, up to
    # group_seconds. Two groups' worth leaves room for a loaded machine's scheduling (1.16 s seen
    # once with the suite running beside it) and still fails a writer that is starved.
    assert waited < 2 * store.group_seconds, f"the operator's write waited {waited:.2f} s"
    assert store.setting("revoked") == "yes" and store.devices(job)[0].tiles_done == writes
    store.close()


def test_a_finished_job_stays_finished_whatever_stops_the_coordinator_after() -> None:
    """Ctrl-C during the goodbyes or the linger interrupts no training: the books keep the job
    finished (a stopped one would be 'resumed' by the next start)."""
    from cleave.coordinator.engine.books import Books

    store = MemoryStore()
    job = store.create_job("j", {}, 4, 0.0)
    books = Books(store, job)
    books.finished(1.0)
    books.stopped(2.0, trained=True)
    assert store.job(job).state == "finished"


def test_the_time_left_is_this_runs_pace_not_the_jobs() -> None:
    """A job resumed at step 900 of 1,000 that took 10 s for one step has about 990 s left."""
    from cleave.coordinator.engine.progress import Progress

    p = Progress(step=900, steps=1000)
    p.since, p.first = 50.0, 900  # training (re)started at 50 s, from the checkpoint's step
    p.step = 901
    assert p.eta(60.0) == pytest.approx(990.0) and p.elapsed(60.0) == pytest.approx(10.0)
    p.ended = 70.0
    assert p.eta(80.0) is None and p.elapsed(80.0) == pytest.approx(20.0)  # stops at the finish


def test_why_leases_were_lost_is_counted_as_they_end(store: Store) -> None:
    """``lost_reasons``: counted from the rows when first asked, then kept as leases end (the
    status asks every second; it must not scan the leases each time)."""
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _gemm(store, job, n=5)
    claimed = [store.claim_tile(d, [], now=11.0) for _ in range(5)]
    ids = [c.id for c in claimed if c]
    store.end_lease(ids[0], d, Outcome.LOST, 12.0, "no heartbeat for 30.0 s")
    assert store.lost_reasons(job) == {"no heartbeat for 30.0 s": 1}  # counted from the rows
    store.end_lease(ids[1], d, Outcome.LOST, 13.0, "connection closed")
    store.end_lease(ids[2], d, Outcome.LOST, 13.0, "connection closed")
    store.end_lease(ids[3], d, Outcome.VERIFIED, 13.0)
    assert store.lost_reasons(job) == {"connection closed": 2, "no heartbeat for 30.0 s": 1}  # kept since
    assert store.lost_reasons(job, limit=1) == {"connection closed": 2}
    assert store.lost_reasons(store.create_job("other", {}, 1, 14.0)) == {}


def test_a_result_taken_for_its_band_is_verified_or_rejected_with_it(store: Store) -> None:
    """Checks by band: a result is booked ``taken`` when it arrives, then ``verified`` when its
    band passes (one write for the band), or ``rejected`` (failed) or ``revoked`` (its device was
    banned first): the tile is queued again, never to that device."""
    job = store.create_job("j", {}, 1, 0.0)
    d, other = store.add_device(job, DeviceInfo("a"), 0.0), store.add_device(job, DeviceInfo("b"), 0.0)
    _, ids = _gemm(store, job, n=4)
    for _ in ids:
        store.claim_tile(d, [], now=11.0)
    for tid in ids:
        store.end_lease(tid, d, Outcome.TAKEN, now=12.0)
    counts = store.tile_counts(job)
    assert (counts["taken"], counts["leased"], counts["verified"]) == (4, 0, 0)
    with pytest.raises(StoreError):  # it has no result of the other device
        store.reject_taken(ids[0], other, 13.0, "failed verification")
    with pytest.raises(StoreError):  # a band is verified whole or not at all
        store.verify_taken([(ids[0], d), (ids[1], other)], 13.0)
    assert store.tile_state(ids[0]) == "taken"
    with pytest.raises(StoreError):  # only rejected or revoked
        store.reject_taken(ids[0], d, 13.0, "no", Outcome.LOST)
    store.verify_taken([(ids[0], d), (ids[1], d)], 13.0)
    store.reject_taken(ids[2], d, 13.0, "failed verification: residual")
    store.reject_taken(ids[3], d, 13.0, "its device was banned", Outcome.REVOKED)
    assert [store.tile_state(t) for t in ids] == ["verified", "verified", "queued", "queued"]
    assert [(lease.outcome, lease.reason) for lease in store.leases(ids[2])] == [
        ("rejected", "failed verification: residual")
    ]
    assert [lease.outcome for lease in store.leases(ids[3])] == ["revoked"]
    counts = store.tile_counts(job)
    assert (counts["taken"], counts["verified"], counts["queued"], counts["rejected"], counts["revoked"]) == (
        0,
        2,
        2,
        1,
        1,
    )
    assert store.claim_tile(d, [], now=14.0) is None  # barred from both
    assert {store.claim_tile(other, [], now=14.0).id for _ in range(2)} == {ids[2], ids[3]}
    with pytest.raises(StoreError):  # once
        store.reject_taken(ids[2], d, 15.0, "again")
    if isinstance(store, SQLiteStore):  # the running counters agree with the rows
        assert store.recount(job) == store.tile_counts(job)


def test_a_dispatch_leases_its_tiles_together(store: Store) -> None:
    """``lease_tiles``: each (tile, device) as ``lease_tile`` would, in one write: a tile not
    queued, or barred to that device, is refused (None) and the rest still leased."""
    job = store.create_job("j", {}, 1, 0.0)
    d, e = store.add_device(job, DeviceInfo("a"), 0.0), store.add_device(job, DeviceInfo("b"), 0.0)
    _, ids = _gemm(store, job, n=5)
    store.lease_tile(ids[0], d, 10.0)
    store.end_lease(ids[0], d, Outcome.REJECTED, 10.5)  # queued again, d barred from it
    store.lease_tile(ids[1], e, 10.0)
    got = store.lease_tiles([(ids[0], d), (ids[1], d), (ids[2], d), (ids[3], e)], 11.0)
    assert got[0] is None and got[1] is None  # barred; leased already
    assert [(g.id, g.issued) for g in got[2:]] == [(ids[2], "first"), (ids[3], "first")]
    got = store.lease_tiles([(ids[0], e), (ids[4], d), (ids[4], e)], 11.0)  # a tile twice: the first wins
    assert [(g.id, g.issued) for g in got[:2]] == [(ids[0], "requeued after rejected"), (ids[4], "first")]
    assert got[2] is None
    assert [store.tile_state(t) for t in ids] == ["leased"] * 5
    assert store.leased_to(d) == sorted([ids[2], ids[4]]) and store.leased_to(e) == sorted([ids[0], ids[1], ids[3]])
    counts = store.tile_counts(job)
    assert (counts["leased"], counts["queued"], counts["requeued"]) == (5, 0, 1)
    assert store.lease_tiles([], 12.0) == []
    if isinstance(store, SQLiteStore):
        assert store.recount(job) == store.tile_counts(job)


def test_a_restart_loses_the_results_waiting_for_their_bands(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    d = store.add_device(job, DeviceInfo("a"), 0.0)
    _, ids = _gemm(store, job, n=2)
    store.lease_tiles([(ids[0], d), (ids[1], d)], 11.0)
    store.end_lease(ids[0], d, Outcome.TAKEN, 12.0)
    assert store.abandon_unfinished(job, 20.0) == 2
    assert [store.tile_state(t) for t in ids] == ["abandoned", "abandoned"]
    assert [(lease.outcome, lease.reason) for t in ids for lease in store.leases(t)] == [
        ("lost", RESTARTED),
        ("lost", RESTARTED),
    ]


def _crowd(path: Path, identities: int, jobs: int = 3) -> tuple[SQLiteStore, int]:
    """A real SQLite store of ``identities`` enrolled identities, each with one device row (job by
    job, in one transaction), one in a hundred credited verified work and energy."""
    store = SQLiteStore(path)
    job_ids = [store.create_job(f"job{j}", {}, 10, 0.0) for j in range(jobs)]
    with store.atomic() as c:
        c.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :n)"
            " INSERT INTO identities (id, name, key, state, reason, created_at, last_seen)"
            " SELECT i, 'v' || i, x'00', 'active', '', 0, 0 FROM n",
            {"n": identities},
        )
        c.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :n)"
            " INSERT INTO devices (job_id, name, platform, cores, memory_bytes, device, gflops, state, joined_at,"
            " last_seen, identity_id) SELECT :first + (i - 1) * :jobs / :n, 'v' || i, 'Linux', 4, 1, 'cpu', 10.0,"
            " 'offline', 0, 0, i FROM n",
            {"n": identities, "jobs": jobs, "first": job_ids[0]},
        )
    with store.batch():
        for device in range(1, identities + 1, 100):
            store.credit_device(device, verified=device % 7 + 1, gflop=float(device), now=1.0)
            store.credit_device(device, joules=float(device % 13 + 1), gflop_metered=float(device), now=1.0)
    return store, job_ids[-1]


def test_a_status_build_does_the_same_query_work_at_a_thousand_and_a_hundred_thousand_identities(
    tmp_path: Path,
) -> None:
    """The public status is built every second from the store; its queries (the leaderboards, the
    device counts, the listed rows) must not visit every identity's row. Counted in SQLite
    virtual-machine steps (a progress handler), which do not depend on the machine's load."""
    import numpy as np

    from cleave.coordinator.engine import report
    from cleave.coordinator.engine.core import Core

    work = {}
    for n in (1_000, 100_000):
        store, job = _crowd(tmp_path / f"{n}.db", n)
        core = Core(store, job, join_token="tok", operator_token="op", rng=np.random.default_rng(0))
        report.status(core, 0.0)  # counts kept in memory are counted from the rows once, here
        steps = Counter[str]()
        store.conn.set_progress_handler(partial(steps.update, ("vm",)), 10)  # called every 10 VM steps
        status = report.status(core, 0.0)
        store.conn.set_progress_handler(None, 0)
        work[n] = steps["vm"] * 10
        # The ranks are still right: the most verified GFLOP first, the rest by GFLOP per joule.
        worked = range(1, n + 1, 100)
        assert [r["gflop"] for r in status["leaderboard"]] == [float(d) for d in sorted(worked, reverse=True)[:10]]
        best = sorted(worked, key=lambda d: (-d / (d % 13 + 1), d))[:10]
        assert [r["identity"] for r in status["leaderboard_efficiency"]] == best
        assert status["device_counts"] == {"connected": 0, "offline": sum(i * 3 // n == 2 for i in range(n))}
        store.close()
    assert work[100_000] <= 2 * work[1_000], work


def test_an_older_database_gets_its_identities_totals_from_its_device_rows(tmp_path: Path) -> None:
    """m005 sums each identity's device rows of every job once; the leaderboard reads those
    totals, and credit keeps them."""
    import sqlite3

    import sqlite_utils

    from cleave.db.migrations import MIGRATIONS

    path = tmp_path / "old.db"
    db = sqlite_utils.Database(sqlite3.connect(path))
    db["_migrations"].create({"name": str, "applied_at": float}, pk="name")
    for name, fn in MIGRATIONS[:4]:  # the schema before m005
        fn(db)
        db["_migrations"].insert({"name": name, "applied_at": 0.0})
    db.execute("INSERT INTO identities (id, name, key, state, created_at) VALUES (1, 'a', x'00', 'active', 0)")
    db.execute(
        "INSERT INTO jobs (id, name, config, state) VALUES (1, 'j1', '{}', 'finished'), (2, 'j2', '{}', 'finished')"
    )
    db.execute(
        "INSERT INTO devices (job_id, name, identity_id, tiles_done, gflop_verified, joules, gflop_metered)"
        " VALUES (1, 'a', 1, 3, 1.5, 2.0, 1.0), (2, 'a', 1, 4, 2.5, 1.0, 2.0)"
    )
    db.conn.commit()
    db.conn.close()
    store = SQLiteStore(path)
    assert store.leaderboard(10) == [LeaderRow(1, "a", 4.0, 7, 3.0, 3.0)]
    store.credit_device(2, verified=1, gflop=0.5, now=1.0)
    assert store.leaderboard(10, by="gflop_per_j")[0].gflop == 4.5
    store.close()


def _a_step_of_work(store: Store, job: int, step: int, d1: int, d2: int, *, finish: bool = True) -> list[int]:
    """One GEMM of ``step`` whose three tiles end every way the books count: a lost lease then a
    requeued one, a speculative (or deadline) copy cancelled by the first result, a rejection."""
    gid = store.next_gemm_id()
    new = [NewTile(i, f"{gid}.a{i}", f"{gid}.b", 9) for i in range(3)]
    t0, t1, t2 = store.add_gemm(gid, job, step, "fwd", (3, 1, 1), new, now=1.0)
    if not finish:
        return [t0, t1, t2]
    store.lease_tile(t0, d1, 2.0)
    store.end_lease(t0, d1, Outcome.LOST, 3.0, reason=f"silent {step % 2}")
    store.lease_tile(t0, d2, 4.0)
    store.end_lease(t0, d2, Outcome.VERIFIED, 5.0)
    store.lease_tile(t1, d1, 2.0)
    store.claim_copy(t1, d2, Issued.SPECULATIVE if step % 2 else Issued.DEADLINE, 3.0)
    store.end_lease(t1, d1, Outcome.VERIFIED, 4.0)
    store.lease_tile(t2, d2, 2.0)
    store.end_lease(t2, d2, Outcome.REJECTED, 3.0)
    store.lease_tile(t2, d1, 4.0)
    store.end_lease(t2, d1, Outcome.VERIFIED, 5.0)
    store.finish_gemm(gid, 6.0)
    return [t0, t1, t2]


def test_pruning_old_steps_keeps_the_books_and_the_last_steps(store: Store, tmp_path: Path) -> None:
    # Prepare: four steps of finished GEMMs, an unfinished GEMM of step 1, and another job's step.
    job = store.create_job("j", {}, 10, 0.0)
    d1 = store.add_device(job, DeviceInfo("a"), 1.0)
    d2 = store.add_device(job, DeviceInfo("b"), 1.0)
    tiles = {step: _a_step_of_work(store, job, step, d1, d2) for step in (1, 2, 3, 4)}
    unfinished = _a_step_of_work(store, job, 1, d1, d2, finish=False)
    store.lease_tile(unfinished[0], d1, 7.0)
    store.end_lease(unfinished[0], d1, Outcome.LOST, 8.0, reason="gone")
    counts, lost = store.tile_counts(job), store.lost_reasons(job)
    assert (counts["verified"], counts["lost"], counts["rejected"], counts["cancelled"]) == (12, 5, 4, 4)
    assert (counts["speculative"], counts["expired"], counts["requeued"], counts["queued"]) == (2, 2, 8, 3)
    assert lost == {"silent 0": 2, "silent 1": 2, "gone": 1}
    rows = _row_counts(store)
    # Execute: the checkpoint of step 4 with --prune-steps 2 deletes steps 1 and 2's finished GEMMs.
    assert store.prune_gemms(job, 4 - 2) == 2
    # Assert: the same books, fewer rows; the unfinished GEMM and steps 3 and 4 are untouched.
    assert store.tile_counts(job) == counts and store.lost_reasons(job) == lost
    for tid in tiles[1] + tiles[2]:
        assert store.leases(tid) == []
        with pytest.raises(StoreError):
            store.tile_state(tid)
    assert [store.tile_state(t) for t in tiles[3] + tiles[4]] == ["verified"] * 6
    assert [store.tile_state(t) for t in unfinished] == ["queued"] * 3
    assert [len(store.leases(t)) for t in tiles[4]] == [2, 2, 2]
    assert store.prune_gemms(job, 2) == 0  # nothing left to prune there
    if isinstance(store, SQLiteStore):
        assert _row_counts(store) == {k: n - {"gemms": 2, "tiles": 6, "leases": 12}[k] for k, n in rows.items()}
        assert store.recount(job) == counts
        store.close()
        again = SQLiteStore(store.path)  # counted from the rows again, and from what was pruned
        assert again.tile_counts(job) == counts and again.lost_reasons(job) == lost
        # The next pruning adds to what the first one kept.
        assert again.prune_gemms(job, 3) == 1
        assert again.tile_counts(job) == counts == again.recount(job) and again.lost_reasons(job) == lost
        again.close()
        store = SQLiteStore(store.path)  # for the fixture's close
        assert store.tile_counts(job) == counts and store.lost_reasons(job) == lost


def _row_counts(store: Store) -> dict[str, int]:
    if not isinstance(store, SQLiteStore):
        return {}
    return {t: store.conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("gemms", "tiles", "leases")}


def test_pruning_never_deletes_the_newest_gemm_so_gemm_ids_never_go_back(store: Store) -> None:
    job = store.create_job("j", {}, 10, 0.0)
    d1 = store.add_device(job, DeviceInfo("a"), 1.0)
    d2 = store.add_device(job, DeviceInfo("b"), 1.0)
    _a_step_of_work(store, job, 1, d1, d2)
    newest = _a_step_of_work(store, job, 2, d1, d2)
    next_id = store.next_gemm_id()
    assert store.prune_gemms(job, 99) == 1  # step 2's GEMM is the newest: it stays
    assert store.next_gemm_id() == next_id and store.tile_state(newest[0]) == "verified"


def test_pruning_deletes_by_index_in_sqlite(tmp_path: Path) -> None:
    from cleave.db.sqlite import PRUNE_DELETES

    store = SQLiteStore(tmp_path / "p.db")
    params = {"job": 1, "through": 5, "newest": 9}
    for delete in PRUNE_DELETES:  # the deletes themselves and their foreign-key checks
        plan = [row[3] for row in store.conn.execute(f"EXPLAIN QUERY PLAN {delete}", params)]
        assert plan and not [step for step in plan if step.startswith("SCAN")], (delete, plan)
    store.close()


def test_books_prune_the_store_at_each_checkpoint() -> None:
    from cleave.coordinator.engine.books import Books

    store = MemoryStore()
    books = Books.create(store, "j", {}, 10, 0.0, prune_steps=1)
    d1 = store.add_device(books.job_id, DeviceInfo("a"), 1.0)
    d2 = store.add_device(books.job_id, DeviceInfo("b"), 1.0)
    tiles = {step: _a_step_of_work(store, books.job_id, step, d1, d2) for step in (1, 2, 3)}
    counts = store.tile_counts(books.job_id)
    books.checkpointed(CheckpointRow(books.job_id, 3, "c3.pt", "0" * 64, 1, 9.0))
    assert store.tile_counts(books.job_id) == counts
    assert store.leases(tiles[2][0]) == [] and store.tile_state(tiles[3][0]) == "verified"  # the last step kept
    keep = Books(store, books.job_id)  # 0: every row kept
    keep.checkpointed(CheckpointRow(books.job_id, 4, "c4.pt", "0" * 64, 1, 9.0))
    assert len(store.leases(tiles[3][0])) == 2


def test_prune_steps_is_checked_with_a_clear_error() -> None:
    from cleave.coordinator.config import CoordinatorConfig
    from cleave.wire.errors import ConfigError

    assert CoordinatorConfig(prune_steps=2).prune_steps == 2
    with pytest.raises(ConfigError, match="^prune_steps must be between 0 and"):
        CoordinatorConfig(prune_steps=-1)
    with pytest.raises(ConfigError, match="^prune_steps prunes at each checkpoint, and checkpoints are off"):
        CoordinatorConfig(prune_steps=2, checkpoint_every=0)
