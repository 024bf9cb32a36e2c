"""Untrusted devices at the Core, on a fake clock: identities, earned slots, bans, cut-offs,
rate limits and frame limits. Real processes come in tests/drills/test_hostile.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_core import Fleet, corrupt, honest, submit

from cleave.coordinator.engine import report
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.identity import JOIN_TOKEN, store_token
from cleave.coordinator.engine.limits import Limits, Rate, TokenBucket, TrustPolicy, memory_bound
from cleave.coordinator.engine.outbound import Close, Limit, Send
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.db.memory import MemoryStore
from cleave.db.sqlite import SQLiteStore
from cleave.wire import auth
from cleave.wire.codes import CloseCode, ReleaseWhy
from cleave.wire.errors import AuthError
from cleave.wire.messages import (
    Cancel,
    Credential,
    Error,
    Heartbeat,
    Hello,
    Pause,
    Release,
    Result,
    Resume,
    StatusReply,
    Welcome,
    encode,
)

POLICY = TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1)
FAULTS = FaultPolicy(
    heartbeat=1.0,
    heartbeat_timeout=30.0,
    lease_floor=2.0,
    lease_factor=4.0,
    speculate_after=0.5,
    speculate_factor=2.0,
    max_copies=2,
)
TRUST = TrustPolicy(
    probation_tiles=4,
    window=10,
    ban_rejects=2,
    max_slots=4,
    grow_every=2,
    cut_after=3,
    cut_unanswered=3,
    cooloff=10.0,
    cooloff_max=40.0,
)


def _core(store: MemoryStore | SQLiteStore | None = None, **limits: object) -> Core:
    store = store or MemoryStore()
    job = store.create_job("trust", {}, 10, 0.0)
    return Core(
        store,
        job,
        join_token="tok",
        operator_token="op",
        rng=np.random.default_rng(0),
        policy=POLICY,
        faults=FAULTS,
        trust=TRUST,
        limits=Limits(**limits),
        band_checks=False,  # each result checked alone, as it arrives: that path is what this tests
    )


def _credential(fleet: Fleet, device: int) -> Credential:
    return next(m for m in fleet.inbox[device] if isinstance(m, Credential))


def _returning(
    core: Core,
    credential: Credential,
    now: float,
    name: str = "x",
    secret: bytes | None = None,
    nonce: str | None = None,
) -> tuple[int, list]:
    nonce = nonce or core.gate.challenge().nonce
    proof = auth.proof(secret or bytes.fromhex(credential.secret), credential.identity, bytes.fromhex(nonce))
    return core.connect(Hello(name=name, identity=credential.identity, proof=proof.hex()), nonce, now)


# ------------------------------------------------------------------ credentials


def test_a_proof_binds_the_secret_to_one_nonce_and_the_stored_key_alone_proves_nothing() -> None:
    secret, nonce, other = b"s" * 32, b"n" * 32, b"m" * 32
    key = auth.stored_key(secret)
    answer = auth.proof(secret, 7, nonce)
    assert auth.verify_proof(key, 7, nonce, answer)
    assert not auth.verify_proof(key, 7, other, answer)  # replayed on another connection
    assert not auth.verify_proof(key, 8, nonce, answer)  # claimed for another identity
    assert not auth.verify_proof(key, 7, nonce, auth.proof(b"t" * 32, 7, nonce))  # another secret
    assert not auth.verify_proof(key, 7, nonce, auth.proof(key, 7, nonce))  # someone who copied the database
    assert not auth.verify_proof(key, 7, nonce, answer[:-1]) and not auth.verify_proof(key, 7, nonce, b"")
    assert answer != secret and secret.hex() not in answer.hex()  # the secret itself never travels
    assert auth.token_matches("tok", auth.token_hash("tok")) and not auth.token_matches("tok", None)
    assert not auth.token_matches("", auth.token_hash(""))


def test_a_device_enrols_once_then_comes_back_with_its_credential_as_the_same_device() -> None:
    core = _core()
    fleet = Fleet(core)
    first = fleet.join("laptop", slots=2)
    credential = _credential(fleet, first)
    assert core.store.identity_key(credential.identity) == auth.stored_key(bytes.fromhex(credential.secret))
    fleet.route(core.disconnect(first, fleet.now, "connection closed"))
    again, out = _returning(core, credential, fleet.now, name="renamed")
    assert again == first  # one device row per identity per job
    assert not any(isinstance(o, Send) and isinstance(o.message, Credential) for o in out)  # nothing new to keep
    welcome = next(o.message for o in out if isinstance(o, Send) and isinstance(o.message, Welcome))
    assert welcome.identity == credential.identity
    assert [d["name"] for d in report.status(core, fleet.now)["devices"]] == ["laptop"]  # the enrolled name stays


@pytest.mark.parametrize(
    "attack", ["wrong secret", "replayed hello", "unknown identity", "no proof", "operator token", "no token"]
)
def test_bad_credentials_are_refused_with_one_message(attack: str) -> None:
    core = _core()
    fleet = Fleet(core)
    device = fleet.join("laptop")
    credential = _credential(fleet, device)
    fleet.route(core.disconnect(device, fleet.now, "connection closed"))
    with pytest.raises(AuthError) as info:
        if attack == "wrong secret":
            _returning(core, credential, fleet.now, secret=b"x" * 32)
        elif attack == "replayed hello":  # a hello recorded on another connection
            old = core.gate.challenge().nonce
            proof = auth.proof(bytes.fromhex(credential.secret), credential.identity, bytes.fromhex(old))
            core.connect(
                Hello(name="x", identity=credential.identity, proof=proof.hex()), core.gate.challenge().nonce, fleet.now
            )
        elif attack == "unknown identity":
            _returning(core, Credential(999, credential.secret), fleet.now)
        elif attack == "no proof":
            core.connect(Hello(name="x", identity=credential.identity), core.gate.challenge().nonce, fleet.now)
        elif attack == "operator token":
            core.connect(Hello(name="x", token="op"), core.gate.challenge().nonce, fleet.now)
        else:
            core.connect(Hello(name="x"), core.gate.challenge().nonce, fleet.now)
    assert info.value.code == CloseCode.AUTH
    if attack in ("wrong secret", "replayed hello", "unknown identity", "no proof"):
        assert info.value.reason == "unknown identity or wrong credential"  # no oracle
    assert core.devices == {}


def test_an_identity_connects_once_at_a_time() -> None:
    core = _core()
    fleet = Fleet(core)
    credential = _credential(fleet, fleet.join("laptop"))
    with pytest.raises(AuthError) as info:
        _returning(core, credential, fleet.now)
    assert info.value.code == CloseCode.IN_USE


def test_the_join_token_rotates_without_cutting_enrolled_devices(tmp_path: Path) -> None:
    core = _core(SQLiteStore(tmp_path / "c.db"))
    fleet = Fleet(core)
    device = fleet.join("laptop")
    credential = _credential(fleet, device)
    operator = SQLiteStore(tmp_path / "c.db")  # another process: `cleave coordinator token rotate`
    store_token(operator, JOIN_TOKEN, "new-token")
    operator.close()
    fleet.now += 1.5
    fleet.route(core.tick(fleet.now))
    assert device in core.devices and device not in fleet.closed
    with pytest.raises(AuthError):
        core.connect(Hello(name="y", token="tok"), core.gate.challenge().nonce, fleet.now)
    newcomer, _ = core.connect(Hello(name="y", token="new-token"), core.gate.challenge().nonce, fleet.now)
    fleet.route(core.disconnect(device, fleet.now))
    assert _returning(core, credential, fleet.now)[0] == device  # credentials outlive the token
    assert newcomer in core.devices


def test_an_operator_revocation_in_another_process_cuts_the_device_within_a_second(tmp_path: Path) -> None:
    core = _core(SQLiteStore(tmp_path / "c.db"))
    fleet = Fleet(core)
    device = fleet.join("stolen-laptop")
    credential = _credential(fleet, device)
    operator = SQLiteStore(tmp_path / "c.db")
    operator.set_identity_state(credential.identity, "revoked", "reported stolen", 5.0)
    operator.close()
    fleet.now += 1.5
    fleet.route(core.tick(fleet.now))
    assert fleet.closed.get(device) == CloseCode.REVOKED and device not in core.devices
    with pytest.raises(AuthError) as info:
        _returning(core, credential, fleet.now)
    assert info.value.code == CloseCode.REVOKED and "reported stolen" in info.value.reason


# ------------------------------------------------------------------ earned slots, bans


def test_newcomers_hold_one_tile_until_their_verified_record_earns_more() -> None:
    core = _core()
    fleet = Fleet(core)
    device = fleet.join("eager", slots=8)
    submit(core, fleet, torch.randn(512, 32), torch.randn(32, 512))
    assert len(core.devices[device].inflight) == 1  # probation, whatever it asked for
    seen = []
    while fleet.step(only=device):
        seen.append(core.devices[device].slots)
    assert seen[0] == 1 and max(seen) == TRUST.max_slots  # 4 verified: off probation, then +1 per 2
    assert seen == sorted(seen)


def test_the_first_forgery_on_probation_bans_the_identity_for_good() -> None:
    core = _core()
    fleet = Fleet(core)
    bad = fleet.join("forger", compute=corrupt)
    fleet.join("honest")
    credential = _credential(fleet, bad)
    a, b = torch.randn(128, 32), torch.randn(32, 128)
    box = submit(core, fleet, a, b)
    assert fleet.step(only=bad)
    assert fleet.closed.get(bad) == CloseCode.BANNED
    assert core.store.identity(credential.identity).state == "banned"
    with pytest.raises(AuthError) as info:  # reconnecting does not help
        _returning(core, credential, fleet.now)
    assert info.value.code == CloseCode.BANNED
    fleet.pending = [p for p in fleet.pending if p.device != bad]
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)


def test_a_trusted_device_is_banned_by_repeated_forgeries_however_they_are_spaced() -> None:
    """Honest results between forgeries no longer wash them out."""
    core = _core()
    fleet = Fleet(core)
    sly = fleet.join("sly", slots=1)
    fleet.join("honest", slots=1)
    submit(core, fleet, torch.randn(1024, 32), torch.randn(32, 64))
    answered = 0
    while core.devices[sly].standing.on_probation(TRUST):
        assert fleet.step(only=sly)
        answered += 1
    forged = 0
    while sly in core.devices:
        fleet.compute[sly] = corrupt if answered % 3 == 0 else honest  # one forgery in three
        if not fleet.step(only=sly):
            break
        forged += fleet.compute[sly] is corrupt
        answered += 1
    assert fleet.closed.get(sly) == CloseCode.BANNED and forged == TRUST.ban_rejects


@pytest.mark.parametrize("helper", [True, False], ids=["overtaken by a free device", "alone: taken back"])
def test_a_device_that_holds_tiles_without_answering_is_cut_and_must_cool_off(helper: bool) -> None:
    core = _core()
    fleet = Fleet(core)
    staller = fleet.join("staller", slots=1)
    credential = _credential(fleet, staller)
    if helper:
        fleet.join("honest", slots=1)
    for _ in range(TRUST.cut_after):
        submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))  # one tile each, first to the staller
        fleet.pending = [p for p in fleet.pending if p.device != staller]  # it never answers
        for _ in range(30):  # heartbeats keep it connected; deadlines pass
            if staller not in core.devices:
                break
            fleet.now += 1.0
            fleet.route(core.handle(staller, Heartbeat(), fleet.now))
            fleet.route(core.tick(fleet.now))
            fleet.pending = [p for p in fleet.pending if p.device != staller]  # nor any tile it gets again
            fleet.drain()
            if staller not in core.devices or not core.devices[staller].inflight:
                break
    assert fleet.closed.get(staller) == CloseCode.STALLING
    with pytest.raises(AuthError) as info:
        _returning(core, credential, fleet.now)
    assert info.value.code == CloseCode.STALLING and "come back in 10 s" in info.value.reason
    fleet.now += 10.5
    again, _ = _returning(core, credential, fleet.now)
    assert again == staller
    counts = report.status(core, fleet.now)["tiles"]
    if helper:  # speculation finished its tiles before their deadlines: lost to copies
        assert counts["cancelled"] >= TRUST.cut_unanswered and counts["queued"] == counts["leased"] == 0
    else:  # nobody else: each tile is taken back at twice its deadline (a tile it alone failed
        # is re-opened to it once, and it may take that one again once it is back)
        assert counts["revoked"] >= TRUST.cut_after and counts["queued"] + counts["leased"] == TRUST.cut_after


def test_three_stallers_cannot_hold_a_tile_from_a_free_honest_device() -> None:
    """Every copy of a tile held by devices that never answer: a late one loses it."""
    core = _core()
    fleet = Fleet(core)
    stallers = [fleet.join(f"staller{i}", slots=1) for i in range(3)]
    box = submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))  # one tile
    (tile,) = core.devices[stallers[0]].inflight
    for _ in range(2):  # a speculative copy, then a deadline copy, go to the other stallers
        fleet.now += 1.5
        fleet.route(core.tick(fleet.now))
    assert all(tile in core.devices[s].inflight for s in stallers)
    fleet.pending.clear()  # they never answer
    fleet.join("honest", slots=1)
    started = fleet.now
    while "result" not in box:
        fleet.now += 0.25
        for s in stallers:
            if s in core.devices:
                fleet.route(core.handle(s, Heartbeat(), fleet.now))
        fleet.route(core.tick(fleet.now))
        fleet.drain()
        assert fleet.now - started < 2 * FAULTS.window(0.0) + 1.0, "bounded by the deadlines"
    history = [(lease.issued, lease.outcome) for lease in core.store.leases(tile)]
    assert ("deadline passed", "verified") in history and ("first", "revoked") in history


# ------------------------------------------------------------------ rate and size limits


def test_a_message_flood_is_cut_and_releases_and_pauses_have_their_own_allowance() -> None:
    core = _core(messages=Rate(10.0, 20.0), releases=Rate(1.0, 4.0), pauses=Rate(0.1, 2.0))
    fleet = Fleet(core)
    chatty = fleet.join("chatty")
    for _ in range(20):
        fleet.route(core.handle(chatty, Heartbeat(), fleet.now))
    assert chatty in core.devices
    fleet.route(core.handle(chatty, Heartbeat(), fleet.now))
    assert fleet.closed.get(chatty) == CloseCode.RATE_LIMITED and chatty not in core.devices

    releaser = fleet.join("releaser")
    fleet.route(core.handle(releaser, Release(tuple(range(4))), fleet.now))
    assert releaser in core.devices
    fleet.route(core.handle(releaser, Release((1,)), fleet.now))
    assert fleet.closed.get(releaser) == CloseCode.RATE_LIMITED

    flapper = fleet.join("flapper")
    fleet.route(core.handle(flapper, Pause("on battery"), fleet.now))
    fleet.route(core.handle(flapper, Resume(), fleet.now))
    fleet.route(core.handle(flapper, Pause("on battery"), fleet.now))
    assert fleet.closed.get(flapper) == CloseCode.RATE_LIMITED


def test_results_for_leased_tiles_are_paid_by_their_lease_not_by_the_message_allowance() -> None:
    """An honest device fast enough to return results above the allowance for other frames is
    not cut (on loopback the tiny model's clients were, a few times a run: "too many messages",
    their tiles lost); a result for a tile it does not hold still counts."""
    core = _core(messages=Rate(10.0, 5.0))
    fleet = Fleet(core)
    fast = fleet.join("fast", slots=4)
    box = submit(core, fleet, torch.randn(256, 512), torch.randn(512, 256))
    started = fleet.now
    results = 0
    while fleet.step():  # a result every 0.01 s: ten times the allowance
        results += 1
    assert "result" in box and fast in core.devices and fast not in fleet.closed
    assert results > 5 + 10 * (fleet.now - started)  # more than the allowance would have let through
    for _ in range(6):  # results for tiles it does not hold
        fleet.route(core.handle(fast, Result(10**9, torch.zeros(1, 1), 0.001), fleet.now))
    assert fleet.closed.get(fast) == CloseCode.RATE_LIMITED


def test_a_device_may_send_large_frames_only_while_it_holds_a_tile_with_a_large_result() -> None:
    core = _core(idle_frame=64 << 10, frame_slack=16 << 10, result_grace=5.0)
    limits: dict[int, int] = {}
    fleet = Fleet(core)
    device = fleet.join("d", slots=1)
    route = fleet.route

    def spy(out: list) -> None:
        limits.update({o.device: o.nbytes for o in out if isinstance(o, Limit)})
        route(out)

    fleet.route = spy  # type: ignore[method-assign]
    submit(core, fleet, torch.randn(64, 32), torch.randn(32, 512))  # results of 64 x 64 floats
    assert device not in limits  # 16 KiB results and slack fit the idle limit
    fleet.drain()
    submit(core, fleet, torch.randn(256, 512), torch.randn(512, 256), GemmKind.GRAD_WEIGHT)  # 256 KiB partials
    big = limits[device]
    assert big == 256 * 256 * 4 + (16 << 10)  # raised with the lease, before it can answer
    fleet.step(only=device)
    fleet.route(core.tick(fleet.now))
    assert limits[device] == big  # the next partial is already leased to it
    fleet.route(core.handle(device, Pause("owner is back"), fleet.now))  # its tile goes back
    fleet.now += 1.0
    fleet.route(core.tick(fleet.now))
    assert limits[device] == big  # it may still be sending the result of the tile it gave back
    fleet.now += 5.0
    fleet.route(core.tick(fleet.now))
    assert limits[device] == 64 << 10  # then only small frames


def test_status_is_bounded_however_many_devices_ever_joined() -> None:
    core = _core(status_rows=5)
    fleet = Fleet(core)
    devices = [fleet.join(f"d{i}") for i in range(12)]
    for d in devices[:8]:
        fleet.route(core.disconnect(d, fleet.now))
    status = report.status(core, fleet.now)
    assert len(status["devices"]) == 5
    assert [d["state"] for d in status["devices"][:4]] == ["idle"] * 4  # connected ones first
    assert status["device_counts"] == {"connected": 4, "online": 4, "offline": 8}
    encode(StatusReply(status))


def test_enrolments_are_rate_limited_for_the_whole_coordinator() -> None:
    core = _core(enrolments=Rate(1.0, 3.0))
    fleet = Fleet(core)
    for i in range(3):
        fleet.join(f"sybil{i}")
    with pytest.raises(AuthError) as info:
        fleet.join("sybil3")
    assert info.value.code == CloseCode.BUSY
    fleet.now += 1.0
    fleet.join("patient")


def test_token_buckets_refill_at_their_rate_and_never_past_their_burst() -> None:
    bucket = TokenBucket(2.0, 4.0)
    assert all(bucket.take(0.0) for _ in range(4)) and not bucket.take(0.0)
    assert bucket.take(0.5) and not bucket.take(0.5)
    assert not bucket.take(100.0, 5.0) and bucket.take(100.0, 4.0)


def test_the_memory_bound_is_finite_and_grows_with_each_limit() -> None:
    base = memory_bound(Limits(), devices_holding=16, largest_result=16 << 20, largest_frame=16 << 20)
    assert base["total"] == sum(v for k, v in base.items() if k != "total")
    more = memory_bound(
        Limits(max_connections=4096), devices_holding=16, largest_result=16 << 20, largest_frame=16 << 20
    )
    assert more["total"] > base["total"] and base["total"] < 16 << 30
    assert (
        memory_bound(Limits(), devices_holding=32, largest_result=16 << 20, largest_frame=16 << 20)["total"]
        > base["total"]
    )


def test_results_with_absurd_timings_and_errors_never_reach_status_as_non_json() -> None:
    core = _core()
    fleet = Fleet(core)
    device = fleet.join("d", slots=1)
    submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))
    item = fleet.pending.pop(0)
    a, b = item.message.operands(fleet.blocks[device])
    fleet.route(core.handle(device, Result(item.message.tile_id, a @ b, 86400.0), fleet.now))
    encode(StatusReply(report.status(core, fleet.now)))
    out = core.handle(device, Result(12345, torch.zeros(1, 1)), fleet.now)
    assert isinstance(out[0], Send) and isinstance(out[0].message, Error)
    assert not any(isinstance(o, (Close, Cancel)) for o in out)


def test_a_device_that_connects_paused_gets_no_work_until_it_resumes() -> None:
    core = _core()
    fleet = Fleet(core)
    busy = fleet.join("busy", paused="the owner is typing")
    submit(core, fleet, torch.randn(64, 32), torch.randn(32, 64))
    assert not core.devices[busy].inflight and not fleet.pending
    assert report.status(core, fleet.now)["devices"][0]["state"] == "paused"
    fleet.route(core.handle(busy, Resume(), fleet.now))
    assert core.devices[busy].inflight


def test_hundreds_of_stallers_cut_in_one_tick_do_not_nest_or_lose_tiles() -> None:
    """Cutting a device must not re-enter dispatch (it once recursed once per cut)."""
    store = MemoryStore()
    job = store.create_job("trust", {}, 10, 0.0)
    core = Core(
        store,
        job,
        join_token="tok",
        rng=np.random.default_rng(0),
        policy=POLICY,
        faults=FAULTS,
        trust=TrustPolicy(probation_tiles=4, cut_after=1),
        limits=Limits(enrolments=Rate(1e9, 1e9)),
        band_checks=False,  # each result checked alone, as it arrives: that path is what this tests
    )
    fleet = Fleet(core)
    stallers = [fleet.join(f"s{i}", slots=1) for i in range(400)]
    submit(core, fleet, torch.randn(64 * 400, 32), torch.randn(32, 16))  # more tiles than stallers
    assert all(core.devices[s].inflight for s in stallers)
    tiles = len(next(iter(core.gemms.values())).tiles)
    fleet.pending.clear()
    fleet.now += 10.0  # every hard deadline passed at once: 400 leases taken back, 400 cuts
    fleet.route(core.tick(fleet.now))
    assert sum(code == CloseCode.STALLING for code in fleet.closed.values()) == 400 and not core.devices
    assert report.status(core, fleet.now)["tiles"]["queued"] == tiles and not dict(core.sched.holding())


def test_cutting_a_loser_while_settling_a_tile_keeps_the_result() -> None:
    """A verified result cuts two stalling copy holders: the GEMM still completes."""
    store = MemoryStore()
    job = store.create_job("trust", {}, 10, 0.0)
    core = Core(
        store,
        job,
        join_token="tok",
        rng=np.random.default_rng(0),
        policy=POLICY,
        faults=FAULTS,
        trust=TrustPolicy(probation_tiles=0, first_slots=1, cut_unanswered=1, cut_unanswered_trusted=1),
        band_checks=False,  # each result checked alone, as it arrives: that path is what this tests
    )
    fleet = Fleet(core)
    s1 = fleet.join("s1", slots=1)
    box = submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))
    (tile,) = core.devices[s1].inflight
    s2 = fleet.join("s2", slots=1)
    fleet.now += 1.0
    fleet.route(core.tick(fleet.now))  # a speculative copy to s2
    honest = fleet.join("honest", slots=1)
    fleet.now += 1.5
    fleet.route(core.tick(fleet.now))  # s1 late: a deadline copy to the honest device
    assert {s1, s2, honest} <= {d for d in core.devices if tile in core.devices[d].inflight}
    fleet.pending = [p for p in fleet.pending if p.device == honest]
    fleet.now += 10.0  # past every deadline, but nothing has ticked yet
    fleet.drain()
    assert "result" in box and fleet.closed.get(s1) == fleet.closed.get(s2) == CloseCode.STALLING
    assert core.store.tile_state(tile) == "verified" and not dict(core.sched.holding())


def test_a_device_that_claims_lost_blocks_over_and_over_is_cut() -> None:
    """Every missing_block release makes the coordinator send the blocks again: charged in bytes."""
    core = _core(resends=Rate(64 << 10, 256 << 10))
    fleet = Fleet(core)
    liar = fleet.join("liar", slots=1)
    submit(core, fleet, torch.randn(64, 512), torch.randn(512, 64))  # blocks of 128 KiB
    for _ in range(10):
        if liar not in core.devices:
            break
        (held,) = core.devices[liar].inflight
        fleet.route(core.handle(liar, Release((held,)), fleet.now))
    assert fleet.closed.get(liar) == CloseCode.RATE_LIMITED
    before = len(fleet.pending)
    idle = fleet.join("idle")
    fleet.route(core.handle(idle, Release(()), fleet.now))  # giving back nothing dispatches nothing
    fleet.route(core.handle(idle, Release((424242,)), fleet.now))
    assert len(fleet.pending) >= before


def test_a_trusted_device_that_stops_answering_loses_its_slots_then_its_connection() -> None:
    core = _core()
    fleet = Fleet(core)
    sly = fleet.join("sly", slots=4)
    fleet.join("honest", slots=4)
    submit(core, fleet, torch.randn(512, 32), torch.randn(32, 64))
    while core.devices[sly].standing.on_probation(TRUST) or core.devices[sly].slots < 4:
        assert fleet.step(only=sly)
    fleet.compute[sly] = lambda a, b: (_ for _ in ()).throw(AssertionError("never called"))
    for _ in range(200):
        if sly not in core.devices:
            break
        submit(core, fleet, torch.randn(64, 32), torch.randn(32, 64))
        fleet.pending = [p for p in fleet.pending if p.device != sly]  # it holds them, never answers
        fleet.now += 1.0
        fleet.route(core.handle(sly, Heartbeat(), fleet.now))
        fleet.route(core.tick(fleet.now))
        fleet.drain()
        if sly in core.devices:
            assert core.devices[sly].slots == 1  # every lost race sends it back to one slot
    assert fleet.closed.get(sly) == CloseCode.STALLING


def test_join_and_operator_tokens_may_never_become_equal() -> None:
    core = _core()
    gate = core.gate
    assert gate.would_collide(join="op", operator=None)  # the stored operator token
    assert gate.would_collide(join="x", operator="x") and gate.would_collide(join=None, operator="tok")
    assert not gate.would_collide(join="new", operator=None) and not gate.would_collide(join=None, operator=None)


def test_reconnecting_refills_no_allowance_and_is_itself_limited() -> None:
    core = _core(resends=Rate(1.0, 150 << 10))
    fleet = Fleet(core)
    device = fleet.join("hopper", slots=1)
    credential = _credential(fleet, device)
    submit(core, fleet, torch.randn(64, 512), torch.randn(512, 64))  # blocks of 128 KiB
    (held,) = core.devices[device].inflight
    fleet.route(core.handle(device, Release((held,)), fleet.now))  # 192 KiB claimed lost: over 150 KiB
    assert fleet.closed.get(device) == CloseCode.RATE_LIMITED
    again, out = _returning(core, credential, fleet.now)  # a new connection: the same spent allowance
    fleet.route(out)
    (held,) = core.devices[again].inflight
    fleet.route(core.handle(again, Release((held,)), fleet.now))
    assert again not in core.devices
    for _ in range(4):  # six connections at once, then one per 10 s
        fleet.route(_returning(core, credential, fleet.now)[1])
        fleet.route(core.disconnect(again, fleet.now))
    with pytest.raises(AuthError) as info:
        _returning(core, credential, fleet.now)
    assert info.value.code == CloseCode.RATE_LIMITED
    fleet.now += 10.0
    _returning(core, credential, fleet.now)


def test_devices_barred_from_everything_queued_are_not_asked_again_until_the_queue_changes() -> None:
    core = _core()
    fleet = Fleet(core)
    broken = [fleet.join(f"broken{i}", slots=1) for i in range(5)]
    submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))  # one tile

    def everyone_fails() -> None:
        for d in broken:  # each fails it: barred from it, and it goes to the next
            held = [t for t in core.devices[d].inflight]
            if held:
                fleet.route(core.handle(d, Release(tuple(held), ReleaseWhy.COMPUTE_FAILED), fleet.now))
        fleet.pending.clear()

    everyone_fails()
    fleet.now += 1.0
    fleet.route(core.tick(fleet.now))  # failed everywhere: re-opened once (tests/coordinator/engine/test_core.py)
    everyone_fails()
    calls = []
    claim = core.store.claim_tile
    core.store.claim_tile = lambda *a, **k: calls.append(a[0]) or claim(*a, **k)  # type: ignore[method-assign]
    for _ in range(10):
        fleet.now += 0.05
        fleet.route(core.tick(fleet.now))
    assert calls == []  # the queue did not change: nobody asked the store again
    healthy = fleet.join("healthy", slots=1)
    assert core.devices[healthy].inflight


def test_a_device_that_lets_tiles_go_just_before_their_deadlines_is_cut() -> None:
    core = _core()
    fleet = Fleet(core)
    dodger = fleet.join("dodger", slots=1)
    fleet.join("honest", slots=1)
    for _ in range(TRUST.cut_unanswered):
        if dodger not in core.devices:
            break
        submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))
        fleet.pending = [p for p in fleet.pending if p.device != dodger]
        held = tuple(core.devices[dodger].inflight)
        fleet.now += 1.9  # most of its 2 s deadline
        fleet.route(core.handle(dodger, Release(held), fleet.now))
        fleet.pending = [p for p in fleet.pending if p.device != dodger]  # it answers nothing, ever
        fleet.drain()
    assert fleet.closed.get(dodger) == CloseCode.STALLING


# ------------------------------------------------------------------ give-backs

WORDS = "buy cheap gpus at example.org " * 6  # a device's own words: never in the books


def _bouncer_rows(path: Path, devices: set[int]) -> dict[int, int]:
    """Lease rows written for each device, read from the SQLite file itself."""
    import sqlite3

    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT device_id, count(*) FROM leases GROUP BY device_id").fetchall()
    return {d: n for d, n in rows if d in devices}


def test_release_bouncers_run_out_of_give_backs_and_their_rows_stay_bounded(tmp_path: Path) -> None:
    """Four identities take every tile they can and give it back just under half its deadline
    (short of the stall rule), with text of their choosing, for two minutes of a GEMM stream;
    each comes back after every cut. Their give-backs run out: each is cut, then cut again after
    each cool-off, the tiles go to the one honest device, and the lease rows they cost are
    bounded by their allowance (not by how long they keep at it), none with their words."""
    path = tmp_path / "c.db"
    core = _core(SQLiteStore(path))
    fleet = Fleet(core)
    bouncers = {fleet.join(f"bouncer{i}", slots=1): None for i in range(4)}
    credentials = {d: _credential(fleet, d) for d in bouncers}
    honest = fleet.join("honest", slots=1)
    boxes: list[dict] = []
    start, next_result = fleet.now, fleet.now
    while fleet.now - start < 120.0:
        if not boxes or "result" in boxes[-1]:  # a stream of GEMMs: the next once the last is done
            boxes.append(submit(core, fleet, torch.randn(64, 32), torch.randn(32, 16)))
        fleet.now += 0.1
        for d in bouncers:
            if d not in core.devices:
                try:  # back as soon as its cool-off allows
                    fleet.route(_returning(core, credentials[d], fleet.now)[1])
                except AuthError:
                    continue
            fleet.route(core.handle(d, Heartbeat(), fleet.now))
            for tile in list(core.devices[d].inflight) if d in core.devices else []:
                hold = core.sched.hold(tile, d)
                if hold is not None and fleet.now - hold.leased_at >= 0.45 * (hold.soft - hold.leased_at):
                    fleet.route(core.handle(d, Release((tile,), ReleaseWhy.MISSING_BLOCK, WORDS), fleet.now))
        fleet.pending = [p for p in fleet.pending if p.device not in bouncers]  # they never compute
        if fleet.now >= next_result and fleet.step(only=honest):  # one result every half second
            next_result = fleet.now + 0.5
        fleet.route(core.tick(fleet.now))
    core.store.flush()
    rows = _bouncer_rows(path, set(bouncers))
    for d in bouncers:
        cuts = core.gate.standing(credentials[d].identity).cuts
        assert cuts >= 2, (d, cuts)
        # Its free give-backs, then cut_after more after every cut, and one still open.
        assert rows.get(d, 0) <= TRUST.give_backs + TRUST.cut_after * cuts + 1, (d, rows, cuts)
    assert sum(rows.values()) < 120  # 225 when they could bounce for ever (80 now)
    done = sum("result" in box for box in boxes)
    assert done >= 75, done  # the honest device's stream: 85 GEMMs now, 63 while they bounced
    reasons = {lease.reason for t in range(1, 10_000) for lease in core.store.leases(t)}
    assert not any("example.org" in r for r in reasons) and "missing_block" in reasons


def test_honest_pauses_cost_nothing_within_the_allowance_and_book_no_owners_words() -> None:
    """An owner who pauses and resumes a device holding tiles, give_backs times, loses nothing:
    not cut, its slots kept, the leases' rows say "paused" (the owner's words stay on the
    device's row alone)."""
    core = _core(pauses=Rate(10.0, 100.0))
    fleet = Fleet(core)
    laptop = fleet.join("laptop", slots=2)
    fleet.join("other", slots=1)
    box = submit(core, fleet, torch.randn(512, 32), torch.randn(32, 64))
    while core.devices[laptop].standing.on_probation(TRUST):
        assert fleet.step(only=laptop)
    slots = core.devices[laptop].slots
    held = next(iter(core.devices[laptop].inflight))
    for _ in range(TRUST.give_backs):
        fleet.now += 1.0
        assert core.devices[laptop].inflight
        fleet.route(core.handle(laptop, Pause("on battery " + WORDS), fleet.now))
        fleet.pending = [p for p in fleet.pending if p.device != laptop]
        fleet.now += 1.0
        fleet.route(core.handle(laptop, Resume(), fleet.now))
    assert laptop in core.devices and laptop not in fleet.closed and core.devices[laptop].slots == slots
    given = [lease.reason for lease in core.store.leases(held) if lease.outcome == "released"]
    assert given and set(given) == {"paused"}
    fleet.drain()
    assert "result" in box and core.devices[laptop].standing.given_back == 0  # its work refills it


