"""Cleave's wire protocol: every message that crosses a websocket, in one module.

One message is one binary websocket frame:

    magic      b"CLV"        3 bytes
    version    u8            PROTOCOL_VERSION
    header_len u32, little-endian
    header     UTF-8 JSON object, keys sorted: {"type": ..., fields..., "tensors": [...]}
    payload    raw little-endian tensor bytes, back to back, in the order of header["tensors"]

Tensor payloads are never pickled and never compressed (floats barely compress and
permessage-deflate is 30x slower than the link).

Every field declares its limits (a range, a length, a kind of text); ``decode`` checks them all,
so nothing absurd from a peer reaches the coordinator's state, SQLite or a JSON encoder. A
malformed frame raises ``ProtocolError`` (with a ``Code`` for the peer), never ``KeyError``,
``TypeError``, ``RecursionError`` or ``struct.error``.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import sys
import threading
import warnings
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is handled, not here: a program that only speaks the messages
# without tensors (``cleave status``, the operator's commands) starts in a fraction of a second
# instead of paying torch's import (1.5 s or more).

from cleave.wire.codes import Code, EnergySource, Name, RelayFault, ReleaseWhy, StandbyWhy
from cleave.wire.errors import ProtocolError

PROTOCOL_VERSION = 9  # 3: result.waited; 4: work.more (a tile summed over several block pairs);
# 5: work_batch, result_batch and hello.batch (many tiles under one header); 6: redirect and
# hello.ticket (a tier's rank sends a newcomer to the rank that needs devices most); 7: relays
# (hello.relay, work.fetch, use_relay, block_request, blocks, relay_report); 8: energy; 9: standby
# and wake
MAGIC = b"CLV"
_PREFIX = struct.Struct("<3sBI")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 20
MAX_DIM = 1 << 27  # elements along one dimension (a 1-D speed-test payload reaches 64 Mi)
MAX_ELEMENTS = 1 << 40  # elements of one tensor, counting a zero-size dim as 1 (far above any frame limit)
MAX_SPEEDTEST_BYTES = 16 << 20
MAX_IDS = 1024  # tile ids in one release or cancel
MAX_BATCH = 64  # tiles in one work_batch or result_batch (= MAX_SLOTS: all a device may hold)
MAX_BATCH_TENSORS = 64  # tensors in one batch frame: its results, or its works' new blocks
MAX_TENSORS = 16  # tensors in one frame
MAX_PAIRS = MAX_TENSORS // 2 - 1  # (A, B) block pairs in one work message beyond the first: all its
# pieces' blocks fit one frame even when the device holds none of them
MAX_ID = (1 << 53) - 1  # ids stay exact in JSON and fit SQLite's int64
NONCE_HEX = 64  # 32 random bytes, hex
SECRET_HEX = 64
MAX_NAME = 64  # characters of a device's name (hello.name) and a coordinator's id
MAX_TOKEN = 256  # characters of a join or operator token
MAX_GFLOPS = 1e7  # the largest GEMM rate a hello may claim
MAX_SLOTS = 64  # tiles a device may ask to hold, and be given, at once
DEFAULT_SLOTS = 2  # what a device asks for unless told otherwise (cleave join --slots)
DEFAULT_HEARTBEAT = 2.0  # seconds between heartbeats, until a welcome says otherwise
MAX_PLATFORM = 128  # characters of a hello's platform description
MAX_CORES = 1 << 16
MAX_BYTES = 1 << 50  # the largest memory or block budget a hello may state
MAX_URL = 256  # characters of a coordinator's URL in a redirect
TICKET_HEX = 120  # a redirect's ticket: 60 bytes, hex (wire/auth.py)
MAX_RANK = 1023  # a tier has at most 1,024 ranks
MAX_JOULES = 1e9  # of one energy report (a 1 kW machine for 11 days)
MAX_SPAN = 1e6  # seconds one energy report may cover
MAX_GRID = 2000.0  # gCO2/kWh a volunteer may state (coal plants emit about 1,000)
ENERGY_EVERY = 30.0  # seconds between a device's energy reports, at the most often
# A device in standby beats every ``standby.keepalive`` seconds, within these bounds; each side
# counts the other silent after STANDBY_MISSES keep-alives heard of neither.
MIN_KEEPALIVE, MAX_KEEPALIVE = 1.0, 3600.0
STANDBY_MISSES = 3
DIGEST_HEX = 64  # a block's digest: BLAKE2b-256 of its dtype, shape and bytes (wire/digest.py), hex
MAX_FETCH = MAX_BATCH_TENSORS  # digests in one block_request or blocks frame, and fetches in one work

# Wire names of the tensor dtypes a tile may use, in the order of ``tensor_dtypes``.
DTYPE_NAMES = ("f32", "f16", "bf16", "u8")


_FIRST_USE = threading.Lock()  # warnings.catch_warnings is process-wide: one thread spends it


@functools.cache
def tensor_dtypes() -> Mapping[str, torch.dtype]:
    """Each wire dtype name's torch dtype (imports torch on first use)."""
    with _FIRST_USE:
        import torch

        # torch warns, once per process, that a tensor over read-only memory (a received frame)
        # could be written through; ours are never written (see decode). Spent here, where expected.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(b"\0", dtype=torch.uint8)
        return MappingProxyType(
            dict(zip(DTYPE_NAMES, (torch.float32, torch.float16, torch.bfloat16, torch.uint8), strict=True))
        )


