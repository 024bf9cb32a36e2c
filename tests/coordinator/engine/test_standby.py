"""Devices the plan does not need sleep (coordinator/engine/standby.py): the Core driven directly
with messages and a fake clock. An idle device the plans leave out goes to standby, gets no work,
is never cut for sleeping, and is woken before a plan that names it (or tiles nobody awake may
take) needs it; its wake is timed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cleave.coordinator.engine import report
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.engine.live_plan import LivePlanner, Planner
from cleave.coordinator.engine.outbound import Outbound, Send
from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.engine.standby import StandbyPolicy
from cleave.coordinator.planning.costmodel import PSProfile
from cleave.coordinator.planning.planner import Kind, PlannerOptions
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.db.memory import MemoryStore
from cleave.wire.codes import CloseCode, Code, StandbyWhy
from cleave.wire.errors import ConfigError
from cleave.wire.messages import (
    Error,
    Heartbeat,
    Message,
    Standby,
    Wake,
    decode,
    encode,
)
from tests.coordinator.engine import test_core as core_tests

POLICY = TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1)
SLOW_PS = PSProfile(gflops={"fp32": 0.01}, verify_flops=1e12, unit_overhead=0.0)  # shipping always wins
AFTER, KEEPALIVE = 5.0, 20.0
FAULTS = FaultPolicy(heartbeat=1.0, heartbeat_timeout=5.0)  # awake, 5 s of silence is the end


def make_core(planner: Planner = Planner.COST) -> Core:
    store = MemoryStore()
    options = PlannerOptions(kinds=frozenset({Kind.OUTPUT}), edges=(16, 32, 64), uniform=POLICY)
    return Core(
        store,
        store.create_job("test", {}, 10, 0.0),
        join_token="tok",
        rng=np.random.default_rng(0),
        policy=POLICY,
        faults=FAULTS,
        trust=TrustPolicy(probation_tiles=0, first_slots=4),
        planner=LivePlanner(planner, SLOW_PS, POLICY, options),
        band_checks=False,
        standby=StandbyPolicy(after=AFTER, keepalive=KEEPALIVE),
    )


class Fleet(core_tests.Fleet):
    """test_core's honest devices, every message to them through the real codec: a standby
    drops the device's blocks, as the client does, and (``tick_until``) they beat."""

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self.order: list[tuple[int, str]] = []  # (device, message type) as sent

    def join(self, name: str, slots: int = 4) -> int:  # type: ignore[override]
        return super().join(name, slots=slots, batch=1, gflops=50.0)

    def route(self, out: list[Outbound]) -> None:
        for item in out:
            if isinstance(item, Send):
                item = Send(item.device, decode(encode(item.message)))
                self.order.append((item.device, item.message.TYPE))
            super().route([item])
            if isinstance(item, Send) and isinstance(item.message, Standby):  # the client drops its blocks
                self.blocks[item.device].clear()

    def got(self, device: int, kind: type) -> list[Message]:
        return [m for m in self.inbox[device] if isinstance(m, kind)]

    def tick_until(self, until: float, *, beat: dict[int, float] | None = None, step: float = 0.25) -> None:
        """Tick the Core every ``step`` seconds up to ``until``; each device in ``beat`` sends a
        heartbeat at that interval (the rest stay silent)."""
        last = dict.fromkeys(beat or {}, self.now)
        while self.now < until:
            self.now = min(until, self.now + step)
            for device, every in (beat or {}).items():
                if device in self.core.devices and self.now - last[device] >= every:
                    last[device] = self.now
                    self.route(self.core.handle(device, Heartbeat(self.now), self.now))
            self.route(self.core.tick(self.now))


def submit(core: Core, fleet: Fleet, a: torch.Tensor, b: torch.Tensor) -> dict:
    box: dict = {}
    _, out = core.submit(a, b, GemmKind.FORWARD, fleet.now, lambda r: box.setdefault("c", r))
    fleet.route(out)
    return box


