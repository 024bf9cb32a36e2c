"""Cleave's wire protocol: every message that crosses a websocket, in one module.

One message is one binary websocket frame:

    magic      b"CLV"        3 bytes
    version    u8            PROTOCOL_VERSION
    header_len u32, little-endian
    header     UTF-8 JSON object, keys sorted: {"type": ..., fields..., "tensors": [...]}
    payload    raw little-endian tensor bytes, back to back, in the order of header["tensors"]

Tensor payloads are never pickled and never compressed (floats barely compress and
permessage-deflate is 30x slower than the link). Decoding validates everything: a malformed
frame raises ``ProtocolError`` (with a short code for the peer), never ``KeyError`` or
``struct.error``.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Union

import torch

PROTOCOL_VERSION = 1
MAGIC = b"CLV"
_PREFIX = struct.Struct("<3sBI")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 20
MAX_DIM = 1 << 27  # elements along one dimension (a 1-D speed-test payload reaches 64 Mi)
MAX_SPEEDTEST_BYTES = 64 << 20

# Wire names of the tensor dtypes a tile may use.
DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "u8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("Cleave's wire format assumes a little-endian machine")


# Websocket close codes (4000-4999 are free for applications in RFC 6455).
CLOSE_FINISHED = 1000  # normal closure once the job is over
CLOSE_PROTOCOL = 4000  # malformed frame or unknown message
CLOSE_AUTH = 4001  # wrong token
CLOSE_BANNED = 4003  # too many rejected results
CLOSE_SILENT = 4008  # no heartbeat within the timeout


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol. ``code`` is sent back to the peer."""

    def __init__(self, message: str, code: str = "bad_frame") -> None:
        super().__init__(message)
        self.code = code


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
class Hello:
    """Client -> coordinator, first message of a device: who it is and what it can do."""

    TYPE: ClassVar[str] = "hello"
    token: str
    name: str
    platform: str = ""
    cores: int = 1
    memory_bytes: int = 0
    device: str = "cpu"
    gflops: float = 0.0
    slots: int = 2
    client_version: str = ""
    block_budget: int = 0  # bytes of input blocks the device will cache; 0: no limit


@dataclass(frozen=True)
class StatusRequest:
    """Observer -> coordinator: ask for one status snapshot (``cleave status``)."""

    TYPE: ClassVar[str] = "status_request"
    token: str


@dataclass(frozen=True)
class Result:
    """Client -> coordinator: the C block of a tile, and how long the matmul took."""

    TYPE: ClassVar[str] = "result"
    tile_id: int
    c: torch.Tensor
    seconds: float = 0.0


@dataclass(frozen=True)
class Leave:
    """Client -> coordinator: the device is going away; re-queue its tiles now."""

    TYPE: ClassVar[str] = "leave"
    reason: str = ""


@dataclass(frozen=True)
class Release:
    """Client -> coordinator: give these leased tiles back (e.g. a block went missing); they are
    re-queued at once and their blocks are sent again with the next Work."""

    TYPE: ClassVar[str] = "release"
    tile_ids: tuple[int, ...]
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat:
    """Either way, every few seconds: "I am alive". A device silent for too long is presumed
    frozen and its tiles go to others; a client that hears nothing reconnects."""

    TYPE: ClassVar[str] = "heartbeat"
    sent_at: float = 0.0


@dataclass(frozen=True)
class Cancel:
    """Coordinator -> client: another copy of these tiles was verified first; drop them."""

    TYPE: ClassVar[str] = "cancel"
    tile_ids: tuple[int, ...]
    reason: str = ""


@dataclass(frozen=True)
class Pause:
    """Client -> coordinator: the owner needs the machine (``reason``); take my tiles back now,
    keep me connected, send nothing until Resume."""

    TYPE: ClassVar[str] = "pause"
    reason: str = ""


@dataclass(frozen=True)
class Resume:
    """Client -> coordinator: the machine is free again."""

    TYPE: ClassVar[str] = "resume"


@dataclass(frozen=True)
class Credit:
    """Coordinator -> client: verified work so far, in GFLOP: this connection's, and everything
    done under its name in this coordinator's database."""

    TYPE: ClassVar[str] = "credit"
    device_gflop: float = 0.0
    name_gflop: float = 0.0


@dataclass(frozen=True)
class SpeedTest:
    """Observer <-> coordinator link test: the coordinator answers with ``reply_bytes`` of
    payload (at most 64 MiB); ``data`` carries the upload. Used by ``cleave benchmark --url``."""

    TYPE: ClassVar[str] = "speedtest"
    reply_bytes: int
    data: torch.Tensor


