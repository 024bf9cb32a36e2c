"""The cost model applied to the live fleet: connected devices grouped into classes, one plan per
GEMM, and the plan's units mapped to real devices. Pure: profiles in, tiles and owners out.

``--planner cost`` (the default) lets ``planner.plan_gemm`` choose the partition (keep the GEMM on
the PS, output tiles, split-K, or a 3D grid) and which devices take how many units; ``--planner
uniform`` keeps the fixed grid of ``tiles.plan_gemm`` dealt to whoever is free, and is priced
with the same model so both predict a step time.

A plan is advice about *who*: each unit waits in its planned device's own queue, and a device
that runs dry steals from the tail of the longest queue (coordinator/engine/scheduler.py). A device
whose measured profile flatters it therefore only gets a longer queue, which others drain.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cleave.coordinator.planning.costmodel import CostModelError, DeviceClass, Profile, PSProfile
from cleave.coordinator.planning.planner import (
    Gemm,
    Kind,
    Plan,
    PlannerOptions,
    baseline,
    local_plan,
    plan_gemm,
    realize,
)
from cleave.coordinator.planning.tiles import GemmKind, Tile, TileList, TilePlan, TilingPolicy, even_cuts
from cleave.coordinator.planning.tiles import plan_gemm as uniform_grid
from cleave.wire.codes import Name
from cleave.wire.messages import MAX_BATCH, MAX_PAIRS

# Partitions the live data plane runs: all of them (split-K units that span several pieces go
# out as one work message with several block pairs, summed by the device).
LIVE_KINDS = frozenset({Kind.LOCAL, Kind.OUTPUT, Kind.GRID3D, Kind.SPLIT_K})
# The devices that may take work now, or a function giving them (called only when the caller's
# version of the fleet moved).
Profiles = Mapping[int, Profile] | Callable[[], Mapping[int, Profile]]
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


class Planner(Name):
    """How GEMMs are cut (``--planner``): by the cost model, or the fixed uniform grid."""

    COST = "cost"
    UNIFORM = "uniform"


SUMMED = "split-k summed"  # a split-K plan whose devices add up their pieces: its name in reports


@dataclass(frozen=True)
class LivePlan:
    """One GEMM's cut for the fleet connected now: its tiles, their planned owners, the model's plan."""

    tiles: TilePlan | TileList | None  # None: the PS multiplies itself
    owners: Mapping[int, int]  # tile index -> the device it is planned for (absent: whoever is free)
    plan: Plan | None  # the model's prediction (None when no device could be priced)
    done_at: float | None = None  # when predicted done: its lane's, the loop's or the CPU's turn (``now``'s clock)

    @property
    def seconds(self) -> float | None:
        """The model's predicted seconds for this GEMM, or None when it could not price it."""
        return self.plan.seconds if self.plan is not None and math.isfinite(self.plan.seconds) else None

    @property
    def label(self) -> str:
        """The partition's name in reports (``status.plan.partitions``, the simulator's counts)."""
        plan = self.plan
        if plan is None or plan.kind is Kind.UNIFORM:
            return Kind.UNIFORM.value
        return SUMMED if plan.local_sum and plan.kind is Kind.SPLIT_K else plan.kind.value


MAX_CLASSES = 32  # the planner prices each class: more, and the grid is coarsened until they fit
MIN_TIME = 1e-4  # seconds: latencies below this round up to it (a class for every LAN rtt is noise)
# Priced GEMMs shared by every planner of this process: a plan is a pure function of the GEMM,
# the classes, the PS, the options and the uniform grid's policy, and a simulation's forecasts, its calm run and its
# run with a crash price the same GEMMs on the same fleets (at 1,024 devices pricing was a third
# of a one-layer simulation). At most this many plans (each a few hundred bytes).
PRICED_LIMIT = 4096
# With GEMMs in flight, a GEMM is kept home when the coordinator's CPU would finish it sooner than
# its loop would ship it (``LivePlanner._balance``), by this margin: the CPU runs every PS op in
# turn (attention, assembly, the optimizer), so a GEMM kept home also delays the critical path's
# own PS work behind it, which a shipped one does not. Measured on the simulator's probe
# (Llama-2-7B cut to 8 layers, 1,024 mixed devices, 64 x 1,024, bf16, 8 parts): a step of 299,
# 283, 293 and 324 s at 1, 1.5, 2 and 3 (399 s with no balance); docs/simulation.md.
HOME_MARGIN = 1.5
_priced: OrderedDict[tuple, Plan | None] = OrderedDict()


