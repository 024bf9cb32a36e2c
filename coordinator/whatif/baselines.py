"""What Cleave is compared with: a DTFM-style edge baseline and a cloud baseline. Pure arithmetic.

No I/O, no clock. ``dtfm_step`` prices one training step of ``model`` on a volunteer fleet the way
DT-FM would run it (Yuan et al., "Decentralized Training of Foundation Models in Heterogeneous
Environments", NeurIPS 2022; repository DS3Lab/DT-FM): devices cut into ``D_PP`` pipeline stages
times ``D_DP`` data-parallel replicas, GPipe micro-batches through each pipeline, then an
all-reduce of every stage's gradients among its replicas. ``cloud_step`` prices the same step on
a few datacenter GPUs at a published model-FLOPs utilisation. docs/simulation.md derives every
formula and gives the source of every constant; the simplifications and the direction in which
each errs are listed there too.

Units: bytes, seconds, FLOP; links are the profiles' one-way rates in bytes/s.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from cleave.coordinator.planning.costmodel import ATTENTION_PASSES, ITEMSIZE, CostModelError, DeviceClass, Profile
from cleave.coordinator.whatif.presets import ModelShape, step_gemms

# --------------------------------------------------------------------------- constants

# Each weight costs 2 FLOP (a multiply-add) per token in each of a Linear's three GEMMs: forward,
# input gradient, weight gradient (coordinator/whatif/presets.py step_gemms: 6 x tokens x weights).
GEMM_FLOP_PER_WEIGHT_TOKEN = 6
# A transformer layer has two norms (before attention, before the MLP); RMSNorm has a weight per
# feature, LayerNorm a weight and a bias (as ModelShape.params counts them).
NORMS_PER_LAYER = 2
# Training-state bytes per parameter with Adam: the weights and their gradients in the training
# dtype, Adam's first and second moments in fp32 (4 + 4), and, when training in a 2-byte dtype,
# an fp32 master copy of the weights (4). Mixed precision: 2 + 2 + 12 = 16 bytes (Rajbhandari et
# al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 3.1:
# "2Psi + 2Psi + 12Psi = 16Psi bytes"); fp32: 4 + 4 + 8 = 16 bytes as well.
ADAM_MOMENTS_BYTES = 8
MASTER_COPY_BYTES = 4
# Activations kept for backward, per layer and per sequence of s tokens, in 16-bit training with
# no recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", eq. 1): s h (34 + 5 a s / h) bytes = 34 s h + 5 a s^2 bytes, h = d_model,
# a = heads. The 34 counts 2-byte tensors and 1-byte dropout masks; we scale the whole by
# itemsize / 2 for fp32 (an approximation: masks stay 1 byte).
ACT_BYTES_PER_TOKEN_HIDDEN = 34
ACT_BYTES_PER_HEAD_SCORE = 5
ACT_REFERENCE_ITEMSIZE = 2
# A message between two volunteers takes about half of each one's round trip to the internet's
# core; we charge only the sender's half (its half of its ``rtt``), which never exceeds the
# pair's one-way delay. DT-FM charges its measured pair delay per message.
ONE_WAY_SHARE_OF_RTT = 0.5
# DT-FM's data-parallel all-reduce (comm/nccl_backend.py all_reduce_opt, used by
# data_parallel/dist_dp_sharded_ps.py) is two all-to-all phases: each device sends every peer
# 1/R of its gradients and sums what it gets (reduce-scatter), then sends its summed 1/R to every
# peer (all-gather): 2 (R - 1) / R of the gradient bytes out and as many in, 2 (R - 1) messages.
# DT-FM's cost model (scheduler/heuristic_evolutionary_solver/scheduler.py,
# compute_data_parallel_cost) charges sum over peers of 2 (delay + bytes / (R bandwidth)).
ALLREDUCE_PHASES = 2

# Cloud GPUs: dense (no structured sparsity) tensor-core peaks, FLOP/s, and memory.
# NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): FP32 19.5 TFLOP/s, TF32 156, BF16 and FP16
# 312 (the datasheet's 312 TF32 and 624 BF16/FP16 are with sparsity); 80 GB HBM2e.
A100_FP32_FLOPS = 19.5e12
A100_TF32_FLOPS = 156e12
A100_BF16_FLOPS = 312e12
A100_FP16_FLOPS = 312e12
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67 TFLOP/s, TF32 494.7 (989 with sparsity),
# BF16 and FP16 989.4 (1,979 with sparsity); 80 GB HBM3.
H100_FP32_FLOPS = 67e12
H100_TF32_FLOPS = 494.7e12
H100_BF16_FLOPS = 989.4e12
H100_FP16_FLOPS = 989.4e12
GPU_MEMORY_80GB = 80 * 2**30  # "80GB": 81,920 MiB as nvidia-smi reports it
# Model-FLOPs utilisation of well-tuned large-scale LLM training in 16-bit: OPT-175B ran at up to
# 147 TFLOP/s per A100-80GB, 47% of 312 (Zhang et al. 2022, "OPT", sec. 2.4); PaLM 540B 46.2% MFU
# (Chowdhery et al. 2022, Table 3, on TPU v4); Megatron-LM 52% on A100 at 1T parameters
# (Narayanan et al. 2021, SC21). We take 0.45.
MFU_HALF = 0.45
# fp32 training runs its matmuls in TF32 on these GPUs (PyTorch: torch.backends.cuda.matmul.
# allow_tf32 = True); we assume the same utilisation of the TF32 peak. Our assumption: we found
# no published MFU for TF32 LLM training at scale.
MFU_FP32_TF32 = 0.45
CLOUD_GPUS_DEFAULT = 8


@dataclass(frozen=True)
class GpuSpec:
    """A cloud GPU: peak FLOP/s per training dtype (fp32 trains in TF32) and its memory."""

    name: str
    peak: Mapping[str, float]
    memory: int
    source: str


GPUS: dict[str, GpuSpec] = {
    "a100-80gb": GpuSpec(
        "a100-80gb",
        {"fp32": A100_TF32_FLOPS, "bf16": A100_BF16_FLOPS, "fp16": A100_FP16_FLOPS},
        GPU_MEMORY_80GB,
        "NVIDIA A100 Tensor Core GPU datasheet (dense; fp32 as TF32)",
    ),
    "h100-80gb": GpuSpec(
        "h100-80gb",
        {"fp32": H100_TF32_FLOPS, "bf16": H100_BF16_FLOPS, "fp16": H100_FP16_FLOPS},
        GPU_MEMORY_80GB,
        "NVIDIA H100 Tensor Core GPU datasheet, SXM5 (dense; fp32 as TF32)",
    ),
}
DEFAULT_MFU: Mapping[str, float] = {"fp32": MFU_FP32_TF32, "bf16": MFU_HALF, "fp16": MFU_HALF}

# --------------------------------------------------------------------------- validation


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CostModelError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check(model: ModelShape, batch: int, seq: int, dtype: str) -> None:
    if not isinstance(model, ModelShape):
        raise CostModelError(f"model must be a ModelShape, got {type(model).__name__}")
    _positive_int("batch", batch)
    _positive_int("seq", seq)
    if seq > model.max_seq_len:
        raise CostModelError(f"seq {seq} exceeds {model.name}'s {model.max_seq_len} positions")
    if dtype not in ITEMSIZE:
        raise CostModelError(f"unknown dtype {dtype!r}; use one of {', '.join(ITEMSIZE)}")


# --------------------------------------------------------------------------- FLOP and bytes


def step_flops(model: ModelShape, batch: int, seq: int) -> float:
    """FLOP of one training step on ``batch`` sequences of ``seq`` tokens: every GEMM of
    ``step_gemms`` (forward, input gradient, weight gradient: ``6 * tokens * linear_params``)
    plus attention's ``softmax(QK^T)V``, forward and backward (``3 * attention_flops``)."""
    gemms = sum(g.flops for g in step_gemms(model, batch, seq))
    return float(gemms) + ATTENTION_PASSES * model.attention_flops(batch, seq)


