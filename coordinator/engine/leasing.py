"""The live coordinator's hands for the dispatch rules (engine/dispatch.py): each lease in the
store, its work frame with only the blocks the device lacks, copies, take-backs and cuts.

It owns what a lease carried on the wire (``sent``: the bytes of blocks its work frame held and
when that frame went out), which the link fit reads when the result comes back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from cleave.coordinator.engine.devices import DeviceState
from cleave.coordinator.engine.gemms import GemmState
from cleave.coordinator.engine.outbound import Limit, Outbound
from cleave.coordinator.engine.relays import WAIT_SHARE
from cleave.db.store import Outcome
from cleave.wire.codes import CloseCode
from cleave.wire.messages import MAX_SLOTS, Block, Cancel, Work

if TYPE_CHECKING:
    from cleave.coordinator.engine.core import Core

log = logging.getLogger(__name__)


class Leasing:
    """``Hands`` of the live ``Core``: the store's rows and the messages of each decision."""

    def __init__(self, core: Core) -> None:
        self.core = core
        # (tile, device) -> [bytes of blocks its work carried, when the frame went on the wire]
        self.sent: dict[tuple[int, int], list[Any]] = {}
        self.first: list[tuple[int, int]] = []  # first leases since the last flush: written together

    def device(self, device_id: int) -> DeviceState | None:
        """The connected device, or None."""
        return self.core.devices.get(device_id)

    def vanished(self, device_id: int, unit: int) -> None:
        """Its work's bytes are forgotten with it."""
        self.sent.pop((unit, device_id), None)

    def on_wire(self, device_id: int, tile_id: int, now: float) -> None:
        """The server started writing ``tile_id``'s work frame to the device's socket."""
        entry = self.sent.get((tile_id, device_id))
        if entry is not None and entry[1] is None:
            entry[1] = now

    def lease(self, dev: DeviceState, unit: int, now: float) -> list[Outbound]:
        """A first lease: its row waits for ``flush``; its work goes now."""
        self.first.append((unit, dev.id))
        return self.send_work(dev, unit, now)

    def flush(self, now: float) -> list[Outbound]:
        """Write the scheduler's first leases in one go (``store.lease_tiles``). A lease the store
        refuses (a bug, never a peer's doing: the scheduler and the store disagree) is logged,
        its tile given to someone else, and its work cancelled (the device keeps the blocks)."""
        if not self.first:
            return []
        core = self.core
        leasing, self.first = self.first, []
        claimed = core.store.lease_tiles(leasing, core.wall(now))
        out: list[Outbound] = []
        for (tile_id, device_id), got in zip(leasing, claimed, strict=True):
            if got is None:
                log.error(
                    "store refused the scheduler's lease of tile %d to device %d; tile re-queued", tile_id, device_id
                )
                self.sent.pop((tile_id, device_id), None)
                core.sched.release(tile_id, device_id, now=now)
                dev = core.devices.get(device_id)
                if dev is not None:
                    dev.cancel(tile_id)
                    out.append(
                        core.send(device_id, Cancel((tile_id,), "the coordinator could not record its lease"), now)
                    )
        return out

    def copy(self, dev: DeviceState, unit: int, copy: str, now: float) -> list[Outbound]:
        """Record the scheduler's copy of an outstanding tile in the store and send the work."""
        core = self.core
        if core.store.claim_copy(unit, dev.id, copy, core.wall(now)) is None:
            # The scheduler and the store disagree (a bug, never a peer's doing): say so, and let
            # the scheduler give the tile to someone else rather than stop training.
            log.error("store refused the scheduler's copy of tile %d to device %d", unit, dev.id)
            core.sched.release(unit, dev.id, now=now)
            return []
        return self.send_work(dev, unit, now)

    def excused(self, dev: DeviceState, unit: int) -> bool:
        """Held waiting on a relay it reported (engine/relays.py)."""
        return unit in dev.excused

    def take_back(self, dev: DeviceState, unit: int, reason: str, excused: bool, now: float) -> list[Outbound]:
        """The lease is revoked and the device barred from the tile; its work is cancelled."""
        core = self.core
        dev.excused.discard(unit)
        self.sent.pop((unit, dev.id), None)
        if not excused:
            core.fleet.failed(dev.id, now)
        dev.cancel(unit)
        core.lost_tile(dev, now)
        # Barred from the tile: it goes to someone else, never straight back to this device.
        core.store.end_lease(unit, dev.id, Outcome.REVOKED, core.wall(now), reason, bar=True)
        if not excused:
            core.store.credit_device(dev.id, revoked=1, now=core.wall(now))
        return [core.send(dev.id, Cancel((unit,), f"lease taken back: {reason}"), now)]

    def on_relay(self, dev: DeviceState, unit: int) -> bool:
        """The tile's blocks were named on the device's relay."""
        return unit in dev.relayed

    def drop(self, dev: DeviceState, why: str, wait: float, on_relay: bool, now: float) -> list[Outbound]:
        """A cut: the device may come back after ``wait``. A cut on a lease that waited on its
        relay's blocks cools the relay (it takes no newcomers for a while), if the device is off
        probation: a new identity costs only the join token, so its cuts, like its reports, cool
        no relay (give-backs and races never do)."""
        core = self.core
        relay_id = core.relays.behind.get(dev.id)
        if relay_id is not None and on_relay and not dev.standing.on_probation(core.trust):
            core.relays.cool(relay_id, now)
        return core.drop(dev, CloseCode.STALLING, f"{why}; come back in {wait:.0f} s", now)

    def send_work(self, dev: DeviceState, tile_id: int, now: float) -> list[Outbound]:
        """Send the work of a lease (its store row is ``flush``'s or ``copy``'s)."""
        core = self.core
        core.standby.working(dev.id, now)
        gemm = core.intake.gemm_of(tile_id)
        tile = gemm.tiles[tile_id]
        out: list[Outbound] = []
        # A device that batches may answer ``batch`` tiles in one frame (at most its hello's
        # batch, within the slots it asked for: cleave join asks batch = slots).
        need = gemm.result_bytes(tile) * dev.batch + core.limits.frame_slack
        if need > dev.frame_limit:  # raised before the device can possibly answer
            dev.frame_limit = need
            out.append(Limit(dev.id, need))
        out.append(core.send(dev.id, self._work(dev, gemm, tile_id), now))
        return out

    def _work(self, dev: DeviceState, gemm: GemmState, tile_id: int) -> Work:
        core = self.core
        sched = core.sched
        pairs = gemm.pairs_of(gemm.tiles[tile_id])
        ra, rb = pairs[0]
        # Forget first: a namespace dropped and a block of a new one may share this message.
        forget = tuple(sorted(dev.forget))
        dev.forget.clear()
        blocks, fetch = [], []
        sent = 0
        for ref in {r.key: r for pair in pairs for r in pair}.values():
            if ref.key not in dev.blocks:
                digest = core.relays.name(dev.id, ref)  # behind a relay: it fetches the block there
                if digest is None:
                    blocks.append(Block(ref.key, ref.wire()))
                    sent += ref.nbytes
                else:
                    fetch.append((ref.key, digest))
                dev.hold(ref)
                sched.holds_block(dev.id, ref.key)
        dev.bytes_down += sent
        self.sent[(tile_id, dev.id)] = [sent, None]
        if fetch:  # it waits on its relay for this tile: what a relay failure may excuse
            if len(dev.relayed) >= 2 * MAX_SLOTS:
                dev.relayed &= set(dev.inflight)
            dev.relayed.add(tile_id)
        if dev.full:
            sched.update(dev.id, full=True)
        more = tuple(key for pa, pb in pairs[1:] for key in (pa.key, pb.key))
        more_t = tuple(flag for pa, pb in pairs[1:] for flag in (pa.transposed, pb.transposed))
        wait = 0.0  # the relay's wait scales with this lease's own deadline (slow links, big tiles)
        if fetch and (hold := sched.hold(tile_id, dev.id)) is not None:
            wait = max(core.relays.wait, WAIT_SHARE * (hold.soft - hold.leased_at))
        return Work(
            tile_id, ra.key, rb.key, ra.transposed, rb.transposed, tuple(blocks), forget, more, more_t, tuple(fetch),
            wait,
        )  # fmt: skip
