"""How each GEMM is cut, and which devices compute how much of it: the cost model's decisions.

Pure: shapes, device profiles and the parameter server's profile in, a ``Plan`` out. The live
scheduler asks for one plan per GEMM, ``cleave plan`` for every GEMM of a training step, and the
simulator for both; docs/cost-model.md explains the model with a worked example.

Candidates, each priced by the same model (coordinator/costmodel.py):

* ``local``: the PS multiplies itself (no bytes move, nothing to verify);
* ``output``: an ``r x c`` grid of output tiles, each with the whole reduction;
* ``split-k``: the reduction cut into pieces; each device multiplies a run of pieces and sums
  them itself, so it sends one partial block however many pieces it had; the PS adds partials;
* ``3d``: output tiles *and* the reduction cut into slabs (2.5D/3D multiplication): each slab is
  an output grid for its own share of the fleet; the PS adds the slabs' partials. Fewer input
  bytes go down per device (``sqrt(slabs)`` fewer), more partial bytes come up;
* ``uniform``: today's fixed grid (``tiles.plan_gemm``) dealt round-robin to every device: the
  baseline a cost plan must never lose to (it is a candidate, so it never does).

Pricing one candidate: for a target time ``T`` each device can finish some number of pieces
(its *capacity*: the pipelined time of n pieces, coordinator/costmodel.py, is within ``T`` and
they fit its memory); devices are filled most capable first until every piece is covered, and
the PS's egress, ingress and CPU must also fit in ``T``. The plan's predicted time is the least
such ``T`` (bisection). Filling the most capable first uses the fewest devices, which sends the
fewest bytes: per-device input bytes are concave in its share (blocks are reused), so the
concentrated fill minimises their sum. Both properties make the prediction monotone: a device
more can only add capacity, never bytes, so adding devices never makes a plan slower; a device
that would lengthen the step (too slow, too flaky, too little memory, too thin a link) gets no
work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Mapping, Sequence

from coordinator.costmodel import (
    ITEMSIZE, VERIFY_ROUNDS, CostModelError, DeviceClass, Profile, PSProfile, Stage, Unit, local_seconds,
    output_tiles_egress_floor, pipeline, pipelined, ps_seconds,
)
from coordinator.tiles import GemmKind, TilingPolicy
from coordinator.tiles import plan_gemm as uniform_grid

BISECTION_STEPS = 48  # relative precision ~1e-9 over the bracket's ratio
MAX_DOUBLINGS = 80


class Kind(str, Enum):
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
            raise CostModelError(f"GEMM {self.label or ''} needs positive sizes, got {self.m}x{self.k} @ {self.k}x{self.n}")
        if self.dtype not in ITEMSIZE:
            raise CostModelError(f"unknown dtype {self.dtype!r}; use one of {', '.join(ITEMSIZE)}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class PlannerOptions:
    min_reliability: float = 0.0  # devices less likely than this to return a unit get none (their
    # time is already charged 1/reliability, which leaves the flaky idle where others can do better)
    edges: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)  # tile edges tried
    slabs: tuple[int, ...] = (2, 4, 8, 16)  # reduction slabs tried by 3d
    pieces: tuple[int, ...] = (256, 512, 1024, 2048, 4096)  # reduction pieces tried by split-k (unaligned)
    kinds: frozenset[Kind] = frozenset(Kind)  # which candidates to consider (tests force one)
    uniform: TilingPolicy = field(default_factory=TilingPolicy)  # the baseline's grid
    max_cells: int = 1 << 16  # tiles per GEMM considered at most (bounds the plan's size)
    local_sum: bool = True  # split-k may let a device add up its own pieces (the live data plane
    # sends one piece per unit for now: it plans with False)

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
    memory: int  # bytes its busiest device needs


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
    egress_floor: float = 0.0  # the least the PS must send for this kind of partition
    ps_seconds: float = 0.0  # PS CPU: verify, assemble, sum partials (or the whole GEMM if local)
    compute_seconds: float = 0.0  # the busiest device's GEMM seconds
    down_seconds: float = 0.0  # the longest download: a device's link or the PS egress
    up_seconds: float = 0.0  # the longest upload: a device's link or the PS ingress
    unit: Unit | None = None  # the largest unit
    local_sum: bool = False  # split-k: each device adds up its pieces and sends one partial

    @property
    def devices(self) -> int:
        return sum(s.devices for s in self.shares)

    @property
    def units(self) -> int:
        return sum(s.units for s in self.shares)

    @property
    def bound(self) -> str:
        """What limits the plan: compute, down, up or ps."""
        if self.kind is Kind.LOCAL:
            return "ps"
        parts = {"compute": self.compute_seconds, "down": self.down_seconds, "up": self.up_seconds,
                 "ps": self.ps_seconds}
        return max(parts, key=lambda k: parts[k])


# --------------------------------------------------------------------------- pricing


@dataclass(frozen=True)
class _Costs:
    """How a candidate charges one device for n of its pieces. Every function is non-decreasing
    in n, and ``down`` is concave (blocks are reused), which the fill relies on."""

    time: Callable[[int], float]  # seconds until its n pieces are back (before reliability)
    down: Callable[[int], float]  # bytes sent to it
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
    groups: int  # independent groups of pieces (3d slabs, split-k cells), each with an equal sub-fleet
    pieces: int  # pieces each group needs covered
    costs: Callable[[DeviceClass], _Costs | None]  # None: the class cannot take part
    verify: Callable[[int], float]  # PS verify FLOPs for one device's n pieces
    out_bytes: float
    unit: Unit
    local_sum: bool = True  # split-k: a device sums its pieces (one partial) or sends each


def _effective(profile: Profile, first_unit_seconds: float) -> float:
    """Expected share of a device's work that comes back: its record, and the chance it stays
    for the time of one unit."""
    stay = math.exp(-first_unit_seconds / profile.session) if math.isfinite(profile.session) else 1.0
    return profile.reliability * stay


def _region_edges(n: float, rows: int, cols: int, r: int, c: int) -> float:
    """Input a device needs for ``n`` tiles of an ``r x c`` grid of ``rows x cols``, in units of
    the reduction: ``r x + c y`` for the best region of ``x`` tile rows by ``y = n / x`` tile
    columns (real-valued: an idealised near-square block of the grid). ``2 sqrt(r c n)`` while
    the square fits, linear once a side reaches the grid's edge: concave in ``n``, and never more
    than any real set of ``n`` tiles needs (``x y >= n`` for the rows and columns they touch)."""
    if n <= 0:
        return 0.0
    lo = max(1.0, n / cols)  # rows of tiles: at least enough for the columns to suffice
    hi = float(min(rows, n))  # ... at most the grid's, and no more than one tile per row
    x = min(hi, max(lo, math.sqrt(c * n / r)))
    return r * x + c * n / x


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


def _grid_costs(gemm: Gemm, rows: int, cols: int, kk: float, opts: PlannerOptions) -> Callable[[DeviceClass], _Costs | None]:
    """Output tiles ``r x c`` with a reduction of ``kk``: a device with n tiles holds a
    near-square region of them and downloads each row block and column block once; its
    downloads, GEMMs and uploads overlap (coordinator/costmodel.py ``pipelined``)."""
    s = gemm.itemsize
    r, c = gemm.m / rows, gemm.n / cols  # average tiles: totals come out exact
    unit = Unit(r, c, kk, s)
    largest = Unit(-(-gemm.m // rows), -(-gemm.n // cols), math.ceil(kk), s)  # what memory must hold
    cells = rows * cols

    def costs(cls: DeviceClass) -> _Costs | None:
        p = cls.profile
        rate = p.flops_per_s(gemm.dtype)
        if rate <= 0 or largest.memory > p.memory:
            return None
        gemm_s = unit.flops / rate
        first = Stage(unit.down() / p.down, gemm_s + p.overhead, unit.up / p.up)
        rel = _effective(p, first.total + p.rtt)
        if rel < opts.min_reliability:
            return None

        def down(n: int) -> float:
            return s * kk * _region_edges(n, rows, cols, r, c)

        def time(n: int) -> float:
            if n <= 0:
                return 0.0
            rest_down = (down(n) - unit.down()) / (n - 1) / p.down if n > 1 else 0.0
            return pipelined(first, Stage(rest_down, first.compute, first.up), n, p.rtt)

        def memory(n: int) -> int:
            # Two tiles in flight (prefetch). Blocks of its region are kept while they fit the
            # device's budget; the client evicts the oldest beyond it.
            return math.ceil(min(n, 2) * largest.memory)

        # Without room for two tiles it cannot prefetch, so the pipelined time would be wrong:
        # it gets one tile.
        limit = _most(cells, lambda n: memory(n) <= p.memory)
        return _Costs(time, down, lambda n: float(n * unit.up), lambda n: n, lambda n: n * gemm_s, memory, limit, rel)

    return costs


def _split_costs(gemm: Gemm, rows: int, cols: int, piece: float, pieces: int, held: Mapping[str, int],
                 local_sum: bool, opts: PlannerOptions) -> Callable[[DeviceClass], _Costs | None]:
    """Reduction pieces of one ``r x c`` output block. With ``local_sum`` a device's n pieces are
    one work message whose products it adds up itself: one partial back, but its downloads do
    not overlap its GEMMs. Without, each piece is a unit of its own, pipelined, and each sends
    its partial back for the PS to add. ``held[name]`` pieces are on the device already (the
    aligned dW after forward and dX sent them)."""
    s = gemm.itemsize
    r, c = gemm.m / rows, gemm.n / cols
    unit = Unit(r, c, piece, s)
    largest = Unit(-(-gemm.m // rows), -(-gemm.n // cols), math.ceil(piece), s)
    piece_bytes = unit.down()
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

            def memory(n: int) -> int:
                return math.ceil(n * largest.down() + largest.up) if n else 0
        else:
            held_stage = Stage(0.0, piece_s + p.overhead, partial / p.up)
            fresh = Stage(piece_bytes / p.down, piece_s + p.overhead, partial / p.up)

            def time(n: int) -> float:  # the pieces it holds first, then the ones it downloads
                if n <= 0:
                    return 0.0
                k = min(n, have)
                if k == 0:
                    return pipelined(fresh, fresh, n, p.rtt)
                return pipeline([held_stage] * k + [fresh] * (n - k), p.rtt) if n - k < 64 else \
                    pipelined(held_stage, held_stage, k, 0.0) + pipelined(fresh, fresh, n - k, p.rtt)

            def up(n: int) -> float:
                return float(n * partial)

            def units(n: int) -> int:
                return n

            def memory(n: int) -> int:
                return math.ceil(min(n, 2) * largest.memory + have * largest.down()) if n else 0
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


def _fill(cand: _Candidate, classes: Sequence[tuple[DeviceClass, _Costs]], t: float, ps: PSProfile) -> _Fill:
    """Cover one group's pieces with the most capable devices first (each group: slabs, cells,
    gets ``count // groups`` devices of every class); then the PS must keep up in ``t``."""
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
    fill.ps = ps_seconds(fill.units, fill.verify, max(0.0, fill.up - cand.out_bytes), cand.out_bytes, ps)
    fill.ok = fill.down / ps.egress <= t and fill.up / ps.ingress <= t and fill.ps <= t
    return fill


