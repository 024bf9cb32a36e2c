"""The network-free coordinator brain, driven directly with messages and a fake clock."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from cleave.coordinator.engine import report
from cleave.coordinator.engine.checks import UNCHECKED_PER_SLOT
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.gemms import BandCheck
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.engine.outbound import Abort, Close, Limit, Outbound, Send
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.db.memory import MemoryStore
from cleave.wire.codes import CloseCode, ReleaseWhy
from cleave.wire.errors import AuthError
from cleave.wire.messages import (
    Credential,
    Credit,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Leave,
    Release,
    Result,
    Welcome,
    Work,
)

Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def honest(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def corrupt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    c = a @ b
    c[0, 0] += 1.0
    return c


class Fleet:
    """Fake devices: they cache blocks as real clients do and answer Work with a compute function."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.blocks: dict[int, dict[str, torch.Tensor]] = {}
        self.inbox: dict[int, list[object]] = {}
        self.pending: list[Send] = []
        self.compute: dict[int, Compute] = {}
        self.blocks_received: dict[int, list[str]] = {}
        self.closed: dict[int, int] = {}
        self.forgotten: dict[int, list[int]] = {}
        self.now = 100.0

    def join(self, name: str, compute: Compute = honest, slots: int = 2, **hello: object) -> int:
        nonce = self.core.gate.challenge().nonce
        device, out = self.core.connect(Hello(token="tok", name=name, slots=slots, **hello), nonce, self.now)
        self.blocks[device], self.inbox[device], self.blocks_received[device] = {}, [], []
        self.compute[device] = compute
        self.route(out)
        return device

    def route(self, out: list[Outbound]) -> None:
        for item in out:
            if isinstance(item, Limit):
                continue
            if isinstance(item, Close):
                self.closed[item.device] = item.code
            elif isinstance(item.message, Work):
                work = item.message
                for g in work.forget:
                    self.blocks[item.device] = {
                        k: v for k, v in self.blocks[item.device].items() if not k.startswith(f"{g}.")
                    }
                    self.forgotten.setdefault(item.device, []).append(g)
                for blk in work.blocks:
                    self.blocks[item.device][blk.key] = blk.data
                    self.blocks_received[item.device].append(blk.key)
                self.pending.append(item)
            else:
                self.inbox[item.device].append(item.message)

    def step(self, only: int | None = None) -> bool:
        for i, item in enumerate(self.pending):
            if only is None or item.device == only:
                self.pending.pop(i)
                work = item.message
                assert isinstance(work, Work)
                operands = work.operands(self.blocks[item.device])
                assert operands is not None, "a Work named a block the device was never sent"
                c = self.compute[item.device](*operands)
                self.now += 0.01
                self.route(self.core.handle(item.device, Result(work.tile_id, c, 0.001), self.now))
                return True
        return False

    def drain(self) -> None:
        while self.step():
            pass


@pytest.fixture
def core() -> Core:
    return make_core()


@pytest.fixture
def core_alone() -> Core:
    """Every result checked alone, as it arrives (``band_checks=False``)."""
    return make_core(band_checks=False)


def make_core(*, band_checks: bool = True, ban_rejects: int | None = None, trust: TrustPolicy | None = None) -> Core:
    store = MemoryStore()
    job = store.create_job("test", {}, 10, 0.0)
    policy = TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1)
    # No probation here: these tests are about tiles; tests/coordinator/engine/test_trust.py covers how trust is earned.
    return Core(
        store,
        job,
        join_token="tok",
        operator_token="op",
        rng=np.random.default_rng(0),
        policy=policy,
        trust=trust
        or TrustPolicy(
            probation_tiles=0, first_slots=8, **({} if ban_rejects is None else {"ban_rejects": ban_rejects})
        ),
        band_checks=band_checks,
    )


def submit(core: Core, fleet: Fleet, a: torch.Tensor, b: torch.Tensor, kind: GemmKind = GemmKind.FORWARD) -> dict:
    box: dict = {}
    _, out = core.submit(a, b, kind, fleet.now, lambda r: box.setdefault("result", r))
    fleet.route(out)
    return box


def test_two_devices_compute_a_gemm_exactly(core: Core) -> None:
    fleet = Fleet(core)
    d1 = fleet.join("a")
    fleet.join("b")
    assert isinstance(fleet.inbox[d1][0], Credential) and isinstance(fleet.inbox[d1][1], Welcome)
    a, b = torch.randn(150, 70), torch.randn(70, 130)
    box = submit(core, fleet, a, b)
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    status = report.status(core, fleet.now)
    assert all(d["tiles_done"] > 0 for d in status["devices"])  # the work was shared
    assert status["tiles"]["verified"] == sum(d["tiles_done"] for d in status["devices"])


