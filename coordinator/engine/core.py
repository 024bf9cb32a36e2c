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

import functools
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coordinator.engine.blocks import BlockRef, Source, Sources, block_ref
from coordinator.engine.identity import Admission, Gate, Standing
from coordinator.engine.limits import Limits, TokenBucket, TrustPolicy
from coordinator.engine.live_plan import DTYPE_NAMES, LivePlan, LivePlanner, Planner, fleet_key
from coordinator.engine.profiles import PRIOR_MEMORY, DeviceProfile
from coordinator.engine.scheduler import (
    Assign,
    Decision,
    FaultPolicy,
    Hold,
    Overdue,
    Reclaim,
    Scheduler,
    Seat,
    UnitSpec,
)
from coordinator.planning.costmodel import Profile, PSProfile
from coordinator.planning.tiles import (
    GemmKind,
    Tile,
    TileList,
    TilePlan,
    TilingPolicy,
    a_block,
    assemble,
    b_block,
    piece_tiles,
)
from coordinator.wire import auth
from coordinator.wire.codes import CloseCode, Code, ReleaseWhy
from coordinator.wire.errors import AuthError, Diverged
from coordinator.wire.messages import (
    Block,
    Cancel,
    Credential,
    Credit,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Leave,
    Message,
    Pause,
    Release,
    Result,
    Resume,
    Welcome,
    Work,
)
from coordinator.wire.verify import Verdict, freivalds
from db.store import BANNED, REVOKED, DeviceInfo, NewTile, Store

__all__ = ["AuthError", "Close", "Core", "FaultPolicy", "Hold", "Limit", "Outbound", "Send"]

log = logging.getLogger(__name__)

SHUTDOWN = "coordinator stopped"
CREDIT_INTERVAL = 1.0  # seconds between Credit messages to a device whose verified total grew
EMA = 0.2  # weight of a new observation in a device's running estimates
STANDING_CHECK = 1.0  # seconds between looks for an operator's revocations and token rotations
STUCK_GRACE = 60.0  # seconds a tile failed everywhere twice waits for a new device before the job stops
SWEEP = 0.5  # seconds in which tick looks after every device once (heartbeats, silence, credit)
TICK_GUESS = 0.05  # the server's tick interval: the first tick of a sweep already takes its share
# A device's claimed speed only sets its first deadlines, and only within these bounds.
CLAIM_GFLOPS = (1.0, 1e5)
WAIT_SLACK = 0.005  # seconds a tile may wait on a device with nothing before it (its event loop)
MAX_SECONDS_PER_GFLOP = 10.0  # slower turnarounds than this are not waited for any longer


@dataclass(frozen=True)
class Send:
    device: int
    message: Message


@dataclass(frozen=True)
class Close:
    device: int
    code: int
    reason: str


@dataclass(frozen=True)
class Limit:
    """The largest frame the device may send from now on (the server enforces it)."""

    device: int
    nbytes: int


@dataclass(frozen=True)
class Abort:
    """Training cannot go on: the server fails every GEMM in flight with this reason."""

    reason: str


Outbound = Send | Close | Limit | Abort
Product = Callable[[], torch.Tensor]  # a GEMM's result, computed when called (``submit(lazy=True)``)


@dataclass
class GemmState:
    id: int
    kind: GemmKind
    a: torch.Tensor
    b: torch.Tensor
    plan: TilePlan | TileList
    tiles: dict[int, Tile]  # tile id -> tile
    on_done: Callable[[torch.Tensor], None]
    sources: tuple[Source, Source]
    a_blocks: dict[tuple[int, int], BlockRef]  # (i, p) -> A[rows i, ks p]
    b_blocks: dict[tuple[int, int], BlockRef]  # (p, j) -> B[ks p, cols j]
    parts: dict[int, torch.Tensor] = field(default_factory=dict)  # tile index -> verified C block
    lazy: bool = False  # on_done gets a Product: the caller assembles, off the event loop
    out_dtype: torch.dtype | None = None  # of the assembled product (float32 for half-precision wire tiles)
    deferred: bool = False  # nobody waits on it before the step's end (a weight gradient)

    def blocks_of(self, tile: Tile) -> tuple[BlockRef, BlockRef]:
        """The blocks of the tile's first reduction piece."""
        return self.a_blocks[(tile.i, tile.p)], self.b_blocks[(tile.p, tile.j)]

    def pairs_of(self, tile: Tile) -> list[tuple[BlockRef, BlockRef]]:
        """The (A, B) blocks of every reduction piece the tile adds up."""
        return [(self.a_blocks[(tile.i, q)], self.b_blocks[(q, tile.j)]) for q in range(tile.p, tile.p + tile.pieces)]

    def result_bytes(self, tile: Tile) -> int:
        return (tile.r1 - tile.r0) * (tile.c1 - tile.c0) * self.a.element_size()

    @property
    def done(self) -> bool:
        return len(self.parts) == len(self.tiles)


