"""One test suite, run against both Store implementations."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from db.memory import MemoryStore
from db.migrations import migrate
from db.sqlite import SQLiteStore
from db.store import DeviceInfo, NewTile, Store, StoreError


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "s.db")
    yield s
    s.close()


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
    assert store.tile_counts(job) == {"queued": 0, "leased": 3, "verified": 0, "rejected": 0}


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
    assert [lease.outcome for lease in store.leases(ids[0])] == ["rejected", None]


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
    assert store.tile_counts(job) == {"queued": 2, "leased": 1, "verified": 0, "rejected": 0}
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


def test_gemm_ids_are_handed_out_in_order(store: Store) -> None:
    job = store.create_job("j", {}, 1, 0.0)
    first, _ = _gemm(store, job)
    assert store.next_gemm_id() == first + 1
    with pytest.raises(Exception):
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
