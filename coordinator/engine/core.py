"""The coordinator's brain, free of any network: messages and ``now`` in, messages out.

The websocket server (coordinator/net/server.py) decodes frames, calls these methods and sends what
they return, and calls ``tick(now)`` a few times a second; a simulator can drive the very same
object with a virtual clock. ``now`` is monotonic seconds; records in the store get
``now + epoch`` (wall-clock time), so a clock step never expires leases.

Flow of one GEMM: ``submit`` plans its tiles and queues them in the store; the dispatch
(engine/dispatch.py, the loop the simulator runs too) leases queued tiles to devices with free
slots (preferring tiles whose input blocks the device already holds) and emits ``Work`` messages
carrying only the blocks that device lacks; ``handle(Result)`` verifies the C block with
Freivalds' check before it is kept (or ``receive`` hands the check out to run on another thread
and ``settle`` takes its verdict); once every tile is verified the GEMM is assembled and
``on_done`` receives ``A @ B`` (or, with ``lazy``, a function that assembles it on the caller's
thread).

Devices are untrusted (see docs/security.md):

* who connects is decided by the ``Gate`` (join token to enrol, a challenge-response credential
  after that; banned, revoked and cooling-off identities are refused);
* how many tiles a device holds is decided here, from its verified record (``Standing``): one
  on probation, more as it returns verified work, back to one when a lease runs late;
* every lease has a deadline. Past it, a copy goes to a free device (even when every copy slot is
  taken: the late holder then loses the tile); past twice the deadline, the tile is taken back.
  Leases taken back in a row cut the device, and it may not return for a cool-off;
* rejected results ban an identity (the first one while on probation), and the ban is stored;
* every message kind a device can send is rate-limited, and what it may send next is capped in
  size (``Limit``): a device holding no tile may send only small frames.

Faults cost only outstanding tiles:

* a device that closes its socket, leaves, or stays silent past the heartbeat timeout loses
  its leases at once, and their tiles go straight to other devices;
* when the queue is empty, idle devices take speculative copies of the oldest outstanding
  tiles; the first verified result wins and the other copies are cancelled;
* a late result for a tile that is finished or no longer leased to its sender is ignored.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from cleave.coordinator.engine.admission import Admissions
from cleave.coordinator.engine.balance import Balancer
from cleave.coordinator.engine.books import Books
from cleave.coordinator.engine.checks import Checks
from cleave.coordinator.engine.conduct import Conduct
from cleave.coordinator.engine.devices import Departure, DeviceState
from cleave.coordinator.engine.dispatch import Dispatch
from cleave.coordinator.engine.energy import GRID_GCO2_KWH, EnergyBooks
from cleave.coordinator.engine.fleet import Fleet
from cleave.coordinator.engine.gemms import BandCheck, Check, Done
from cleave.coordinator.engine.giveback import GiveBacks
from cleave.coordinator.engine.identity import Gate
from cleave.coordinator.engine.intake import Intake
from cleave.coordinator.engine.leasing import Leasing
from cleave.coordinator.engine.limits import Limits, TrustPolicy
from cleave.coordinator.engine.live_plan import LivePlanner, Planner
from cleave.coordinator.engine.outbound import Close, Outbound, Send
from cleave.coordinator.engine.progress import Prediction, Progress
from cleave.coordinator.engine.relay_desk import RelayDesk
from cleave.coordinator.engine.relays import WAIT_SHARE, Relays
from cleave.coordinator.engine.scheduler import (
    FaultPolicy,
    Scheduler,
)
from cleave.coordinator.engine.standby import Sleepers, StandbyPolicy
from cleave.coordinator.engine.upkeep import Upkeep
from cleave.coordinator.planning.costmodel import Profile, PSProfile
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.db.store import CheckpointRow, DeviceStatus, Outcome, Store
from cleave.wire import auth
from cleave.wire.codes import CloseCode, Code, EnergySource, JobPhase
from cleave.wire.messages import (
    Challenge,
    Credit,
    Energy,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Leave,
    Message,
    Pause,
    RelayReport,
    Release,
    Result,
    Resume,
)
from cleave.wire.verify import Verdict

log = logging.getLogger(__name__)


class Core:
    """The engine: devices' messages and ``now`` in (``connect``, ``receive``/``settle``,
    ``tick``, ``disconnect``), GEMMs from the trainer in (``submit``, ``begin_step``), and the
    messages to send out (``Outbound``). See the module's docstring for the flow."""

    def __init__(
        self,
        store: Store,
        job_id: int,
        *,
        rng: np.random.Generator,
        join_token: str | None = None,
        operator_token: str | None = None,
        policy: TilingPolicy | None = None,
        faults: FaultPolicy | None = None,
        trust: TrustPolicy | None = None,
        limits: Limits | None = None,
        randbytes: auth.RandomBytes = secrets.token_bytes,
        epoch: float = 0.0,
        job_name: str = "",
        planner: Planner | LivePlanner = Planner.UNIFORM,
        ps: PSProfile | None = None,
        books: Books | None = None,
        grid_gco2_kwh: float = GRID_GCO2_KWH,
        band_checks: bool = True,
        standby: StandbyPolicy | None = None,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.books = books or Books(store, job_id)  # the job's own records (the tile path's are written here)
        self.rng = rng
        self.policy = policy or TilingPolicy()
        self.faults = faults or FaultPolicy()
        self.trust = trust or TrustPolicy()
        self.limits = limits or Limits()
        self.epoch = epoch  # store records get now + epoch: wall-clock time from a monotonic clock
        self.gate = Gate(store, self.trust, self.limits.enrolments.bucket(), randbytes)
        if join_token is not None or operator_token is not None:
            self.gate.set_tokens(join=join_token, operator=operator_token)
        self.job_name = job_name or f"job {job_id}"
        self.devices: dict[int, DeviceState] = {}
        # Devices the plans leave out sleep (engine/standby.py): who sleeps, whom to wake.
        self.standby = Sleepers(standby)
        self.energy = EnergyBooks(grid_gco2_kwh)  # devices' reports within their band, and our own meter
        self.admissions = Admissions(self)  # who is connected, by identity, and how a device comes in
        self.intake = Intake(self)  # the trainer's GEMMs: planned, queued, assembled
        self.gemms = self.intake.gemms  # the live ones, by id
        # How devices earn tiles and lose them, told to the scheduler (``sched``): which tile goes
        # to which device, and when.
        self.conduct = Conduct(Scheduler(self.faults), self.trust)
        # How each GEMM is cut and who takes which tile (a LivePlanner: tests force partitions).
        self.planner = (
            planner if isinstance(planner, LivePlanner) else LivePlanner(planner, ps or PSProfile(), self.policy)
        )
        self.fleet = Fleet(self.devices, self.standby, self.conduct)  # what the planner knows of them
        self.leasing = Leasing(self)  # the store's rows and the messages of the scheduler's decisions
        self._dispatch = Dispatch(self.conduct, self.leasing)  # the rules the simulator runs too
        self.checks = Checks(self, band_checks=band_checks)  # results' checks, verdicts and credit
        self.give_backs = GiveBacks(self)  # tiles a device's owner or the device itself hands back
        self.prediction = Prediction()
        self.upkeep = Upkeep(self)  # what time passing asks: silence, heartbeats, standby, stuck tiles
        self.progress = Progress(steps=store.job(job_id).steps)
        self.finished = False
        # Relays and the devices behind them (engine/relays.py).
        self.relays = Relays(self.faults.lease_floor * WAIT_SHARE)
        self.relay_desk = RelayDesk(self, self.relays)

    @property
    def sched(self) -> Scheduler:
        """The scheduler the engine and its rules drive (a test may wrap it to record calls)."""
        return self.conduct.sched

    @sched.setter
    def sched(self, sched: Scheduler) -> None:
        self.conduct.sched = sched

    def wall(self, now: float) -> float:
        """Wall-clock seconds for records, from monotonic ``now`` (a clock step never expires a lease)."""
        return now + self.epoch

    # ------------------------------------------------------------------ devices

    @property
    def active_devices(self) -> int:
        """Connected and not paused by their owners: the devices that can take work now."""
        return sum(1 for d in self.devices.values() if d.paused is None)

    def is_operator(self, token: str) -> bool:
        """Whether ``token`` is the operator's (observers, the devices table)."""
        return self.gate.is_operator(token)

    def connect(self, hello: Hello, nonce: str, now: float) -> tuple[int, list[Outbound]]:
        """Admit a device that answered ``nonce`` with ``hello``. Raises AuthError (the server
        closes with its code): wrong token or credential, banned, revoked, cooling off, in use.
        On a rank of a tier, a newcomer with the join token may instead be sent to a rank whose
        pool is weaker: ``Redirecting`` (engine/balance.py), before it enrols here. A peer whose
        hello names a relay URL enrols as a relay (``RelayDesk.connect``): it takes no tiles."""
        if hello.relay:
            return self.relay_desk.connect(hello, nonce, now)
        device_id, out = self.admissions.connect(hello, nonce, now)
        return device_id, out if self.finished else out + self._dispatch(now)

    def disconnect(
        self, device_id: int, now: float, reason: str = Departure.CLOSED, state: DeviceStatus | None = None
    ) -> list[Outbound]:
        """A device is gone: its outstanding tiles go straight back to the queue and to others.
        ``reason`` is recorded; it is a ``Departure`` or free text (a closed connection)."""
        if device_id in self.relay_desk:
            return self.relay_desk.forget(device_id, reason, now)
        if device_id not in self.devices:
            return []
        self._remove(device_id, now, reason, state)
        return self._dispatch(now)

    def _remove(self, device_id: int, now: float, reason: str, state: DeviceStatus | None = None) -> None:
        """Forget a device and end its leases. Never dispatches: only the public entry points
        (connect, handle, tick, submit, disconnect) do, once, at their end."""
        dev = self.devices.pop(device_id, None)
        if dev is None:
            return
        self.admissions.left(dev.identity)
        self.relays.leave(device_id)
        self.energy.left(device_id)
        self.standby.left(device_id)
        departure = Departure.of(reason)
        graceful = departure is not Departure.CLOSED  # leaving, or the coordinator stopping
        held = list(dev.inflight)
        if departure in (Departure.LEFT, Departure.CLOSED) and self.give_backs.held_long(dev, held, now):
            self.conduct.cut(dev, now)  # it is gone already: it just may not come back yet
        self.store.release_device(device_id, Outcome.RELEASED if graceful else Outcome.LOST, self.wall(now), reason)
        self.sched.leave(device_id)
        profile = self.fleet.left(device_id)
        for tile_id in held:
            self.leasing.sent.pop((tile_id, device_id), None)
        if held and not graceful:
            self.store.credit_device(device_id, lost=len(held), now=self.wall(now))
            if profile is not None:
                profile.failed(now)
        self.store.set_device_state(device_id, state or DeviceStatus.OFFLINE, self.wall(now), reason)

    def drop(
        self, dev: DeviceState, code: CloseCode, reason: str, now: float, state: DeviceStatus | None = None
    ) -> list[Outbound]:
        """Close a device and forget it (the caller dispatches its tiles to others)."""
        self._remove(dev.id, now, reason, state)
        return [Close(dev.id, code, reason)]

    # ------------------------------------------------------------------ messages

    def handle(self, device_id: int, msg: Message, now: float) -> list[Outbound]:
        """Act on one message from a device; a result, or a band of them, is verified here, on
        this thread."""
        got = self.receive(device_id, msg, now)
        if isinstance(got, Check):
            verdict, seconds = got.run(self.rng)
            got = self.settle(got, verdict, seconds, now)
        return got + self.checks.check_bands(now)

    def receive_all(self, device_id: int, msgs: Sequence[Message], now: float) -> tuple[list[Outbound], list[Check]]:
        """``receive`` for one frame's messages (a result batch's results) as one piece of
        bookkeeping: their store rows in one write group (``batch``), the slots the results
        taken for their bands free granted by one dispatch after the last. Returns what to send
        and the results to check alone (``settle`` each verdict). Stops at a message that
        dropped the device."""
        if len(msgs) == 1 and not isinstance(msgs[0], Result):  # a heartbeat writes nothing: no write group
            got = self.receive(device_id, msgs[0], now)
            return ([], [got]) if isinstance(got, Check) else (got, [])
        out: list[Outbound] = []
        checks: list[Check] = []
        taken = False
        with self.batch():
            for msg in msgs:
                got = self.receive(device_id, msg, now, dispatch=False)
                if isinstance(got, Check):
                    checks.append(got)
                else:
                    out.extend(got)
                    taken = taken or isinstance(msg, Result)
                if device_id not in self.devices and device_id not in self.relay_desk:
                    break
            if taken:
                out.extend(self._dispatch(now))
        return out, checks

    def receive(self, device_id: int, msg: Message, now: float, *, dispatch: bool = True) -> list[Outbound] | Check:
        """``handle``, except that a result to verify comes back as a ``Check``: the caller runs
        it (on another thread if it likes: see ``Check``) and passes its verdict to ``settle``.
        ``dispatch=False``: a result taken for its band does not dispatch (``receive_all``)."""
        if device_id in self.relay_desk:
            return self.relay_desk.message(device_id, msg, now)
        dev = self.devices.get(device_id)
        if dev is None:
            return []
        dev.last_seen = now
        if self.standby.heard(device_id, now) is not None:  # the answer to its wake: planned at its round trip again
            self.fleet.changed()
        # A result for a tile it holds was asked for: its lease paid for it (the coordinator
        # leases at most ``slots`` at once). Every other frame draws on the message allowance; a
        # fast honest device returns results far faster (the tiny model's, ~170 a second here).
        paid = isinstance(msg, Result) and msg.tile_id in dev.inflight and msg.tile_id not in dev.checking
        if not paid and not dev.messages.take(now):
            return self.drop(dev, CloseCode.RATE_LIMITED, "too many messages", now) + self._dispatch(now)
        if isinstance(msg, Result):
            return self.checks.receive(dev, msg, dispatch)
        if isinstance(msg, Heartbeat):
            return []
        if isinstance(msg, Release):
            if not dev.releases.take(now, max(1, len(msg.tile_ids))):
                return self.drop(dev, CloseCode.RATE_LIMITED, "too many tiles given back", now) + self._dispatch(now)
            return self.give_backs.release(dev, msg, now)
        if isinstance(msg, (Pause, Resume)):
            if not dev.pauses.take(now):
                return self.drop(dev, CloseCode.RATE_LIMITED, "pausing and resuming too often", now) + self._dispatch(
                    now
                )
            if isinstance(msg, Pause):
                return self.give_backs.pause(dev, msg.reason or "paused by its owner", now)
            dev.paused = None
            self.sched.update(dev.id, paused=self.standby.is_asleep(dev.id))  # its owner is back; it may still sleep
            self.fleet.changed()
            self.store.set_device_state(dev.id, DeviceStatus.ONLINE, self.wall(now))
            return self._dispatch(now)
        if isinstance(msg, Leave):
            return self.disconnect(device_id, now, Departure.LEFT)
        if isinstance(msg, RelayReport):
            return self.relay_desk.report(dev, msg, now) + self._dispatch(now)
        if isinstance(msg, Energy):
            return self._on_energy(dev, msg, now)
        return [
            self.send(
                device_id, Error(Code.UNEXPECTED, f"{type(msg).__name__} is not a message a device may send"), now
            )
        ]

    def _on_energy(self, dev: DeviceState, msg: Energy, now: float) -> list[Outbound]:
        """A device's energy since its last report: booked within its band (engine/energy.py):
        the seconds it held work and the rate it delivered in them (measured here), and the GEMM
        seconds its results stated (its word: they lift its ceiling only). A claim outside it is
        capped and flagged, never credited as measured."""
        held = dev.seat.held(now)
        try:
            claim = self.energy.report(dev.id, dev.name, msg, dev.gflop_verified, held, dev.compute_seconds)
        except ValueError as exc:
            return [self.send(dev.id, Error(Code.UNEXPECTED, str(exc)), now)]
        self.store.credit_device(dev.id, now=self.wall(now), **claim.credit())
        return []

    def on_wire(self, device_id: int, tile_id: int, now: float) -> None:
        """The server started writing ``tile_id``'s work frame to the device's socket."""
        self.leasing.on_wire(device_id, tile_id, now)

    # ------------------------------------------------------------------ standby

    def tick(self, now: float) -> list[Outbound]:
        """Time passes: drop silent devices, take back late tiles, copy them, keep heartbeats
        (``Upkeep.tick``: a slice of the devices a tick, so its cost does not grow with the fleet)."""
        return self.upkeep.tick(now)

    def credit(self, dev: DeviceState, now: float) -> Send:
        """Tell a device its verified GFLOP, in this job and in all (never its claims)."""
        dev.credit_sent, dev.credit_at = dev.gflop_verified, now
        total = self.store.identity_total(dev.identity)[0]
        return self.send(dev.id, Credit(round(dev.gflop_verified, 6), round(total, 6)), now)

    def send(self, device_id: int, message: Message, now: float) -> Send:
        """A message to a device (its last-sent time keeps heartbeats away)."""
        dev = self.devices.get(device_id)
        if dev is not None:
            dev.last_sent = now
        return Send(device_id, message)

    def lost_tile(self, dev: DeviceState, now: float) -> None:
        """A lease of ``dev`` ended without its result: it may still send one for a while."""
        dev.big_until = now + self.limits.result_grace

    def dispatch(self, now: float) -> list[Outbound]:
        """What the scheduler decides now (after ``settle(..., dispatch=False)``), done."""
        return self._dispatch(now)

    def cut(self, dev: DeviceState, why: str, now: float, *, on_relay: bool = False) -> list[Outbound]:
        """Disconnect a device that holds tiles without returning them (``Dispatch.cut``)."""
        return self._dispatch.cut(dev, why, now, on_relay=on_relay)

    def settle(
        self, check: Check, verdict: Verdict | None, seconds: float, now: float, *, dispatch: bool = True
    ) -> list[Outbound]:
        """Act on a result's verdict (``Checks.settle``); ``dispatch=False``: the caller
        dispatches once after a batch."""
        return self.checks.settle(check, verdict, seconds, now, dispatch=dispatch)

    def settle_band(
        self, check: BandCheck, passed: bool, verdicts: Sequence[Verdict], seconds: float, now: float
    ) -> list[Outbound]:
        """Act on a band's check (``Checks.settle_band``); the caller dispatches after."""
        return self.checks.settle_band(check, passed, verdicts, seconds, now)

    def take_band_checks(self) -> list[BandCheck]:
        """The bands due for their check, each handed out once (``Checks.take_band_checks``)."""
        return self.checks.take_band_checks()

    def batch(self) -> AbstractContextManager[None]:
        """Settle and dispatch a verifier batch as one piece of bookkeeping (``Checks.batch``)."""
        return self.checks.batch()

    def live(self, identity: int) -> DeviceState | None:
        """The identity's connected device, if any."""
        device_id = self.admissions.live(identity)
        return None if device_id is None else self.devices.get(device_id)

    def submit(
        self, a: torch.Tensor, b: torch.Tensor, kind: GemmKind, now: float, on_done: Done, **options: Any
    ) -> tuple[int, list[Outbound]]:
        """The trainer's way in: queue ``a @ b`` as tiles, ``on_done(result)`` once every tile is
        verified (``Intake.submit`` says what the options mean)."""
        return self.intake.submit(a, b, kind, now, on_done, **options)

    def plan_lanes(self, lanes: int) -> None:
        """The trainer runs this many micro-batches at once: each GEMM is planned on one of as
        many lanes of the fleet (``LivePlanner``), as the simulator plans them."""
        self.planner = self.planner.with_lanes(lanes)

    def begin_step(self, step: int, now: float | None = None) -> None:
        """A training step starts: blocks still kept from the last one will not be read again."""
        if now is not None:
            self.prediction.step_done(now)
        self.progress.current = step
        self.intake.begin_step()
        self.relays.new_step()

    # ------------------------------------------------------------------ GEMMs

    def join_tier(self, balancer: Balancer, *, redirect: bool = True) -> None:
        """This coordinator is a rank of a tier (``Admissions.join_tier``)."""
        self.admissions.join_tier(balancer, redirect=redirect)

    def redirect_ignored(self, rank: int) -> None:
        """A newcomer sent to ``rank`` ignored its redirect (``Balancer.ignored_by``)."""
        self.admissions.ignored_by(rank)

    def pool(self) -> tuple[int, float]:
        """The devices that may take work now and their GFLOP/s as the tier balances them (``Fleet.pool``)."""
        return self.fleet.pool()

    def fleet_profiles(self, dtype: str | None = None) -> dict[int, Profile]:
        """What the cost model knows of each device that may take work now (``Fleet.current``)."""
        return self.fleet.current(dtype)

    @property
    def dtype(self) -> str:
        """The job's GEMMs' dtype (fp32 until the first comes): devices are planned in it."""
        return self.fleet.dtype

    # ------------------------------------------------------------------ the server's and the job's views

    def challenge(self) -> Challenge:
        """A connection's first frame: a fresh nonce and this coordinator's id."""
        return self.gate.challenge()

    def start_tokens(self, join: str | None, operator: str | None) -> tuple[str | None, str | None, tuple[str, ...]]:
        """The tokens of this start: as given, else the stored ones, else new (``Gate.start_tokens``)."""
        return self.gate.start_tokens(join, operator)

    def connected(self, peer_id: int) -> bool:
        """Whether a device or a relay of that id is connected (not dropped by the engine)."""
        return peer_id in self.devices or peer_id in self.relay_desk

    def batch_of(self, device_id: int) -> int:
        """How many tiles the device takes in one frame (1 if it is gone)."""
        dev = self.devices.get(device_id)
        return 1 if dev is None else dev.batch

    def abandon(self, check: Check) -> None:
        """A result handed out for its check will not be settled (the job is over)."""
        check.dev.checking.discard(check.msg.tile_id)

    def child_rng(self) -> np.random.Generator:
        """A generator seeded from the engine's own: a seeded engine's helpers stay reproducible."""
        return np.random.default_rng(self.rng.integers(0, 2**63, size=4))

    def relay_bytes(self) -> tuple[int, int]:
        """Bytes devices were told to fetch from relays, and bytes relays took from here."""
        return self.relays.bytes_named, self.relays.bytes_served

    def forecast_inputs(self, dtype: str) -> tuple[PSProfile, Planner, TilingPolicy, dict[int, Profile]]:
        """What the cost model's step forecast needs: the coordinator's profile, the planner,
        the tiling policy and the fleet that may take work now, in ``dtype``."""
        planner = self.planner
        return planner.ps, planner.planner, planner.policy, self.fleet.current(dtype)

    def step_figures(self) -> dict[str, Any]:
        """The engine's part of a finished step's row: devices, relays' bytes, the cost model's
        step and the home step, and the most GEMMs out at once (all, and those waited on)."""
        predicted, home = self.prediction.current(), self.prediction.current_home()
        named, served = self.relay_bytes()
        return {
            "devices": len(self.devices),
            "mb_relay_out": round(named / 1e6, 3),
            "mb_to_relays": round(served / 1e6, 3),  # of mb_ps_out
            "predicted_s": None if predicted is None else round(predicted, 4),
            # The cost model's step had the coordinator kept every GEMM (the plan never loses to it).
            "home_s": None if home is None or not math.isfinite(home) else round(home, 4),
            # The step's most shipped GEMMs out at once, and of them waited on by the trainer.
            "gemms_in_flight_max": self.intake.peak_in_flight,
            "waited_gemms_max": self.intake.peak_waited,
        }

    def close_energy_step(self, joules: float, source: EnergySource, gpu_joules: float = 0.0) -> dict[str, object]:
        """The coordinator's own energy over the step, booked; the step's energy row (engine/energy.py)."""
        self.energy.own(joules, source, gpu_joules)
        return self.energy.close_step(self.checks.gflop_verified).as_row()

    def evaluated(self, step: int, val_loss: float) -> None:
        """A held-out loss at ``step`` (a resumed job's, from its books)."""
        self.progress.evaluated(step, val_loss)

    def phase(self) -> tuple[int, JobPhase]:
        """The job's step and phase."""
        return self.progress.step, self.progress.state

    # ------------------------------------------------------------------ job

    def resume_from(self, step: int) -> None:
        """The job goes on after its checkpoint of ``step``."""
        self.progress.step = step

    def waiting(self) -> None:
        """The coordinator listens and waits for its first devices."""
        self.progress.state = JobPhase.WAITING

    def start_training(self, now: float) -> None:
        """Training starts: tokens per second count from here (waiting for devices is not training)."""
        self.progress.state = JobPhase.TRAINING
        self.progress.since = now
        self.progress.first = self.progress.step

    def shared(self, gemm_share: dict[str, Any]) -> None:
        """The share of the model's GEMM FLOPs that devices get, once counted on the model."""
        self.progress.gemm_share = gemm_share

    def record_step(
        self, step: int, loss: float, tokens: int, seconds: float, extra: dict[str, Any], now: float
    ) -> None:
        """A training step finished: its row in the books and the job's progress."""
        self.books.record_step(step, loss, tokens, seconds, self.wall(now), extra)
        p = self.progress
        p.tokens += tokens
        elapsed = now - p.since if p.since is not None else 0.0
        p.loss = loss if math.isfinite(loss) else None
        p.step = step
        p.tokens_per_s = p.tokens / elapsed if elapsed > 0 else 0.0
        if "val_loss" in extra:  # a step that evaluated the held-out split (--eval-every)
            p.evaluated(step, extra["val_loss"])

    def checkpointed(self, row: CheckpointRow) -> list[CheckpointRow]:
        """A checkpoint was written: recorded; returns the job's checkpoints, newest first."""
        return self.books.checkpointed(row)

    def finish(self, now: float, reason: str = "job complete") -> list[Outbound]:
        """The job is over: it is finished in the books, and every device is told (the server
        then closes their sockets)."""
        self.books.finished(self.wall(now))
        self.finished = True
        self.progress.state = JobPhase.FINISHED
        self.progress.ended = now
        out: list[Outbound] = []
        for dev in list(self.devices.values()):
            out.append(self.credit(dev, now))  # the final tally, before goodbye
            out.append(self.send(dev.id, Finished(reason), now))
        return out