@dataclass(frozen=True, eq=False)
class Check:
    """A device's result and what its verification reads: the GEMM's own operand views and
    their blocks. ``run`` reads the operands and the result and touches nothing of the Core's
    but the blocks' norm caches (a race there only computes the same norm twice), so it may run
    on another thread. The operands stay as they are while the GEMM is live (the trainer waits
    for it); ``settle`` trusts no verdict of a check whose GEMM had completed."""

    dev: DeviceState
    msg: Result
    gemm: GemmState
    tile: Tile
    a: torch.Tensor  # the tile's A range, a view of the GEMM's operand
    b: torch.Tensor
    pairs: tuple[tuple[BlockRef, BlockRef], ...]  # the blocks of its reduction pieces
    arrived: float  # when the result was received: its timings count from here, not the verdict

    def run(self, rng: np.random.Generator) -> tuple[Verdict, float]:
        """The verdict and the seconds it took (``rng``: never seen by a device; not shared
        between threads)."""
        started = time.perf_counter()
        if self.a.dtype not in (torch.float32, torch.float64):  # the check takes norms of its own
            row_norms, b_norm = None, None
        elif len(self.pairs) == 1:
            ((ra, rb),) = self.pairs
            row_norms, b_norm = ra.row_norms(), rb.norm()
        else:
            row_norms = torch.stack([ra.row_norms() for ra, _ in self.pairs]).square().sum(0).sqrt()
            b_norm = math.sqrt(sum(rb.norm() ** 2 for _, rb in self.pairs))
        gemm = self.gemm
        if gemm.a.dtype in (torch.float16, torch.bfloat16):
            # Half tiles (the half-precision wire, or a bf16/fp16/autocast job): devices sum in
            # float32 and round once (client/kernels.py), and only that rounding is tolerated
            # (coordinator/wire/verify.py, ROUNDING_FACTOR). A tolerance of the half dtype's own
            # products would let a forged bf16 tile through.
            compute, rounded_to = torch.float32, gemm.a.dtype
        else:
            compute, rounded_to = gemm.a.dtype, None
        verdict = freivalds(
            self.a,
            self.b,
            self.msg.c,
            rng,
            compute_dtype=compute,
            rounded_to=rounded_to,
            a_row_norms=row_norms,
            b_norm=b_norm,
        )
        return verdict, time.perf_counter() - started


@dataclass
class DeviceState:
    id: int
    identity: int
    name: str
    asked: int  # the most tiles its owner wants in flight
    seat: Seat  # the scheduler's view: slots, tiles held, pause, speed
    standing: Standing
    device: str
    last_seen: float
    messages: TokenBucket
    releases: TokenBucket
    resends: TokenBucket  # bytes of blocks it may make the coordinator send again
    pauses: TokenBucket
    frame_limit: int  # the largest frame it may send now
    cancelled: dict[int, None] = field(default_factory=dict)  # recent cancelled tiles (ordered set)
    checking: set[int] = field(default_factory=set)  # tiles whose result is being verified
    blocks: set[str] = field(default_factory=set)  # keys of the blocks the device holds
    namespaces: dict[int, dict[str, int]] = field(default_factory=dict)  # source id -> {key: bytes} held
    forget: set[int] = field(default_factory=set)  # namespaces to drop, sent with the next Work
    bytes_down: int = 0
    bytes_up: int = 0
    tiles_done: int = 0
    tiles_rejected: int = 0
    compute_seconds: float = 0.0  # as reported by the device, verified tiles only
    last_sent: float = 0.0
    paused: str | None = None  # the owner's reason, while the device must not get work
    budget: int = 0  # bytes of cached blocks the device accepts (0: no limit)
    cached_bytes: int = 0
    gflop_verified: float = 0.0
    credit_sent: float = 0.0
    credit_at: float = 0.0
    big_until: float = 0.0  # until then it may still send a result for a tile it lost
    verified_at: float | None = None  # when its last result was verified
    result_at: float = -math.inf  # when its last verified result arrived
    result_gap: float | None = None  # running estimate of seconds between its verified results

    @property
    def inflight(self) -> dict[int, float]:
        """Tile id -> when it was leased (the scheduler's record)."""
        return self.seat.inflight

    @property
    def slots(self) -> int:
        return self.seat.slots

    @property
    def free(self) -> int:
        return self.seat.free

    @property
    def seconds_per_gflop(self) -> float:
        """Running estimate of a lease's turnaround (transfer, queue, compute)."""
        return self.seat.seconds_per_gflop

    @property
    def full(self) -> bool:
        return bool(self.budget) and self.cached_bytes >= self.budget

    def cancel(self, tile_id: int) -> None:
        """Its copy lost the race or was taken back: a late result is expected and ignored.
        Bounded, since a client that drops a cancelled tile before computing it never answers."""
        self.cancelled[tile_id] = None
        if len(self.cancelled) > 1024:
            del self.cancelled[next(iter(self.cancelled))]

    def hold(self, ref: BlockRef) -> None:
        self.blocks.add(ref.key)
        self.namespaces.setdefault(ref.namespace, {})[ref.key] = ref.nbytes
        self.cached_bytes += ref.nbytes

    def drop(self, namespace: int) -> dict[str, int]:
        keys = self.namespaces.pop(namespace, None)
        if keys is None:
            return {}
        self.blocks -= keys.keys()
        self.cached_bytes -= sum(keys.values())
        self.forget.add(namespace)
        return keys

    def lose(self, ref: BlockRef) -> None:
        self.blocks.discard(ref.key)
        held = self.namespaces.get(ref.namespace, {})
        if ref.key in held:
            self.cached_bytes -= held.pop(ref.key)


