"""A GEMM while it is live on the engine: its operands, tiles and blocks, the verified parts
of its product, and the check of one device's result (``Check``, which may run on another
thread). ``check_finite`` refuses operands that would make every honest device fail.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cleave.coordinator.engine.blocks import BlockRef, Source
from cleave.coordinator.planning.tiles import GemmKind, Tile, TileList, TilePlan
from cleave.wire.errors import Diverged
from cleave.wire.messages import Result
from cleave.wire.verify import ROUNDS, Band, Verdict, freivalds_band, freivalds_batch, random_vectors
from cleave.wire.verify import Product as VerifyProduct

if TYPE_CHECKING:
    from cleave.coordinator.engine.devices import DeviceState

Product = Callable[[], torch.Tensor]  # a GEMM's result, computed when called (``submit(lazy=True)``)
Done = Callable[[Any], None]  # what gets a GEMM's result: the tensor, or (``lazy``) its ``Product``


def _cell(t: Tile) -> tuple[int, int, int, int]:
    """A tile's position in the GEMM's reduction and columns (its vectors' key)."""
    return (t.k0, t.k1, t.c0, t.c1)


@dataclass(eq=False)
class BandState:
    """Rows ``r0:r1`` of a GEMM whose results are checked together (``BandCheck``): a result is
    taken when it arrives (its device's slot freed, its lease booked), and the band is checked
    once all of its tiles are in. A band that fails its check has every result checked alone,
    and from then on checks each of its results alone (``alone``) as they come."""

    r0: int
    r1: int
    tiles: frozenset[int]  # tile ids
    answered: dict[int, Check] = field(default_factory=dict)  # taken, waiting for the band's check
    verified: dict[int, Check] = field(default_factory=dict)  # checked alone already (a device on probation)
    checking: bool = False  # its check is out on the verifier
    alone: bool = False  # it failed once: its results are checked one by one

    @property
    def complete(self) -> bool:
        """Every tile of the band is in, some wait for the band's check, and it is not out yet."""
        return (
            not self.checking
            and not self.alone
            and bool(self.answered)
            and len(self.answered) + len(self.verified) == len(self.tiles)
        )

    def take(self, check: Check) -> None:
        """A result taken for the band's check (its device counts it as unchecked)."""
        self.answered[check.msg.tile_id] = check
        check.dev.unchecked += 1

    def drop(self, tile_id: int) -> Check:
        """A taken result leaves the band: judged, or taken back."""
        check = self.answered.pop(tile_id)
        check.dev.unchecked -= 1
        return check

    def due(self) -> tuple[Check, ...]:
        """What the band's check reads: every result of it, those checked alone already too
        (the band's sum needs them; only the others are judged by it)."""
        return (*self.answered.values(), *self.verified.values())


@dataclass
class GemmState:
    """One GEMM out on devices: its operands, tiles and their blocks, and the verified parts of
    its product, until every tile is verified and it is assembled."""

    id: int
    kind: GemmKind
    a: torch.Tensor
    b: torch.Tensor
    plan: TilePlan | TileList
    tiles: dict[int, Tile]  # tile id -> tile
    on_done: Done
    sources: tuple[Source, Source]
    a_blocks: dict[tuple[int, int], BlockRef]  # (i, p) -> A[rows i, ks p]
    b_blocks: dict[tuple[int, int], BlockRef]  # (p, j) -> B[ks p, cols j]
    parts: dict[int, torch.Tensor] = field(default_factory=dict)  # tile index -> verified C block
    lazy: bool = False  # on_done gets a Product: the caller assembles, off the event loop
    out_dtype: torch.dtype | None = None  # of the assembled product (float32 for half-precision wire tiles)
    deferred: bool = False  # nobody waits on it before the step's end (a weight gradient)
    # Checked by row bands (``form_bands``): the bands by first row, each tile's band, and the
    # GEMM's secret vectors, one set per tile position (columns and reduction range; never sent
    # anywhere), with ``B R`` per reduction range, computed at first need.
    bands: dict[int, BandState] | None = None
    band_of: dict[int, BandState] = field(default_factory=dict)
    vectors: dict[tuple[int, int, int, int], torch.Tensor] = field(default_factory=dict)
    _expected: list[tuple[int, int, torch.Tensor]] | None = None

    def form_bands(self, rng: np.random.Generator) -> bool:
        """Group the tiles into row bands to check together, if they make bands: tiles of one
        row range that cover every column over the whole reduction, row ranges that do not
        overlap. False (checked one by one) otherwise."""
        groups: dict[tuple[int, int], list[int]] = {}
        for tid, t in self.tiles.items():
            groups.setdefault((t.r0, t.r1), []).append(tid)
        spans = sorted(groups)
        if any(x[1] > y[0] for x, y in zip(spans, spans[1:])):
            return False
        k, n = self.b.shape
        for tids in groups.values():
            tiles = [self.tiles[t] for t in tids]
            if sum((t.c1 - t.c0) * (t.k1 - t.k0) for t in tiles) != n * k:
                return False
        cells = sorted({_cell(t) for t in self.tiles.values()})
        self.vectors = {cell: random_vectors(cell[3] - cell[2], ROUNDS, rng) for cell in cells}
        self.bands = {r0: BandState(r0, r1, frozenset(tids)) for (r0, r1), tids in groups.items()}
        self.band_of = {tid: self.bands[r0] for (r0, _), tids in groups.items() for tid in tids}
        return True

    def band(self, band: BandState, checks: Sequence[Check]) -> Band:
        """What ``freivalds_band`` reads for ``band``'s results. ``B R`` per reduction range is
        the GEMM's, computed once (on whichever thread checks its first band): one pass over B."""
        if not self.vectors:
            raise RuntimeError("the GEMM was not formed into bands")
        if self._expected is None:
            b = self.b if self.b.dtype in (torch.float32, torch.float64) else self.b.float()
            ranges: dict[tuple[int, int], torch.Tensor] = {}
            for (k0, k1, c0, c1), r in self.vectors.items():
                part = b[k0:k1, c0:c1] @ r.to(b.dtype)
                ranges[(k0, k1)] = part if (k0, k1) not in ranges else ranges[(k0, k1)].add_(part)
            self._expected = [(k0, k1, br) for (k0, k1), br in sorted(ranges.items())]
        return Band(
            self.a[band.r0 : band.r1],
            [self.vectors[_cell(c.tile)] for c in checks],
            self._expected,
            [c.product() for c in checks],
        )

    def blocks_of(self, tile: Tile) -> tuple[BlockRef, BlockRef]:
        """The blocks of the tile's first reduction piece."""
        return self.a_blocks[(tile.i, tile.p)], self.b_blocks[(tile.p, tile.j)]

    def pairs_of(self, tile: Tile) -> list[tuple[BlockRef, BlockRef]]:
        """The (A, B) blocks of every reduction piece the tile adds up."""
        return [(self.a_blocks[(tile.i, q)], self.b_blocks[(q, tile.j)]) for q in range(tile.p, tile.p + tile.pieces)]

    def result_bytes(self, tile: Tile) -> int:
        """Bytes of ``tile``'s result (the frame a device may send back for it)."""
        return (tile.r1 - tile.r0) * (tile.c1 - tile.c0) * self.a.element_size()

    @property
    def done(self) -> bool:
        """Every tile is verified."""
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

    def product(self) -> VerifyProduct:
        """What ``freivalds_batch`` checks: the result, its operands, the blocks they are (so
        that results of one GEMM checked together share the work) and their cached norms."""
        if self.a.dtype not in (torch.float32, torch.float64):  # the check takes norms of its own
            row_norms, b_norm = None, None
        elif len(self.pairs) == 1:
            ((ra, rb),) = self.pairs
            row_norms, b_norm = ra.row_norms(), rb.norm()
        else:
            row_norms = torch.stack([ra.row_norms() for ra, _ in self.pairs]).square().sum(0).sqrt()
            b_norm = math.sqrt(sum(rb.norm() ** 2 for _, rb in self.pairs))
        gemm, t = self.gemm, self.tile
        if gemm.a.dtype in (torch.float16, torch.bfloat16):
            # Half tiles (the half-precision wire, or a bf16/fp16/autocast job): devices sum in
            # float32 and round once (client/kernels.py), and only that rounding is tolerated
            # (wire/verify.py, ROUNDING_FACTOR). A tolerance of the half dtype's own
            # products would let a forged bf16 tile through.
            compute, rounded_to = torch.float32, gemm.a.dtype
        else:
            compute, rounded_to = gemm.a.dtype, None
        return VerifyProduct(
            self.a,
            self.b,
            self.msg.c,
            a_key=(gemm.id, "a", t.r0, t.r1, t.k0, t.k1),
            b_key=(gemm.id, "b", t.k0, t.k1, t.c0, t.c1),
            compute_dtype=compute,
            rounded_to=rounded_to,
            a_row_norms=row_norms,
            b_norm=b_norm,
        )

    def run(self, rng: np.random.Generator) -> tuple[Verdict, float]:
        """The verdict and the seconds it took (``rng``: never seen by a device; not shared
        between threads)."""
        ((verdict, seconds),) = run_checks([self], rng)
        return verdict, seconds


@dataclass(frozen=True, eq=False)
class BandCheck:
    """A band's results, checked as one (``freivalds_band``); like ``Check``, it reads only the
    GEMM's operands, its vectors and the results, so it may run on another thread."""

    gemm: GemmState
    band: BandState
    checks: tuple[Check, ...]

    def run(self, rng: np.random.Generator) -> tuple[bool, list[Verdict], float]:
        """Whether the band passed as one, each result's verdict, and the seconds it took."""
        started = time.perf_counter()
        passed, verdicts = freivalds_band(self.gemm.band(self.band, self.checks), rng)
        return passed, verdicts, time.perf_counter() - started


def run_bands(bands: Sequence[BandCheck], rng: np.random.Generator) -> list[tuple[bool, list[Verdict], float]]:
    """``BandCheck.run`` for each band, in order (one job for the verifier)."""
    return [band.run(rng) for band in bands]


def run_checks(checks: Sequence[Check], rng: np.random.Generator) -> list[tuple[Verdict, float]]:
    """Verdicts of many results checked as one batch (``freivalds_batch``: each result keeps
    its own random vectors, so a forged one is caught as surely as alone and named alone;
    results of one GEMM share ``B R`` and the pass over A), with each one's share of the time.
    Reads nothing of the Core's but the blocks' norm caches, like ``Check.run``."""
    started = time.perf_counter()
    verdicts = freivalds_batch([c.product() for c in checks], rng)
    each = (time.perf_counter() - started) / max(1, len(checks))
    return [(v, each) for v in verdicts]


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
