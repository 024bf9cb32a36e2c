"""The coordinator's brain, free of any network: messages and ``now`` in, messages out.

The websocket server (coordinator/net/server.py) decodes frames, calls these methods and sends what
they return, and calls ``tick(now)`` a few times a second; a simulator can drive the very same
object with a virtual clock. ``now`` is monotonic seconds; records in the store get
``now + epoch`` (wall-clock time), so a clock step never expires leases.

Flow of one GEMM: ``submit`` plans its tiles and queues them in the store; ``_dispatch`` leases
queued tiles to devices with free slots (preferring tiles whose input blocks the device already
holds) and emits ``Work`` messages carrying only the blocks that device lacks; ``handle(Result)``
verifies the C block with Freivalds' check before it is kept (or ``receive`` hands the check out
to run on another thread and ``settle`` takes its verdict); once every tile is verified the
GEMM is assembled and ``on_done`` receives ``A @ B`` (or, with ``lazy``, a function that
assembles it on the caller's thread).

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

import dataclasses
import functools
import logging
import math
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from cleave.coordinator.engine.balance import UNMEASURED_GFLOPS, Balancer, Redirecting
from cleave.coordinator.engine.blocks import BlockRef, Sources, block_ref
from cleave.coordinator.engine.books import Books
from cleave.coordinator.engine.conduct import Conduct, Pace, Standing
from cleave.coordinator.engine.devices import DeviceState
from cleave.coordinator.engine.energy import GRID_GCO2_KWH, EnergyBooks
from cleave.coordinator.engine.gemms import BandCheck, Check, GemmState, Product, check_finite
from cleave.coordinator.engine.identity import Admission, Gate
from cleave.coordinator.engine.limits import Limits, TrustPolicy
from cleave.coordinator.engine.live_plan import DTYPE_NAMES, LivePlan, LivePlanner, Planner, fleet_key
from cleave.coordinator.engine.outbound import Abort, Close, Limit, Outbound, Send
from cleave.coordinator.engine.profiles import PRIOR_MEMORY, DeviceProfile
from cleave.coordinator.engine.progress import Prediction, Progress
from cleave.coordinator.engine.relays import WAIT_SHARE, Relays, RelayState, relay_url_ok
from cleave.coordinator.engine.scheduler import (
    Assign,
    Decision,
    FaultPolicy,
    Overdue,
    Reclaim,
    Scheduler,
    UnitSpec,
)
from cleave.coordinator.engine.standby import Sleepers, StandbyPolicy
from cleave.coordinator.planning.costmodel import Profile, PSProfile, local_seconds
from cleave.coordinator.planning.tiles import (
    GemmKind,
    TilingPolicy,
    a_block,
    assemble,
    b_block,
    piece_tiles,
)
from cleave.db.store import CheckpointRow, DeviceInfo, DeviceStatus, IdentityState, NewTile, Outcome, Store
from cleave.wire import auth
from cleave.wire.codes import CloseCode, Code, JobPhase, Name, ReleaseWhy, StandbyWhy
from cleave.wire.errors import AuthError
from cleave.wire.messages import (
    MAX_SLOTS,
    Block,
    BlockRequest,
    Cancel,
    Credential,
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
    Standby,
    UseRelay,
    Wake,
    Welcome,
    Work,
)
from cleave.wire.verify import Product as VerifyProduct
from cleave.wire.verify import Verdict, structure

log = logging.getLogger(__name__)

# Results a device may have taken for their bands, unchecked, per slot it holds: beyond that its
# results are checked alone as they come. What a trusted forger can make the coordinator
# recompute before its ban (docs/security.md, "Checks by band"); a device reaches it only when
# bands are long against the fleet (bench_tax: 6 devices of 2 slots answer 5-6 tiles of a
# 32-tile band each).
UNCHECKED_PER_SLOT = 8

TICK = 0.05  # seconds between the driver's calls to tick (the server's; the simulator's too)
CREDIT_INTERVAL = 1.0  # seconds between Credit messages to a device whose verified total grew
STANDING_CHECK = 1.0  # seconds between looks for an operator's revocations and token rotations
STUCK_GRACE = 60.0  # seconds a tile failed everywhere twice waits for a new device before the job stops
SWEEP = 0.5  # seconds in which tick looks after every device once (heartbeats, silence, credit)
WAIT_SLACK = 0.005  # seconds a tile may wait on a device with nothing before it (its event loop)
WAKE_SCAN = 64  # sleeping devices woken in one tick for tiles no awake device may take (Scheduler.scan's bound)


class Departure(Name):
    """How a device's session ended, as far as the rules care: leaving and a coordinator that
    stops are nobody's fault; anything else (a closed connection, a cut) costs the device the
    tiles it held. A reason that is none of these values reads as ``CLOSED``."""

    LEFT = "left"  # it said leave
    SHUTDOWN = "coordinator stopped"  # the coordinator is going
    FINISHED = "job finished"  # the job is over: every device is sent away
    CLOSED = "connection closed"  # its connection closed or was cut (the reason given says why)

    @classmethod
    def of(cls, reason: str) -> Departure:
        """The departure a reason stands for (free text: ``CLOSED``)."""
        try:
            return cls(reason)
        except ValueError:
            return cls.CLOSED


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
        # Results of a GEMM cut into row bands are checked a band at a time (``BandCheck``):
        # one pass over A and B per GEMM, not per tile. False: every result alone, as it comes.
        self.band_checks = band_checks
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
        self.gflop_verified = 0.0  # every device's, in this process
        self._by_identity: dict[int, int] = {}  # identity -> device id, while connected
        self.gemms: dict[int, GemmState] = {}
        self.sources = Sources()
        self._tile_gemm: dict[int, int] = {}  # tile id -> gemm id, for tiles of live GEMMs
        # How devices earn tiles and lose them, told to the scheduler (``sched``): which tile goes
        # to which device, and when.
        self.conduct = Conduct(Scheduler(self.faults), self.trust)
        # How each GEMM is cut and who takes which tile (a LivePlanner: tests force partitions).
        self.planner = (
            planner if isinstance(planner, LivePlanner) else LivePlanner(planner, ps or PSProfile(), self.policy)
        )
        self.profiles: dict[int, DeviceProfile] = {}  # connected devices, measured live
        # (tile, device) -> [bytes of blocks its work carried, when the frame went on the wire]
        self._sent: dict[tuple[int, int], list] = {}
        self.dtype = "fp32"  # of the job's GEMMs: the dtype devices are measured and planned in
        self._credits: dict[int, tuple[int, float, float]] | None = None  # in batch(): device -> (tiles, GFLOP, when)
        self.prediction = Prediction()
        self._fleet_version = 0  # moves when the planner's view of the fleet may have changed
        self._fleet_keys: dict[int, tuple[float, ...]] = {}  # each device's place on the planner's grid
        self._measured: set[int] = set()  # devices with observations since the last plan
        self._profiled: dict[int, Profile] = {}  # each device's profile in self.dtype, as of its last observation
        self._dispatching = False
        self._sweep: list[int] = []  # devices still to look after in this tick round
        self._sweep_at = 0.0
        self._sweep_len = 0
        self._checked_at = -float("inf")
        self._reopened: set[int] = set()  # tiles re-opened once after every device failed them
        self._stuck_since: dict[int, float] = {}  # re-opened tiles failed everywhere again: since when
        self._aborted = False  # an Abort went out
        self.progress = Progress(steps=store.job(job_id).steps)
        # This step's most shipped GEMMs out at once, and of them the most the trainer waited on
        # (not deferred): above 1 only when micro-batches run at once (Trainer.parts_at_once).
        self.peak_in_flight = 0
        self.peak_waited = 0
        self.finished = False
        # A rank of a tier: where newcomers go (engine/balance.py; set with ``join_tier``).
        self.balancer: Balancer | None = None
        # Relays and the devices behind them (engine/relays.py).
        self.relays = Relays(self.faults.lease_floor * WAIT_SHARE)
        self._relay_by_identity: dict[int, int] = {}
        self.verify_seconds = 0.0
        self._bands_due: list[BandCheck] = []  # bands with every result in, for the verifier
        self.band_failures = 0  # bands whose check failed: their results were checked one by one
        # Largest residual/tolerance accepted, per GEMM kind: how close honest work comes to a reject.
        self.verify_worst_honest: dict[str, float] = {}

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
        hello names a relay URL enrols as a relay (``_connect_relay``): it takes no tiles."""
        if hello.relay:
            return self._connect_relay(hello, nonce, now)
        if self.balancer is not None and not hello.identity and not hello.ticket and not self.finished:
            self.gate.check_join(hello.token)
            rate = DeviceProfile(hello.gflops, PRIOR_MEMORY).profile(self.dtype).flops_per_s(self.dtype) / 1e9
            redirect = self.balancer.place(self.pool()[1], rate, self.wall(now))
            if redirect is not None:
                self.gate.take_enrolment(now)  # a ticket is an enrolment elsewhere: the same rate
                raise Redirecting(redirect)
        admission: Admission = self.gate.admit(hello, nonce, now, self.wall(now))
        # Not a connected relay's identity either: one (job, identity) is one devices row, and a
        # device sharing the relay's would have its leases ended when the relay goes.
        standing = self._reconnecting(admission.identity, now)
        info = DeviceInfo(
            name=admission.name,
            platform=hello.platform,
            cores=max(1, hello.cores),
            memory_bytes=hello.memory_bytes,
            device=hello.device,
            gflops=hello.gflops,
        )
        device_id = self.store.add_device(self.job_id, info, self.wall(now), admission.identity)
        asked = min(hello.slots, self.trust.max_slots)
        pace = Pace.unproven(hello.gflops)  # its claim sets its first deadlines, nothing more
        lim = self.limits
        measured = DeviceProfile(hello.gflops, hello.block_budget or PRIOR_MEMORY)
        links = measured.profile(self.dtype)  # the link fit's priors until it returns work
        seat = self.conduct.seat(
            device_id,
            standing,
            pace,
            asked,
            paused=bool(hello.paused),
            down_rate=links.down,
            up_rate=links.up,
            batch=min(hello.batch, asked),
        )
        dev = DeviceState(
            device_id,
            admission.identity,
            admission.name,
            asked,
            seat,
            standing,
            pace,
            hello.device,
            now,
            lim.messages.bucket(),
            standing.budgets[0],
            standing.budgets[1],
            lim.pauses.bucket(),
            lim.idle_frame,
            budget=hello.block_budget,
            batch=min(hello.batch, asked),
        )
        self.devices[device_id] = dev
        self.standby.joined(device_id, now)
        self.energy.joined(device_id, hello.device, dev.gflop_verified)
        self._by_identity[admission.identity] = device_id
        self.profiles[device_id] = measured
        self._fleet_changed()
        if hello.paused:  # its owner is busy: it gets nothing until it resumes
            dev.paused = hello.paused
            self.store.set_device_state(device_id, DeviceStatus.PAUSED, self.wall(now), hello.paused)
        out: list[Outbound] = [Limit(device_id, lim.idle_frame)]
        if admission.secret is not None:
            out.append(self._send(device_id, Credential(admission.identity, admission.secret.hex()), now))
        out.append(
            self._send(
                device_id, Welcome(device_id, admission.identity, self.job_name, dev.slots, self.faults.heartbeat), now
            )
        )
        if self.finished:
            out.append(self._send(device_id, Finished(), now))
            return device_id, out
        use = self.relays.place(device_id, links.down, now)  # a relay with room serves its blocks
        if use is not None:
            out.append(self._send(device_id, use, now))
        return device_id, out + self._dispatch(now)

    def _reconnecting(self, identity: int, now: float) -> Standing:
        """An admitted identity connects (a device or a relay): one connection per identity,
        after its cool-off, within its reconnect budget; returns its standing."""
        if identity in self._by_identity or identity in self._relay_by_identity:
            raise AuthError(CloseCode.IN_USE, "this identity is already connected")
        self.gate.check_cooloff(identity, now)
        standing = self.gate.standing(identity)
        if standing.budgets is None:  # kept with the identity: reconnecting does not refill them
            standing.budgets = (
                self.limits.releases.bucket(),
                self.limits.resends.bucket(),
                self.trust.reconnects.bucket(),
            )
        if not standing.budgets[2].take(now):
            raise AuthError(CloseCode.RATE_LIMITED, "reconnecting too often; try again in a while")
        return standing

    def _connect_relay(self, hello: Hello, nonce: str, now: float) -> tuple[int, list[Outbound]]:
        """Admit a relay (``cleave relay``): its identity as a device's, a row of its own (its
        ``device`` is "relay"), no tiles; the devices without one go behind it."""
        if not relay_url_ok(hello.relay):
            raise AuthError(
                CloseCode.PROTOCOL,
                "hello.relay must be the ws:// or wss:// URL devices reach the relay at (a host, a port, no more)",
            )
        admission: Admission = self.gate.admit(hello, nonce, now, self.wall(now))
        # A relay reconnects within the same budget and cool-off as a device: each connection
        # moves devices behind it, and each drop excuses what they held.
        self._reconnecting(admission.identity, now)
        key = self.store.identity_key(admission.identity)
        if key is None:  # pragma: no cover - admitted identities have a key
            raise AuthError(CloseCode.AUTH, "unknown identity")
        info = DeviceInfo(admission.name, hello.platform, max(1, hello.cores), hello.memory_bytes, "relay", 0.0)
        relay_id = self.store.add_device(self.job_id, info, self.wall(now), admission.identity)
        bucket = self.limits.messages.bucket()
        self.relays.add(RelayState(relay_id, admission.identity, admission.name, hello.relay, key, bucket))
        self.planner.use_relays(len(self.relays))  # the cost model prices blocks through it
        self._relay_by_identity[admission.identity] = relay_id
        out: list[Outbound] = [Limit(relay_id, self.limits.idle_frame)]
        if admission.secret is not None:
            out.append(Send(relay_id, Credential(admission.identity, admission.secret.hex())))
        out.append(Send(relay_id, Welcome(relay_id, admission.identity, self.job_name, 1, self.faults.heartbeat)))
        for device_id in sorted(self.devices):
            profile = self._profiled.get(device_id) or self.profiles[device_id].profile(self.dtype)
            use = self.relays.place(device_id, profile.down, now)
            if use is not None:
                out.append(self._send(device_id, use, now))
        return relay_id, out

    def _relay_message(self, relay_id: int, msg: Message, now: float) -> list[Outbound]:
        """A relay asks for blocks (or beats, or leaves); anything else is refused."""
        if not self.relays.relays[relay_id].messages.take(now):
            return self._drop_relay(relay_id, CloseCode.RATE_LIMITED, "too many messages", now)
        if isinstance(msg, BlockRequest):
            return [Send(relay_id, self.relays.serve(relay_id, msg.digests))]
        if isinstance(msg, Heartbeat):
            return []
        if isinstance(msg, Leave):
            return self.disconnect(relay_id, now, Departure.LEFT)
        return [Send(relay_id, Error(Code.UNEXPECTED, f"{type(msg).__name__} is not a message a relay may send"))]

    def _drop_relay(self, relay_id: int, code: CloseCode, reason: str, now: float) -> list[Outbound]:
        """Close a relay; its devices take their blocks from the coordinator from now on."""
        out = self._forget_relay(relay_id, reason, now)
        return [*out, Close(relay_id, code, reason)]

    def _forget_relay(self, relay_id: int, reason: str, now: float) -> list[Outbound]:
        relay = self.relays.relays.get(relay_id)
        if relay is None:
            return []
        devices = self.relays.remove(relay_id)
        for d in devices:  # their fetches from it fail now: what they give back is not their stall
            if d in self.devices:
                self.devices[d].excused = self.devices[d].relayed & set(self.devices[d].inflight)
        self.planner.use_relays(len(self.relays))
        self._relay_by_identity.pop(relay.identity, None)
        self.store.release_device(relay_id, Outcome.RELEASED, self.wall(now), reason)
        return [self._send(d, UseRelay(0), now) for d in devices if d in self.devices]

    def _on_relay_report(self, dev: DeviceState, msg: RelayReport, now: float) -> list[Outbound]:
        """A device says its relay failed it: it takes its blocks from here from now on; a relay
        proven to have served other bytes is banned (engine/relays.py)."""
        trusted = not dev.standing.on_probation(self.trust)  # only earned trust cools a relay (engine/relays.py)
        verdict = self.relays.report(dev.id, msg.relay, msg.fault, msg.digest, msg.tag, msg.got, now, trusted=trusted)
        if verdict is None:
            return []
        log.warning("device %d reported relay %d: %s", dev.id, msg.relay, verdict.why)
        dev.excused = dev.relayed & set(dev.inflight)  # it waited on the relay for these: giving them back is no stall
        out: list[Outbound] = [self._send(dev.id, UseRelay(0), now)]
        if verdict.banned:
            relay = self.relays.relays[msg.relay]
            self.gate.ban(relay.identity, f"relay: {verdict.why}", self.wall(now))
            out += self._drop_relay(msg.relay, CloseCode.BANNED, f"banned: {verdict.why}", now)
        elif verdict.dropped:
            out += self._drop_relay(msg.relay, CloseCode.GOING_AWAY, f"dropped: {verdict.why}", now)
        return out

    def disconnect(
        self, device_id: int, now: float, reason: str = Departure.CLOSED, state: DeviceStatus | None = None
    ) -> list[Outbound]:
        """A device is gone: its outstanding tiles go straight back to the queue and to others.
        ``reason`` is recorded; it is a ``Departure`` or free text (a closed connection)."""
        if device_id in self.relays.relays:
            return self._forget_relay(device_id, reason, now)
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
        self._by_identity.pop(dev.identity, None)
        self.relays.leave(device_id)
        self.energy.left(device_id)
        self.standby.left(device_id)
        departure = Departure.of(reason)
        graceful = departure is not Departure.CLOSED  # leaving, or the coordinator stopping
        held = list(dev.inflight)
        if departure in (Departure.LEFT, Departure.CLOSED) and self._held_long(dev, held, now):
            self.conduct.cut(dev, now)  # it is gone already: it just may not come back yet
        self.store.release_device(device_id, Outcome.RELEASED if graceful else Outcome.LOST, self.wall(now), reason)
        self.sched.leave(device_id)
        profile = self.profiles.pop(device_id, None)
        self._fleet_keys.pop(device_id, None)
        self._profiled.pop(device_id, None)
        self._fleet_changed()
        for tile_id in held:
            self._sent.pop((tile_id, device_id), None)
        if held and not graceful:
            self.store.credit_device(device_id, lost=len(held), now=self.wall(now))
            if profile is not None:
                profile.failed(now)
        self.store.set_device_state(device_id, state or DeviceStatus.OFFLINE, self.wall(now), reason)

    def _drop(
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
        return got + self.check_bands(now)

    def check_bands(self, now: float) -> list[Outbound]:
        """Check the bands whose results are all in, here, on this thread (``handle``; the
        server runs them on its verifier instead: ``take_band_checks``, ``settle_band``)."""
        out: list[Outbound] = []
        settled = False
        while self._bands_due:
            for band in self.take_band_checks():
                passed, verdicts, seconds = band.run(self.rng)
                out.extend(self.settle_band(band, passed, verdicts, seconds, now))
                settled = True
        return out + self._dispatch(now) if settled else out

    def take_band_checks(self) -> list[BandCheck]:
        """The bands due for their check (each handed out once): the caller runs them (on
        another thread if it likes) and passes each outcome to ``settle_band``."""
        due, self._bands_due = self._bands_due, []
        return due

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
                if device_id not in self.devices and device_id not in self.relays.relays:
                    break
            if taken:
                out.extend(self._dispatch(now))
        return out, checks

    def receive(self, device_id: int, msg: Message, now: float, *, dispatch: bool = True) -> list[Outbound] | Check:
        """``handle``, except that a result to verify comes back as a ``Check``: the caller runs
        it (on another thread if it likes: see ``Check``) and passes its verdict to ``settle``.
        ``dispatch=False``: a result taken for its band does not dispatch (``receive_all``)."""
        if device_id in self.relays.relays:
            return self._relay_message(device_id, msg, now)
        dev = self.devices.get(device_id)
        if dev is None:
            return []
        dev.last_seen = now
        if self.standby.heard(device_id, now) is not None:  # the answer to its wake: planned at its round trip again
            self._fleet_changed()
        # A result for a tile it holds was asked for: its lease paid for it (the coordinator
        # leases at most ``slots`` at once). Every other frame draws on the message allowance; a
        # fast honest device returns results far faster (the tiny model's, ~170 a second here).
        paid = isinstance(msg, Result) and msg.tile_id in dev.inflight and msg.tile_id not in dev.checking
        if not paid and not dev.messages.take(now):
            return self._drop(dev, CloseCode.RATE_LIMITED, "too many messages", now) + self._dispatch(now)
        if isinstance(msg, Result):
            return self._check_of(dev, msg, dispatch)
        if isinstance(msg, Heartbeat):
            return []
        if isinstance(msg, Release):
            if not dev.releases.take(now, max(1, len(msg.tile_ids))):
                return self._drop(dev, CloseCode.RATE_LIMITED, "too many tiles given back", now) + self._dispatch(now)
            return self._on_release(dev, msg, now)
        if isinstance(msg, (Pause, Resume)):
            if not dev.pauses.take(now):
                return self._drop(dev, CloseCode.RATE_LIMITED, "pausing and resuming too often", now) + self._dispatch(
                    now
                )
            if isinstance(msg, Pause):
                return self._on_pause(dev, msg.reason or "paused by its owner", now)
            dev.paused = None
            self.sched.update(dev.id, paused=self.standby.is_asleep(dev.id))  # its owner is back; it may still sleep
            self._fleet_changed()
            self.store.set_device_state(dev.id, DeviceStatus.ONLINE, self.wall(now))
            return self._dispatch(now)
        if isinstance(msg, Leave):
            return self.disconnect(device_id, now, Departure.LEFT)
        if isinstance(msg, RelayReport):
            return self._on_relay_report(dev, msg, now) + self._dispatch(now)
        if isinstance(msg, Energy):
            return self._on_energy(dev, msg, now)
        return [
            self._send(
                device_id, Error(Code.UNEXPECTED, f"{type(msg).__name__} is not a message a device may send"), now
            )
        ]

    def _on_energy(self, dev: DeviceState, msg: Energy, now: float) -> list[Outbound]:
        """A device's energy since its last report: booked within its band (engine/energy.py);
        a claim outside it is capped and flagged, never credited as measured."""
        try:
            # Its band: the seconds it held work and the rate it delivered in them (measured here),
            # and the GEMM seconds its results stated (its word: they lift its ceiling only).
            claim = self.energy.claim(dev.id, msg, dev.gflop_verified, dev.seat.held(now), dev.compute_seconds)
        except ValueError as exc:
            return [self._send(dev.id, Error(Code.UNEXPECTED, str(exc)), now)]
        metered = self.energy.devices[dev.id]
        if claim.flagged and metered.flagged in (1, 10, 100, 1000):  # said, not repeated per report
            log.warning(
                "device %d (%s): energy claim capped (%d so far): %s", dev.id, dev.name, metered.flagged, claim.flagged
            )
        self.store.credit_device(
            dev.id,
            joules=sum(claim.booked.values()),
            energy_flagged=int(bool(claim.flagged)),
            gflop_metered=claim.gflop,
            now=self.wall(now),
        )
        return []

    def on_wire(self, device_id: int, tile_id: int, now: float) -> None:
        """The server started writing ``tile_id``'s work frame to the device's socket."""
        entry = self._sent.get((tile_id, device_id))
        if entry is not None and entry[1] is None:
            entry[1] = now

    def tick(self, now: float) -> list[Outbound]:
        """Time passes: drop silent devices, take back late tiles, copy them, keep heartbeats.

        Each tick looks after a slice of the devices (every device once per ``SWEEP`` seconds at
        the server's 50 ms ticks), so its cost does not grow with the fleet."""
        out: list[Outbound] = []
        if now - self._checked_at >= STANDING_CHECK:
            self._checked_at = now
            out.extend(self._check_standings(now))
            out.extend(self._unstick(now))
        if not self._sweep:
            self._sweep = list(self.devices)
            self._sweep_at, self._sweep_len = now, len(self._sweep)
        # Enough of this round's devices to finish it SWEEP seconds after it began.
        share = max(1, math.ceil(self._sweep_len * min(1.0, (now - self._sweep_at + TICK) / SWEEP)))
        due = self._sweep_len - len(self._sweep)
        for _ in range(max(0, share - due)):
            dev = self.devices.get(self._sweep.pop()) if self._sweep else None
            if dev is None:
                continue
            # A sleeping device beats once a keep-alive: silent for a few of them, it is gone;
            # silent for less, it is sleeping, never at fault (engine/standby.py).
            if now - dev.last_seen > self.standby.silence(dev.id, self.faults.heartbeat_timeout):
                silence = f"no heartbeat for {now - dev.last_seen:.1f} s"
                out.extend(self._drop(dev, CloseCode.SILENT, silence, now))
                continue
            if dev.gflop_verified != dev.credit_sent and now - dev.credit_at >= CREDIT_INTERVAL:
                out.append(self._credit(dev, now))  # verified work only, never claims
            if now - dev.last_sent >= self.standby.beat(dev.id, self.faults.heartbeat):
                out.append(self._send(dev.id, Heartbeat(self.wall(now)), now))
            idle = dev.paused is None and not dev.inflight and not dev.seat.own_count and not self.finished
            why = self.standby.due(dev.id, idle, bool(self.gemms), now)
            if why is not None:
                out.append(self._sleep(dev, why, now))
            if self.relays.relays and dev.id not in self.relays.behind:  # one it avoided for a while, or none had room
                profile = self._profiled.get(dev.id) or self.profiles[dev.id].profile(self.dtype)
                use = self.relays.place(dev.id, profile.down, now)
                if use is not None:
                    out.append(self._send(dev.id, use, now))
            if dev.frame_limit > self.limits.idle_frame and not dev.inflight and now >= dev.big_until:
                dev.frame_limit = self.limits.idle_frame
                out.append(Limit(dev.id, dev.frame_limit))
        out.extend(self._dispatch(now))
        woken = self._wake_for_queue(now)
        if woken:
            out.extend(woken)
            out.extend(self._dispatch(now))
        self.store.flush()  # the hot path's grouped writes are durable within a tick or two
        return out

    # ------------------------------------------------------------------ standby

    def _sleep(self, dev: DeviceState, why: StandbyWhy, now: float) -> Send:
        """Send an idle device the plans leave out to standby: it gets no work (its seat is paused
        with the scheduler) and drops its cached blocks, which it is no longer counted to hold."""
        self.standby.sleep(dev.id, now)
        self.sched.update(dev.id, paused=True)
        for namespace in list(dev.namespaces):
            keys = dev.drop(namespace)
            self.sched.drops_blocks(dev.id, keys)
        dev.forget.clear()  # it drops every block: nothing to name in a later work's ``forget``
        self.sched.update(dev.id, full=dev.full)
        self._fleet_changed()  # planned at its wake latency from now on
        log.info("device %d (%s) sent to standby: %s", dev.id, dev.name, why)
        return self._send(dev.id, Standby(self.standby.policy.keepalive, why), now)

    def _wake(self, dev: DeviceState, now: float) -> Send:
        """Wake a sleeping device: it may take work at once (its frames follow the wake on its
        socket); its answer times the wake (``Sleepers.heard``)."""
        self.standby.wake(dev.id, now)
        self.sched.update(dev.id, paused=dev.paused is not None)
        self._fleet_changed()
        log.info("device %d (%s) woken", dev.id, dev.name)
        return self._send(dev.id, Wake(), now)

    def _wake_for_queue(self, now: float) -> list[Outbound]:
        """Tiles wait that no awake device may take now (no planned owner is here for them, and
        every free device is barred from them, or none is free): wake sleepers, longest asleep
        first, until their slots cover them (at most ``WAKE_SCAN`` a tick). O(woken), plus the
        sleepers its owner paused ahead of them."""
        waiting = self.sched.unowned
        if not waiting or not self.standby.asleep or self.sched.offered:
            return []
        chosen: list[DeviceState] = []
        for device_id in self.standby.longest_asleep():
            dev = self.devices[device_id]
            if dev.paused is not None:  # its owner's pause holds it anyway: waking it would not help
                continue
            chosen.append(dev)
            waiting -= max(1, dev.slots)
            if waiting <= 0 or len(chosen) >= WAKE_SCAN:
                break
        return [self._wake(dev, now) for dev in chosen]

    def _unstick(self, now: float) -> list[Outbound]:
        """A queued tile that every device here has failed would wait forever, and training
        with it: it is re-opened once (each device may try it again); failed everywhere a second
        time, it waits ``STUCK_GRACE`` for a device that may take it, then the job stops with
        the reason rather than hang."""
        reopened = False
        stuck = self.sched.stuck()
        for tile_id in [t for t in self._stuck_since if t not in stuck]:  # someone took it meanwhile
            del self._stuck_since[tile_id]
        for tile_id in stuck:
            gemm = self.gemms.get(self._tile_gemm.get(tile_id, -1))
            if gemm is None:
                continue
            if tile_id in self._reopened:  # a device that joins within the grace may still take it
                since = self._stuck_since.setdefault(tile_id, now)
                if now - since < STUCK_GRACE or self._aborted:
                    continue
            # Read from the store only now: a tile waiting out its grace costs nothing per second.
            # Real failures only (what bars): a give-back for a missing block or a pause is none.
            failures = [
                lease
                for lease in self.store.leases(tile_id)
                if lease.outcome in (Outcome.REJECTED, Outcome.REVOKED)
                or (lease.outcome == Outcome.RELEASED and lease.reason.startswith(ReleaseWhy.COMPUTE_FAILED.value))
            ]
            last = f"{failures[-1].outcome}: {failures[-1].reason}" if failures else "unknown"
            if tile_id in self._reopened:
                self._aborted = True  # said once: the trainer stops at its next GEMM
                m, k = gemm.a.shape
                return [
                    Abort(
                        f"tile {tile_id} of a {gemm.kind.value} GEMM ({m}x{k} @ {k}x{gemm.b.shape[1]}) failed "
                        f"on every connected device, twice ({len(failures)} attempts; last {last}), and no "
                        f"other device came to take it within {STUCK_GRACE:.0f} s"
                    )
                ]
            self._reopened.add(tile_id)
            self.sched.unbar(tile_id)
            self.store.unbar_tile(tile_id)
            log.warning(
                "tile %d was failed by every connected device (last %s); each may try it once more", tile_id, last
            )
            reopened = True
        return self._dispatch(now) if reopened else []

    def _check_standings(self, now: float) -> list[Outbound]:
        """An operator may have revoked or banned an identity, or rotated a token, from another
        process: the store says when anything changed, and connected devices are checked then."""
        if not self.store.changed():
            return []
        self.gate.reload()
        states = self.gate.states([d.identity for d in self.devices.values()])
        out: list[Outbound] = []
        for dev in list(self.devices.values()):
            state = states.get(dev.identity)
            if state not in (IdentityState.REVOKED, IdentityState.BANNED):
                continue
            row = self.store.identity(dev.identity)
            why = f": {row.reason}" if row is not None and row.reason else ""
            if state == IdentityState.REVOKED:
                out.extend(
                    self._drop(
                        dev, CloseCode.REVOKED, f"credential revoked by the operator{why}", now, DeviceStatus.REVOKED
                    )
                )
            else:
                out.extend(self._drop(dev, CloseCode.BANNED, f"banned by the operator{why}", now, DeviceStatus.BANNED))
        return out

    def _credit(self, dev: DeviceState, now: float) -> Send:
        dev.credit_sent, dev.credit_at = dev.gflop_verified, now
        total = self.store.identity_total(dev.identity)[0]
        return self._send(dev.id, Credit(round(dev.gflop_verified, 6), round(total, 6)), now)

    def _send(self, device_id: int, message: Message, now: float) -> Send:
        dev = self.devices.get(device_id)
        if dev is not None:
            dev.last_sent = now
        return Send(device_id, message)

    def _lost_tile(self, dev: DeviceState, now: float) -> None:
        """A lease of ``dev`` ended without its result: it may still send one for a while."""
        dev.big_until = now + self.limits.result_grace

    def _check_of(self, dev: DeviceState, msg: Result, dispatch: bool = True) -> list[Outbound] | Check:
        if msg.tile_id not in dev.inflight:
            if dev.cancelled.pop(msg.tile_id, False) is None:  # a copy that lost the race: ignored
                return []
            return [
                self._send(
                    dev.id,
                    Error(Code.NOT_LEASED, f"tile {msg.tile_id} is not leased to you; result ignored"),
                    dev.last_seen,
                )
            ]
        if msg.tile_id in dev.checking:  # its first result for the tile is being verified
            return [
                self._send(
                    dev.id,
                    Error(Code.NOT_LEASED, f"tile {msg.tile_id} was answered already; result ignored"),
                    dev.last_seen,
                )
            ]
        dev.checking.add(msg.tile_id)
        gemm = self.gemms[self._tile_gemm[msg.tile_id]]
        tile = gemm.tiles[msg.tile_id]
        if tile.pieces == 1:
            ra, rb = gemm.blocks_of(tile)
            check = Check(dev, msg, gemm, tile, ra.logical, rb.logical, ((ra, rb),), dev.last_seen)
        else:  # the pieces' range, as views; norms from the pieces' cached ones
            check = Check(
                dev,
                msg,
                gemm,
                tile,
                a_block(gemm.a, tile),
                b_block(gemm.b, tile),
                tuple(gemm.pairs_of(tile)),
                dev.last_seen,
            )
        band = gemm.band_of.get(msg.tile_id)
        # Alone: a newcomer's results, and a device's beyond UNCHECKED_PER_SLOT results a slot
        # still waiting for their bands (a forger is caught by its next result then, not after
        # bands it holds up; an honest device rarely holds that many of one step's bands).
        unchecked_cap = UNCHECKED_PER_SLOT * max(1, dev.slots)
        if band is None or band.alone or dev.standing.on_probation(self.trust) or dev.unchecked >= unchecked_cap:
            return check
        # Checked with its band: its shape now, the rest once every result of the band is in.
        wrong = structure(VerifyProduct(check.a, check.b, msg.c))
        if wrong is not None and not wrong.ok:
            return self.settle(check, wrong, 0.0, check.arrived, dispatch=dispatch)
        return self.settle(check, None, 0.0, check.arrived, dispatch=dispatch)

    def settle(
        self, check: Check, verdict: Verdict | None, seconds: float, now: float, *, dispatch: bool = True
    ) -> list[Outbound]:
        """Act on a result's verdict. The device may have left, or lost the tile to a copy or a
        deadline, while it was checked: a good result then comes too late and is dropped (as a
        losing copy's would be), a forgery still counts against its identity. Once the GEMM has
        completed, its operands may have changed under the check (an optimizer step): then the
        verdict means nothing and is dropped, whatever it says.

        ``dispatch=False``: the caller settles a batch and calls ``dispatch`` once after it, so
        the slots the batch freed are granted together (a device gets them as one work batch)."""
        out = self._settle(check, verdict, seconds, now)
        if out is None:  # nothing changed: nothing to dispatch
            return []
        return out + self._dispatch(now) if dispatch else out

    def dispatch(self, now: float) -> list[Outbound]:
        """What the scheduler decides now (after ``settle(..., dispatch=False)``)."""
        return self._dispatch(now)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Settle and dispatch a verifier batch as one piece of bookkeeping: its store rows in one
        savepoint of the group (``store.batch``), and one credit per device for its verified
        results, written as the batch ends."""
        if self._credits is not None:  # already in one
            yield
            return
        self._credits = {}
        try:
            with self.store.batch():
                try:
                    yield
                finally:  # what was verified is credited, whatever stopped the batch after it
                    for device_id, (n, gflop, at) in self._credits.items():
                        self.store.credit_device(device_id, verified=n, gflop=gflop, now=at)
        finally:
            self._credits = None

    def _settle(self, check: Check, verdict: Verdict | None, seconds: float, now: float) -> list[Outbound] | None:
        """``verdict`` None: the result is taken for its band's check (``settle_band``): its
        lease ends and its device's slot is free, but it is neither credited nor used until its
        band passes."""
        dev, msg, gemm, tile = check.dev, check.msg, check.gemm, check.tile
        dev.checking.discard(msg.tile_id)
        self.verify_seconds += seconds
        current = self.devices.get(dev.id) is dev and msg.tile_id in dev.inflight
        if not current:
            if verdict is None or verdict.ok or self.gemms.get(gemm.id) is not gemm:
                return None
            return self._forged(dev, now) or None
        leased_at = dev.inflight[msg.tile_id]
        arrived = check.arrived
        nbytes = msg.c.numel() * msg.c.element_size()
        dev.bytes_up += nbytes
        out: list[Outbound] = []
        sent, on_wire = self._sent.pop((msg.tile_id, dev.id), (0, None))
        if verdict is not None and not verdict.ok:
            self._failed(dev.id, now)
            self.sched.release(msg.tile_id, dev.id, bar=True, now=now)
            self.store.end_lease(msg.tile_id, dev.id, Outcome.REJECTED, self.wall(now), verdict.reason)
            out.append(
                self._send(
                    dev.id, Error(Code.REJECTED, f"tile {msg.tile_id} failed verification: {verdict.reason}"), now
                )
            )
            return out + self._forged(dev, now)
        losers = self.sched.done(msg.tile_id, dev.id, now)
        # Its lease is over either way; taken for its band, it is booked ``taken`` until the
        # band's check turns it verified (``settle_band``) or rejected (``_reject_taken``).
        self.store.end_lease(
            msg.tile_id, dev.id, Outcome.VERIFIED if verdict is not None else Outcome.TAKEN, self.wall(now)
        )
        dev.tiles_done += 1
        dev.compute_seconds += msg.seconds
        self.standby.working(dev.id, now)
        # From its work frame going on the wire (not from the lease: a frame queued behind the
        # device's other work is that work's link time, not this one's).
        start = leased_at if on_wire is None else max(leased_at, on_wire)
        # A tile waits on a device only behind the work before it, which was done by the time
        # its result arrived here: a claimed wait beyond that is not believed.
        waited = min(msg.waited, max(0.0, dev.result_at - start) + WAIT_SLACK)
        dev.result_at = arrived
        self.profiles[dev.id].verified(tile.flops, msg.seconds, waited, arrived - start, sent, nbytes, arrived)
        self._measured.add(dev.id)
        raced = []
        for loser in losers:  # other copies lost the race: tell their devices to drop them
            self._sent.pop((msg.tile_id, loser), None)
            other = self.devices.get(loser)
            if other is not None:
                other.cancel(msg.tile_id)
                self._lost_tile(other, now)
                out.append(self._send(loser, Cancel((msg.tile_id,), "another copy was verified first"), now))
                raced.append((other, msg.tile_id in other.checking))  # answered: its result is being checked
        # Its standing, pace and slots, and the losers': the rules the simulator runs too.
        stallers = self.conduct.settled(dev, arrived, leased_at, tile.flops, raced)
        band = gemm.band_of.get(msg.tile_id)
        if verdict is not None:
            self._verified(check, verdict, now)
            if gemm.done:
                self._complete(gemm, now)
        elif band is not None:
            band.take(check)
        if band is not None and band.complete:  # its last result is in (taken, or checked alone)
            band.checking = True
            self._bands_due.append(BandCheck(gemm, band, band.due()))
        for other in stallers:  # only once this tile is settled everywhere
            if other.id in self.devices:
                out.extend(
                    self._cut(
                        other,
                        f"{other.standing.unanswered} tiles in a row went to other devices without a result from it",
                        now,
                    )
                )
        return out

    def _verified(self, check: Check, verdict: Verdict, now: float) -> None:
        """A result passed its check (alone or with its band): credit it and keep it."""
        dev, gemm, tile = check.dev, check.gemm, check.tile
        kind = gemm.kind.value
        self.verify_worst_honest[kind] = max(self.verify_worst_honest.get(kind, 0.0), verdict.worst_ratio)
        gflop = tile.flops / 1e9
        if self._credits is not None:  # in a batch: one credit per device as it ends
            n, total, _ = self._credits.get(dev.id, (0, 0.0, 0.0))
            self._credits[dev.id] = (n + 1, total + gflop, self.wall(now))
        else:
            self.store.credit_device(dev.id, verified=1, gflop=gflop, now=self.wall(now))
        dev.gflop_verified += gflop
        self.gflop_verified += gflop
        gemm.parts[tile.index] = check.msg.c
        band = gemm.band_of.get(check.msg.tile_id)
        if band is not None:
            band.verified[check.msg.tile_id] = check

    def settle_band(
        self, check: BandCheck, passed: bool, verdicts: Sequence[Verdict], seconds: float, now: float
    ) -> list[Outbound]:
        """Act on a band's check (``BandCheck.run``): each result that passed is credited and
        kept; each that failed is rejected (its tile queued again, never to that device) and
        counted against its identity, as a result that failed alone is. A failed band checks
        its later results one by one. The caller dispatches (``dispatch``) after."""
        gemm, band = check.gemm, check.band
        band.checking = False
        self.verify_seconds += seconds
        if self.gemms.get(gemm.id) is not gemm:  # finished or abandoned meanwhile
            return []
        if len(verdicts) != len(check.checks):  # a bug: never pair a verdict with the wrong result
            raise RuntimeError(f"{len(verdicts)} verdicts for a band of {len(check.checks)} results")
        if not passed:
            band.alone = True
            self.band_failures += 1
            log.warning("a band of %d results of GEMM %d failed: each was checked alone", len(verdicts), gemm.id)
        out: list[Outbound] = []
        judged = [
            (one, verdict)
            for one, verdict in zip(check.checks, verdicts)
            if band.answered.get(one.msg.tile_id) is one  # else taken back meanwhile (its device was banned)
        ]
        # The band's passes in one write (first: should it fail, the band is left as it was),
        # then each result's own books.
        self.store.verify_taken(
            [(one.msg.tile_id, one.dev.id) for one, verdict in judged if verdict.ok], self.wall(now)
        )
        for one, _ in judged:  # judged here: a ban below does not revoke them (a pass proves its result)
            band.drop(one.msg.tile_id)
        for one, verdict in judged:
            if verdict.ok:
                self._verified(one, verdict, now)
            else:
                out.extend(self._reject_taken(one, f"failed verification: {verdict.reason}", now, forged=True))
        if gemm.done:
            self._complete(gemm, now)
        return out

    def _reject_taken(self, check: Check, reason: str, now: float, *, forged: bool) -> list[Outbound]:
        """A result taken for its band is not used after all: the tile is queued again, never to
        that device. ``forged``: it failed its check, which counts against its identity."""
        dev, tile_id = check.dev, check.msg.tile_id
        outcome = Outcome.REJECTED if forged else Outcome.REVOKED
        self.store.reject_taken(tile_id, dev.id, self.wall(now), reason, outcome)
        self.sched.reopen(tile_id, dev.id)
        if not forged:
            return []
        out: list[Outbound] = []
        if self.devices.get(dev.id) is dev:
            self._failed(dev.id, now)
            out.append(self._send(dev.id, Error(Code.REJECTED, f"tile {tile_id} {reason}"), now))
        return out + self._forged(dev, now)

    def _forged(self, dev: DeviceState, now: float) -> list[Outbound]:
        """Count a rejected result against its identity; when that bans it, drop the identity's
        live session (this one, or a newer one if it reconnected meanwhile)."""
        self.store.credit_device(dev.id, rejected=1, now=self.wall(now))
        dev.tiles_rejected += 1
        if not self.conduct.rejected(dev):
            return []
        reason = "results failed verification"
        self.gate.ban(dev.identity, reason, self.wall(now))
        # Its results still waiting for their bands are not used: their tiles go to others now.
        for gemm in self.gemms.values():
            for band in (gemm.bands or {}).values():
                if band.checking:  # judged with its band: a pass there proves it
                    continue
                for tile_id in [t for t, c in band.answered.items() if c.dev.identity == dev.identity]:
                    self._reject_taken(band.drop(tile_id), "its device was banned", now, forged=False)
        live = self.devices.get(self._by_identity.get(dev.identity, -1))
        return [] if live is None else self._drop(live, CloseCode.BANNED, reason, now, DeviceStatus.BANNED)

    def _on_pause(self, dev: DeviceState, reason: str, now: float) -> list[Outbound]:
        """The owner needs the machine: its tiles go to others at once; it stays connected."""
        dev.paused = reason  # its work goes back: its paused time books no draw (it holds nothing)
        self.sched.update(dev.id, paused=True)
        self._fleet_changed()
        self.store.set_device_state(dev.id, DeviceStatus.PAUSED, self.wall(now), reason)
        # A paused client keeps its cached blocks: they serve it again once it resumes. Its
        # leases' rows say "paused", never its owner's words (the device row keeps those, once).
        return self._give_back(dev, tuple(dev.inflight), DeviceStatus.PAUSED.value, now, blocks_lost=False, paused=True)

    def _on_release(self, dev: DeviceState, msg: Release, now: float) -> list[Outbound]:
        # A missing block: send the blocks again if it gets the tile back. A failed compute: the
        # tile goes to another device, never straight back to this one.
        missing = msg.why is ReleaseWhy.MISSING_BLOCK
        if missing:  # every byte it claims to have lost is a byte sent again: charged as such
            held = {
                ref.key: ref.nbytes
                for tid in set(msg.tile_ids)
                if tid in dev.inflight
                for pair in self._pairs_of(tid)
                for ref in pair
                if ref.key in dev.blocks
            }
            # Named for its relay but never had: not relayed, and not charged (the relay failed it).
            resend = sum(held.values()) - self.relays.unserved(dev.id, held)
            if resend and not dev.resends.take(now, resend):
                return self._drop(dev, CloseCode.RATE_LIMITED, "too many blocks to send again", now) + self._dispatch(
                    now
                )
        # Its leases' rows get ``why`` alone (an enum): its own words (``msg.reason``) are never
        # stored, so giving tiles back writes no text of a device's choosing into the books.
        if msg.reason and not missing:  # "out of memory": the operator's log has them, once a release
            log.info("device %d (%s) failed tiles %s: %s", dev.id, dev.name, list(msg.tile_ids[:8]), msg.reason)
        return self._give_back(dev, msg.tile_ids, msg.why.value, now, blocks_lost=missing, failed=not missing)

    def _pairs_of(self, tile_id: int) -> list[tuple[BlockRef, BlockRef]]:
        gemm = self.gemms[self._tile_gemm[tile_id]]
        return gemm.pairs_of(gemm.tiles[tile_id])

    def _give_back(
        self,
        dev: DeviceState,
        tile_ids: tuple[int, ...],
        reason: str,
        now: float,
        *,
        blocks_lost: bool,
        failed: bool = False,
        paused: bool = False,
    ) -> list[Outbound]:
        """``dev`` gives these tiles back (``reason``: a fixed value, never the device's words).
        ``failed``: its compute failed, it never gets them again (a bar: only real failures bar,
        so only they can leave a tile to ``_unstick``). A missing block bars nothing: the tile's
        blocks come with it again. ``paused``: its owner needs the machine. A release spends its
        allowance of them (``Conduct.gave_back``: past it, each counts as a take-back), so
        identities bouncing tiles between them cannot go on for ever; a pause does not (it has
        its own rate limit)."""
        given = 0
        # Tiles its relay failed it on were held waiting on the relay, not stalled by the device.
        excused = dev.excused & set(tile_ids)
        kept = [t for t in set(tile_ids) if t in dev.inflight and t not in excused]
        stalled = self._held_long(dev, kept, now, released=not paused)
        dev.excused.difference_update(tile_ids)
        for tile_id in tile_ids:
            if tile_id not in dev.inflight:
                continue  # already finished or re-issued: nothing to give back
            given += 1
            self._sent.pop((tile_id, dev.id), None)
            if failed:
                self._failed(dev.id, now)
            bar = failed  # never a missing block's tile: it is sent again with its blocks
            self.sched.release(tile_id, dev.id, bar=bar, now=now)
            self._lost_tile(dev, now)
            self.store.end_lease(tile_id, dev.id, Outcome.RELEASED, self.wall(now), reason, bar=bar)
            if blocks_lost:
                for ref in {r.key: r for pair in self._pairs_of(tile_id) for r in pair}.values():
                    dev.lose(ref)
                    self.sched.drops_blocks(dev.id, (ref.key,))
                self.sched.update(dev.id, full=dev.full)
        out = self._cut(dev, "it kept giving tiles back without returning work", now) if stalled else []
        return out + self._dispatch(now) if given else out  # nothing changed: nothing to dispatch

    def _held_long(self, dev: DeviceState, tile_ids: list[int], now: float, *, released: bool = False) -> bool:
        """Leases it gives back (or loses by leaving) after holding them for most of their
        deadline count as unanswered, as if another copy had won: holding tiles until just
        before their deadlines and then letting go is stalling. A release (``released``) also
        spends its allowance of them (``Conduct.gave_back``). True when it must be cut."""
        holds = [hold for tile_id in tile_ids if (hold := self.sched.hold(tile_id, dev.id)) is not None]
        return self.conduct.gave_back(dev, holds, now, released=released)

    def _complete(self, gemm: GemmState, now: float) -> None:
        product = functools.partial(assemble, gemm.plan, gemm.parts, gemm.out_dtype or gemm.a.dtype)
        self.store.finish_gemm(gemm.id, self.wall(now))
        self.sched.drop_gemm(gemm.id, now)
        self.standby.done(gemm.id)
        for tid in gemm.tiles:
            self._tile_gemm.pop(tid, None)
            self._reopened.discard(tid)
            self._stuck_since.pop(tid, None)
        # dW is the last reader of its X and dY: their cached pieces can go everywhere.
        last_use = gemm.kind is GemmKind.GRAD_WEIGHT
        for src in gemm.sources:
            if self.sources.release(src, last_use=last_use):
                self._forget(src.id)
        del self.gemms[gemm.id]
        pred = self.prediction
        if not self.gemms and pred.busy_since is not None:
            pred.busy += now - pred.busy_since
            pred.busy_since = None
        gemm.on_done(product if gemm.lazy else product())

    def _forget(self, namespace: int) -> None:
        for dev in self.devices.values():
            keys = dev.drop(namespace)
            if keys:
                self.sched.drops_blocks(dev.id, keys)
                self.sched.update(dev.id, full=dev.full)

    def plan_lanes(self, lanes: int) -> None:
        """The trainer runs this many micro-batches at once: each GEMM is planned on one of as
        many lanes of the fleet (``LivePlanner``), as the simulator plans them."""
        self.planner = self.planner.with_lanes(lanes)

    def begin_step(self, step: int, now: float | None = None) -> None:
        """A training step starts: blocks still kept from the last one will not be read again."""
        if now is not None:
            self.prediction.step_done(now)
        self.progress.current = step
        self.peak_in_flight = self.peak_waited = 0
        for namespace in self.sources.sweep():
            self._forget(namespace)
        self.relays.new_step()

    # ------------------------------------------------------------------ GEMMs

    def submit(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        kind: GemmKind,
        now: float,
        on_done: Callable[[torch.Tensor], None],
        *,
        finite_checked: bool = False,
        lazy: bool = False,
        out_dtype: torch.dtype | None = None,
        kept: Product | None = None,
        deferred: bool = False,
        retain: bool = True,
    ) -> tuple[int, list[Outbound]]:
        """Queue ``a @ b`` as tiles; ``on_done(result)`` is called once every tile is verified.
        ``finite_checked``: the caller ran ``check_finite`` already (the server's trainer thread
        does, so the event loop does not read every input once more). ``lazy``: ``on_done`` gets
        a ``Product`` instead, and the caller's thread puts the tiles together (or multiplies a
        GEMM kept on the PS) rather than the event loop. ``out_dtype``: the product's dtype when
        it differs from the operands' (half-precision wire operands of a float32 job: the tiles'
        results are summed and returned in float32). ``kept``: the product should the planner
        keep the GEMM here (the wire's float32 originals), instead of ``a @ b``. ``deferred``:
        nobody waits on this product until the step ends (a weight gradient): its tiles queue
        behind those of GEMMs submitted later without it, which the trainer waits on. ``retain``
        False: no backward will read a forward's X again (one without autograd: an evaluation),
        so its blocks go with this GEMM rather than at the next step."""
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
        if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported GEMM dtypes {a.dtype}, {b.dtype}")
        if not finite_checked:
            check_finite(a, b, kind)
        m, k = a.shape
        n = b.shape[1]
        dtype = DTYPE_NAMES[str(a.dtype)]
        if dtype != self.dtype:  # profiles are cached in the job's dtype
            self._profiled.clear()
            self.dtype = dtype
        live = self._plan(m, n, k, kind, now)
        pred = self.prediction
        pred.planned.append(live.seconds)
        pred.home.append(local_seconds(m, n, k, dtype, self.planner.ps))
        label = live.label
        pred.kinds[label] = pred.kinds.get(label, 0) + 1
        if live.tiles is None:  # cheaper here than shipped: the PS multiplies itself
            pred.local_gemms += 1
            out = out_dtype or a.dtype
            product = kept or functools.partial(torch.matmul, a.detach().to(out), b.detach().to(out))
            on_done(product if lazy else product())
            return -1, []
        plan = live.tiles
        tiles = plan.tiles
        a, b = a.detach(), b.detach()
        # Forward's X and dX's dY are read again by their dW (a deferred dW may come first: then
        # whichever of the two finishes last lets dY go): keep them on devices.
        sources = (
            self.sources.acquire(a, retain=retain and kind in (GemmKind.FORWARD, GemmKind.GRAD_INPUT)),
            self.sources.acquire(b, retain=False),
        )
        gemm_id = self.store.next_gemm_id()
        pieces = [q for t in tiles for q in piece_tiles(plan, t)]  # one-piece tiles: the blocks
        a_blocks = {(q.i, q.p): block_ref(sources[0], gemm_id, f"a{q.i}.{q.p}", a_block(a, q)) for q in pieces}
        b_blocks = {(q.p, q.j): block_ref(sources[1], gemm_id, f"b{q.p}.{q.j}", b_block(b, q)) for q in pieces}
        new = [NewTile(t.index, a_blocks[(t.i, t.p)].key, b_blocks[(t.p, t.j)].key, t.flops) for t in tiles]
        ids = self.store.add_gemm(
            gemm_id, self.job_id, self.progress.current, kind.value, (m, n, k), new, self.wall(now)
        )
        gemm = GemmState(
            gemm_id,
            kind,
            a,
            b,
            plan,
            dict(zip(ids, tiles)),
            on_done,
            sources,
            a_blocks,
            b_blocks,
            lazy=lazy,
            out_dtype=out_dtype,
            deferred=deferred,
        )
        if self.band_checks:
            gemm.form_bands(self.rng)
        if not self.gemms and pred.busy_since is None:
            pred.busy_since = now
        self.gemms[gemm_id] = gemm
        self.peak_in_flight = max(self.peak_in_flight, len(self.gemms))
        if not deferred:
            self.peak_waited = max(self.peak_waited, sum(not g.deferred for g in self.gemms.values()))
        for tid in ids:
            self._tile_gemm[tid] = gemm_id
        owners = live.owners
        # Sleeping devices the plan names are woken first: their tiles then wait in their own
        # queues, and their work frames follow the wake (engine/standby.py).
        wakes = [self._wake(self.devices[d], now) for d in self.standby.planned(gemm_id, owners.values())]
        # Ahead of deferred GEMMs' queued tiles (FIFO otherwise): the trainer waits on this one.
        front = not deferred and any(g.deferred for g in self.gemms.values() if g is not gemm)
        self.sched.add_gemm(
            gemm_id,
            [
                UnitSpec(
                    tid,
                    gemm_id,
                    nt.a_key,
                    nt.b_key,
                    nt.flops,
                    owners.get(t.index),
                    sum(ra.nbytes + rb.nbytes for ra, rb in gemm.pairs_of(t)),
                    gemm.result_bytes(t),
                )
                for tid, nt, t in zip(ids, new, tiles)
            ],
            front=front,
        )
        return gemm_id, wakes + self._dispatch(now)

    def _plan(self, m: int, n: int, k: int, kind: GemmKind, now: float) -> LivePlan:
        """The cost model's plan for the devices that may take work now. Their classes are
        rebuilt (O(devices)) only when the fleet changed: a device joined, left, paused or
        resumed, or its measured profile moved on the planner's grid."""

        # Devices measured since the last plan: has any moved on the planner's grid? (Here, once
        # per GEMM, rather than at every result.)
        for device_id in self._measured:
            profile = self.profiles.get(device_id)
            now_profile = None if profile is None else profile.profile(self.dtype)
            key = None if now_profile is None else fleet_key(now_profile, self.dtype)
            if now_profile is not None:  # a thief's links count against stealing (Seat.transfer)
                self._profiled[device_id] = now_profile
                self.sched.links(device_id, now_profile.down, now_profile.up)
            if key is not None and self._fleet_keys.get(device_id) != key:
                self._fleet_keys[device_id] = key
                self._fleet_changed()
        self._measured.clear()
        return self.planner.plan(m, n, k, kind, self.dtype, self.fleet_profiles, self._fleet_version, now=now)

    def join_tier(self, balancer: Balancer, *, redirect: bool = True) -> None:
        """This coordinator is a rank of a tier: tickets from the other ranks admit newcomers, and
        (``redirect``) newcomers with the join token may be sent to a weaker rank."""
        self.balancer = balancer if redirect else None
        self.gate.tickets = balancer

    def pool(self) -> tuple[int, float]:
        """The devices that may take work now and their GEMM GFLOP/s as the tier's balancing
        counts them: measured, as the cost model has them, once a device has returned verified
        work; until then its discounted claim, at most ``UNMEASURED_GFLOPS`` (a hello's claim
        moves no device: engine/balance.py). O(devices)."""
        profiles = self.fleet_profiles()
        total = 0.0
        for d, p in profiles.items():
            rate = p.flops_per_s(self.dtype) / 1e9
            total += rate if self.profiles[d].results else min(rate, UNMEASURED_GFLOPS)
        return len(profiles), total

    def fleet_profiles(self, dtype: str | None = None) -> dict[int, Profile]:
        """What the cost model knows of each device that may take work now (O(devices)), in
        ``dtype`` (default: the job's GEMMs' dtype, known once the first GEMM has come)."""
        dtype = dtype or self.dtype
        if dtype != self.dtype:
            return {
                d: self._resting(d, self.profiles[d].profile(dtype))
                for d, dev in self.devices.items()
                if dev.paused is None
            }
        # A profile changes only with an observation (which marks the device measured): each
        # device's is computed once per observation, not once per GEMM the fleet changed for.
        out = {}
        for d, dev in self.devices.items():
            if dev.paused is not None:
                continue
            known = None if d in self._measured else self._profiled.get(d)
            if known is None:
                known = self._profiled[d] = self.profiles[d].profile(dtype)
            out[d] = self._resting(d, known)
        return out

    def _resting(self, device_id: int, profile: Profile) -> Profile:
        """A sleeping device as the planner sees it: its round trip lengthened by its wake, so a
        plan that wants it pays for the wait (engine/standby.py)."""
        wait = self.standby.latency(device_id, profile.rtt)
        return dataclasses.replace(profile, rtt=profile.rtt + wait) if wait > 0 else profile

    def _fleet_changed(self) -> None:
        """A device joined, left, paused, resumed or moved on the planner's grid."""
        self._fleet_version += 1

    def _failed(self, device_id: int, now: float) -> None:
        """A lease of the device ended without a verified result (its reliability)."""
        self.profiles[device_id].failed(now)
        self._measured.add(device_id)

    def _dispatch(self, now: float) -> list[Outbound]:
        """Ask the scheduler what to do now and do it: late leases and leases taken back, queued
        tiles to devices with free slots, then copies of late tiles and stragglers.

        Never re-entered: removing a device inside it (a cut) only changes state, and this loop
        picks up what that freed."""
        if self._dispatching:
            return []
        self._dispatching = True
        try:
            sched = self.sched
            out = self._apply(sched.expire(now), now)
            out.extend(self._apply(sched.assign(now), now))
            out.extend(self._apply(sched.copies(now), now))
            if sched.queued:  # a late tile was taken back with no copy left out
                out.extend(self._apply(sched.assign(now), now))
            return out
        finally:
            self._dispatching = False

    def _apply(self, decisions: Iterable[Decision], now: float) -> list[Outbound]:
        """Carry out decisions one at a time: each may change what the next one sees (a lease
        fills a device's block budget, a take-back cuts a device)."""
        out: list[Outbound] = []
        leasing: list[tuple[int, int]] = []  # first leases since the last write: written together
        for decision in decisions:
            dev = self.devices.get(decision.device)
            if dev is None:  # cut earlier in this batch: the scheduler has let its tiles go already
                self._sent.pop((decision.unit, decision.device), None)
                continue
            if isinstance(decision, Assign) and decision.copy is None:
                leasing.append((decision.unit, dev.id))
                out.extend(self._lease(dev, decision.unit, now))
            elif isinstance(decision, Overdue):
                if decision.unit not in dev.excused:  # late waiting on a relay it reported: the relay's doing
                    self.conduct.late(dev)
            else:  # the store sees the leases before it, in order
                out.extend(self._write_leases(leasing, now))
                if isinstance(decision, Assign):
                    out.extend(self._copy(dev, decision.unit, decision.copy or "", now))
                else:
                    out.extend(self._take_back(dev, decision, now))
        out.extend(self._write_leases(leasing, now))
        return out

    def _write_leases(self, leasing: list[tuple[int, int]], now: float) -> list[Outbound]:
        """Write the scheduler's first leases in one go (``store.lease_tiles``). A lease the store
        refuses (a bug, never a peer's doing: the scheduler and the store disagree) is logged,
        its tile given to someone else, and its work cancelled (the device keeps the blocks)."""
        if not leasing:
            return []
        claimed = self.store.lease_tiles(leasing, self.wall(now))
        out: list[Outbound] = []
        for (tile_id, device_id), got in zip(leasing, claimed, strict=True):
            if got is None:
                log.error(
                    "store refused the scheduler's lease of tile %d to device %d; tile re-queued", tile_id, device_id
                )
                self._sent.pop((tile_id, device_id), None)
                self.sched.release(tile_id, device_id, now=now)
                dev = self.devices.get(device_id)
                if dev is not None:
                    dev.cancel(tile_id)
                    out.append(
                        self._send(device_id, Cancel((tile_id,), "the coordinator could not record its lease"), now)
                    )
        leasing.clear()
        return out

    def _take_back(self, dev: DeviceState, decision: Reclaim, now: float) -> list[Outbound]:
        """The scheduler revoked ``dev``'s lease; leases taken back in a row cut the device."""
        tile_id, reason = decision.unit, decision.reason
        # Held waiting on a relay it reported (engine/relays.py): the relay's slowness, not its stall.
        excused = tile_id in dev.excused
        dev.excused.discard(tile_id)
        self._sent.pop((tile_id, dev.id), None)
        if not excused:
            self._failed(dev.id, now)
        dev.cancel(tile_id)
        self._lost_tile(dev, now)
        # Barred from the tile: it goes to someone else, never straight back to this device.
        self.store.end_lease(tile_id, dev.id, Outcome.REVOKED, self.wall(now), reason, bar=True)
        out: list[Outbound] = [self._send(dev.id, Cancel((tile_id,), f"lease taken back: {reason}"), now)]
        if excused:
            return out
        self.store.credit_device(dev.id, revoked=1, now=self.wall(now))
        if self.conduct.taken_back(dev):  # else it is regraded
            # Cut on a lease that waited on its relay's blocks: it may have been the relay.
            on_relay = tile_id in dev.relayed
            out.extend(self._cut(dev, "its tiles kept running past their deadlines", now, on_relay=on_relay))
        return out

    def _cut(self, dev: DeviceState, why: str, now: float, *, on_relay: bool = False) -> list[Outbound]:
        """Disconnect a device that holds tiles without returning them; it may come back after a
        cool-off (doubling with every cut). ``on_relay``: the lease taken back last waited on
        blocks named on its relay: the relay may have been slow, and takes no newcomers for a
        while, if the device is off probation (a new identity costs only the join token: its
        cuts, like its reports, cool no relay; give-backs and races never do)."""
        wait = self.conduct.cut(dev, now)
        relay_id = self.relays.behind.get(dev.id)
        if relay_id is not None and on_relay and not dev.standing.on_probation(self.trust):
            self.relays.cool(relay_id, now)
        return self._drop(dev, CloseCode.STALLING, f"{why}; come back in {wait:.0f} s", now)

    def _copy(self, dev: DeviceState, tile_id: int, copy: str, now: float) -> list[Outbound]:
        """Record the scheduler's copy of an outstanding tile in the store and send the work."""
        if self.store.claim_copy(tile_id, dev.id, copy, self.wall(now)) is None:
            # The scheduler and the store disagree (a bug, never a peer's doing): say so, and let
            # the scheduler give the tile to someone else rather than stop training.
            log.error("store refused the scheduler's copy of tile %d to device %d", tile_id, dev.id)
            self.sched.release(tile_id, dev.id, now=now)
            return []
        return self._lease(dev, tile_id, now)

    def _lease(self, dev: DeviceState, tile_id: int, now: float) -> list[Outbound]:
        """Send the work of a lease (its store row is the caller's: ``_write_leases``, ``_copy``)."""
        self.standby.working(dev.id, now)
        gemm = self.gemms[self._tile_gemm[tile_id]]
        tile = gemm.tiles[tile_id]
        out: list[Outbound] = []
        # A device that batches may answer ``batch`` tiles in one frame (at most its hello's
        # batch, within the slots it asked for: cleave join asks batch = slots).
        need = gemm.result_bytes(tile) * dev.batch + self.limits.frame_slack
        if need > dev.frame_limit:  # raised before the device can possibly answer
            dev.frame_limit = need
            out.append(Limit(dev.id, need))
        out.append(self._send(dev.id, self._work(dev, gemm, tile_id), now))
        return out

    def _work(self, dev: DeviceState, gemm: GemmState, tile_id: int) -> Work:
        pairs = gemm.pairs_of(gemm.tiles[tile_id])
        ra, rb = pairs[0]
        # Forget first: a namespace dropped and a block of a new one may share this message.
        forget = tuple(sorted(dev.forget))
        dev.forget.clear()
        blocks, fetch = [], []
        sent = 0
        for ref in {r.key: r for pair in pairs for r in pair}.values():
            if ref.key not in dev.blocks:
                digest = self.relays.name(dev.id, ref)  # behind a relay: it fetches the block there
                if digest is None:
                    blocks.append(Block(ref.key, ref.wire()))
                    sent += ref.nbytes
                else:
                    fetch.append((ref.key, digest))
                dev.hold(ref)
                self.sched.holds_block(dev.id, ref.key)
        dev.bytes_down += sent
        self._sent[(tile_id, dev.id)] = [sent, None]
        if fetch:  # it waits on its relay for this tile: what a relay failure may excuse
            if len(dev.relayed) >= 2 * MAX_SLOTS:
                dev.relayed &= set(dev.inflight)
            dev.relayed.add(tile_id)
        if dev.full:
            self.sched.update(dev.id, full=True)
        more = tuple(key for pa, pb in pairs[1:] for key in (pa.key, pb.key))
        more_t = tuple(flag for pa, pb in pairs[1:] for flag in (pa.transposed, pb.transposed))
        wait = 0.0  # the relay's wait scales with this lease's own deadline (slow links, big tiles)
        if fetch and (hold := self.sched.hold(tile_id, dev.id)) is not None:
            wait = max(self.relays.wait, WAIT_SHARE * (hold.soft - hold.leased_at))
        return Work(
            tile_id, ra.key, rb.key, ra.transposed, rb.transposed, tuple(blocks), forget, more, more_t, tuple(fetch),
            wait,
        )  # fmt: skip

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
            out.append(self._credit(dev, now))  # the final tally, before goodbye
            out.append(self._send(dev.id, Finished(reason), now))
        return out
