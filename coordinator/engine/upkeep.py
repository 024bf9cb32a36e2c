"""Time passing, and what it asks of the engine: each tick looks after a slice of the devices
(silence, credit, heartbeats, standby, relays, frame limits), takes back and copies late work
(the dispatch), wakes sleepers for tiles no awake device may take, and once a second looks for an
operator's revocations and bans and for tiles every device has failed.

It owns the sweep's place in the devices, the tiles re-opened after failing everywhere and
since when they wait, and when the standings were last looked at.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cleave.coordinator.engine.devices import DeviceState
from cleave.coordinator.engine.outbound import Abort, Limit, Outbound, Send
from cleave.db.store import DeviceStatus, IdentityState, Outcome
from cleave.wire.codes import CloseCode, ReleaseWhy, StandbyWhy
from cleave.wire.messages import Heartbeat, Standby, Wake

if TYPE_CHECKING:
    from cleave.coordinator.engine.core import Core

log = logging.getLogger(__name__)

TICK = 0.05  # seconds between the driver's calls to tick (the server's; the simulator's too)
CREDIT_INTERVAL = 1.0  # seconds between Credit messages to a device whose verified total grew
STANDING_CHECK = 1.0  # seconds between looks for an operator's revocations and token rotations
STUCK_GRACE = 60.0  # seconds a tile failed everywhere twice waits for a new device before the job stops
SWEEP = 0.5  # seconds in which tick looks after every device once (heartbeats, silence, credit)
WAKE_SCAN = 64  # sleeping devices woken in one tick for tiles no awake device may take (Scheduler.scan's bound)


class Upkeep:
    """What the engine does as time passes (``Core.tick``)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self._sweep: list[int] = []  # devices still to look after in this tick round
        self._sweep_at = 0.0
        self._sweep_len = 0
        self._checked_at = -float("inf")
        self.reopened: set[int] = set()  # tiles re-opened once after every device failed them
        self._stuck_since: dict[int, float] = {}  # re-opened tiles failed everywhere again: since when
        self.aborted = False  # an Abort went out

    def done(self, tile_ids: Iterable[int]) -> None:
        """These tiles' GEMM is complete: nothing of them can be stuck."""
        for tid in tile_ids:
            self.reopened.discard(tid)
            self._stuck_since.pop(tid, None)

    def tick(self, now: float) -> list[Outbound]:
        """Time passes: drop silent devices, take back late tiles, copy them, keep heartbeats.

        Each tick looks after a slice of the devices (every device once per ``SWEEP`` seconds at
        the server's 50 ms ticks), so its cost does not grow with the fleet."""
        core = self.core
        out: list[Outbound] = []
        if now - self._checked_at >= STANDING_CHECK:
            self._checked_at = now
            out.extend(self._check_standings(now))
            out.extend(self._unstick(now))
        if not self._sweep:
            self._sweep = list(core.devices)
            self._sweep_at, self._sweep_len = now, len(self._sweep)
        # Enough of this round's devices to finish it SWEEP seconds after it began.
        share = max(1, math.ceil(self._sweep_len * min(1.0, (now - self._sweep_at + TICK) / SWEEP)))
        due = self._sweep_len - len(self._sweep)
        for _ in range(max(0, share - due)):
            dev = core.devices.get(self._sweep.pop()) if self._sweep else None
            if dev is None:
                continue
            # A sleeping device beats once a keep-alive: silent for a few of them, it is gone;
            # silent for less, it is sleeping, never at fault (engine/standby.py).
            if now - dev.last_seen > core.standby.silence(dev.id, core.faults.heartbeat_timeout):
                silence = f"no heartbeat for {now - dev.last_seen:.1f} s"
                out.extend(core.drop(dev, CloseCode.SILENT, silence, now))
                continue
            if dev.gflop_verified != dev.credit_sent and now - dev.credit_at >= CREDIT_INTERVAL:
                out.append(core.credit(dev, now))  # verified work only, never claims
            if now - dev.last_sent >= core.standby.beat(dev.id, core.faults.beat):
                out.append(core.send(dev.id, Heartbeat(core.wall(now)), now))
            idle = dev.paused is None and not dev.inflight and not dev.seat.own_count and not core.finished
            why = core.standby.due(dev.id, idle, bool(core.gemms), now)
            if why is not None:
                out.append(self.sleep(dev, why, now))
            if core.relays.relays and dev.id not in core.relays.behind:  # one it avoided for a while, or none had room
                out.extend(core.relay_desk.place(dev.id, now))
            if dev.frame_limit > core.limits.idle_frame and not dev.inflight and now >= dev.big_until:
                dev.frame_limit = core.limits.idle_frame
                out.append(Limit(dev.id, dev.frame_limit))
        out.extend(core.dispatch(now))
        woken = self._wake_for_queue(now)
        if woken:
            out.extend(woken)
            out.extend(core.dispatch(now))
        core.store.flush()  # the hot path's grouped writes are durable within a tick or two
        return out

    def sleep(self, dev: DeviceState, why: StandbyWhy, now: float) -> Send:
        """Send an idle device the plans leave out to standby: it gets no work (its seat is paused
        with the scheduler) and drops its cached blocks, which it is no longer counted to hold."""
        core = self.core
        core.standby.sleep(dev.id, now)
        core.sched.update(dev.id, paused=True)
        for namespace in list(dev.namespaces):
            keys = dev.drop(namespace)
            core.sched.drops_blocks(dev.id, keys)
        dev.forget.clear()  # it drops every block: nothing to name in a later work's ``forget``
        core.sched.update(dev.id, full=dev.full)
        core.fleet.changed()  # planned at its wake latency from now on
        log.info("device %d (%s) sent to standby: %s", dev.id, dev.name, why)
        return core.send(dev.id, Standby(core.standby.policy.keepalive, why), now)

    def wake(self, dev: DeviceState, now: float) -> Send:
        """Wake a sleeping device: it may take work at once (its frames follow the wake on its
        socket); its answer times the wake (``Sleepers.heard``)."""
        core = self.core
        core.standby.wake(dev.id, now)
        core.sched.update(dev.id, paused=dev.paused is not None)
        core.fleet.changed()
        log.info("device %d (%s) woken", dev.id, dev.name)
        return core.send(dev.id, Wake(), now)

    def _wake_for_queue(self, now: float) -> list[Outbound]:
        """Tiles wait that no awake device may take now (no planned owner is here for them, and
        every free device is barred from them, or none is free): wake sleepers, longest asleep
        first, until their slots cover them (at most ``WAKE_SCAN`` a tick). O(woken), plus the
        sleepers its owner paused ahead of them."""
        core = self.core
        waiting = core.sched.unowned
        if not waiting or not core.standby.asleep or core.sched.offered:
            return []
        chosen: list[DeviceState] = []
        for device_id in core.standby.longest_asleep():
            dev = core.devices[device_id]
            if dev.paused is not None:  # its owner's pause holds it anyway: waking it would not help
                continue
            chosen.append(dev)
            waiting -= max(1, dev.slots)
            if waiting <= 0 or len(chosen) >= WAKE_SCAN:
                break
        return [self.wake(dev, now) for dev in chosen]

    def _unstick(self, now: float) -> list[Outbound]:
        """A queued tile that every device here has failed would wait forever, and training
        with it: it is re-opened once (each device may try it again); failed everywhere a second
        time, it waits ``STUCK_GRACE`` for a device that may take it, then the job stops with
        the reason rather than hang."""
        core = self.core
        reopened = False
        stuck = core.sched.stuck()
        for tile_id in [t for t in self._stuck_since if t not in stuck]:  # someone took it meanwhile
            del self._stuck_since[tile_id]
        for tile_id in stuck:
            gemm = core.intake.find(tile_id)
            if gemm is None:
                continue
            if tile_id in self.reopened:  # a device that joins within the grace may still take it
                since = self._stuck_since.setdefault(tile_id, now)
                if now - since < STUCK_GRACE or self.aborted:
                    continue
            # Read from the store only now: a tile waiting out its grace costs nothing per second.
            # Real failures only (what bars): a give-back for a missing block or a pause is none.
            failures = [
                lease
                for lease in core.store.leases(tile_id)
                if lease.outcome in (Outcome.REJECTED, Outcome.REVOKED)
                or (lease.outcome == Outcome.RELEASED and lease.reason.startswith(ReleaseWhy.COMPUTE_FAILED.value))
            ]
            last = f"{failures[-1].outcome}: {failures[-1].reason}" if failures else "unknown"
            if tile_id in self.reopened:
                self.aborted = True  # said once: the trainer stops at its next GEMM
                m, k = gemm.a.shape
                return [
                    Abort(
                        f"tile {tile_id} of a {gemm.kind.value} GEMM ({m}x{k} @ {k}x{gemm.b.shape[1]}) failed "
                        f"on every connected device, twice ({len(failures)} attempts; last {last}), and no "
                        f"other device came to take it within {STUCK_GRACE:.0f} s"
                    )
                ]
            self.reopened.add(tile_id)
            core.sched.unbar(tile_id)
            core.store.unbar_tile(tile_id)
            log.warning(
                "tile %d was failed by every connected device (last %s); each may try it once more", tile_id, last
            )
            reopened = True
        return core.dispatch(now) if reopened else []

    def _check_standings(self, now: float) -> list[Outbound]:
        """An operator may have revoked or banned an identity, or rotated a token, from another
        process: the store says when anything changed, and connected devices are checked then."""
        core = self.core
        if not core.store.changed():
            return []
        core.gate.reload()
        states = core.gate.states([d.identity for d in core.devices.values()])
        out: list[Outbound] = []
        for dev in list(core.devices.values()):
            state = states.get(dev.identity)
            if state not in (IdentityState.REVOKED, IdentityState.BANNED):
                continue
            row = core.store.identity(dev.identity)
            why = f": {row.reason}" if row is not None and row.reason else ""
            if state == IdentityState.REVOKED:
                out.extend(
                    core.drop(
                        dev, CloseCode.REVOKED, f"credential revoked by the operator{why}", now, DeviceStatus.REVOKED
                    )
                )
            else:
                out.extend(core.drop(dev, CloseCode.BANNED, f"banned by the operator{why}", now, DeviceStatus.BANNED))
        return out