def _price(cand: _Candidate, gemm: Gemm, fleet: Sequence[DeviceClass], ps: PSProfile) -> Plan | None:
    """The least time ``t`` at which the fill covers every piece and the PS keeps up (bisection:
    feasibility only grows with ``t``)."""
    classes = [(cls, costs) for cls in fleet if cls.count >= cand.groups for costs in [cand.costs(cls)] if costs]
    if not classes:
        return None
    hi = max(1e-9, min(costs.time(min(costs.limit, max(1, -(-cand.pieces // (cls.count // cand.groups)))))
                       / costs.reliability for cls, costs in classes))
    for _ in range(MAX_DOUBLINGS):
        if _fill(cand, classes, hi, ps).ok:
            break
        hi *= 2
    else:
        return None
    lo = hi / 2
    while lo > 1e-12 and _fill(cand, classes, lo, ps).ok:
        hi, lo = lo, lo / 2
    for _ in range(BISECTION_STEPS):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        if _fill(cand, classes, mid, ps).ok:
            hi = mid
        else:
            lo = mid
    fill = _fill(cand, classes, hi, ps)
    g = cand.groups
    shares = []
    compute = down_s = up_s = 0.0
    for cls, costs, full, cap, last in fill.used:
        busiest = cap if full else last
        devices = full + (1 if last else 0)
        pieces = full * cap + last
        shares.append(Share(
            cls.name, devices * g, pieces * g, busiest,
            (full * costs.units(cap) + costs.units(last)) * g, costs.time(busiest) / costs.reliability,
            (full * costs.down(cap) + costs.down(last)) * g, (full * costs.up(cap) + costs.up(last)) * g,
            costs.compute(busiest), costs.memory(busiest),
        ))
        compute = max(compute, costs.compute(busiest))
        down_s = max(down_s, costs.down(busiest) / cls.profile.down)
        up_s = max(up_s, costs.up(busiest) / cls.profile.up)
    seconds = max([sh.seconds for sh in shares] + [fill.down / ps.egress, fill.up / ps.ingress, fill.ps])
    if cand.kind is Kind.SPLIT_K:  # every input piece goes down once (less what devices hold)
        floor = float(gemm.itemsize * gemm.k * (gemm.m * cand.grid[1] + gemm.n * cand.grid[0]))
    else:  # a region of a r c outputs needs k (rows + cols) >= 2 k sqrt(a r c) inputs; equal
        # regions over P devices make this the familiar 2 s k sqrt(P m n)
        u = cand.unit
        floor = g * sum(d * 2.0 * gemm.itemsize * u.k * math.sqrt(n * u.m * u.n)
                        for _, _, full, cap, last in fill.used for n, d in ((cap, full), (last, 1 if last else 0)))
    return Plan(gemm, cand.kind, cand.grid, seconds, tuple(shares), fill.down, fill.up, floor, fill.ps,
                compute, max(down_s, fill.down / ps.egress), max(up_s, fill.up / ps.ingress), _largest(gemm, cand.grid),
                cand.kind is Kind.SPLIT_K and cand.local_sum)


def _largest(gemm: Gemm, grid: tuple[int, int, int]) -> Unit:
    rows, cols, parts = grid
    return Unit(-(-gemm.m // rows), -(-gemm.n // cols), -(-gemm.k // parts), gemm.itemsize)


# --------------------------------------------------------------------------- candidates


def _grid_candidate(gemm: Gemm, rows: int, cols: int, slabs: int, opts: PlannerOptions) -> _Candidate:
    kk = gemm.k / slabs
    unit = Unit(gemm.m / rows, gemm.n / cols, kk, gemm.itemsize)
    return _Candidate(Kind.OUTPUT if slabs == 1 else Kind.GRID3D, (rows, cols, slabs), slabs, rows * cols,
                      _grid_costs(gemm, rows, cols, kk, opts), lambda n: n * unit.verify_flops(),
                      float(gemm.itemsize * gemm.m * gemm.n), unit)


def _split_candidate(gemm: Gemm, rows: int, cols: int, piece: int, held: Mapping[str, int], local_sum: bool,
                     opts: PlannerOptions) -> _Candidate:
    pieces = -(-gemm.k // piece)
    r, c = gemm.m / rows, gemm.n / cols
    unit = Unit(r, c, gemm.k / pieces, gemm.itemsize)

    def verify(n: int) -> float:
        if not local_sum:
            return n * unit.verify_flops()
        return 2.0 * VERIFY_ROUNDS * (r * unit.k * n + unit.k * n * c + r * c) if n else 0.0

    return _Candidate(Kind.SPLIT_K, (rows, cols, pieces), rows * cols, pieces,
                      _split_costs(gemm, rows, cols, unit.k, pieces, held, local_sum, opts), verify,
                      float(gemm.itemsize * gemm.m * gemm.n), unit, local_sum)


def _parts(size: int, edges: Iterable[int]) -> set[int]:
    return {max(1, -(-size // e)) for e in edges} | {1}


def uniform_shapes(gemm: Gemm, devices: int, policy: TilingPolicy) -> list[tuple[int, int, int]]:
    """Every grid ``tiles.plan_gemm`` picks for 1 to ``devices`` devices. The planner prices them
    all, so for any fleet it has priced the round-robin baseline's grid, and adding a device
    only adds candidates."""
    kind = GemmKind(gemm.kind) if gemm.kind in {k.value for k in GemmKind} else GemmKind.PLAIN
    shapes: list[tuple[int, int, int]] = []
    last = uniform_grid(gemm.m, gemm.n, gemm.k, kind, max(1, devices), policy).shape
    count = 1
    while count <= devices:
        shape = uniform_grid(gemm.m, gemm.n, gemm.k, kind, count, policy).shape
        if not shapes or shapes[-1] != shape:
            shapes.append(shape)
        if shape == last:
            break
        count += 1 if count < 64 else max(1, count // 64)  # the grid moves with the square root: coarse is enough
    return shapes


def candidates(gemm: Gemm, devices: int, opts: PlannerOptions, held: Mapping[str, int] | None = None) -> list[_Candidate]:
    """Every grid the planner prices for ``gemm`` (``local`` is priced apart). Depends on the
    fleet only through its size, and only grows with it."""
    held = held or {}
    out: list[_Candidate] = []
    rows_opts = {-(-gemm.m // gemm.row_piece)} if gemm.row_piece else _parts(gemm.m, opts.edges)
    cols_opts = _parts(gemm.n, opts.edges)
    grids: set[tuple[int, int, int]] = {(r, c, 1) for r in rows_opts for c in cols_opts}
    splits: set[tuple[int, int, int]] = set()
    for shape in uniform_shapes(gemm, devices, opts.uniform):
        rows, cols, parts = shape
        if gemm.row_piece and rows not in rows_opts:
            continue
        (grids if parts == 1 else splits).add(shape)
    if Kind.GRID3D in opts.kinds and not gemm.k_piece:
        for rows, cols, _ in list(grids):
            grids |= {(rows, cols, slabs) for slabs in opts.slabs if gemm.k // slabs >= 64}
    for rows, cols, slabs in sorted(grids):
        kind = Kind.OUTPUT if slabs == 1 else Kind.GRID3D
        if kind in opts.kinds and rows * cols * slabs <= opts.max_cells:
            out.append(_grid_candidate(gemm, rows, cols, slabs, opts))
    if Kind.SPLIT_K in opts.kinds:
        pieces = {gemm.k_piece} if gemm.k_piece else {min(p, gemm.k) for p in opts.pieces}
        for piece in pieces:
            for rows, cols in _partial_cuts(gemm):
                splits.add((rows, cols, -(-gemm.k // piece)))
        for rows, cols, parts in sorted(splits):
            piece = -(-gemm.k // parts)
            if parts < 2 or rows * cols * parts > opts.max_cells:
                continue
            for local_sum in (True, False) if opts.local_sum else (False,):
                out.append(_split_candidate(gemm, rows, cols, piece, held, local_sum, opts))
    return out


PARTIAL_LIMITS = (64 << 20, 256 << 20, 1 << 30, 4 << 30)  # bytes of one partial block tried by split-k


def _partial_cuts(gemm: Gemm) -> list[tuple[int, int]]:
    """Cuts of the output so that one partial block stays under each of ``PARTIAL_LIMITS``."""
    s = gemm.itemsize
    out = set()
    for limit in PARTIAL_LIMITS:
        rows = cols = 1
        while s * (-(-gemm.m // rows)) * (-(-gemm.n // cols)) > limit and rows * cols < 4096:
            if -(-gemm.m // rows) >= -(-gemm.n // cols):
                rows += 1
            else:
                cols += 1
        out.add((rows, cols))
    return sorted(out)


def _lower_bound(cand: _Candidate, gemm: Gemm, fleet_rate: float, ps: PSProfile) -> float:
    """No plan of this candidate is faster: the whole fleet computing, or the PS's own share."""
    compute = gemm.flops / fleet_rate if fleet_rate > 0 else math.inf
    out = cand.out_bytes
    if cand.kind is Kind.SPLIT_K and cand.local_sum:
        cells = cand.groups
        return max(compute, ps_seconds(cells, cand.verify(cand.pieces) * cells, 0.0, out, ps))
    units = cand.groups * cand.pieces
    partials = units * cand.unit.up
    return max(compute, ps_seconds(units, units * cand.unit.verify_flops(), max(0.0, partials - out), out, ps),
               partials / ps.ingress)


# --------------------------------------------------------------------------- the plan


def baseline(gemm: Gemm, fleet: Sequence[DeviceClass], ps: PSProfile, opts: PlannerOptions | None = None) -> Plan | None:
    """Today's fixed grid (``tiles.plan_gemm``), tile ``t`` to device ``t mod P`` over every device
    that can multiply in the dtype: the round-robin baseline, priced exactly (a device downloads
    each block the first time one of its tiles needs it; its work takes 1/reliability longer).
    None when no device can multiply in the dtype."""
    opts = opts or PlannerOptions()
    members = [cls for cls in fleet if cls.profile.flops_per_s(gemm.dtype) > 0 for _ in range(cls.count)]
    if not members:
        return None
    kind = GemmKind(gemm.kind) if gemm.kind in {k.value for k in GemmKind} else GemmKind.PLAIN
    tp = uniform_grid(gemm.m, gemm.n, gemm.k, kind, len(members), opts.uniform)
    s = gemm.itemsize
    P = len(members)
    stages: list[list[Stage]] = [[] for _ in range(P)]
    held: list[set[tuple[str, int, int]]] = [set() for _ in range(P)]
    sent, back, flops, peak = [0.0] * P, [0.0] * P, [0.0] * P, [0] * P
    shapes: dict[tuple[int, int, int], Unit] = {}
    verify = 0.0
    largest: Unit | None = None
    tiles = tp.tiles
    for t in tiles:
        d = t.index % P
        p = members[d].profile
        shape = (t.r1 - t.r0, t.c1 - t.c0, t.k1 - t.k0)
        unit = shapes.get(shape) or shapes.setdefault(shape, Unit(*shape, s))
        verify += unit.verify_flops()
        largest = unit if largest is None or unit.flops > largest.flops else largest
        a_key, b_key = ("a", t.i, t.p), ("b", t.p, t.j)
        down = (0 if a_key in held[d] else unit.a_bytes) + (0 if b_key in held[d] else unit.b_bytes)
        held[d].add(a_key)
        held[d].add(b_key)
        rate = p.flops_per_s(gemm.dtype)
        stages[d].append(Stage(down / p.down, unit.flops / rate + p.overhead, unit.up / p.up))
        flops[d] += unit.flops / rate
        sent[d] += down
        back[d] += unit.up
        peak[d] = max(peak[d], unit.memory)
    rows: dict[str, list[float]] = {}  # class -> devices, tiles, most tiles, seconds, down, up, compute, memory
    worst = compute = down_s = up_s = 0.0
    for d, cls in enumerate(members):
        if not stages[d]:
            continue
        p = cls.profile
        memory = int(sent[d]) + 2 * (largest.up if largest else 0)
        t = pipeline(stages[d], p.rtt) / max(1e-9, _effective(p, stages[d][0].total + p.rtt))
        if min(len(stages[d]), 2) * peak[d] > p.memory:
            t = math.inf  # round-robin hands it tiles it cannot hold (two in flight, as a plan's)
        row = rows.setdefault(cls.name, [0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0])
        row[0] += 1
        row[1] += len(stages[d])
        row[2] = max(row[2], len(stages[d]))
        row[3] = max(row[3], t)
        row[4] += sent[d]
        row[5] += back[d]
        row[6] = max(row[6], flops[d])
        row[7] = max(row[7], memory)
        worst, compute = max(worst, t), max(compute, flops[d])
        down_s, up_s = max(down_s, sent[d] / p.down), max(up_s, back[d] / p.up)
    shares = tuple(Share(name, int(v[0]), int(v[1]), int(v[2]), int(v[1]), v[3], v[4], v[5], v[6], int(v[7]))
                   for name, v in rows.items())
    egress, ingress = sum(sent), sum(back)
    out_bytes = float(s * gemm.m * gemm.n)
    ps_s = ps_seconds(len(tiles), verify, max(0.0, ingress - out_bytes), out_bytes, ps)
    gr, gc, gk = tp.shape
    seconds = max(worst, egress / ps.egress, ingress / ps.ingress, ps_s)
    floor = output_tiles_egress_floor(gemm.m, gemm.n, -(-gemm.k // gk), min(P, gr * gc), s) * gk
    return Plan(gemm, Kind.UNIFORM, (gr, gc, gk), seconds, shares, egress, ingress, floor, ps_s, compute,
                max(down_s, egress / ps.egress), max(up_s, ingress / ps.ingress), largest)


def _local(gemm: Gemm, ps: PSProfile) -> Plan:
    seconds = local_seconds(gemm.m, gemm.n, gemm.k, gemm.dtype, ps)
    return Plan(gemm, Kind.LOCAL, (1, 1, 1), seconds, ps_seconds=seconds)


def plan_gemm(gemm: Gemm, fleet: Sequence[DeviceClass], ps: PSProfile, opts: PlannerOptions | None = None,
              *, held: Mapping[str, int] | None = None) -> Plan:
    """The fastest predicted plan for ``gemm`` on ``fleet`` (ties: fewer bytes, then the simpler
    kind). ``held[class]``: reduction pieces each device of that class holds already (the
    aligned dW of the live scheduler). Raises CostModelError when nothing is feasible."""
    opts = opts or PlannerOptions()
    plans: list[Plan] = []
    if Kind.LOCAL in opts.kinds:
        plans.append(_local(gemm, ps))
    devices = sum(cls.count for cls in fleet)
    rate = sum(cls.count * cls.profile.flops_per_s(gemm.dtype) for cls in fleet)
    best = min((p.seconds for p in plans), default=math.inf)
    # Cheapest bound first; a candidate that cannot beat the best so far is not priced.
    ranked = sorted((_lower_bound(c, gemm, rate, ps), i, c) for i, c in enumerate(candidates(gemm, devices, opts, held)))
    for lb, _, cand in ranked:
        if lb >= best:
            break
        plan = _price(cand, gemm, fleet, ps)
        if plan is not None:
            plans.append(plan)
            best = min(best, plan.seconds)
    finite = [p for p in plans if math.isfinite(p.seconds)]
    if not finite:
        kinds = ", ".join(sorted(k.value for k in opts.kinds))
        raise CostModelError(f"{gemm.label or 'the GEMM'} ({gemm.m}x{gemm.k} @ {gemm.k}x{gemm.n}, {gemm.dtype}) has "
                             f"no feasible plan of kind {kinds}: no device can take a unit of it (dtype, memory, "
                             f"reliability) and the parameter server cannot compute it")
    order = {k: i for i, k in enumerate(Kind)}
    return min(finite, key=lambda p: (p.seconds, p.egress_bytes + p.ingress_bytes, order[p.kind], p.grid))


# --------------------------------------------------------------------------- a whole step


@dataclass(frozen=True)
class StepPlan:
    plans: tuple[tuple[Plan, int], ...]  # each distinct GEMM's plan and how many times a step runs it
    ps_other_seconds: float  # PS work that is not a GEMM (attention products, optimizer, elementwise)
    fleet_flops: float  # FLOP/s of every device in the fleet, in the training dtype

    @property
    def gemm_seconds(self) -> float:
        return sum(p.seconds * count for p, count in self.plans)

    @property
    def seconds(self) -> float:
        return self.gemm_seconds + self.ps_other_seconds

    @property
    def flops(self) -> float:
        return sum(p.gemm.flops * count for p, count in self.plans)

    @property
    def utilisation(self) -> float:
        """Share of the fleet's FLOP/s the step's GEMMs use (MFU over the whole fleet)."""
        return self.flops / (self.seconds * self.fleet_flops) if self.seconds > 0 and self.fleet_flops > 0 else 0.0

    def total(self, attr: str) -> float:
        return sum(getattr(p, attr) * count for p, count in self.plans)


def plan_step(gemms: Iterable[tuple[Gemm, int]], fleet: Sequence[DeviceClass], ps: PSProfile,
              opts: PlannerOptions | None = None, *, ps_other_seconds: float = 0.0) -> StepPlan:
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


def classes_from(profiles: Mapping[str, Profile]) -> tuple[DeviceClass, ...]:
    """Live devices as classes of one (the scheduler plans for each device by name)."""
    return tuple(DeviceClass(name, 1, p) for name, p in sorted(profiles.items()))


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


def realize(plan: Plan) -> list[PlannedUnit]:
    """The plan's units, each with the device it is meant for: output tiles in row-major order
    within their slab, dealt to devices as consecutive runs of their planned counts; split-k
    pieces dealt as runs, one unit per run (``local_sum``) or per piece. A local plan has none."""
    if plan.kind is Kind.LOCAL:
        return []
    from coordinator.tiles import even_cuts

    g = plan.gemm
    rows, cols, parts = plan.grid
    rc, cc, kc = even_cuts(g.m, rows), even_cuts(g.n, cols), even_cuts(g.k, parts)
    split = plan.kind is Kind.SPLIT_K
    groups = rows * cols if split else parts
    owners: list[tuple[str, int, int, int]] = []  # per group: (class, device index, pieces, devices), fill order
    for share in plan.shares:
        per_group = share.pieces // groups
        busiest = max(1, share.per_device)
        full, last = divmod(per_group, busiest)
        used = share.devices // groups  # of the class, in each group
        owners += [(share.name, i, busiest, used) for i in range(full)] + ([(share.name, full, last, used)] if last else [])
    out: list[PlannedUnit] = []
    local_sum = plan.local_sum
    for group in range(groups):
        index = 0
        for slot, (name, device, count, used) in enumerate(owners):
            device_id = group * len(owners) + slot  # devices differ from group to group
            member = group * used + device  # the same device, counted within its class
            if split:
                i, j = divmod(group, cols)
                run = range(index, index + count)
                spans = [(run.start, run.stop)] if local_sum else [(p, p + 1) for p in run]
                out += [PlannedUnit(rc[i], rc[i + 1], cc[j], cc[j + 1], kc[a], kc[b], name, device_id, member)
                        for a, b in spans]
            else:
                for cell in range(index, index + count):
                    i, j = divmod(cell, cols)
                    out.append(PlannedUnit(rc[i], rc[i + 1], cc[j], cc[j + 1], kc[group], kc[group + 1], name, device_id,
                                           member))
            index += count
    return out