def _down(x: float, step: float = 0.5) -> float:
    """``x`` rounded down to a power of ``2 ** step``: within a factor of it, and stable as
    estimates jitter."""
    return 2.0 ** (math.floor(math.log2(x) / step) * step) if x > 0 else 0.0


def _up(x: float, step: float = 0.5) -> float:
    x = max(x, MIN_TIME)
    return 2.0 ** (math.ceil(math.log2(x) / step) * step)


def _rounded(p: Profile, dtype: str, step: float = 0.5) -> Profile:
    """A device's profile on a coarse grid, never better than measured: devices on the same grid
    point form one class, and a plan stays the same while estimates move within a step."""
    quantum = min(0.05 * 2 * step, 0.25)  # reliability: 0.05 at the finest grid
    return Profile(
        gflops={dtype: _down(p.flops_per_s(dtype) / 1e9, step)},
        memory=int(_down(p.memory, step)),
        down=_down(p.down, step),
        up=_down(p.up, step),
        rtt=_up(p.rtt, step),
        reliability=math.floor(p.reliability / quantum) * quantum,
        overhead=_up(p.overhead, step) if p.overhead > 0 else 0.0,
    )


def fleet_classes(profiles: Mapping[int, Profile], dtype: str) -> tuple[list[DeviceClass], dict[str, list[int]]]:
    """Group devices whose rounded profiles agree into classes (``_rounded``: never better than
    any member's measurement, so no member is over-planned). At most ``MAX_CLASSES``: the grid
    is coarsened (a factor of sqrt 2, then 2, 4...) until the fleet fits, so however many
    devices, or however they set their claims, planning costs a bounded number of classes."""
    step = 0.5
    while True:
        groups: dict[tuple[float, ...], tuple[Profile, list[int]]] = {}
        # Devices often share one profile object (a class's prior, the simulator's classes):
        # each is rounded once (at 10,000 devices, 100 ms a call rounding each device).
        seen: dict[int, tuple[Profile, tuple[float, ...]]] = {}
        for device in sorted(profiles):
            measured = profiles[device]
            hit = seen.get(id(measured))
            if hit is None:
                p = _rounded(measured, dtype, step)
                hit = seen[id(measured)] = (p, _key(p, dtype))
            groups.setdefault(hit[1], (hit[0], []))[1].append(device)
        if len(groups) <= MAX_CLASSES or step >= 64:
            break
        step *= 2
    classes, members = [], {}
    for i, key in enumerate(sorted(groups)):
        profile, ids = groups[key]
        name = f"c{i}"
        classes.append(DeviceClass(name, len(ids), profile))
        members[name] = ids
    return classes, members


def _key(p: Profile, dtype: str) -> tuple[float, ...]:
    # Everything of a profile the planner reads (planner.py; its session for the work at risk).
    return (p.gflops.get(dtype, 0.0), p.memory, p.down, p.up, p.rtt, p.reliability, p.overhead, p.session)


def shared(ps: PSProfile, lanes: int) -> PSProfile:
    """The PS as one of ``lanes`` lanes sees it: its CPU, its event loop and its links are shared by every lane,
    so a lane plans with its share of each (a GEMM kept home runs on a share of the CPU too)."""
    if lanes == 1:
        return ps
    return dataclasses.replace(
        ps,
        egress=ps.egress / lanes,
        ingress=ps.ingress / lanes,
        gflops={dtype: rate / lanes for dtype, rate in ps.gflops.items()},
        verify_flops=ps.verify_flops / lanes,
        unit_overhead=ps.unit_overhead * lanes,
        memory_bw=ps.memory_bw / lanes,
        loop=ps.loop.scaled(lanes),  # its event loop's time too (costmodel.LoopCosts)
    )


