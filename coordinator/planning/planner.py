"""How each GEMM is cut, and which devices compute how much of it: the cost model's decisions.

Pure: shapes, device profiles and the parameter server's profile in, a ``Plan`` out. The live
scheduler asks for one plan per GEMM, ``cleave plan`` for every GEMM of a training step, and the
simulator for both; docs/cost-model.md explains the model with worked examples.

Candidates, each priced by the same model (coordinator/planning/costmodel.py):

* ``local``: the PS multiplies itself (no bytes move, nothing to verify);
* ``output``: an ``r x c`` grid of output tiles, each with the whole reduction, cut into
  ``bands`` bands of whole tile rows; each band is shared out to its own sub-fleet, and a device
  takes a run of its band's tiles in serpentine column order, so it holds a block of
  ``band height x (its tiles / band height)`` tiles;
* ``split-k``: the reduction cut into pieces; each device multiplies a run of pieces and sums
  them itself, so it sends one partial block however many pieces it had; the PS adds partials;
* ``3d``: output tiles *and* the reduction cut into slabs (2.5D/3D multiplication): each slab is
  an output grid for its own share of the fleet; the PS adds the slabs' partials. Fewer input
  bytes go down per device (``sqrt(slabs)`` fewer), more partial bytes come up;
* ``uniform``: today's fixed grid (``tiles.plan_gemm``) dealt round-robin to every device
  (``baseline``), priced exactly. It is a candidate, so a plan is never slower than it; an
  equally fast cost plan is preferred.

Prices are honest: a device is charged the bytes its realised units (``realize``) need wherever
its run starts in its band, with the largest tile of an uneven cut. They are upper bounds that
depend only on the device's number of pieces, never below what ``realize`` hands it.

Pricing one candidate: for a target time ``T`` each device can finish some number of pieces
(its *capacity*: the pipelined time of n pieces, coordinator/planning/costmodel.py, is within ``T`` and
they fit its memory); devices are filled most capable first until every piece is covered, and
the PS's egress, ingress and CPU must also fit in ``T``. The plan's predicted time is the least
such ``T`` (bisection). Filling the most capable first uses the fewest devices, which sends the
fewest bytes: per-device input bytes are concave in its share (blocks are reused), so the
concentrated fill minimises their sum. Both properties make the prediction monotone: a device
more can only add capacity, never bytes, so adding devices never makes a cost plan slower; a
device that would lengthen the step (too slow, too flaky, too little memory, too thin a link)
gets no work.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cleave.coordinator.planning.costmodel import (
    ITEMSIZE,
    VERIFY_ROUNDS,
    CostModelError,
    DeviceClass,
    Profile,
    PSProfile,
    Stage,
    Unit,
    in_flight_memory,
    local_seconds,
    loop_seconds,
    output_egress_floor,
    pipeline,
    pipelined,
    ps_seconds,
)
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy, even_cuts
from cleave.coordinator.planning.tiles import plan_gemm as uniform_grid
from cleave.wire.codes import Name

BISECTION_STEPS = 48  # relative precision ~1e-9 over the bracket's ratio
MAX_DOUBLINGS = 80
TIE = 1e-9  # relative: plans this close in time are equally fast (the bisection's precision)


class Kind(Name):
    """How a GEMM is cut: kept on the PS, output tiles, split-K, a 3D grid, or the fixed grid."""

    LOCAL = "local"
    OUTPUT = "output"
    SPLIT_K = "split-k"
    GRID3D = "3d"
    UNIFORM = "uniform"


@dataclass(frozen=True)
class Gemm:
    """One GEMM, symbolically: ``(m x k) @ (k x n)`` in ``dtype``."""

    m: int
    n: int
    k: int
    dtype: str = "fp32"
    kind: str = "mm"  # fwd | dx | dw | mm: what the product is in a Linear layer
    label: str = ""
    row_piece: int = 0  # > 0: output rows are tokens, cut in these aligned pieces (fwd, dx)
    k_piece: int = 0  # > 0: the reduction is tokens, cut in these aligned pieces (dw)

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k) < 1:
            raise CostModelError(
                f"GEMM {self.label or ''} needs positive sizes, got {self.m}x{self.k} @ {self.k}x{self.n}"
            )
        if self.dtype not in ITEMSIZE:
            raise CostModelError(f"unknown dtype {self.dtype!r}; use one of {', '.join(ITEMSIZE)}")

    @property
    def itemsize(self) -> int:
        """Bytes per element in its dtype."""
        return ITEMSIZE[self.dtype]

    @property
    def flops(self) -> float:
        """FLOP of the product (2 m n k)."""
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class PlannerOptions:
    """What the planner may choose among (partitions, tile edges) and whom it leaves out."""

    min_reliability: float = 0.0  # devices less likely than this to return a unit get none (their
    # time is already charged 1/reliability, which leaves the flaky idle where others can do better)
    edges: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)  # tile edges tried
    slabs: tuple[int, ...] = (2, 4, 8, 16)  # reduction slabs tried by 3d
    pieces: tuple[int, ...] = (256, 512, 1024, 2048, 4096)  # reduction pieces tried by split-k (unaligned)
    kinds: frozenset[Kind] = frozenset(Kind)  # which candidates to consider (tests force one)
    uniform: TilingPolicy = field(default_factory=TilingPolicy)  # the baseline's grid
    max_cells: int = 1 << 16  # tiles per GEMM considered at most (bounds the plan's size)
    local_sum: bool = True  # split-k may let a device add up its own consecutive pieces

    def __post_init__(self) -> None:
        if not 0 <= self.min_reliability <= 1:
            raise CostModelError("min_reliability must be between 0 and 1")
        if not self.kinds:
            raise CostModelError("at least one partition kind must be allowed")


@dataclass(frozen=True)
class Share:
    """What one device class does in a plan."""

    name: str
    devices: int  # devices of the class given work (the rest stay idle)
    pieces: int  # pieces (tiles, or reduction pieces for split-k) over all its devices
    per_device: int  # the most pieces one of its devices gets
    units: int  # work messages over all its devices
    seconds: float  # when its busiest device is done
    down_bytes: float  # sent to its devices
    up_bytes: float  # sent back by them
    compute_seconds: float  # GEMM seconds of its busiest device
    memory: int  # bytes its busiest device needs (costmodel.in_flight_memory)
    device_down: float = 0.0  # bytes sent to its busiest device (an upper bound on what its units need)


@dataclass(frozen=True)
class Plan:
    """How one GEMM is cut and shared out, and what the model predicts for it."""

    gemm: Gemm
    kind: Kind
    grid: tuple[int, int, int]  # output rows, output columns, reduction parts (pieces or slabs)
    seconds: float  # predicted time from submit to the assembled result
    shares: tuple[Share, ...] = ()
    egress_bytes: float = 0.0
    ingress_bytes: float = 0.0
    egress_floor: float = 0.0  # the least the PS can send for these shares of this kind of partition
    ps_seconds: float = 0.0  # PS CPU: verify, assemble, sum partials (or the whole GEMM if local)
    compute_seconds: float = 0.0  # the busiest device's GEMM seconds
    down_seconds: float = 0.0  # the longest download: a device's link or the PS egress
    up_seconds: float = 0.0  # the longest upload: a device's link or the PS ingress
    unit: Unit | None = None  # the largest unit
    local_sum: bool = False  # split-k: each device adds up its pieces and sends one partial
    bands: int = 1  # output and 3d: bands of whole tile rows, each with its own sub-fleet
    # The PS's event loop: framing the work messages and reading the results (``loop_seconds``),
    # beside its CPU's checks and assembly: a cut that ships more bytes per FLOP pays it here.
    loop_seconds: float = 0.0

    @property
    def devices(self) -> int:
        """Devices given work."""
        return sum(s.devices for s in self.shares)

    @property
    def units(self) -> int:
        """Units planned."""
        return sum(s.units for s in self.shares)

    @property
    def bound(self) -> str:
        """What limits the plan: compute, down, up, ps (its checks and assembly) or loop."""
        if self.kind is Kind.LOCAL:
            return "ps"
        parts = {
            "compute": self.compute_seconds,
            "down": self.down_seconds,
            "up": self.up_seconds,
            "ps": self.ps_seconds,
            "loop": self.loop_seconds,
        }
        return max(parts, key=lambda k: parts[k])


# --------------------------------------------------------------------------- pricing


@dataclass(frozen=True)
class _Costs:
    """How a candidate charges one device for n of its pieces. Every function is non-decreasing
    in n, and ``down`` is concave (blocks are reused), which the fill relies on."""

    time: Callable[[int], float]  # seconds until its n pieces are back (before reliability)
    down: Callable[[int], float]  # bytes sent to it: never less than its realised units need
    up: Callable[[int], float]  # bytes it sends back
    units: Callable[[int], int]  # work messages
    compute: Callable[[int], float]  # its GEMM seconds
    memory: Callable[[int], int]  # bytes it needs
    limit: int  # the most pieces it may take (its memory, the group's size)
    reliability: float  # expected share of its work that comes back: time is divided by it


@dataclass(frozen=True)
class _Candidate:
    kind: Kind
    grid: tuple[int, int, int]
    groups: int  # independent groups of pieces (bands x 3d slabs, split-k cells), each with an equal sub-fleet
    pieces: int  # pieces each group needs covered
    costs: Callable[[DeviceClass], _Costs | None]  # None: the class cannot take part
    verify: Callable[[int], float]  # PS verify FLOPs for one device's n pieces
    out_bytes: float
    unit: Unit
    local_sum: bool = True  # split-k: a device sums its pieces (one partial) or sends each
    bands: int = 1  # output and 3d: bands of tile rows
    held: Mapping[str, int] = field(default_factory=dict)  # split-k: pieces each device of a class holds


def _effective(profile: Profile, first_unit_seconds: float) -> float:
    """Expected share of a device's work that comes back: its record, and the chance it stays
    for the time of one unit."""
    stay = math.exp(-first_unit_seconds / profile.session) if math.isfinite(profile.session) else 1.0
    return profile.reliability * stay


def _band_edges(n: int, height: int, cols: int) -> tuple[float, float]:
    """Tile rows and tile columns a run of ``n`` tiles can touch in a band of ``height`` tile rows
    by ``cols`` columns, taken in serpentine column order (down one column, up the next),
    wherever the run starts: ``min(height, n)`` rows and ``ceil((n - 1) / height) + 1``
    columns (a run that starts at the end of a column spills into one more). The column count
    is replaced by the least concave bound above it, ``min(cols, n, 2 + (n - 2) / height)``,
    so that bytes stay concave in ``n``. Both counts are 0 for no tiles."""
    if n <= 0:
        return 0.0, 0.0
    return float(min(height, n)), float(min(cols, n, 2 + (n - 2) / height))


def _most(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [0, limit] with ``fits(n)`` (``fits`` is monotone: true, then false)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _largest(gemm: Gemm, grid: tuple[int, int, int]) -> Unit:
    """The largest unit of a grid: uneven cuts differ by one row, column or reduction index."""
    rows, cols, parts = grid
    return Unit(-(-gemm.m // rows), -(-gemm.n // cols), -(-gemm.k // parts), gemm.itemsize)


def _grid_costs(
    gemm: Gemm, rows: int, cols: int, slabs: int, bands: int, opts: PlannerOptions
) -> Callable[[DeviceClass], _Costs | None]:
    """Output tiles ``rows x cols`` with a reduction of ``k / slabs``, in ``bands`` bands of
    ``rows / bands`` tile rows. A device takes a run of n tiles of one band (``realize``) and
    downloads each row block and column block its run touches once (``_band_edges``, with the
    largest tile: an honest bound wherever the run starts); its downloads, GEMMs and uploads
    overlap (coordinator/planning/costmodel.py ``pipelined``), the later downloads priced as their average."""
    s = gemm.itemsize
    unit = Unit(gemm.m / rows, gemm.n / cols, gemm.k / slabs, s)  # average tiles: totals come out exact
    largest = _largest(gemm, (rows, cols, slabs))  # what memory must hold, and what a block can weigh
    height = rows // bands
    cells = height * cols

    def down(n: int) -> float:
        a, b = _band_edges(n, height, cols)
        return s * largest.k * (largest.m * a + largest.n * b)

    def costs(cls: DeviceClass) -> _Costs | None:
        p = cls.profile
        rate = p.flops_per_s(gemm.dtype)
        if rate <= 0 or largest.memory > p.memory:
            return None
        gemm_s = unit.flops / rate
        first = Stage(largest.down() / p.down, gemm_s + p.overhead, unit.up / p.up)
        rel = _effective(p, first.total + p.rtt)
        if rel < opts.min_reliability:
            return None

        def time(n: int) -> float:
            if n <= 0:
                return 0.0
            rest_down = (down(n) - largest.down()) / (n - 1) / p.down if n > 1 else 0.0
            return pipelined(first, Stage(rest_down, first.compute, first.up), n, p.rtt)

        def memory(n: int) -> int:
            return in_flight_memory(n, largest.memory)

        # Without room for two tiles it cannot prefetch, so the pipelined time would be wrong:
        # it gets one tile.
        limit = _most(cells, lambda n: memory(n) <= p.memory)
        return _Costs(time, down, lambda n: float(n * unit.up), lambda n: n, lambda n: n * gemm_s, memory, limit, rel)

    return costs


def _split_costs(
    gemm: Gemm, rows: int, cols: int, pieces: int, held: Mapping[str, int], local_sum: bool, opts: PlannerOptions
) -> Callable[[DeviceClass], _Costs | None]:
    """Reduction pieces of one ``r x c`` output block. With ``local_sum`` a device's n pieces are
    one work message whose products it adds up itself: one partial back, but its downloads do
    not overlap its GEMMs. Without, each piece is a unit of its own, pipelined, and each sends
    its partial back for the PS to add. ``held[name]`` pieces are on the device already (the
    aligned dW after forward and dX sent them). A piece is charged as the largest one (uneven
    cuts), so a run never needs more than it is charged."""
    s = gemm.itemsize
    unit = Unit(gemm.m / rows, gemm.n / cols, gemm.k / pieces, s)
    largest = _largest(gemm, (rows, cols, pieces))
    piece_bytes = largest.down()
    partial = unit.up

    def costs(cls: DeviceClass) -> _Costs | None:
        p = cls.profile
        rate = p.flops_per_s(gemm.dtype)
        if rate <= 0 or largest.memory > p.memory:
            return None
        have = max(0, held.get(cls.name, 0))
        piece_s = unit.flops / rate

        def down(n: int) -> float:
            return float(max(0, n - have) * piece_bytes)

        if local_sum:

            def time(n: int) -> float:
                return down(n) / p.down + n * piece_s + p.overhead + partial / p.up + p.rtt if n > 0 else 0.0

            def up(n: int) -> float:
                return float(partial) if n > 0 else 0.0

            def units(n: int) -> int:
                return 1 if n > 0 else 0

            def memory(n: int) -> int:  # one unit in flight: all its pieces and the partial
                return in_flight_memory(1, n * largest.down() + largest.up) if n else 0
        else:
            held_stage = Stage(0.0, piece_s + p.overhead, partial / p.up)
            fresh = Stage(piece_bytes / p.down, piece_s + p.overhead, partial / p.up)

            def time(n: int) -> float:  # the pieces it holds first, then the ones it downloads
                if n <= 0:
                    return 0.0
                k = min(n, have)
                if k == 0:
                    return pipelined(fresh, fresh, n, p.rtt)
                return (
                    pipeline([held_stage] * k + [fresh] * (n - k), p.rtt)
                    if n - k < 64
                    else pipelined(held_stage, held_stage, k, 0.0) + pipelined(fresh, fresh, n - k, p.rtt)
                )

            def up(n: int) -> float:
                return float(n * partial)

            def units(n: int) -> int:
                return n

            def memory(n: int) -> int:  # and the pieces it holds, which it keeps
                return in_flight_memory(n, largest.memory) + math.ceil(have * largest.down()) if n else 0

        rel = _effective(p, time(1))
        if rel < opts.min_reliability:
            return None
        limit = _most(pieces, lambda n: memory(n) <= p.memory)
        return _Costs(time, down, up, units, lambda n: n * piece_s, memory, limit, rel)

    return costs


def _capacity(costs: _Costs, t: float) -> int:
    """The most pieces the device delivers within ``t``: its time for them, stretched by the
    work it is expected to lose, fits (times are non-decreasing in n)."""
    return _most(costs.limit, lambda n: costs.time(n) <= t * costs.reliability)


@dataclass
class _Fill:
    ok: bool
    used: list[tuple[DeviceClass, _Costs, int, int, int]]  # class, costs, full devices, their pieces, last one's
    down: float = 0.0
    up: float = 0.0
    units: int = 0
    verify: float = 0.0
    ps: float = 0.0
    loop: float = 0.0


def _fill(
    cand: _Candidate, classes: Sequence[tuple[DeviceClass, _Costs]], t: float, ps: PSProfile, gemm: Gemm
) -> _Fill:
    """Cover one group's pieces with the most capable devices first (each group: bands and slabs,
    or cells, gets ``count // groups`` devices of every class); then the PS must keep up in ``t``."""
    caps = sorted(((_capacity(costs, t), cls.name, cls, costs) for cls, costs in classes), key=lambda e: (-e[0], e[1]))
    remaining = cand.pieces
    fill = _Fill(False, [])
    for cap, _, cls, costs in caps:
        if remaining <= 0 or cap <= 0:
            break
        count = cls.count // cand.groups
        if count <= 0:
            continue
        full = min(count, remaining // cap)
        last = remaining - full * cap if full < count else 0
        remaining -= full * cap + last
        for n, d in ((cap, full), (last, 1 if last else 0)):
            if d:
                fill.down += d * costs.down(n)
                fill.up += d * costs.up(n)
                fill.units += d * costs.units(n)
                fill.verify += d * cand.verify(n)
        fill.used.append((cls, costs, full, cap, last))
    if remaining > 0:
        return fill
    g = cand.groups
    fill.down, fill.up, fill.units, fill.verify = fill.down * g, fill.up * g, fill.units * g, fill.verify * g
    cols = cand.grid[1]
    fill.ps = ps_seconds(fill.units, fill.verify, max(0.0, fill.up - cand.out_bytes), cand.out_bytes, ps, cols)
    fill.loop = _loop(ps, gemm, fill.units, fill.down, fill.up)
    ok = _send(ps, gemm, fill.down) <= t and fill.up / ps.ingress <= t
    fill.ok = ok and fill.ps <= t and fill.loop <= t
    return fill


def _send(ps: PSProfile, gemm: Gemm, sent: float) -> float:
    """Seconds for ``sent`` bytes of this GEMM's blocks to reach the devices (through relays, if
    any: each distinct block leaves the PS once per relay; ``PSProfile.send_seconds``)."""
    return ps.send_seconds(sent, float(gemm.itemsize * gemm.k * (gemm.m + gemm.n)))


def _loop(ps: PSProfile, gemm: Gemm, units: float, sent: float, received: float) -> float:
    """The PS's event loop for ``units`` work messages (one tile each, one result each back),
    ``sent`` bytes of blocks to the devices (the share that leaves the PS when relays carry
    the rest: each distinct block once per relay) and ``received`` bytes of results."""
    if ps.relays > 0:
        sent = min(sent, ps.relays * float(gemm.itemsize * gemm.k * (gemm.m + gemm.n)))
    return loop_seconds(units, units, sent, received, ps)


def _split_floor(gemm: Gemm, rows: int, cols: int, pieces: int, held_pieces: int) -> float:
    """Least the PS sends for split-K cells ``rows x cols``: every input piece goes down once per
    cell (a device works in one cell), less ``held_pieces`` pieces that devices already hold
    (each at most a largest piece)."""
    every = float(gemm.itemsize * gemm.k * (gemm.m * cols + gemm.n * rows))
    return max(0.0, every - held_pieces * _largest(gemm, (rows, cols, pieces)).down())


def _held_pieces(cand: _Candidate, counts: Iterable[tuple[str, int]]) -> int:
    """Pieces the devices of ``counts`` (class, devices) can save in a split-K candidate: each
    device works in one cell, so at most all of that cell's pieces."""
    return sum(count * min(cand.pieces, max(0, cand.held.get(name, 0))) for name, count in counts)


def _price(
    cand: _Candidate, gemm: Gemm, fleet: Sequence[DeviceClass], ps: PSProfile, cutoff: float = math.inf
) -> Plan | None:
    """The least time ``t`` at which the fill covers every piece and the PS keeps up (bisection:
    feasibility only grows with ``t``). None when no class can take part, or when the candidate
    cannot finish by ``cutoff`` (the best plan so far: one fill tells)."""
    classes = [(cls, costs) for cls in fleet if cls.count >= cand.groups for costs in [cand.costs(cls)] if costs]
    if not classes:
        return None
    if math.isfinite(cutoff):
        if not _fill(cand, classes, cutoff, ps, gemm).ok:
            return None
        hi = cutoff
    else:
        hi = max(
            1e-9,
            min(
                costs.time(min(costs.limit, max(1, -(-cand.pieces // (cls.count // cand.groups))))) / costs.reliability
                for cls, costs in classes
            ),
        )
        for _ in range(MAX_DOUBLINGS):
            if _fill(cand, classes, hi, ps, gemm).ok:
                break
            hi *= 2
        else:
            return None
    lo = hi / 2
    while lo > 1e-12 and _fill(cand, classes, lo, ps, gemm).ok:
        hi, lo = lo, lo / 2
    for _ in range(BISECTION_STEPS):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        if _fill(cand, classes, mid, ps, gemm).ok:
            hi = mid
        else:
            lo = mid
    fill = _fill(cand, classes, hi, ps, gemm)
    g = cand.groups
    shares = []
    compute = down_s = up_s = 0.0
    for cls, costs, full, cap, last in fill.used:
        busiest = cap if full else last
        devices = full + (1 if last else 0)
        pieces = full * cap + last
        shares.append(
            Share(
                cls.name,
                devices * g,
                pieces * g,
                busiest,
                (full * costs.units(cap) + costs.units(last)) * g,
                costs.time(busiest) / costs.reliability,
                (full * costs.down(cap) + costs.down(last)) * g,
                (full * costs.up(cap) + costs.up(last)) * g,
                costs.compute(busiest),
                costs.memory(busiest),
                costs.down(busiest),
            )
        )
        compute = max(compute, costs.compute(busiest))
        down_s = max(down_s, costs.down(busiest) / cls.profile.down)
        up_s = max(up_s, costs.up(busiest) / cls.profile.up)
    seconds = max(
        [sh.seconds for sh in shares] + [_send(ps, gemm, fill.down), fill.up / ps.ingress, fill.ps, fill.loop]
    )
    rows, cols, parts = cand.grid
    if cand.kind is Kind.SPLIT_K:
        # Every input piece goes down once per cell, less what the devices that can take part hold.
        savings = _held_pieces(cand, ((c.name, c.count // g * g) for c, _ in classes))
        floor = _split_floor(gemm, rows, cols, parts, savings)
    else:  # each device's share of outputs (its tiles, smallest sizes) needs at least the AM-GM bound
        area, depth = (gemm.m // rows) * (gemm.n // cols), gemm.k // parts
        floor = g * sum(
            d * output_egress_floor(n * area, depth, gemm.itemsize)
            for _, _, full, cap, last in fill.used
            for n, d in ((cap, full), (last, 1 if last else 0))
        )
    return Plan(
        gemm,
        cand.kind,
        cand.grid,
        seconds,
        tuple(shares),
        fill.down,
        fill.up,
        floor,
        fill.ps,
        compute,
        max(down_s, _send(ps, gemm, fill.down)),
        max(up_s, fill.up / ps.ingress),
        _largest(gemm, cand.grid),
        cand.kind is Kind.SPLIT_K and cand.local_sum,
        cand.bands,
        fill.loop,
    )


# --------------------------------------------------------------------------- candidates


def _grid_candidate(gemm: Gemm, rows: int, cols: int, slabs: int, bands: int, opts: PlannerOptions) -> _Candidate:
    unit = Unit(gemm.m / rows, gemm.n / cols, gemm.k / slabs, gemm.itemsize)
    return _Candidate(
        Kind.OUTPUT if slabs == 1 else Kind.GRID3D,
        (rows, cols, slabs),
        slabs * bands,
        rows // bands * cols,
        _grid_costs(gemm, rows, cols, slabs, bands, opts),
        lambda n: n * unit.verify_flops(),
        float(gemm.itemsize * gemm.m * gemm.n),
        unit,
        bands=bands,
    )


def _split_candidate(
    gemm: Gemm, rows: int, cols: int, pieces: int, held: Mapping[str, int], local_sum: bool, opts: PlannerOptions
) -> _Candidate:
    """``pieces`` even pieces of the reduction (``tiles.even_cuts``), as ``realize`` cuts them."""
    r, c = gemm.m / rows, gemm.n / cols
    unit = Unit(r, c, gemm.k / pieces, gemm.itemsize)

    def verify(n: int) -> float:
        if not local_sum:
            return n * unit.verify_flops()
        return 2.0 * VERIFY_ROUNDS * (r * unit.k * n + unit.k * n * c + r * c) if n else 0.0

    return _Candidate(
        Kind.SPLIT_K,
        (rows, cols, pieces),
        rows * cols,
        pieces,
        _split_costs(gemm, rows, cols, pieces, held, local_sum, opts),
        verify,
        float(gemm.itemsize * gemm.m * gemm.n),
        unit,
        local_sum,
        held=dict(held),
    )


def _parts(size: int, edges: Iterable[int]) -> set[int]:
    return {max(1, -(-size // e)) for e in edges} | {1}


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def _gemm_kind(gemm: Gemm) -> GemmKind:
    return GemmKind(gemm.kind) if gemm.kind in {k.value for k in GemmKind} else GemmKind.PLAIN


def uniform_shapes(
    gemm: Gemm, devices: int, policy: TilingPolicy, max_cells: int | None = None
) -> list[tuple[int, int, int]]:
    """Every distinct grid ``tiles.plan_gemm`` picks for 1 to ``devices`` devices, in order (up to
    ``max_cells`` tiles: the planner prices no larger grid). The planner prices them all, so for
    any fleet it has priced the round-robin baseline's grid (``devices``'s is always among them),
    and adding a device only adds grids.

    ``plan_gemm``'s grid only grows with the device count, one grid per run of counts; each run
    is found by galloping then bisecting for its end, so this costs O(grids x log(devices))
    calls, not O(devices)."""
    kind = _gemm_kind(gemm)
    devices = max(1, devices)

    def shape(count: int) -> tuple[int, int, int]:
        return uniform_grid(gemm.m, gemm.n, gemm.k, kind, count, policy).shape

    shapes = [shape(1)]
    count, last = 1, shape(devices)
    while shapes[-1] != last and count < devices and (max_cells is None or math.prod(shapes[-1]) <= max_cells):
        same, step = count, 1  # shape(same) is the current grid; find the first count with another
        while True:
            probe = min(devices, same + step)
            if shape(probe) != shapes[-1]:
                break
            same, step = probe, step * 2
        other = probe
        while other - same > 1:
            mid = (same + other) // 2
            if shape(mid) == shapes[-1]:
                same = mid
            else:
                other = mid
        count = other
        shapes.append(shape(count))
    if last not in shapes:  # plan_gemm's grid not monotone in the count after all: never miss the baseline's
        shapes.append(last)
    return shapes


def _aligned(gemm: Gemm, grid: tuple[int, int, int], split: bool) -> bool:
    """Whether a grid keeps the GEMM's token cuts: output rows in ``ceil(m / row_piece)`` even
    pieces, and a reduction cut (split-k) in ``ceil(k / k_piece)``. Output tiles that keep the
    whole reduction are aligned with any reduction cut."""
    rows, _, parts = grid
    if gemm.row_piece and rows != -(-gemm.m // gemm.row_piece):
        return False
    return not (gemm.k_piece and split and parts != -(-gemm.k // gemm.k_piece))


def candidates(
    gemm: Gemm, devices: int, opts: PlannerOptions, held: Mapping[str, int] | None = None
) -> list[_Candidate]:
    """Every grid the planner prices for ``gemm`` (``local`` and ``uniform`` are priced apart).
    Depends on the fleet only through its size, and only grows with it."""
    held = held or {}
    out: list[_Candidate] = []
    rows_opts = {-(-gemm.m // gemm.row_piece)} if gemm.row_piece else _parts(gemm.m, opts.edges)
    cols_opts = _parts(gemm.n, opts.edges)
    grids: set[tuple[int, int, int]] = {(r, c, 1) for r in rows_opts for c in cols_opts}
    splits: set[tuple[int, int, int]] = set()
    for shape in uniform_shapes(gemm, devices, opts.uniform, opts.max_cells):
        split = shape[2] > 1
        if _aligned(gemm, shape, split):
            (splits if split else grids).add(shape)
    if Kind.GRID3D in opts.kinds and not gemm.k_piece:
        for rows, cols, _ in list(grids):
            grids |= {(rows, cols, slabs) for slabs in opts.slabs if gemm.k // slabs >= 64}
    for rows, cols, slabs in sorted(grids):
        kind = Kind.OUTPUT if slabs == 1 else Kind.GRID3D
        if kind in opts.kinds and rows * cols * slabs <= opts.max_cells:
            out += [_grid_candidate(gemm, rows, cols, slabs, bands, opts) for bands in _divisors(rows)]
    if Kind.SPLIT_K in opts.kinds:
        pieces = {gemm.k_piece} if gemm.k_piece else {min(p, gemm.k) for p in opts.pieces}
        for piece in pieces:
            for rows, cols in _partial_cuts(gemm):
                splits.add((rows, cols, -(-gemm.k // piece)))
        for rows, cols, parts in sorted(splits):
            if parts < 2 or parts > gemm.k or rows * cols * parts > opts.max_cells:
                continue
            if not _aligned(gemm, (rows, cols, parts), True):
                continue
            for local_sum in (True, False) if opts.local_sum else (False,):
                out.append(_split_candidate(gemm, rows, cols, parts, held, local_sum, opts))
    return out


PARTIAL_LIMITS = (64 << 20, 256 << 20, 1 << 30, 4 << 30)  # bytes of one partial block tried by split-k


def _partial_cuts(gemm: Gemm) -> list[tuple[int, int]]:
    """Cuts of the output so that one partial block stays under each of ``PARTIAL_LIMITS``
    (rows fixed to the token pieces of an aligned GEMM)."""
    s = gemm.itemsize
    aligned = -(-gemm.m // gemm.row_piece) if gemm.row_piece else 0
    out = set()
    for limit in PARTIAL_LIMITS:
        rows, cols = aligned or 1, 1
        while s * (-(-gemm.m // rows)) * (-(-gemm.n // cols)) > limit and rows * cols < 4096 and cols < gemm.n:
            if -(-gemm.m // rows) >= -(-gemm.n // cols) and not aligned:
                rows += 1
            else:
                cols += 1
        out.add((rows, cols))
    return sorted(out)


def _lower_bound(cand: _Candidate, gemm: Gemm, fleet: Sequence[DeviceClass], ps: PSProfile) -> float:
    """No plan of this candidate is faster: the whole fleet computing, the PS's own share of
    CPU, its partials through the ingress, or its least input bytes through the egress."""
    rate = sum(cls.count * cls.profile.flops_per_s(gemm.dtype) for cls in fleet)
    compute = gemm.flops / rate if rate > 0 else math.inf
    out = cand.out_bytes
    rows, cols, parts = cand.grid
    if cand.kind is Kind.SPLIT_K:
        egress = _split_floor(gemm, rows, cols, parts, _held_pieces(cand, ((c.name, c.count) for c in fleet)))
    else:  # each band of each slab sends its rows of A and all of B at least once
        egress = float(gemm.itemsize * gemm.k * (gemm.m + cand.bands * gemm.n))
    if cand.kind is Kind.SPLIT_K and cand.local_sum:
        cells = cand.groups
        check = ps_seconds(cells, cand.verify(cand.pieces) * cells, 0.0, out, ps, cand.grid[1])
        return max(compute, check, _send(ps, gemm, egress), _loop(ps, gemm, cells, egress, out))
    units = cand.groups * cand.pieces
    partials = units * cand.unit.up
    return max(
        compute,
        ps_seconds(units, units * cand.unit.verify_flops(), max(0.0, partials - out), out, ps, cand.grid[1]),
        partials / ps.ingress,
        _send(ps, gemm, egress),
        _loop(ps, gemm, units, egress, partials),
    )


# --------------------------------------------------------------------------- the plan


def baseline(
    gemm: Gemm, fleet: Sequence[DeviceClass], ps: PSProfile, opts: PlannerOptions | None = None
) -> Plan | None:
    """Today's fixed grid (``tiles.plan_gemm``), tile ``t`` to device ``t mod P`` over every device
    that can multiply in the dtype, class by class in the fleet's order: the round-robin
    baseline, priced exactly (a device downloads each block the first time one of its tiles
    needs it; its work takes 1/reliability longer; it needs ``in_flight_memory`` of its largest
    tile, and a device that lacks it never finishes). None when no device can multiply in the
    dtype. O(classes + tiles): devices beyond the tiles get none."""
    opts = opts or PlannerOptions()
    members = [cls for cls in fleet if cls.profile.flops_per_s(gemm.dtype) > 0 and cls.count > 0]
    P = sum(cls.count for cls in members)
    if not P:
        return None
    firsts = [0]  # each member class's first device
    for cls in members:
        firsts.append(firsts[-1] + cls.count)
    tp = uniform_grid(gemm.m, gemm.n, gemm.k, _gemm_kind(gemm), P, opts.uniform)
    s = gemm.itemsize
    stages: dict[int, list[Stage]] = {}
    held: dict[int, set[tuple[str, int, int]]] = {}
    sent: dict[int, float] = {}
    back: dict[int, float] = {}
    flops: dict[int, float] = {}
    peak: dict[int, float] = {}
    area: dict[int, int] = {}
    shapes: dict[tuple[int, int, int], Unit] = {}
    verify = 0.0
    largest: Unit | None = None
    tiles = tp.tiles
    for tile in tiles:
        d = tile.index % P
        p = members[bisect.bisect_right(firsts, d) - 1].profile
        shape = (tile.r1 - tile.r0, tile.c1 - tile.c0, tile.k1 - tile.k0)
        unit = shapes.get(shape) or shapes.setdefault(shape, Unit(*shape, s))
        verify += unit.verify_flops()
        largest = unit if largest is None or unit.flops > largest.flops else largest
        a_key, b_key = ("a", tile.i, tile.p), ("b", tile.p, tile.j)
        mine = held.setdefault(d, set())
        down = (0 if a_key in mine else unit.a_bytes) + (0 if b_key in mine else unit.b_bytes)
        mine |= {a_key, b_key}
        rate = p.flops_per_s(gemm.dtype)
        stages.setdefault(d, []).append(Stage(down / p.down, unit.flops / rate + p.overhead, unit.up / p.up))
        flops[d] = flops.get(d, 0.0) + unit.flops / rate
        sent[d] = sent.get(d, 0.0) + down
        back[d] = back.get(d, 0.0) + unit.up
        peak[d] = max(peak.get(d, 0.0), unit.memory)
        area[d] = area.get(d, 0) + shape[0] * shape[1]
    # class -> devices, tiles, most tiles, seconds, down, up, compute, memory, most down
    rows: dict[str, list[float]] = {}
    worst = compute = down_s = up_s = 0.0
    for d in sorted(stages):
        cls = members[bisect.bisect_right(firsts, d) - 1]
        p = cls.profile
        memory = in_flight_memory(len(stages[d]), peak[d])
        t = pipeline(stages[d], p.rtt) / max(1e-9, _effective(p, stages[d][0].total + p.rtt))
        if memory > p.memory:
            t = math.inf  # round-robin hands it tiles it cannot hold
        row = rows.setdefault(cls.name, [0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0, 0.0])
        row[0] += 1
        row[1] += len(stages[d])
        row[2] = max(row[2], len(stages[d]))
        row[3] = max(row[3], t)
        row[4] += sent[d]
        row[5] += back[d]
        row[6] = max(row[6], flops[d])
        row[7] = max(row[7], memory)
        row[8] = max(row[8], sent[d])
        worst, compute = max(worst, t), max(compute, flops[d])
        down_s, up_s = max(down_s, sent[d] / p.down), max(up_s, back[d] / p.up)
    shares = tuple(
        Share(name, int(v[0]), int(v[1]), int(v[2]), int(v[1]), v[3], v[4], v[5], v[6], int(v[7]), v[8])
        for name, v in rows.items()
    )
    egress, ingress = sum(sent.values()), sum(back.values())
    out_bytes = float(s * gemm.m * gemm.n)
    gr, gc, gk = tp.shape
    ps_s = ps_seconds(len(tiles), verify, max(0.0, ingress - out_bytes), out_bytes, ps, gc)
    loop = _loop(ps, gemm, len(tiles), egress, ingress)
    seconds = max(worst, _send(ps, gemm, egress), ingress / ps.ingress, ps_s, loop)
    if gk == 1:  # each device's outputs need at least the AM-GM bound, as an output plan's shares
        floor = sum(output_egress_floor(a, gemm.k, s) for a in area.values())
    else:  # split-k's floor; a device here takes tiles of any cell, so the whole output is one cell
        floor = _split_floor(gemm, 1, 1, gk, 0)
    return Plan(
        gemm,
        Kind.UNIFORM,
        (gr, gc, gk),
        seconds,
        shares,
        egress,
        ingress,
        floor,
        ps_s,
        compute,
        max(down_s, _send(ps, gemm, egress)),
        max(up_s, ingress / ps.ingress),
        largest,
        loop_seconds=loop,
    )


def local_plan(gemm: Gemm, ps: PSProfile) -> Plan:
    """The GEMM kept on the PS: no bytes move, no verification."""
    seconds = local_seconds(gemm.m, gemm.n, gemm.k, gemm.dtype, ps)
    return Plan(gemm, Kind.LOCAL, (1, 1, 1), seconds, ps_seconds=seconds)


def _uniform_lower_bound(gemm: Gemm, fleet: Sequence[DeviceClass], ps: PSProfile, opts: PlannerOptions) -> float:
    """No round-robin plan is faster, in O(classes): its PS work is exact without dealing a tile
    (``rows x cols x parts`` units, checks summing to ``32 (m k cols + k n rows + m n parts)``),
    its partials come through the ingress, and every input goes down at least once."""
    devices = sum(cls.count for cls in fleet if cls.profile.flops_per_s(gemm.dtype) > 0)
    if not devices:
        return math.inf
    rows, cols, parts = uniform_grid(gemm.m, gemm.n, gemm.k, _gemm_kind(gemm), devices, opts.uniform).shape
    s, m, n, k = gemm.itemsize, gemm.m, gemm.n, gemm.k
    out = float(s * m * n)
    verify = 2.0 * VERIFY_ROUNDS * (m * k * cols + k * n * rows + m * n * parts)
    ps_s = ps_seconds(rows * cols * parts, verify, out * (parts - 1), out, ps, cols)
    sent = s * (m * k + k * n)
    loop = _loop(ps, gemm, rows * cols * parts, sent, out * parts)
    return max(ps_s, out * parts / ps.ingress, _send(ps, gemm, sent), loop)


def plan_gemm(
    gemm: Gemm,
    fleet: Sequence[DeviceClass],
    ps: PSProfile,
    opts: PlannerOptions | None = None,
    *,
    held: Mapping[str, int] | None = None,
) -> Plan:
    """The fastest predicted plan for ``gemm`` on ``fleet`` (ties: fewer bytes, then the simpler
    kind; ``uniform`` only when it is faster than every other kind allowed). ``held[class]``:
    reduction pieces each device of that class holds already (the aligned dW of the live
    scheduler). Every plan keeps the GEMM's token cuts (``row_piece``, ``k_piece``), the round-robin
    one included. Raises CostModelError when nothing is feasible."""
    opts = opts or PlannerOptions()
    plans: list[Plan] = []
    if Kind.LOCAL in opts.kinds:
        plans.append(local_plan(gemm, ps))
    devices = sum(cls.count for cls in fleet)
    best = min((p.seconds for p in plans), default=math.inf)
    # Cheapest bound first; a candidate that cannot beat the best so far (within TIE, so that ties
    # are priced and broken as documented) is not priced: its bound, or one fill at that time, says so.
    found = candidates(gemm, devices, opts, held)
    ranked = sorted((_lower_bound(c, gemm, fleet, ps), i, c) for i, c in enumerate(found))
    for lb, _, cand in ranked:
        if lb > best * (1 + TIE):
            break
        plan = _price(cand, gemm, fleet, ps, best * (1 + TIE))
        if plan is not None:
            plans.append(plan)
            best = min(best, plan.seconds)
    # Round-robin last, and only when it could be faster (pricing it deals every tile).
    uniform: Plan | None = None
    unaligned = False
    if Kind.UNIFORM in opts.kinds and _uniform_lower_bound(gemm, fleet, ps, opts) < best * (1 - TIE):
        base = baseline(gemm, fleet, ps, opts)
        if base is not None and math.isfinite(base.seconds):
            unaligned = not _aligned(gemm, base.grid, base.grid[2] > 1)
            uniform = None if unaligned else base
    finite = [p for p in plans if math.isfinite(p.seconds)]
    if not finite and uniform is None:
        kinds = ", ".join(sorted(k.value for k in opts.kinds))
        why = "; the round-robin grid does not keep its token cuts" if unaligned else ""
        raise CostModelError(
            f"{gemm.label or 'the GEMM'} ({gemm.m}x{gemm.k} @ {gemm.k}x{gemm.n}, {gemm.dtype}) has "
            f"no feasible plan of kind {kinds}: no device can take a unit of it (dtype, memory, "
            f"reliability) and the parameter server cannot compute it{why}"
        )
    order = {k: i for i, k in enumerate(Kind)}
    chosen = min(
        finite,
        key=lambda p: (p.seconds, p.egress_bytes + p.ingress_bytes, order[p.kind], p.grid, p.bands),
        default=None,
    )
    if uniform is not None and (chosen is None or uniform.seconds < chosen.seconds * (1 - TIE)):
        return uniform
    assert chosen is not None
    return chosen


# --------------------------------------------------------------------------- a whole step


@dataclass(frozen=True)
class StepPlan:
    """A training step's plan: each distinct GEMM's plan with its count, and the PS's own work."""

    plans: tuple[tuple[Plan, int], ...]  # each distinct GEMM's plan and how many times a step runs it
    ps_other_seconds: float  # PS work that is not a GEMM (attention products, optimizer, elementwise)
    fleet_flops: float  # FLOP/s of every device in the fleet, in the training dtype

    @property
    def gemm_seconds(self) -> float:
        """Predicted seconds of the step's GEMMs, one after another."""
        return sum(p.seconds * count for p, count in self.plans)

    @property
    def seconds(self) -> float:
        """Predicted seconds of the step: its GEMMs and the PS's own work."""
        return self.gemm_seconds + self.ps_other_seconds

    @property
    def flops(self) -> float:
        """FLOP of the step's GEMMs."""
        return sum(p.gemm.flops * count for p, count in self.plans)

    @property
    def utilisation(self) -> float:
        """Share of the fleet's FLOP/s the step's GEMMs use (MFU over the whole fleet)."""
        return self.flops / (self.seconds * self.fleet_flops) if self.seconds > 0 and self.fleet_flops > 0 else 0.0

    def total(self, attr: str) -> float:
        """The sum of a per-GEMM figure (``attr`` of each plan) over the step."""
        figures: list[float] = [getattr(p, attr) * count for p, count in self.plans]
        return sum(figures)


def plan_step(
    gemms: Iterable[tuple[Gemm, int]],
    fleet: Sequence[DeviceClass],
    ps: PSProfile,
    opts: PlannerOptions | None = None,
    *,
    ps_other_seconds: float = 0.0,
) -> StepPlan:
    """Plan each distinct GEMM of a step once. GEMMs run one after another, so the step's
    prediction is their sum (dX and dW of a layer overlap in practice: a conservative sum)."""
    cache: dict[Gemm, Plan] = {}
    plans = []
    for gemm, count in gemms:
        if gemm not in cache:
            cache[gemm] = plan_gemm(gemm, fleet, ps, opts)
        plans.append((cache[gemm], count))
    dtype = plans[0][0].gemm.dtype if plans else "fp32"
    fleet_flops = sum(cls.count * cls.profile.flops_per_s(dtype) for cls in fleet)
    return StepPlan(tuple(plans), ps_other_seconds, fleet_flops)


# --------------------------------------------------------------------------- realising a plan


@dataclass(frozen=True)
class PlannedUnit:
    """One work unit of a plan: ``C[r0:r1, c0:c1] (+)= A[r0:r1, k0:k1] @ B[k0:k1, c0:c1]`` for the
    ``device``-th device of class ``owner`` (its reduction is one run of pieces)."""

    r0: int
    r1: int
    c0: int
    c1: int
    k0: int
    k1: int
    owner: str
    device: int
    member: int = 0  # which device of class ``owner`` (0 .. its count - 1)


def _band_order(band: int, height: int, cols: int) -> list[tuple[int, int]]:
    """A band's tiles (tile row, tile column) in serpentine column order: down the first column,
    up the next. A run of n of them touches at most ``_band_edges(n, height, cols)`` rows and
    columns, wherever it starts (the turns keep a run that crosses a column near where it was)."""
    out = []
    for j in range(cols):
        rows = range(band * height, (band + 1) * height)
        out += [(i, j) for i in (rows if j % 2 == 0 else reversed(rows))]
    return out


def _realize_uniform(plan: Plan) -> list[PlannedUnit]:
    """Round-robin: tile ``t`` of the fixed grid to device ``t mod P``, the devices in the order of
    the plan's shares (the fleet's order, as ``baseline`` dealt them)."""
    g = plan.gemm
    rows, cols, parts = plan.grid
    members = [(share.name, i) for share in plan.shares for i in range(share.devices)]
    rc, cc, kc = even_cuts(g.m, rows), even_cuts(g.n, cols), even_cuts(g.k, parts)
    out = []
    for t, (i, j, p) in enumerate((i, j, p) for i in range(rows) for j in range(cols) for p in range(parts)):
        d = t % len(members)
        name, member = members[d]
        out.append(PlannedUnit(rc[i], rc[i + 1], cc[j], cc[j + 1], kc[p], kc[p + 1], name, d, member))
    return out


def realize(plan: Plan) -> list[PlannedUnit]:
    """The plan's units, each with the device it is meant for. Output tiles: each band of each
    slab gets its own devices, and each takes a run of its planned count of the band's tiles in
    serpentine column order (``_band_order``), so it holds a block about ``band height`` tiles
    tall and never needs more input than the plan charged it. Split-k pieces are dealt as runs,
    one unit per run (``local_sum``) or per piece. Round-robin deals the fixed grid. A local plan
    has none."""
    if plan.kind is Kind.LOCAL:
        return []
    if plan.kind is Kind.UNIFORM:
        return _realize_uniform(plan)
    g = plan.gemm
    rows, cols, parts = plan.grid
    rc, cc, kc = even_cuts(g.m, rows), even_cuts(g.n, cols), even_cuts(g.k, parts)
    split = plan.kind is Kind.SPLIT_K
    bands = 1 if split else plan.bands
    height = rows // bands
    groups = rows * cols if split else parts * bands
    owners: list[tuple[str, int, int, int]] = []  # per group: (class, device index, pieces, devices), fill order
    for share in plan.shares:
        per_group = share.pieces // groups
        busiest = max(1, share.per_device)
        full, last = divmod(per_group, busiest)
        used = share.devices // groups  # of the class, in each group
        owners += [(share.name, i, busiest, used) for i in range(full)] + (
            [(share.name, full, last, used)] if last else []
        )
    out: list[PlannedUnit] = []
    local_sum = plan.local_sum
    for group in range(groups):
        index = 0
        order = [] if split else _band_order(group % bands, height, cols)
        slab = group // bands
        for slot, (name, device, count, used) in enumerate(owners):
            device_id = group * len(owners) + slot  # devices differ from group to group
            member = group * used + device  # the same device, counted within its class
            if split:
                i, j = divmod(group, cols)
                run = range(index, index + count)
                spans = [(run.start, run.stop)] if local_sum else [(p, p + 1) for p in run]
                out += [
                    PlannedUnit(rc[i], rc[i + 1], cc[j], cc[j + 1], kc[a], kc[b], name, device_id, member)
                    for a, b in spans
                ]
            else:
                for i, j in order[index : index + count]:
                    out.append(
                        PlannedUnit(rc[i], rc[i + 1], cc[j], cc[j + 1], kc[slab], kc[slab + 1], name, device_id, member)
                    )
            index += count
    return out