def bytes_per_param(dtype: str) -> int:
    """Training state per parameter with Adam: weights + gradients in ``dtype``, fp32 moments,
    and an fp32 master copy when ``dtype`` is a 2-byte type (16 either way)."""
    weights = gradients = ITEMSIZE[dtype]
    master = MASTER_COPY_BYTES if weights < MASTER_COPY_BYTES else 0
    return weights + gradients + ADAM_MOMENTS_BYTES + master


def layer_activation_bytes(model: ModelShape, sequences: int, seq: int, dtype: str) -> float:
    """Activations one layer keeps for backward for ``sequences`` sequences (Korthikanti et al.
    2022, eq. 1, scaled from 16-bit to ``dtype``)."""
    per_sequence = (
        ACT_BYTES_PER_TOKEN_HIDDEN * seq * model.d_model + ACT_BYTES_PER_HEAD_SCORE * model.n_heads * seq * seq
    )
    return sequences * per_sequence * ITEMSIZE[dtype] / ACT_REFERENCE_ITEMSIZE


@dataclass(frozen=True)
class _Parts:
    """Parameters and FLOP of the pieces a pipeline stage is made of."""

    layer_params: int  # one transformer layer: its Linears' weights and biases, its two norms
    embedding_params: int  # token embedding and a learned position table (first stage)
    head_params: int  # lm head weight (last stage; its own copy when tied and pipelined)
    final_norm_params: int  # (last stage)
    layer_flops: float  # one layer, one sequence, forward and backward
    head_flops: float  # the lm head, one sequence, forward and backward