def test_each_block_goes_to_a_device_once_and_is_forgotten_after_the_gemm(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("solo", slots=4)
    a, b = torch.randn(200, 40), torch.randn(40, 200)
    first = submit(core, fleet, a, b, GemmKind.PLAIN)
    fleet.drain()
    assert "result" in first
    keys = list(fleet.blocks_received[d])
    assert len(keys) == len(set(keys))  # never sent twice
    submit(core, fleet, torch.randn(64, 8), torch.randn(8, 64), GemmKind.PLAIN)
    # The next GEMM's first Work tells the device to drop both sources of the finished one.
    assert len(fleet.pending[0].message.forget) == 2
    fleet.drain()
    assert not any(k in fleet.blocks[d] for k in keys)


def test_dw_reuses_the_forward_and_dx_blocks_already_on_the_device(core: Core) -> None:
    """A Linear layer's three GEMMs, as the seam submits them: dW needs no new input block."""
    fleet = Fleet(core)
    d = fleet.join("solo", slots=4)
    x, w, dy = torch.randn(256, 40), torch.randn(48, 40), torch.randn(256, 48)
    y = submit(core, fleet, x, w.t(), GemmKind.FORWARD)
    fleet.drain()
    dx = submit(core, fleet, dy, w, GemmKind.GRAD_INPUT)
    fleet.drain()
    sent_before_dw = len(fleet.blocks_received[d])
    dw = submit(core, fleet, dy.t(), x, GemmKind.GRAD_WEIGHT)
    fleet.drain()
    assert len(fleet.blocks_received[d]) == sent_before_dw  # X and dY pieces were already there
    torch.testing.assert_close(y["result"], x @ w.t(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dx["result"], dy @ w, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dw["result"], dy.t() @ x, rtol=1e-5, atol=1e-4)
    # dW was their last reader: both namespaces are forgotten with the next Work.
    submit(core, fleet, torch.randn(64, 8), torch.randn(8, 64), GemmKind.PLAIN)
    assert len(fleet.pending[0].message.forget) >= 2
    fleet.drain()
    assert len(core.intake.sources) == 0


def test_a_forward_no_backward_follows_leaves_no_source_on_devices(core: Core) -> None:
    """A forward's X is kept on devices for its dW; an evaluation's (``retain=False``) has no
    dW, so its blocks go with the GEMM instead of at the next step."""
    fleet = Fleet(core)
    fleet.join("solo", slots=4)
    x, w = torch.randn(96, 64), torch.randn(64, 48)
    box: dict = {}
    _, out = core.submit(x, w, GemmKind.FORWARD, fleet.now, lambda r: box.setdefault("y", r), retain=False)
    fleet.route(out)
    fleet.drain()
    torch.testing.assert_close(box["y"], x @ w, rtol=1e-5, atol=1e-5)
    assert len(core.intake.sources) == 0
    submit(core, fleet, x, w)  # training's forward: X stays for the dW
    fleet.drain()
    assert [s.retained for s in core.intake.sources._live.values()] == [True]


def test_a_weight_changed_in_place_is_never_served_from_a_stale_cache(core: Core) -> None:
    fleet = Fleet(core)
    fleet.join("solo", slots=4)
    x, w = torch.randn(128, 32), torch.randn(16, 32)
    first = submit(core, fleet, x, w.t(), GemmKind.FORWARD)
    fleet.drain()
    with torch.no_grad():
        w.add_(1.0)  # an optimizer step: same memory, new values
    second = submit(core, fleet, x, w.t(), GemmKind.FORWARD)
    fleet.drain()
    torch.testing.assert_close(second["result"], x @ w.t(), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(first["result"], second["result"])
    assert report.status(core, fleet.now)["tiles"]["rejected"] == 0


def test_split_k_weight_gradient_is_exact(core: Core) -> None:
    fleet = Fleet(core)
    fleet.join("a")
    fleet.join("b")
    dy, x = torch.randn(256, 48), torch.randn(256, 40)
    box = submit(core, fleet, dy.t(), x, GemmKind.GRAD_WEIGHT)
    assert len(core.gemms[1].plan.k_cuts) > 2  # really split along tokens
    fleet.drain()
    torch.testing.assert_close(box["result"], dy.t() @ x, rtol=1e-5, atol=1e-4)  # sums of 256 terms ~16


def test_devices_never_hold_more_tiles_than_their_slots(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("a", slots=3)
    submit(core, fleet, torch.randn(256, 64), torch.randn(64, 256))
    assert len(core.devices[d].inflight) == 3
    assert report.status(core, fleet.now)["tiles"]["queued"] > 0


def test_corrupted_results_are_rejected_and_recomputed_elsewhere(core_alone: Core) -> None:
    core = core_alone
    fleet = Fleet(core)
    bad = fleet.join("bad", compute=corrupt)
    good = fleet.join("good")
    a, b = torch.randn(128, 64), torch.randn(64, 128)
    box = submit(core, fleet, a, b)
    assert fleet.step(only=bad)
    errors = [m for m in fleet.inbox[bad] if isinstance(m, Error)]
    assert errors and errors[0].code == "rejected"
    fleet.compute[bad] = honest  # it behaves from now on; the rejected tile must still go elsewhere
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    status = report.status(core, fleet.now)
    rows = {d["name"]: d for d in status["devices"]}
    assert rows["bad"]["tiles_rejected"] == 1 and status["tiles"]["rejected"] == 1
    histories = [core.store.leases(t) for t in range(1, status["tiles"]["verified"] + 1)]
    (history,) = [h for h in histories if any(lease.outcome == "rejected" for lease in h)]
    assert [(lease.device_id, lease.outcome) for lease in history] == [(bad, "rejected"), (good, "verified")]


def test_a_device_that_keeps_failing_verification_is_banned(core_alone: Core) -> None:
    core = core_alone
    fleet = Fleet(core)
    bad = fleet.join("bad", compute=corrupt, slots=4)
    fleet.join("good")
    a, b = torch.randn(256, 64), torch.randn(64, 256)
    box = submit(core, fleet, a, b)
    for _ in range(3):
        assert fleet.step(only=bad)
    assert fleet.closed.get(bad) == CloseCode.BANNED
    assert bad not in core.devices
    fleet.pending = [p for p in fleet.pending if p.device != bad]  # its socket is gone
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    assert {d["name"]: d["state"] for d in report.status(core, fleet.now)["devices"]}["bad"] == "banned"


def test_a_lost_device_loses_only_its_outstanding_tiles(core: Core) -> None:
    fleet = Fleet(core)
    d1 = fleet.join("a")
    fleet.join("b")
    a, b = torch.randn(256, 64), torch.randn(64, 256)
    box = submit(core, fleet, a, b)
    fleet.step(only=d1)
    held = set(core.devices[d1].inflight)
    assert held
    fleet.pending = [p for p in fleet.pending if p.device != d1]
    fleet.route(core.disconnect(d1, fleet.now, "connection closed"))
    assert core.store.leased_to(d1) == []
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    for tile in held:
        assert [lease.outcome for lease in core.store.leases(tile)] == ["lost", "verified"]


def test_graceful_leave_releases_tiles(core: Core) -> None:
    fleet = Fleet(core)
    d1 = fleet.join("a")
    fleet.join("b")
    submit(core, fleet, torch.randn(256, 64), torch.randn(64, 256))
    held = sorted(core.devices[d1].inflight)
    fleet.route(core.handle(d1, Leave("owner is back"), fleet.now))
    assert d1 not in core.devices
    assert core.store.leases(held[0])[0].outcome == "released"


def test_results_for_tiles_never_leased_are_refused_without_harm(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("a")
    out = core.handle(d, Result(tile_id=999, c=torch.zeros(2, 2)), fleet.now)
    assert len(out) == 1 and isinstance(out[0].message, Error) and out[0].message.code == "not_leased"
    other = fleet.join("b")
    submit(core, fleet, torch.randn(64, 32), torch.randn(32, 64))
    stolen = next(iter(core.devices[other].inflight))
    out = core.handle(d, Result(tile_id=stolen, c=torch.zeros(2, 2)), fleet.now)
    assert out[0].message.code == "not_leased"
    assert core.store.tile_state(stolen) == "leased"


def test_wrong_shape_or_dtype_results_are_rejected(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("a", slots=2)
    fleet.join("b")
    submit(core, fleet, torch.randn(128, 32), torch.randn(32, 128))
    t1, t2 = sorted(core.devices[d].inflight)
    for tile, c in ((t1, torch.zeros(3, 3)), (t2, torch.zeros(64, 64, dtype=torch.float16))):
        out = core.handle(d, Result(tile, c), fleet.now)
        assert any(isinstance(o, Send) and isinstance(o.message, Error) and o.message.code == "rejected" for o in out)
        assert core.store.tile_state(tile) in ("queued", "leased")
        assert core.store.leases(tile)[0].outcome == "rejected"


def test_wrong_token_is_refused(core: Core) -> None:
    with pytest.raises(AuthError) as info:
        core.connect(Hello(token="nope", name="x"), core.gate.challenge().nonce, 0.0)
    assert info.value.code == CloseCode.AUTH and core.devices == {}
    with pytest.raises(AuthError):  # the operator token is not a join token
        core.connect(Hello(token="op", name="x"), core.gate.challenge().nonce, 0.0)


def test_finish_tells_every_device_and_late_joiners(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("a")
    out = core.finish(fleet.now)
    assert [(o.device, type(o.message)) for o in out] == [(d, Credit), (d, Finished)]
    late, out = core.connect(Hello(token="tok", name="late"), core.gate.challenge().nonce, fleet.now)
    assert isinstance(out[-1].message, Finished)


def test_status_has_the_documented_keys(core: Core) -> None:
    fleet = Fleet(core)
    fleet.join("a")
    status = report.status(core, fleet.now)
    assert {"step", "steps", "loss"} <= set(status["job"])
    assert {"queued", "leased", "verified", "rejected"} <= set(status["tiles"])
    assert {"name", "identity", "state", "tiles_done", "tiles_rejected", "gflops", "slots"} <= set(status["devices"][0])
    assert status["device_counts"] == {"connected": 1, "online": 1}
    assert status["leaderboard"] == []  # nothing verified yet


def test_submit_refuses_operands_that_do_not_chain(core: Core) -> None:
    with pytest.raises(ValueError):
        core.submit(torch.randn(3, 4), torch.randn(5, 6), GemmKind.FORWARD, 0.0, lambda r: None)
    with pytest.raises(ValueError):
        core.submit(torch.randn(3, 4).double(), torch.randn(4, 6).double(), GemmKind.FORWARD, 0.0, lambda r: None)


def test_released_tiles_are_requeued_and_their_blocks_sent_again(core: Core) -> None:
    from cleave.wire.messages import Release

    fleet = Fleet(core)
    d = fleet.join("a", slots=1)
    a, b = torch.randn(64, 32), torch.randn(32, 64)
    box = submit(core, fleet, a, b)
    (held,) = core.devices[d].inflight
    fleet.pending.clear()
    fleet.blocks[d].clear()  # the device lost its cache
    fleet.route(core.handle(d, Release((held, 12345)), fleet.now))
    assert core.store.leases(held)[0].outcome == "released"
    again = fleet.pending[0].message
    assert again.tile_id == held and {blk.key for blk in again.blocks} == {again.a, again.b}
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)


def test_non_finite_inputs_stop_training_instead_of_banning_honest_devices(core: Core) -> None:
    fleet = Fleet(core)
    fleet.join("honest")
    a = torch.randn(64, 32)
    a[3, 4] = float("inf")
    with pytest.raises(FloatingPointError, match="diverged"):
        core.submit(a, torch.randn(32, 64), GemmKind.FORWARD, fleet.now, lambda r: None)
    assert report.status(core, fleet.now)["tiles"]["queued"] == 0 and core.gemms == {}


def test_an_absurd_timing_cannot_poison_speed_estimates_or_status(core: Core) -> None:
    from cleave.wire.messages import StatusReply, encode

    fleet = Fleet(core)
    d = fleet.join("liar-about-speed", slots=1)
    submit(core, fleet, torch.randn(16, 32), torch.randn(32, 16))
    item = fleet.pending.pop(0)
    a, b = item.message.operands(fleet.blocks[d])
    fleet.route(core.handle(d, Result(item.message.tile_id, a @ b, 5e-324), fleet.now))
    status = report.status(core, fleet.now)
    assert all(dev["gflops"] < 1e8 for dev in status["devices"])
    encode(StatusReply(status))  # strict JSON: would raise on inf


def test_a_take_back_that_cuts_a_device_never_leaves_the_store_and_scheduler_apart() -> None:
    """A copy's take-back can cut its slow holder while more copies are being handed out: what
    follows must see the cut (it once crashed the coordinator with a refused lease)."""
    from cleave.coordinator.engine.scheduler import FaultPolicy
    from cleave.wire.messages import Leave

    store = MemoryStore()
    job = store.create_job("x", {}, 10, 0.0)
    policy = TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1)
    core = Core(
        store,
        job,
        join_token="tok",
        rng=np.random.default_rng(0),
        policy=policy,
        faults=FaultPolicy(),
        trust=TrustPolicy(probation_tiles=0, first_slots=8),
    )
    f = Fleet(core)
    slow = f.join("A", slots=2, gflops=1000.0)
    for r in range(2):  # twice it holds a tile past twice its deadline; another finishes it
        submit(core, f, torch.randn(16, 32), torch.randn(32, 16))
        f.pending = [p for p in f.pending if p.device != slow]
        f.now += 0.01
        helper = f.join(f"Z{r}", slots=1, gflops=1000.0)
        f.pending = [p for p in f.pending if p.device != slow]
        for _ in range(9):
            f.now += 0.5
            f.route(core.tick(f.now))
        while f.step(helper):
            pass
        f.route(core.handle(helper, Leave(), f.now))
        f.pending = [p for p in f.pending if p.device != slow]
    t0 = f.now = f.now + 1
    box: dict = {}
    for i, (delay, name) in enumerate(((0.0, None), (0.06, "B"), (0.07, None), (2.01, "C"), (2.10, "D"))):
        f.now = t0 + delay
        if name is None:
            _, out = core.submit(
                torch.randn(16, 32), torch.randn(32, 16), GemmKind.FORWARD, f.now, lambda c, i=i: box.setdefault(i, c)
            )
            f.route(out)
        else:
            f.join(name, slots=2 if name == "D" else 1, gflops=1000.0)
    for _ in range(40):
        f.now += 0.5
        f.route(core.tick(f.now))
        f.pending = [p for p in f.pending if p.device != slow]
        while f.step():
            pass
    assert len(box) == 2 and not core.gemms


def test_a_gemm_the_trainer_waits_on_overtakes_a_deferred_weight_gradient(core: Core) -> None:
    fleet = Fleet(core)
    d = fleet.join("solo", slots=1)
    x, dy, w = torch.randn(96, 40), torch.randn(96, 48), torch.randn(48, 40)
    boxes: dict[str, torch.Tensor] = {}
    gid_w, out = core.submit(
        dy.t(), x, GemmKind.GRAD_WEIGHT, fleet.now, lambda r: boxes.setdefault("dw", r), deferred=True
    )
    fleet.route(out)
    gid_x, out = core.submit(dy, w, GemmKind.GRAD_INPUT, fleet.now, lambda r: boxes.setdefault("dx", r))
    fleet.route(out)
    assert len(core.gemms[gid_w].tiles) > 1 and len(core.gemms[gid_x].tiles) > 1
    while "dx" not in boxes:  # one dW tile was out already (its one slot); then every dX tile
        assert fleet.step()
    assert len(core.gemms[gid_w].parts) <= 1
    fleet.drain()
    torch.testing.assert_close(boxes["dx"], dy @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(boxes["dw"], dy.t() @ x, rtol=1e-5, atol=1e-5)
    assert d in core.devices


def test_a_tile_every_device_failed_is_reopened_once_then_the_job_stops_with_the_reason(core: Core) -> None:
    fleet = Fleet(core)
    devices = [fleet.join("a", slots=1), fleet.join("b", slots=1)]
    box = submit(core, fleet, torch.randn(8, 16), torch.randn(16, 8))  # one tile

    def everyone_fails() -> None:  # each device in turn: its compute fails (an OOM, say)
        for _ in devices:
            (work,) = fleet.pending
            fleet.pending.clear()
            tile = work.message.tile_id
            fleet.route(
                core.handle(work.device, Release((tile,), ReleaseWhy.COMPUTE_FAILED, "out of memory"), fleet.now)
            )
        assert not fleet.pending and core.sched.stuck() == [tile]  # nobody may take it now

    everyone_fails()
    fleet.now += 2.0
    out = core.tick(fleet.now)
    assert not any(isinstance(o, Abort) for o in out)
    fleet.route(out)
    assert len(fleet.pending) == 1  # re-opened: a device has it again
    everyone_fails()
    fleet.now += 2.0
    assert not any(isinstance(o, Abort) for o in core.tick(fleet.now))  # a new device may still come
    fleet.now += 61.0
    for d in devices:  # still here (they answer heartbeats)
        fleet.route(core.handle(d, Heartbeat(fleet.now), fleet.now))
    aborts = [o for o in core.tick(fleet.now) if isinstance(o, Abort)]
    assert len(aborts) == 1 and "failed on every connected device, twice" in aborts[0].reason
    # The books' fixed code for why, never the device's own words ("out of memory" is in the log).
    assert "released: compute_failed" in aborts[0].reason and "out of memory" not in aborts[0].reason
    assert "result" not in box


def test_a_tile_failed_everywhere_twice_waits_for_a_new_device_that_can_take_it(core: Core) -> None:
    fleet = Fleet(core)
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    devices = [fleet.join("a", slots=1)]
    box = submit(core, fleet, a, b)
    for _ in range(2):  # failed, re-opened, failed again
        (work,) = fleet.pending
        fleet.pending.clear()
        fleet.route(
            core.handle(work.device, Release((work.message.tile_id,), ReleaseWhy.COMPUTE_FAILED, "oom"), fleet.now)
        )
        fleet.now += 2.0
        out = core.tick(fleet.now)
        assert not any(isinstance(o, Abort) for o in out)
        fleet.route(out)
    devices.append(fleet.join("newcomer", slots=1))  # within the grace
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    fleet.now += 120.0
    fleet.route(core.handle(devices[0], Heartbeat(fleet.now), fleet.now))
    assert not any(isinstance(o, Abort) for o in core.tick(fleet.now))


# --------------------------------------------------------------------------- relays (engine/relays.py)


def _relay(core: Core, fleet: Fleet, name: str = "relay-1") -> tuple[int, bytes]:
    from cleave.wire import auth

    nonce = core.gate.challenge().nonce
    relay_id, out = core.connect(Hello(token="tok", name=name, relay="ws://10.0.0.9:8766"), nonce, fleet.now)
    fleet.inbox[relay_id], fleet.blocks[relay_id] = [], {}
    fleet.route(out)
    secret = next(m for m in fleet.inbox[relay_id] if isinstance(m, Credential)).secret
    return relay_id, auth.stored_key(bytes.fromhex(secret))


def test_devices_behind_a_relay_fetch_by_digest_and_the_relay_is_served_only_live_blocks_twice(core: Core) -> None:
    from cleave.wire.digest import block_digest, relay_ticket, ticket_ok
    from cleave.wire.messages import BlockRequest, Blocks, UseRelay

    fleet = Fleet(core)
    relay_id, key = _relay(core, fleet)
    d1, d2 = fleet.join("a"), fleet.join("b")
    uses = {d: [m for m in fleet.inbox[d] if isinstance(m, UseRelay)] for d in (d1, d2)}
    assert all(len(u) == 1 and u[0].relay == relay_id for u in uses.values()), uses
    assert ticket_ok(key, relay_id, d1, uses[d1][0].ticket) and uses[d1][0].ticket == relay_ticket(key, relay_id, d1)
    a, b = torch.randn(150, 70), torch.randn(70, 130)
    submit(core, fleet, a, b)
    works = [item.message for item in fleet.pending]
    assert works and all(not w.blocks and w.fetch for w in works)  # every block named, none carried
    digests = sorted({d for w in works for _, d in w.fetch})
    served = core.handle(relay_id, BlockRequest(tuple(digests)), fleet.now)
    (reply,) = [item.message for item in served]
    assert isinstance(reply, Blocks) and not reply.missing
    assert all(block_digest(blk.data) == blk.key for blk in reply.blocks)  # the true bytes under each digest
    again = core.handle(relay_id, BlockRequest(tuple(digests)), fleet.now).pop().message
    third = core.handle(relay_id, BlockRequest(tuple(digests)), fleet.now).pop().message
    assert len(again.blocks) == len(digests) and third.missing == tuple(digests)  # each at most twice
    unknown = core.handle(relay_id, BlockRequest(("ab" * 32,)), fleet.now).pop().message
    assert unknown.missing == ("ab" * 32,) and not unknown.blocks  # only blocks a GEMM reads now
    assert core.relays.bytes_named > 0 and core.relays.relays[relay_id].bytes_out > 0
    assert core.planner.ps.relays == 1  # the cost model prices blocks through it
    core.disconnect(relay_id, fleet.now)
    assert core.planner.ps.relays == 0 and not core.relays.behind


def test_a_relay_is_banned_only_on_its_own_seals_proof_and_limited_like_any_peer(core: Core) -> None:
    from cleave.wire.codes import RelayFault
    from cleave.wire.digest import relay_tag
    from cleave.wire.messages import BlockRequest, RelayReport, UseRelay

    fleet = Fleet(core)
    relay_id, key = _relay(core, fleet)
    devices = [fleet.join(f"d{i}") for i in range(5)]
    submit(core, fleet, torch.randn(150, 70), torch.randn(70, 130))
    digest = fleet.pending[0].message.fetch[0][1]
    other_bytes = "ef" * 32  # the digest of what a liar sent instead
    # A device cannot forge the relay's seal: a made-up tag on a mismatch proves nothing. It
    # leaves the relay (and is never put behind it again); the relay stays, with a strike.
    liar = devices[0]
    out = core.handle(liar, RelayReport(relay_id, RelayFault.WRONG, digest, "ab" * 32, other_bytes), fleet.now)
    assert any(isinstance(i, Send) and i.message == UseRelay(0) for i in out) and relay_id in core.relays.relays
    assert liar not in core.relays.behind and core.relays.place(liar) is None  # not behind it again
    # A report of a relay that is not the device's own is ignored.
    assert core.handle(liar, RelayReport(relay_id, RelayFault.STALLED, digest), fleet.now) == []
    # A relay that lacked a block is not struck: an honest one may have been evicted.
    out = core.handle(devices[1], RelayReport(relay_id, RelayFault.UNREACHABLE, digest), fleet.now)
    assert relay_id in core.relays.relays and core.relays.relays[relay_id].strikes == {liar}
    # The relay's own seal on serving other bytes under that digest: proof. Banned, devices released.
    sealed = relay_tag(key, digest, other_bytes)
    out = core.handle(devices[2], RelayReport(relay_id, RelayFault.WRONG, digest, sealed, other_bytes), fleet.now)
    assert any(isinstance(i, Close) and i.device == relay_id and i.code == CloseCode.BANNED for i in out), out
    assert relay_id not in core.relays.relays and not core.relays.behind
    # A relay that floods the coordinator with requests is cut like any peer.
    flooder, _ = _relay(core, fleet, "relay-2")
    closes = []
    for _ in range(10_000):
        got = core.handle(flooder, BlockRequest(("cd" * 32,)), fleet.now)
        closes = [i for i in got if isinstance(i, Close)]
        if closes:
            break
    assert closes and closes[0].code == CloseCode.RATE_LIMITED and flooder not in core.relays.relays


def test_devices_go_behind_the_relay_whose_devices_downlinks_add_up_to_least() -> None:
    from cleave.coordinator.engine.limits import TokenBucket
    from cleave.coordinator.engine.relays import Relays, RelayState

    relays = Relays()
    relays.add(RelayState(1, 11, "r1", "ws://10.0.0.1:8766", b"k" * 32, TokenBucket(1, 1)))
    relays.add(RelayState(2, 12, "r2", "ws://10.0.0.2:8766", b"k" * 32, TokenBucket(1, 1)))
    placed = [relays.place(d, down).relay for d, down in ((10, 100e6), (11, 10e6), (12, 10e6), (13, 10e6))]
    assert placed == [1, 2, 2, 2]  # one fast device weighs as much as several slow ones
    relays.leave(10)
    assert relays.place(14, 10e6).relay == 1 and relays.relays[1].load == 10e6
    assert relays.place(14, 10e6) is None  # placed once
    assert relays.remove(2) == [11, 12, 13] and set(relays.behind) == {14}


def test_tiles_a_device_gives_back_after_its_relay_failed_it_are_no_stall_and_leave_the_relayed_count(
    core: Core,
) -> None:
    """A device waited on a relay that stalled until late in its leases: it reports the relay and
    gives the tiles back for their blocks. Holding them that long was the relay's doing, not a
    stall of the device's (no unanswered lease is counted), and the blocks it never had leave
    the count of bytes relays served."""
    from cleave.wire.codes import RelayFault
    from cleave.wire.messages import RelayReport

    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    dev = fleet.join("a")
    submit(core, fleet, torch.randn(150, 70), torch.randn(70, 130))
    works = [item.message for item in fleet.pending if item.device == dev]
    assert works and all(w.fetch for w in works)
    named = core.relays.bytes_named
    assert named > 0 and core.relays.relays[relay_id].bytes_named == named
    tiles = tuple(w.tile_id for w in works)
    holds = [core.sched.hold(t, dev) for t in tiles]
    fleet.now = min(h.leased_at + 0.75 * (h.soft - h.leased_at) for h in holds)  # a stall, were it the device's
    fleet.route(core.handle(dev, RelayReport(relay_id, RelayFault.STALLED, works[0].fetch[0][1]), fleet.now))
    fleet.route(core.handle(dev, Release(tiles, ReleaseWhy.MISSING_BLOCK), fleet.now))
    assert core.devices[dev].standing.unanswered == 0 and dev in core.devices
    assert core.relays.bytes_named == 0 and core.relays.relays[relay_id].bytes_named == 0


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("ws://10.0.0.9:8766", True),
        ("wss://relay.example.org", True),
        ("wss://relay.example.org:443/blocks", True),
        ("http://10.0.0.9:8766", False),
        ("ws://", False),
        ("ws://user:pw@10.0.0.9:8766", False),
        ("ws://10.0.0.9:8766/?next=evil", False),
        ("ws://10.0.0.9:8766#x", False),
        ("ws://10.0.0.9:99999", False),
        ("ws://10.0.0.9:8766/\nHost: x", False),
        ("ws://" + "a" * 600 + ".org", False),
        ("ws://2130706433:8766", False),  # no standard address: devices would not take it anyway
        ("ws://127.1:8766", False),
    ],
)
def test_a_relay_may_name_only_a_plain_ws_url_for_devices(core: Core, url: str, ok: bool) -> None:
    from cleave.coordinator.engine.relays import relay_url_ok

    assert relay_url_ok(url) is ok
    if not ok:
        nonce = core.gate.challenge().nonce
        with pytest.raises(AuthError, match="hello.relay must be"):
            core.connect(Hello(token="tok", name="r", relay=url), nonce, 100.0)


def test_a_relays_credential_cannot_also_connect_a_device_and_the_job_goes_on(core: Core) -> None:
    """One identity is one devices row: a device hello with a connected relay's credential is
    refused (4009), so the relay leaving later ends no device's leases."""
    from cleave.wire import auth

    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    cred = next(m for m in fleet.inbox[relay_id] if isinstance(m, Credential))
    nonce = core.gate.challenge().nonce
    proof = auth.proof(bytes.fromhex(cred.secret), cred.identity, bytes.fromhex(nonce)).hex()
    with pytest.raises(AuthError, match="already connected") as refused:
        core.connect(Hello(name="twin", identity=cred.identity, proof=proof), nonce, fleet.now)
    assert refused.value.code == CloseCode.IN_USE
    dev = fleet.join("honest")
    a, b = torch.randn(150, 70), torch.randn(70, 130)
    box = submit(core, fleet, a, b)
    fleet.route(core.disconnect(relay_id, fleet.now))  # its device takes blocks from here again
    failed = tuple(p.message.tile_id for p in fleet.pending if p.message.fetch)  # fetches from the gone relay
    fleet.pending = [p for p in fleet.pending if not p.message.fetch]
    fleet.route(core.handle(dev, Release(failed, ReleaseWhy.MISSING_BLOCK), fleet.now))  # sent again, carried
    fleet.drain()
    fleet.route(core.tick(fleet.now + 1.0))  # no store error: the relay's row was its own
    assert dev in core.devices and torch.allclose(box["result"], a @ b, atol=1e-4)


def test_a_relay_is_served_only_blocks_named_for_its_own_devices_within_a_reply_cap(
    core: Core, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay asking for a live block named only for another relay's devices is told it is
    missing; a reply carries at most ``MAX_REPLY_BYTES`` of blocks (always one) and leaves the
    rest out of both its blocks and its missing: the relay asks again."""
    import cleave.coordinator.engine.relays as relays_mod
    from cleave.wire.messages import BlockRequest

    fleet = Fleet(core)
    r1, _ = _relay(core, fleet, "relay-1")
    r2, _ = _relay(core, fleet, "relay-2")
    d1, d2 = fleet.join("a"), fleet.join("b")
    assert core.relays.behind == {d1: r1, d2: r2}
    submit(core, fleet, torch.randn(150, 70), torch.randn(70, 130))
    named = {d: {g for p in fleet.pending if p.device == d for _, g in p.message.fetch} for d in (d1, d2)}
    only_r1 = sorted(named[d1] - named[d2])
    assert only_r1, named
    reply = core.handle(r2, BlockRequest(tuple(only_r1)), fleet.now).pop().message
    assert reply.missing == tuple(only_r1) and not reply.blocks
    mine = sorted(named[d1])
    monkeypatch.setattr(relays_mod, "MAX_REPLY_BYTES", 1)  # every reply: one block
    reply = core.handle(r1, BlockRequest(tuple(mine)), fleet.now).pop().message
    assert [b.key for b in reply.blocks] == mine[:1] and not reply.missing
    reply = core.handle(r1, BlockRequest(tuple(mine[1:])), fleet.now).pop().message
    assert [b.key for b in reply.blocks] == mine[1:2] and not reply.missing


def test_blocks_a_relay_failed_to_serve_are_not_charged_to_the_devices_resend_budget(core: Core) -> None:
    """A device whose relay stalled gives its tiles back for their blocks: those were named for
    the relay and never had, so sending them now is not charged to its own resend budget (one
    big stall would cut an honest device, 4029)."""
    from cleave.coordinator.engine.limits import TokenBucket
    from cleave.wire.codes import RelayFault
    from cleave.wire.messages import RelayReport

    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    dev = fleet.join("a")
    submit(core, fleet, torch.randn(150, 70), torch.randn(70, 130))
    works = [item.message for item in fleet.pending if item.device == dev]
    assert works and all(w.fetch and not w.blocks for w in works)
    core.devices[dev].resends = TokenBucket(0.0, 1.0)  # a byte: any charge cuts it
    fleet.route(core.handle(dev, RelayReport(relay_id, RelayFault.STALLED, works[0].fetch[0][1]), fleet.now))
    tiles = tuple(w.tile_id for w in works)
    fleet.route(core.handle(dev, Release(tiles, ReleaseWhy.MISSING_BLOCK), fleet.now))
    assert dev in core.devices and dev not in fleet.closed
    # A second release of the same blocks is the device's own: charged, and it is cut.
    fleet.pending.clear()
    again = tuple(t for t in tiles if t in core.devices[dev].inflight)
    assert again
    fleet.route(core.handle(dev, Release(again, ReleaseWhy.MISSING_BLOCK), fleet.now))
    assert fleet.closed.get(dev) == CloseCode.RATE_LIMITED


def _past_hard_deadlines(core: Core, fleet: Fleet, dev: int) -> None:
    """Move time past the hard deadlines of ``dev``'s leases now (it beats meanwhile), ticking."""
    holds = [h for t in core.devices[dev].inflight if (h := core.sched.hold(t, dev)) is not None]
    fleet.now = max(h.hard for h in holds) + 0.01
    fleet.route(core.handle(dev, Heartbeat(fleet.now), fleet.now))
    fleet.route(core.tick(fleet.now))


def test_a_slow_relay_costs_the_relay_new_devices_and_never_its_waiting_devices_their_standing(core: Core) -> None:
    """A device behind a relay is told to wait at most half the shortest lease deadline on it;
    then it reports the relay stalled. Its leases held meanwhile may still pass their deadlines
    (its release is slow to come): taken back, they are not its stall (no cut, no lease counted
    against it). The relay takes no new devices for its cool-off, then may again."""
    from cleave.coordinator.engine.relays import COOLOFF_S, WAIT_SHARE
    from cleave.wire.codes import RelayFault
    from cleave.wire.messages import RelayReport, UseRelay

    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    dev = fleet.join("a", slots=4)
    (use,) = [m for m in fleet.inbox[dev] if isinstance(m, UseRelay)]
    assert use.relay == relay_id and use.wait == core.faults.lease_floor * WAIT_SHARE
    a, b = torch.randn(150, 70), torch.randn(70, 130)
    box = submit(core, fleet, a, b)
    works = [item.message for item in fleet.pending if item.device == dev]
    assert len(works) >= core.trust.cut_after and all(w.fetch for w in works)
    assert all(
        fleet.now + use.wait < h.leased_at + h.soft - h.leased_at
        for w in works
        if (h := core.sched.hold(w.tile_id, dev))
    )
    fleet.now += use.wait  # it gave up on the relay
    fleet.route(core.handle(dev, RelayReport(relay_id, RelayFault.STALLED, works[0].fetch[0][1]), fleet.now))
    relayed = {w.tile_id for w in works}
    fleet.pending = [p for p in fleet.pending if p.message.tile_id not in relayed]  # never had their blocks
    _past_hard_deadlines(core, fleet, dev)
    assert dev in core.devices and dev not in fleet.closed, fleet.closed
    assert core.devices[dev].standing.taken_in_a_row == 0 and not relayed & set(core.devices[dev].inflight)
    # Its relay takes no new device for its cool-off (its load is back to nothing).
    reported = fleet.now
    newcomer = fleet.join("b")
    assert core.relays.behind.get(newcomer) is None and not [
        m for m in fleet.inbox[newcomer] if isinstance(m, UseRelay)
    ]
    while (
        fleet.pending
    ):  # the tiles get done; a work naming a block it never had is given back for it, as a client does
        item = fleet.pending[0]
        if item.message.operands(fleet.blocks[item.device]) is None:
            fleet.pending.pop(0)
            fleet.route(core.handle(item.device, Release((item.message.tile_id,), ReleaseWhy.MISSING_BLOCK), fleet.now))
        else:
            fleet.step()
    assert not fleet.closed
    assert torch.allclose(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    # Once its cool-off is over it may take newcomers again; never the device that reported it.
    fleet.now = reported + COOLOFF_S + 1
    for d in (dev, newcomer):
        fleet.route(core.handle(d, Heartbeat(fleet.now), fleet.now))
    for _ in range(3):  # each device is swept every few seconds
        fleet.now += 3.0
        fleet.route(core.tick(fleet.now))
    assert core.relays.behind.get(newcomer) == relay_id and dev not in core.relays.behind  # it reported it: never


def test_one_new_identity_cannot_close_a_relay_to_newcomers() -> None:
    """A relay cools off only on a trusted device's word or conduct: a new identity (the join
    token is all it costs) that gets itself cut for giving tiles back, or reports the relay
    stalled, strikes it at most and leaves it; the next newcomer still goes behind it."""
    from cleave.wire.codes import RelayFault
    from cleave.wire.messages import RelayReport

    core = make_core(trust=TrustPolicy(probation_tiles=20, first_slots=8))
    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    relay = core.relays.relays[relay_id]
    sybil = fleet.join("sybil", slots=1)
    assert core.relays.behind[sybil] == relay_id
    submit(core, fleet, torch.randn(150, 70), torch.randn(70, 130))
    while sybil in core.devices:  # every tile it gets, given back at once: cut past its allowance
        fleet.now += 0.1
        fleet.route(
            core.handle(sybil, Release(tuple(core.devices[sybil].inflight), ReleaseWhy.MISSING_BLOCK), fleet.now)
        )
        fleet.pending = [p for p in fleet.pending if p.device != sybil]
    assert fleet.closed[sybil] == CloseCode.STALLING
    assert relay.cool_until <= fleet.now, "a give-back bouncer's cut cooled its relay"
    other = fleet.join("other", slots=1)
    assert core.relays.behind[other] == relay_id
    fleet.route(core.handle(other, RelayReport(relay_id, RelayFault.STALLED, "ab" * 32), fleet.now))
    assert other not in core.relays.behind and relay.strikes == {other}  # struck, and it left
    assert relay.cool_until <= fleet.now, "a new identity's report cooled the relay"
    assert core.relays.behind.get(fleet.join("newcomer")) == relay_id


def test_relay_and_device_cool_offs_stay_capped_past_a_thousand_marks_and_start_over_after_a_clean_spell(
    core: Core,
) -> None:
    """Marks double a cool-off up to its cap however many there are (``2 ** 1025`` does not fit
    in a float: a relay marked that often made the tick that cut its device raise, which stops
    the job), and a clean spell after the last cool-off starts it over from the first."""
    from cleave.coordinator.engine.relays import AVOID_S, CLEAN_S, COOLOFF_S

    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    dev = fleet.join("a", slots=4)
    relay, standing = core.relays.relays[relay_id], core.devices[dev].standing
    for _ in range(1100):  # a relay and an identity marked for months on end
        until, wait = core.relays.cool(relay_id, fleet.now), core.conduct.cut(core.devices[dev], fleet.now)
    assert (until, wait) == (fleet.now + AVOID_S, core.trust.cooloff_max)
    submit(core, fleet, torch.randn(150, 70), torch.randn(70, 130))  # its tiles wait on the relay's blocks ...
    _past_hard_deadlines(core, fleet, dev)  # ... and the tick takes them back: cut, its relay marked
    assert fleet.closed.get(dev) == CloseCode.STALLING
    assert relay.cool_until == fleet.now + AVOID_S and standing.cooloff_until == fleet.now + core.trust.cooloff_max
    later = relay.cool_until + CLEAN_S  # nothing for a clean spell: from the first cool-off again
    assert core.relays.cool(relay_id, later) == later + COOLOFF_S
    later = standing.cooloff_until + core.trust.cooloff_max
    assert standing.cut(core.trust, later) == core.trust.cooloff


def test_a_relay_whose_device_was_cut_for_stalling_takes_no_new_devices_for_a_while(core: Core) -> None:
    """A device that sat on its relayed tiles without a word until they were taken back is cut
    (it may be the device, it may be its relay); its relay does not get the next newcomer, so a
    relay whose devices all left is not handed new ones on its empty load."""
    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    dev = fleet.join("a", slots=4)
    submit(core, fleet, torch.randn(150, 70), torch.randn(70, 130))
    _past_hard_deadlines(core, fleet, dev)
    assert fleet.closed.get(dev) == CloseCode.STALLING
    assert core.relays.relays[relay_id].load == 0 and core.relays.relays[relay_id].cool_until > fleet.now
    newcomer = fleet.join("b")
    assert core.relays.behind.get(newcomer) is None


def test_a_device_avoids_a_relay_it_could_not_reach_for_a_while_and_one_that_stalled_for_good() -> None:
    from cleave.coordinator.engine.limits import TokenBucket
    from cleave.coordinator.engine.relays import AVOID_S, Relays, RelayState
    from cleave.wire.codes import RelayFault

    relays = Relays()
    relays.add(RelayState(1, 11, "r1", "ws://10.0.0.1:8766", b"k" * 32, TokenBucket(1, 1)))
    for device in (10, 11):
        assert relays.place(device, now=100.0).relay == 1
    assert relays.report(10, 1, RelayFault.UNREACHABLE, "ab" * 32, "", now=100.0).dropped is False
    assert relays.report(11, 1, RelayFault.STALLED, "ab" * 32, "", now=100.0).dropped is False
    assert relays.place(10, now=100.0 + AVOID_S - 1) is None and relays.place(11, now=100.0 + AVOID_S - 1) is None
    assert relays.place(10, now=100.0 + AVOID_S).relay == 1  # its time is up: it may try again
    assert relays.place(11, now=1e12) is None  # a stall: never again


def test_a_relay_reconnects_within_the_same_budget_as_a_device(core: Core) -> None:
    """Each connection of a relay moves devices behind it and each drop excuses what they held:
    it may not bounce at will."""
    from cleave.wire import auth
    from cleave.wire.messages import Hello

    fleet = Fleet(core)
    relay_id, key = _relay(core, fleet)
    identity = core.relays.relays[relay_id].identity
    secret = next(m for m in fleet.inbox[relay_id] if isinstance(m, Credential)).secret
    refused = None
    for _ in range(1000):
        core.disconnect(relay_id, fleet.now)
        challenge = core.gate.challenge()
        proof = auth.proof(bytes.fromhex(secret), identity, bytes.fromhex(challenge.nonce)).hex()
        try:
            relay_id, out = core.connect(
                Hello(name="relay-1", identity=identity, proof=proof, relay="ws://10.0.0.9:8766"),
                challenge.nonce,
                fleet.now,
            )
        except AuthError as exc:
            refused = exc
            break
    assert refused is not None and refused.code == CloseCode.RATE_LIMITED, refused


def test_a_device_that_could_not_reach_its_relay_goes_back_behind_it_once_its_time_is_up(core: Core) -> None:
    from cleave.coordinator.engine.relays import AVOID_S
    from cleave.wire.codes import RelayFault
    from cleave.wire.messages import RelayReport, UseRelay

    fleet = Fleet(core)
    relay_id, _ = _relay(core, fleet)
    dev = fleet.join("a")
    fleet.route(core.handle(dev, RelayReport(relay_id, RelayFault.UNREACHABLE, "ab" * 32), fleet.now))
    assert dev not in core.relays.behind
    fleet.inbox[dev].clear()
    for dt in (1.0, 3.0, 6.0, AVOID_S / 2, AVOID_S / 2 + 3, AVOID_S / 2 + 6):  # swept, but still avoided
        fleet.route(core.handle(dev, Heartbeat(0.0), fleet.now + dt))
        fleet.route(core.tick(fleet.now + dt))
    assert dev not in core.relays.behind and not [m for m in fleet.inbox[dev] if isinstance(m, UseRelay)]
    for dt in (AVOID_S + 1, AVOID_S + 3, AVOID_S + 6):  # each device is swept every few seconds
        fleet.route(core.handle(dev, Heartbeat(0.0), fleet.now + dt))
        fleet.route(core.tick(fleet.now + dt))
    assert core.relays.behind.get(dev) == relay_id
    assert [m.relay for m in fleet.inbox[dev] if isinstance(m, UseRelay)] == [relay_id]


def test_a_forged_tile_inside_a_checked_band_is_rejected_alone_and_its_device_banned() -> None:
    core = make_core(ban_rejects=1)  # a trusted device is banned at its first rejected result here
    fleet = Fleet(core)
    forged: list[int] = []

    def forge_first(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = a @ b
        if not forged:
            forged.append(1)
            c[0, 0] += 1.0
        return c

    bad = fleet.join("bad", compute=forge_first)
    good = fleet.join("good")
    a, b = torch.randn(256, 64), torch.randn(64, 256)
    box = submit(core, fleet, a, b)
    assert fleet.step(only=bad)
    # Taken for its band: booked on arrival, judged once the band's other results are in.
    assert not [m for m in fleet.inbox[bad] if isinstance(m, Error)]
    counts = core.store.tile_counts(core.job_id)
    assert (counts["taken"], counts["verified"]) == (1, 0)  # neither verified nor used before its band's check
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
    assert fleet.closed.get(bad) == CloseCode.BANNED and core.checks.band_failures == 1
    errors = [m for m in fleet.inbox[bad] if isinstance(m, Error)]
    assert [e.code for e in errors] == ["rejected"]
    histories = {t: core.store.leases(t) for t in range(1, 17)}
    failed = [t for t, h in histories.items() if any(lease.reason.startswith("failed verification") for lease in h)]
    assert len(failed) == 1  # only the forged tile, however many of its band's results were checked with it
    assert [(lease.device_id, lease.outcome) for lease in histories[failed[0]]] == [
        (bad, "rejected"),
        (good, "verified"),
    ]
    for tile, history in histories.items():  # each ends verified once; the banned device's waiting ones went to good
        assert [lease.outcome for lease in history].count("verified") == 1, tile
        assert all(
            lease.device_id == bad and lease.outcome == "revoked"
            for lease in history
            if lease.reason == "its device was banned"
        ), tile
        assert "taken" not in [lease.outcome for lease in history], tile
    rows = {d["name"]: d for d in report.status(core, fleet.now)["devices"]}
    assert rows["bad"]["tiles_rejected"] == 1 and rows["bad"]["state"] == "banned"


def test_bands_check_every_result_once_and_the_job_stays_exact(core: Core) -> None:
    fleet = Fleet(core)
    for name in ("a", "b", "c"):
        fleet.join(name)
    checked: list[int] = []
    run = BandCheck.run

    def counted(self: BandCheck, rng: np.random.Generator) -> tuple:
        checked.extend(c.msg.tile_id for c in self.checks)
        return run(self, rng)

    BandCheck.run = counted  # type: ignore[method-assign]
    try:
        for kind in (GemmKind.FORWARD, GemmKind.GRAD_WEIGHT):
            a, b = torch.randn(192, 320), torch.randn(320, 160)
            box = submit(core, fleet, a, b, kind)
            fleet.drain()
            torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-4)
    finally:
        BandCheck.run = run  # type: ignore[method-assign]
    assert checked and len(checked) == len(set(checked)) == core.store.tile_counts(core.job_id)["verified"]
    assert core.checks.band_failures == 0


def test_a_trusted_forger_gets_a_bounded_number_of_results_past_the_check_before_its_ban(core: Core) -> None:
    fleet = Fleet(core)
    bad = fleet.join("bad", compute=corrupt, slots=4)
    fleet.join("good", slots=4)
    a, b = torch.randn(1024, 128), torch.randn(128, 1024)  # 256 tiles in 16 bands
    box = submit(core, fleet, a, b)
    answered = 0
    while bad in core.devices and fleet.step(only=bad):
        answered += 1
    # Taken for their bands while it held fewer than UNCHECKED_PER_SLOT a slot unchecked; every
    # later result is checked alone, and two rejected ones ban a trusted device.
    assert fleet.closed.get(bad) == CloseCode.BANNED
    assert bad not in core.devices and answered <= UNCHECKED_PER_SLOT * 4 + core.trust.ban_rejects
    fleet.pending = [p for p in fleet.pending if p.device != bad]
    fleet.drain()
    torch.testing.assert_close(box["result"], a @ b, rtol=1e-5, atol=1e-5)
