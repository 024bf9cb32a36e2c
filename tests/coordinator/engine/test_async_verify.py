"""Verification off the event loop: ``Core.receive`` hands a result out as a ``Check`` and
``Core.settle`` acts on its verdict later. Whatever happens in between (the device leaves, another
copy wins, the device answers twice), a forgery never enters the model and still counts against
whoever sent it, and a good result that comes too late is dropped like a losing copy."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from test_core import Fleet, corrupt, honest, submit

from cleave.coordinator.engine import report
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.gemms import Check
from cleave.coordinator.engine.limits import Rate, TrustPolicy
from cleave.coordinator.engine.outbound import Close, Send
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.db.memory import MemoryStore
from cleave.wire import auth
from cleave.wire.codes import CloseCode
from cleave.wire.messages import Cancel, Credential, Error, Hello, Result, Work

FAULTS = FaultPolicy(
    heartbeat=1.0,
    heartbeat_timeout=5.0,
    lease_floor=2.0,
    lease_factor=4.0,
    speculate_after=0.5,
    speculate_factor=2.0,
    max_copies=2,
)


def _core(probation_tiles: int = 0, faults: FaultPolicy | None = None) -> Core:
    store = MemoryStore()
    job = store.create_job("test", {}, 10, 0.0)
    policy = TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1)
    return Core(
        store,
        job,
        join_token="tok",
        operator_token="op",
        rng=np.random.default_rng(0),
        policy=policy,
        faults=faults,
        trust=TrustPolicy(probation_tiles=probation_tiles, first_slots=8),
        band_checks=False,  # each result checked alone, as it arrives: that path is what this tests
    )


def _receive(fleet: Fleet, device: int, compute=honest) -> tuple[Check, Work]:
    """The device computes its first pending work; its result is received, not yet settled."""
    i = next(i for i, item in enumerate(fleet.pending) if item.device == device)
    work = fleet.pending.pop(i).message
    assert isinstance(work, Work)
    a, b = work.operands(fleet.blocks[device])
    fleet.now += 0.01
    got = fleet.core.receive(device, Result(work.tile_id, compute(a, b), 0.001), fleet.now)
    assert isinstance(got, Check)
    return got, work


def test_receive_then_settle_gives_the_same_product_as_handle() -> None:
    core = _core()
    fleet = Fleet(core)
    d = fleet.join("a")
    a, b = torch.randn(100, 70), torch.randn(70, 90)
    box = submit(core, fleet, a, b)
    while fleet.pending:
        check, _ = _receive(fleet, d)
        verdict, seconds = check.run(np.random.default_rng(1))
        assert verdict.ok and seconds >= 0
        fleet.route(core.settle(check, verdict, seconds, fleet.now))
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    assert core.checks.seconds > 0


def test_a_second_result_for_a_tile_under_check_is_refused_and_not_checked_twice() -> None:
    core = _core()
    fleet = Fleet(core)
    d = fleet.join("a")
    submit(core, fleet, torch.randn(64, 64), torch.randn(64, 64))
    check, work = _receive(fleet, d)
    again = core.receive(d, Result(work.tile_id, check.msg.c.clone(), 0.001), fleet.now)
    assert isinstance(again, list) and len(again) == 1
    assert isinstance(again[0], Send) and isinstance(again[0].message, Error)
    assert again[0].message.code == "not_leased"
    verdict, seconds = check.run(core.rng)
    fleet.route(core.settle(check, verdict, seconds, fleet.now))
    assert report.status(core, fleet.now)["tiles"]["verified"] == 1


def test_resending_a_result_under_check_draws_on_the_message_allowance() -> None:
    """A result for a tile it holds is paid by its lease, once: a resend while the first is being
    verified is an unsolicited frame like any other, and a flood of them is cut."""
    core = _core()
    core.limits = dataclasses.replace(core.limits, messages=Rate(1.0, 5.0))
    fleet = Fleet(core)
    d = fleet.join("a")
    submit(core, fleet, torch.randn(64, 64), torch.randn(64, 64))
    check, work = _receive(fleet, d)  # paid by its lease: the allowance is untouched
    for _ in range(6):
        if d not in core.devices:
            break
        fleet.route(core.receive(d, Result(work.tile_id, check.msg.c.clone(), 0.001), fleet.now))  # type: ignore[arg-type]
    assert fleet.closed.get(d) == CloseCode.RATE_LIMITED


def test_a_forgery_whose_device_left_during_the_check_still_bans_it() -> None:
    core = _core(probation_tiles=20)  # a newcomer: one forgery bans it
    fleet = Fleet(core)
    d = fleet.join("forger", slots=1)
    submit(core, fleet, torch.randn(64, 64), torch.randn(64, 64))
    check, _ = _receive(fleet, d, corrupt)
    identity = core.devices[d].identity
    fleet.route(core.disconnect(d, fleet.now, "connection closed"))  # gone before the verdict
    verdict, seconds = check.run(core.rng)
    assert not verdict.ok
    assert core.settle(check, verdict, seconds, fleet.now) == []
    assert core.gate.states([identity])[identity] == "banned"
    assert report.status(core, fleet.now)["tiles"]["verified"] == 0


def test_a_forgery_is_rejected_banned_and_redone_when_the_device_is_still_there() -> None:
    core = _core(probation_tiles=20)
    fleet = Fleet(core)
    forger = fleet.join("forger", slots=1)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    box = submit(core, fleet, a, b)
    check, _ = _receive(fleet, forger, corrupt)
    verdict, seconds = check.run(core.rng)
    out = core.settle(check, verdict, seconds, fleet.now)
    fleet.route(out)
    assert fleet.closed[forger] == CloseCode.BANNED
    assert "result" not in box  # nothing of it reached the product
    fleet.join("honest")
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)


def test_a_good_result_settled_after_another_copy_won_is_dropped() -> None:
    core = _core(faults=FAULTS)
    fleet = Fleet(core)
    slow = fleet.join("slow", slots=1)
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    box = submit(core, fleet, a, b)  # one tile
    check, work = _receive(fleet, slow)  # answered; its check is still running
    fast = fleet.join("fast", slots=1)
    fleet.now += 1.0  # past the lease's speculation point: a copy goes to the idle device
    fleet.route(core.tick(fleet.now))
    assert [p.message.tile_id for p in fleet.pending if p.device == fast] == [work.tile_id]
    fleet.step(only=fast)
    assert "result" in box
    # The slow device is told to drop its copy, but it did answer: not counted as a staller.
    assert any(isinstance(m, Cancel) for m in fleet.inbox[slow])
    assert core.devices[slow].standing.unanswered == 0
    verdict, seconds = check.run(core.rng)
    assert verdict.ok
    assert core.settle(check, verdict, seconds, fleet.now) == []  # too late: dropped, no credit
    assert core.devices[slow].tiles_done == 0 and not core.devices[slow].checking
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)


def test_lazy_submit_hands_out_a_product_the_caller_computes() -> None:
    core = _core()
    fleet = Fleet(core)
    fleet.join("a")
    a, b = torch.randn(100, 70), torch.randn(70, 90)
    box: dict = {}
    _, out = core.submit(a, b, GemmKind.FORWARD, fleet.now, lambda r: box.setdefault("product", r), lazy=True)
    fleet.route(out)
    fleet.drain()
    product = box["product"]
    assert callable(product)
    torch.testing.assert_close(product(), a @ b, rtol=1e-5, atol=1e-5)


def test_a_check_whose_gemm_completed_meanwhile_is_dropped_even_if_it_fails() -> None:
    """The losing copy's check runs after the winner completed the GEMM and the trainer stepped
    the weight in place: its verdict compares against changed operands and means nothing."""
    core = _core(probation_tiles=20, faults=FAULTS)
    fleet = Fleet(core)
    slow = fleet.join("slow", slots=1)
    a, w = torch.randn(16, 32), torch.randn(32, 16)
    box = submit(core, fleet, a, w)
    fast = fleet.join("fast", slots=1)
    fleet.now += 1.0
    fleet.route(core.tick(fleet.now))  # a copy for the idle device
    check_fast, _ = _receive(fleet, fast)
    check_slow, _ = _receive(fleet, slow)  # answered too, before the copy's verdict
    verdict, seconds = check_fast.run(np.random.default_rng(1))
    fleet.route(core.settle(check_fast, verdict, seconds, fleet.now))
    assert "result" in box
    w.add_(0.01)  # the optimizer's step, on the trainer's thread
    stale, seconds = check_slow.run(np.random.default_rng(2))
    assert not stale.ok  # against the new weight, the honest result fails
    identity = core.devices[slow].identity
    assert core.settle(check_slow, stale, seconds, fleet.now) == []
    assert slow in core.devices and core.gate.states([identity])[identity] != "banned"
    assert core.devices[slow].tiles_rejected == 0


def test_a_forger_that_reconnects_before_its_verdict_is_banned_and_dropped() -> None:
    core = _core(probation_tiles=20)
    fleet = Fleet(core)
    d = fleet.join("forger", slots=1)
    cred = next(m for m in fleet.inbox[d] if isinstance(m, Credential))
    submit(core, fleet, torch.randn(64, 64), torch.randn(64, 64))
    check, _ = _receive(fleet, d, corrupt)
    fleet.route(core.disconnect(d, fleet.now, "connection closed"))
    fleet.now += 1
    nonce = core.gate.challenge().nonce
    proof = auth.proof(bytes.fromhex(cred.secret), cred.identity, bytes.fromhex(nonce)).hex()
    d2, _ = core.connect(Hello(identity=cred.identity, proof=proof, name="forger", slots=1), nonce, fleet.now)
    verdict, seconds = check.run(core.rng)
    out = core.settle(check, verdict, seconds, fleet.now)
    assert any(isinstance(o, Close) and o.device == d2 and o.code == CloseCode.BANNED for o in out)
    assert d2 not in core.devices
    assert core.gate.states([cred.identity])[cred.identity] == "banned"


def test_timings_count_from_the_result_arriving_not_from_its_verdict() -> None:
    core = _core()
    fleet = Fleet(core)
    d = fleet.join("a", slots=1)
    submit(core, fleet, torch.randn(64, 64), torch.randn(64, 64))
    check, _ = _receive(fleet, d)
    arrived = fleet.now
    verdict, seconds = check.run(core.rng)
    core.settle(check, verdict, seconds, arrived + 30.0)  # a long queue before the verifier
    assert core.devices[d].verified_at == arrived
    assert core.devices[d].result_at == arrived


def test_a_batch_settled_as_one_credits_each_device_once_and_grants_its_freed_slots_together() -> None:
    """The server settles a verifier batch inside ``Core.batch()`` and dispatches once after it:
    the product is exact, each device's verified tiles are credited in one write, and a device
    whose results freed several slots gets its next tiles in the same dispatch."""
    core = _core()
    credits: list[tuple[int, int]] = []
    credit = core.store.credit_device

    def counted(device_id: int, **kw) -> None:
        credits.append((device_id, kw.get("verified", 0)))
        credit(device_id, **kw)

    core.store.credit_device = counted  # type: ignore[method-assign]
    fleet = Fleet(core)
    devices = [fleet.join("a"), fleet.join("b")]
    a, b = torch.randn(256, 64), torch.randn(64, 256)
    box = submit(core, fleet, a, b)
    rounds = most = 0
    while fleet.pending:
        checks = []
        for d in devices:
            while any(item.device == d for item in fleet.pending):
                checks.append(_receive(fleet, d)[0])
        verdicts = [check.run(np.random.default_rng(1)) for check in checks]
        before = len(credits)
        with core.batch():
            out = [
                o
                for check, (v, s) in zip(checks, verdicts, strict=True)
                for o in core.settle(check, v, s, fleet.now, dispatch=False)
            ]
            assert not any(isinstance(o, Send) and isinstance(o.message, Work) for o in out)  # nothing granted yet
            out += core.dispatch(fleet.now)
        per_device = [d for d, _ in credits[before:]]
        assert sorted(per_device) == sorted(set(per_device))  # one credit write per device a batch
        assert sum(n for _, n in credits[before:]) == len(checks)
        granted = [o.device for o in out if isinstance(o, Send) and isinstance(o.message, Work)]
        most = max([most, *(granted.count(d) for d in devices)])
        fleet.route(out)
        rounds += 1
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    assert most >= 2  # a device's freed slots went out together (one work batch on the wire)
    # The planner's cached profiles are each device's as its observations left it.
    assert core.fleet_profiles() == {d: core.fleet.profiles[d].profile(core.dtype) for d in devices}
    assert rounds >= 2 and sum(n for _, n in credits) == report.status(core, fleet.now)["tiles"]["verified"]


def test_the_fleets_profiles_are_given_in_the_dtype_asked_before_any_gemm_came() -> None:
    """--micro-batches auto chooses before the first GEMM, when the Core's own dtype is still
    fp32's: a bf16 job's forecast must see the devices' bf16 rates, not a fleet that cannot work."""
    core = _core()
    fleet = Fleet(core)
    d = fleet.join("a")
    assert core.dtype == "fp32"
    for dtype in ("fp32", "bf16"):
        assert core.fleet_profiles(dtype)[d].flops_per_s(dtype) > 0
    assert core.fleet_profiles()[d] == core.fleet_profiles("fp32")[d]