def test_an_owner_whose_laptop_keeps_waking_or_dropping_off_is_never_cut_for_it() -> None:
    """Pauses and departures have rate limits of their own and spend none of the release
    allowance: a laptop holding tiles that its owner wakes three times the allowance over, and
    whose Wi-Fi then drops as often, is never cut, and its standing counts no give-back."""
    from cleave.coordinator.engine.devices import Departure

    core = _core(pauses=Rate(10.0, 100.0))
    fleet = Fleet(core)
    laptop = fleet.join("laptop", slots=2)
    credential = _credential(fleet, laptop)
    fleet.join("other", slots=1)
    submit(core, fleet, torch.randn(512, 32), torch.randn(32, 64))
    rounds = 3 * (TRUST.give_backs + TRUST.cut_after)
    for _ in range(rounds):
        fleet.now += 1.0
        assert core.devices[laptop].inflight
        fleet.route(core.handle(laptop, Pause("the owner is back"), fleet.now))
        fleet.pending = [p for p in fleet.pending if p.device != laptop]
        fleet.now += 1.0
        fleet.route(core.handle(laptop, Resume(), fleet.now))
    assert laptop in core.devices and laptop not in fleet.closed
    assert core.devices[laptop].standing.given_back == 0 and core.devices[laptop].standing.cuts == 0
    for _ in range(TRUST.give_backs + TRUST.cut_after + 1):
        assert core.devices[laptop].inflight  # it holds tiles when its link drops
        fleet.route(core.disconnect(laptop, fleet.now, Departure.CLOSED))
        fleet.pending = [p for p in fleet.pending if p.device != laptop]
        fleet.now += 10.0  # within its reconnect allowance (one per 10 s)
        laptop, out = _returning(core, credential, fleet.now, name="laptop")  # refused while cut: AuthError
        fleet.blocks[laptop], fleet.inbox[laptop], fleet.compute[laptop] = {}, [], honest
        fleet.blocks_received[laptop] = []
        fleet.route(out)
    standing = core.gate.standing(credential.identity)
    assert standing.cuts == 0 and standing.given_back == 0, (standing.cuts, standing.given_back)


