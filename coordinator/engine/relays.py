"""Relays: which devices take their blocks from which relay, what a relay may be served, and what
a device's report of a relay proves (protocol 7, docs/protocol.md "Relays").

A relay (``cleave relay``) enrols like a device and is never given tiles. The coordinator puts
devices behind relays, names the blocks they lack by digest in their work (``Work.fetch``), and
serves a relay the blocks its devices ask it for: only blocks a GEMM of this step still reads
(the ``index``), each at most ``SERVES`` times to one relay, so a relay cannot make the
coordinator send the same bytes again and again. A device believes a relay about nothing but
bytes with the right digest; when one fails it, the device says so (``RelayReport``) and takes
its blocks from the coordinator from then on. A report of wrong bytes carries the relay's own
seal on what it served: a seal that is not the true block's proves the relay lied, and it is
banned; a report of wrong bytes or a stall that proves nothing moves that device and counts a
strike, and a relay that ``STRIKES`` different devices report is dropped (not banned: it may only
be slow). A relay that only lacked a block (``UNREACHABLE``) is avoided by that device for
``AVOID_S`` seconds and struck by no one.

A slow relay costs the relay, never its devices: a device waits on it for a work frame's blocks
at most its ``fetch_wait``, counted from the frame's arrival (``WAIT_SHARE`` of that lease's own
window, at least ``wait``, the share of the shortest lease deadline told in ``use_relay``), then
takes its blocks from the coordinator and reports the relay stalled; the leases it held meanwhile are
excused (the Core neither counts their take-back nor their give-back as its stall). A relay
reported stalled by a device off probation, or one whose device off probation was cut on leases
that waited on its blocks, takes no new devices for a cool-off (``COOLOFF_S``, doubling with each
such mark up to ``AVOID_S``, from ``COOLOFF_S`` again after ``CLEAN_S`` without one).

Pure: no clock of its own, no I/O; the Core holds one ``Relays`` and sends what it decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from cleave.coordinator.engine.blocks import BlockRef
from cleave.coordinator.engine.limits import TokenBucket, cooloff
from cleave.wire.addresses import odd_ipv4
from cleave.wire.codes import RelayFault
from cleave.wire.digest import relay_ticket, tag_ok
from cleave.wire.messages import MAX_FETCH, MAX_URL, Block, Blocks, UseRelay

SERVES = 2  # times one relay may be sent one block (it may evict it once and ask again)
STRIKES = 3  # different devices whose unproven reports drop a relay
MAX_DEVICES_PER_RELAY = 1024  # devices one relay serves at most
# Block bytes in one reply to a relay (always at least one block; a block is at most 16 MiB, as
# engine/profiles.py's MAX_UNIT_MEMORY plans two units in 32 MiB): an honest relay has two
# requests unanswered (client/relay.py OUTSTANDING), whose replies stay within the coordinator's
# 64 MiB queue for one peer (Limits.outbound_queue).
MAX_REPLY_BYTES = 16 << 20
AVOID_S = 600.0  # seconds a device keeps off a relay it could not take its blocks from
# A device waits on its relay for one work frame's blocks this share of the frame's lease
# window (work.fetch_wait; use_relay.wait: this share of FaultPolicy.lease_floor, the shortest),
# counted from the frame's arrival: it gives up, reports the relay and has the coordinator's
# blocks well before its leases would be copied or taken back.
WAIT_SHARE = 0.5
COOLOFF_S = 60.0  # first cool-off of a relay reported stalled (or whose device was cut): no new devices
# A relay with no such mark for this long after its last cool-off ended starts again from
# COOLOFF_S (its marks are forgotten, as a device's cuts are: engine/conduct.py).
CLEAN_S = AVOID_S


def relay_url_ok(url: str) -> bool:
    """Whether ``url`` is one a relay may give devices: ws:// or wss://, a host (a name or a
    standard address: not ``127.1`` or ``2130706433``), at most a port and a bare path; no
    credentials, query or fragment (devices connect to exactly what it says)."""
    if len(url) > MAX_URL or any(c.isspace() or ord(c) < 32 for c in url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises for a port that is not one
    except ValueError:
        return False
    return (
        parts.scheme in ("ws", "wss")
        and bool(parts.hostname)
        and not odd_ipv4(parts.hostname or "")
        and parts.username is None
        and parts.password is None
        and not parts.query
        and not parts.fragment
    )


@dataclass
class RelayState:
    """One connected relay."""

    id: int  # its device row (welcome.device_id): what tickets and reports name
    identity: int
    name: str
    url: str  # where devices reach it (hello.relay)
    key: bytes  # its stored key K = H(S): seals tickets and checks its tags
    messages: TokenBucket  # its message allowance, as any peer's (the Core's limits)
    devices: set[int] = field(default_factory=set)
    load: float = 0.0  # its devices' downlinks, summed (bytes/s): what its egress may have to feed
    served: dict[str, int] = field(default_factory=dict)  # digest -> times sent to it
    named: set[str] = field(default_factory=set)  # digests named this step for its own devices
    strikes: set[int] = field(default_factory=set)  # devices that reported it, unproven
    slow: int = 0  # marks (a stall report, a cut) since its last clean period: each doubles its cool-off
    cool_until: float = 0.0  # no new devices go behind it before this (monotonic seconds)
    bytes_out: int = 0  # block bytes the coordinator sent it
    bytes_named: int = 0  # block bytes its devices were told to fetch from it


@dataclass(frozen=True)
class Verdict:
    """What a device's report of its relay decides."""

    banned: bool  # the relay proved to have served other bytes under a digest
    dropped: bool  # the relay lost its devices (banned, or reported by STRIKES devices)
    why: str


