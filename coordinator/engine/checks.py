"""Checking and booking results: each result verified with Freivalds' check before it is used,
alone or with its row band (``BandCheck``: one pass over A and B per band, not per tile); a
verified result credited and kept, a forged one rejected and counted against its identity
(docs/security.md). The verdicts may come from another thread (the server's verifier): a result
is handed out as a ``Check`` and its verdict comes back to ``settle``.

It owns the verifier's books: its seconds, the bands due for their check, the bands that failed,
and how close honest work came to a reject.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cleave.coordinator.engine.devices import DeviceState
from cleave.coordinator.engine.gemms import BandCheck, Check
from cleave.coordinator.engine.outbound import Outbound
from cleave.coordinator.planning.tiles import a_block, b_block
from cleave.db.store import DeviceStatus, Outcome
from cleave.wire.codes import CloseCode, Code
from cleave.wire.messages import Cancel, Error, Result
from cleave.wire.verify import Product as VerifyProduct
from cleave.wire.verify import Verdict, structure

if TYPE_CHECKING:
    from cleave.coordinator.engine.core import Core

log = logging.getLogger(__name__)

# Results a device may have taken for their bands, unchecked, per slot it holds: beyond that its
# results are checked alone as they come. What a trusted forger can make the coordinator
# recompute before its ban (docs/security.md, "Checks by band"); a device reaches it only when
# bands are long against the fleet (bench_tax: 6 devices of 2 slots answer 5-6 tiles of a
# 32-tile band each).
UNCHECKED_PER_SLOT = 8
WAIT_SLACK = 0.005  # seconds a tile may wait on a device with nothing before it (its event loop)


class Checks:
    """The results' path from their arrival to their credit (or their identity's ban)."""

    def __init__(self, core: Core, *, band_checks: bool = True) -> None:
        self.core = core
        # Results of a GEMM cut into row bands are checked a band at a time (``BandCheck``):
        # one pass over A and B per GEMM, not per tile. False: every result alone, as it comes.
        self.band_checks = band_checks
        self.seconds = 0.0  # the verifier's, in this process
        self.gflop_verified = 0.0  # every device's, in this process
        self.band_failures = 0  # bands whose check failed: their results were checked one by one
        # Largest residual/tolerance accepted, per GEMM kind: how close honest work comes to a reject.
        self.worst_honest: dict[str, float] = {}
        self._due: list[BandCheck] = []  # bands with every result in, for the verifier
        self._credits: dict[int, tuple[int, float, float]] | None = None  # in batch(): device -> (tiles, GFLOP, when)

    def check_bands(self, now: float) -> list[Outbound]:
        """Check the bands whose results are all in, here, on this thread (``handle``; the
        server runs them on its verifier instead: ``take_band_checks``, ``settle_band``)."""
        core = self.core
        out: list[Outbound] = []
        settled = False
        while self._due:
            for band in self.take_band_checks():
                passed, verdicts, seconds = band.run(core.rng)
                out.extend(self.settle_band(band, passed, verdicts, seconds, now))
                settled = True
        return out + core.dispatch(now) if settled else out

    def take_band_checks(self) -> list[BandCheck]:
        """The bands due for their check (each handed out once): the caller runs them (on
        another thread if it likes) and passes each outcome to ``settle_band``."""
        due, self._due = self._due, []
        return due

    def receive(self, dev: DeviceState, msg: Result, dispatch: bool = True) -> list[Outbound] | Check:
        """A result for a tile ``dev`` holds: a ``Check`` to run alone, or taken for its band's
        check (after a check of its shape); a stray or repeated result is answered with an error."""
        core = self.core
        if msg.tile_id not in dev.inflight:
            if dev.cancelled.pop(msg.tile_id, False) is None:  # a copy that lost the race: ignored
                return []
            return [
                core.send(
                    dev.id,
                    Error(Code.NOT_LEASED, f"tile {msg.tile_id} is not leased to you; result ignored"),
                    dev.last_seen,
                )
            ]
        if msg.tile_id in dev.checking:  # its first result for the tile is being verified
            return [
                core.send(
                    dev.id,
                    Error(Code.NOT_LEASED, f"tile {msg.tile_id} was answered already; result ignored"),
                    dev.last_seen,
                )
            ]
        dev.checking.add(msg.tile_id)
        gemm = core.intake.gemm_of(msg.tile_id)
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
        if band is None or band.alone or dev.standing.on_probation(core.trust) or dev.unchecked >= unchecked_cap:
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
        core = self.core
        out = self._settle(check, verdict, seconds, now)
        if out is None:  # nothing changed: nothing to dispatch
            return []
        return out + core.dispatch(now) if dispatch else out

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Settle and dispatch a verifier batch as one piece of bookkeeping: its store rows in one
        savepoint of the group (``store.batch``), and one credit per device for its verified
        results, written as the batch ends."""
        core = self.core
        if self._credits is not None:  # already in one
            yield
            return
        self._credits = {}
        try:
            with core.store.batch():
                try:
                    yield
                finally:  # what was verified is credited, whatever stopped the batch after it
                    for device_id, (n, gflop, at) in self._credits.items():
                        core.store.credit_device(device_id, verified=n, gflop=gflop, now=at)
        finally:
            self._credits = None

    def _settle(self, check: Check, verdict: Verdict | None, seconds: float, now: float) -> list[Outbound] | None:
        """``verdict`` None: the result is taken for its band's check (``settle_band``): its
        lease ends and its device's slot is free, but it is neither credited nor used until its
        band passes."""
        core = self.core
        dev, msg, gemm, tile = check.dev, check.msg, check.gemm, check.tile
        dev.checking.discard(msg.tile_id)
        self.seconds += seconds
        current = core.devices.get(dev.id) is dev and msg.tile_id in dev.inflight
        if not current:
            if verdict is None or verdict.ok or core.gemms.get(gemm.id) is not gemm:
                return None
            return self._forged(dev, now) or None
        leased_at = dev.inflight[msg.tile_id]
        arrived = check.arrived
        nbytes = msg.c.numel() * msg.c.element_size()
        dev.bytes_up += nbytes
        out: list[Outbound] = []
        sent, on_wire = core.leasing.sent.pop((msg.tile_id, dev.id), (0, None))
        if verdict is not None and not verdict.ok:
            core.fleet.failed(dev.id, now)
            core.sched.release(msg.tile_id, dev.id, bar=True, now=now)
            core.store.end_lease(msg.tile_id, dev.id, Outcome.REJECTED, core.wall(now), verdict.reason)
            out.append(
                core.send(
                    dev.id, Error(Code.REJECTED, f"tile {msg.tile_id} failed verification: {verdict.reason}"), now
                )
            )
            return out + self._forged(dev, now)
        losers = core.sched.done(msg.tile_id, dev.id, now)
        # Its lease is over either way; taken for its band, it is booked ``taken`` until the
        # band's check turns it verified (``settle_band``) or rejected (``_reject_taken``).
        core.store.end_lease(
            msg.tile_id, dev.id, Outcome.VERIFIED if verdict is not None else Outcome.TAKEN, core.wall(now)
        )
        dev.tiles_done += 1
        dev.compute_seconds += msg.seconds
        core.standby.working(dev.id, now)
        # From its work frame going on the wire (not from the lease: a frame queued behind the
        # device's other work is that work's link time, not this one's).
        start = leased_at if on_wire is None else max(leased_at, on_wire)
        # A tile waits on a device only behind the work before it, which was done by the time
        # its result arrived here: a claimed wait beyond that is not believed.
        waited = min(msg.waited, max(0.0, dev.result_at - start) + WAIT_SLACK)
        dev.result_at = arrived
        core.fleet.verified(dev.id, tile.flops, msg.seconds, waited, arrived - start, sent, nbytes, arrived)
        raced = []
        for loser in losers:  # other copies lost the race: tell their devices to drop them
            core.leasing.sent.pop((msg.tile_id, loser), None)
            other = core.devices.get(loser)
            if other is not None:
                other.cancel(msg.tile_id)
                core.lost_tile(other, now)
                out.append(core.send(loser, Cancel((msg.tile_id,), "another copy was verified first"), now))
                raced.append((other, msg.tile_id in other.checking))  # answered: its result is being checked
        # Its standing, pace and slots, and the losers': the rules the simulator runs too.
        stallers = core.conduct.settled(dev, arrived, leased_at, tile.flops, raced)
        band = gemm.band_of.get(msg.tile_id)
        if verdict is not None:
            self._verified(check, verdict, now)
            if gemm.done:
                core.intake.complete(gemm, now)
        elif band is not None:
            band.take(check)
        if band is not None and band.complete:  # its last result is in (taken, or checked alone)
            band.checking = True
            self._due.append(BandCheck(gemm, band, band.due()))
        for staller in stallers:  # only once this tile is settled everywhere
            stalled = core.devices.get(staller.id)
            if stalled is not None:
                why = f"{stalled.standing.unanswered} tiles in a row went to other devices without a result from it"
                out.extend(core.cut(stalled, why, now))
        return out

    def _verified(self, check: Check, verdict: Verdict, now: float) -> None:
        """A result passed its check (alone or with its band): credit it and keep it."""
        core = self.core
        dev, gemm, tile = check.dev, check.gemm, check.tile
        kind = gemm.kind.value
        self.worst_honest[kind] = max(self.worst_honest.get(kind, 0.0), verdict.worst_ratio)
        gflop = tile.flops / 1e9
        if self._credits is not None:  # in a batch: one credit per device as it ends
            n, total, _ = self._credits.get(dev.id, (0, 0.0, 0.0))
            self._credits[dev.id] = (n + 1, total + gflop, core.wall(now))
        else:
            core.store.credit_device(dev.id, verified=1, gflop=gflop, now=core.wall(now))
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
        core = self.core
        gemm, band = check.gemm, check.band
        band.checking = False
        self.seconds += seconds
        if core.gemms.get(gemm.id) is not gemm:  # finished or abandoned meanwhile
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
        core.store.verify_taken(
            [(one.msg.tile_id, one.dev.id) for one, verdict in judged if verdict.ok], core.wall(now)
        )
        for one, _ in judged:  # judged here: a ban below does not revoke them (a pass proves its result)
            band.drop(one.msg.tile_id)
        for one, verdict in judged:
            if verdict.ok:
                self._verified(one, verdict, now)
            else:
                out.extend(self._reject_taken(one, f"failed verification: {verdict.reason}", now, forged=True))
        if gemm.done:
            core.intake.complete(gemm, now)
        return out

    def _reject_taken(self, check: Check, reason: str, now: float, *, forged: bool) -> list[Outbound]:
        """A result taken for its band is not used after all: the tile is queued again, never to
        that device. ``forged``: it failed its check, which counts against its identity."""
        core = self.core
        dev, tile_id = check.dev, check.msg.tile_id
        outcome = Outcome.REJECTED if forged else Outcome.REVOKED
        core.store.reject_taken(tile_id, dev.id, core.wall(now), reason, outcome)
        core.sched.reopen(tile_id, dev.id)
        if not forged:
            return []
        out: list[Outbound] = []
        if core.devices.get(dev.id) is dev:
            core.fleet.failed(dev.id, now)
            out.append(core.send(dev.id, Error(Code.REJECTED, f"tile {tile_id} {reason}"), now))
        return out + self._forged(dev, now)

    def _forged(self, dev: DeviceState, now: float) -> list[Outbound]:
        """Count a rejected result against its identity; when that bans it, drop the identity's
        live session (this one, or a newer one if it reconnected meanwhile)."""
        core = self.core
        core.store.credit_device(dev.id, rejected=1, now=core.wall(now))
        dev.tiles_rejected += 1
        if not core.conduct.rejected(dev):
            return []
        reason = "results failed verification"
        core.gate.ban(dev.identity, reason, core.wall(now))
        # Its results still waiting for their bands are not used: their tiles go to others now.
        for gemm in core.gemms.values():
            for band in (gemm.bands or {}).values():
                if band.checking:  # judged with its band: a pass there proves it
                    continue
                for tile_id in [t for t, c in band.answered.items() if c.dev.identity == dev.identity]:
                    self._reject_taken(band.drop(tile_id), "its device was banned", now, forged=False)
        live = core.live(dev.identity)
        return [] if live is None else core.drop(live, CloseCode.BANNED, reason, now, DeviceStatus.BANNED)