def test_an_idle_device_goes_to_standby_after_standby_after_and_is_counted_apart() -> None:
    core = make_core()
    fleet = Fleet(core)
    d1, d2 = fleet.join("a"), fleet.join("b")
    fleet.tick_until(fleet.now + AFTER - 0.5, beat={d1: 1.0, d2: 1.0})
    assert not fleet.got(d1, Standby) and not core.standby.asleep  # not idle long enough yet
    fleet.tick_until(fleet.now + 1.0, beat={d1: 1.0, d2: 1.0})
    for d in (d1, d2):
        (standby,) = fleet.got(d, Standby)
        assert standby == Standby(keepalive=KEEPALIVE, reason=StandbyWhy.IDLE)  # no GEMM out: the job waits
    status = report.status(core, fleet.now)
    assert [d["state"] for d in status["devices"]] == ["standby", "standby"]
    assert status["devices_standby"] == 2 and status["standby"] == {"sent": 2, "woken": 0}
    assert status["device_counts"] == {"connected": 2, "online": 2}  # still online in the books
    assert report.books(core)["devices_standby"] == 2


def test_a_sleeping_device_beats_at_its_keepalive_and_is_never_cut_for_sleeping() -> None:
    core = make_core()
    fleet = Fleet(core)
    d = fleet.join("a")
    fleet.tick_until(fleet.now + AFTER + 1.0, beat={d: 1.0})
    assert core.standby.is_asleep(d)
    beats = len(fleet.got(d, Heartbeat))
    # Silent for 3.5 x the awake timeout between its keep-alives, for four of them: still here.
    fleet.tick_until(fleet.now + 4 * KEEPALIVE, beat={d: KEEPALIVE})
    assert d in core.devices and d not in fleet.closed
    assert core.standby.is_asleep(d)
    # The coordinator beat at its keep-alive too (once every 20 s, not every second).
    assert len(fleet.got(d, Heartbeat)) - beats == pytest.approx(4, abs=1)
    live = core.devices[d]
    assert (live.standing.cuts, live.standing.unanswered) == (0, 0)
    assert core.fleet.profiles[d].profile().reliability == 1.0
    # Silent for 3 keep-alives, it is gone like any silent device (4008).
    fleet.tick_until(fleet.now + 3 * KEEPALIVE + 1.0)
    assert fleet.closed[d] == CloseCode.SILENT and d not in core.devices


def test_a_plan_that_names_sleepers_wakes_them_before_their_tiles_and_times_the_wakes() -> None:
    core = make_core()
    fleet = Fleet(core)
    devices = [fleet.join(n) for n in "abc"]
    fleet.tick_until(fleet.now + AFTER + 1.0, beat=dict.fromkeys(devices, 1.0))
    assert sorted(core.standby.asleep) == devices
    a, b = torch.randn(128, 96), torch.randn(96, 128)
    box = submit(core, fleet, a, b)
    owners = {item.device for item in fleet.pending}
    assert owners, "the plan shipped the GEMM"
    for d in owners:  # each owner's wake comes before its first work
        kinds = [kind for dev, kind in fleet.order if dev == d]
        assert kinds.index("wake") < kinds.index("work") and kinds.count("wake") == 1
        assert not core.standby.is_asleep(d)
    for d in set(devices) - owners:
        assert core.standby.is_asleep(d) and not fleet.got(d, Wake)  # the plan left it out: still asleep
    fleet.now += 0.2
    for d in owners:  # each answers its wake at once, 0.2 s on the coordinator's clock
        fleet.route(core.handle(d, Heartbeat(fleet.now), fleet.now))
        assert core.standby.wake_s[d] == pytest.approx(0.2)
    fleet.drain()
    torch.testing.assert_close(box["c"], a @ b, rtol=1e-5, atol=1e-5)
    rows = {r["id"]: r for r in report.status(core, fleet.now)["devices"]}
    assert all(rows[d]["wake_s"] == pytest.approx(0.2) and rows[d]["tiles_done"] > 0 for d in owners)
    assert core.standby.woken == len(owners)