class Relays:
    """The coordinator's relays, the devices behind each, and the blocks it may serve them."""

    def __init__(self, wait: float = 1.0) -> None:
        self.wait = wait  # seconds a device waits on its relay for one work frame's blocks (use_relay.wait)
        self.relays: dict[int, RelayState] = {}
        self.behind: dict[int, int] = {}  # device -> its relay
        self._down: dict[int, float] = {}  # device -> the downlink it was placed with
        # device -> {relay it reported: until when it is not put behind it again (inf: never)}
        self.avoid: dict[int, dict[int, float]] = {}
        self.index: dict[str, BlockRef] = {}  # digest -> a block of this step, as named in work
        self.bytes_named = 0  # over the job: block bytes devices were told to take from relays (less unserved)
        self._named: dict[int, dict[str, int]] = {}  # device -> {block key: its relay}, this step
        self.bytes_served = 0  # over the job: block bytes sent to relays

    def __len__(self) -> int:
        return len(self.relays)

    def add(self, relay: RelayState) -> None:
        """A relay connected: devices may be put behind it."""
        self.relays[relay.id] = relay

    def remove(self, relay_id: int) -> list[int]:
        """Forget a relay; returns the devices that were behind it."""
        relay = self.relays.pop(relay_id, None)
        if relay is None:
            return []
        for device in relay.devices:
            self.behind.pop(device, None)
            self._down.pop(device, None)
        return sorted(relay.devices)

    def place(self, device: int, down: float = 1.0, now: float = 0.0) -> UseRelay | None:
        """Put a device whose downlink is ``down`` bytes/s behind the relay whose devices'
        downlinks add up to least (what its egress would have to feed were they all busy;
        ties: fewest devices, then the lowest id), none it avoids at ``now`` and none cooling off
        (reported slow: its load fell because its devices left it); None: no relay has room. The
        device takes its blocks from there from its next work on."""
        if device in self.behind or not self.relays:
            return None
        avoid = self.avoid.get(device, {})
        for relay_id in [r for r, until in avoid.items() if until <= now]:
            del avoid[relay_id]  # an UNREACHABLE report's time is up: it may try that relay again
        open_ = [
            r
            for r in self.relays.values()
            if len(r.devices) < MAX_DEVICES_PER_RELAY and r.id not in avoid and r.cool_until <= now
        ]
        if not open_:
            return None
        relay = min(open_, key=lambda r: (r.load, len(r.devices), r.id))
        relay.devices.add(device)
        relay.load += down
        self._down[device] = down
        self.behind[device] = relay.id
        return UseRelay(relay.id, relay.url, relay_ticket(relay.key, relay.id, device), self.wait)

    def cool(self, relay_id: int, now: float) -> float:
        """``relay_id`` was slow (reported stalled by a trusted device, or a trusted device of it
        was cut on tiles that waited on it): it takes no new devices until the returned time
        (``COOLOFF_S``, doubling with each mark, at most ``AVOID_S``; a relay with no mark for
        ``CLEAN_S`` after its last cool-off starts again from ``COOLOFF_S``). Its devices stay:
        each finds out and reports it on its own."""
        relay = self.relays.get(relay_id)
        if relay is None:
            return now
        if relay.slow and now >= relay.cool_until + CLEAN_S:
            relay.slow = 0
        relay.slow += 1
        relay.cool_until = max(relay.cool_until, now + cooloff(COOLOFF_S, AVOID_S, relay.slow))
        return relay.cool_until

    def leave(self, device: int) -> None:
        """A device is gone, or will take its blocks from the coordinator."""
        relay_id = self.behind.pop(device, None)
        down = self._down.pop(device, 0.0)
        if relay_id is not None and relay_id in self.relays:
            self.relays[relay_id].devices.discard(device)
            self.relays[relay_id].load -= down

    def name(self, device: int, ref: BlockRef) -> str | None:
        """The digest under which ``device`` fetches ``ref`` from its relay, or None: it has
        none, and the block travels in the work itself. Digests are taken once per block."""
        relay_id = self.behind.get(device)
        if relay_id is None:
            return None
        digest = ref.digest()
        self.index[digest] = ref
        relay = self.relays[relay_id]
        relay.named.add(digest)  # what this relay, and no other, may be served this step
        relay.bytes_named += ref.nbytes
        self.bytes_named += ref.nbytes
        self._named.setdefault(device, {})[ref.key] = relay_id
        return digest

    def unserved(self, device: int, lost: dict[str, int]) -> int:
        """``device`` says it lacks these blocks (key -> bytes): those it was told to take from a
        relay this step were not served, and leave the relays' count. Returns their bytes (the
        relay failed it on those: sending them again is not the device's doing)."""
        named = self._named.get(device)
        if not named:
            return 0
        unnamed = 0
        for key, nbytes in lost.items():
            relay_id = named.pop(key, None)
            if relay_id is None:
                continue
            unnamed += nbytes
            self.bytes_named -= nbytes
            if relay_id in self.relays:
                self.relays[relay_id].bytes_named -= nbytes
        return unnamed

    def serve(self, relay_id: int, digests: tuple[str, ...]) -> Blocks:
        """A relay's request: the live blocks named this step for its own devices that it has
        not been sent ``SERVES`` times, up to ``MAX_REPLY_BYTES`` of them (always one); those past
        the cap are left out of both ``blocks`` and ``missing`` (the relay asks again)."""
        relay = self.relays[relay_id]
        blocks: list[Block] = []
        missing: list[str] = []
        size = 0
        for digest in digests[:MAX_FETCH]:
            ref = self.index.get(digest)
            if ref is None or digest not in relay.named or relay.served.get(digest, 0) >= SERVES:
                missing.append(digest)
                continue
            if blocks and size + ref.nbytes > MAX_REPLY_BYTES:
                continue  # past this reply's cap: neither sent nor missing
            size += ref.nbytes
            relay.served[digest] = relay.served.get(digest, 0) + 1
            blocks.append(Block(digest, ref.wire()))
            relay.bytes_out += ref.nbytes
            self.bytes_served += ref.nbytes
        return Blocks(tuple(blocks), tuple(missing))

    def new_step(self) -> None:
        """The last step's blocks will not be read again: nothing of them is served."""
        self.index.clear()
        self._named.clear()
        for relay in self.relays.values():
            relay.served.clear()
            relay.named.clear()

    def report(
        self,
        device: int,
        relay_id: int,
        fault: RelayFault,
        digest: str,
        tag: str,
        got: str = "",
        now: float = 0.0,
        *,
        trusted: bool = True,
    ) -> Verdict | None:
        """A device's report of its relay at ``now`` (None: not its relay, ignored). The device
        leaves the relay in any case, and is not put behind it again (after ``UNREACHABLE``: not
        for ``AVOID_S`` seconds; after a stall or wrong bytes: never). A wrong-bytes report proves a lie
        only with the relay's own seal on serving bytes of digest ``got`` as ``digest``: then the
        relay is banned. Without proof (a device may say anything, and a relay may seal what it
        did not send) a stall or wrong bytes counts a strike; a relay that lacked a block
        (``UNREACHABLE``) does not (an honest one may have been evicted or sent its limit). A
        stall reported by a ``trusted`` device (off probation: it has returned verified work)
        also cools the relay off (``cool``): no new devices go behind it for a while. A new
        identity costs only the join token, so one on probation strikes the relay and leaves
        it, and cools nothing: else one identity, cut and back again, could keep a relay
        closed to newcomers for ever."""
        relay = self.relays.get(relay_id)
        if relay is None or self.behind.get(device) != relay_id:
            return None
        self.leave(device)
        until = now + AVOID_S if fault is RelayFault.UNREACHABLE else float("inf")
        avoid = self.avoid.setdefault(device, {})
        avoid[relay_id] = max(until, avoid.get(relay_id, until))
        if fault is RelayFault.WRONG and got and got != digest and tag and tag_ok(relay.key, digest, got, tag):
            return Verdict(True, True, f"its own seal says it served other bytes as block {digest[:16]}")
        if fault is RelayFault.UNREACHABLE:
            return Verdict(False, False, f"device {device} could not take its blocks there")
        if fault is RelayFault.STALLED and trusted:  # slow for this device: no one new goes behind it for a while
            self.cool(relay_id, now)
        relay.strikes.add(device)
        if len(relay.strikes) >= STRIKES:
            return Verdict(False, True, f"{len(relay.strikes)} devices reported it ({fault.value})")
        return Verdict(False, False, f"device {device} reported it ({fault.value})")