def test_a_banning_forgery_first_in_a_batch_drops_the_honest_results_after_it() -> None:
    """A verifier batch settled in order: the forged result bans its device (a proven one with
    several tiles out, under a policy that bans at the first rejection), and its honest results after it in the batch
    are dropped with the rest of its tiles (``lost``, never verified: nothing of a banned
    device enters training), as docs/protocol.md says. The tiles are redone elsewhere."""
    core = _core(probation_tiles=0)
    core.conduct.trust = dataclasses.replace(core.conduct.trust, ban_rejects=1)
    fleet = Fleet(core)
    forger = fleet.join("forger", slots=4)
    a, b = torch.randn(128, 64), torch.randn(64, 128)
    box = submit(core, fleet, a, b)
    checks = [_receive(fleet, forger, corrupt)[0]]
    while any(item.device == forger for item in fleet.pending):
        checks.append(_receive(fleet, forger)[0])
    assert len(checks) >= 2
    verdicts = [c.run(np.random.default_rng(1)) for c in checks]
    assert [v.ok for v, _ in verdicts] == [False] + [True] * (len(checks) - 1)
    with core.batch():
        for check, (verdict, seconds) in zip(checks, verdicts, strict=True):
            fleet.route(core.settle(check, verdict, seconds, fleet.now, dispatch=False))
        fleet.route(core.dispatch(fleet.now))
    assert fleet.closed[forger] == CloseCode.BANNED
    outcomes = [[r.outcome.value for r in core.store.leases(c.msg.tile_id)] for c in checks]
    assert outcomes[0] == ["rejected"]
    assert all(o == ["lost"] for o in outcomes[1:]), outcomes
    fleet.join("honest")
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
