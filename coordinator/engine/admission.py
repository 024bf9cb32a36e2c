"""Devices coming in: a hello admitted by the gate (engine/identity.py) becomes a seated device
with its limits, its budgets and its measurements' priors; on a rank of a tier, a newcomer may be
sent to a rank whose pool is weaker instead (``Redirecting``, engine/balance.py).

It owns which identity is connected as which device (one connection per identity), and the
rank's balancer once the rank joins a tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cleave.coordinator.engine.balance import Balancer, Redirecting
from cleave.coordinator.engine.conduct import Pace, Standing
from cleave.coordinator.engine.devices import DeviceState
from cleave.coordinator.engine.identity import Admission
from cleave.coordinator.engine.outbound import Limit, Outbound
from cleave.coordinator.engine.profiles import PRIOR_MEMORY, DeviceProfile
from cleave.db.store import DeviceInfo, DeviceStatus
from cleave.wire.codes import CloseCode
from cleave.wire.errors import AuthError
from cleave.wire.messages import Credential, Finished, Hello, Welcome

if TYPE_CHECKING:
    from cleave.coordinator.engine.core import Core


class Admissions:
    """Who is connected, by identity, and how a device is let in."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._by_identity: dict[int, int] = {}  # identity -> device id, while connected
        # A rank of a tier: where newcomers go (engine/balance.py; set with ``join_tier``).
        self.balancer: Balancer | None = None

    def live(self, identity: int) -> int | None:
        """The identity's connected device's id, if any."""
        return self._by_identity.get(identity)

    def left(self, identity: int) -> None:
        """The identity's device is gone."""
        self._by_identity.pop(identity, None)

    def connect(self, hello: Hello, nonce: str, now: float) -> tuple[int, list[Outbound]]:
        """Admit a device that answered ``nonce`` with ``hello`` (``Core.connect``); the caller
        dispatches once it is seated."""
        core = self.core
        if self.balancer is not None and not hello.identity and not hello.ticket and not core.finished:
            core.gate.check_join(hello.token)
            dtype = core.fleet.dtype
            rate = DeviceProfile(hello.gflops, PRIOR_MEMORY).profile(dtype).flops_per_s(dtype) / 1e9
            redirect = self.balancer.place(core.fleet.pool()[1], rate, core.wall(now))
            if redirect is not None:
                core.gate.take_enrolment(now)  # a ticket is an enrolment elsewhere: the same rate
                raise Redirecting(redirect)
        admission: Admission = core.gate.admit(hello, nonce, now, core.wall(now))
        # Not a connected relay's identity either: one (job, identity) is one devices row, and a
        # device sharing the relay's would have its leases ended when the relay goes.
        standing = self.reconnecting(admission.identity, now)
        info = DeviceInfo(
            name=admission.name,
            platform=hello.platform,
            cores=max(1, hello.cores),
            memory_bytes=hello.memory_bytes,
            device=hello.device,
            gflops=hello.gflops,
        )
        device_id = core.store.add_device(core.job_id, info, core.wall(now), admission.identity)
        asked = min(hello.slots, core.trust.max_slots)
        pace = Pace.unproven(hello.gflops)  # its claim sets its first deadlines, nothing more
        lim = core.limits
        measured = DeviceProfile(hello.gflops, hello.block_budget or PRIOR_MEMORY)
        links = measured.profile(core.fleet.dtype)  # the link fit's priors until it returns work
        batch = min(hello.batch, asked)
        seat = core.conduct.seat(
            device_id, standing, pace, asked, paused=bool(hello.paused), down_rate=links.down, up_rate=links.up,
            batch=batch,
        )  # fmt: skip
        assert standing.budgets is not None  # set by ``reconnecting``
        dev = DeviceState(
            device_id, admission.identity, admission.name, asked, seat, standing, pace, hello.device, now,
            lim.messages.bucket(), standing.budgets[0], standing.budgets[1], lim.pauses.bucket(), lim.idle_frame,
            budget=hello.block_budget, batch=batch,
        )  # fmt: skip
        core.devices[device_id] = dev
        core.standby.joined(device_id, now)
        core.energy.joined(device_id, hello.device, dev.gflop_verified)
        self._by_identity[admission.identity] = device_id
        core.fleet.joined(device_id, measured)
        if hello.paused:  # its owner is busy: it gets nothing until it resumes
            dev.paused = hello.paused
            core.store.set_device_state(device_id, DeviceStatus.PAUSED, core.wall(now), hello.paused)
        out: list[Outbound] = [Limit(device_id, lim.idle_frame)]
        if admission.secret is not None:
            out.append(core.send(device_id, Credential(admission.identity, admission.secret.hex()), now))
        welcome = Welcome(device_id, admission.identity, core.job_name, dev.slots, core.faults.beat)
        out.append(core.send(device_id, welcome, now))
        if core.finished:
            out.append(core.send(device_id, Finished(), now))
            return device_id, out
        return device_id, out + core.relay_desk.place(device_id, now)  # a relay with room serves its blocks

    def reconnecting(self, identity: int, now: float) -> Standing:
        """An admitted identity connects (a device or a relay): one connection per identity,
        after its cool-off, within its reconnect budget; returns its standing."""
        core = self.core
        if identity in self._by_identity or core.relay_desk.holds(identity):
            raise AuthError(CloseCode.IN_USE, "this identity is already connected")
        core.gate.check_cooloff(identity, now)
        standing = core.gate.standing(identity)
        if standing.budgets is None:  # kept with the identity: reconnecting does not refill them
            standing.budgets = (
                core.limits.releases.bucket(),
                core.limits.resends.bucket(),
                core.trust.reconnects.bucket(),
            )
        if not standing.budgets[2].take(now):
            raise AuthError(CloseCode.RATE_LIMITED, "reconnecting too often; try again in a while")
        return standing

    def join_tier(self, balancer: Balancer, *, redirect: bool = True) -> None:
        """This coordinator is a rank of a tier: tickets from the other ranks admit newcomers, and
        (``redirect``) newcomers with the join token may be sent to a weaker rank."""
        self.balancer = balancer if redirect else None
        self.core.gate.tickets = balancer

    def ignored_by(self, rank: int) -> None:
        """A newcomer sent to ``rank`` ignored its redirect (``Balancer.ignored_by``)."""
        if self.balancer is not None:
            self.balancer.ignored_by(rank)
