"""A discrete-event simulation of training steps on a fleet: the live scheduler on a virtual clock.

What is real here: the scheduler (coordinator/engine/scheduler.py: the same ``Scheduler`` object the
live ``Core`` drives, fed the same calls: ``join``, ``add_gemm``, ``holds_block``, ``expire``,
``assign``, ``copies``, ``done``, ``release``, ``leave``), the planner (coordinator/engine/live_plan.py:
the live ``LivePlanner``, so every GEMM is cut and owned as the coordinator would cut and own it)
and each device's conduct (coordinator/engine/conduct.py: the same ``Conduct`` rules as ``Core``:
probation, slots, its pace, stallers cut, cool-offs).

What is modelled (docs/simulation.md derives each rule and validates it against emulated runs):

* **no sockets, no tensors**: a unit's bytes and FLOP come from its tile; its result is honest;
* **links are FIFO resources**: a work frame of B bytes leaves the PS's egress queue at
  ``max(now, egress_free) + B / egress`` and crosses the device's downlink in ``B / down``; it is
  usable when both are done, plus half a round trip. Results go back the same way through the
  device's uplink and the PS's ingress. Each device computes one unit at a time;
* **the PS's CPU is three FIFOs, as the live coordinator's threads**: the *event loop* frames
  every work message and reads every result, paying ``PSProfile.loop`` (``costmodel.LoopCosts``:
  per message, per tile, per byte down and up, measured by bench_tax.py); a work frame leaves
  the PS's egress only once the loop has framed it, and a result is taken (its lease ended, its
  slot freed, the next lease decided) only once the loop has read it. The *verifier* checks by
  band as ``Core(band_checks=True)`` does: a taken result waits for the rest of its row band,
  and the band is checked at once (``costmodel.batch_check_seconds`` over the band's products:
  its A rows once, each result once, ``B R`` once per GEMM, plus ``unit_overhead`` a result);
  results of devices on probation, or of a device holding ``UNCHECKED_PER_SLOT`` unchecked
  results a slot, are checked alone (waiting ones together, in batches of ``CHECK_BATCH``).
  The *trainer* assembles GEMM outputs and adds partials (``memory_bw``), multiplies the GEMMs
  its plan keeps, and runs the non-GEMM work (attention, AdamW), in the order the training loop
  issues them. ``PSProfile.workers`` loops and verifiers share the work (each a FIFO; a job
  goes to the one free first). Leases are decided when the scheduler is called (its decisions
  are instantaneous); what they cost is the loop's time before the frame can leave. A lease
  counts from its frame on the wire (``Scheduler.on_wire``) and its clock stops while its
  result waits for the loop (``Scheduler.result_in``), as the live loop, which decides a lease
  when it gets to it, counts it: a long queue behind the loop makes no lease late;
* **churn**: each device stays for an exponential session with its class's mean; a leave is a
  clean close (seen at once) or a crash (seen after ``FaultPolicy.heartbeat_timeout``, as the
  live coordinator's heartbeat sweep sees it), and the device is replaced by a newcomer of the
  same class after an exponential delay. Randomness comes from ``seed`` only.

The simulation is deterministic for a seed. It costs O(log n) per event and scheduler decision;
a step of Llama-2-7B on 10,000 phones takes seconds (bench figure in docs/simulation.md).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cleave.coordinator.engine.checks import UNCHECKED_PER_SLOT  # a device's results a slot awaiting bands

# The live coordinator's rules and estimates (coordinator/engine/): each defined once, there.
from cleave.coordinator.engine.conduct import Conduct, Pace, Standing
from cleave.coordinator.engine.dispatch import Dispatch
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.engine.live_plan import LivePlanner, Planner, batches, filled_lanes, fleet_key
from cleave.coordinator.engine.profiles import Ema
from cleave.coordinator.engine.scheduler import Assign, Decision, FaultPolicy, Overdue, Reclaim, Scheduler, UnitSpec
from cleave.coordinator.engine.standby import StandbyPolicy
from cleave.coordinator.engine.upkeep import TICK  # the live server's tick: copies and deferred devices look again
from cleave.coordinator.planning.costmodel import (
    ADAMW_BYTES,
    ATTENTION_PASSES,
    CHECK_BATCH,
    ITEMSIZE,
    PARTS_IN_FLIGHT,
    CostModelError,
    DeviceClass,
    Profile,
    PSProfile,
    batch_check_seconds,
    compute_share_ceiling,
    local_seconds,
    utilisation_bound,
)
from cleave.coordinator.planning.planner import Kind, PlannerOptions
from cleave.coordinator.planning.tier import SOLO, Tier
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy
from cleave.coordinator.whatif.presets import ModelShape
from cleave.wire.messages import DEFAULT_SLOTS

QUANTILES = (0.1, 0.5, 0.9)  # of the devices' compute shares, in reports
TELL_EVERY = 50_000  # events between progress lines (about a second of wall time at 1,024 devices)


class SimulationError(CostModelError):
    """A simulation that cannot run (no device can compute, a bad option)."""


# --------------------------------------------------------------------------- the step's program


@dataclass(frozen=True)
class Operand:
    """A GEMM operand as stored on the PS: which tensor, whether the GEMM reads it transposed,
    and the stored tensor's width (a block is one contiguous run of memory only when it spans
    whole stored rows; any other slice is copied and travels under a key of its own)."""

    tensor: tuple  # namespace: ("X", step, group), ("dY", step, linear) or ("W", gemm)
    transposed: bool
    width: int


@dataclass(frozen=True)
class GemmCall:
    m: int
    n: int
    k: int
    kind: GemmKind
    a: Operand
    b: Operand
    label: str
    # Deferred (a weight gradient in the dataflow program): issued with its op, but nothing in
    # the micro-batch waits for it; the optimizer waits for every one.
    deferred: bool = False


@dataclass(frozen=True)
class PsWork:
    seconds: float
    what: str  # "attention" | "optimizer" | "tier" (a rank's collectives)


Op = PsWork | tuple[GemmCall, ...]

# Linears fed the same input tensor (a layer's q, k and v read one normed X; gate and up another):
# their forward blocks of X are the same memory, so a device holding them needs them once.
_SHARED_INPUT = {"q": "attn", "k": "attn", "v": "attn", "gate": "mlp", "up": "mlp"}


def step_program(model: ModelShape, batch: int, seq: int, dtype: str, ps: PSProfile, step: object = 0) -> list[Op]:
    """The order in which one training step issues GEMMs and PS work: forward layer by layer
    (attention on the PS between the projections and the output projection), the head, then
    backward in reverse, each Linear's dX and dW submitted together, then AdamW."""
    tokens = batch * seq
    rate = ps.flops_per_s(dtype)
    if rate <= 0:
        raise SimulationError(f"the parameter server cannot compute in {dtype}")
    attention = model.attention_flops(batch, seq) / model.n_layers / rate  # one layer's forward
    linears = model.linears()
    head, body = linears[-1], linears[:-1]
    attn_names = {"q", "k", "v", "qkv"}
    order: list[tuple[int, str, int, int]] = []  # (layer, name, in, out) in forward order
    for layer in range(model.n_layers):
        order += [(layer, lin.name, lin.in_features, lin.out_features) for lin in body]
    order.append((model.n_layers, head.name, head.in_features, head.out_features))

    def x_of(layer: int, name: str, fin: int) -> Operand:
        group = _SHARED_INPUT.get(name, name)
        return Operand(("X", step, layer, group), False, fin)

    ops: list[Op] = []
    for index, (layer, name, fin, fout) in enumerate(order):
        w = Operand(("W", step, index, "fwd"), True, fin)  # W^T: the weight (out x in) transposed
        ops.append((GemmCall(tokens, fout, fin, GemmKind.FORWARD, x_of(layer, name, fin), w, f"{name}.fwd"),))
        if name in attn_names and (index + 1 == len(order) or order[index + 1][1] not in attn_names):
            ops.append(PsWork(attention, "attention"))
    for index in reversed(range(len(order))):
        layer, name, fin, fout = order[index]
        dy = Operand(("dY", step, index), False, fout)
        dx = GemmCall(
            tokens, fin, fout, GemmKind.GRAD_INPUT, dy, Operand(("W", step, index, "dx"), False, fin), f"{name}.dx"
        )
        dw = GemmCall(
            fout,
            fin,
            tokens,
            GemmKind.GRAD_WEIGHT,
            Operand(("dY", step, index), True, fout),
            x_of(layer, name, fin),
            f"{name}.dw",
        )
        ops.append((dx, dw))
        if name in ("o", "proj"):
            ops.append(PsWork((ATTENTION_PASSES - 1) * attention, "attention"))
    ops.append(_optimizer(model, dtype, ps))
    return ops