def test_a_sleeper_is_planned_at_its_wake_latency_and_its_dropped_blocks_come_again() -> None:
    core = make_core()
    fleet = Fleet(core)
    d1, d2 = fleet.join("a"), fleet.join("b")
    a, b = torch.randn(128, 96), torch.randn(96, 128)
    submit(core, fleet, a, b)
    fleet.drain()
    rtt = core.fleet_profiles()[d2].rtt
    fleet.tick_until(fleet.now + AFTER + 1.0, beat={d1: 1.0, d2: 1.0})
    assert core.standby.is_asleep(d2) and not core.devices[d2].blocks  # it holds nothing, as far as we know
    assert core.fleet_profiles()[d2].rtt == pytest.approx(2 * rtt)  # before its first wake: one round trip more
    core.standby.wake_s[d2] = 3.0  # a slow waker, as measured
    assert core.fleet_profiles()[d2].rtt == pytest.approx(rtt + 3.0)
    box = submit(core, fleet, a, b)  # the same operands again: every block it needs comes with its work
    fleet.drain()
    torch.testing.assert_close(box["c"], a @ b, rtol=1e-5, atol=1e-5)


def test_tiles_nobody_awake_may_take_wake_sleepers_longest_asleep_first() -> None:
    core = make_core(Planner.UNIFORM)  # the fixed grid: no planned owners
    fleet = Fleet(core)
    first = fleet.join("a", slots=2)
    fleet.tick_until(fleet.now + 1.0, beat={first: 1.0})
    later = [fleet.join(n, slots=2) for n in "bc"]
    fleet.tick_until(fleet.now + AFTER + 1.0, beat=dict.fromkeys([first, *later], 1.0))
    assert list(core.standby.asleep) == [first, *later]
    box = submit(core, fleet, torch.randn(64, 40), torch.randn(40, 64))  # 6 tiles: 2 a device
    assert not fleet.pending  # queued, nobody awake
    fleet.tick_until(fleet.now + 0.25)
    woken = [d for d in (first, *later) if fleet.got(d, Wake)]
    assert woken == [first, *later]  # 6 tiles need all their slots, taken longest asleep first
    fleet.drain()
    assert "c" in box


def test_a_sleeper_its_owner_paused_is_passed_over_when_tiles_wait() -> None:
    from cleave.wire.messages import Pause

    core = make_core(Planner.UNIFORM)
    fleet = Fleet(core)
    devices = [fleet.join(n, slots=2) for n in "abc"]
    fleet.tick_until(fleet.now + AFTER + 1.0, beat=dict.fromkeys(devices, 1.0))
    first = next(iter(core.standby.asleep))
    fleet.route(core.handle(first, Pause("owner active"), fleet.now))  # asleep, and its owner needs it
    submit(core, fleet, torch.randn(64, 40), torch.randn(40, 64))  # 4 tiles: 2 a device that may work
    fleet.tick_until(fleet.now + 0.25)
    assert not fleet.got(first, Wake) and core.standby.is_asleep(first)
    assert all(fleet.got(d, Wake) for d in devices if d != first)
    fleet.drain()


def test_a_busy_device_is_never_sent_to_standby_and_a_woken_one_has_standby_after_again() -> None:
    core = make_core()
    fleet = Fleet(core)
    d1, d2 = fleet.join("a"), fleet.join("b")
    for _ in range(3):  # every 2 s a GEMM planned on both: neither sleeps
        submit(core, fleet, torch.randn(128, 96), torch.randn(96, 128))
        fleet.drain()
        fleet.tick_until(fleet.now + 2.0, beat={d1: 1.0, d2: 1.0})
    assert not core.standby.asleep and not fleet.got(d1, Standby)
    fleet.tick_until(fleet.now + AFTER, beat={d1: 1.0, d2: 1.0})
    assert core.standby.asleep.keys() == {d1, d2}
    submit(core, fleet, torch.randn(128, 96), torch.randn(96, 128))  # wakes both
    fleet.drain()
    fleet.tick_until(fleet.now + AFTER - 1.0, beat={d1: 1.0, d2: 1.0})
    assert not core.standby.asleep  # woken, they have AFTER seconds before they may sleep again