def _lanes(
    classes: Sequence[DeviceClass], members: Mapping[str, list[int]], lanes: int
) -> list[tuple[list[DeviceClass], dict[str, list[int]]]]:
    """The fleet cut into ``lanes`` sub-fleets, each class's devices shared out evenly (lane i
    of n devices: ``[i n / lanes, (i + 1) n / lanes)``); a lane with no device is left out."""
    out = []
    for i in range(lanes):
        sub, ids = [], {}
        for cls in classes:
            mine = members[cls.name][i * cls.count // lanes : (i + 1) * cls.count // lanes]
            if mine:
                sub.append(DeviceClass(cls.name, len(mine), cls.profile))
                ids[cls.name] = mine
        if sub:
            out.append((sub, ids))
    return out or [(list(classes), dict(members))]


def filled_lanes(profiles: Mapping[int, Profile], dtype: str, lanes: int) -> int:
    """How many of ``lanes`` lanes these devices fill (each class is shared out on its own, so a
    class of fewer devices than lanes leaves some empty)."""
    return len(_lanes(*fleet_classes(profiles, dtype), lanes)) if profiles else 1


def fleet_key(p: Profile, dtype: str) -> tuple[float, ...]:
    """A device's place on the finest grid: when it moves, the fleet's classes may change."""
    return _key(_rounded(p, dtype), dtype)


def signature(classes: Sequence[DeviceClass], dtype: str) -> tuple:
    """What a plan depends on in the fleet (a cache key)."""
    return tuple((c.count, *_key(c.profile, dtype)) for c in classes)


def gemm_of(m: int, n: int, k: int, kind: GemmKind, dtype: str, policy: TilingPolicy) -> Gemm:
    """The symbolic GEMM. Token cuts are aligned as ``tiles.plan_gemm`` aligns them: forward and
    dX rows, and dW's reduction, in pieces of ``policy.max_edge`` tokens, so dW reuses the X and
    dY blocks the devices already hold."""
    aligned = kind in (GemmKind.FORWARD, GemmKind.GRAD_INPUT)
    return Gemm(
        m,
        n,
        k,
        dtype,
        kind.value,
        row_piece=policy.max_edge if aligned else 0,
        k_piece=policy.max_edge if kind is GemmKind.GRAD_WEIGHT else 0,
    )


class LivePlanner:
    """Plans each GEMM for the devices connected now. Plans are priced once per process for the
    same GEMM, lane and inputs (``_priced``: a step's GEMMs repeat every step; rounded profiles
    keep the key stable)."""

    def __init__(
        self,
        planner: Planner,
        ps: PSProfile,
        policy: TilingPolicy,
        options: PlannerOptions | None = None,
        lanes: int = 1,
    ) -> None:
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise CostModelError(f"lanes must be a positive integer, got {lanes!r}")
        self.planner = planner
        self.ps = ps
        self.policy = policy
        # Concurrency: the fleet is cut into this many lanes (each class shared out evenly), and
        # each GEMM is planned on the lane that is free first, so that GEMMs in flight side by
        # side run on different devices, each device with a larger share of fewer GEMMs.
        self.lanes = lanes
        # The lanes the fleet fills (a class of fewer devices than lanes leaves some empty): the
        # PS is shared by these, and each plans with its share (``_lane_ps``).
        self._filled = lanes
        self._lane_ps = shared(ps, lanes)  # what one lane plans with
        self._free_at = [0.0] * lanes  # when each lane is predicted to finish what it was given
        # Tests force one partition kind through ``options.kinds``.
        self.options = options or PlannerOptions(kinds=LIVE_KINDS, uniform=policy)
        self._fleet: tuple | None = None  # (version, dtype), classes, members, devices
        self._inputs = self._key_of_inputs()  # what a plan depends on besides the GEMM and the lane
        # The coordinator's two shared resources, across lanes: when its CPU and its event loop
        # are predicted free of the GEMMs planned so far (full rate, not a lane's share).
        self._cpu_free = 0.0
        self._loop_free = 0.0

    def use_relays(self, relays: int) -> None:
        """The coordinator has this many relays now: blocks are priced through them
        (``PSProfile.send_seconds``), at the profile's relay link; plans made before go."""
        if relays != self.ps.relays:
            self.ps = dataclasses.replace(self.ps, relays=relays)
            self._lane_ps = shared(self.ps, self._filled)
            self._inputs = self._key_of_inputs()  # plans made before no longer match

    def with_lanes(self, lanes: int) -> LivePlanner:
        """This planner for ``lanes`` GEMMs side by side (the micro-batches the trainer runs at once)."""
        if lanes == self.lanes:
            return self
        return LivePlanner(self.planner, self.ps, self.policy, self.options, lanes)

    def plan(
        self,
        m: int,
        n: int,
        k: int,
        kind: GemmKind,
        dtype: str,
        profiles: Profiles,
        version: int | None = None,
        now: float = 0.0,
    ) -> LivePlan:
        """``profiles``: the devices that may take work now (or a function giving them, called
        only when ``version``, which the caller moves whenever they may have changed, moved).
        ``now``: with several lanes, the GEMM goes to the lane predicted to be free first."""
        if min(m, n, k) < 1:  # nothing to price: an empty product is one (empty) tile
            return LivePlan(uniform_grid(m, n, k, kind, 1, self.policy), {}, None)
        gemm = gemm_of(m, n, k, kind, dtype, self.policy)
        plan, done_at, active, members = self._choose(gemm, dtype, profiles, version, now)
        if self.planner is Planner.UNIFORM or plan is None:
            # The fixed grid, dealt to whoever is free (also when nothing could be priced: no
            # device can take a unit and the PS cannot price it; never worse than nothing).
            return LivePlan(uniform_grid(m, n, k, kind, max(1, active), self.policy), {}, plan, done_at)
        if plan.kind is Kind.LOCAL:
            return LivePlan(None, {}, plan, done_at)
        tiles, owners = _tiled(plan, m, n, k, members)
        return LivePlan(tiles, owners, plan, done_at)

    def forecast(
        self, m: int, n: int, k: int, kind: GemmKind, dtype: str, profiles: Mapping[int, Profile], now: float = 0.0
    ) -> tuple[float | None, bool]:
        """``plan``'s decision for a forecast (``predict``), without cutting the GEMM into tiles:
        when it is predicted done (lanes, CPU and loop moved as ``plan`` moves them), and whether
        the coordinator keeps it. The fleet is taken as one version: pass the same ``profiles``
        every call."""
        if min(m, n, k) < 1:
            return None, False
        plan, done_at, _, _ = self._choose(gemm_of(m, n, k, kind, dtype, self.policy), dtype, profiles, 0, now)
        return done_at, plan is not None and plan.kind is Kind.LOCAL

    def _choose(
        self, gemm: Gemm, dtype: str, profiles: Profiles, version: int | None, now: float
    ) -> tuple[Plan | None, float | None, int, Mapping[str, list[int]]]:
        """The plan of ``gemm`` for the lane free first, balanced against the coordinator's
        resources, and when it is predicted done; the devices that may take work, and the lane's
        members."""
        if version is None or self._fleet is None or self._fleet[0] != (version, dtype):
            current = profiles() if callable(profiles) else profiles
            classes, members = fleet_classes(current, dtype)
            self._fleet = ((version, dtype), classes, members, len(current), _lanes(classes, members, self.lanes))
            if len(self._fleet[4]) != self._filled:  # two devices and eight lanes: two lanes, not eight
                self._filled = len(self._fleet[4])
                self._lane_ps = shared(self.ps, self._filled)
                self._inputs = self._key_of_inputs()
        _, _, _, active, lanes = self._fleet
        lane = min(range(len(lanes)), key=lambda i: (max(now, self._free_at[i]), i))
        classes, members = lanes[lane]
        plan = self._price(gemm, classes)
        done_at = None
        if plan is not None and math.isfinite(plan.seconds):
            lane_done = max(now, self._free_at[lane]) + plan.seconds
            if self.planner is Planner.COST and self.lanes > 1:
                plan, done_at = self._balance(gemm, plan, now, lane_done)
            else:  # one lane: the plan's own choice
                done_at = lane_done
            if plan.kind is not Kind.LOCAL or self.lanes == 1:
                self._free_at[lane] = lane_done
        return plan, done_at, active, members

    def _balance(self, gemm: Gemm, plan: Plan, now: float, lane_done: float) -> tuple[Plan, float]:
        """Ship the GEMM as planned, or keep it home, whichever the coordinator's resources as
        loaded so far finish first: shipped, it is done when its lane has done what it holds
        (``lane_done``) and its frames have waited for the loop behind those planned before
        (``plan.loop_seconds`` is a lane's share: a lane's loop is ``lanes`` times slower); kept
        home, the multiply waits for the CPU. Each lane alone sees a share of both, and the
        loop binds long before the CPU does (docs/simulation.md): this is the step's view."""
        home = local_plan(gemm, self.ps)
        home_at = max(now, self._cpu_free) + home.seconds
        if plan.kind is Kind.LOCAL:
            self._cpu_free = home_at
            return plan, home_at
        loop = plan.loop_seconds / self._filled
        ship_at = max(lane_done, max(now, self._loop_free) + loop)
        if now + (home_at - now) * HOME_MARGIN < ship_at:
            self._cpu_free = home_at
            return home, home_at
        self._loop_free = max(now, self._loop_free) + loop
        return plan, ship_at

    def _key_of_inputs(self) -> tuple:
        return (self.planner, repr(self._lane_ps), repr(self.options), repr(self.policy))

    def _price(self, gemm: Gemm, classes: list[DeviceClass]) -> Plan | None:
        """The lane's plan for ``gemm``, priced once per process for the same inputs (``_priced``).
        Class names are in the key too: a plan's units name their classes, and a lane's are a
        subset of the fleet's (its counts and profiles can recur under other names)."""
        if not classes and self.planner is Planner.UNIFORM:
            return None  # the grid waits for devices
        key = (gemm, tuple(c.name for c in classes), signature(classes, gemm.dtype), self._inputs)
        if key in _priced:
            _priced.move_to_end(key)
            return _priced[key]
        # With no device (--min-devices 0, or every one gone or paused) the cost planner keeps
        # the GEMM home: the PS alone is a plan it can price, and waiting for devices is not.
        ps = self._lane_ps
        plan: Plan | None
        if self.planner is Planner.UNIFORM:
            plan = baseline(gemm, classes, ps, PlannerOptions(uniform=self.policy))
        else:
            try:
                plan = plan_gemm(gemm, classes, ps, self.options)
            except CostModelError:
                plan = None
        _priced[key] = plan
        if len(_priced) > PRICED_LIMIT:
            _priced.popitem(last=False)
        return plan


def _tiled(
    plan: Plan, m: int, n: int, k: int, members: Mapping[str, list[int]]
) -> tuple[TilePlan | TileList, dict[int, int]]:
    """A shipped plan's tiles and each one's planned device (``members``: the lane's devices
    by class)."""
    rows, cols, parts = plan.grid
    rc, cc, kc = even_cuts(m, rows), even_cuts(n, cols), even_cuts(k, parts)
    units = realize(plan)
    tiles: TilePlan | TileList
    if plan.local_sum:  # a unit is a run of pieces: one tile, its device adds them up
        ri, ci, ki = ({v: i for i, v in enumerate(cuts)} for cuts in (rc, cc, kc))
        # A work frame names at most 1 + MAX_PAIRS pairs: longer runs go as several units
        # (each still summed on the device; the PS adds the few partials).
        run = MAX_PAIRS + 1
        units = [
            dataclasses.replace(u, k0=kc[q], k1=kc[min(q + run, ki[u.k1])])
            for u in units
            for q in range(ki[u.k0], ki[u.k1], run)
        ]
        ordered = sorted(units, key=lambda u: (u.r0, u.c0, u.k0))
        tiles = TileList(
            m,
            n,
            k,
            rc,
            cc,
            kc,
            tuple(
                Tile(i, ri[u.r0], ci[u.c0], ki[u.k0], u.r0, u.r1, u.c0, u.c1, u.k0, u.k1, ki[u.k1] - ki[u.k0])
                for i, u in enumerate(ordered)
            ),
        )
    else:
        tiles = TilePlan(m, n, k, rc, cc, kc)
    owners: dict[int, int] = {}
    # Every kind goes to its planned owners, dW too: left to whoever holds one of its blocks,
    # a dW unit priced for a GPU could wait on a 3 GFLOP/s laptop that kept an X block (the
    # simulator measured 65 s for a 2.7 s plan). The scheduler's affinity serves unplanned units.
    index = {(t.r0, t.c0, t.k0): t.index for t in tiles.tiles}
    for unit in units:
        owners[index[(unit.r0, unit.c0, unit.k0)]] = members[unit.owner][unit.member]
    return tiles, owners


def batches(tiles: Sequence[Tile], owners: Mapping[int, int], limit: int = MAX_BATCH) -> list[list[Tile]]:
    """A GEMM's tiles as work messages: each planned owner's tiles in at least two batches of at
    most ``limit`` (so that it downloads the next while it computes one: a batch is leased,
    downloaded, computed and returned as one), in tile order; a tile without an owner alone."""
    mine: dict[int, list[Tile]] = {}
    out: list[list[Tile]] = []
    for t in tiles:
        owner = owners.get(t.index)
        if owner is None:
            out.append([t])
        else:
            mine.setdefault(owner, []).append(t)
    for run in mine.values():
        size = max(1, min(limit, -(-len(run) // 2)))
        out += [run[i : i + size] for i in range(0, len(run), size)]
    return out