def dataflow_program(
    model: ModelShape, batch: int, seq: int, dtype: str, ps: PSProfile, step: int = 0, micro_batches: int = 1
) -> list[list[Op]]:
    """The step as the concurrent trainer issues it (coordinator/training/loop.py): the batch in
    ``micro_batches`` equal parts, each a chain of ops that runs while the others' GEMMs are out.
    In a chain, GEMMs that read the same input go out together (q, k and v; gate and up; and
    their input gradients), and each weight gradient is deferred: issued with its input
    gradient, waited for only by the optimizer. The optimizer is not in any chain: it runs once
    every chain and every deferred GEMM is done (``Simulation.run``). Tensor namespaces carry
    the micro-batch, so no block is shared across parts."""
    if batch % micro_batches:
        raise SimulationError(f"micro_batches ({micro_batches}) must divide the batch ({batch})")
    chains = []
    for part in range(micro_batches):
        flat = step_program(model, batch // micro_batches, seq, dtype, ps, (step, part))[:-1]  # AdamW: once
        chain: list[Op] = []
        for op in flat:
            if isinstance(op, PsWork):
                chain.append(op)
                continue
            calls = [c for c in op if c.kind is not GemmKind.GRAD_WEIGHT]
            deferred = tuple(dataclasses.replace(c, deferred=True) for c in op if c.kind is GemmKind.GRAD_WEIGHT)
            group = _SHARED_INPUT.get(calls[0].label.split(".")[0])
            prev = chain[-1] if chain and not isinstance(chain[-1], PsWork) else None
            prev_group = _SHARED_INPUT.get(prev[0].label.split(".")[0]) if prev else None
            if prev is not None and group is not None and group == prev_group and prev[0].kind is calls[0].kind:
                chain[-1] = (*prev, *calls, *deferred)  # the same input (or its gradient): together
            else:
                chain.append((*calls, *deferred))
        chains.append(chain)
    return chains


def predict(
    chains: list[list[Op]], tail: list[Op], planner: LivePlanner, dtype: str, profiles: Mapping[int, Profile]
) -> float:
    """The cost model's step: the program list-scheduled on the planner's lanes with each GEMM's
    predicted seconds (``LivePlanner.forecast`` at the predicted clock: it picks the lane free
    first, and ships the GEMM or keeps it, as it will live), a chain's next op once its GEMMs
    are predicted done, deferred GEMMs on lanes without holding their chain, then ``tail`` once
    everything is done. The coordinator's CPU runs the GEMMs kept home and the PS work (attention,
    the optimizer) one after another: the planner sees only the GEMMs (the live one cannot see
    the trainer's other work), so its view of the CPU is not the step's. No events, no units:
    O(ops log chains). Pass a fresh planner."""
    ready = [(0.0, index) for index in range(len(chains))]  # (when the chain's next op may start, chain)
    heapq.heapify(ready)
    ops = [iter(chain) for chain in chains]
    end = cpu = 0.0  # cpu: when the coordinator's CPU is predicted free
    while ready:
        now, index = heapq.heappop(ready)
        op = next(ops[index], None)
        if op is None:
            end = max(end, now)
            continue
        if isinstance(op, PsWork):
            cpu = max(now, cpu) + op.seconds
            heapq.heappush(ready, (cpu, index))
            continue
        done = now
        for call in op:
            at, home = planner.forecast(call.m, call.n, call.k, call.kind, dtype, profiles, now=now)
            if home:  # behind the PS work the planner does not see
                at = cpu = max(now, cpu) + local_seconds(call.m, call.n, call.k, dtype, planner.ps)
            at = at if at is not None else math.inf
            end = max(end, at)
            if not call.deferred:
                done = max(done, at)
        heapq.heappush(ready, (done, index))
    for op in tail:
        if isinstance(op, PsWork):
            end = cpu = max(end, cpu) + op.seconds
    return end


# --micro-batches auto: forecasts this close to the best are a tie, which fewer parts win (less
# held on the PS, larger GEMMs). Kept small: where the PS's own work binds, forecasts for 2, 4 and
# 8 parts come within 1% of each other while the simulated steps differ by 14% (10,000 devices:
# 558, 554 and 553 s forecast; 797 s simulated with 2 parts, 699 s with 4; docs/simulation.md).
MICRO_BATCH_SLACK = 0.005


def program(
    model: ModelShape,
    batch: int,
    seq: int,
    dtype: str,
    ps: PSProfile,
    step: int,
    micro_batches: int,
    tier: Tier = SOLO,
) -> tuple[list[list[Op]], list[Op]]:
    """The step's chains and what runs once they are all done, as the trainer issues them. On a
    tier, ``batch`` is one rank's slice, and the tail is the tier's: the gradients'
    reduce-scatter, AdamW on the rank's share of the parameters, the weights' all-gather."""
    tail = optimizer_tail(model, dtype, ps, tier)
    if micro_batches == 1:  # today's order: one chain, every GEMM waited for in turn
        ops = step_program(model, batch, seq, dtype, ps, step)
        return ([ops], []) if tier.ranks == 1 else ([ops[:-1]], tail)
    return dataflow_program(model, batch, seq, dtype, ps, step, micro_batches), tail


def optimizer_tail(model: ModelShape, dtype: str, ps: PSProfile, tier: Tier = SOLO) -> list[Op]:
    """What the trainer runs once every GEMM of the step is done: AdamW, and on a tier the
    collectives around it (``coordinator/planning/tier.py``), all on its thread."""
    if tier.ranks == 1:
        return [_optimizer(model, dtype, ps)]
    sizes = model.parameter_sizes()
    return [
        PsWork(tier.reduce_seconds(sizes, ps.memory_bw), "tier"),
        _optimizer(model, dtype, ps, tier.optimizer_share(sizes)),
        PsWork(tier.gather_seconds(sizes), "tier"),
    ]


def micro_batch_choices(batch: int, most: int = PARTS_IN_FLIGHT) -> list[int]:
    """The part counts the cost model weighs: divisors of the batch, at most ``most``."""
    return [m for m in range(1, min(batch, most) + 1) if batch % m == 0]


@dataclass(frozen=True)
class MicroBatchChoice:
    """The cost model's number of micro-batches and the forecast step of every candidate."""

    micro_batches: int
    forecasts: dict[int, float]  # candidate -> forecast step seconds (capped at the PS alone with keeps_home)

    def summary(self, basis: str = "the fleet") -> str:
        others = ", ".join(f"{m}: {s:.3g} s" for m, s in sorted(self.forecasts.items()) if m != self.micro_batches)
        return (
            f"micro-batches: {self.micro_batches}, chosen by the cost model on {basis} "
            f"(forecast step {self.forecasts[self.micro_batches]:.3g} s; {others or 'no other choice'})"
        )


def choose_micro_batches(
    model: ModelShape,
    batch: int,
    seq: int,
    dtype: str,
    ps: PSProfile,
    planner: Planner,
    policy: TilingPolicy,
    profiles: Mapping[int, Profile],
    most: int = PARTS_IN_FLIGHT,
    *,
    keeps_home: bool = True,
    tier: Tier = SOLO,
) -> MicroBatchChoice:
    """``--micro-batches auto``: forecast one step for each candidate part count on this fleet
    (``predict``, the fleet in as many lanes) and take the fewest parts within
    ``MICRO_BATCH_SLACK`` of the best forecast: fewer parts hold less on the coordinator and cut
    the GEMMs less. ``keeps_home``: the step runs on the PS alone where that is forecast sooner
    (the simulator's cost planner does; the live coordinator decides GEMM by GEMM, so it passes
    False). On a tier, ``batch`` is one rank's slice and ``profiles`` its devices. Pure: no
    clock, no I/O."""
    forecasts: dict[int, float] = {}
    for m in micro_batch_choices(batch, most):
        # No more parts than the lanes the fleet fills: a part without a lane of its own only
        # waits (on two devices, four parts ran 2x slower than two: bench/bench_planner.py).
        if m > 1 and filled_lanes(profiles, dtype, m) < m:
            continue
        chains, tail = program(model, batch, seq, dtype, ps, 0, m, tier)
        forecast = predict(chains, tail, LivePlanner(planner, ps, policy, lanes=m), dtype, profiles)
        if keeps_home and planner is Planner.COST:
            forecast = min(forecast, home_seconds(chains, tail, ps, dtype))
        forecasts[m] = forecast
    best = min(forecasts.values())
    chosen = min(m for m, f in forecasts.items() if f <= best * (1 + MICRO_BATCH_SLACK))
    return MicroBatchChoice(chosen, forecasts)


def home_seconds(chains: list[list[Op]], tail: list[Op], ps: PSProfile, dtype: str) -> float:
    """The step with every GEMM kept on the PS: its CPU does everything, one op after another."""
    return sum(
        op.seconds if isinstance(op, PsWork) else sum(local_seconds(c.m, c.n, c.k, dtype, ps) for c in op)
        for op in [*(op for chain in chains for op in chain), *tail]
    )


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SimConfig:
    model: ModelShape
    fleet: tuple[DeviceClass, ...]
    ps: PSProfile
    batch: int = 8
    seq: int = 256
    dtype: str = "fp32"
    seed: int = 0
    steps: int = 1
    planner: Planner = Planner.COST
    policy: TilingPolicy = field(default_factory=TilingPolicy)
    faults: FaultPolicy = field(default_factory=FaultPolicy)
    trust: TrustPolicy = field(default_factory=TrustPolicy)
    churn: bool = True  # sessions end (exponential, each class's mean session) and newcomers replace them
    crash_share: float = 0.5  # of leaves, the share that are crashes (seen only by the heartbeat sweep)
    rejoin_seconds: float = 60.0  # mean delay before a leaver's replacement joins
    veterans: bool = True  # devices present at the start are off probation (a running fleet)
    fail_at: float | None = None  # crash the busiest device this many seconds into the last step
    # ... or once this share of the last step's GEMMs is submitted (or the first GEMM after,
    # when no device holds work then): mid-step whatever the step turns out to take, so a run
    # with a crash needs no calm run before it (coordinator/whatif/runs.py). A step kept home
    # has nobody to crash. ``run``'s steps only (``run_ops`` injects no crash).
    fail_share: float | None = None
    slots: int = DEFAULT_SLOTS  # what `cleave join` asks for by default (--slots)
    give_up: float = 3600.0  # simulated seconds without a verified unit before the run is declared stalled
    # The batch in this many parts through the model side by side (``dataflow_program``); 1: one
    # GEMM after another, each waited for, as the trainer without --micro-batches issues them;
    # 0: as many as the cost model chooses from the fleet at the first step (``choose_micro_batches``).
    micro_batches: int = 1
    # A planned owner's tiles of a GEMM go out in a few batched work messages (live_plan.batches):
    # one lease and one result each. False: one tile per message. (Checks are batched either way.)
    batched: bool = False
    lanes: int = 0  # the fleet in this many lanes, a GEMM planned on one (LivePlanner); 0: micro_batches
    # Coordinators training the batch together (``coordinator/planning/tier.py``): the run
    # simulates the tier's slowest rank, with its slice of the batch and its share of the fleet.
    tier: Tier = SOLO
    # Results checked by row band (``Core(band_checks=True)``, the live default); False: each
    # result checked alone (the verifier batching whatever waits), as ``band_checks=False``.
    band_checks: bool = True
    # Seconds of one process that every device shares, per unit (bench_tax's clients replay in
    # one Python process: bench/bench_sim_live.py): each unit's compute also waits its turn
    # there, FIFO. 0: every device computes on its own.
    host_cpu: float = 0.0
    # When the coordinator sends a device the plans leave idle to standby (coordinator/engine/
    # standby.py): its seconds asleep are booked at standby power (``StepStats.class_standby_s``).
    standby: StandbyPolicy = field(default_factory=StandbyPolicy)

    @property
    def rank_batch(self) -> int:
        """Sequences the simulated coordinator trains each step: the batch, or a rank's slice."""
        return self.batch // self.tier.ranks

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise SimulationError(f"unknown dtype {self.dtype!r}; use one of {', '.join(ITEMSIZE)}")
        for name in ("batch", "seq", "steps", "slots", "micro_batches"):
            value = getattr(self, name)
            least = 0 if name == "micro_batches" else 1  # 0 micro-batches: the cost model's choice
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                what = "a non-negative integer (0: auto)" if least == 0 else "a positive integer"
                raise SimulationError(f"{name} must be {what}, got {value!r}")
        if not (math.isfinite(self.host_cpu) and self.host_cpu >= 0):
            raise SimulationError(f"host_cpu must be non-negative and finite, got {self.host_cpu!r}")
        if self.fail_share is not None and (self.fail_at is not None or not 0 < self.fail_share <= 1):
            raise SimulationError(f"fail_share must be in (0, 1] and fail_at unset, got {self.fail_share!r}")
        if not 0 <= self.crash_share <= 1:
            raise SimulationError(f"crash_share must be between 0 and 1, got {self.crash_share!r}")
        if not sum(c.count for c in self.fleet):
            raise SimulationError("the fleet has no devices")
        if self.batch % self.tier.ranks:
            ranks = self.tier.ranks
            raise SimulationError(f"a batch of {self.batch} does not cut into {ranks} equal slices, one per rank")
        if self.micro_batches and self.rank_batch % self.micro_batches:
            what = "the batch" if self.tier.ranks == 1 else "each rank's slice of the batch"
            raise SimulationError(f"micro_batches ({self.micro_batches}) must divide {what} ({self.rank_batch})")
        if not sum(self.tier.share(c.count) for c in self.fleet):
            raise SimulationError(f"{self.tier.ranks} coordinators leave the slowest of them no devices")


# --------------------------------------------------------------------------- results


@dataclass
class StepStats:
    """One step, from its first GEMM to the end of AdamW."""

    seconds: float = 0.0
    units: int = 0  # leases made (copies included)
    copies: int = 0
    reclaimed: int = 0
    checks: int = 0  # batches the verifier ran (results waiting for it are checked together)
    checked: int = 0  # results those batches checked
    lost: int = 0  # leases that ended with their device's leave
    local_gemms: int = 0
    remote_gemms: int = 0
    predicted: float = 0.0  # the planner's prediction for the step's GEMMs plus PS work
    egress_bytes: float = 0.0  # blocks that left the PS (to devices, or to relays)
    ingress_bytes: float = 0.0
    relay_bytes: float = 0.0  # blocks relays served to their devices
    ps_cpu: dict[str, float] = field(
        default_factory=lambda: {
            "verify": 0.0,
            "assembly": 0.0,
            "local_gemms": 0.0,
            "attention": 0.0,
            "optimizer": 0.0,
            "tier": 0.0,  # a rank's collectives (on its trainer thread, which they hold)
        }
    )
    leaves: int = 0
    joins: int = 0
    ops: list[tuple[str, float, float]] = field(default_factory=list)  # (what, predicted, simulated) per op
    # Devices in this step: the busiest one's seconds of compute and of each link, and bytes.
    device_compute: float = 0.0
    device_down: float = 0.0
    device_up: float = 0.0
    devices_used: int = 0
    bytes_down_mean: float = 0.0  # over devices that computed in the step
    bytes_down_max: float = 0.0
    bytes_up_mean: float = 0.0
    bytes_up_max: float = 0.0
    forecast: float = 0.0  # the cost model's step (``predict``): the program list-scheduled on its lanes
    home: float = 0.0  # the step with every GEMM kept on the PS (``home_seconds``)
    kept_home: bool = False  # the forecast said the PS alone is faster: every GEMM stayed home
    gemm_seconds_in_flight: float = 0.0  # the integral of GEMMs in flight over the step
    most_gemms_in_flight: int = 0
    # Each device present in the step: the share of the step it spent multiplying (its units'
    # FLOP at its rate; the per-unit overhead is busy time, not compute). Their mean
    # (idle devices count), a few quantiles of the distribution, and the mean per class.
    fleet_utilisation: float = 0.0
    utilisation_quantiles: dict[float, float] = field(default_factory=dict)
    class_utilisation: dict[str, float] = field(default_factory=dict)
    # The mean over the same devices of the most their links let them compute, whatever the plan
    # (costmodel.compute_share_ceiling over the step's GEMMs): how close fleet_utilisation came.
    utilisation_ceiling: float = 0.0
    # The most the same devices could have computed in this step's time with its GEMM FLOP, each
    # within its ceiling (costmodel.utilisation_bound): below the ceiling when there is too little
    # work to keep the slow devices busy.
    utilisation_bound: float = 0.0
    # The same with only the work that can wait (the deferred weight gradients): what the slowest
    # devices could be kept busy with if the critical path (forward, input gradients) took none of
    # their time, so that they do not lengthen the step. The most a step-level plan could reach
    # without the slow devices on the critical path.
    utilisation_wait_bound: float = 0.0
    # Per class, summed over its devices present in the step: seconds busy computing (its units'
    # FLOP at its rate plus the per-unit overhead) and seconds present (joined and not yet left).
    # What coordinator/whatif/energy.py prices: busy at a busy power, the rest waiting.
    class_busy_s: dict[str, float] = field(default_factory=dict)
    class_present_s: dict[str, float] = field(default_factory=dict)
    # Of those present seconds, the ones asleep (``SimConfig.standby``): a device that held no
    # work in the step sleeps once ``after`` seconds have passed, one that worked after ``after``
    # seconds past its last result (the gaps between its units are counted awake: an upper
    # bound on its draw).
    class_standby_s: dict[str, float] = field(default_factory=dict)
    loop_s: float = 0.0  # the event loop's CPU (every worker's): frames down, results up
    bands: int = 0  # band checks the verifier ran
    alone: int = 0  # results checked alone (probation, a device's unchecked cap, tile checks)
    # Seconds each PS resource was busy in the step, per worker for the loop and the verifier:
    # "loop", "verifier", "trainer", "egress", "ingress" (``Simulation._ps_busy``).
    ps_busy: dict[str, float] = field(default_factory=dict)

    @property
    def ps_shares(self) -> dict[str, float]:
        """Each PS resource's busy share of the step (1: busy the whole step)."""
        return {k: v / self.seconds if self.seconds > 0 else 0.0 for k, v in self.ps_busy.items()}

    @property
    def busiest(self) -> str:
        """The PS resource busy longest in the step: what binds the coordinator."""
        return max(self.ps_busy, key=lambda k: self.ps_busy[k]) if self.ps_busy else ""

    @property
    def gemms_in_flight(self) -> float:
        """GEMMs submitted and not yet assembled, on average over the step."""
        return self.gemm_seconds_in_flight / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SimResult:
    steps: list[StepStats]
    devices: int  # at the start
    device_compute: list[float]  # per device ever present: GEMM seconds over the run
    device_down: list[float]  # seconds its downlink was busy
    device_up: list[float]
    device_bytes_down: list[float]
    device_bytes_up: list[float]
    recoveries: list[float]  # per crash of a device that held work: seconds until all its units were verified
    kinds: Counter
    events: int
    injected_recovery: float | None = None  # the injected crash's (``fail_at``, ``fail_share``); None: none came
    micro_batches: int = 1  # the parts each step ran in (the cost model's choice when asked for 0)
    choice: MicroBatchChoice | None = None  # that choice and its forecasts, when the cost model made it

    @property
    def measured(self) -> list[StepStats]:
        """The steps ``step_s`` averages."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    @property
    def step_s(self) -> float:
        """Mean over the steps after the first when there are several (the first warms up
        probation and the devices' speed estimates), else the one step."""
        return sum(s.seconds for s in self.measured) / len(self.measured)


# --------------------------------------------------------------------------- devices and units


@dataclass(eq=False)
class _Device:
    id: int
    cls: str
    profile: Profile
    rate: float  # FLOP/s in the dtype
    asked: int  # the slots its client asks for
    standing: Standing
    pace: Pace
    joined: float
    epoch: int = 0
    alive: bool = True
    left: float = math.inf  # when it stopped (a clean leave, or a crash: before it is noticed)
    down_free: float = 0.0
    cpu_free: float = 0.0
    up_free: float = 0.0
    blocks: set = field(default_factory=set)
    compute_s: float = 0.0  # busy: its units' FLOP at its rate plus the per-unit overhead
    flop_s: float = 0.0  # of which multiplying: what utilisation counts and its bounds price
    down_s: float = 0.0
    up_s: float = 0.0
    bytes_down: float = 0.0
    bytes_up: float = 0.0
    # 1 per verified result, 0 per lease taken back: the reliability the planner sees, as the
    # live coordinator's DeviceProfile keeps it (engine/profiles.py).
    kept: Ema = field(default_factory=Ema)


@dataclass
class _Relay:
    """A relay (``PSProfile.relays``): its egress (a FIFO link) and the blocks it caches, least
    recently used first, within ``relay_memory`` bytes."""

    egress_free: float = 0.0
    blocks: OrderedDict = field(default_factory=OrderedDict)  # key -> bytes
    held: float = 0.0

    def take(self, key: tuple, size: int, cap: float) -> bool:
        """Whether the relay holds ``key`` already; it does afterwards (evicting the oldest)."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return True
        self.blocks[key] = size
        self.held += size
        while self.held > cap and len(self.blocks) > 1:
            _, old = self.blocks.popitem(last=False)
            self.held -= old
        return False


@dataclass(eq=False)
class _Unit:
    gemm: _Gemm
    blocks: tuple[tuple[tuple, str, int], ...]  # (key, the scheduler's name for it, bytes) of every input block
    flops: int
    up: int
    # What its check reads: (A block, B block, rows, cols, depth) per product, keys scoped by GEMM
    # so that results of one GEMM checked together share B R and A's pass (batch_check_seconds).
    products: tuple[tuple[tuple, tuple, int, int, int], ...]
    waiting: int = 0  # bands it is taken into, not yet checked (band checks)


@dataclass(eq=False)
class _Band:
    """A GEMM's row band (``BandState``): checked once every product in it is taken."""

    key: tuple
    gemm: int
    expected: int  # products not yet taken (or checked alone)
    products: list = field(default_factory=list)  # taken ones: (A block, B block, rows, cols, depth)
    units: list = field(default_factory=list)  # their units: (id, unit, device)


@dataclass(eq=False)
class _Gemm:
    id: int
    call: GemmCall
    remaining: int
    out_bytes: int
    op: int  # the op that issued it
    up_bytes: int = 0


# Event kinds, in the order ties are broken at one instant.
_ARRIVE, _UPLOAD, _RESULT, _CHECK, _HANDLE, _CPU_DONE, _LEAVE, _DETECT, _JOIN, _FAIL, _TICK, _TAKE, _BAND = range(13)


class _Hands:
    """The simulator's hands for the live dispatch rules (engine/dispatch.py): a lease or a copy
    puts the unit on the links and the clock; a take-back forgets its arrival; a cut device
    leaves, and comes back after its cool-off. No relay report excuses a lease here."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def device(self, device_id: int) -> _Device | None:
        """The connected device, or None."""
        return self.sim.devices.get(device_id)

    def vanished(self, device_id: int, unit: int) -> None:
        """Nothing is kept of a gone device's leases here."""

    def lease(self, dev: _Device, unit: int, now: float) -> list[Any]:
        """A first lease: the unit goes out."""
        self.sim._lease(dev, unit, None)
        return []

    def flush(self, now: float) -> list[Any]:
        """No store: nothing to write."""
        return []

    def copy(self, dev: _Device, unit: int, copy: str, now: float) -> list[Any]:
        """A copy goes out like a lease (and is counted as one)."""
        self.sim._lease(dev, unit, copy)
        return []

    def excused(self, dev: _Device, unit: int) -> bool:
        """Simulated devices never report their relays."""
        return False

    def take_back(self, dev: _Device, unit: int, reason: str, excused: bool, now: float) -> list[Any]:
        """The lease is revoked (the scheduler barred the device): its result will not count."""
        sim = self.sim
        sim._leased.pop((unit, dev.id), None)
        sim._arrived.discard((unit, dev.id))
        sim._stats.reclaimed += 1
        if not excused:  # its reliability, as the live Fleet.failed counts it
            dev.kept.add(0.0, now)
            sim._replan(dev)
        return []

    def on_relay(self, dev: _Device, unit: int) -> bool:
        """Relays are never cooled by a cut here."""
        return False

    def drop(self, dev: _Device, why: str, wait: float, on_relay: bool, now: float) -> list[Any]:
        """A cut device is dropped and may come back after its cool-off (a departed device that
        was cut before anyone noticed it left does not come back: its replacement is on its way)."""
        sim = self.sim
        back = dev.alive
        sim._remove(dev, graceful=False)
        if back:
            sim._at(now + wait, _JOIN, DeviceClass(dev.cls, 1, dev.profile))
        return []


class Simulation:
    """One run: ``run()`` simulates ``cfg.steps`` steps and returns their statistics."""

    def __init__(
        self, cfg: SimConfig, *, scheduler: Scheduler | None = None, tell: Callable[[str], None] | None = None
    ) -> None:
        self.cfg = cfg
        # Progress for a person waiting (``cleave simulate``'s status line): a line every
        # ``TELL_EVERY`` events, what is done of the step's ops and the simulated clock.
        self.tell = tell
        self.rng = random.Random(cfg.seed)
        self.sched = scheduler if scheduler is not None else Scheduler(cfg.faults)
        self.conduct = Conduct(self.sched, cfg.trust)  # the live Core's rules, over this scheduler
        self.dispatch = Dispatch(self.conduct, _Hands(self))  # ...and its dispatch, on a virtual clock
        # 0 micro-batches: the cost model chooses at the first step (``choose_micro_batches``).
        self.micro_batches = cfg.micro_batches or 1
        self.choice: MicroBatchChoice | None = None
        self._shipping = LivePlanner(cfg.planner, cfg.ps, cfg.policy, lanes=cfg.lanes or self.micro_batches)
        self._home = LivePlanner(cfg.planner, cfg.ps, cfg.policy, PlannerOptions(kinds=frozenset({Kind.LOCAL})))
        self.planner = self._shipping  # per step: ``_home`` when the forecast keeps the step home
        self.itemsize = ITEMSIZE[cfg.dtype]
        self.now = 0.0
        self._events: list[tuple] = []
        self._seq = 0
        self.devices: dict[int, _Device] = {}
        self.gone: list[_Device] = []
        self._next_device = 1
        self._fleet_version = 0
        self._profiles: dict[int, Profile] = {}
        self.units: dict[int, _Unit] = {}
        self._next_unit = 1
        self._next_gemm = 1
        self.gemms: dict[int, _Gemm] = {}
        self._holders: dict[tuple, set[int]] = {}  # tensor namespace -> devices holding its blocks
        self._leased: dict[tuple[int, int], int] = {}  # (unit, device) -> lease epoch of the device
        self.egress_free = self.ingress_free = self.cpu_free = 0.0
        self.host_free = 0.0  # the devices' shared process (``SimConfig.host_cpu``)
        self._loops = [0.0] * cfg.ps.workers  # when each event loop is free
        self._verifiers = [0.0] * cfg.ps.workers  # when each verifier is free
        # Row bands (``Core(band_checks=True)``): (gemm, r0, r1) -> its products not yet taken,
        # the taken ones, and their units; a GEMM's B blocks whose ``B R`` a band already made.
        self._bands: dict[tuple, _Band] = {}
        self._bands_due: list[_Band] = []
        self._band_turn = False  # the verifier alternates bands and results checked alone
        self._b_known: dict[int, set] = {}
        self._unchecked: Counter = Counter()  # device -> its taken results awaiting their bands
        self.relays = [_Relay() for _ in range(cfg.ps.relays)]  # device d behind relay d mod count
        self._shapes: set[tuple[int, int, int]] = set()  # the step's GEMMs (m, n, k)
        self._calls = 0  # the step's GEMMs
        self._work = 0.0  # ...their FLOP
        self._waiting = 0.0  # ...of which deferred (the weight gradients)
        self._checks: list[tuple[int, int, int, float]] = []  # results waiting for the verifier
        self._check_due = False  # a _CHECK event is on the clock
        self._tick_at = math.inf
        self._progress_at = 0.0  # when a unit was last verified
        self._outstanding = 0  # units of live GEMMs not yet verified
        self._recovering: dict[int, tuple[float, set[int]]] = {}  # crashed device -> (when, units lost)
        self._arrived: set[tuple[int, int]] = set()  # (unit, device): its result reached the PS
        self._injected: int | None = None
        self.injected_recovery: float | None = None
        self.recoveries: list[float] = []
        self.kinds: Counter = Counter()
        self._stats = StepStats()
        self._ops: dict[int, _Op] = {}  # issued ops not done yet
        self._next_token = 1
        self._chains: list[Iterator[Op]] = []
        self._running = 0  # chains with ops left
        self._deferred = 0  # deferred GEMMs not done yet
        self._readers: Counter = Counter()  # tensor namespace -> GEMMs that will still read it
        self._gemms_live = 0
        self._gemms_since = 0.0
        self._fail_after: int | None = None  # GEMMs to submit before the crash of ``fail_share``
        self.events = 0

    # ------------------------------------------------------------------ clock

    def _at(self, when: float, kind: int, *args: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, kind, self._seq, args))

    # ------------------------------------------------------------------ devices

    def _join(self, cls: DeviceClass, veteran: bool) -> None:
        p = cls.profile
        rate = p.flops_per_s(self.cfg.dtype)
        if rate <= 0:
            return  # it cannot multiply in the dtype: `cleave join` would not be offered work it fails
        trust = self.cfg.trust
        standing = Standing(trust.probation_tiles if veteran else 0)
        # Its claim (its class's rate) sets its first deadlines, as Core takes a hello's.
        d = _Device(self._next_device, cls.name, p, rate, self.cfg.slots, standing, Pace.unproven(rate / 1e9), self.now)
        self._next_device += 1
        d.down_free = d.cpu_free = d.up_free = self.now
        self.devices[d.id] = d
        # Seated with its class's links: a running coordinator has measured its veterans' (the
        # live one starts a newcomer from the link fit's priors until its first result).
        self.conduct.seat(d.id, d.standing, d.pace, d.asked, down_rate=p.down, up_rate=p.up)
        if rate > 0:
            self._profiles[d.id] = p
        self._fleet_version += 1
        if self.cfg.churn and math.isfinite(p.session):
            self._at(self.now + self.rng.expovariate(1.0 / p.session), _LEAVE, d.id, d.epoch, cls)

    def _remove(self, d: _Device, *, graceful: bool) -> None:
        """The coordinator sees the device gone: its leases end, its blocks are forgotten."""
        if d.id not in self.devices:
            return
        del self.devices[d.id]
        self._profiles.pop(d.id, None)
        self._fleet_version += 1
        held = self.sched.leave(d.id)
        for uid in held:
            self._leased.pop((uid, d.id), None)
        if not graceful:
            self._stats.lost += len(held)
        for key in {key[0] for key in d.blocks}:
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(d.id)
        d.alive = False
        d.left = min(d.left, self.now)
        d.epoch += 1
        self.gone.append(d)

    # ------------------------------------------------------------------ GEMMs

    def _key(self, op: Operand, gemm: int, which: str, r0: int, r1: int, c0: int, c1: int) -> tuple:
        """A block's key as the live coordinator names it (coordinator/engine/blocks.py): by the memory
        it comes from when it is whole stored rows (as it lies, or transposed back), else a key
        of this GEMM only (a strided slice is copied)."""
        if op.transposed:
            r0, r1, c0, c1 = c0, c1, r0, r1
        if c0 == 0 and c1 == op.width:
            return (op.tensor, r0, r1)
        return (("G", gemm), which, r0, r1, c0, c1)

    def _submit(self, call: GemmCall, token: int) -> int:
        """Plan and queue one GEMM of op ``token``; returns its id."""
        cfg = self.cfg
        live = self.planner.plan(
            call.m, call.n, call.k, call.kind, cfg.dtype, self._profiles, self._fleet_version, now=self.now
        )
        stats = self._stats
        if live.plan is not None and live.seconds is not None:
            stats.predicted += live.seconds
        label = live.label
        self.kinds[label] += 1
        gid = self._next_gemm
        self._next_gemm += 1
        self._in_flight(+1)
        self._fail_soon()  # a crash it makes due comes as an event, after this GEMM is queued
        if live.tiles is None:  # the PS multiplies it
            stats.local_gemms += 1
            seconds = local_seconds(call.m, call.n, call.k, cfg.dtype, cfg.ps)
            self.gemms[gid] = _Gemm(gid, call, 1, 0, token)
            self._cpu(seconds, "local_gemms", gid)
            return gid
        stats.remote_gemms += 1
        plan = live.tiles
        kc = plan.k_cuts
        s = self.itemsize
        tiles = plan.tiles
        work = batches(tiles, live.owners) if cfg.batched else [[t] for t in tiles]
        gemm = _Gemm(gid, call, len(work), s * call.m * call.n, token)
        self.gemms[gid] = gemm
        specs = []
        for batch in work:
            blocks: dict[tuple, int] = {}
            products = []
            flops = up = 0
            for t in batch:
                for q in range(t.p, t.p + t.pieces):
                    k0, k1 = kc[q], kc[q + 1]
                    blocks[self._key(call.a, gid, "a", t.r0, t.r1, k0, k1)] = s * (t.r1 - t.r0) * (k1 - k0)
                    blocks[self._key(call.b, gid, "b", k0, k1, t.c0, t.c1)] = s * (k1 - k0) * (t.c1 - t.c0)
                rows, cols, depth = t.r1 - t.r0, t.c1 - t.c0, t.k1 - t.k0
                products.append(((gid, t.r0, t.r1, t.k0, t.k1), (gid, t.k0, t.k1, t.c0, t.c1), rows, cols, depth))
                flops += t.flops
                up += s * rows * cols
            named = tuple((key, _name(key), size) for key, size in blocks.items())
            uid = self._next_unit
            self._next_unit += 1
            unit = _Unit(gemm, named, flops, up, tuple(products))
            self.units[uid] = unit
            if cfg.band_checks:
                for product in products:
                    key = _band_key(product)
                    band = self._bands.get(key)
                    if band is None:
                        band = self._bands[key] = _Band(key, gid, 0)
                    band.expected += 1
            gemm.up_bytes += unit.up
            owner = live.owners.get(batch[0].index)
            down = sum(size for _, _, size in named)
            specs.append(UnitSpec(uid, gid, named[0][1], named[1][1], flops, owner, down, up))
        self._outstanding += len(specs)
        # Core.submit: ahead of deferred GEMMs' queued units, which only the optimizer waits for.
        front = not call.deferred and any(g.call.deferred for g in self.gemms.values() if g is not gemm)
        self.sched.add_gemm(gid, specs, front=front)
        return gid

    def _fail_soon(self) -> None:
        """A GEMM was submitted: once ``fail_share`` of the step's are, the injected crash is due."""
        if self._fail_after is not None:
            self._fail_after -= 1
            if self._fail_after <= 0:
                self._fail_after = None
                self._at(self.now, _FAIL)

    def _gemm_done(self, gemm: _Gemm) -> None:
        """Every unit verified: the PS writes the output and adds partials (memory bound)."""
        ps = self.cfg.ps
        partial = max(0, gemm.up_bytes - gemm.out_bytes)
        self.sched.drop_gemm(gemm.id)
        self._cpu((gemm.out_bytes + 2 * partial) / ps.memory_bw, "assembly", gemm.id)

    def _cpu(self, seconds: float, what: str, gemm: int | None = None, token: int | None = None) -> None:
        start = max(self.now, self.cpu_free)
        self.cpu_free = start + seconds
        self._stats.ps_cpu[what] += seconds
        self._at(self.cpu_free, _CPU_DONE, gemm, token)

    def _loop(self, seconds: float) -> tuple[float, float]:
        """A job on the event loop free first (FIFO each): when it starts and when it is done."""
        i = min(range(len(self._loops)), key=self._loops.__getitem__)
        start = max(self.now, self._loops[i])
        self._loops[i] = start + seconds
        self._stats.loop_s += seconds
        return start, start + seconds

    def _in_flight(self, change: int) -> None:
        """GEMMs submitted and not yet assembled: their time-weighted count over the step."""
        st = self._stats
        st.gemm_seconds_in_flight += self._gemms_live * (self.now - self._gemms_since)
        self._gemms_since = self.now
        self._gemms_live += change
        st.most_gemms_in_flight = max(st.most_gemms_in_flight, self._gemms_live)

    def _forget(self, namespaces: Iterable[tuple]) -> None:
        """Devices drop the blocks of tensors no GEMM will read again."""
        for ns in namespaces:
            for device in self._holders.pop(ns, ()):
                d = self.devices.get(device)
                if d is None:
                    continue
                gone = [key for key in d.blocks if key[0] == ns]
                d.blocks.difference_update(gone)
                self.sched.drops_blocks(device, [_name(k) for k in gone])

    # ------------------------------------------------------------------ decisions

    def _dispatch(self) -> None:
        """The live coordinator's dispatch (engine/dispatch.py: late leases, leases, copies),
        decided on its event loop, which the verifier's thread and the trainer's do not hold up;
        then the next tick is put on the clock."""
        now, sched = self.now, self.sched
        self.dispatch(now)
        nxt = sched.next_deadline()
        want = math.inf if nxt is None else max(nxt, now)
        if self._outstanding:  # the live server ticks: copies, and devices set aside look again
            want = min(want, now + TICK)
        if want < self._tick_at or self._tick_at <= now:
            self._tick_at = want
            if math.isfinite(want):
                self._at(want, _TICK)

    def _lease(self, d: _Device, uid: int, copy: str | None) -> None:
        """Send the unit: its blocks the device lacks go through the PS's egress and the
        device's downlink (FIFO each); it is computed when it has arrived and the device is free.
        Behind a relay, only the blocks the relay lacks leave the PS (to the relay), and the
        relay's egress then carries all of them to the device (store and forward per unit)."""
        unit = self.units[uid]
        stats = self._stats
        stats.units += 1
        if copy is not None:
            stats.copies += 1
        nbytes = 0
        lacked = []
        for key, name, size in unit.blocks:
            if key not in d.blocks:
                d.blocks.add(key)
                self.sched.holds_block(d.id, name)
                self._holders.setdefault(key[0], set()).add(d.id)
                nbytes += size
                lacked.append((key, size))
        p = d.profile
        ps = self.cfg.ps
        from_ps = nbytes
        relay = self.relays[d.id % len(self.relays)] if self.relays and nbytes else None
        if relay is not None:
            from_ps = sum(size for key, size in lacked if not relay.take(key, size, ps.relay_memory))
        # The loop frames the work message (its bytes from the PS) and sends it: the egress may
        # carry it as it is sent, but it has left only once the loop is done with it.
        framing, framed = self._loop(ps.loop.seconds(1, len(unit.products), from_ps))
        # The live loop decides a lease when it gets to it and frames it at once: the lease
        # counts from when its frame goes on the wire, not from this instant (Scheduler.on_wire).
        self.sched.on_wire(uid, d.id, framed)
        egress_done = max(framed, max(framing, self.egress_free) + from_ps / ps.egress)
        self.egress_free = egress_done
        if relay is not None:  # the relay sends once it has the blocks it lacked
            egress_done = max(egress_done if from_ps else framed, relay.egress_free) + nbytes / ps.relay_egress
            relay.egress_free = egress_done
            stats.relay_bytes += nbytes
        start = max(framed, d.down_free)
        end = max(start + nbytes / p.down, egress_done)
        d.down_s += nbytes / p.down
        d.down_free = end
        d.bytes_down += nbytes
        stats.egress_bytes += from_ps
        self._leased[(uid, d.id)] = d.epoch
        if not d.alive and d.id in self._recovering:  # leased to a departed device nobody noticed yet
            self._recovering[d.id][1].add(uid)
        self._at(end + p.rtt / 2, _ARRIVE, uid, d.id, d.epoch)

    # ------------------------------------------------------------------ events

    def _arrive(self, uid: int, device: int, epoch: int) -> None:
        d = self.devices.get(device)
        if d is None or d.epoch != epoch or not d.alive or self._leased.get((uid, device)) != epoch:
            return  # gone, or the lease was cancelled before the work was computed
        unit = self.units[uid]
        start = max(self.now, d.cpu_free)
        seconds = unit.flops / d.rate + d.profile.overhead
        if self.cfg.host_cpu:  # the devices' shared process: this unit's turn in it
            start = max(start, self.host_free)
            seconds += self.cfg.host_cpu
            self.host_free = start + seconds
        d.cpu_free = start + seconds
        d.compute_s += seconds
        d.flop_s += unit.flops / d.rate
        self._at(d.cpu_free, _UPLOAD, uid, device, epoch)

    def _upload(self, uid: int, device: int, epoch: int) -> None:
        d = self.devices.get(device)
        if d is None or d.epoch != epoch or not d.alive or self._leased.get((uid, device)) != epoch:
            return
        unit = self.units[uid]
        now, p = self.now, d.profile
        ingress_done = max(now, self.ingress_free) + unit.up / self.cfg.ps.ingress
        self.ingress_free = ingress_done
        start = max(now, d.up_free)
        end = max(start + unit.up / p.up, ingress_done)
        d.up_free = end
        d.up_s += unit.up / p.up
        d.bytes_up += unit.up
        self._stats.ingress_bytes += unit.up
        self._at(end + p.rtt / 2, _RESULT, uid, device, epoch)

    def _result(self, uid: int, device: int, epoch: int) -> None:
        """The result reached the PS: the event loop reads it (FIFO), then takes it."""
        d = self.devices.get(device)
        unit = self.units.get(uid)
        if d is None or d.epoch != epoch or unit is None or self._leased.get((uid, device)) != epoch:
            return  # the device was dropped, or another copy won (its result is ignored unread)
        self._arrived.add((uid, device))
        _, read = self._loop(self.cfg.ps.loop.seconds(1, len(unit.products), 0.0, unit.up))
        # Waiting for the loop is not the device's lateness: the lease's clock stops meanwhile.
        self.sched.result_in(uid, device, self.now, read)
        self._at(read, _TAKE, uid, device, epoch, self.now)

    def _take(self, uid: int, device: int, epoch: int, arrived: float) -> None:
        """Core.receive once the loop has read the result: a trusted device's result is taken
        for its bands (settled now, checked with the band), any other waits for the verifier."""
        d = self.devices.get(device)
        unit = self.units.get(uid)
        if d is None or d.epoch != epoch or unit is None or self._leased.get((uid, device)) != epoch:
            return
        alone = (
            not self.cfg.band_checks
            or d.standing.on_probation(self.cfg.trust)
            # As Core: the slots the scheduler grants it now, not those its client asked for.
            or self._unchecked[device] >= UNCHECKED_PER_SLOT * max(1, self.sched.seats[device].slots)
        )
        if alone:
            self._checks.append((uid, device, epoch, arrived))
            self._verify_soon()
            return
        if self._settle(uid, device, epoch, arrived) is None:
            return
        self._unchecked[device] += 1
        for product in unit.products:
            band = self._bands[_band_key(product)]
            band.expected -= 1
            band.products.append(product)
            if not band.units or band.units[-1][1] is not unit:
                band.units.append((uid, unit, device))
                unit.waiting += 1
            if band.expected == 0:
                self._band_due(band)
        self._dispatch()

    def _band_due(self, band: _Band) -> None:
        """Every product of the band is in (or was checked alone): its check is due."""
        self._bands.pop(band.key, None)
        if band.products:
            self._bands_due.append(band)
            self._verify_soon()

    def _verify_soon(self) -> None:
        if not self._check_due:
            self._check_due = True
            self._at(max(self.now, min(self._verifiers)), _CHECK)

    def _check(self) -> None:
        """Each free verifier takes the next job: a band whose results are all in, or the
        results waiting to be checked alone, at most ``CHECK_BATCH``, as one batch
        (``freivalds_batch``: while it is busy results queue up, and the more a batch shares),
        bands and lone results in turn as ``Core``'s verifier takes them."""
        self._check_due = False
        ps = self.cfg.ps
        while self._checks or self._bands_due:
            i = min(range(len(self._verifiers)), key=self._verifiers.__getitem__)
            if self._verifiers[i] > self.now:
                self._verify_soon()
                return
            self._band_turn = not self._band_turn
            if self._bands_due and (self._band_turn or not self._checks):
                band = self._bands_due.pop(0)
                known = self._b_known.setdefault(band.gemm, set())
                seconds = batch_check_seconds(band.products, ps, known) + len(band.units) * ps.unit_overhead
                known.update(p[1] for p in band.products)
                self._verifiers[i] = self.now + seconds
                self._stats.ps_cpu["verify"] += seconds
                self._stats.bands += 1
                self._stats.checked += len(band.units)
                self._at(self._verifiers[i], _BAND, band)
                continue
            waiting, self._checks = self._checks[:CHECK_BATCH], self._checks[CHECK_BATCH:]
            products = [p for uid, *_ in waiting if uid in self.units for p in self.units[uid].products]
            seconds = batch_check_seconds(products, ps) + len(waiting) * ps.unit_overhead
            self._verifiers[i] = self.now + seconds
            self._stats.ps_cpu["verify"] += seconds
            self._stats.checks += 1
            self._stats.checked += len(waiting)
            self._stats.alone += len(waiting)
            for uid, device, epoch, arrived in waiting:
                self._at(self._verifiers[i], _HANDLE, uid, device, epoch, arrived)

    def _band_checked(self, band: _Band) -> None:
        """A band passed (results are honest here): its units are verified once every band
        they were taken into is."""
        for uid, unit, device in band.units:
            unit.waiting -= 1
            if unit.waiting == 0:
                self._unchecked[device] -= 1
                self._verified(uid, unit)
        self._dispatch()

    def _handle(self, uid: int, device: int, epoch: int, arrived: float) -> None:
        """Checks.settle for a result checked alone, once the verifier got to it: the first
        verified copy wins."""
        unit = self._settle(uid, device, epoch, arrived)
        if unit is None:
            return
        if self.cfg.band_checks:  # its products leave their bands (which may now be due)
            for product in unit.products:
                band = self._bands.get(_band_key(product))
                if band is not None:
                    band.expected -= 1
                    if band.expected == 0:
                        self._band_due(band)
        self._verified(uid, unit)
        self._dispatch()

    def _settle(self, uid: int, device: int, epoch: int, arrived: float) -> _Unit | None:
        """The live rules for a result that wins (checked, or taken for its band): its lease
        ends, the other copies lose, the devices' standing and pace move, stallers are cut."""
        d = self.devices.get(device)
        if d is None or d.epoch != epoch or self._leased.pop((uid, device), None) != epoch:
            return None  # a copy that lost the race, or a lease taken back: ignored
        hold = self.sched.hold(uid, device)
        if hold is None:
            return None
        leased_at = hold.leased_at
        losers = self.sched.done(uid, device)
        raced = []
        for loser in losers:  # the other copies lost the race (their results are never checked here)
            self._leased.pop((uid, loser), None)
            self._arrived.discard((uid, loser))
            other = self.devices.get(loser)
            if other is not None:
                raced.append((other, False))
        unit = self.units.pop(uid)
        d.kept.add(1.0, arrived)
        if d.kept.value < 1.0:  # it lost leases before: its reliability recovers in the plans
            self._replan(d)
        # Core's rules: the winner's standing, pace and slots, the losers', and who stalls.
        stallers = self.conduct.settled(d, arrived, leased_at, unit.flops, raced)
        self._arrived.discard((uid, device))
        for other in stallers:
            if other.id in self.devices:
                self.dispatch.cut(other, "tiles in a row went to other devices", self.now)
        return unit

    def _replan(self, d: _Device) -> None:
        """The planner sees ``d`` at its reliability now; its classes are rebuilt only when that
        moves ``d`` on the planner's grid (as the live ``Fleet.plan`` does)."""
        if d.id not in self._profiles:
            return
        seen = dataclasses.replace(d.profile, reliability=min(1.0, max(0.0, d.kept.value)))
        if fleet_key(seen, self.cfg.dtype) != fleet_key(self._profiles[d.id], self.cfg.dtype):
            self._profiles[d.id] = seen
            self._fleet_version += 1

    def _verified(self, uid: int, unit: _Unit) -> None:
        """A unit's result is verified: its GEMM is a unit nearer assembly."""
        self._outstanding -= 1
        self._progress_at = self.now
        self._delivered(uid)
        gemm = unit.gemm
        gemm.remaining -= 1
        if gemm.remaining == 0:
            self._b_known.pop(gemm.id, None)
            self._gemm_done(gemm)

    def _delivered(self, uid: int) -> None:
        """A unit was verified: crashes waiting on it may be over. O(crashes being recovered)."""
        done = []
        for crashed, (_since, held) in self._recovering.items():
            held.discard(uid)
            if not held:  # everything it lost is verified elsewhere
                done.append(crashed)
        for crashed in done:
            since, _ = self._recovering.pop(crashed)
            self.recoveries.append(self.now - since)
            if crashed == self._injected:
                self.injected_recovery = self.now - since

    def _crash_or_leave(self, device: int, epoch: int, cls: DeviceClass, crash: bool | None = None) -> None:
        d = self.devices.get(device)
        if d is None or d.epoch != epoch or not d.alive:
            return  # gone already (a crash not yet noticed cannot leave again)
        if crash is None:
            crash = self.rng.random() < self.cfg.crash_share
        self._stats.leaves += 1
        if crash:
            d.alive = False  # it stops answering; the coordinator notices after the heartbeat timeout
            d.left = self.now
            # Lost: what it holds whose result has not reached the PS, and whatever it is leased
            # until it is noticed (``_lease``).
            held = {uid for (uid, dev), _ in self._leased.items() if dev == device and (uid, dev) not in self._arrived}
            if held:
                self._recovering[device] = (self.now, held)
            self._at(self.now + self.cfg.faults.heartbeat_timeout, _DETECT, device, epoch)
        else:
            self._remove(d, graceful=True)
        if self.cfg.churn:
            self._at(self.now + self.rng.expovariate(1.0 / self.cfg.rejoin_seconds), _JOIN, cls)

    def _fail_busiest(self) -> None:
        """The injected failure: the device with the most units whose results have not reached
        the PS crashes now."""
        counts: Counter = Counter(
            dev
            for (uid, dev) in self._leased
            if (uid, dev) not in self._arrived and self.devices.get(dev) is not None and self.devices[dev].alive
        )
        if counts:
            device = max(counts, key=lambda d: (counts[d], -d))
            d = self.devices[device]
            self._injected = device
            self._crash_or_leave(device, d.epoch, DeviceClass(d.cls, 1, d.profile), crash=True)
        elif self.cfg.fail_share is not None:  # nobody holds work now (GEMMs kept home): at the next GEMM
            self._fail_after = 1

    # ------------------------------------------------------------------ running

    def run(self, progress: Callable[[int, int], None] | None = None) -> SimResult:
        cfg = self.cfg
        counts = [(cls, cfg.tier.share(cls.count)) for cls in cfg.fleet]  # the (slowest) rank's devices
        if (
            not any(cls.profile.flops_per_s(cfg.dtype) > 0 and n for cls, n in counts)
            and cfg.ps.flops_per_s(cfg.dtype) <= 0
        ):
            raise SimulationError(f"neither the fleet nor the parameter server can compute in {cfg.dtype}")
        for cls, n in counts:
            for _ in range(n):
                self._join(cls, cfg.veterans)
        start_devices = len(self.devices)
        steps = []
        for step in range(cfg.steps):
            if progress is not None:
                progress(step, cfg.steps)
            self._stats = StepStats()
            began = self.now
            before = {
                d.id: (d.compute_s, d.down_s, d.up_s, d.bytes_down, d.bytes_up, d.flop_s) for d in self.devices.values()
            }
            gone_before = len(self.gone)
            if cfg.fail_at is not None and step == cfg.steps - 1:
                self._at(began + cfg.fail_at, _FAIL)
            if step == 0 and not cfg.micro_batches:  # auto: the cost model chooses from the fleet that joined
                self.choice = choose_micro_batches(
                    cfg.model,
                    cfg.rank_batch,
                    cfg.seq,
                    cfg.dtype,
                    cfg.ps,
                    cfg.planner,
                    cfg.policy,
                    dict(self._profiles),
                    tier=cfg.tier,
                )
                self.micro_batches = self.choice.micro_batches
                self._shipping = self._shipping.with_lanes(cfg.lanes or self.micro_batches)
            chains, tail = program(
                cfg.model, cfg.rank_batch, cfg.seq, cfg.dtype, cfg.ps, step, self.micro_batches, cfg.tier
            )
            fresh = LivePlanner(cfg.planner, cfg.ps, cfg.policy, lanes=self._shipping.lanes)
            self._stats.forecast = predict(chains, tail, fresh, cfg.dtype, dict(self._profiles))
            self._stats.home = home_seconds(chains, tail, cfg.ps, cfg.dtype)
            # Shipping forecast slower than the PS alone: the cost model keeps this step home.
            self._stats.kept_home = self._stats.home < self._stats.forecast and cfg.planner is Planner.COST
            if self._stats.kept_home:
                self._stats.forecast = self._stats.home
            self.planner = self._home if self._stats.kept_home else self._shipping
            self._count(chains)
            if cfg.fail_share is not None and step == cfg.steps - 1:
                self._fail_after = max(1, math.ceil(cfg.fail_share * self._calls))
            self._run_chains(chains)
            if tail:
                self._run_chains([tail])
            self._in_flight(0)
            self._stats.seconds = self.now - began
            self._stats.ps_busy = self._ps_busy(self._stats)
            self._device_figures(before, list(self.devices.values()) + self.gone[gone_before:], began)
            steps.append(self._stats)
        everyone = list(self.devices.values()) + self.gone
        return SimResult(
            steps,
            start_devices,
            [d.compute_s for d in everyone],
            [d.down_s for d in everyone],
            [d.up_s for d in everyone],
            [d.bytes_down for d in everyone],
            [d.bytes_up for d in everyone],
            self.recoveries,
            self.kinds,
            self.events,
            self.injected_recovery,
            self.micro_batches,
            self.choice,
        )

    def run_ops(self, chains: list[list[Op]], planner: LivePlanner | None = None) -> StepStats:
        """Run a program of one's own (``chains`` of ops side by side, as a step's micro-batches)
        on the fleet, as one step, with ``planner`` cutting its GEMMs (the config's otherwise):
        what bench/bench_sim_live.py drives with bench_tax's GEMMs. The fleet joins on the first
        call; later calls go on from where the last one ended."""
        cfg = self.cfg
        if not self.devices and not self.gone:
            for cls in cfg.fleet:
                for _ in range(cls.count):
                    self._join(cls, cfg.veterans)
        if planner is not None:
            self.planner = planner
        self._stats = StepStats()
        began = self.now
        self._count(chains)
        self._run_chains(chains)
        self._in_flight(0)
        self._stats.seconds = self.now - began
        self._stats.ps_busy = self._ps_busy(self._stats)
        return self._stats

    def _ps_busy(self, st: StepStats) -> dict[str, float]:
        """Seconds each of the PS's resources was busy in the step: its event loop and its
        verifier (per worker, as they share the work), its trainer thread (assembly, GEMMs kept
        home, attention, AdamW, collectives), its egress and its ingress."""
        ps = self.cfg.ps
        return {
            "loop": st.loop_s / ps.workers,
            "verifier": st.ps_cpu["verify"] / ps.workers,
            "trainer": sum(v for k, v in st.ps_cpu.items() if k != "verify"),
            "egress": st.egress_bytes / ps.egress,
            "ingress": st.ingress_bytes / ps.ingress,
        }

    def _device_figures(self, before: dict[int, tuple], present: list[_Device], began: float) -> None:
        """What each device did in the step just ended (O(devices), once per step)."""
        st = self._stats
        rows = []
        busy: Counter = Counter()
        there: Counter = Counter()
        asleep: Counter = Counter()
        after = self.cfg.standby.after
        for d in present:
            c0, d0, u0, bd0, bu0, f0 = before.get(d.id, (0.0,) * 6)
            rows.append(
                (d.compute_s - c0, d.down_s - d0, d.up_s - u0, d.bytes_down - bd0, d.bytes_up - bu0, d.flop_s - f0)
            )
            busy[d.cls] += d.compute_s - c0
            end, start = min(self.now, d.left), max(began, d.joined)
            there[d.cls] += max(0.0, end - start)
            if after > 0:  # 0: the coordinator never sends a device to standby
                idle_from = start if d.compute_s <= c0 else max(start, d.up_free)
                asleep[d.cls] += max(0.0, end - idle_from - after)
        st.class_busy_s = dict(sorted(busy.items()))
        st.class_present_s = dict(sorted(there.items()))
        st.class_standby_s = dict(sorted(asleep.items()))
        worked = [r for r in rows if r[0] > 0]
        st.devices_used = len(worked)
        if rows and st.seconds > 0:  # every device present, idle ones too: the fleet's view
            # Multiplying, not the per-unit overhead: the share its ceiling and bound price.
            shares = sorted(r[5] / st.seconds for r in rows)
            st.fleet_utilisation = sum(shares) / len(shares)
            st.utilisation_quantiles = {q: shares[min(len(shares) - 1, int(q * len(shares)))] for q in QUANTILES}
            by_class: dict[str, list[float]] = {}
            for d, r in zip(present, rows, strict=True):
                by_class.setdefault(d.cls, []).append(r[5] / st.seconds)
            st.class_utilisation = {name: sum(v) / len(v) for name, v in sorted(by_class.items())}
            ceiling: dict[str, float] = {}  # a class's devices share its profile
            for d in present:
                if d.cls not in ceiling:
                    ceiling[d.cls] = compute_share_ceiling(d.profile, self.cfg.dtype, self._shapes, self.itemsize)
            st.utilisation_ceiling = sum(ceiling[d.cls] for d in present) / len(present)
            rates = [(d.rate, ceiling[d.cls]) for d in present]
            st.utilisation_bound = utilisation_bound(rates, self._work, st.seconds)
            st.utilisation_wait_bound = utilisation_bound(rates, self._waiting, st.seconds)
        if rows:
            st.device_compute = max(r[0] for r in rows)
            st.device_down = max(r[1] for r in rows)
            st.device_up = max(r[2] for r in rows)
            st.bytes_down_max = max(r[3] for r in rows)
            st.bytes_up_max = max(r[4] for r in rows)
        if worked:
            st.bytes_down_mean = sum(r[3] for r in worked) / len(worked)
            st.bytes_up_mean = sum(r[4] for r in worked) / len(worked)

    def _count(self, chains: list[list[Op]]) -> None:
        """The step's GEMMs, for its report: their shapes, their FLOP, and the deferred part."""
        calls = [c for chain in chains for op in chain if not isinstance(op, PsWork) for c in op]
        self._calls = len(calls)
        self._shapes = {(c.m, c.n, c.k) for c in calls}
        self._work = sum(2.0 * c.m * c.n * c.k for c in calls)
        self._waiting = sum(2.0 * c.m * c.n * c.k for c in calls if c.deferred)

    def _run_chains(self, chains: list[list[Op]]) -> None:
        """Run chains of ops side by side until every op and every deferred GEMM is done: each
        chain issues its next op when its current one is done (a micro-batch through the
        model), and all of them share the fleet, the PS's CPU and its link."""
        self._readers = Counter(
            t
            for chain in chains
            for op in chain
            if not isinstance(op, PsWork)
            for c in op
            for t in (c.a.tensor, c.b.tensor)
        )
        self._chains = [iter(chain) for chain in chains]
        self._running = len(chains)
        self._deferred = 0
        self._ops.clear()
        began = self.now
        total, first = sum(len(chain) for chain in chains), self._next_token
        for index in range(len(chains)):
            self._next_op(index)
        while self._running or self._deferred:
            if self.tell is not None and self.events % TELL_EVERY == 0:
                done = self._next_token - first - len(self._ops)  # issued, less those not done
                self.tell(f"{done:,} of {total:,} ops, {self.now:,.0f} simulated s")
            if not self._events:
                raise SimulationError(
                    "the simulation stalled: work is queued that no device can take (every device left "
                    "or is barred) and nothing is left to happen"
                )
            if self.now - max(began, self._progress_at) > self.cfg.give_up:
                departed = sum(1 for d in self.devices.values() if not d.alive)
                barred = sum(1 for u in self.sched.units.values() if u.queued and len(u.barred) >= len(self.devices))
                why = (
                    f"{barred} queued units are barred for every device (each let its lease pass twice its deadline)"
                    if barred
                    else f"{departed} of {len(self.devices)} seated devices have departed unnoticed "
                    f"(sessions shorter than --heartbeat-timeout)"
                    if departed
                    else "no device finished its work"
                )
                what = ", ".join(sorted({_what(op.op) for op in self._ops.values()})) or "the deferred GEMMs"
                raise SimulationError(
                    f"the simulation stalled: no unit of {what} verified in {self.cfg.give_up:,.0f} simulated "
                    f"seconds, {self._outstanding} outstanding: {why}"
                )
            self._step_event()

    def _next_op(self, chain: int) -> None:
        """Issue chain ``chain``'s next op, or count the chain done."""
        op = next(self._chains[chain], None)
        if op is None:
            self._running -= 1
            return
        token = self._next_token
        self._next_token += 1
        state = _Op(op, chain, self.now, self._stats.predicted)
        self._ops[token] = state
        if isinstance(op, PsWork):
            state.pending = 1
            self._stats.predicted += op.seconds
            self._cpu(op.seconds, op.what, None, token)
            return
        state.pending = sum(1 for call in op if not call.deferred)
        self._deferred += len(op) - state.pending
        for call in op:  # Core.submit dispatches after each GEMM
            state.gemms.append(self._submit(call, token))
            self._dispatch()

    def _gemm_finished(self, gemm: _Gemm) -> None:
        """A GEMM's output is assembled (or the PS multiplied it). A deferred one releases what it
        read at once; the others with their op, as the live coordinator drops sources."""
        gemm.remaining = -1
        self._in_flight(-1)
        if gemm.call.deferred:  # its op may be done long ago
            self._deferred -= 1
            self._release([gemm])
            return
        state = self._ops[gemm.op]
        state.pending -= 1
        if state.pending == 0:
            self._op_finished(gemm.op)

    def _op_finished(self, token: int) -> None:
        state = self._ops.pop(token)
        if not isinstance(state.op, PsWork):
            self._release([self.gemms[g] for g in state.gemms if g in self.gemms and not self.gemms[g].call.deferred])
        self._stats.ops.append((_what(state.op), self._stats.predicted - state.predicted, self.now - state.began))
        self._next_op(state.chain)

    def _release(self, gemms: list[_Gemm]) -> None:
        """Finished GEMMs' copied blocks are forgotten, and their inputs once nothing left reads
        them, or (Intake.complete) once a dW read them: q's, k's and v's dW each send X again."""
        spaces: list[tuple] = []
        for gemm in gemms:
            call = gemm.call
            del self.gemms[gemm.id]
            spaces.append(("G", gemm.id))
            for t in (call.a.tensor, call.b.tensor):
                self._readers[t] -= 1
            dw = call.kind is GemmKind.GRAD_WEIGHT
            spaces += [t for t in {call.a.tensor, call.b.tensor} if self._readers[t] <= 0 or dw]
        self._forget(spaces)

    def _step_event(self) -> None:
        when, kind, _, args = heapq.heappop(self._events)
        self.now = max(self.now, when)
        self.events += 1
        if kind == _ARRIVE:  # device-side events change nothing the scheduler sees
            self._arrive(*args)
            return
        if kind == _UPLOAD:
            self._upload(*args)
            return
        if kind == _RESULT:
            self._result(*args)
            return
        if kind == _CHECK:
            self._check()
            return
        if kind == _HANDLE:
            self._handle(*args)  # dispatches itself, as Core.handle does
            return
        if kind == _TAKE:
            self._take(*args)  # dispatches itself
            return
        if kind == _BAND:
            self._band_checked(*args)
            return
        if kind == _CPU_DONE:
            gid, token = args
            if gid is None:
                self._ops[token].pending = 0  # PS work: the op is done
                self._op_finished(token)
            else:
                gemm = self.gemms.get(gid)
                if gemm is not None and gemm.remaining >= 0 and (gemm.remaining == 0 or gemm.out_bytes == 0):
                    self._gemm_finished(gemm)  # an assembled output, or a local GEMM
        elif kind == _LEAVE:
            self._crash_or_leave(*args)
        elif kind == _DETECT:
            device, epoch = args
            d = self.devices.get(device)
            if d is not None and d.epoch == epoch:
                self._remove(d, graceful=False)
        elif kind == _JOIN:
            (cls,) = args
            self._join(cls, False)
            self._stats.joins += 1
        elif kind == _FAIL:
            self._fail_busiest()
        elif kind == _TICK:
            if when < self._tick_at:
                return  # superseded by an earlier tick that already ran
        self._dispatch()


@dataclass(eq=False)
class _Op:
    """An op issued by a chain, until it is done."""

    op: Op
    chain: int
    began: float
    predicted: float  # the step's prediction when it was issued
    pending: int = 0  # of its GEMMs (not deferred) or its PS work, not done yet
    gemms: list[int] = field(default_factory=list)


def _optimizer(model: ModelShape, dtype: str, ps: PSProfile, params: int | None = None) -> PsWork:
    """AdamW over every parameter on the PS (``step_program``'s last op), or over ``params`` of
    them (a rank's share on a tier)."""
    extra = ITEMSIZE[dtype] if dtype != "fp32" else 0
    return PsWork((model.params if params is None else params) * (ADAMW_BYTES + extra) / ps.optimizer_bw, "optimizer")


def _what(op: Op) -> str:
    return op.what if isinstance(op, PsWork) else "+".join(call.label for call in op)


def _band_key(product: tuple) -> tuple:
    """The row band of a product (its A block's key is ``(gemm, r0, r1, k0, k1)``): its GEMM
    and rows. Grids cut rows evenly, so a row range's tiles cover every column over the whole
    reduction (``form_bands``' test), and row ranges never overlap."""
    gemm, r0, r1 = product[0][:3]
    return (gemm, r0, r1)


def _name(key: tuple) -> str:
    """The scheduler knows blocks by string keys."""
    return repr(key)


# --------------------------------------------------------------------------- recording and replay


class SchedulerLog:
    """A scheduler that records: every call that changes it and every decision it makes, in the
    order they happened. Wrap the live coordinator's scheduler (``core.sched``) or the
    simulator's; ``replay`` drives a fresh ``Scheduler`` with the same calls and checks that it
    makes the same decisions (the simulator's scheduler is the live one, not a model of it)."""

    CALLS = frozenset(
        {
            "join",
            "leave",
            "update",
            "links",
            "holds_block",
            "drops_blocks",
            "add_gemm",
            "drop_gemm",
            "release",
            "done",
            "expire",
            "assign",
            "copies",
            "on_wire",
            "result_in",
        }
    )
    GENERATORS = frozenset({"assign", "copies"})

    def __init__(self, inner: Scheduler) -> None:
        self.inner = inner
        self.entries: list[tuple] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.inner, name)
        if name not in self.CALLS:
            return attr

        def call(*args: object, **kwargs: object) -> object:
            index = len(self.entries)
            self.entries.append(("call", index, name, args, dict(kwargs)))
            result = attr(*args, **kwargs)
            if name in self.GENERATORS:
                return self._yields(index, result)
            self.entries.append(("return", index, None if name == "join" else result))
            return result

        return call

    def _yields(self, index: int, decisions: Iterator[Decision]) -> Iterator[Decision]:
        for decision in decisions:
            self.entries.append(("yield", index, decision))
            yield decision
        self.entries.append(("end", index))  # running it to its end has effects too (devices set aside)


