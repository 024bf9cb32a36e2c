"""One connection of a volunteer to its coordinator, as a protocol state machine with no I/O.

In the style of websockets' sans-I/O ``protocol.py``: a ``Session`` holds what one connection
knows (the coordinator's id, the cached blocks, the tiles queued, held and cancelled, the
heartbeat interval, when the coordinator was last heard) and decides what to do. It opens no
socket, starts no task or thread, reads no clock and multiplies nothing. client/runner.py owns
the websocket, the compute thread, the owner's policy and reconnects, and drives it::

    runner (I/O)                                 Session (decisions)
    ------------                                 -------------------
    a frame arrives at ``now``         ------>   receive_frame(frame, now) -> events
    the heartbeat timer fires          ------>   tick(now, wall) -> events (HangUp when silent)
    (standby: ``Sleeping``; wake: ``Woken``, and the next beat is due at once)
    the owner's policy changes         ------>   pause(reason) / resume()
    the compute task wants a tile      ------>   pop(), then start(queued, now) -> Tile or None
    the product is done / failed       ------>   computed(tile, c, seconds) -> Result or None / failed(tile, why)
    the connection closed              ------>   closed(code, reason) -> outcome, or raises Refused / Banned
    after each call                    <------   messages_to_send(): Hello, Heartbeat, Release, Pause, Resume

Events (``Welcomed``, ``TileQueued``, ``Credited``, ``Enrolled``, ``ErrorReceived``, ``Ended``,
``HangUp``, ``Sleeping``, ``Woken``) tell the runner what happened; it acts on them (stores a
credential, restarts its heartbeat timer, wakes the compute task, frees memory, updates what the
owner sees). Results are returned
rather than queued, because an emulated device delivers them later (its paced uplink).

Times are monotonic seconds passed in as ``now``; ``wall`` (Unix seconds) only stamps heartbeats.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from cleave.client.credentials import Credential as StoredCredential
from cleave.wire import auth
from cleave.wire.codes import CloseCode, Code, Name, ReleaseWhy, StandbyWhy
from cleave.wire.errors import Banned, ClientError, ProtocolError, Refused
from cleave.wire.messages import (
    DEFAULT_HEARTBEAT,
    MAX_KEEPALIVE,
    MIN_KEEPALIVE,
    STANDBY_MISSES,
    Cancel,
    Challenge,
    Credential,
    Credit,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Message,
    Pause,
    Redirect,
    Release,
    Result,
    ResultBatch,
    Resume,
    Standby,
    Wake,
    Welcome,
    Work,
    WorkBatch,
    decode,
)

log = logging.getLogger("cleave.client")

SILENCE_FACTOR = 15  # a coordinator silent this many heartbeats is gone (a big Work frame takes a while)
MIN_HEARTBEAT, MAX_HEARTBEAT = 0.1, 60.0  # the interval a Welcome may set, clamped to these

# Closes after which reconnecting cannot help.
_PERMANENT: dict[CloseCode, type[ClientError]] = {CloseCode.REVOKED: Refused, CloseCode.BANNED: Banned}

CredentialLookup = Callable[[str], "StoredCredential | None"]
Place = Callable[[torch.Tensor], torch.Tensor]
Arrival = Callable[[int], float]


# --------------------------------------------------------------------------- what comes out


@dataclass(frozen=True)
class Welcomed:
    """The coordinator accepted this device; ``heartbeat`` is the interval now kept (clamped)."""

    device_id: int
    identity: int
    job: str
    heartbeat: float


@dataclass(frozen=True)
class TileQueued:
    """A tile arrived and waits in the queue (``pop``)."""

    tile_id: int


@dataclass(frozen=True)
class Credited:
    """Verified work: this client's, over every connection so far, and its identity's in total."""

    gflop: float
    total_gflop: float


@dataclass(frozen=True)
class Enrolled:
    """The coordinator issued a credential: store it under ``coordinator`` for the next connections."""

    coordinator: str
    identity: int
    secret: bytes


@dataclass(frozen=True)
class ErrorReceived:
    """The coordinator refused something this device sent; ``rejected``: a result failed verification."""

    code: Code
    message: str

    @property
    def rejected(self) -> bool:
        return self.code is Code.REJECTED


class Ending(Name):
    """How a session ended, where the runner acts on it (any other outcome is text for the owner)."""

    FINISHED = "finished"  # the job is complete
    STOPPED = "stopped"  # the owner stopped the client
    REDIRECTED = "redirected"  # sent to another rank of a tier: connect there at once


@dataclass(frozen=True)
class Ended:
    """The session is over on the protocol's side (``outcome``: ``Ending.FINISHED`` when the job
    is complete, else why, in words); the runner leaves the connection."""

    outcome: str


@dataclass(frozen=True)
class HangUp:
    """Close the connection with ``code`` and ``reason``: the coordinator went silent for ``silent``
    seconds. How the close ends is still classified by ``closed``."""

    code: CloseCode
    reason: str
    silent: float


@dataclass(frozen=True)
class Redirected:
    """The coordinator (a rank of a tier) sent this newcomer to another rank: connect to ``url``
    and enrol there with ``ticket``. The session is over."""

    url: str
    rank: int
    ticket: str
    reason: str


@dataclass(frozen=True)
class Sleeping:
    """The coordinator has no work for this device for now (``reason``): its blocks and tiles are
    dropped (free the memory they held), and it beats every ``keepalive`` seconds until woken."""

    keepalive: float
    reason: StandbyWhy


@dataclass(frozen=True)
class Woken:
    """The coordinator needs this device again: its next heartbeat (the wake's answer) is due now."""


Event = Welcomed | TileQueued | Credited | Enrolled | ErrorReceived | Ended | HangUp | Redirected | Sleeping | Woken


@dataclass(frozen=True)
class Queued:
    """A tile waiting on this device: its work and when its blocks were usable (``ready``)."""

    work: Work
    ready: float


@dataclass(frozen=True)
class Tile:
    """A tile to compute now: ``a @ b`` (``flops`` of it), after ``waited`` seconds queued."""

    tile_id: int
    a: torch.Tensor
    b: torch.Tensor
    flops: float
    waited: float


# --------------------------------------------------------------------------- the session


class Session:
    """The protocol state of one connection (module docstring). Not thread-safe: one event loop.

    ``hello`` is this device's hello without its credentials (name, platform, rate, slots...);
    the session adds a proof from ``credential(coordinator_id)`` or enrols with ``token``.
    ``paused`` (a reason, or empty) carries the owner's pause over from an earlier connection;
    ``credit_before`` the verified GFLOP of earlier connections. ``place`` keeps a block where
    tiles are computed (a GPU); ``arrival(nbytes)`` says when a work frame that size is usable
    (an emulated link), by default the moment it arrives.
    """

    def __init__(
        self,
        hello: Hello,
        *,
        now: float,
        token: str = "",
        ticket: str = "",
        credential: CredentialLookup = lambda coordinator: None,
        credentials_file: str = "",
        paused: str = "",
        credit_before: float = 0.0,
        place: Place | None = None,
        arrival: Arrival | None = None,
    ) -> None:
        self._hello = hello
        self._token = token
        self._ticket = ticket  # from a redirect: enrols here instead of the join token
        self.welcomed = False
        self._credential = credential
        self._credentials_file = credentials_file
        self._place = place
        self._arrival = arrival
        self.paused = paused  # why the owner paused this machine; empty while it may work
        self.coordinator: str | None = None  # its id, from the challenge; None until then
        self.enrolling = False  # the hello carried the join token, not a proof
        self.interval = DEFAULT_HEARTBEAT
        self.keepalive: float | None = None  # in standby: seconds between its heartbeats; None: awake
        # The most results one frame may carry: the hello's batch (the coordinator's frame limit
        # allows that many of the tiles it leases, and no device holds more than it leased).
        self.batch = max(1, hello.batch)
        self.blocks: dict[str, torch.Tensor] = {}  # the block cache, by key
        self.ended: str | None = None  # the outcome, once the protocol ended the session
        self._credit_before = credit_before
        self._queue: deque[Queued] = deque()
        self._assigned: set[int] = set()  # received and not yet answered
        self._cancelled: set[int] = set()  # of those, the ones nobody wants back
        self._heard = now
        self._next_beat = now + self.interval
        self._outgoing: list[Message] = []

    # ---------------------------------------------------------------- state

    @property
    def queued(self) -> int:
        """Tiles waiting to be computed."""
        return len(self._queue)

    @property
    def held(self) -> frozenset[int]:
        """Tiles received and not yet answered (queued or computing)."""
        return frozenset(self._assigned)

    @property
    def next_beat(self) -> float:
        """When ``tick`` next has something to do: send a heartbeat, or hang up."""
        return self._next_beat

    def messages_to_send(self) -> list[Message]:
        """Messages for the coordinator, in order, since the last call (the runner encodes them)."""
        out, self._outgoing = self._outgoing, []
        return out

    # ---------------------------------------------------------------- input

    def receive_frame(self, frame: bytes | bytearray | memoryview, now: float) -> list[Event]:
        """A frame from the coordinator arrived at ``now``. A frame that does not decode ends the
        session if it is the first; later ones are logged and ignored."""
        try:
            msg = decode(frame)
        except ProtocolError as exc:
            self._heard = now
            if self.coordinator is None:
                return self._end(f"the coordinator's first frame was not understood ({exc})")
            log.error("coordinator sent a bad frame: %s", exc)
            return []
        return self.receive(msg, now, len(frame))

    def receive(self, msg: Message, now: float, nbytes: int = 0) -> list[Event]:
        """A decoded message from the coordinator, ``nbytes`` on the wire, arrived at ``now``."""
        self._heard = now
        if self.ended is not None:
            return []
        if self.coordinator is None:
            return self._on_challenge(msg)
        if isinstance(msg, Work):
            return self._on_work(msg, now if self._arrival is None else self._arrival(nbytes))
        if isinstance(msg, WorkBatch):  # as its works one after another, all usable when the frame is
            ready = now if self._arrival is None else self._arrival(nbytes)
            return [event for work in msg.works for event in self._on_work(work, ready)]
        if isinstance(msg, Cancel):
            # Another copy won: skip it, or drop its result. Cancels for tiles already answered need
            # no memory.
            self._cancelled.update(t for t in msg.tile_ids if t in self._assigned)
        elif isinstance(msg, Credit):
            # Per connection on the coordinator's side; this client's total spans reconnects.
            return [Credited(self._credit_before + msg.session_gflop, msg.total_gflop)]
        elif isinstance(msg, Credential):
            return [Enrolled(self.coordinator, msg.identity, bytes.fromhex(msg.secret))]
        elif isinstance(msg, Redirect):
            if self.welcomed:  # a redirect answers a hello, never a session under way
                log.error("coordinator sent a redirect after its welcome; ignored")
                return []
            self.ended = Ending.REDIRECTED
            return [Redirected(msg.url, msg.rank, msg.ticket, msg.reason)]
        elif isinstance(msg, Welcome):
            self.welcomed = True
            self.interval = min(max(msg.heartbeat, MIN_HEARTBEAT), MAX_HEARTBEAT)
            self._next_beat = now + self.interval
            return [Welcomed(msg.device_id, msg.identity, msg.job, self.interval)]
        elif isinstance(msg, Standby):
            return self._standby(msg, now)
        elif isinstance(msg, Wake):
            # Answered at once, asleep or not: the coordinator times the wake by the answer.
            self.keepalive = None
            self._next_beat = now
            return [Woken()]
        elif isinstance(msg, Finished):
            return self._end(Ending.FINISHED)
        elif isinstance(msg, Error):
            return [ErrorReceived(msg.code, msg.message)]
        return []

    def tick(self, now: float, wall: float) -> list[Event]:
        """The heartbeat timer (due at ``next_beat``): send a heartbeat stamped ``wall``, or hang up
        when the coordinator has been silent for ``SILENCE_FACTOR`` intervals."""
        if self.ended is not None or self.coordinator is None or now < self._next_beat:
            return []
        silent = now - self._heard
        # In standby the coordinator beats once a keep-alive too: a few of them missed, it is gone.
        patience = SILENCE_FACTOR * self.interval
        if self.keepalive is not None:
            patience = max(patience, STANDBY_MISSES * self.keepalive)
        if silent > patience:
            self._next_beat = float("inf")
            return [HangUp(CloseCode.GOING_AWAY, "coordinator silent", silent)]
        self._outgoing.append(Heartbeat(wall))
        self._next_beat = now + (self.interval if self.keepalive is None else self.keepalive)
        return []

    def pause(self, reason: str) -> None:
        """The owner needs the machine: every tile held is the coordinator's again (queued ones are
        skipped, a result computed anyway is dropped), and the coordinator hears why."""
        self.paused = reason or "paused by its owner"
        self._cancelled |= self._assigned
        if self.coordinator is not None:  # before the challenge, the hello says it
            self._outgoing.append(Pause(reason))

    def resume(self) -> None:
        """The machine is free again."""
        self.paused = ""
        if self.coordinator is not None:
            self._outgoing.append(Resume())

    # ---------------------------------------------------------------- the compute task

    def pop(self) -> Queued | None:
        """The next tile in arrival order, or None; ``start`` it when its turn comes."""
        return self._queue.popleft() if self._queue else None

    def start(self, queued: Queued, now: float) -> Tile | None:
        """The tile's turn came at ``now``: its operands, or None when it is not to be computed
        (cancelled, paused, or its blocks cannot be gathered: then it is released)."""
        tile_id = queued.work.tile_id
        if tile_id in self._cancelled or self.paused:
            # Cancelled, or sent before the coordinator saw our pause: not ours any more.
            self._done(tile_id)
            return None
        try:  # pieces summed on the device are joined here: that allocates
            operands = queued.work.operands(self.blocks)
        except (RuntimeError, MemoryError) as exc:
            log.error("tile %d: cannot gather its blocks (%s); releasing it", tile_id, exc)
            self.failed(tile_id, str(exc))
            return None
        if operands is None:
            # Never sit on a tile we cannot compute: give it back so the GEMM is not stalled.
            log.error("tile %d names a block this device does not hold; releasing it", tile_id)
            self._done(tile_id)
            self._outgoing.append(Release((tile_id,), ReleaseWhy.MISSING_BLOCK))
            return None
        a, b = operands
        # The coordinator counts the wait as the device's, not the link's.
        return Tile(tile_id, a, b, 2.0 * a.shape[0] * a.shape[1] * b.shape[1], now - queued.ready)

    def failed(self, tile_id: int, why: str) -> None:
        """The tile's compute failed: give it back (the coordinator will not send it here again)."""
        self._done(tile_id)
        self._outgoing.append(Release((tile_id,), ReleaseWhy.COMPUTE_FAILED, why[:200]))

    def computed(self, tile: Tile, c: torch.Tensor, seconds: float) -> Result | None:
        """The product is done: the result to send, or None when the tile was cancelled (or the
        machine paused) meanwhile and nobody wants it."""
        cancelled = tile.tile_id in self._cancelled
        self._done(tile.tile_id)
        return None if cancelled else Result(tile.tile_id, c, seconds, tile.waited)

    def frames_of(self, results: list[Result]) -> list[Result | ResultBatch]:
        """``results`` as the messages that carry them: one ``Result`` each, or batches of at
        most ``batch`` (the coordinator lets a batching device send frames that large)."""
        n = self.batch
        chunks = [results[i : i + n] for i in range(0, len(results), n)]
        return [chunk[0] if len(chunk) == 1 else ResultBatch(tuple(chunk)) for chunk in chunks]

    # ---------------------------------------------------------------- the end

    def closed(self, code: int | None, reason: str) -> str:
        """The connection closed with ``code`` and ``reason``: why, for the owner, before a
        reconnect. Raises ``Refused`` or ``Banned`` when reconnecting cannot help."""
        if code == CloseCode.REDIRECTED and self.ended == Ending.REDIRECTED:  # a 4013 alone is a close
            return Ending.REDIRECTED
        if code == CloseCode.AUTH:
            if self.enrolling and self._ticket:
                raise Refused(f"the coordinator refused the redirect's ticket ({reason})")
            if self.enrolling:
                raise Refused(f"the coordinator refused the join token ({reason})")
            # Never dropped silently: a server that refuses it may not be the one that issued it.
            raise Refused(
                f"the coordinator refused this device's credential ({reason}); if its database "
                "was replaced, enrol again with --new-identity and the join token (CLEAVE_TOKEN)"
            )
        if code in _PERMANENT:
            what = "banned this device" if code == CloseCode.BANNED else "refused this device"
            raise _PERMANENT[CloseCode(code)](f"the coordinator {what}: {reason}")
        return f"connection closed ({code} {reason})".strip()

    # ---------------------------------------------------------------- inside

    def _end(self, outcome: str) -> list[Event]:
        self.ended = outcome
        return [Ended(outcome)]

    def _done(self, tile_id: int) -> None:
        self._assigned.discard(tile_id)
        self._cancelled.discard(tile_id)

    def _on_challenge(self, msg: Message) -> list[Event]:
        if not isinstance(msg, Challenge) or len(msg.nonce) != 2 * auth.NONCE_BYTES:
            return self._end("the coordinator did not start with a challenge (an older version?)")
        self.coordinator = msg.coordinator
        self._outgoing.append(self._answer(msg))
        return []

    def _answer(self, challenge: Challenge) -> Hello:
        """A proof with the stored credential, or the join token to enrol."""
        hello = replace(self._hello, paused=self.paused)  # still paused from before: no work first
        credential = self._credential(challenge.coordinator)
        if credential is not None:
            answer = auth.proof(credential.secret, credential.identity, bytes.fromhex(challenge.nonce))
            return replace(hello, identity=credential.identity, proof=answer.hex())
        if self._ticket:  # sent here by another rank: its ticket, never the other rank's token
            self.enrolling = True
            return replace(hello, ticket=self._ticket)
        if not self._token:
            where = f" in {self._credentials_file}" if self._credentials_file else ""
            raise Refused(
                f"no credential for this coordinator under the name {self._hello.name!r}{where}; "
                "set CLEAVE_TOKEN (or pass --token-file) to the join token to enrol"
            )
        self.enrolling = True
        return replace(hello, token=self._token)

    def _standby(self, msg: Standby, now: float) -> list[Event]:
        """No work for now: beat every ``keepalive`` seconds and hold nothing. The coordinator sends
        it only once every lease of this device has ended, so a tile still held is one nobody
        wants back (cancelled): queued ones are dropped, the one computing has its result dropped.
        The blocks go (the coordinator forgets that this device held them)."""
        if not self.welcomed:
            log.error("coordinator sent standby before its welcome; ignored")
            return []
        for queued in self._queue:
            self._done(queued.work.tile_id)
        self._queue.clear()
        self._cancelled |= self._assigned
        self.blocks.clear()
        # Within the wire's bounds already (decode checks them); held to them here too.
        self.keepalive = min(max(msg.keepalive, MIN_KEEPALIVE), MAX_KEEPALIVE)
        self._next_beat = now + self.keepalive
        return [Sleeping(self.keepalive, msg.reason)]

    def _on_work(self, msg: Work, ready: float) -> list[Event]:
        for namespace in msg.forget:
            prefix = f"{namespace}."
            for key in [k for k in self.blocks if k.startswith(prefix)]:
                del self.blocks[key]
        for block in msg.blocks:
            self.blocks[block.key] = block.data if self._place is None else self._place(block.data)
        self._assigned.add(msg.tile_id)
        self._queue.append(Queued(msg, ready))
        return [TileQueued(msg.tile_id)]