@dataclass(frozen=True)
class Welcome:
    """Coordinator -> client, answer to Hello. ``heartbeat`` is the interval the client must keep."""

    TYPE: ClassVar[str] = "welcome"
    device_id: int
    job: str
    slots: int
    heartbeat: float = 2.0


@dataclass(frozen=True)
class Work:
    """Coordinator -> client: compute ``C = A @ B`` for one tile.

    ``A`` is the cached block ``a`` (transposed when ``a_t``), ``B`` likewise. ``blocks`` carries
    the blocks this device does not hold yet; ``forget`` lists key namespaces it may drop.
    """

    TYPE: ClassVar[str] = "work"
    tile_id: int
    a: str
    b: str
    a_t: bool = False
    b_t: bool = False
    blocks: tuple[Block, ...] = ()
    forget: tuple[int, ...] = ()

    def operands(self, cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(A, B)`` from a device's block cache, or None when a block is missing."""
        a, b = cache.get(self.a), cache.get(self.b)
        if a is None or b is None:
            return None
        return (a.t() if self.a_t else a), (b.t() if self.b_t else b)


@dataclass(frozen=True)
class StatusReply:
    """Coordinator -> observer: a JSON snapshot of the job, devices and tiles."""

    TYPE: ClassVar[str] = "status"
    status: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finished:
    """Coordinator -> client: the job is over; a client started with --once exits."""

    TYPE: ClassVar[str] = "finished"
    reason: str = "job complete"


@dataclass(frozen=True)
class Error:
    """Coordinator -> client: something the peer sent was refused. Never a traceback."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str


Message = Union[
    Hello, StatusRequest, Result, Leave, Release, Heartbeat, Cancel, Pause, Resume, Credit, SpeedTest, Welcome, Work,
    StatusReply, Finished, Error,
]
_PLAIN: dict[str, type] = {
    cls.TYPE: cls
    for cls in (Hello, StatusRequest, Leave, Release, Heartbeat, Cancel, Pause, Resume, Credit, Welcome,
                StatusReply, Finished, Error)
}
_FIELD_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (float, int), "str": (str,)}


# --------------------------------------------------------------------------- encoding


def _tensor_desc(t: torch.Tensor) -> dict[str, Any]:
    if t.dtype not in _DTYPE_NAMES:
        raise ProtocolError(f"dtype {t.dtype} cannot travel", "bad_dtype")
    return {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)}


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def encode(msg: Message) -> bytes:
    """Serialize one message into one binary frame."""
    tensors: list[torch.Tensor] = []
    if isinstance(msg, Work):
        header: dict[str, Any] = {
            "tile_id": msg.tile_id,
            "a": msg.a,
            "b": msg.b,
            "a_t": msg.a_t,
            "b_t": msg.b_t,
            "blocks": [b.key for b in msg.blocks],
            "forget": list(msg.forget),
        }
        tensors = [b.data for b in msg.blocks]
    elif isinstance(msg, Result):
        header = {"tile_id": msg.tile_id, "seconds": msg.seconds}
        tensors = [msg.c]
    elif isinstance(msg, SpeedTest):
        header = {"reply_bytes": msg.reply_bytes}
        tensors = [msg.data.reshape(-1)]
    elif type(msg) in _PLAIN.values():
        header = {f.name: getattr(msg, f.name) for f in fields(msg)}
        header = {k: list(v) if isinstance(v, tuple) else v for k, v in header.items()}
    else:
        raise TypeError(f"not a Cleave message: {msg!r}")
    header["type"] = msg.TYPE
    header["tensors"] = [_tensor_desc(t) for t in tensors]
    head = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    parts: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, PROTOCOL_VERSION, len(head)), head]
    parts.extend(_raw(t) for t in tensors)
    return b"".join(parts)


# --------------------------------------------------------------------------- decoding


def _field(header: dict[str, Any], name: str, kind: str, default: Any = ...) -> Any:
    if name not in header:
        if default is ...:
            raise ProtocolError(f"{header.get('type')!s} message lacks field {name!r}")
        return default
    value = header[name]
    if isinstance(value, bool) or not isinstance(value, _FIELD_TYPES[kind]):
        raise ProtocolError(f"field {name!r} must be {kind}, got {type(value).__name__}")
    if kind == "float":
        value = float(value)
        if not math.isfinite(value):
            raise ProtocolError(f"field {name!r} must be finite")
    return value


def _decode_plain(cls: type, header: dict[str, Any]) -> Message:
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        kind = {"str": "str", "int": "int", "float": "float"}.get(str(f.type))
        if str(f.type) == "tuple[int, ...]":
            value = header.get(f.name)
            if not isinstance(value, list) or len(value) > 1024 or not all(type(v) is int for v in value):
                raise ProtocolError(f"field {f.name!r} must be a list of at most 1024 ints")
            kwargs[f.name] = tuple(value)
            continue
        if kind is None:  # StatusReply.status: any JSON object
            value = header.get(f.name, {})
            if not isinstance(value, dict):
                raise ProtocolError(f"field {f.name!r} must be an object")
            kwargs[f.name] = value
            continue
        kwargs[f.name] = _field(header, f.name, kind, ... if f.default is MISSING else f.default)
    return cls(**kwargs)



def _tensors(header: dict[str, Any], buf: bytearray, offset: int) -> list[torch.Tensor]:
    descs = header.get("tensors", [])
    if not isinstance(descs, list):
        raise ProtocolError("'tensors' must be a list")
    out: list[torch.Tensor] = []
    for d in descs:
        if not isinstance(d, dict) or d.get("dtype") not in DTYPES or not isinstance(d.get("shape"), list):
            raise ProtocolError(f"bad tensor descriptor {d!r}", "bad_tensor")
        shape = d["shape"]
        if len(shape) > 4 or not all(type(s) is int and 0 <= s <= MAX_DIM for s in shape):
            raise ProtocolError(f"bad tensor shape {shape!r}", "bad_tensor")
        dtype = DTYPES[d["dtype"]]
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        if offset + nbytes > len(buf):
            raise ProtocolError("frame is shorter than its tensors say (truncated?)", "truncated")
        if count:
            t = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        out.append(t)
        offset += nbytes
    if offset != len(buf):
        raise ProtocolError(f"{len(buf) - offset} stray bytes after the tensors", "bad_frame")
    return out


def decode(frame: bytes | bytearray | memoryview | str) -> Message:
    """Parse one frame. Raises ProtocolError with a peer-facing code on any malformation."""
    if isinstance(frame, str):
        raise ProtocolError("text frames are not part of the protocol; send binary", "text_frame")
    if len(frame) < _PREFIX.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is too short", "truncated")
    magic, version, head_len = _PREFIX.unpack_from(frame, 0)
    if magic != MAGIC:
        raise ProtocolError("not a Cleave frame (bad magic)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not {PROTOCOL_VERSION}", "bad_version")
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(frame):
        raise ProtocolError("header length runs past the frame (truncated?)", "truncated")
    try:
        header = json.loads(bytes(frame[_PREFIX.size : _PREFIX.size + head_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("header must be an object with a string 'type'")
    kind = header["type"]
    # One copy into a writable buffer so tensors are zero-copy views of it.
    buf = bytearray(frame)
    tensors = _tensors(header, buf, _PREFIX.size + head_len)
    if kind == "work":
        blocks = header.get("blocks", [])
        forget = header.get("forget", [])
        if not isinstance(blocks, list) or len(blocks) != len(tensors):
            raise ProtocolError("work: one block descriptor per tensor expected")
        if not isinstance(forget, list) or not all(type(g) is int for g in forget):
            raise ProtocolError("work: 'forget' must be a list of ints")
        parsed = []
        for key, t in zip(blocks, tensors):
            if not isinstance(key, str):
                raise ProtocolError("work: block keys must be strings")
            if t.dim() != 2:
                raise ProtocolError("work: blocks must be 2-D", "bad_tensor")
            parsed.append(Block(key, t))
        flags = [header.get(f, False) for f in ("a_t", "b_t")]
        if not all(isinstance(f, bool) for f in flags):
            raise ProtocolError("work: 'a_t' and 'b_t' must be booleans")
        return Work(
            tile_id=_field(header, "tile_id", "int"),
            a=_field(header, "a", "str"),
            b=_field(header, "b", "str"),
            a_t=flags[0],
            b_t=flags[1],
            blocks=tuple(parsed),
            forget=tuple(forget),
        )
    if kind == "result":
        if len(tensors) != 1:
            raise ProtocolError("result must carry exactly one tensor", "bad_tensor")
        return Result(
            tile_id=_field(header, "tile_id", "int"),
            c=tensors[0],
            seconds=_field(header, "seconds", "float", 0.0),
        )
    if kind == "speedtest":
        if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].dim() != 1:
            raise ProtocolError("speedtest carries one 1-D u8 tensor", "bad_tensor")
        reply = _field(header, "reply_bytes", "int")
        if not 0 <= reply <= MAX_SPEEDTEST_BYTES:
            raise ProtocolError(f"speedtest reply_bytes must be between 0 and {MAX_SPEEDTEST_BYTES}")
        return SpeedTest(reply, tensors[0])
    cls = _PLAIN.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message type {kind!r}", "unknown_type")
    if tensors:
        raise ProtocolError(f"{kind} carries no tensors", "bad_tensor")
    return _decode_plain(cls, header)
