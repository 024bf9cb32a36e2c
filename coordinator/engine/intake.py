"""GEMMs coming in from the trainer and going out assembled: each planned by the cost model
(kept on the coordinator, or cut into tiles queued with the scheduler and the store), its
operands' blocks named once per tensor so devices keep them across GEMMs (engine/blocks.py), and
once every tile is verified, put together and handed back; blocks no later GEMM reads are let go.

It owns the live GEMMs, which tile belongs to which, the tensors their blocks come from, and
this step's peaks of GEMMs out at once.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from cleave.coordinator.engine.blocks import BlockRef, Sources, block_ref
from cleave.coordinator.engine.gemms import Done, GemmState, Product, check_finite
from cleave.coordinator.engine.live_plan import DTYPE_NAMES
from cleave.coordinator.engine.outbound import Outbound
from cleave.coordinator.engine.scheduler import UnitSpec
from cleave.coordinator.planning.costmodel import local_seconds
from cleave.coordinator.planning.tiles import GemmKind, a_block, assemble, b_block, piece_tiles
from cleave.db.store import NewTile

if TYPE_CHECKING:
    from cleave.coordinator.engine.core import Core


class Intake:
    """The trainer's GEMMs, from ``submit`` to their product."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.gemms: dict[int, GemmState] = {}
        self.sources = Sources()  # the tensors blocks come from, and who still reads them
        self._tile_gemm: dict[int, int] = {}  # tile id -> gemm id, for tiles of live GEMMs
        # This step's most shipped GEMMs out at once, and of them the most the trainer waited on
        # (not deferred): above 1 only when micro-batches run at once (Trainer.parts_at_once).
        self.peak_in_flight = 0
        self.peak_waited = 0

    def find(self, tile_id: int) -> GemmState | None:
        """The live GEMM ``tile_id`` belongs to, or None once it is done."""
        gemm_id = self._tile_gemm.get(tile_id)
        return None if gemm_id is None else self.gemms.get(gemm_id)

    def tiles(self) -> set[int]:
        """The tiles of live GEMMs."""
        return set(self._tile_gemm)

    def begin_step(self) -> None:
        """A training step starts: blocks still kept from the last one will not be read again."""
        self.peak_in_flight = self.peak_waited = 0
        for namespace in self.sources.sweep():
            self.forget(namespace)

    def submit(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        kind: GemmKind,
        now: float,
        on_done: Done,
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
        core = self.core
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
        if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported GEMM dtypes {a.dtype}, {b.dtype}")
        if not finite_checked:
            check_finite(a, b, kind)
        m, k = a.shape
        n = b.shape[1]
        dtype = DTYPE_NAMES[str(a.dtype)]
        core.fleet.use_dtype(dtype)
        live = core.fleet.plan(core.planner, m, n, k, kind, now)
        pred = core.prediction
        pred.planned.append(live.seconds)
        pred.home.append(local_seconds(m, n, k, dtype, core.planner.ps))
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
        gemm_id = core.store.next_gemm_id()
        pieces = [q for t in tiles for q in piece_tiles(plan, t)]  # one-piece tiles: the blocks
        a_blocks = {(q.i, q.p): block_ref(sources[0], gemm_id, f"a{q.i}.{q.p}", a_block(a, q)) for q in pieces}
        b_blocks = {(q.p, q.j): block_ref(sources[1], gemm_id, f"b{q.p}.{q.j}", b_block(b, q)) for q in pieces}
        new = [NewTile(t.index, a_blocks[(t.i, t.p)].key, b_blocks[(t.p, t.j)].key, t.flops) for t in tiles]
        ids = core.store.add_gemm(
            gemm_id, core.job_id, core.progress.current, kind.value, (m, n, k), new, core.wall(now)
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
        if core.checks.band_checks:
            gemm.form_bands(core.rng)
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
        wakes = [core.upkeep.wake(core.devices[d], now) for d in core.standby.planned(gemm_id, owners.values())]
        # Ahead of deferred GEMMs' queued tiles (FIFO otherwise): the trainer waits on this one.
        front = not deferred and any(g.deferred for g in self.gemms.values() if g is not gemm)
        core.sched.add_gemm(
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
        return gemm_id, wakes + core.dispatch(now)

    def complete(self, gemm: GemmState, now: float) -> None:
        """Every tile verified: the GEMM is assembled (or handed over to be) and its blocks let go."""
        core = self.core
        product = functools.partial(assemble, gemm.plan, gemm.parts, gemm.out_dtype or gemm.a.dtype)
        core.store.finish_gemm(gemm.id, core.wall(now))
        core.sched.drop_gemm(gemm.id, now)
        core.standby.done(gemm.id)
        for tid in gemm.tiles:
            self._tile_gemm.pop(tid, None)
        core.upkeep.done(gemm.tiles)
        # dW is the last reader of its X and dY: their cached pieces can go everywhere.
        last_use = gemm.kind is GemmKind.GRAD_WEIGHT
        for src in gemm.sources:
            if self.sources.release(src, last_use=last_use):
                self.forget(src.id)
        del self.gemms[gemm.id]
        pred = core.prediction
        if not self.gemms and pred.busy_since is not None:
            pred.busy += now - pred.busy_since
            pred.busy_since = None
        gemm.on_done(product if gemm.lazy else product())

    def forget(self, namespace: int) -> None:
        """No GEMM reads this tensor's blocks again: every device drops them."""
        core = self.core
        for dev in core.devices.values():
            keys = dev.drop(namespace)
            if keys:
                core.sched.drops_blocks(dev.id, keys)
                core.sched.update(dev.id, full=dev.full)

    def gemm_of(self, tile_id: int) -> GemmState:
        """The live GEMM a tile of a live GEMM belongs to."""
        return self.gemms[self._tile_gemm[tile_id]]

    def pairs_of(self, tile_id: int) -> list[tuple[BlockRef, BlockRef]]:
        """The (A, B) block pairs a tile multiplies (one a piece of its depth)."""
        gemm = self.gemm_of(tile_id)
        return gemm.pairs_of(gemm.tiles[tile_id])
