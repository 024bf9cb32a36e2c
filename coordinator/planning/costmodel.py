"""What a work unit costs, where: bytes down and up, FLOPs, memory and time. Pure arithmetic.

No I/O, no tensors, no clock: the planner (coordinator/planning/planner.py), ``cleave plan``, the live
scheduler and the simulator all price work with these functions, and docs/cost-model.md derives
each formula with a worked example.

Units and conventions: bytes, seconds, FLOP. A *unit* is ``C[m x n] (+)= A[m x k] @ B[k x n]``
in ``itemsize``-byte elements; its result travels in the same dtype. Links are one-way rates in
bytes per second; ``rtt`` is a round trip of a small message.
"""

from __future__ import annotations

import math
from collections.abc import Container, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cleave.wire.errors import ConfigError

# The most micro-batches the coordinator's trainer runs at once (Trainer.parts_at_once), and so
# the most lanes a plan is cut into: memory on the PS grows with it (one part's activations and
# gradients each), the fleet's work in flight too.
PARTS_IN_FLIGHT = 8

# Training dtypes and their element sizes. Names are the CLI's (``--dtype``).
ITEMSIZE: Mapping[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
# Verification (wire/verify.py) multiplies by 16 random vectors: A(Br) and Cr, each a
# matrix-vector product per vector, so it reads A, B and C once and does 32 FLOP per element.
VERIFY_ROUNDS = 16
# Results the coordinator's verifier checks together at most (coordinator/net/server.py). The
# results are held anyway (one per connection, within its frame limit); a batch adds (rows +
# depth) x ROUNDS floats a result (the stacked A (B R) and B R), 8 MB for 64 results of 1,024 x
# 1,024 x 1,024 tiles, and for half-precision jobs a float32 copy of each distinct operand block
# and result it reads while it runs.
CHECK_BATCH = 64
# Column blocks of one A block a batch is priced to meet: a batch of CHECK_BATCH results from a
# grid spans several row bands and column blocks, about sqrt(CHECK_BATCH) of each.
CHECK_COLUMNS = 8
# Units a device holds at once: the one it computes and the one it prefetches.
IN_FLIGHT = 2
# The PS's own work per step besides the GEMMs it hands out (cleave plan, the simulator and the
# baselines price it alike). Backward of softmax(QK^T)V is two products per forward product (dQ
# and dK; dP and dV): attention costs 3x its forward FLOP.
ATTENTION_PASSES = 3
# AdamW on the PS keeps fp32 master weights: per parameter it reads weight, gradient, m and v
# (16 bytes) and writes weight, m and v (12 bytes). Training in a 2-byte dtype also writes the
# weights' low-precision copy that devices receive.
ADAMW_BYTES = 28


MAX_PS_GFLOPS = 1e7  # the fastest coordinator an option may state (--ps-gflops)


class CostModelError(ConfigError):
    """A profile or shape the model cannot price (negative sizes, zero rates...)."""


def _positive(name: str, value: float, *, zero: bool = False) -> None:
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise CostModelError(f"{name} must be {'non-negative' if zero else 'positive'} and finite, got {value!r}")


@dataclass(frozen=True)
class LoopCosts:
    """What the coordinator's event loop pays, in seconds of its CPU, for the frames it moves:
    per message (a work frame or a result frame: its task, header, decode, send call), per tile
    (the books: lease, store rows, settle, the band's count) and per byte (framing and the
    socket: bytes down as work frames, bytes up as results). The one home of these figures: the
    simulator's loop resource, ``loop_seconds`` (the planner and ``cleave plan``) and
    bench/calibrate_loop.py (which fits them again from a bench_tax run) all read them here.

    Measured on the 2-core test machine (one Python event loop, loopback TCP), not scaled to a
    server: a faster core pays less, a NIC with segmentation offload less a byte than loopback.

    * ``per_message``, ``per_tile``: bench/bench_throughput.py (``.venv/bin/python
      bench/bench_throughput.py --seconds 15 --warmup 10 --json``, 2026-11-26; bench/README.md):
      tiny tiles (bytes negligible), the loop "about 0.6 ms a tile outside the verifier" with one
      tile a work frame and 0.89 results a result frame (2.1 frames a tile); runs of tiles (2.0
      tiles a work frame, 1.2 a result frame: 1.35 frames a tile) took the coordinator from
      1.02-1.08 to 0.84-0.86 ms a tile, 0.2 ms for 0.77 frames fewer: about 0.25 ms a frame.
      So 0.25 ms a message and the rest of the 0.6 ms, 0.1 ms, a tile.
    * ``per_byte_down``, ``per_byte_up``: bench/bench_tax.py with the coordinator as it runs by
      default, band checks and one send thread (``.venv/bin/python bench/bench_tax.py --check
      both --send-threads 0 1 2 --json``, 2026-11-28, stored as
      bench/results/bench_tax-2026-11-28-send-threads.json), fitted by ``.venv/bin/python
      bench/calibrate_loop.py bench/results/bench_tax-2026-11-28-send-threads.json --check
      band+1s``: the loop's CPU per tile less the 0.6 ms above, over the socket floor's cost of
      the tile's bytes (0.353 ms a MB sent, 0.227 a MB received, measured in the same run), is
      1.41x that floor (least squares over the 3 shapes; loops 5.7, 9.5 and 7.0 ms a tile for
      10.6, 14.9 and 14.3 MB down; the fit is within 14% of each): 0.497 ms a MB down, 0.320 a
      MB up. The kernel's copy of the sent bytes runs on the send thread beside the loop (3.7-6.3
      ms a tile there), which no PS resource here charges: on a host with a core for it, it does
      not hold the loop up. With the loop writing its sockets itself (``--send-threads 0``) the
      same fit gave 2.65x the floor: 0.879 ms a MB down, 0.472 up
      (bench/results/bench_tax-2026-11-28.json, ``--check band``).
      bench_tax's trainer thread assembles and checks for NaN as a job's does, so these are a
      job's loop.
    """

    per_message: float = 0.25e-3
    per_tile: float = 0.10e-3
    per_byte_down: float = 0.497e-9
    per_byte_up: float = 0.320e-9

    def __post_init__(self) -> None:
        for name in ("per_message", "per_tile", "per_byte_down", "per_byte_up"):
            _positive(f"loop {name}", getattr(self, name), zero=True)

    def seconds(self, messages: float, tiles: float, down: float = 0.0, up: float = 0.0) -> float:
        """Loop CPU for ``messages`` frames carrying ``tiles`` tiles, ``down`` bytes sent and
        ``up`` bytes received."""
        return messages * self.per_message + tiles * self.per_tile + down * self.per_byte_down + up * self.per_byte_up

    def scaled(self, factor: float) -> LoopCosts:
        """Every cost ``factor`` times (a lane's share of the loop: ``factor`` lanes share it)."""
        return LoopCosts(
            *(factor * getattr(self, f) for f in ("per_message", "per_tile", "per_byte_down", "per_byte_up"))
        )


# The loop's measured costs (``LoopCosts``' docstring says where each figure comes from).
LOOP_COSTS = LoopCosts()


def _loop_costs() -> LoopCosts:
    return LOOP_COSTS


@dataclass(frozen=True)
class Profile:
    """What one device can do: measured live (coordinator/engine/profiles.py) or given by a fleet."""

    gflops: Mapping[str, float]  # effective GEMM GFLOP/s per dtype; a dtype absent or 0: unsupported
    memory: int  # bytes the device gives to blocks and results
    down: float  # bytes/s from the coordinator to the device
    up: float  # bytes/s back
    rtt: float = 0.05  # seconds, a small message there and back
    reliability: float = 1.0  # share of its units that come back verified
    session: float = math.inf  # mean seconds a volunteer stays once it has joined
    overhead: float = 0.002  # seconds per unit on the device besides the GEMM (decode, launch, encode)

    def __post_init__(self) -> None:
        for dtype, rate in self.gflops.items():
            if dtype not in ITEMSIZE:
                raise CostModelError(f"unknown dtype {dtype!r}; use one of {', '.join(ITEMSIZE)}")
            _positive(f"gflops[{dtype}]", rate, zero=True)
        _positive("memory", self.memory, zero=True)
        _positive("down", self.down)
        _positive("up", self.up)
        _positive("rtt", self.rtt, zero=True)
        _positive("overhead", self.overhead, zero=True)
        if not 0 <= self.reliability <= 1:
            raise CostModelError(f"reliability must be between 0 and 1, got {self.reliability!r}")
        if not self.session > 0:
            raise CostModelError(f"session must be positive, got {self.session!r}")

    def flops_per_s(self, dtype: str) -> float:
        """Its GEMM rate in ``dtype`` (0: it cannot compute in it)."""
        return self.gflops.get(dtype, 0.0) * 1e9


@dataclass(frozen=True)
class DeviceClass:
    """``count`` devices with one profile: a fleet file's ``[[class]]`` or a group of live devices."""

    name: str
    count: int
    profile: Profile

    def __post_init__(self) -> None:
        if self.count < 0:
            raise CostModelError(f"class {self.name!r}: count must be >= 0, got {self.count}")


@dataclass(frozen=True)
class PSProfile:
    """The parameter server: its link is shared by every device, and so is its CPU.

    The defaults describe the coordinator of a real deployment: a many-core server on a
    10 Gbit/s link, not the 2-core machine the tests run on (coordinator/engine/profiles.py measures the
    machine it runs on instead). docs/cost-model.md gives the sources of each figure."""

    egress: float = 1.25e9  # bytes/s it can send (10 Gbit/s)
    ingress: float = 1.25e9  # bytes/s it can receive
    # Sustained GEMM rate of a modern many-core server with AVX-512/AMX, in every dtype (what the
    # PS multiplies itself it may upcast). One core of the 2-core test machine does 80-95 GFLOP/s
    # fp32 (the project's performance notes).
    gflops: Mapping[str, float] = field(default_factory=lambda: {"fp32": 1000.0, "bf16": 1000.0, "fp16": 1000.0})
    # The 16-vector Freivalds check is a skinny GEMM (16 columns) bound by memory: it reads A, B
    # and C once for 32 FLOP per element, ~8 FLOP per byte of fp32, at ~25 GB/s effective. On the
    # test machine it runs at ~35-40 GFLOP/s per core (checking a 512-class tile costs 18-23% of
    # its GEMM; bench/bench_verify.py), so a server's ~25 GB/s gives ~200 GFLOP/s.
    verify_flops: float = 200e9
    # Seconds of PS CPU per unit besides the check: decode, bookkeeping, store. The whole Core
    # spends ~1e-4 s per Result on the test machine (bench/bench_scheduler.py, core column).
    unit_overhead: float = 2e-4
    memory_bw: float = 10e9  # bytes/s of copies: assembling results, summing partials (one socket)
    # bytes/s of the memory AdamW streams (0: memory_bw): a GPU coordinator's optimizer reads its
    # own memory, while results still come through the host.
    own_bw: float = 0.0
    # Column blocks of one A block a batched check is priced to meet (``check_width``): the
    # coordinator checks results in batches (CHECK_COLUMNS); 1 prices every check alone.
    check_columns: int = CHECK_COLUMNS
    # Relays (``cleave relay``): volunteers with good links that take each operand block from
    # the PS once and serve it to their devices. ``relays`` of them, each sending ``relay_egress``
    # bytes/s and caching ``relay_memory`` bytes of blocks; every device sits behind one.
    relays: int = 0
    relay_egress: float = 1.25e9  # 10 Gbit/s: a university server or a cloud VM
    relay_memory: float = 16e9
    # The coordinator's event loop: what it pays per message, tile and byte (``LoopCosts``).
    loop: LoopCosts = field(default_factory=_loop_costs)
    # Processes that each run an event loop and a verifier (issue 34, item 3): the loop's and
    # the verifier's work spread over this many of each. 1: today's one loop, one verifier thread.
    workers: int = 1

    def __post_init__(self) -> None:
        _positive("ps egress", self.egress)
        _positive("relay egress", self.relay_egress)
        _positive("relay memory", self.relay_memory)
        if isinstance(self.relays, bool) or not isinstance(self.relays, int) or self.relays < 0:
            raise CostModelError(f"relays must be a non-negative integer, got {self.relays!r}")
        _positive("ps ingress", self.ingress)
        _positive("ps verify_flops", self.verify_flops)
        _positive("ps unit_overhead", self.unit_overhead, zero=True)
        _positive("ps memory_bw", self.memory_bw)
        _positive("ps own_bw", self.own_bw, zero=True)
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise CostModelError(f"ps workers must be a positive integer, got {self.workers!r}")
        if isinstance(self.check_columns, bool) or not isinstance(self.check_columns, int) or self.check_columns < 1:
            raise CostModelError(f"ps check_columns must be a positive integer, got {self.check_columns!r}")
        for dtype, rate in self.gflops.items():
            _positive(f"ps gflops[{dtype}]", rate, zero=True)

    def send_seconds(self, sent: float, distinct: float) -> float:
        """Seconds to get ``sent`` bytes of operand blocks to the devices, of which ``distinct``
        are different blocks. Without relays all of it leaves the PS. Behind relays a block
        leaves the PS once per relay at most (``min(sent, relays x distinct)``), and the relays'
        egress carries it once per device that needs it, spread over the relays; the slower of
        the two binds (each is a FIFO link, and both run at once across a GEMM's blocks)."""
        if self.relays <= 0:
            return sent / self.egress
        from_ps = min(sent, self.relays * distinct)
        return max(from_ps / self.egress, sent / (self.relays * self.relay_egress))

    @property
    def optimizer_bw(self) -> float:
        """Bytes/s at which AdamW streams its parameters, moments and gradients."""
        return self.own_bw or self.memory_bw

    def flops_per_s(self, dtype: str) -> float:
        """Its GEMM rate in ``dtype`` (0: it cannot compute in it)."""
        return self.gflops.get(dtype, 0.0) * 1e9

    def check_width(self, cols: int) -> int:
        """Columns of the stacked check of one A block of a grid with ``cols`` column blocks,
        checked in batches (``batch_check_seconds``): ``VERIFY_ROUNDS`` for each column block a
        batch meets, at most ``check_columns`` of them."""
        return VERIFY_ROUNDS * max(1, min(cols, self.check_columns))

    def check_rate(self, width: int = VERIFY_ROUNDS) -> float:
        """FLOP/s of a check's product with ``width`` stacked random vectors (checks run in fp32).

        A skinny product is bound by reading its matrix: ``verify_flops`` at ``VERIFY_ROUNDS``
        columns. A wider one reads the matrix once for all its columns and nears the GEMM rate:
        seconds per FLOP ``1/peak + (1/verify - 1/peak) VERIFY_ROUNDS / width``, a roofline with a
        soft knee that fits bench/bench_verify.py's stacked products here within 15% (one core:
        44 GFLOP/s at 16 columns, 57-62 at 32, 62-73 at 64, 67-81 at 128, 73-86 at 256, against
        ~90 for a square GEMM). ``peak`` is the fp32 GEMM rate, or the skinny rate where that is
        stated lower (``--ps-gflops`` states what GEMMs may count on, not what checks need)."""
        peak = max(self.flops_per_s("fp32"), self.verify_flops)
        if width <= VERIFY_ROUNDS:
            return self.verify_flops
        return 1.0 / (1.0 / peak + (1.0 / self.verify_flops - 1.0 / peak) * VERIFY_ROUNDS / width)

    @classmethod
    def from_link(cls, gbps: float, **kwargs: object) -> PSProfile:
        """Both directions at ``gbps`` gigabits per second."""
        _positive("--ps-link-gbps", gbps)
        rate = gbps * 1e9 / 8
        return cls(egress=rate, ingress=rate, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- one unit


@dataclass(frozen=True)
class Unit:
    """``C[m x n] (+)= A[m x k] @ B[k x n]``: the shape of one work unit. Sizes may be averages
    (a grid's tiles differ by one row or column where the cut is uneven)."""

    m: float
    n: float
    k: float
    itemsize: int = 4

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k) < 1 or self.itemsize < 1:
            raise CostModelError(f"a unit needs positive sizes, got {self.m}x{self.k} @ {self.k}x{self.n}")

    @property
    def flops(self) -> float:
        """FLOP of the product (2 m n k)."""
        return 2 * self.m * self.n * self.k

    @property
    def a_bytes(self) -> float:
        """Bytes of its A block."""
        return self.m * self.k * self.itemsize

    @property
    def b_bytes(self) -> float:
        """Bytes of its B block."""
        return self.k * self.n * self.itemsize

    def down(self, *, held_a: bool = False, held_b: bool = False) -> float:
        """Bytes sent to the device: the input blocks it does not hold already."""
        return (0 if held_a else self.a_bytes) + (0 if held_b else self.b_bytes)

    @property
    def up(self) -> float:
        """Bytes of the result block it sends back."""
        return self.m * self.n * self.itemsize

    @property
    def memory(self) -> float:
        """Bytes the device needs for the unit: both inputs and the result."""
        return self.a_bytes + self.b_bytes + self.up

    def verify_flops(self) -> float:
        """PS work to check the result: ``VERIFY_ROUNDS`` products with A, B and C each."""
        return 2.0 * VERIFY_ROUNDS * (self.m * self.k + self.k * self.n + self.m * self.n)


def batch_check_seconds(
    products: Iterable[tuple[Hashable, Hashable, float, float, float]],
    ps: PSProfile,
    known_b: Container[Hashable] = (),
) -> float:
    """PS seconds to check a batch of products ``(a_block, b_block, rows, cols, depth)`` that the
    verifier takes together (``wire.verify.freivalds_batch``): ``B R`` once per
    distinct B block, one stacked product ``A [B_1 R_1 | ...]`` per distinct A block with
    ``VERIFY_ROUNDS`` columns for each distinct B block it meets (at ``check_rate`` of that
    width), and each product's ``C R``. A batch of one is ``Unit.verify_flops`` at
    ``check_rate()``.

    A band check (``wire.verify.freivalds_band``) is the same sum over one row band's
    products: its rows of A read once (one A block per reduction range, stacked with every tile
    position's vectors), each result once, and ``B R`` once per GEMM: pass the B blocks an
    earlier band of the GEMM already multiplied as ``known_b``."""
    t = VERIFY_ROUNDS
    skinny = ps.check_rate()
    b_blocks: dict[Hashable, float] = {}
    a_blocks: dict[Hashable, tuple[float, set[Hashable]]] = {}
    cr = 0.0
    for a, b, rows, cols, depth in products:
        if b not in known_b:
            b_blocks[b] = depth * cols
        a_blocks.setdefault(a, (rows * depth, set()))[1].add(b)
        cr += rows * cols
    seconds = 2.0 * t * (cr + sum(b_blocks.values())) / skinny
    for area, met in a_blocks.values():
        width = t * len(met)
        seconds += 2.0 * area * width / ps.check_rate(width)
    return seconds


def compute_share_ceiling(profile: Profile, dtype: str, gemms: Iterable[tuple[int, int, int]], itemsize: int) -> float:
    """The largest share of a step a device could spend computing, whatever the plan: its links
    cap it. A tile ``a x b`` deep ``c`` computes ``2 a b c / F`` seconds; its result goes back
    (``s a b / up``: results are never held), and at least one operand block comes down (``s c
    min(a, b) / down``, the other held from an earlier tile, within the device's memory). With
    downloads, computing and uploads overlapped, its share is ``compute / max(compute, down, up)``,
    at best ``min(1, 2 c up / (s F), 2 max(a, b) down / (s F))``: the deepest reduction and the
    widest held block of the step's GEMMs ``(m, n, k)``. No overheads, no waiting: an upper bound
    (the simulator reports it beside the fleet utilisation it reached)."""
    rate = profile.flops_per_s(dtype)
    if rate <= 0:
        return 0.0
    best = 0.0
    for m, n, k in gemms:
        wide = min(max(m, n), profile.memory / (itemsize * max(1, k)))  # the held block must fit
        share = min(1.0, 2.0 * k * profile.up / (itemsize * rate), 2.0 * wide * profile.down / (itemsize * rate))
        best = max(best, share)
    return best


def utilisation_bound(devices: Sequence[tuple[float, float]], work: float, seconds: float) -> float:
    """The highest mean share of a step the devices could spend computing: ``devices`` are
    ``(rate, ceiling)`` (FLOP/s, and ``compute_share_ceiling``), ``work`` the step's GEMM FLOP,
    ``seconds`` the step. A device computing ``f`` FLOP is busy ``f / (rate seconds)`` of the step,
    at most its ceiling; the mean is largest when the slowest devices take the work first (a
    fractional knapsack: busy share per FLOP is ``1 / rate``). With less work than the slow
    devices could do, no plan keeps the fleet busier, however it cuts the GEMMs."""
    if not devices or seconds <= 0:
        return 0.0
    left, busy = max(0.0, work), 0.0
    for rate, ceiling in sorted(devices):
        if left <= 0:
            break
        if rate <= 0 or ceiling <= 0:
            continue
        take = min(left, rate * seconds * ceiling)
        busy += take / (rate * seconds)
        left -= take
    return busy / len(devices)


def in_flight_memory(units: int, unit_memory: float) -> int:
    """Bytes a device needs for ``units`` units of at most ``unit_memory`` bytes each: ``IN_FLIGHT``
    of them at once (one computing, one prefetched). Blocks it has finished with are kept only
    while they fit what is left of its budget (the client evicts the oldest), so they add nothing.
    The one definition of a device's memory need: the planner and the round-robin baseline both
    use it, for feasibility and for the memory they report."""
    return math.ceil(min(units, IN_FLIGHT) * unit_memory) if units > 0 else 0


@dataclass(frozen=True)
class Stage:
    """Seconds one unit spends in each of a device's three pipelined stages."""

    down: float
    compute: float
    up: float

    @property
    def total(self) -> float:
        """Seconds of the unit end to end, one phase after another."""
        return self.down + self.compute + self.up

    @property
    def bottleneck(self) -> float:
        """Seconds of its slowest phase: what a pipeline of such units pays per unit."""
        return max(self.down, self.compute, self.up)


def stage(unit: Unit, profile: Profile, dtype: str, *, down_bytes: float | None = None) -> Stage:
    """Seconds of ``unit`` on a device: download (``down_bytes`` if some blocks are held), the
    GEMM plus the device's per-unit overhead, and the upload. Infinite compute when the device
    cannot multiply in ``dtype``."""
    rate = profile.flops_per_s(dtype)
    compute = unit.flops / rate + profile.overhead if rate > 0 else math.inf
    sent = unit.down() if down_bytes is None else down_bytes
    return Stage(sent / profile.down, compute, unit.up / profile.up)


def pipeline(stages: Sequence[Stage], rtt: float = 0.0) -> float:
    """Seconds until the last result of ``stages`` (in order) is back, with download, compute and
    upload overlapping across consecutive units (a three-machine flow shop: each stage starts
    when its unit's previous stage and the previous unit's same stage are done), plus one round
    trip of latency. Exact for the flow shop; O(len(stages))."""
    d = c = u = 0.0
    for s in stages:
        d += s.down
        c = max(c, d) + s.compute
        u = max(u, c) + s.up
    return (u + rtt) if stages else 0.0


def pipelined(first: Stage, rest: Stage, count: int, rtt: float = 0.0) -> float:
    """``pipeline([first] + [rest] * (count - 1), rtt)`` in O(1): the first unit downloads more
    (blocks the later ones reuse). Each stage's finish time is a max of linear forms in the
    unit index, so only the end points count."""
    if count <= 0:
        return 0.0
    if count == 1:
        return first.total + rtt
    n1 = count - 1
    d2 = first.down + rest.down  # second download done
    c1 = first.down + first.compute
    c2 = max(c1, d2) + rest.compute
    # C_count = max over the unit j whose download gates the compute chain from j on.
    cn = max(c2 + (count - 2) * rest.compute, first.down + n1 * rest.down + rest.compute)
    u1 = c1 + first.up
    un = max(u1 + n1 * rest.up, c2 + (count - 1) * rest.up, cn + rest.up)
    return un + rtt


# --------------------------------------------------------------------------- the PS


def ps_seconds(
    units: int, verify_flops: float, partial_bytes: float, out_bytes: float, ps: PSProfile, cols: int = 1
) -> float:
    """PS CPU for a GEMM: per-unit bookkeeping, verifying every unit (checked in batches from a
    grid of ``cols`` column blocks: at ``check_rate(check_width(cols))``), writing the result
    and adding every extra partial block (split reductions) into it."""
    check = verify_flops / ps.check_rate(ps.check_width(cols))
    return units * ps.unit_overhead + check + (out_bytes + 2 * partial_bytes) / ps.memory_bw


def loop_seconds(units: float, tiles: float, down_bytes: float, up_bytes: float, ps: PSProfile) -> float:
    """The coordinator's event-loop CPU for a GEMM handed out in ``units`` work messages (each
    answered by one result message) carrying ``tiles`` tiles, ``down_bytes`` of blocks sent and
    ``up_bytes`` of results received (``LoopCosts``), spread over its ``workers``. The loop runs
    beside the verifier and the trainer, so a plan is feasible in ``T`` only if this fits too."""
    return ps.loop.seconds(2.0 * units, tiles, down_bytes, up_bytes) / ps.workers


def output_egress_floor(area: float, k: float, itemsize: int) -> float:
    """Fewest bytes a device needs to compute ``area`` outputs, each with a reduction of ``k``:
    outputs touching ``a`` rows and ``b`` columns need ``s k (a + b)`` inputs, ``a b >= area``
    and ``a + b >= 2 sqrt(a b)`` (AM-GM), so at least ``2 s k sqrt(area)``."""
    return 2.0 * itemsize * k * math.sqrt(max(0.0, area))


def output_tiles_egress_floor(m: int, n: int, k: int, parts: int, itemsize: int) -> float:
    """Fewest bytes the PS sends for an ``m x k @ k x n`` GEMM whose outputs are shared out in
    ``parts`` *equal* shares that each keep the full reduction: ``parts`` times
    ``output_egress_floor(m n / parts)``, i.e. ``2 s k sqrt(P m n)``. Unequal shares can need
    less (the square root is concave): sum ``output_egress_floor`` over the actual shares."""
    return max(1, parts) * output_egress_floor(m * n / max(1, parts), k, itemsize)


def local_seconds(m: int, n: int, k: int, dtype: str, ps: PSProfile) -> float:
    """The GEMM on the PS itself: no bytes move, no verification."""
    rate = ps.flops_per_s(dtype)
    return 2.0 * m * n * k / rate if rate > 0 else math.inf