@functools.cache
def _dtype_names() -> Mapping[torch.dtype, str]:
    return MappingProxyType({v: k for k, v in tensor_dtypes().items()})


class WireDtype(Name):
    """What a float32 job's GEMM operands and results travel as (``--wire-dtype``). Half
    precision halves the bytes but rounds the operands: opt-in, never exact (docs/cli.md)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch(self) -> torch.dtype | None:
        """The dtype float32 operands are cast to, or None: they travel as they are."""
        import torch

        return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("Cleave's wire format assumes a little-endian machine")


# --------------------------------------------------------------------------- field limits
#
# Each field's metadata says what a peer may put there; ``_check`` enforces it on decode.
#   int:    {"lo", "hi"}            float: {"lo", "hi"} and finite
#   text:   {"max_len", "text"}     "free": control characters become spaces (reasons, messages);
#                                   "name": printable only, else refused (names, keys, tokens);
#                                   "hex": exactly ``max_len`` lowercase hex digits, or empty
#   ids:    {"max_items", "lo", "hi"}   a list of ints
#   enum:   {"enum": EnumClass}


def _int(default: Any = MISSING, *, lo: int = 0, hi: int = MAX_ID) -> Any:
    return field(default=default, metadata={"kind": "int", "lo": lo, "hi": hi})


def _float(default: Any = MISSING, *, lo: float = 0.0, hi: float = 1e9) -> Any:
    return field(default=default, metadata={"kind": "float", "lo": lo, "hi": hi})


def _text(default: Any = MISSING, *, max_len: int = 200, text: str = "free") -> Any:
    # A hex field without a default must be there in full: an empty nonce or secret is no value.
    meta = {"kind": "str", "max_len": max_len, "text": text, "required": default is MISSING}
    return field(default=default, metadata=meta)


def _ids(default: Any = MISSING) -> Any:
    return field(default=default, metadata={"kind": "ids", "max_items": MAX_IDS, "lo": 0, "hi": MAX_ID})


def _digests(default: Any = ()) -> Any:
    return field(default=default, metadata={"kind": "digests"})


def _enum(enum: type[Enum], default: Any = MISSING) -> Any:
    return field(default=default, metadata={"kind": "enum", "enum": enum})


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Block:
    """An input block, sent once to a device and cached there under ``key``.

    Keys look like ``"<namespace>.<rest>"``; ``Work.forget`` drops whole namespaces. One block
    may serve many tiles and several GEMMs (a forward pass's ``X`` rows are the weight
    gradient's token pieces), used as it is or transposed, as each tile says.
    """

    key: str
    data: torch.Tensor


@dataclass(frozen=True)
class Challenge:
    """Coordinator -> peer, the first frame of every connection. A device with a credential
    answers with a proof over ``nonce`` (so a recorded hello cannot be replayed); ``coordinator``
    names this coordinator's database, the key under which clients keep their credential."""

    TYPE: ClassVar[str] = "challenge"
    nonce: str = _text(max_len=NONCE_HEX, text="hex")
    coordinator: str = _text(max_len=MAX_NAME, text="name")


@dataclass(frozen=True)
class Hello:
    """Device -> coordinator, answer to the challenge: who it is and what it can do.

    Enrolment: ``token`` is the project's join token, ``identity`` 0. Later connections:
    ``identity`` and ``proof`` (see wire/auth.py), no token."""

    TYPE: ClassVar[str] = "hello"
    name: str = _text(max_len=MAX_NAME, text="name")
    token: str = _text("", max_len=MAX_TOKEN, text="name")
    identity: int = _int(0)
    proof: str = _text("", max_len=SECRET_HEX, text="hex")
    platform: str = _text("", max_len=MAX_PLATFORM)
    cores: int = _int(1, lo=0, hi=MAX_CORES)
    memory_bytes: int = _int(0, hi=MAX_BYTES)
    device: str = _text("cpu", max_len=16, text="name")
    gflops: float = _float(0.0, hi=MAX_GFLOPS)
    slots: int = _int(DEFAULT_SLOTS, lo=1, hi=MAX_SLOTS)  # the most tiles it wants in flight; the coordinator decides
    client_version: str = _text("", max_len=32)
    block_budget: int = _int(0, hi=MAX_BYTES)  # bytes of input blocks the device will cache; 0: no limit
    paused: str = _text("")  # not empty: it connects paused, for this reason (no work until Resume)
    # The most tiles it takes in one work_batch frame (and may answer in one result_batch); 1:
    # one work frame per tile (a client from before batches, or one that wants none).
    batch: int = _int(1, lo=1, hi=MAX_BATCH)
    # Enrolment on a redirect: the ticket another rank of the tier gave it, instead of the token.
    ticket: str = _text("", max_len=TICKET_HEX, text="hex")
    # Not empty: this peer is a relay (``cleave relay``), reached by devices at this URL; it takes
    # no tiles, only blocks to serve.
    relay: str = _text("", max_len=MAX_URL, text="name")


@dataclass(frozen=True)
class Credential:
    """Coordinator -> device, once, when it enrols: keep this secret; later connections prove
    they hold it instead of presenting the join token."""

    TYPE: ClassVar[str] = "credential"
    identity: int = _int(lo=1)
    secret: str = _text(max_len=SECRET_HEX, text="hex")


@dataclass(frozen=True)
class StatusRequest:
    """Observer -> coordinator: ask for one status snapshot (``cleave status``), with the
    operator token."""

    TYPE: ClassVar[str] = "status_request"
    token: str = _text(max_len=MAX_TOKEN, text="name")


@dataclass(frozen=True)
class Result:
    """Device -> coordinator: the C block of a tile, how long the matmul took, and how long the
    tile waited before it."""

    TYPE: ClassVar[str] = "result"
    tile_id: int = _int()
    c: torch.Tensor  # type: ignore[misc]  # mypy takes _int() for a default: it knows no field helper but field()
    seconds: float = _float(0.0, hi=86400.0)
    # Seconds the tile waited on the device between arriving and its matmul starting (its queue).
    # With ``seconds`` it lets the coordinator split its own measured turnaround into the link's
    # share and the device's; both are claims, trusted only within that turnaround.
    waited: float = _float(0.0, hi=86400.0)


@dataclass(frozen=True)
class Leave:
    """Device -> coordinator: the device is going away; re-queue its tiles now."""

    TYPE: ClassVar[str] = "leave"
    reason: str = _text("")


@dataclass(frozen=True)
class Release:
    """Device -> coordinator: give these leased tiles back. ``why`` decides what follows: a
    missing block is sent again with the tile; a failed compute bars the device from it."""

    TYPE: ClassVar[str] = "release"
    tile_ids: tuple[int, ...] = _ids()
    why: ReleaseWhy = _enum(ReleaseWhy, ReleaseWhy.MISSING_BLOCK)
    reason: str = _text("")


@dataclass(frozen=True)
class Heartbeat:
    """Either way, every few seconds: "I am alive". A device silent for too long is presumed
    frozen and its tiles go to others; a client that hears nothing reconnects."""

    TYPE: ClassVar[str] = "heartbeat"
    sent_at: float = _float(0.0, lo=-1e12, hi=1e12)


@dataclass(frozen=True)
class Cancel:
    """Coordinator -> device: drop these tiles (another copy was verified first, or the lease
    was taken back)."""

    TYPE: ClassVar[str] = "cancel"
    tile_ids: tuple[int, ...] = _ids()
    reason: str = _text("")


@dataclass(frozen=True)
class Pause:
    """Device -> coordinator: the owner needs the machine (``reason``); take my tiles back now,
    keep me connected, send nothing until Resume."""

    TYPE: ClassVar[str] = "pause"
    reason: str = _text("")


@dataclass(frozen=True)
class Resume:
    """Device -> coordinator: the machine is free again."""

    TYPE: ClassVar[str] = "resume"


@dataclass(frozen=True)
class Credit:
    """Coordinator -> device: verified work in GFLOP, this connection's and its identity's over
    every job in the coordinator's database."""

    TYPE: ClassVar[str] = "credit"
    session_gflop: float = _float(0.0, hi=1e15)
    total_gflop: float = _float(0.0, hi=1e15)


@dataclass(frozen=True)
class SpeedTest:
    """Observer <-> coordinator link test: the coordinator answers with ``reply_bytes`` of
    payload; ``data`` carries the upload. The first one of a connection carries the operator
    token (the coordinator refuses any other). Used by ``cleave benchmark --url``."""

    TYPE: ClassVar[str] = "speedtest"
    reply_bytes: int = _int(hi=MAX_SPEEDTEST_BYTES)
    data: torch.Tensor  # type: ignore[misc]  # mypy takes _int() for a default: it knows no field helper but field()
    token: str = _text("", max_len=MAX_TOKEN, text="name")


@dataclass(frozen=True)
class Welcome:
    """Coordinator -> device, answer to Hello. ``heartbeat`` is the interval the client must keep;
    ``slots`` the tiles it may hold now (the coordinator raises it as the device earns trust)."""

    TYPE: ClassVar[str] = "welcome"
    device_id: int = _int()
    identity: int = _int()
    job: str = _text(max_len=200)
    slots: int = _int(lo=1, hi=MAX_SLOTS)
    heartbeat: float = _float(DEFAULT_HEARTBEAT, lo=0.01, hi=3600.0)


@dataclass(frozen=True)
class Work:
    """Coordinator -> device: compute ``C = A @ B`` for one tile.

    ``A`` is the cached block ``a`` (transposed when ``a_t``), ``B`` likewise. ``blocks`` carries
    the blocks this device does not hold yet; ``forget`` lists key namespaces it may drop.
    """

    TYPE: ClassVar[str] = "work"
    tile_id: int = _int()
    a: str = _text(max_len=128, text="name")
    b: str = _text(max_len=128, text="name")
    a_t: bool = False
    b_t: bool = False
    blocks: tuple[Block, ...] = ()
    forget: tuple[int, ...] = ()
    # More (A, B) pairs, flattened: the tile is ``sum_i A_i @ B_i`` over consecutive reduction
    # pieces (a device adds up its own split-K pieces and sends one partial). ``more_t``: whether
    # each of those blocks is used transposed (like ``a_t``, ``b_t``; blocks travel as laid out).
    more: tuple[str, ...] = ()
    more_t: tuple[bool, ...] = ()
    # Blocks to take from the device's relay (``use_relay``) rather than from this frame: each a
    # ``(key, digest)``. The device checks the bytes against the digest before using them.
    fetch: tuple[tuple[str, str], ...] = ()
    # Seconds the device may wait on its relay for ``fetch``, from the frame's arrival (a share
    # of this lease's own window, so a slow relay is reported before the lease is late); 0:
    # ``use_relay.wait``.
    fetch_wait: float = _float(0.0, hi=3600.0)

    def operands(self, cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(A, B)`` from a device's block cache, or None when a block is missing. With more
        pairs, ``A`` is their A blocks side by side and ``B`` their B blocks stacked, so that
        ``A @ B`` is the sum of the pairs' products."""
        keys = (self.a, self.b, *self.more)
        flags = (self.a_t, self.b_t, *self.more_t)
        blocks = [cache[key] for key in keys if key in cache]
        if len(blocks) != len(keys) or len(flags) != len(keys):
            return None
        used = [(x.t() if t else x) for x, t in zip(blocks, flags)]
        a, b = used[0::2], used[1::2]
        if len(a) == 1:
            return a[0], b[0]
        if any(x.shape[0] != a[0].shape[0] for x in a) or any(x.shape[1] != b[0].shape[1] for x in b):
            return None  # pieces that do not line up: a coordinator bug, given back as missing
        import torch

        return torch.cat(a, dim=1), torch.cat(b, dim=0)


@dataclass(frozen=True)
class WorkBatch:
    """Coordinator -> device: several tiles under one header, as if each ``Work`` had come in
    its own frame, in order (a tile's blocks may serve the tiles after it). Sent only to a device
    whose hello said ``batch`` > 1, at most that many tiles and ``MAX_BATCH_TENSORS`` new blocks."""

    TYPE: ClassVar[str] = "work_batch"
    works: tuple[Work, ...]


@dataclass(frozen=True)
class ResultBatch:
    """Device -> coordinator: several results under one header, each as a ``Result`` would carry
    it (at most ``MAX_BATCH``; each tile once). The coordinator acts on them in order, and on the
    device's next frame only once every one of them is judged."""

    TYPE: ClassVar[str] = "result_batch"
    results: tuple[Result, ...]


@dataclass(frozen=True)
class StatusReply:
    """Coordinator -> observer: a JSON snapshot of the job, devices and tiles."""

    TYPE: ClassVar[str] = "status"
    status: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Redirect:
    """Coordinator -> device, instead of a welcome: this job runs on a tier of coordinators and
    another rank needs devices more. Connect to ``url`` (rank ``rank``) and enrol there with
    ``ticket`` instead of the join token; the coordinator then closes with 4013. A ticket is good
    for one enrolment, at that rank, for a few minutes (wire/auth.py)."""

    TYPE: ClassVar[str] = "redirect"
    url: str = _text(max_len=MAX_URL, text="name")
    rank: int = _int(hi=MAX_RANK)
    ticket: str = _text(max_len=TICKET_HEX, text="hex")
    reason: str = _text("")


@dataclass(frozen=True)
class UseRelay:
    """Coordinator -> device: take the blocks that ``work.fetch`` names from the relay at
    ``url`` (relay ``relay``), presenting ``ticket`` (``relay`` 0: no relay any more), waiting
    at most ``wait`` seconds for one work frame's blocks (well within its leases' deadlines;
    then it takes them from the coordinator and reports the relay). Results still come here."""

    TYPE: ClassVar[str] = "use_relay"
    relay: int = _int()
    url: str = _text("", max_len=MAX_URL, text="name")
    ticket: str = _text("", max_len=SECRET_HEX, text="hex")
    wait: float = _float(0.0, hi=3600.0)


@dataclass(frozen=True)
class BlockRequest:
    """Device -> relay, and relay -> coordinator: send me these blocks, by digest. A device
    names itself and shows the ticket its coordinator gave it for this relay."""

    TYPE: ClassVar[str] = "block_request"
    digests: tuple[str, ...] = _digests()
    device: int = _int(0)
    ticket: str = _text("", max_len=SECRET_HEX, text="hex")


@dataclass(frozen=True)
class Blocks:
    """Relay -> device, and coordinator -> relay: the blocks asked for, each under its digest
    (``Block.key``), and the digests it does not have. A relay seals each block it serves
    (``tags``, one per block: BLAKE2b keyed with the relay's own key over the digest and the
    bytes), so that a device can show the coordinator what the relay gave it."""

    TYPE: ClassVar[str] = "blocks"
    blocks: tuple[Block, ...] = ()
    missing: tuple[str, ...] = _digests()
    tags: tuple[str, ...] = _digests()


@dataclass(frozen=True)
class RelayReport:
    """Device -> coordinator: its relay failed it (``fault``) on the block ``digest``. For a
    wrong block, ``got`` is the digest of the bytes it received and ``tag`` the relay's seal on
    them. The device takes its blocks from the coordinator from then on."""

    TYPE: ClassVar[str] = "relay_report"
    relay: int = _int()
    fault: RelayFault = _enum(RelayFault)
    digest: str = _text("", max_len=DIGEST_HEX, text="hex")
    tag: str = _text("", max_len=DIGEST_HEX, text="hex")
    got: str = _text("", max_len=DIGEST_HEX, text="hex")


@dataclass(frozen=True)
class Energy:
    """Device -> coordinator, with its results (at most one every ``ENERGY_EVERY`` seconds, never
    per tile): the energy its machine used over the last ``seconds`` it was serving, since its
    previous report. ``joules`` come from ``source`` (the CPU side: RAPL counters, the battery's
    discharge, or the stated estimate); ``gpu_joules`` from NVML, 0 without a CUDA GPU. A
    volunteer may state their grid's carbon intensity (``grid_gco2_kwh``, 0: the coordinator's).
    The coordinator believes none of it past its device kind's ceiling (docs/operations.md)."""

    TYPE: ClassVar[str] = "energy"
    joules: float = _float(lo=0.0, hi=MAX_JOULES)
    seconds: float = _float(lo=0.0, hi=MAX_SPAN)
    source: EnergySource = _enum(EnergySource)
    gpu_joules: float = _float(0.0, lo=0.0, hi=MAX_JOULES)
    grid_gco2_kwh: float = _float(0.0, lo=0.0, hi=MAX_GRID)


@dataclass(frozen=True)
class Standby:
    """Coordinator -> device: no work for you for now (``reason``). Drop your cached blocks and
    free what memory you can, send a heartbeat only every ``keepalive`` seconds, take no work
    until ``wake``. The coordinator sends it only to a device holding no tile of its: any tile the
    device still holds is one nobody wants back (cancelled), and goes."""

    TYPE: ClassVar[str] = "standby"
    keepalive: float = _float(lo=MIN_KEEPALIVE, hi=MAX_KEEPALIVE)
    reason: StandbyWhy = _enum(StandbyWhy, StandbyWhy.UNPLANNED)


@dataclass(frozen=True)
class Wake:
    """Coordinator -> device in standby: come back. Answer with a ``heartbeat`` at once (the
    coordinator times its devices' wakes by it); work may follow this frame straight away."""

    TYPE: ClassVar[str] = "wake"


@dataclass(frozen=True)
class Finished:
    """Coordinator -> device: the job is over; a client started with --once exits."""

    TYPE: ClassVar[str] = "finished"
    reason: str = _text("job complete")


@dataclass(frozen=True)
class Error:
    """Coordinator -> device: something the peer sent was refused. Never a traceback."""

    TYPE: ClassVar[str] = "error"
    code: Code = _enum(Code)
    message: str = _text(max_len=500)


Message = (
    Challenge
    | Hello
    | Credential
    | StatusRequest
    | Result
    | Leave
    | Release
    | Heartbeat
    | Cancel
    | Pause
    | Resume
    | Credit
    | SpeedTest
    | Welcome
    | Work
    | WorkBatch
    | ResultBatch
    | StatusReply
    | Redirect
    | UseRelay
    | BlockRequest
    | Blocks
    | RelayReport
    | Energy
    | Standby
    | Wake
    | Finished
    | Error
)
_PLAIN: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Challenge,
        Hello,
        Credential,
        StatusRequest,
        Leave,
        Release,
        Heartbeat,
        Cancel,
        Pause,
        Resume,
        Credit,
        Welcome,
        StatusReply,
        Redirect,
        UseRelay,
        BlockRequest,
        RelayReport,
        Energy,
        Standby,
        Wake,
        Finished,
        Error,
    )
}
# What each side may send; the rest of the table is the other side's.
DEVICE_MESSAGES = (Hello, Result, ResultBatch, Release, Heartbeat, Pause, Resume, Leave, RelayReport, Energy)
RELAY_MESSAGES = (BlockRequest, Heartbeat, Leave)  # what a relay may send its coordinator
OBSERVER_MESSAGES = (StatusRequest, SpeedTest)