def _parts(model: ModelShape, seq: int) -> _Parts:
    d, L = model.d_model, model.n_layers
    layer = 0
    head = 0
    for lin in model.linears():
        if lin.name == "head":
            head = lin.in_features * lin.out_features
            continue
        layer += (lin.in_features * lin.out_features + (lin.out_features if lin.bias else 0)) * lin.count
    norm = d * (2 if model.norm == "layer" else 1)  # weight (and bias)
    layer = layer // L + NORMS_PER_LAYER * norm
    layer_linear = sum(lin.weights for lin in model.linears() if lin.name != "head") // L
    layer_flops = GEMM_FLOP_PER_WEIGHT_TOKEN * seq * layer_linear + ATTENTION_PASSES * model.attention_flops(1, seq) / L
    return _Parts(
        layer_params=layer,
        embedding_params=(model.vocab + model.position_rows) * d,
        head_params=head,
        final_norm_params=norm,
        layer_flops=float(layer_flops),
        head_flops=float(GEMM_FLOP_PER_WEIGHT_TOKEN * seq * head),
    )


# --------------------------------------------------------------------------- DTFM


@dataclass(frozen=True)
class DtfmSeat:
    """One kind of device in the chosen pipeline (a stage role), for pricing its energy: how many
    devices take it, what each computes and sends in the step, and which classes may take it
    without slowing the step (they fit it, and their pace and all-reduce are within the step's)."""

    role: str  # "only" | "first" | "middle" | "last" | "layers" | "head" | "embed"
    devices: int
    flops: float  # per device per step: its micro-batches, forward and backward
    bytes_sent: float  # per device per step: activations (and their gradients) and its all-reduce share
    classes: tuple[str, ...]