def test_a_paused_device_is_not_sent_to_standby_and_a_resume_leaves_a_sleeper_asleep() -> None:
    from cleave.wire.messages import Pause, Resume

    core = make_core()
    fleet = Fleet(core)
    d1, d2 = fleet.join("a"), fleet.join("b")
    fleet.route(core.handle(d1, Pause("on battery"), fleet.now))
    fleet.tick_until(fleet.now + AFTER + 1.0, beat={d1: 1.0, d2: 1.0})
    assert not fleet.got(d1, Standby) and core.standby.is_asleep(d2)  # its owner's pause comes first
    fleet.now += 3.0
    fleet.route(core.handle(d2, Pause("owner active"), fleet.now))
    fleet.now += 3.0
    fleet.route(core.handle(d2, Resume(), fleet.now))
    assert core.standby.is_asleep(d2) and core.devices[d2].free == 0  # the coordinator's standby still holds


def test_a_hostile_sleeper_that_beats_fast_or_sends_what_a_device_may_not_stays_asleep_and_workless() -> None:
    core = make_core()
    fleet = Fleet(core)
    d1, d2 = fleet.join("a"), fleet.join("b")
    fleet.tick_until(fleet.now + AFTER + 1.0, beat={d1: 1.0, d2: 1.0})
    assert core.standby.asleep.keys() == {d1, d2}
    fleet.route(core.handle(d1, Wake(), fleet.now))  # the coordinator's messages, from a device
    fleet.route(core.handle(d1, Standby(keepalive=1.0), fleet.now))
    errors = fleet.got(d1, Error)
    assert [e.code for e in errors] == [Code.UNEXPECTED, Code.UNEXPECTED]
    # Ten heartbeats a second for 30 s (well within the message allowance): still asleep, no work.
    fleet.tick_until(fleet.now + 30.0, beat={d1: 0.1, d2: KEEPALIVE}, step=0.1)
    assert core.standby.is_asleep(d1) and d1 in core.devices and not core.devices[d1].inflight
    assert not fleet.pending and core.standby.wake_s.get(d1) is None  # its beats answered no wake
    # Past the allowance it is cut as any device flooding the coordinator would be (4029), not for sleeping.
    for _ in range(1000):
        fleet.route(core.handle(d1, Heartbeat(fleet.now), fleet.now))
        if d1 in fleet.closed:
            break
    assert fleet.closed[d1] == CloseCode.RATE_LIMITED
    assert core.standby.is_asleep(d2) and d2 not in fleet.closed


def test_a_standby_policy_out_of_bounds_is_refused() -> None:
    for bad in (dict(after=-1.0), dict(after=float("nan")), dict(keepalive=0.5), dict(keepalive=7200.0)):
        with pytest.raises(ConfigError):
            StandbyPolicy(**bad)  # type: ignore[arg-type]
    assert StandbyPolicy(after=0.0).after == 0.0  # 0: never
    core = make_core()
    core.standby.policy = StandbyPolicy(after=0.0)
    fleet = Fleet(core)
    d = fleet.join("a")
    fleet.tick_until(fleet.now + 120.0, beat={d: 1.0}, step=1.0)
    assert not core.standby.asleep and not fleet.got(d, Standby)


# --------------------------------------------------------------------------- the live drill