# --------------------------------------------------------------------------- encoding


def _tensor_desc(t: torch.Tensor) -> dict[str, Any]:
    names = _dtype_names()
    if t.dtype not in names:
        raise ProtocolError(f"dtype {t.dtype} cannot travel", Code.BAD_DTYPE)
    return {"dtype": names[t.dtype], "shape": list(t.shape)}


def _raw(t: torch.Tensor) -> memoryview:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # Flattened first: a contiguous tensor may keep any stride on a size-1 dim (W^T[:, 0:1] has
    # stride (1, k)), and a 0-d tensor has none; viewing bytes needs a unit last stride.
    t = t.contiguous().reshape(-1)
    if t.numel() and t.stride(0) != 1:  # one element keeps its view's stride through reshape
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def _wire_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def encode(msg: Message) -> bytes:
    """Serialize one message into one binary frame."""
    return b"".join(encode_parts(msg))


def encode_parts(msg: Message) -> list[bytes | memoryview]:
    """The frame of ``msg`` as its header and zero-copy views of its tensors (``encode`` joins
    them); a large payload can then go out in fragments without a copy of the whole."""
    tensors: list[torch.Tensor] = []
    if isinstance(msg, Work):
        header: dict[str, Any] = _work_header(msg)
        tensors = [b.data for b in msg.blocks]
    elif isinstance(msg, WorkBatch):
        header = {"works": [_work_header(w) for w in msg.works]}
        tensors = [b.data for w in msg.works for b in w.blocks]
    elif isinstance(msg, Result):
        header = _result_header(msg)
        tensors = [msg.c]
    elif isinstance(msg, ResultBatch):
        header = {"results": [_result_header(r) for r in msg.results]}
        tensors = [r.c for r in msg.results]
    elif isinstance(msg, SpeedTest):
        header = {"reply_bytes": msg.reply_bytes, "token": msg.token}
        tensors = [msg.data.reshape(-1)]
    elif isinstance(msg, Blocks):
        header = {"blocks": [b.key for b in msg.blocks], "missing": list(msg.missing), "tags": list(msg.tags)}
        tensors = [b.data for b in msg.blocks]
    elif type(msg) in _PLAIN.values():
        header = {f.name: _wire_value(getattr(msg, f.name)) for f in fields(msg)}
    else:
        raise TypeError(f"not a Cleave message: {msg!r}")
    header["type"] = msg.TYPE
    header["tensors"] = [_tensor_desc(t) for t in tensors]
    head = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    parts: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(head)) + head]
    parts.extend(_raw(t) for t in tensors)
    return parts