@dataclass(frozen=True)
class DtfmResult:
    """One step of DT-FM on a fleet: ``step_s = compute_s + pipeline_comm_s + bubble_s +
    allreduce_s``, or ``step_s`` None and ``why`` when the model cannot be placed."""

    step_s: float | None  # None: the model does not fit the fleet's memory, or no device computes the dtype
    why: str | None  # one line when step_s is None
    stages: int  # D_PP (with the head's own stage, when it has one)
    replicas: int  # D_DP
    devices_used: int  # stages * replicas
    micro_batches: int  # per replica
    compute_s: float  # micro_batches x the compute of the device that sets the pipeline's pace
    pipeline_comm_s: float  # micro_batches x the activation transfer that compute does not hide
    allreduce_s: float  # the slowest stage's gradient all-reduce among its replicas
    bubble_s: float  # rounds x (stages - 1) x the pace: GPipe's fill and drain
    memory_per_device: float  # bytes the busiest device needs (for None: the need that fits nowhere)
    bound: str  # "compute" | "pipeline" | "allreduce"; "infeasible" when step_s is None
    rounds: int = 1  # pipeline flushes per step (gradient accumulation), > 1 only to fit memory
    head_stage: bool = False  # the lm head has a stage of its own (the last)
    embed_stage: bool = False  # the token embedding has a stage of its own (the first)
    seats: tuple[DtfmSeat, ...] = ()  # the roles and who may take them (coordinator/whatif/energy.py)


@dataclass(frozen=True)
class _Role:
    """Stages of one kind: the first (embedding), middle ones, the last (head), or the only one."""

    name: str
    count: int  # devices that take this role: replicas x stages of this kind
    params: int
    flops: float  # per micro-batch, forward and backward
    static: float  # bytes per device besides activations: weights, gradients, Adam state
    activation: float  # bytes of activations per micro-batch in flight
    depth: int  # most micro-batches in flight under 1F1B (stage i of S: S - i)
    sends: int  # activation-sized messages it sends per micro-batch (and receives as many)

    def memory(self, in_flight: int) -> float:
        return self.static + min(in_flight, self.depth) * self.activation


