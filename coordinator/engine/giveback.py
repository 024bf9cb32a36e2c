"""Tiles a device gives back: its owner paused it (its work goes to others at once; it keeps its
blocks and stays connected), or it releases tiles it cannot do (a block it lost, which is sent
again; a compute that failed, which bars it from the tile). Giving back is bounded: a release
spends an allowance (``Conduct.gave_back``), and leases held for most of their deadline before
being let go count as unanswered, so neither stalling nor bouncing tiles can go on for ever.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cleave.coordinator.engine.devices import DeviceState
from cleave.coordinator.engine.outbound import Outbound
from cleave.db.store import DeviceStatus, Outcome
from cleave.wire.codes import CloseCode, ReleaseWhy
from cleave.wire.messages import Release

if TYPE_CHECKING:
    from cleave.coordinator.engine.core import Core

log = logging.getLogger(__name__)


class GiveBacks:
    """Pauses and releases (``Core.receive``), and what leaving costs a device that stalled."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def pause(self, dev: DeviceState, reason: str, now: float) -> list[Outbound]:
        """The owner needs the machine: its tiles go to others at once; it stays connected."""
        core = self.core
        dev.paused = reason  # its work goes back: its paused time books no draw (it holds nothing)
        core.sched.update(dev.id, paused=True)
        core.fleet.changed()
        core.store.set_device_state(dev.id, DeviceStatus.PAUSED, core.wall(now), reason)
        # A paused client keeps its cached blocks: they serve it again once it resumes. Its
        # leases' rows say "paused", never its owner's words (the device row keeps those, once).
        return self.give_back(dev, tuple(dev.inflight), DeviceStatus.PAUSED.value, now, blocks_lost=False, paused=True)

    def release(self, dev: DeviceState, msg: Release, now: float) -> list[Outbound]:
        """The device gives tiles back it cannot do (``msg.why``): a block it lost, or a compute
        that failed. Every byte it says it lost is a byte sent again, charged to its allowance."""
        core = self.core
        # A missing block: send the blocks again if it gets the tile back. A failed compute: the
        # tile goes to another device, never straight back to this one.
        missing = msg.why is ReleaseWhy.MISSING_BLOCK
        if missing:  # every byte it claims to have lost is a byte sent again: charged as such
            held = {
                ref.key: ref.nbytes
                for tid in set(msg.tile_ids)
                if tid in dev.inflight
                for pair in core.intake.pairs_of(tid)
                for ref in pair
                if ref.key in dev.blocks
            }
            # Named for its relay but never had: not relayed, and not charged (the relay failed it).
            resend = sum(held.values()) - core.relays.unserved(dev.id, held)
            if resend and not dev.resends.take(now, resend):
                return core.drop(dev, CloseCode.RATE_LIMITED, "too many blocks to send again", now) + core.dispatch(now)
        # Its leases' rows get ``why`` alone (an enum): its own words (``msg.reason``) are never
        # stored, so giving tiles back writes no text of a device's choosing into the books.
        if msg.reason and not missing:  # "out of memory": the operator's log has them, once a release
            log.info("device %d (%s) failed tiles %s: %s", dev.id, dev.name, list(msg.tile_ids[:8]), msg.reason)
        return self.give_back(dev, msg.tile_ids, msg.why.value, now, blocks_lost=missing, failed=not missing)

    def give_back(
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
        core = self.core
        given = 0
        # Tiles its relay failed it on were held waiting on the relay, not stalled by the device.
        excused = dev.excused & set(tile_ids)
        kept = [t for t in set(tile_ids) if t in dev.inflight and t not in excused]
        stalled = self.held_long(dev, kept, now, released=not paused)
        dev.excused.difference_update(tile_ids)
        for tile_id in tile_ids:
            if tile_id not in dev.inflight:
                continue  # already finished or re-issued: nothing to give back
            given += 1
            core.leasing.sent.pop((tile_id, dev.id), None)
            if failed:
                core.fleet.failed(dev.id, now)
            bar = failed  # never a missing block's tile: it is sent again with its blocks
            core.sched.release(tile_id, dev.id, bar=bar, now=now)
            core.lost_tile(dev, now)
            core.store.end_lease(tile_id, dev.id, Outcome.RELEASED, core.wall(now), reason, bar=bar)
            if blocks_lost:
                for ref in {r.key: r for pair in core.intake.pairs_of(tile_id) for r in pair}.values():
                    dev.lose(ref)
                    core.sched.drops_blocks(dev.id, (ref.key,))
                core.sched.update(dev.id, full=dev.full)
        out = core.cut(dev, "it kept giving tiles back without returning work", now) if stalled else []
        return out + core.dispatch(now) if given else out  # nothing changed: nothing to dispatch

    def held_long(self, dev: DeviceState, tile_ids: list[int], now: float, *, released: bool = False) -> bool:
        """Leases it gives back (or loses by leaving) after holding them for most of their
        deadline count as unanswered, as if another copy had won: holding tiles until just
        before their deadlines and then letting go is stalling. A release (``released``) also
        spends its allowance of them (``Conduct.gave_back``). True when it must be cut."""
        core = self.core
        holds = [hold for tile_id in tile_ids if (hold := core.sched.hold(tile_id, dev.id)) is not None]
        return core.conduct.gave_back(dev, holds, now, released=released)