def _work_header(msg: Work) -> dict[str, Any]:
    header: dict[str, Any] = {
        "tile_id": msg.tile_id,
        "a": msg.a,
        "b": msg.b,
        "a_t": msg.a_t,
        "b_t": msg.b_t,
        "blocks": [b.key for b in msg.blocks],
        "forget": list(msg.forget),
    }
    if msg.more:  # absent when empty: one-pair work frames are unchanged
        header["more"] = list(msg.more)
        header["more_t"] = list(msg.more_t)
    if msg.fetch:  # absent when empty, likewise
        header["fetch"] = [list(f) for f in msg.fetch]
    if msg.fetch_wait:  # absent when 0 (set only beside ``fetch``)
        header["fetch_wait"] = msg.fetch_wait
    return header


def _result_header(msg: Result) -> dict[str, Any]:
    return {"tile_id": msg.tile_id, "seconds": msg.seconds, "waited": msg.waited}


# --------------------------------------------------------------------------- decoding


def _clean(value: str) -> str:
    return "".join(ch if ch.isprintable() else " " for ch in value)


def _check(kind_of: str, name: str, meta: Any, value: Any) -> Any:
    """One field's value as the peer sent it -> the value the message holds, or ProtocolError."""
    kind = meta["kind"]
    where = f"{kind_of}.{name}"
    if kind == "int":
        if type(value) is not int:
            raise ProtocolError(f"{where} must be an integer, got {type(value).__name__}")
        if not meta["lo"] <= value <= meta["hi"]:
            raise ProtocolError(f"{where} must be between {meta['lo']} and {meta['hi']}")
        return value
    if kind == "float":
        if type(value) not in (int, float):
            raise ProtocolError(f"{where} must be a number, got {type(value).__name__}")
        try:
            value = float(value)
        except OverflowError:  # an integer literal beyond float range
            raise ProtocolError(f"{where} is out of range") from None
        if not (math.isfinite(value) and meta["lo"] <= value <= meta["hi"]):
            raise ProtocolError(f"{where} must be a finite number between {meta['lo']:g} and {meta['hi']:g}")
        return value
    if kind == "str":
        if type(value) is not str:
            raise ProtocolError(f"{where} must be a string, got {type(value).__name__}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(f"{where} is not valid Unicode (a lone surrogate?)") from None
        text, max_len = meta["text"], meta["max_len"]
        if text == "hex":
            if (value or meta.get("required")) and (len(value) != max_len or value.strip("0123456789abcdef")):
                raise ProtocolError(f"{where} must be {max_len} lowercase hex digits")
            return value
        if len(value) > max_len:
            raise ProtocolError(f"{where} is longer than {max_len} characters")
        if text == "name":
            if not value.isprintable():
                raise ProtocolError(f"{where} holds control characters")
            return value
        return _clean(value)
    if kind == "ids":
        if type(value) is not list or len(value) > meta["max_items"]:
            raise ProtocolError(f"{where} must be a list of at most {meta['max_items']} integers")
        for v in value:
            if type(v) is not int or not meta["lo"] <= v <= meta["hi"]:
                raise ProtocolError(f"{where} must hold integers between {meta['lo']} and {meta['hi']}")
        return tuple(value)
    if kind == "digests":
        if type(value) is not list or len(value) > MAX_FETCH:
            raise ProtocolError(f"{where} must be a list of at most {MAX_FETCH} digests")
        for v in value:
            if type(v) is not str or len(v) != DIGEST_HEX or v.strip("0123456789abcdef"):
                raise ProtocolError(f"{where} must hold digests of {DIGEST_HEX} lowercase hex digits")
        if len(set(value)) != len(value):
            raise ProtocolError(f"{where} names a digest twice")
        return tuple(value)
    if kind == "enum":
        try:
            return meta["enum"](value)
        except (ValueError, TypeError):
            allowed = ", ".join(e.value for e in meta["enum"])
            raise ProtocolError(f"{where} must be one of {allowed}") from None
    raise AssertionError(f"unknown field kind {kind}")  # pragma: no cover - a bug in this module


def _fields_of(cls: type[Message], header: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        if f.name in skip:
            continue
        if f.name not in header:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(f"{cls.TYPE} message lacks field {f.name!r}")
            continue
        if not f.metadata:  # StatusReply.status: any JSON object
            if not isinstance(header[f.name], dict):
                raise ProtocolError(f"{cls.TYPE}.{f.name} must be an object")
            kwargs[f.name] = header[f.name]
            continue
        kwargs[f.name] = _check(cls.TYPE, f.name, f.metadata, header[f.name])
    return kwargs


def _tensors(header: dict[str, Any], buf: bytes | bytearray, offset: int) -> list[torch.Tensor]:
    descs = header.get("tensors", [])
    most = MAX_BATCH_TENSORS if header["type"] in (WorkBatch.TYPE, ResultBatch.TYPE, Blocks.TYPE) else MAX_TENSORS
    if not isinstance(descs, list) or len(descs) > most:
        raise ProtocolError(f"'tensors' must be a list of at most {most} descriptors", Code.BAD_TENSOR)
    out: list[torch.Tensor] = []
    if descs:  # a frame without tensors needs no torch
        import torch

        dtypes = tensor_dtypes()
    for d in descs:
        dtype_name = d.get("dtype") if isinstance(d, dict) else None
        if not isinstance(dtype_name, str) or dtype_name not in dtypes or not isinstance(d.get("shape"), list):
            raise ProtocolError(f"bad tensor descriptor {str(d)[:80]}", Code.BAD_TENSOR)
        shape = d["shape"]
        if len(shape) > 4 or not all(type(s) is int and 0 <= s <= MAX_DIM for s in shape):
            raise ProtocolError(f"bad tensor shape {str(shape)[:80]}", Code.BAD_TENSOR)
        if math.prod(max(1, s) for s in shape) > MAX_ELEMENTS:  # zero-size ones too: strides must fit
            raise ProtocolError(f"tensor shape {str(shape)[:80]} is too large", Code.BAD_TENSOR)
        dtype = dtypes[dtype_name]
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if offset + nbytes > len(buf):
            raise ProtocolError("frame is shorter than its tensors say (truncated?)", Code.TRUNCATED)
        if count:
            t = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        out.append(t)
        offset += nbytes
    if offset != len(buf):
        raise ProtocolError(f"{len(buf) - offset} stray bytes after the tensors", Code.BAD_FRAME)
    return out


def _no_constants(name: str) -> Any:
    raise ProtocolError(f"header holds {name}, which JSON does not allow")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # 1e400 parses as inf: no field may hold it, nor may a status
        raise ProtocolError(f"header holds the number {literal[:40]}, beyond float range")
    return value


def _header(raw: bytes) -> dict[str, Any]:
    try:
        # UTF-8, as the protocol says (json.loads would also take UTF-16 and UTF-32 bytes).
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constants, parse_float=_finite)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("header is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer of too many digits
        raise ProtocolError(f"header is not JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("header must be an object with a string 'type'")
    return header


def decode(frame: bytes | bytearray | memoryview | str) -> Message:
    """Parse one frame. Raises ProtocolError with a peer-facing code on any malformation."""
    if isinstance(frame, str):
        raise ProtocolError("text frames are not part of the protocol; send binary", Code.TEXT_FRAME)
    if len(frame) < _PREFIX.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is too short", Code.TRUNCATED)
    magic, version, head_len = _PREFIX.unpack_from(frame, 0)
    if magic != MAGIC:
        raise ProtocolError("not a Cleave frame (bad magic)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not {PROTOCOL_VERSION}", Code.BAD_VERSION)
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(frame):
        raise ProtocolError("header length runs past the frame (truncated?)", Code.TRUNCATED)
    header = _header(bytes(frame[_PREFIX.size : _PREFIX.size + head_len]))
    kind = header["type"]
    # Tensors are views of the frame as received (websockets hands over immutable bytes): no
    # copy of the payload. Decoded tensors are only ever read (a result is verified and summed
    # into the product; a block is multiplied), never written in place.
    buf = frame if isinstance(frame, (bytes, bytearray)) else bytes(frame)
    tensors = _tensors(header, buf, _PREFIX.size + head_len)
    if kind == "work":
        return _decode_work(header, tensors)
    if kind == "result":
        if len(tensors) != 1:
            raise ProtocolError("result must carry exactly one tensor", Code.BAD_TENSOR)
        return Result(c=tensors[0], **_fields_of(Result, header, skip=("c",)))
    if kind == WorkBatch.TYPE:
        return _decode_work_batch(header, tensors)
    if kind == Blocks.TYPE:
        return _decode_blocks(header, tensors)
    if kind == ResultBatch.TYPE:
        return _decode_result_batch(header, tensors)
    if kind == "speedtest":
        if len(tensors) != 1 or tensors[0].dtype is not tensor_dtypes()["u8"] or tensors[0].dim() != 1:
            raise ProtocolError("speedtest carries one 1-D u8 tensor", Code.BAD_TENSOR)
        return SpeedTest(data=tensors[0], **_fields_of(SpeedTest, header, skip=("data",)))
    cls = _PLAIN.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind[:40]!r}", Code.UNKNOWN_TYPE)
    if tensors:
        raise ProtocolError(f"{kind} carries no tensors", Code.BAD_TENSOR)
    return cls(**_fields_of(cls, header))


def _decode_work(header: dict[str, Any], tensors: list[torch.Tensor]) -> Work:
    blocks = header.get("blocks", [])
    if not isinstance(blocks, list) or len(blocks) != len(tensors):
        raise ProtocolError("work: one block descriptor per tensor expected")
    forget = _check(
        "work", "forget", {"kind": "ids", "max_items": MAX_IDS, "lo": 0, "hi": MAX_ID}, header.get("forget", [])
    )
    key_meta = {"kind": "str", "max_len": 128, "text": "name"}
    parsed = []
    for key, t in zip(blocks, tensors):
        if t.dim() != 2:
            raise ProtocolError("work: blocks must be 2-D", Code.BAD_TENSOR)
        parsed.append(Block(_check("work", "blocks", key_meta, key), t))
    flags = [header.get(f, False) for f in ("a_t", "b_t")]
    if not all(isinstance(f, bool) for f in flags):
        raise ProtocolError("work: 'a_t' and 'b_t' must be booleans")
    more, more_t = header.get("more", []), header.get("more_t", [])
    if not isinstance(more, list) or len(more) % 2 or len(more) > 2 * MAX_PAIRS:
        raise ProtocolError(f"work: 'more' must be a list of up to {MAX_PAIRS} key pairs")
    if not isinstance(more_t, list) or len(more_t) != len(more) or not all(isinstance(f, bool) for f in more_t):
        raise ProtocolError("work: 'more_t' must be one boolean per key of 'more'")
    more = tuple(_check("work", "more", key_meta, key) for key in more)
    fetch = header.get("fetch", [])
    if not isinstance(fetch, list) or len(fetch) > 2 * (MAX_PAIRS + 1):
        raise ProtocolError(f"work: 'fetch' must be a list of up to {2 * (MAX_PAIRS + 1)} [key, digest] pairs")
    pairs_f = []
    for entry in fetch:
        if not isinstance(entry, list) or len(entry) != 2:
            raise ProtocolError("work: each of 'fetch' must be a [key, digest] pair")
        pairs_f.append((_check("work", "fetch", key_meta, entry[0]), _check("work", "fetch", _DIGEST_META, entry[1])))
    if len({k for k, _ in pairs_f} | {b.key for b in parsed}) != len(pairs_f) + len(parsed):
        raise ProtocolError("work: a block is named twice between 'blocks' and 'fetch'")
    plain = _fields_of(Work, header, skip=("a_t", "b_t", "blocks", "forget", "more", "more_t", "fetch"))
    pairs = [(plain.get("a"), plain.get("b")), *zip(more[0::2], more[1::2])]
    if len(set(pairs)) != len(pairs):  # (at most 8 pairs: a repeated block costs at most that)
        raise ProtocolError("work: a block pair appears twice")
    return Work(
        a_t=flags[0],
        b_t=flags[1],
        blocks=tuple(parsed),
        forget=forget,
        more=more,
        more_t=tuple(more_t),
        fetch=tuple(pairs_f),
        **plain,
    )


_DIGEST_META = {"kind": "str", "max_len": DIGEST_HEX, "text": "hex", "required": True}


def _decode_blocks(header: dict[str, Any], tensors: list[torch.Tensor]) -> Blocks:
    keys = header.get("blocks", [])
    if not isinstance(keys, list) or len(keys) != len(tensors):
        raise ProtocolError("blocks: one digest per tensor expected")
    digests = _check(Blocks.TYPE, "blocks", {"kind": "digests"}, keys)
    for t in tensors:
        if t.dim() != 2:
            raise ProtocolError("blocks: blocks must be 2-D", Code.BAD_TENSOR)
    plain = _fields_of(Blocks, header, skip=("blocks",))
    if plain.get("tags") and len(plain["tags"]) != len(tensors):
        raise ProtocolError("blocks: one tag per block, or none")
    return Blocks(blocks=tuple(Block(d, t) for d, t in zip(digests, tensors, strict=True)), **plain)


def _entries(header: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """A batch's list of per-tile headers: 1 to ``MAX_BATCH`` JSON objects."""
    entries = header.get(name)
    kind = header["type"]
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_BATCH:
        raise ProtocolError(f"{kind}: '{name}' must be a list of 1 to {MAX_BATCH} objects")
    if not all(isinstance(e, dict) for e in entries):
        raise ProtocolError(f"{kind}: each of '{name}' must be an object")
    return entries


def _unique(kind: str, ids: list[int]) -> None:
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"{kind}: a tile appears twice")


def _decode_work_batch(header: dict[str, Any], tensors: list[torch.Tensor]) -> WorkBatch:
    works, at = [], 0
    for entry in _entries(header, "works"):
        blocks = entry.get("blocks", [])
        if not isinstance(blocks, list) or at + len(blocks) > len(tensors):
            raise ProtocolError("work_batch: its works name more blocks than it carries")
        works.append(_decode_work({**entry, "type": Work.TYPE}, tensors[at : at + len(blocks)]))
        at += len(blocks)
    if at != len(tensors):
        raise ProtocolError("work_batch: one block descriptor per tensor expected")
    _unique(WorkBatch.TYPE, [w.tile_id for w in works])
    return WorkBatch(tuple(works))


def _decode_result_batch(header: dict[str, Any], tensors: list[torch.Tensor]) -> ResultBatch:
    entries = _entries(header, "results")
    if len(tensors) != len(entries):
        raise ProtocolError("result_batch must carry one tensor per result", Code.BAD_TENSOR)
    results = tuple(
        Result(c=c, **_fields_of(Result, {**entry, "type": Result.TYPE}, skip=("c",)))
        for entry, c in zip(entries, tensors, strict=True)
    )
    _unique(ResultBatch.TYPE, [r.tile_id for r in results])
    return ResultBatch(results)
