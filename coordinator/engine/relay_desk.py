"""Relays (``cleave relay``) as the engine meets them: a relay's admission and its messages,
placing devices behind relays, a device's report against its relay, and a relay's departure.
The relays' books (who is behind whom, what each served, their cool-offs and bans' evidence) are
``Relays`` (engine/relays.py); the desk keeps which identities are connected as relays.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cleave.coordinator.engine.devices import Departure, DeviceState
from cleave.coordinator.engine.identity import Admission
from cleave.coordinator.engine.outbound import Close, Limit, Outbound, Send
from cleave.coordinator.engine.relays import Relays, RelayState, relay_url_ok
from cleave.db.store import DeviceInfo, Outcome
from cleave.wire.codes import CloseCode, Code
from cleave.wire.errors import AuthError
from cleave.wire.messages import (
    BlockRequest,
    Credential,
    Error,
    Heartbeat,
    Hello,
    Leave,
    Message,
    RelayReport,
    UseRelay,
    Welcome,
)

if TYPE_CHECKING:
    from cleave.coordinator.engine.core import Core

log = logging.getLogger(__name__)


class RelayDesk:
    """The engine's side of its relays; ``relays`` holds their books."""

    def __init__(self, core: Core, relays: Relays) -> None:
        self.core = core
        self.relays = relays
        self._by_identity: dict[int, int] = {}  # identity -> relay id, while connected

    def __contains__(self, peer_id: int) -> bool:
        """Whether ``peer_id`` is a connected relay."""
        return peer_id in self.relays.relays

    def holds(self, identity: int) -> bool:
        """Whether ``identity`` is connected as a relay."""
        return identity in self._by_identity

    def connect(self, hello: Hello, nonce: str, now: float) -> tuple[int, list[Outbound]]:
        """Admit a relay: its identity as a device's, a row of its own (its ``device`` is
        "relay"), no tiles; the devices without one go behind it."""
        core = self.core
        if not relay_url_ok(hello.relay):
            raise AuthError(
                CloseCode.PROTOCOL,
                "hello.relay must be the ws:// or wss:// URL devices reach the relay at (a host, a port, no more)",
            )
        admission: Admission = core.gate.admit(hello, nonce, now, core.wall(now))
        # A relay reconnects within the same budget and cool-off as a device: each connection
        # moves devices behind it, and each drop excuses what they held.
        core.admissions.reconnecting(admission.identity, now)
        key = core.store.identity_key(admission.identity)
        if key is None:  # pragma: no cover - admitted identities have a key
            raise AuthError(CloseCode.AUTH, "unknown identity")
        info = DeviceInfo(admission.name, hello.platform, max(1, hello.cores), hello.memory_bytes, "relay", 0.0)
        relay_id = core.store.add_device(core.job_id, info, core.wall(now), admission.identity)
        bucket = core.limits.messages.bucket()
        self.relays.add(RelayState(relay_id, admission.identity, admission.name, hello.relay, key, bucket))
        core.planner.use_relays(len(self.relays))  # the cost model prices blocks through it
        self._by_identity[admission.identity] = relay_id
        out: list[Outbound] = [Limit(relay_id, core.limits.idle_frame)]
        if admission.secret is not None:
            out.append(Send(relay_id, Credential(admission.identity, admission.secret.hex())))
        out.append(Send(relay_id, Welcome(relay_id, admission.identity, core.job_name, 1, core.faults.beat)))
        for device_id in sorted(core.devices):
            out.extend(self.place(device_id, now))
        return relay_id, out

    def place(self, device_id: int, now: float) -> list[Outbound]:
        """Put a device behind a relay with room for its downlink, if one has: it is told where."""
        use = self.relays.place(device_id, self.core.fleet.links(device_id).down, now)
        return [] if use is None else [self.core.send(device_id, use, now)]

    def message(self, relay_id: int, msg: Message, now: float) -> list[Outbound]:
        """A relay asks for blocks (or beats, or leaves); anything else is refused."""
        if not self.relays.relays[relay_id].messages.take(now):
            return self.drop(relay_id, CloseCode.RATE_LIMITED, "too many messages", now)
        if isinstance(msg, BlockRequest):
            return [Send(relay_id, self.relays.serve(relay_id, msg.digests))]
        if isinstance(msg, Heartbeat):
            return []
        if isinstance(msg, Leave):
            return self.forget(relay_id, Departure.LEFT, now)
        return [Send(relay_id, Error(Code.UNEXPECTED, f"{type(msg).__name__} is not a message a relay may send"))]

    def drop(self, relay_id: int, code: CloseCode, reason: str, now: float) -> list[Outbound]:
        """Close a relay; its devices take their blocks from the coordinator from now on."""
        return [*self.forget(relay_id, reason, now), Close(relay_id, code, reason)]

    def forget(self, relay_id: int, reason: str, now: float) -> list[Outbound]:
        """A relay is gone: what its devices were fetching from it is excused, and they are told
        to take their blocks from here."""
        core = self.core
        relay = self.relays.relays.get(relay_id)
        if relay is None:
            return []
        devices = self.relays.remove(relay_id)
        for d in devices:  # their fetches from it fail now: what they give back is not their stall
            if d in core.devices:
                core.devices[d].excused = core.devices[d].relayed & set(core.devices[d].inflight)
        core.planner.use_relays(len(self.relays))
        self._by_identity.pop(relay.identity, None)
        core.store.release_device(relay_id, Outcome.RELEASED, core.wall(now), reason)
        return [core.send(d, UseRelay(0), now) for d in devices if d in core.devices]

    def report(self, dev: DeviceState, msg: RelayReport, now: float) -> list[Outbound]:
        """A device says its relay failed it: it takes its blocks from here from now on; a relay
        proven to have served other bytes is banned (engine/relays.py)."""
        core = self.core
        trusted = not dev.standing.on_probation(core.trust)  # only earned trust cools a relay (engine/relays.py)
        verdict = self.relays.report(dev.id, msg.relay, msg.fault, msg.digest, msg.tag, msg.got, now, trusted=trusted)
        if verdict is None:
            return []
        log.warning("device %d reported relay %d: %s", dev.id, msg.relay, verdict.why)
        dev.excused = dev.relayed & set(dev.inflight)  # it waited on the relay for these: giving them back is no stall
        out: list[Outbound] = [core.send(dev.id, UseRelay(0), now)]
        if verdict.banned:
            relay = self.relays.relays[msg.relay]
            core.gate.ban(relay.identity, f"relay: {verdict.why}", core.wall(now))
            out += self.drop(msg.relay, CloseCode.BANNED, f"banned: {verdict.why}", now)
        elif verdict.dropped:
            out += self.drop(msg.relay, CloseCode.GOING_AWAY, f"dropped: {verdict.why}", now)
        return out