def _replica_counts(batch: int, most: int) -> Iterator[int]:
    """The fewest replicas for each distinct per-replica batch ``ceil(batch / R)``, R <= most:
    more replicas with the same per-replica batch are never faster."""
    r = 1
    while r <= most:
        yield r
        per = -(-batch // r)
        if per == 1:
            return
        r = -(-batch // (per - 1))


def _divisors(n: int) -> list[int]:
    return [s for s in range(1, n + 1) if n % s == 0]


def _splits(model: ModelShape) -> list[tuple[int, bool, bool]]:
    """Every split the search weighs: (stages of layers, the head alone, the embedding alone)."""
    return [(s, h, e) for s in _divisors(model.n_layers) for h in (False, True) for e in (False, True)]


def head_activation_bytes(model: ModelShape, sequences: int, seq: int, dtype: str) -> float:
    """What the lm head keeps for backward for ``sequences`` sequences: its input, the logits and
    their gradient (``d_model + 2 vocab`` values a token, in ``dtype``)."""
    return sequences * seq * (model.d_model + 2 * model.vocab) * ITEMSIZE[dtype]


def _roles(
    model: ModelShape,
    parts: _Parts,
    stages: int,
    replicas: int,
    sequences: int,
    seq: int,
    dtype: str,
    head_stage: bool = False,
    embed_stage: bool = False,
) -> list[_Role]:
    """The kinds of stage for ``stages`` even stages of layers of ``sequences``-sequence
    micro-batches. With ``embed_stage`` the token embedding (and a learned position table) has a
    stage of its own before them, with ``head_stage`` the lm head (and the final norm) one after
    them, as DT-FM's own planner may place them; otherwise the first stage of layers holds the
    embedding and the last the head. A middle stage is charged the activations of the busiest
    middle stage (the second of layers)."""
    per_param = bytes_per_param(dtype)
    k = model.n_layers // stages
    layers = k * parts.layer_params
    act = k * layer_activation_bytes(model, sequences, seq, dtype)
    flops = k * parts.layer_flops * sequences
    head = parts.head_params + parts.final_norm_params
    head_flops = parts.head_flops * sequences
    head_act = head_activation_bytes(model, sequences, seq, dtype)
    embed = parts.embedding_params
    depth = stages + head_stage + embed_stage  # the pipeline's stages; stage i holds at most depth - i in flight
    if depth == 1:
        params = model.params  # the whole model once: a tied head shares the embedding
        return [_Role("only", replicas, params, flops + head_flops, params * per_param, act + head_act, 1, 0)]
    roles = []
    if embed_stage:  # a lookup and its scatter-add: no GEMM FLOP; it keeps its output for backward
        out = sequences * seq * model.d_model * ITEMSIZE[dtype]
        roles.append(_Role("embed", replicas, embed, 0.0, embed * per_param, out, depth, 1))
    first_at = int(embed_stage)
    for j in range(stages):
        if 0 < j < stages - 1:  # the middle stages: one role, at the busiest one's depth
            if j == 1:
                n = replicas * (stages - 2)
                roles.append(_Role("middle", n, layers, flops, layers * per_param, act, depth - first_at - 1, 2))
            continue
        p, f, a = layers, flops, act
        if j == 0 and not embed_stage:
            p += embed
        if j == stages - 1 and not head_stage:
            p, f, a = p + head, f + head_flops, a + head_act
        position = first_at + j
        sends = (position > 0) + (position < depth - 1)  # a neighbour on each side it has
        name = "layers" if stages == 1 else "first" if j == 0 else "last"
        roles.append(_Role(name, replicas, p, f, p * per_param, a, depth - position, sends))
    if head_stage:
        roles.append(_Role("head", replicas, head, head_flops, head * per_param, head_act, 1, 1))
    return roles


def _in_flight_options(roles: list[_Role], classes: list[DeviceClass], micro_batches: int) -> list[int]:
    """Micro-batches in flight worth trying, most first: all of them (one flush), then each
    smaller count at which some class starts to fit some role (fewer gains nothing more)."""
    full = min(micro_batches, max(role.depth for role in roles))
    options = {full}
    for role in roles:
        for cls in classes:
            room = cls.profile.memory - role.static
            if role.activation > 0 and room >= role.activation:
                fit = int(room // role.activation)
                if fit < min(full, role.depth):
                    options.add(fit)
    return sorted(options, reverse=True)


def _assign(
    roles: list[_Role],
    classes: list[DeviceClass],
    rates: list[float],
    pace: list[list[float]],
    reduce: list[list[float]],
    fits: list[list[bool]],
    scale: float,
) -> tuple[float, float, float, int, int] | None:
    """The assignment of classes to roles minimising ``scale * max pace + max all-reduce`` over
    the devices used, or None if none exists. Returns (objective, pace, all-reduce, class, role)
    with the class and role that set the pace.

    Feasibility at thresholds (P, A) is Hall's condition on the bipartite graph classes -> roles
    (a class serves a role if it fits and both its times are within the thresholds): for every
    set of roles, the classes that can serve one of them hold at least the devices they need.
    It is monotone in P and in A, so one sweep over A ascending with P descending is exact."""
    n_roles = len(roles)
    subsets = range(1, 1 << n_roles)
    need = [sum(roles[r].count for r in range(n_roles) if q >> r & 1) for q in subsets]

    def feasible(p: float, a: float) -> bool:
        by_mask = [0] * (1 << n_roles)
        for c, cls in enumerate(classes):
            mask = 0
            for r in range(n_roles):
                if fits[c][r] and pace[c][r] <= p and reduce[c][r] <= a:
                    mask |= 1 << r
            by_mask[mask] += cls.count
        for i, q in enumerate(subsets):
            if sum(n for m, n in enumerate(by_mask) if m & q) < need[i]:
                return False
        return True

    ok = [(c, r) for c in range(len(classes)) for r in range(n_roles) if fits[c][r]]
    paces = sorted({pace[c][r] for c, r in ok})
    reduces = sorted({reduce[c][r] for c, r in ok})
    if not paces or not feasible(paces[-1], reduces[-1]):
        return None
    best: tuple[float, float, float] | None = None
    i = len(paces) - 1
    for a in reduces:
        if not feasible(paces[i], a):
            continue
        while i > 0 and feasible(paces[i - 1], a):
            i -= 1
        value = scale * paces[i] + a
        if best is None or value < best[0]:
            best = (value, paces[i], a)
    assert best is not None
    _, p, a = best
    # The device that sets the pace, for the breakdown: among those at exactly p, the heaviest
    # stage's fastest class (so a tie with a slow class that need not be used reads as link-bound).
    c, r = min(
        ((c, r) for c, r in ok if pace[c][r] == p and reduce[c][r] <= a),
        key=lambda cr: (-roles[cr[1]].flops, roles[cr[1]].flops / rates[cr[0]]),
    )
    return best[0], p, a, c, r


def _gib(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} bytes"


def _infeasible(why: str, memory: float = 0.0) -> DtfmResult:
    return DtfmResult(None, why, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, memory, "infeasible", 0)


def dtfm_step(
    model: ModelShape, fleet: Sequence[DeviceClass], batch: int, seq: int, dtype: str, *, micro_batch: int = 1
) -> DtfmResult:
    """Seconds of one step of ``batch`` sequences of ``seq`` tokens on ``fleet`` as DT-FM runs
    it, at the fastest split into ``D_PP`` stages (a divisor of the layers) and ``D_DP`` replicas
    with the best assignment of device classes to stages (docs/simulation.md).

    Per micro-batch of ``micro_batch`` sequences a device computes its stage forward and
    backward, and sends and receives one activation-sized tensor per neighbour, overlapped
    (DT-FM sends on separate CUDA streams): its pace is the larger of the two. A step is
    ``(micro_batches + stages - 1) x`` the slowest device's pace (GPipe) plus the slowest stage
    group's all-reduce of its gradients (``2 (R-1)/R x bytes`` each way over the device's own
    link, and ``2 (R-1)`` message latencies, DT-FM's data-parallel cost). When a stage fits a
    device only with fewer micro-batches in flight, the replica runs its micro-batches in several
    flushes (gradient accumulation), each with its own fill and drain."""
    _check(model, batch, seq, dtype)
    _positive_int("micro_batch", micro_batch)
    fleet = tuple(fleet)
    if not all(isinstance(cls, DeviceClass) for cls in fleet):
        raise CostModelError("fleet must be a sequence of DeviceClass")
    if sum(cls.count for cls in fleet) < 1:
        raise CostModelError("the fleet has no devices")
    classes = [cls for cls in fleet if cls.count > 0 and cls.profile.flops_per_s(dtype) > 0]
    if not classes:
        return _infeasible(f"no device in the fleet can compute in {dtype}")
    rates = [cls.profile.flops_per_s(dtype) for cls in classes]
    total = sum(cls.count for cls in classes)
    itemsize = ITEMSIZE[dtype]
    parts = _parts(model, seq)

    best: DtfmResult | None = None
    for layers, head_stage, embed_stage in _splits(model):
        stages = layers + head_stage + embed_stage
        if stages > total:
            continue
        for replicas in _replica_counts(batch, total // stages):
            sequences = -(-batch // replicas)  # the busiest replica's share
            mb = min(micro_batch, sequences)
            micro_batches = -(-sequences // mb)
            roles = _roles(model, parts, layers, replicas, mb, seq, dtype, head_stage, embed_stage)
            activation = mb * seq * model.d_model * itemsize
            spread = ALLREDUCE_PHASES * (replicas - 1) / replicas
            pace: list[list[float]] = []
            reduce: list[list[float]] = []
            for cls, rate in zip(classes, rates):
                p: Profile = cls.profile
                one_way = ONE_WAY_SHARE_OF_RTT * p.rtt
                pace.append([])
                reduce.append([])
                for role in roles:
                    compute = role.flops / rate
                    sent = role.sends * activation  # and as many bytes received
                    link = max(sent / p.up, sent / p.down) + role.sends * one_way
                    grads = role.params * itemsize
                    allreduce = (
                        max(spread * grads / p.up, spread * grads / p.down)
                        + ALLREDUCE_PHASES * (replicas - 1) * one_way
                    )
                    pace[-1].append(max(compute, link))
                    reduce[-1].append(allreduce)
            seen: set[tuple[tuple[bool, ...], ...]] = set()
            for in_flight in _in_flight_options(roles, classes, micro_batches):
                fits = [[role.memory(in_flight) <= cls.profile.memory for role in roles] for cls in classes]
                key = tuple(tuple(row) for row in fits)
                if key in seen:  # the same devices fit as with more in flight: only slower
                    continue
                seen.add(key)
                rounds = 1 if in_flight >= min(micro_batches, roles[0].depth) else -(-micro_batches // in_flight)
                found = _assign(roles, classes, rates, pace, reduce, fits, micro_batches + rounds * (stages - 1))
                if found is None:
                    continue
                step, slot, allreduce, c, r = found
                compute = roles[r].flops / rates[c]
                bubble = rounds * (stages - 1) * slot
                if best is not None and (step, stages * replicas) >= (best.step_s, best.devices_used):  # type: ignore[operator]
                    continue
                seats = tuple(
                    DtfmSeat(
                        role.name,
                        role.count,
                        micro_batches * role.flops,
                        micro_batches * role.sends * activation
                        + (spread * role.params * itemsize if replicas > 1 else 0.0),
                        tuple(
                            cls.name
                            for k, cls in enumerate(classes)
                            if fits[k][j] and pace[k][j] <= slot and reduce[k][j] <= allreduce
                        ),
                    )
                    for j, role in enumerate(roles)
                )
                result = DtfmResult(
                    step_s=step,
                    why=None,
                    stages=stages,
                    head_stage=head_stage,
                    embed_stage=embed_stage,
                    replicas=replicas,
                    devices_used=stages * replicas,
                    micro_batches=micro_batches,
                    compute_s=micro_batches * compute,
                    pipeline_comm_s=micro_batches * (slot - compute),
                    allreduce_s=allreduce,
                    bubble_s=bubble,
                    memory_per_device=max(role.memory(in_flight) for role in roles),
                    bound=_bound(
                        micro_batches * compute, micro_batches * (slot - compute), allreduce, bubble, slot > compute
                    ),
                    rounds=rounds,
                    seats=seats,
                )
                best = result
    if best is not None:
        return best
    return _why_not(model, parts, classes, batch, seq, dtype, micro_batch, total)


def _bound(compute: float, comm: float, allreduce: float, bubble: float, link_paced: bool) -> str:
    """The term that dominates; the bubble counts with whatever sets the pace."""
    shares = {
        "compute": compute + (0.0 if link_paced else bubble),
        "pipeline": comm + (bubble if link_paced else 0.0),
        "allreduce": allreduce,
    }
    return max(shares, key=lambda k: shares[k])


def _why_not(
    model: ModelShape,
    parts: _Parts,
    classes: list[DeviceClass],
    batch: int,
    seq: int,
    dtype: str,
    micro_batch: int,
    total: int,
) -> DtfmResult:
    """Why no split works, at the finest split the fleet can staff (fewest layers per stage) and
    one micro-batch in flight, the lm head in a stage of its own where the fleet has a device for
    it: the smallest stage that fits no device, or too few devices that fit a stage."""
    # The finest split the fleet staffs, with the head and the embedding alone where it can.
    layers_in, head_stage, embed_stage = max(
        (split for split in _splits(model) if split[0] + split[1] + split[2] <= total),
        key=lambda split: (split[0], split[1] + split[2], split[1]),
    )
    stages = layers_in + head_stage + embed_stage
    replicas = min(batch, total // stages)
    mb = min(micro_batch, -(-batch // replicas))
    roles = _roles(model, parts, layers_in, replicas, mb, seq, dtype, head_stage, embed_stage)
    largest = max(classes, key=lambda cls: cls.profile.memory)
    k = model.n_layers // layers_in
    layers = f"{k} layer{'s' * (k > 1)}"
    what = {
        "only": f"the whole model ({layers})",
        "middle": f"a stage of {layers}",
        "first": f"the first stage of layers ({layers})"
        if embed_stage
        else f"the first stage (embedding and {layers})",
        "last": f"the last stage of layers ({layers})" if head_stage else f"the last stage ({layers} and the lm head)",
        "layers": f"the stage of layers ({layers})",
        "head": "the lm head's own stage",
        "embed": "the embedding's own stage",
    }
    for role in sorted(roles, key=lambda role: role.memory(1)):
        if role.memory(1) > largest.profile.memory:
            return _infeasible(
                f"{what[role.name]} needs {_gib(role.memory(1))} of memory per device (weights, gradients, "
                f"Adam state, activations) but the largest device ({largest.name}) has {_gib(largest.profile.memory)}",
                role.memory(1),
            )
    lightest = min(roles, key=lambda role: role.memory(1))
    able = sum(cls.count for cls in classes if cls.profile.memory >= lightest.memory(1))
    return _infeasible(
        f"not enough memory: {stages} pipeline stages need at least {stages} devices with room for a stage "
        f"({_gib(lightest.memory(1))}), only {able:,} have it",
        lightest.memory(1),
    )


# --------------------------------------------------------------------------- cloud


@dataclass(frozen=True)
class CloudResult:
    """One step on ``gpus`` datacenter GPUs at ``utilisation`` of their peak."""

    step_s: float
    gpus: int
    gpu: str
    peak_tflops: float  # per GPU, in the training dtype (fp32: TF32)
    utilisation: float  # model-FLOPs utilisation
    flops: float  # of the step (step_flops)
    source: str
    memory_per_gpu: float  # bytes: training state sharded over the GPUs (ZeRO-3/FSDP) plus activations
    fits: bool  # memory_per_gpu fits one GPU's memory


def cloud_step(
    model: ModelShape,
    batch: int,
    seq: int,
    dtype: str,
    *,
    gpus: int = CLOUD_GPUS_DEFAULT,
    gpu: str = "a100-80gb",
    utilisation: float | None = None,
) -> CloudResult:
    """``step_flops / (gpus x peak x utilisation)``. Memory assumes fully sharded data
    parallelism (ZeRO-3 / PyTorch FSDP): each GPU holds ``1/gpus`` of the 16 bytes per parameter
    and the activations of its ``ceil(batch / gpus)`` sequences; ``fits`` says whether that fits."""
    _check(model, batch, seq, dtype)
    _positive_int("gpus", gpus)
    if gpu not in GPUS:
        raise CostModelError(f"unknown gpu {gpu!r}; choose one of {', '.join(GPUS)}")
    spec = GPUS[gpu]
    if utilisation is None:
        utilisation = DEFAULT_MFU[dtype]
    if isinstance(utilisation, bool) or not isinstance(utilisation, (int, float)) or not 0 < utilisation <= 1:
        raise CostModelError(f"utilisation must be in (0, 1], got {utilisation!r}")
    flops = step_flops(model, batch, seq)
    peak = spec.peak[dtype]
    memory = model.params * bytes_per_param(dtype) / gpus + model.n_layers * layer_activation_bytes(
        model, -(-batch // gpus), seq, dtype
    )
    return CloudResult(
        step_s=flops / (gpus * peak * utilisation),
        gpus=gpus,
        gpu=gpu,
        peak_tflops=peak / 1e12,
        utilisation=float(utilisation),
        flops=flops,
        source=f"{spec.source}; utilisation: OPT-175B 147 TFLOP/s per A100 (Zhang et al. 2022), PaLM 46.2% MFU",
        memory_per_gpu=memory,
        fits=memory <= spec.memory,
    )