def test_tiles_given_back_for_missing_blocks_bar_no_one_and_do_not_stop_the_job() -> None:
    """Two devices whose blocks keep going missing give one tile back between them again and
    again (within their allowance): a missing block is sent again with the tile, so neither is
    barred from it, no tile is stuck, the job is not stopped (no ``Abort``), and once one keeps
    its blocks the GEMM completes."""
    from cleave.coordinator.engine.outbound import Abort
    from cleave.coordinator.engine.upkeep import STANDING_CHECK

    core = _core()
    fleet = Fleet(core)
    devices = [fleet.join("a", slots=1), fleet.join("b", slots=1)]
    box = submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))  # one tile
    (tile,) = [t for d in devices for t in core.devices[d].inflight]
    for _ in range(2 * (TRUST.give_backs - 1)):  # each device within its allowance
        (holder,) = [d for d in devices if tile in core.devices[d].inflight]
        fleet.now += STANDING_CHECK
        out = core.handle(holder, Release((tile,), ReleaseWhy.MISSING_BLOCK), fleet.now)
        assert holder not in core.sched.units[tile].barred, "barred for a missing block"
        for d in devices:
            out += core.handle(d, Heartbeat(), fleet.now)
        out += core.tick(fleet.now)  # the stuck-tile check runs here
        assert not [o for o in out if isinstance(o, Abort)]
        fleet.route(out)
        fleet.pending = [p for p in fleet.pending if p.device != holder]  # its blocks: gone again
    assert not [
        lease for lease in core.store.leases(tile) if lease.outcome == "released" and lease.reason != "missing_block"
    ]
    fleet.drain()
    assert "result" in box