@pytest.mark.drill
def test_drill_devices_the_plan_drops_sleep_and_come_back_when_it_needs_them(tmp_path) -> None:  # noqa: ANN001
    """A real coordinator (``serve_job`` on 127.0.0.1) and three real clients (``Worker``) train
    the tiny model. Mid-run a test hook makes the planner plan every GEMM on d0 alone and holds
    d0's tiles in its compute (its GEMMs stay out, so deadlines and copies have nothing to say):
    d1 and d2 idle, are sent to standby as ``unplanned``, show it, beat at their keep-alive (each
    gap longer than the awake heartbeat timeout) and are never cut. Then the planner plans on
    everyone again: they are woken before their tiles, ship tiles, and the losses are plain
    torch's."""
    import asyncio
    import sqlite3
    import threading

    from cleave.cli.render import client_line
    from cleave.client import kernels
    from cleave.client.runner import Worker, WorkerConfig, WorkerStats
    from cleave.client.state import WorkerState
    from cleave.coordinator.config import CoordinatorConfig
    from cleave.coordinator.job import serve_job
    from cleave.coordinator.net.server import Server
    from cleave.coordinator.training.loop import StepResult, TrainConfig, Trainer

    train = TrainConfig(model="tiny", steps=3, batch_size=32, micro_batches=1, eval_every=0)
    faults = FaultPolicy(heartbeat=0.3, heartbeat_timeout=1.5, lease_floor=30.0, speculate_after=60.0)
    standby = StandbyPolicy(after=0.3, keepalive=2.0)
    cfg = CoordinatorConfig(
        train=train,
        port=0,
        db=str(tmp_path / "job.db"),
        token="join-token-drill",
        operator_token="operator-token-drill",
        min_devices=3,
        planner=Planner.COST,
        ps_gflops=0.01,  # the coordinator too slow to keep a GEMM: every one is shipped
        faults=faults,
        trust=TrustPolicy(probation_tiles=0, first_slots=4),
        standby=standby,
        checkpoint_every=0,
        send_threads=0,
    )
    quiet = {"armed": False, "on": False}  # the hook: plan on d0 alone (armed: from the next clean start)
    hold = threading.Event()  # cleared: d0's compute holds its tiles
    hold.set()
    states: dict[str, list[str]] = {f"d{i}": [] for i in range(3)}
    lines: dict[str, list[str]] = {f"d{i}": [] for i in range(3)}
    cpu = torch.device("cpu")

    def held(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        hold.wait(30.0)
        return kernels.matmul(a, b, cpu)

    def watch(name: str, url: str):  # noqa: ANN202
        def update(stats: WorkerStats) -> None:  # each change of state, and the log line it shows
            if not states[name] or states[name][-1] != stats.state:
                states[name].append(str(stats.state))
                lines[name].append(client_line(stats, url).plain)

        return update

    def quieted(core: Core) -> LivePlanner:
        """The job's own planner, but while ``quiet`` is on it plans on d0 alone."""

        class Quiet(LivePlanner):
            def plan(self, m, n, k, kind, dtype, profiles, version=None, now=0.0):  # noqa: ANN001, ANN202
                others = [d for d, dev in core.devices.items() if dev.name != "d0"]
                if quiet["armed"] and not any(core.standby.is_planned(d) for d in others):
                    # From the first GEMM planned once no live one names the others: they idle for sure.
                    quiet.update(armed=False, on=True)
                    hold.clear()
                if not quiet["on"]:
                    return super().plan(m, n, k, kind, dtype, profiles, version, now)
                everyone = profiles() if callable(profiles) else profiles
                mine = {d: p for d, p in everyone.items() if core.devices[d].name == "d0"}
                return super().plan(m, n, k, kind, dtype, mine, None, now)

        live = core.planner
        return Quiet(live.planner, live.ps, live.policy, live.options)

    class Quietly:
        def listening(self, info: object) -> None: ...
        def note(self, text: str) -> None: ...
        def waiting(self, have: int, want: int) -> None: ...
        def step(self, result: StepResult, status: dict) -> None: ...
        def finished(self, results: list[StepResult], status: dict) -> None: ...

    servers: list[Server] = []

    async def until(what: str, predicate, timeout: float = 30.0) -> None:  # noqa: ANN001
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {states}")
            await asyncio.sleep(0.02)

    async def drill() -> tuple[list[float], dict]:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[str] = loop.create_future()
        job = asyncio.create_task(serve_job(cfg, Quietly(), ready=ready.set_result, on_start=servers.append))
        url = await ready
        core = servers[0].core
        core.planner = quieted(core)
        workers = {
            f"d{i}": Worker(
                WorkerConfig(
                    url,
                    token=cfg.token or "",
                    name=f"d{i}",
                    device="cpu",
                    threads=1,
                    once=True,
                    benchmark_seconds=0.05,
                    credentials=tmp_path / f"d{i}.json",
                    slots=4,
                ),
                compute=held if i == 0 else None,
                on_update=watch(f"d{i}", url),
            )
            for i in range(3)
        }
        # One claimed rate: the planner tells them apart by what they deliver, not by a noisy benchmark.
        for w in workers.values():
            w.stats.benchmark_gflops = 20.0
        running = [asyncio.create_task(w.run()) for w in workers.values()]
        try:
            await until("every device to ship tiles", lambda: all(w.stats.tiles > 0 for w in workers.values()))
            ids = {name: w.stats.device_id for name, w in workers.items()}
            quiet["armed"] = True
            sleepers = [ids["d1"], ids["d2"]]
            await until("d1 and d2 to sleep", lambda: all(core.standby.is_asleep(d) for d in sleepers))
            since = {d: core.standby.asleep[d] for d in sleepers}
            tiles_asleep = {d: core.devices[d].tiles_done for d in sleepers}
            gaps = dict.fromkeys(sleepers, 0.0)

            def slept_enough() -> bool:
                now = servers[0].clock()
                for d in sleepers:
                    assert d in core.devices and core.standby.is_asleep(d), f"device {d} was cut or woken asleep"
                    gaps[d] = max(gaps[d], now - core.devices[d].last_seen)
                return all(
                    core.devices[d].last_seen > since[d] + standby.keepalive / 2  # a keep-alive came
                    and gaps[d] > faults.heartbeat_timeout  # silent longer than an awake device may be
                    for d in sleepers
                )

            await until("a keep-alive from each sleeper", slept_enough, timeout=15.0)
            assert all(core.devices[d].tiles_done == tiles_asleep[d] for d in sleepers)  # no work while asleep
            assert all(workers[n].stats.state == WorkerState.STANDBY for n in ("d1", "d2"))
            quiet.update(armed=False, on=False)
            hold.set()
            await until(
                "the plan to wake them and each to answer",
                lambda: not any(core.standby.is_resting(d) for d in sleepers),
            )
            wake_s = {d: core.standby.wake_s[d] for d in sleepers}
            outcome = await asyncio.wait_for(job, 60.0)
            codes = await asyncio.wait_for(asyncio.gather(*running), 30.0)
            assert codes == [0, 0, 0]
            return [r.loss for r in outcome.results], {
                "ids": ids,
                "woken": core.standby.woken,
                "wake_s": wake_s,
                "tiles": {n: w.stats.tiles for n, w in workers.items()},
                "after_wake": {d: tiles_asleep[d] for d in sleepers},
                "gaps": gaps,
                "status": outcome.status,
            }
        finally:
            hold.set()
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    threads = torch.get_num_threads()  # the in-process clients set this process's torch to one thread
    try:
        losses, seen = asyncio.run(drill())
    finally:
        torch.set_num_threads(threads)
    want = [r.loss for r in Trainer(train).run()]
    assert losses == pytest.approx(want, rel=1e-5), (losses, want)
    ids = seen["ids"]
    for name in ("d1", "d2"):  # standby received and shown (the plans left it out while GEMMs were out), then work
        slept = [i for i, line in enumerate(lines[name]) if line.startswith("standby") and "unplanned" in line]
        assert slept, lines[name]
        assert WorkerState.WORKING in states[name][slept[-1] + 1 :], states[name]
    assert seen["woken"] >= 2 and all(w is not None for w in seen["wake_s"].values()), seen
    assert all(t > 0 for t in seen["tiles"].values()), seen["tiles"]
    with sqlite3.connect(cfg.db) as db:
        rows = dict(db.execute("SELECT id, tiles_done FROM devices").fetchall())
        lost = db.execute("SELECT COUNT(*) FROM leases WHERE outcome IN ('lost', 'revoked')").fetchone()[0]
        reasons = [r for (r,) in db.execute("SELECT reason FROM devices")]
    for name in ("d1", "d2"):  # tiles verified after the wake
        assert rows[ids[name]] > seen["after_wake"][ids[name]], (rows, seen)
    assert lost == 0 and not any("heartbeat" in (r or "") or "come back" in (r or "") for r in reasons), reasons
    assert seen["status"]["standby"]["sent"] >= 2
