"""Named inputs of the cost model: model shapes, the GEMMs of one training step, and fleets.

Pure data and arithmetic, except ``load_fleet``, which reads one TOML file. Every number here
has its source in docs/presets.md: the published configuration of each model, and for each
fleet class where its throughput, memory, link and session figures come from.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from cleave.coordinator.planning.costmodel import ITEMSIZE, CostModelError, DeviceClass, Profile, PSProfile
from cleave.coordinator.training.model import PRESETS
from cleave.wire.messages import MAX_NAME  # a class's name names its emulated devices

# --------------------------------------------------------------------------- model shapes

MLPS = ("swiglu", "relu", "gelu")
NORMS = ("rms", "layer")


@dataclass(frozen=True)
class LinearShape:
    """One kind of ``nn.Linear``: ``in_features -> out_features``, ``count`` of them in the model."""

    name: str
    in_features: int
    out_features: int
    count: int
    bias: bool = False  # biases are parameters but not GEMM operands

    @property
    def weights(self) -> int:
        return self.in_features * self.out_features * self.count


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, as far as its GEMMs and parameter count go."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # < n_heads: grouped-query attention (k and v project to fewer heads)
    d_ff: int
    vocab: int
    mlp: str  # "swiglu": gate, up, down; "relu"/"gelu": fc1, fc2
    max_seq_len: int
    source: str  # where the numbers come from (paper, HF config)
    fused: bool = False  # ours: q, k, v in one Linear, gate and up in another
    bias: bool = False  # OPT: every Linear but the lm head has a bias
    tied_head: bool = False  # the lm head reuses the embedding matrix (still a GEMM)
    position_rows: int = 0  # rows of a learned position table (OPT: max positions + 2); 0: rotary
    norm: str = "rms"  # "rms": a weight per feature; "layer": a weight and a bias

    def __post_init__(self) -> None:
        for field in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab", "max_seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CostModelError(f"model {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise CostModelError(
                f"model {self.name!r}: {self.n_heads} heads must divide d_model {self.d_model} "
                f"and be a multiple of {self.n_kv_heads} kv heads"
            )
        if self.mlp not in MLPS:
            raise CostModelError(f"model {self.name!r}: mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}")
        if self.norm not in NORMS:
            raise CostModelError(f"model {self.name!r}: norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if self.position_rows < 0:
            raise CostModelError(f"model {self.name!r}: position_rows must be >= 0, got {self.position_rows}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def linears(self) -> tuple[LinearShape, ...]:
        """Every Linear, as its GEMMs see it (``in -> out``), lm head last. Same-shaped Linears
        with different roles (q and o, k and v) stay apart: the planner may merge them."""
        d, L, b = self.d_model, self.n_layers, self.bias
        kv = self.n_kv_heads * self.head_dim
        if self.fused:
            attn = (LinearShape("qkv", d, d + 2 * kv, L, b), LinearShape("proj", d, d, L, b))
        else:
            attn = (
                LinearShape("q", d, d, L, b),
                LinearShape("k", d, kv, L, b),
                LinearShape("v", d, kv, L, b),
                LinearShape("o", d, d, L, b),
            )
        if self.mlp != "swiglu":
            mlp = (LinearShape("fc1", d, self.d_ff, L, b), LinearShape("fc2", self.d_ff, d, L, b))
        elif self.fused:
            mlp = (LinearShape("gate_up", d, 2 * self.d_ff, L, b), LinearShape("down", self.d_ff, d, L, b))
        else:
            mlp = (
                LinearShape("gate", d, self.d_ff, L, b),
                LinearShape("up", d, self.d_ff, L, b),
                LinearShape("down", self.d_ff, d, L, b),
            )
        return attn + mlp + (LinearShape("head", d, self.vocab, 1),)

    def linear_params(self) -> int:
        """Weights of every Linear, lm head included even when tied: the GEMM operands, so a step
        costs exactly ``6 * tokens * linear_params()`` FLOP of GEMMs (see ``step_gemms``)."""
        return sum(lin.weights for lin in self.linears())

    @property
    def params(self) -> int:
        """Trainable parameters: Linear weights and biases, the token embedding (once when the
        head is tied to it), a learned position table, and the norms (two per layer and a final
        one). Exact for our models and for the HF OPT and Llama-2 checkpoints."""
        biases = sum(lin.out_features * lin.count for lin in self.linears() if lin.bias)
        embedding = self.vocab * self.d_model
        tied = embedding if self.tied_head else 0
        norms = (2 * self.n_layers + 1) * self.d_model * (2 if self.norm == "layer" else 1)
        return self.linear_params() + biases + embedding - tied + self.position_rows * self.d_model + norms

    def parameter_sizes(self) -> list[int]:
        """Each parameter tensor's elements, in the model's order (the embedding and a position
        table, then each layer's norms, Linear weights and biases, the final norm, the head unless
        tied): what a tier shards whole among its ranks. They add up to ``params``."""
        d, L = self.d_model, self.n_layers
        norm = [d] * (2 if self.norm == "layer" else 1)
        sizes = [self.vocab * d] + ([self.position_rows * d] if self.position_rows else [])
        body = [lin for lin in self.linears() if lin.name != "head"]
        for _ in range(L):
            sizes += norm
            for lin in body:
                sizes.append(lin.in_features * lin.out_features)
                if lin.bias:
                    sizes.append(lin.out_features)
            sizes += norm
        sizes += norm
        if not self.tied_head:
            sizes.append(d * self.vocab)
        return sizes

    def attention_flops(self, batch: int, seq: int) -> float:
        """Forward FLOP of ``softmax(Q K^T) V`` per step, all layers: ``Q K^T`` and ``P V`` are
        ``2 * seq^2 * d_model`` each per sequence. Full, not causal-halved: the kernel on the
        parameter server computes (or at least pays for) the masked half too. Not in the GEMMs
        handed to volunteers."""
        _tokens(batch, seq, self)
        return 4.0 * batch * seq * seq * self.d_model * self.n_layers


def _ours(name: str) -> ModelShape:
    cfg = PRESETS[name]
    return ModelShape(
        name=name,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads,
        d_ff=cfg.d_ff,
        vocab=cfg.vocab_size,
        mlp="swiglu",
        max_seq_len=cfg.max_seq_len,
        source="coordinator/training/model.py PRESETS",
        fused=True,
    )


def _opt(name: str, d: int, layers: int, heads: int) -> ModelShape:
    return ModelShape(
        name=name,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        d_ff=4 * d,
        vocab=50272,
        mlp="relu",
        max_seq_len=2048,
        bias=True,
        tied_head=True,
        position_rows=2048 + 2,
        norm="layer",
        source=f"Zhang et al. 2022, OPT, Table 1; HF facebook/{name}",
    )


def _llama2(name: str, d: int, layers: int, heads: int, kv_heads: int, d_ff: int, hf: str) -> ModelShape:
    return ModelShape(
        name=name,
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        d_ff=d_ff,
        vocab=32000,
        mlp="swiglu",
        max_seq_len=4096,
        source=f"Touvron et al. 2023, Llama 2; HF meta-llama/{hf}",
    )


MODELS: dict[str, ModelShape] = {
    **{name: _ours(name) for name in ("tiny", "small", "base")},
    "opt-1.3b": _opt("opt-1.3b", 2048, 24, 32),
    "opt-6.7b": _opt("opt-6.7b", 4096, 32, 32),
    "opt-13b": _opt("opt-13b", 5120, 40, 40),
    "opt-30b": _opt("opt-30b", 7168, 48, 56),
    "llama2-7b": _llama2("llama2-7b", 4096, 32, 32, 32, 11008, "Llama-2-7b-hf"),
    "llama2-13b": _llama2("llama2-13b", 5120, 40, 40, 40, 13824, "Llama-2-13b-hf"),
    "llama2-70b": _llama2("llama2-70b", 8192, 80, 64, 8, 28672, "Llama-2-70b-hf"),
}


def model_shape(name: str) -> ModelShape:
    if name not in MODELS:
        raise CostModelError(f"unknown model preset {name!r}; choose one of {', '.join(MODELS)}")
    return MODELS[name]


# --------------------------------------------------------------------------- GEMMs of a step


@dataclass(frozen=True)
class GemmShape:
    """``(m x k) @ (k x n)``, ``count`` identical ones per step."""

    m: int
    n: int
    k: int
    kind: str  # "fwd" | "dx" | "dw": coordinator.planning.tiles.GemmKind values
    layer: str  # the Linear's name
    count: int

    @property
    def flops(self) -> int:
        """FLOP of all ``count`` of them."""
        return 2 * self.m * self.n * self.k * self.count


def _tokens(batch: int, seq: int, model: ModelShape) -> int:
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CostModelError(f"{name} must be a positive integer, got {value!r}")
    if seq > model.max_seq_len:
        raise CostModelError(f"seq {seq} exceeds {model.name}'s {model.max_seq_len} positions")
    return batch * seq


def step_gemms(model: ModelShape, batch: int, seq: int) -> tuple[GemmShape, ...]:
    """The three GEMMs of every Linear in one step on ``batch * seq`` tokens T: forward
    ``Y = X W^T`` (T x in @ in x out), input gradient ``dX = dY W`` (T x out @ out x in) and
    weight gradient ``dW = dY^T X`` (out x T @ T x in). dX is kept even for the first layer's
    Linears (whose input, the embedding output, needs it anyway)."""
    t = _tokens(batch, seq, model)
    gemms: list[GemmShape] = []
    for lin in model.linears():
        i, o, c = lin.in_features, lin.out_features, lin.count
        gemms += [
            GemmShape(m=t, n=o, k=i, kind="fwd", layer=lin.name, count=c),
            GemmShape(m=t, n=i, k=o, kind="dx", layer=lin.name, count=c),
            GemmShape(m=o, n=i, k=t, kind="dw", layer=lin.name, count=c),
        ]
    return tuple(gemms)


# --------------------------------------------------------------------------- fleet presets

_GiB = 2**30


def _mbps(megabits: float) -> float:
    return megabits * 1e6 / 8


def _class(
    name: str,
    count: int,
    *,
    fp32: float,
    fp16: float,
    bf16: float,
    memory_gb: float,
    down_mbps: float,
    up_mbps: float,
    rtt_ms: float,
    session_hours: float,
) -> DeviceClass:
    """A preset class; rates are effective sustained GEMM GFLOP/s (docs/presets.md says how each
    was derated from peak)."""
    profile = Profile(
        gflops={"fp32": fp32, "bf16": bf16, "fp16": fp16},
        memory=int(memory_gb * _GiB),
        down=_mbps(down_mbps),
        up=_mbps(up_mbps),
        rtt=rtt_ms / 1000,
        session=session_hours * 3600,
    )
    return DeviceClass(name, count, profile)


# Home links are asymmetric (cable: upload ~1/10 of download; fibre closer to symmetric).
# Phones compute on Wi-Fi while charging; x86 CPUs without AVX512-BF16/AMX have no fast bf16 or
# fp16 path in torch, so those rates are ~1/50 of fp32.
_PHONE_FLAGSHIP = dict(
    fp32=500, fp16=1000, bf16=250, memory_gb=3, down_mbps=200, up_mbps=40, rtt_ms=40, session_hours=2
)
_PHONE_MID = dict(fp32=150, fp16=300, bf16=75, memory_gb=2, down_mbps=80, up_mbps=15, rtt_ms=60, session_hours=1)
_LAPTOP_LOW = dict(fp32=150, fp16=3, bf16=3, memory_gb=4, down_mbps=100, up_mbps=20, rtt_ms=35, session_hours=3)
_LAPTOP_HIGH = dict(fp32=400, fp16=8, bf16=8, memory_gb=8, down_mbps=500, up_mbps=50, rtt_ms=20, session_hours=4)
_LAPTOP_ZEN4 = dict(fp32=450, fp16=9, bf16=700, memory_gb=8, down_mbps=300, up_mbps=30, rtt_ms=25, session_hours=4)
_APPLE_M1 = dict(fp32=1600, fp16=1800, bf16=900, memory_gb=4, down_mbps=200, up_mbps=20, rtt_ms=25, session_hours=4)
_APPLE_M2_M3 = dict(fp32=2300, fp16=2500, bf16=2500, memory_gb=8, down_mbps=300, up_mbps=40, rtt_ms=25, session_hours=4)
_APPLE_PRO = dict(fp32=3800, fp16=4200, bf16=4200, memory_gb=12, down_mbps=500, up_mbps=100, rtt_ms=20, session_hours=4)
_RTX_3060 = dict(fp32=8000, fp16=18000, bf16=18000, memory_gb=10, down_mbps=300, up_mbps=30, rtt_ms=25, session_hours=6)
_RTX_3080 = dict(fp32=18000, fp16=42000, bf16=42000, memory_gb=8, down_mbps=500, up_mbps=50, rtt_ms=20, session_hours=6)
_RTX_4090 = dict(
    fp32=50000, fp16=110000, bf16=110000, memory_gb=20, down_mbps=1000, up_mbps=500, rtt_ms=15, session_hours=8
)

FLEETS: dict[str, tuple[DeviceClass, ...]] = {
    "phones": (
        _class("phone-flagship", 350, **_PHONE_FLAGSHIP),
        _class("phone-mid", 650, **_PHONE_MID),
    ),
    "laptops": (
        _class("laptop-low", 500, **_LAPTOP_LOW),
        _class("laptop-high", 400, **_LAPTOP_HIGH),
        _class("laptop-zen4", 100, **_LAPTOP_ZEN4),
    ),
    "apple-laptops": (
        _class("apple-m1", 350, **_APPLE_M1),
        _class("apple-m2-m3", 450, **_APPLE_M2_M3),
        _class("apple-m2-m3-pro", 200, **_APPLE_PRO),
    ),
    "desktop-gpus": (
        _class("rtx-3060", 450, **_RTX_3060),
        _class("rtx-3080", 350, **_RTX_3080),
        _class("rtx-4090", 200, **_RTX_4090),
    ),
    "mixed": (
        _class("phone-mid", 300, **_PHONE_MID),
        _class("phone-flagship", 150, **_PHONE_FLAGSHIP),
        _class("laptop-low", 200, **_LAPTOP_LOW),
        _class("laptop-high", 150, **_LAPTOP_HIGH),
        _class("apple-m2-m3", 100, **_APPLE_M2_M3),
        _class("rtx-3060", 60, **_RTX_3060),
        _class("rtx-3080", 30, **_RTX_3080),
        _class("rtx-4090", 10, **_RTX_4090),
    ),
}


def _check_dtype(dtype: str) -> None:
    if dtype not in ITEMSIZE:
        raise CostModelError(f"unknown dtype {dtype!r}; use one of {', '.join(ITEMSIZE)}")


def fleet_preset(name: str, dtype: str) -> tuple[DeviceClass, ...]:
    """A preset fleet; its profiles carry rates for every dtype, ``dtype`` is only checked."""
    _check_dtype(dtype)
    if name not in FLEETS:
        raise CostModelError(f"unknown fleet preset {name!r}; choose one of {', '.join(FLEETS)}")
    return FLEETS[name]


# --------------------------------------------------------------------------- fleet files

MAX_FLEET_FILE = 1 << 20  # bytes; a fleet is a few dozen lines, so anything bigger is a mistake
MAX_CLASS_COUNT = 10_000_000
MAX_CLASSES = 1000

_REQUIRED = ("name", "count", "memory_gb", "down_mbps", "up_mbps", "rtt_ms")
_OPTIONAL = ("gflops", "session_hours", "reliability", *(f"gflops_{dtype}" for dtype in ITEMSIZE))


def _number(value: object, what: str, *, minimum: float = 0.0, zero: bool = False) -> float:
    # bool is an int subclass: `count = true` must not read as 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CostModelError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum or (value == minimum and not zero):
        bound = f">= {minimum:g}" if zero else f"> {minimum:g}"
        raise CostModelError(f"{what} must be finite and {bound}, got {value!r}")
    return float(value)


def _parse_class(table: Mapping[str, object], dtype: str, names: set[str]) -> DeviceClass:
    unknown = sorted(set(table) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise CostModelError(f"unknown key {unknown[0]!r}; allowed: {', '.join(_REQUIRED + _OPTIONAL)}")
    missing = [key for key in _REQUIRED if key not in table]
    if missing:
        raise CostModelError(f"missing key {missing[0]!r}")
    name = table["name"]
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable():
        raise CostModelError(f"name must be 1 to {MAX_NAME} printable characters, got {name!r}")
    if name in names:
        raise CostModelError(f"duplicate class name {name!r}")
    count = table["count"]
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_CLASS_COUNT:
        raise CostModelError(f"count must be an integer from 0 to {MAX_CLASS_COUNT:,}, got {count!r}")
    gflops = {
        other: _number(table[f"gflops_{other}"], f"gflops_{other}") for other in ITEMSIZE if f"gflops_{other}" in table
    }
    if "gflops" in table:
        rate = _number(table["gflops"], "gflops")
        if gflops.get(dtype, rate) != rate:
            raise CostModelError(
                f"gflops ({rate:g}) and gflops_{dtype} ({gflops[dtype]:g}) disagree on the {dtype} rate"
            )
        gflops[dtype] = rate
    if dtype not in gflops:
        raise CostModelError(f"no {dtype} rate: give gflops (in the training dtype) or gflops_{dtype}")
    session = _number(table["session_hours"], "session_hours") * 3600 if "session_hours" in table else math.inf
    reliability = _number(table.get("reliability", 1.0), "reliability", zero=True)
    if reliability > 1:
        raise CostModelError(f"reliability must be between 0 and 1, got {reliability!r}")
    profile = Profile(
        gflops=gflops,
        memory=int(_number(table["memory_gb"], "memory_gb") * _GiB),
        down=_mbps(_number(table["down_mbps"], "down_mbps")),
        up=_mbps(_number(table["up_mbps"], "up_mbps")),
        rtt=_number(table["rtt_ms"], "rtt_ms", zero=True) / 1000,
        session=session,
        reliability=reliability,
    )
    return DeviceClass(name, count, profile)


def parse_fleet(text: str, dtype: str, source: str = "<fleet>") -> tuple[DeviceClass, ...]:
    """Classes of a fleet TOML document; every error is one line naming ``source`` and the class."""
    _check_dtype(dtype)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CostModelError(f"{source}: not valid TOML: {_one_line(exc)}") from None
    extra = sorted(set(doc) - {"class"})
    if extra:
        raise CostModelError(f"{source}: unknown top-level key {extra[0]!r}; a fleet holds only [[class]] tables")
    tables = doc.get("class")
    if not tables:
        raise CostModelError(f"{source}: no [[class]] tables: the fleet is empty")
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise CostModelError(f"{source}: 'class' must be an array of tables ([[class]])")
    if len(tables) > MAX_CLASSES:
        raise CostModelError(f"{source}: {len(tables)} classes; at most {MAX_CLASSES}")
    classes: list[DeviceClass] = []
    names: set[str] = set()
    for index, table in enumerate(tables, 1):
        name = table.get("name")
        where = f"[[class]] #{index}" + (f" {name!r}" if isinstance(name, str) else "")
        try:
            cls = _parse_class(table, dtype, names)
        except CostModelError as exc:
            raise CostModelError(f"{source}: {where}: {_one_line(exc)}") from None
        names.add(cls.name)
        classes.append(cls)
    if not sum(cls.count for cls in classes):
        raise CostModelError(f"{source}: every class has count 0: the fleet has no devices")
    return tuple(classes)


def load_fleet(path: str | Path, dtype: str) -> tuple[DeviceClass, ...]:
    """Read a fleet file (format in docs/presets.md); more than ``MAX_FLEET_FILE`` bytes is
    refused before parsing."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FLEET_FILE + 1)
    except OSError as exc:
        raise CostModelError(f"{path}: cannot read fleet file: {exc.strerror or exc}") from None
    if len(data) > MAX_FLEET_FILE:
        raise CostModelError(f"{path}: fleet file larger than {MAX_FLEET_FILE // 1024} KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CostModelError(f"{path}: fleet file is not UTF-8 text") from None
    return parse_fleet(text, dtype, str(path))


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


# --------------------------------------------------------------------------- scaling, resolving


def scale_fleet(classes: Iterable[DeviceClass], devices: int) -> tuple[DeviceClass, ...]:
    """The same classes with counts summing to exactly ``devices``, in their proportions
    (largest remainder, ties to the earlier class). A class with devices keeps at least one when
    ``devices`` is at least the number of such classes, taken from the class holding the most."""
    classes = tuple(classes)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise CostModelError(f"--devices must be a positive integer, got {devices!r}")
    total = sum(cls.count for cls in classes)
    if total < 1:
        raise CostModelError("cannot scale a fleet with no devices")
    # Integer arithmetic: quota_i = devices * count_i / total exactly.
    counts = [devices * cls.count // total for cls in classes]
    order = sorted(range(len(classes)), key=lambda i: (-(devices * classes[i].count % total), i))
    for i in order[: devices - sum(counts)]:
        counts[i] += 1
    present = [i for i, cls in enumerate(classes) if cls.count > 0]
    if devices >= len(present):
        for i in present:
            if counts[i] == 0:
                donor = max(present, key=lambda j: counts[j])  # >= 2 by pigeonhole
                counts[donor] -= 1
                counts[i] = 1
    return tuple(DeviceClass(cls.name, n, cls.profile) for cls, n in zip(classes, counts))


def resolve_fleet(spec: str, dtype: str, devices: int | None = None) -> tuple[DeviceClass, ...]:
    """``--fleet``: a preset name, else a path to a TOML fleet file; ``--devices`` rescales."""
    if spec in FLEETS:
        classes = fleet_preset(spec, dtype)
    elif spec.endswith(".toml") or Path(spec).is_file():
        classes = load_fleet(spec, dtype)
    else:
        raise CostModelError(f"unknown fleet {spec!r}: not a preset ({', '.join(FLEETS)}) and not a .toml file")
    return classes if devices is None else scale_fleet(classes, devices)


# --------------------------------------------------------------------------- coordinators


def _server() -> PSProfile:
    """The cost model's documented default (docs/cost-model.md): a many-core server, its own
    work in every dtype at its fp32 rate (it can always upcast what it computes itself)."""
    fp32 = PSProfile().gflops["fp32"]
    return PSProfile(gflops={dtype: fp32 for dtype in ITEMSIZE})


def _h100() -> PSProfile:
    """A coordinator on one H100 SXM5 80 GB (``--device cuda``; docs/presets.md has the sources):
    GEMMs, attention, checks and AdamW on the GPU; results still arrive through the host and
    cross PCIe once. TF32 stays off (exactness), so fp32 runs on the CUDA cores."""
    return PSProfile(
        gflops={"fp32": 50_000.0, "bf16": 600_000.0, "fp16": 600_000.0},  # 75% of 67, 60% of 989 TFLOP/s
        verify_flops=20e12,  # the 16-column check reads HBM3 (3.35 TB/s) at ~8 FLOP per byte, 75%
        memory_bw=50e9,  # PCIe 5.0 x16, pinned: results come through the host (64 GB/s each way)
        own_bw=2.5e12,  # AdamW streams HBM3 (3.35 TB/s, 75%)
    )


COORDINATORS = {"server": _server, "h100": _h100}


def coordinator_preset(name: str, link_gbps: float, gflops: float | None = None) -> PSProfile:
    """A coordinator preset (``--coordinator``) on a link of ``link_gbps`` each way; ``gflops``
    overrides its GEMM rate in every dtype (``--ps-gflops``)."""
    make = COORDINATORS.get(name)
    if make is None:
        raise CostModelError(f"unknown coordinator {name!r}; use one of {', '.join(COORDINATORS)}")
    ps = make()
    rate = PSProfile.from_link(link_gbps)
    ps = dataclasses.replace(ps, egress=rate.egress, ingress=rate.ingress)
    if gflops is not None:
        ps = dataclasses.replace(ps, gflops={dtype: gflops for dtype in ITEMSIZE})
    return ps