def replay(entries: Iterable[tuple], scheduler: Scheduler) -> int:
    """Drive ``scheduler`` with a recorded log; raises ``AssertionError`` at the first decision
    or result that differs. Returns how many decisions (leases, overdue leases, take-backs) it
    made, each the same as recorded."""
    running: dict[int, Iterator[Decision]] = {}
    decisions = 0
    for entry in entries:
        tag, index = entry[0], entry[1]
        if tag == "call":
            _, _, name, args, kwargs = entry
            result = getattr(scheduler, name)(*args, **kwargs)
            if name in SchedulerLog.GENERATORS:
                running[index] = result
            else:
                running[index] = iter([result])
        elif tag == "yield":
            got = next(running[index], None)
            if got != entry[2]:
                raise AssertionError(f"decision {decisions}: recorded {entry[2]!r}, replayed {got!r}")
            decisions += 1
        elif tag == "end":
            extra = next(running.pop(index), None)
            if extra is not None:
                raise AssertionError(f"call {index}: recorded no more decisions, replayed {extra!r}")
        else:
            got = next(running.pop(index))
            expected = entry[2]
            if expected is not None and got != expected:
                raise AssertionError(f"call {index}: recorded {expected!r}, replayed {got!r}")
            if isinstance(expected, list):
                decisions += sum(1 for d in expected if isinstance(d, (Assign, Overdue, Reclaim)))
    return decisions