@dataclass
class Prediction:
    """The cost model's predicted step time against the measured one."""

    planned: list[float | None] = field(default_factory=list)  # this step's GEMMs, as submitted
    kinds: dict[str, int] = field(default_factory=dict)  # this step's partitions, by kind
    local_gemms: int = 0  # GEMMs the PS kept, all steps
    gemm_seconds: float | None = None  # last finished step: its GEMMs' predicted seconds
    last_kinds: dict[str, int] = field(default_factory=dict)
    busy: float = 0.0  # this step: seconds with at least one GEMM out
    busy_since: float | None = None
    last_busy: float | None = None  # last finished step's
    step_started: float | None = None
    measured: float | None = None  # last finished step's seconds, from one begin_step to the next

    def step_done(self, now: float) -> None:
        if self.step_started is not None:
            self.measured = now - self.step_started
            busy = self.busy + (now - self.busy_since if self.busy_since is not None else 0.0)
            self.last_busy = busy
            self.gemm_seconds = self._planned_seconds()
            self.last_kinds = dict(self.kinds)
        self.step_started = now
        self.planned.clear()
        self.kinds.clear()
        self.busy = 0.0
        self.busy_since = now if self.busy_since is not None else None

    @property
    def other(self) -> float | None:
        """The PS's own seconds in the last finished step: its time with no GEMM out."""
        return None if self.measured is None or self.last_busy is None else max(0.0, self.measured - self.last_busy)

    def _planned_seconds(self) -> float | None:
        """The step's GEMMs' predicted seconds; None unless every one of them was priced."""
        if not self.planned or any(p is None for p in self.planned):
            return None
        return float(sum(self.planned))  # type: ignore[arg-type]

    def current(self) -> float | None:
        """The step in progress, once its GEMMs are all submitted: their predicted seconds plus
        the PS's own time of the step before."""
        gemms, other = self._planned_seconds(), self.other
        return None if gemms is None or other is None else gemms + other

    def as_json(self) -> dict[str, Any]:
        """Predicted step = the GEMMs' predicted seconds + the PS's own time measured last step
        (the step's seconds with no GEMM out): the model predicts the part it plans."""
        other = self.other
        predicted = None if self.gemm_seconds is None or other is None else self.gemm_seconds + other
        return {
            "predicted_step_s": _round(predicted),
            "measured_step_s": _round(self.measured),
            "predicted_gemm_s": _round(self.gemm_seconds),
            "measured_gemm_s": _round(self.last_busy),
            "ps_other_s": _round(other),
            "partitions": self.last_kinds,
            "local_gemms": self.local_gemms,
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


@dataclass
class Progress:
    step: int = 0  # last finished step
    current: int = 0  # step whose GEMMs are being submitted
    steps: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    state: str = "starting"
    gemm_share: dict[str, Any] | None = None  # flops.GemmShare.to_dict(), once the model is built
    tokens: int = 0  # trained by this coordinator


def _all_finite(t: torch.Tensor) -> bool:
    # A NaN or an infinity anywhere makes the sum NaN or infinite, never finite, so a finite sum
    # proves every element finite. One reduction runs ~18x faster than isfinite().all(), which
    # writes a mask of the whole tensor; only a sum that overflowed needs the exact pass.
    total = t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()  # no half overflow
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


def check_finite(a: torch.Tensor, b: torch.Tensor, kind: GemmKind, cast: str | None = None) -> None:
    """Honest devices would return NaN/Inf, verification would reject them all and ban innocent
    volunteers: stop where the cause is (training diverged, or ``cast``: a value too large for the
    wire dtype the float32 operands were cast to)."""
    if _all_finite(a) and _all_finite(b):
        return
    if cast is not None:
        raise Diverged(
            f"a {kind.value} GEMM input is NaN or Inf once cast to {cast} for the wire "
            f"(fp16 holds magnitudes up to 65,504: try --wire-dtype bf16, or fp32)"
        )
    raise Diverged(f"a {kind.value} GEMM input holds NaN or Inf: training diverged (try a lower --lr)")


class Core:
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
    ) -> None:
        self.store = store
        self.job_id = job_id
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
        self._by_identity: dict[int, int] = {}  # identity -> device id, while connected
        self.gemms: dict[int, GemmState] = {}
        self.sources = Sources()
        self._tile_gemm: dict[int, int] = {}  # tile id -> gemm id, for tiles of live GEMMs
        self.sched = Scheduler(self.faults)  # which tile goes to which device, and when
        # How each GEMM is cut and who takes which tile (a LivePlanner: tests force partitions).
        self.planner = (
            planner if isinstance(planner, LivePlanner) else LivePlanner(planner, ps or PSProfile(), self.policy)
        )
        self.profiles: dict[int, DeviceProfile] = {}  # connected devices, measured live
        # (tile, device) -> [bytes of blocks its work carried, when the frame went on the wire]
        self._sent: dict[tuple[int, int], list] = {}
        self.dtype = "fp32"  # of the job's GEMMs: the dtype devices are measured and planned in
        self.prediction = Prediction()
        self._fleet_version = 0  # moves when the planner's view of the fleet may have changed
        self._fleet_keys: dict[int, tuple[float, ...]] = {}  # each device's place on the planner's grid
        self._measured: set[int] = set()  # devices with observations since the last plan
        self._dispatching = False
        self._sweep: list[int] = []  # devices still to look after in this tick round
        self._sweep_at = 0.0
        self._sweep_len = 0
        self._checked_at = -float("inf")
        self._reopened: set[int] = set()  # tiles re-opened once after every device failed them
        self._stuck_since: dict[int, float] = {}  # re-opened tiles failed everywhere again: since when
        self._aborted = False  # an Abort went out
        self.progress = Progress(steps=store.job(job_id).steps)
        self.finished = False
        self.verify_seconds = 0.0
        # Largest residual/tolerance accepted, per GEMM kind: how close honest work comes to a reject.
        self.verify_worst_honest: dict[str, float] = {}

    def _at(self, now: float) -> float:
        return now + self.epoch

    # ------------------------------------------------------------------ devices

    @property
    def active_devices(self) -> int:
        """Connected and not paused by their owners: the devices that can take work now."""
        return sum(1 for d in self.devices.values() if d.paused is None)

    def is_operator(self, token: str) -> bool:
        return self.gate.is_operator(token)

    def connect(self, hello: Hello, nonce: str, now: float) -> tuple[int, list[Outbound]]:
        """Admit a device that answered ``nonce`` with ``hello``. Raises AuthError (the server
        closes with its code): wrong token or credential, banned, revoked, cooling off, in use."""
        admission: Admission = self.gate.admit(hello, nonce, now, self._at(now))
        if admission.identity in self._by_identity:
            raise AuthError(CloseCode.IN_USE, "this identity is already connected")
        self.gate.check_cooloff(admission.identity, now)
        standing = self.gate.standing(admission.identity)
        if standing.budgets is None:  # kept with the identity: reconnecting does not refill them
            standing.budgets = (
                self.limits.releases.bucket(),
                self.limits.resends.bucket(),
                self.trust.reconnects.bucket(),
            )
        if not standing.budgets[2].take(now):
            raise AuthError(CloseCode.RATE_LIMITED, "reconnecting too often; try again in a while")
        info = DeviceInfo(
            name=admission.name,
            platform=hello.platform,
            cores=max(1, hello.cores),
            memory_bytes=hello.memory_bytes,
            device=hello.device,
            gflops=hello.gflops,
        )
        device_id = self.store.add_device(self.job_id, info, self._at(now), admission.identity)
        asked = min(hello.slots, self.trust.max_slots)
        # Until it has returned work, assume a device is 4x slower than its own (bounded) claim.
        claim = min(max(hello.gflops, CLAIM_GFLOPS[0]), CLAIM_GFLOPS[1])
        lim = self.limits
        seat = self.sched.join(
            device_id,
            slots=standing.slots(self.trust, asked),
            seconds_per_gflop=4.0 / claim,
            trusted=not standing.on_probation(self.trust),
            paused=bool(hello.paused),
        )
        dev = DeviceState(
            device_id,
            admission.identity,
            admission.name,
            asked,
            seat,
            standing,
            hello.device,
            now,
            lim.messages.bucket(),
            standing.budgets[0],
            standing.budgets[1],
            lim.pauses.bucket(),
            lim.idle_frame,
            budget=hello.block_budget,
        )
        self.devices[device_id] = dev
        self._by_identity[admission.identity] = device_id
        self.profiles[device_id] = DeviceProfile(claim, hello.block_budget or PRIOR_MEMORY)
        self._fleet_changed()
        if hello.paused:  # its owner is busy: it gets nothing until it resumes
            dev.paused = hello.paused
            self.store.set_device_state(device_id, "paused", self._at(now), hello.paused)
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
        return device_id, out + self._dispatch(now)

    def disconnect(
        self, device_id: int, now: float, reason: str = "connection closed", state: str | None = None
    ) -> list[Outbound]:
        """A device is gone: its outstanding tiles go straight back to the queue and to others."""
        if device_id not in self.devices:
            return []
        self._remove(device_id, now, reason, state)
        return self._dispatch(now)

    def _remove(self, device_id: int, now: float, reason: str, state: str | None = None) -> None:
        """Forget a device and end its leases. Never dispatches: only the public entry points
        (connect, handle, tick, submit, disconnect) do, once, at their end."""
        dev = self.devices.pop(device_id, None)
        if dev is None:
            return
        self._by_identity.pop(dev.identity, None)
        graceful = reason in ("left", SHUTDOWN)  # neither is the device's fault
        held = list(dev.inflight)
        if reason != SHUTDOWN and self._held_long(dev, held, now):
            dev.standing.cut(self.trust, now)  # it is gone already: it just may not come back yet
        self.store.release_device(device_id, "released" if graceful else "lost", self._at(now), reason)
        self.sched.leave(device_id)
        profile = self.profiles.pop(device_id, None)
        self._fleet_keys.pop(device_id, None)
        self._fleet_changed()
        for tile_id in held:
            self._sent.pop((tile_id, device_id), None)
        if held and not graceful:
            self.store.credit_device(device_id, lost=len(held), now=self._at(now))
            if profile is not None:
                profile.failed(now)
        self.store.set_device_state(device_id, state or "offline", self._at(now), reason)

    def _drop(
        self, dev: DeviceState, code: CloseCode, reason: str, now: float, state: str | None = None
    ) -> list[Outbound]:
        """Close a device and forget it (the caller dispatches its tiles to others)."""
        self._remove(dev.id, now, reason, state)
        return [Close(dev.id, code, reason)]

    # ------------------------------------------------------------------ messages

    def handle(self, device_id: int, msg: Message, now: float) -> list[Outbound]:
        """Act on one message from a device; a result is verified here, on this thread."""
        got = self.receive(device_id, msg, now)
        if not isinstance(got, Check):
            return got
        verdict, seconds = got.run(self.rng)
        return self.settle(got, verdict, seconds, now)

    def receive(self, device_id: int, msg: Message, now: float) -> list[Outbound] | Check:
        """``handle``, except that a result to verify comes back as a ``Check``: the caller runs
        it (on another thread if it likes: see ``Check``) and passes its verdict to ``settle``."""
        dev = self.devices.get(device_id)
        if dev is None:
            return []
        dev.last_seen = now
        if not dev.messages.take(now):
            return self._drop(dev, CloseCode.RATE_LIMITED, "too many messages", now) + self._dispatch(now)
        if isinstance(msg, Result):
            return self._check_of(dev, msg)
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
            self.sched.update(dev.id, paused=False)
            self._fleet_changed()
            self.store.set_device_state(dev.id, "online", self._at(now))
            return self._dispatch(now)
        if isinstance(msg, Leave):
            return self.disconnect(device_id, now, "left")
        return [
            self._send(
                device_id, Error(Code.UNEXPECTED, f"{type(msg).__name__} is not a message a device may send"), now
            )
        ]

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
        share = max(1, math.ceil(self._sweep_len * min(1.0, (now - self._sweep_at + TICK_GUESS) / SWEEP)))
        due = self._sweep_len - len(self._sweep)
        for _ in range(max(0, share - due)):
            dev = self.devices.get(self._sweep.pop()) if self._sweep else None
            if dev is None:
                continue
            if now - dev.last_seen > self.faults.heartbeat_timeout:
                silence = f"no heartbeat for {now - dev.last_seen:.1f} s"
                out.extend(self._drop(dev, CloseCode.SILENT, silence, now))
                continue
            if dev.gflop_verified != dev.credit_sent and now - dev.credit_at >= CREDIT_INTERVAL:
                out.append(self._credit(dev, now))  # verified work only, never claims
            if now - dev.last_sent >= self.faults.heartbeat:
                out.append(self._send(dev.id, Heartbeat(self._at(now)), now))
            if dev.frame_limit > self.limits.idle_frame and not dev.inflight and now >= dev.big_until:
                dev.frame_limit = self.limits.idle_frame
                out.append(Limit(dev.id, dev.frame_limit))
        out.extend(self._dispatch(now))
        self.store.flush()  # the hot path's grouped writes are durable within a tick or two
        return out

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
            failures = [
                lease for lease in self.store.leases(tile_id) if lease.outcome in ("rejected", "released", "revoked")
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
            if state not in (REVOKED, BANNED):
                continue
            row = self.store.identity(dev.identity)
            why = f": {row.reason}" if row is not None and row.reason else ""
            if state == REVOKED:
                out.extend(
                    self._drop(dev, CloseCode.REVOKED, f"credential revoked by the operator{why}", now, "revoked")
                )
            else:
                out.extend(self._drop(dev, CloseCode.BANNED, f"banned by the operator{why}", now, "banned"))
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

    def _regrade(self, dev: DeviceState) -> None:
        """Its slots: what its record has earned, and no more than it verifies in a prefetch
        window at its measured throughput."""
        slots = dev.standing.slots(self.trust, dev.asked)
        if dev.result_gap is not None and dev.result_gap > 0:
            slots = min(slots, max(1, math.ceil(self.trust.prefetch_seconds / dev.result_gap)))
        self.sched.update(dev.id, slots=slots, trusted=not dev.standing.on_probation(self.trust))

    def _lost_tile(self, dev: DeviceState, now: float) -> None:
        """A lease of ``dev`` ended without its result: it may still send one for a while."""
        dev.big_until = now + self.limits.result_grace

    def _check_of(self, dev: DeviceState, msg: Result) -> list[Outbound] | Check:
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
            return Check(dev, msg, gemm, tile, ra.logical, rb.logical, ((ra, rb),), dev.last_seen)
        # The pieces' range, as views; norms from the pieces' cached ones.
        return Check(
            dev,
            msg,
            gemm,
            tile,
            a_block(gemm.a, tile),
            b_block(gemm.b, tile),
            tuple(gemm.pairs_of(tile)),
            dev.last_seen,
        )

    def settle(self, check: Check, verdict: Verdict, seconds: float, now: float) -> list[Outbound]:
        """Act on a result's verdict. The device may have left, or lost the tile to a copy or a
        deadline, while it was checked: a good result then comes too late and is dropped (as a
        losing copy's would be), a forgery still counts against its identity. Once the GEMM has
        completed, its operands may have changed under the check (an optimizer step): then the
        verdict means nothing and is dropped, whatever it says."""
        dev, msg, gemm, tile = check.dev, check.msg, check.gemm, check.tile
        dev.checking.discard(msg.tile_id)
        self.verify_seconds += seconds
        current = self.devices.get(dev.id) is dev and msg.tile_id in dev.inflight
        if not current:
            if verdict.ok or self.gemms.get(gemm.id) is not gemm:
                return []
            dropped = self._forged(dev, now)
            return dropped + self._dispatch(now) if dropped else []
        leased_at = dev.inflight[msg.tile_id]
        arrived = check.arrived
        nbytes = msg.c.numel() * msg.c.element_size()
        dev.bytes_up += nbytes
        out: list[Outbound] = []
        sent, on_wire = self._sent.pop((msg.tile_id, dev.id), (0, None))
        if not verdict.ok:
            self._failed(dev.id, now)
            self.sched.release(msg.tile_id, dev.id, bar=True)
            self.store.end_lease(msg.tile_id, dev.id, "rejected", self._at(now), verdict.reason)
            out.append(
                self._send(
                    dev.id, Error(Code.REJECTED, f"tile {msg.tile_id} failed verification: {verdict.reason}"), now
                )
            )
            return out + self._forged(dev, now) + self._dispatch(now)
        kind = gemm.kind.value
        self.verify_worst_honest[kind] = max(self.verify_worst_honest.get(kind, 0.0), verdict.worst_ratio)
        losers = self.sched.done(msg.tile_id, dev.id)
        self.store.end_lease(msg.tile_id, dev.id, "verified", self._at(now))
        gflop = tile.flops / 1e9
        self.store.credit_device(dev.id, verified=1, gflop=gflop, now=self._at(now))
        dev.gflop_verified += gflop
        dev.tiles_done += 1
        dev.standing.verified(self.trust)
        if dev.verified_at is not None:  # its throughput: seconds between verified results
            gap = min(arrived - dev.verified_at, MAX_SECONDS_PER_GFLOP)
            dev.result_gap = gap if dev.result_gap is None else (1 - EMA) * dev.result_gap + EMA * gap
        dev.verified_at = arrived
        self._regrade(dev)
        dev.compute_seconds += msg.seconds
        # From its work frame going on the wire (not from the lease: a frame queued behind the
        # device's other work is that work's link time, not this one's).
        start = leased_at if on_wire is None else max(leased_at, on_wire)
        # A tile waits on a device only behind the work before it, which was done by the time
        # its result arrived here: a claimed wait beyond that is not believed.
        waited = min(msg.waited, max(0.0, dev.result_at - start) + WAIT_SLACK)
        dev.result_at = arrived
        self.profiles[dev.id].verified(tile.flops, msg.seconds, waited, arrived - start, sent, nbytes, arrived)
        self._measured.add(dev.id)
        if gflop > 0:
            turnaround = (1 - EMA) * dev.seconds_per_gflop + EMA * (arrived - leased_at) / gflop
            self.sched.update(dev.id, seconds_per_gflop=min(turnaround, MAX_SECONDS_PER_GFLOP))
        stallers = []
        for loser in losers:  # other copies lost the race: tell their devices to drop them
            self._sent.pop((msg.tile_id, loser), None)
            other = self.devices.get(loser)
            if other is not None:
                other.cancel(msg.tile_id)
                self._lost_tile(other, now)
                out.append(self._send(loser, Cancel((msg.tile_id,), "another copy was verified first"), now))
                if msg.tile_id in other.checking:  # it did answer: its result is being checked
                    self._regrade(other)
                elif other.standing.overtaken(self.trust):  # it never answers: a staller
                    stallers.append(other)
                else:
                    self._regrade(other)
        gemm.parts[tile.index] = msg.c
        if gemm.done:
            self._complete(gemm, now)
        for other in stallers:  # only once this tile is settled everywhere
            if other.id in self.devices:
                out.extend(
                    self._cut(
                        other,
                        f"{other.standing.unanswered} tiles in a row went to other devices without a result from it",
                        now,
                    )
                )
        return out + self._dispatch(now)

    def _forged(self, dev: DeviceState, now: float) -> list[Outbound]:
        """Count a rejected result against its identity; when that bans it, drop the identity's
        live session (this one, or a newer one if it reconnected meanwhile)."""
        self.store.credit_device(dev.id, rejected=1, now=self._at(now))
        dev.tiles_rejected += 1
        if not dev.standing.rejected(self.trust):
            return []
        reason = "results failed verification"
        self.gate.ban(dev.identity, reason, self._at(now))
        live = self.devices.get(self._by_identity.get(dev.identity, -1))
        return [] if live is None else self._drop(live, CloseCode.BANNED, reason, now, "banned")

    def _on_pause(self, dev: DeviceState, reason: str, now: float) -> list[Outbound]:
        """The owner needs the machine: its tiles go to others at once; it stays connected."""
        dev.paused = reason
        self.sched.update(dev.id, paused=True)
        self._fleet_changed()
        self.store.set_device_state(dev.id, "paused", self._at(now), reason)
        # A paused client keeps its cached blocks: they serve it again once it resumes.
        return self._give_back(dev, tuple(dev.inflight), f"paused: {reason}", now, blocks_lost=False)

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
            resend = sum(held.values())
            if resend and not dev.resends.take(now, resend):
                return self._drop(dev, CloseCode.RATE_LIMITED, "too many blocks to send again", now) + self._dispatch(
                    now
                )
        reason = f"{msg.why.value}: {msg.reason}" if msg.reason else msg.why.value
        return self._give_back(dev, msg.tile_ids, reason, now, blocks_lost=missing, bar=not missing)

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
        bar: bool = False,
    ) -> list[Outbound]:
        given = 0
        stalled = self._held_long(dev, [t for t in set(tile_ids) if t in dev.inflight], now)
        for tile_id in tile_ids:
            if tile_id not in dev.inflight:
                continue  # already finished or re-issued: nothing to give back
            given += 1
            self._sent.pop((tile_id, dev.id), None)
            if bar:  # its compute failed
                self._failed(dev.id, now)
            self.sched.release(tile_id, dev.id, bar=bar)
            self._lost_tile(dev, now)
            self.store.end_lease(tile_id, dev.id, "released", self._at(now), reason, bar=bar)
            if blocks_lost:
                for ref in {r.key: r for pair in self._pairs_of(tile_id) for r in pair}.values():
                    dev.lose(ref)
                    self.sched.drops_blocks(dev.id, (ref.key,))
                self.sched.update(dev.id, full=dev.full)
        out = self._cut(dev, "it kept giving tiles back near their deadlines", now) if stalled else []
        return out + self._dispatch(now) if given else out  # nothing changed: nothing to dispatch

    def _held_long(self, dev: DeviceState, tile_ids: list[int], now: float) -> bool:
        """Leases it gives back (or loses by leaving) after holding them for most of their
        deadline count as unanswered, as if another copy had won: holding tiles until just
        before their deadlines and then letting go is stalling. True when it must be cut."""
        cut = False
        for tile_id in tile_ids:
            hold = self.sched.hold(tile_id, dev.id)
            if hold is not None and now - hold.leased_at > (hold.soft - hold.leased_at) / 2:
                cut = dev.standing.overtaken(self.trust) or cut
        return cut

    def _complete(self, gemm: GemmState, now: float) -> None:
        product = functools.partial(assemble, gemm.plan, gemm.parts, gemm.out_dtype or gemm.a.dtype)
        self.store.finish_gemm(gemm.id, self._at(now))
        self.sched.drop_gemm(gemm.id)
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

    def begin_step(self, step: int, now: float | None = None) -> None:
        """A training step starts: blocks still kept from the last one will not be read again."""
        if now is not None:
            self.prediction.step_done(now)
        self.progress.current = step
        for namespace in self.sources.sweep():
            self._forget(namespace)

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
        behind those of GEMMs submitted later without it, which the trainer waits on."""
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
        if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported GEMM dtypes {a.dtype}, {b.dtype}")
        if not finite_checked:
            check_finite(a, b, kind)
        m, k = a.shape
        n = b.shape[1]
        self.dtype = DTYPE_NAMES[str(a.dtype)]
        live = self._plan(m, n, k, kind)
        pred = self.prediction
        pred.planned.append(live.seconds)
        label = (
            "uniform"
            if live.plan is None
            else "split-k summed"
            if live.plan.local_sum and live.plan.kind.value == "split-k"
            else live.plan.kind.value
        )
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
            self.sources.acquire(a, retain=kind in (GemmKind.FORWARD, GemmKind.GRAD_INPUT)),
            self.sources.acquire(b, retain=False),
        )
        gemm_id = self.store.next_gemm_id()
        pieces = [q for t in tiles for q in piece_tiles(plan, t)]  # one-piece tiles: the blocks
        a_blocks = {(q.i, q.p): block_ref(sources[0], gemm_id, f"a{q.i}.{q.p}", a_block(a, q)) for q in pieces}
        b_blocks = {(q.p, q.j): block_ref(sources[1], gemm_id, f"b{q.p}.{q.j}", b_block(b, q)) for q in pieces}
        new = [NewTile(t.index, a_blocks[(t.i, t.p)].key, b_blocks[(t.p, t.j)].key, t.flops) for t in tiles]
        ids = self.store.add_gemm(
            gemm_id, self.job_id, self.progress.current, kind.value, (m, n, k), new, self._at(now)
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
        if not self.gemms and pred.busy_since is None:
            pred.busy_since = now
        self.gemms[gemm_id] = gemm
        for tid in ids:
            self._tile_gemm[tid] = gemm_id
        owners = live.owners
        # Ahead of deferred GEMMs' queued tiles (FIFO otherwise): the trainer waits on this one.
        front = not deferred and any(g.deferred for g in self.gemms.values() if g is not gemm)
        self.sched.add_gemm(
            gemm_id,
            [
                UnitSpec(tid, gemm_id, nt.a_key, nt.b_key, nt.flops, owners.get(t.index))
                for tid, nt, t in zip(ids, new, tiles)
            ],
            front=front,
        )
        return gemm_id, self._dispatch(now)

    def _plan(self, m: int, n: int, k: int, kind: GemmKind) -> LivePlan:
        """The cost model's plan for the devices that may take work now. Their classes are
        rebuilt (O(devices)) only when the fleet changed: a device joined, left, paused or
        resumed, or its measured profile moved on the planner's grid."""

        def active() -> dict[int, Profile]:
            return {d: self.profiles[d].profile(self.dtype) for d, dev in self.devices.items() if dev.paused is None}

        # Devices measured since the last plan: has any moved on the planner's grid? (Here, once
        # per GEMM, rather than at every result.)
        for device_id in self._measured:
            profile = self.profiles.get(device_id)
            key = None if profile is None else fleet_key(profile.profile(self.dtype), self.dtype)
            if key is not None and self._fleet_keys.get(device_id) != key:
                self._fleet_keys[device_id] = key
                self._fleet_changed()
        self._measured.clear()
        return self.planner.plan(m, n, k, kind, self.dtype, active, self._fleet_version)

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
        for decision in decisions:
            dev = self.devices.get(decision.device)
            if dev is None:  # cut earlier in this batch: the scheduler has let its tiles go already
                self._sent.pop((decision.unit, decision.device), None)
                continue
            if isinstance(decision, Assign):
                out.extend(self._lease(dev, decision.unit, decision.copy, now))
            elif isinstance(decision, Overdue):
                dev.standing.late()
                self._regrade(dev)
            else:
                out.extend(self._take_back(dev, decision, now))
        return out

    def _take_back(self, dev: DeviceState, decision: Reclaim, now: float) -> list[Outbound]:
        """The scheduler revoked ``dev``'s lease; leases taken back in a row cut the device."""
        tile_id, reason = decision.unit, decision.reason
        self._sent.pop((tile_id, dev.id), None)
        self._failed(dev.id, now)
        dev.cancel(tile_id)
        self._lost_tile(dev, now)
        # Barred from the tile: it goes to someone else, never straight back to this device.
        self.store.end_lease(tile_id, dev.id, "revoked", self._at(now), reason, bar=True)
        self.store.credit_device(dev.id, revoked=1, now=self._at(now))
        out: list[Outbound] = [self._send(dev.id, Cancel((tile_id,), f"lease taken back: {reason}"), now)]
        if dev.standing.taken_back(self.trust):
            out.extend(self._cut(dev, "its tiles kept running past their deadlines", now))
        else:
            self._regrade(dev)
        return out

    def _cut(self, dev: DeviceState, why: str, now: float) -> list[Outbound]:
        """Disconnect a device that holds tiles without returning them; it may come back after a
        cool-off (doubling with every cut)."""
        wait = dev.standing.cut(self.trust, now)
        return self._drop(dev, CloseCode.STALLING, f"{why}; come back in {wait:.0f} s", now)

    def _lease(self, dev: DeviceState, tile_id: int, copy: str | None, now: float) -> list[Outbound]:
        """Record the scheduler's lease in the store and send the work."""
        at = self._at(now)
        claimed = (
            self.store.lease_tile(tile_id, dev.id, at)
            if copy is None
            else self.store.claim_copy(tile_id, dev.id, copy, at)
        )
        if claimed is None:
            # The scheduler and the store disagree (a bug, never a peer's doing): say so, and let
            # the scheduler give the tile to someone else rather than stop training.
            log.error("store refused the scheduler's lease of tile %d to device %d; tile re-queued", tile_id, dev.id)
            self.sched.release(tile_id, dev.id)
            return []
        gemm = self.gemms[self._tile_gemm[tile_id]]
        tile = gemm.tiles[tile_id]
        out: list[Outbound] = []
        need = gemm.result_bytes(tile) + self.limits.frame_slack
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
        blocks = []
        sent = 0
        for ref in {r.key: r for pair in pairs for r in pair}.values():
            if ref.key not in dev.blocks:
                blocks.append(Block(ref.key, ref.wire()))
                dev.hold(ref)
                self.sched.holds_block(dev.id, ref.key)
                sent += ref.nbytes
        dev.bytes_down += sent
        self._sent[(tile_id, dev.id)] = [sent, None]
        if dev.full:
            self.sched.update(dev.id, full=True)
        more = tuple(key for pa, pb in pairs[1:] for key in (pa.key, pb.key))
        more_t = tuple(flag for pa, pb in pairs[1:] for flag in (pa.transposed, pb.transposed))
        return Work(tile_id, ra.key, rb.key, ra.transposed, rb.transposed, tuple(blocks), forget, more, more_t)

    # ------------------------------------------------------------------ job

    def finish(self, now: float, reason: str = "job complete") -> list[Outbound]:
        """The job is over: tell every device. The server then closes their sockets."""
        self.finished = True
        self.progress.state = "finished"
        out: list[Outbound] = []
        for dev in list(self.devices.values()):
            out.append(self._credit(dev, now))  # the final tally, before goodbye
            out.append(self._send(dev.id, Finished(reason), now))
        return out

    def status(self, now: float) -> dict[str, Any]:
        """The snapshot ``cleave status`` renders (its --json keys are a contract). Bounded: at
        most ``Limits.status_rows`` devices are listed, connected ones first; all are counted."""
        counts = self.store.tile_counts(self.job_id)
        cap = self.limits.status_rows
        rows = self.store.devices(self.job_id, states=("online", "paused"), limit=cap)
        if len(rows) < cap:
            rows += self.store.devices(self.job_id, states=("offline", "banned", "revoked"), limit=cap - len(rows))
        listed = []
        for row in rows:
            live = self.devices.get(row.id)
            if live is None:
                state = "offline" if row.state in ("online", "paused") else row.state
            elif live.paused is not None:
                state = "paused"
            else:
                state = "working" if live.inflight else "idle"
            listed.append(
                {
                    "id": row.id,
                    "identity": row.identity_id,
                    "name": row.name,
                    "state": state,
                    "device": row.device,
                    "tiles_done": row.tiles_done,
                    "tiles_rejected": row.tiles_rejected,
                    "tiles_lost": row.tiles_lost,
                    "tiles_revoked": row.tiles_revoked,
                    "reliability": round(row.reliability, 4),
                    # Its benchmark at join, then the rate measured from its verified tiles.
                    "gflops": round(self.profiles[row.id].measured_gflops(row.gflops) if live else row.gflops, 2),
                    "gflop_verified": round(row.gflop_verified, 3),
                    "reason": row.reason,
                    "inflight": len(live.inflight) if live else 0,
                    "slots": live.slots if live else 0,
                    "probation": live.standing.on_probation(self.trust) if live else None,
                    "mb_down": round((live.bytes_down if live else 0) / 1e6, 2),
                    "mb_up": round((live.bytes_up if live else 0) / 1e6, 2),
                    "compute_s": round(live.compute_seconds, 4) if live else None,
                    "profile": self.profiles[row.id].as_json(self.dtype) if row.id in self.profiles else None,
                }
            )
        p = self.progress
        tiles = {
            k: counts[k]
            for k in (
                "queued",
                "leased",
                "verified",
                "rejected",
                "requeued",
                "expired",
                "speculative",
                "cancelled",
                "lost",
                "revoked",
            )
        }
        return {
            "job": {
                "name": self.job_name,
                "step": p.step,
                "steps": p.steps,
                "loss": p.loss,
                "state": p.state,
                "tokens_per_s": round(p.tokens_per_s, 1),
                "gemm_share": p.gemm_share,
            },
            "devices": listed,
            "device_counts": {"connected": len(self.devices), **self.store.device_states(self.job_id)},
            "tiles": tiles,
            "queue_depth": counts["queued"],
            "gemms_in_flight": len(self.gemms),
            "leaderboard": [
                {"identity": r.identity_id, "name": r.name, "gflop": round(r.gflop, 3), "tiles": r.tiles}
                for r in self.store.leaderboard(10)
            ],
            "plan": {
                "planner": self.planner.planner.value,
                **self.prediction.as_json(),
                "ps": {
                    "egress_mbps": round(self.planner.ps.egress * 8 / 1e6, 1),
                    "ingress_mbps": round(self.planner.ps.ingress * 8 / 1e6, 1),
                    "gflops": round(self.planner.ps.flops_per_s(self.dtype) / 1e9, 2),
                    "verify_gflops": round(self.planner.ps.verify_flops / 1e9, 2),
                },
            },
            "verify": {
                "seconds": round(self.verify_seconds, 4),
                "worst_honest_ratio": round(max(self.verify_worst_honest.values(), default=0.0), 4),
                "worst_honest_by_kind": {k: round(v, 4) for k, v in sorted(self.verify_worst_honest.items())},
            },
            "time": self._at(now),
        }
