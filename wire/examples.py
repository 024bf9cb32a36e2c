"""The example frames and the credential test vector of docs/protocol.md, rendered from the real
encoder and ``auth`` so that the page cannot drift from the code.

    python -m cleave.wire.examples                             print every example
    python -m cleave.wire.examples --write docs/protocol.md    rewrite the page's examples
    python -m cleave.wire.examples --check docs/protocol.md    exit 1 if the page differs

In the page, each example sits between marker comments: ``<!-- frame:NAME -->`` and
``<!-- /frame -->`` around a frame, ``<!-- vector:proof -->`` and ``<!-- /vector -->`` around the
test vector. Only the text between the markers is rewritten; tests/wire/test_protocol_doc.py fails
when it differs from what this module renders.

The examples tell one story: the device enrolled earlier as identity 42 answers a challenge with
the vector's proof, is welcomed, computes three tiles (one block pair; two pairs summed; a bf16
pair), then two more that came in one batch and go back in one, and gives one back. Each result
is computed from its ``work`` example's blocks.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import re
import struct
import sys
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import TypedDict

import torch

from cleave.wire import auth
from cleave.wire.codes import Code, EnergySource, RelayFault, ReleaseWhy, StandbyWhy
from cleave.wire.digest import block_digest, relay_tag, relay_ticket
from cleave.wire.messages import (
    MAGIC,
    Block,
    BlockRequest,
    Blocks,
    Cancel,
    Challenge,
    Credential,
    Energy,
    Error,
    Heartbeat,
    Hello,
    Message,
    Redirect,
    RelayReport,
    Release,
    Result,
    ResultBatch,
    Standby,
    UseRelay,
    Wake,
    Welcome,
    Work,
    WorkBatch,
    encode,
    tensor_dtypes,
)

WRITE_COMMAND = "python -m cleave.wire.examples --write docs/protocol.md"

# --------------------------------------------------------------------------- the credential vector

SECRET = bytes(range(32))  # S: 00 01 ... 1f (a real one is 32 random bytes)
NONCE = bytes(range(32, 64))  # N: 20 21 ... 3f (a real one is 32 random bytes, fresh per connection)
IDENTITY = 42
COORDINATOR = "5ca1ab1e0ddba11c0ffee0ddf00d1e55"  # a coordinator's id: 16 random bytes, hex
# The strings auth.py prefixes; ``vector`` checks them against auth.proof, so a change there fails.
IDENTITY_PREFIX = b"cleave-identity-v1|"
AUTH_PREFIX = "cleave-auth-v1|{identity}|"


class Vector(TypedDict):
    """The proof's test vector by the names the page gives its values."""

    S: bytes
    identity: int
    N: bytes
    K: bytes
    M: bytes
    H: bytes
    proof: bytes


def vector() -> Vector:
    """The proof's test vector: inputs and every intermediate value, as raw bytes."""
    key = hashlib.sha256(IDENTITY_PREFIX + SECRET).digest()
    message = AUTH_PREFIX.format(identity=IDENTITY).encode("ascii") + NONCE
    mac = hmac.new(key, message, hashlib.sha256).digest()
    proof = bytes(s ^ h for s, h in zip(SECRET, mac))
    if key != auth.stored_key(SECRET) or proof != auth.proof(SECRET, IDENTITY, NONCE):
        raise RuntimeError("wire/auth.py no longer computes the proof this module documents")
    return {"S": SECRET, "identity": IDENTITY, "N": NONCE, "K": key, "M": message, "H": mac, "proof": proof}


def render_vector() -> str:
    """The vector as the page shows it: one value a line, bytes in lowercase hex."""
    v = vector()
    prefix = IDENTITY_PREFIX.decode("ascii")
    auth_prefix = AUTH_PREFIX.format(identity=IDENTITY)
    rows = [
        ("S", "secret, credential.secret", v["S"]),
        ("identity", "hello.identity, in M as decimal ASCII", v["identity"]),
        ("N", "nonce, challenge.nonce", v["N"]),
        ("K", f'SHA-256("{prefix}" || S)', v["K"]),
        ("M", f'"{auth_prefix}" || N  ({len(v["M"])} bytes)', v["M"]),
        ("H", "HMAC-SHA256(key K, message M)", v["H"]),
        ("proof", "S xor H, hello.proof", v["proof"]),
    ]
    lines = []
    for name, what, value in rows:
        text = value.hex() if isinstance(value, bytes) else str(value)
        lines.append(f"{name:<8} {what}")
        lines.append(f"         {text}")
    return "```\n" + "\n".join(lines) + "\n```\n"


# --------------------------------------------------------------------------- the example messages


def _f32(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _bf16(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bfloat16)


class _HelloFields(TypedDict):
    """What every example hello says of its device."""

    name: str
    platform: str
    cores: int
    memory_bytes: int
    device: str
    gflops: float
    slots: int
    batch: int
    client_version: str
    block_budget: int


_COMMON = _HelloFields(
    name="lab-pc-3",
    platform="Linux-6.8.0-x86_64",
    cores=8,
    memory_bytes=16 << 30,
    device="cpu",
    gflops=85.5,
    slots=2,
    batch=2,
    client_version="0.1.0",
    block_budget=4 << 30,
)

# A tile: A is block 12.0.2x3 as it is, B is block 13.0.2x3 transposed; namespace 5 is dropped.
WORK = Work(
    tile_id=7,
    a="12.0.2x3",
    b="13.0.2x3",
    b_t=True,
    blocks=(
        Block("12.0.2x3", _f32([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])),
        Block("13.0.2x3", _f32([[1.0, 0.0, -1.0], [0.5, 0.5, 0.5]])),
    ),
    forget=(5,),
)
# A tile summed over two block pairs: A0 @ B0 + A1 @ B1. A0 (12.0.2x3) is cached from WORK and
# not sent again; A1 is used as it is, B1 transposed.
WORK_MORE = Work(
    tile_id=8,
    a="12.0.2x3",
    b="14.0.3x2",
    blocks=(
        Block("14.0.3x2", _f32([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])),
        Block("15.0.2x2", _f32([[2.0, 0.0], [0.0, 2.0]])),
        Block("16.0.2x2", _f32([[0.25, 0.5], [-1.0, 1.0]])),
    ),
    more=("15.0.2x2", "16.0.2x2"),
    more_t=(False, True),
)
# A bf16 tile: 1 + 2^-8 + 2^-8. Summed in float32 and rounded once it is 1 + 2^-7 (1.0078125);
# summed in bf16, each 2^-8 is lost to rounding (a tie, to even) and the sum stays 1.0.
WORK_BF16 = Work(
    tile_id=9,
    a="17.0.1x3",
    b="18.0.3x1",
    blocks=(
        Block("17.0.1x3", _bf16([[1.0, 2.0**-8, 2.0**-8]])),
        Block("18.0.3x1", _bf16([[1.0], [1.0], [1.0]])),
    ),
)


# Two tiles in one frame: the first reuses block 12.0.2x3 (cached from WORK) with a new B; the
# second reads that new block, sent with the first, as its A (blocks serve the tiles after them).
WORK_BATCH = WorkBatch(
    (
        Work(
            tile_id=19,
            a="12.0.2x3",
            b="20.0.3x1",
            blocks=(Block("20.0.3x1", _f32([[1.0], [1.0], [1.0]])),),
        ),
        Work(
            tile_id=20,
            a="20.0.3x1",
            b="21.0.1x2",
            blocks=(Block("21.0.1x2", _f32([[2.0, -1.0]])),),
        ),
    )
)


# Relays: relay 4 (whose key is K = H(S) of its secret S, here bytes 32..63) serves device 3.
RELAY_KEY = auth.stored_key(bytes(range(32, 64)))
RELAY_BLOCK = _f32([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
RELAY_DIGEST = block_digest(RELAY_BLOCK)
WRONG_DIGEST = block_digest(_f32([[1.0, 1.0, 0.0], [0.0, 2.0, 1.5]]))  # what a lying relay sent instead
# A tile whose B the device takes from its relay: WORK's A (cached), B named by its digest.
WORK_FETCH = Work(tile_id=22, a="12.0.2x3", b="23.0.2x3", b_t=True, fetch=(("23.0.2x3", RELAY_DIGEST),), fetch_wait=3.0)


def product(work: Work, cache: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """A work message's ``C``, as a device must compute it: every block pair's product summed in
    float32 and rounded once to the blocks' dtype."""
    held = dict(cache or {})
    held.update({blk.key: blk.data for blk in work.blocks})
    operands = work.operands(held)
    if operands is None:
        raise ValueError(f"work {work.tile_id} names a block the cache does not hold")
    a, b = operands
    return (a.float() @ b.float()).to(a.dtype)


def examples() -> dict[str, Message]:
    """Every example message of the page, by the name its markers use, in session order."""
    v = vector()
    cache = {blk.key: blk.data for blk in WORK.blocks}  # the device holds WORK's blocks by then
    batch_cache = {**cache, **{blk.key: blk.data for w in WORK_BATCH.works for blk in w.blocks}}
    return {
        "challenge": Challenge(nonce=NONCE.hex(), coordinator=COORDINATOR),
        "hello-enrol": Hello(token="s3cret", **_COMMON),
        "credential": Credential(identity=IDENTITY, secret=SECRET.hex()),
        "hello-credential": Hello(identity=IDENTITY, proof=v["proof"].hex(), **_COMMON),
        "welcome": Welcome(device_id=3, identity=IDENTITY, job="tiny, 200 steps", slots=2, heartbeat=2.0),
        "work": WORK,
        "result": Result(tile_id=WORK.tile_id, c=product(WORK), seconds=0.25, waited=0.125),
        "work-more": WORK_MORE,
        "result-more": Result(tile_id=WORK_MORE.tile_id, c=product(WORK_MORE, cache), seconds=0.5, waited=0.0),
        "work-bf16": WORK_BF16,
        "result-bf16": Result(tile_id=WORK_BF16.tile_id, c=product(WORK_BF16), seconds=0.125, waited=0.0),
        "work-batch": WORK_BATCH,
        "result-batch": ResultBatch(
            tuple(
                Result(tile_id=w.tile_id, c=product(w, batch_cache), seconds=0.0625, waited=waited)
                for w, waited in zip(WORK_BATCH.works, (0.0, 0.0625), strict=True)
            )
        ),
        "release": Release(tile_ids=(10,), why=ReleaseWhy.MISSING_BLOCK),
        "cancel": Cancel(tile_ids=(11,), reason="another copy was verified first"),
        "error": Error(code=Code.NOT_LEASED, message="tile 12 is not leased to you; result ignored"),
        "heartbeat": Heartbeat(sent_at=1767225600.5),
        # The plans leave the device out: it sleeps, beating once a minute, until it is woken.
        "standby": Standby(keepalive=60.0, reason=StandbyWhy.UNPLANNED),
        "wake": Wake(),
        # A newcomer at a rank of a tier whose pool is strong: sent to rank 1 with a ticket, which
        # it presents there instead of the join token (the ticket is opaque to the device).
        "redirect": Redirect(
            url="wss://rank1.example.org:8765",
            rank=1,
            ticket=auth.redirect_ticket(b"the tier's secret", 1, 1767225900, bytes(range(16))).hex(),
            reason="rank 1's pool (120 GFLOP/s) needs devices more",
        ),
        "hello-ticket": Hello(
            ticket=auth.redirect_ticket(b"the tier's secret", 1, 1767225900, bytes(range(16))).hex(), **_COMMON
        ),
        "hello-relay": Hello(name="uni-relay-1", token="s3cret", relay="wss://relay1.example.edu:8766"),
        "use-relay": UseRelay(
            relay=4, url="wss://relay1.example.edu:8766", ticket=relay_ticket(RELAY_KEY, 4, 3), wait=1.0
        ),
        "work-fetch": WORK_FETCH,
        "block-request": BlockRequest(digests=(RELAY_DIGEST,), device=3, ticket=relay_ticket(RELAY_KEY, 4, 3)),
        "blocks": Blocks(
            blocks=(Block(RELAY_DIGEST, RELAY_BLOCK),), tags=(relay_tag(RELAY_KEY, RELAY_DIGEST, RELAY_DIGEST),)
        ),
        "relay-report": RelayReport(
            relay=4,
            fault=RelayFault.WRONG,
            digest=RELAY_DIGEST,
            got=WRONG_DIGEST,
            tag=relay_tag(RELAY_KEY, RELAY_DIGEST, WRONG_DIGEST),
        ),
        "energy": Energy(joules=1520.5, seconds=30.0, source=EnergySource.RAPL, gpu_joules=0.0, grid_gco2_kwh=250.0),
    }


# --------------------------------------------------------------------------- rendering

_PREFIX = struct.Struct("<3sBI")
_WIRE_NAMES = {dtype: name for name, dtype in tensor_dtypes().items()}
_HEAD = "offset  size  field       "  # the byte column starts here
_PAD = " " * len(_HEAD)


def _value(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"<{_WIRE_NAMES[value.dtype]} {list(value.shape)}>"
    if isinstance(value, Block):
        return f"Block({value.key!r}, {_value(value.data)})"
    if isinstance(value, (Work, Result)):  # inside a batch
        return constructor(value)
    if isinstance(value, Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, tuple):
        inner = ", ".join(_value(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    return repr(value)


def constructor(msg: Message) -> str:
    """``msg`` as the Python call that builds it (every field, tensors abridged)."""
    args = ", ".join(f"{f.name}={_value(getattr(msg, f.name))}" for f in fields(msg))
    return f"{type(msg).__name__}({args})"


def _hex(data: bytes) -> str:
    return " ".join(f"{x:02x}" for x in data)


def _tensor_rows(t: torch.Tensor) -> list[str]:
    """One pair of lines per row: each element's little-endian bytes, and under them its value."""
    if t.numel() == 0:
        return [_PAD + "(no bytes)"]
    rows = t.reshape(1, -1) if t.dim() < 2 else t.reshape(t.shape[0], -1)
    size = t.element_size()
    out = []
    for i, row in enumerate(rows):
        raw = row.contiguous().view(torch.uint8).numpy().tobytes()
        cells = [_hex(raw[j : j + size]) for j in range(0, len(raw), size)]
        values = [repr(x) for x in row.tolist()]
        width = [max(len(c), len(v)) for c, v in zip(cells, values)]
        label = f"row {i}: " if t.dim() >= 2 else ""
        out.append(_PAD + label + "  ".join(c.ljust(w) for c, w in zip(cells, width)).rstrip())
        out.append(_PAD + " " * len(label) + "  ".join(v.ljust(w) for v, w in zip(values, width)).rstrip())
    return out


def _tensors_of(msg: Message) -> list[tuple[str, torch.Tensor]]:
    if isinstance(msg, Work):
        return [(f'block "{blk.key}"', blk.data) for blk in msg.blocks]
    if isinstance(msg, Result):
        return [("C", msg.c)]
    if isinstance(msg, WorkBatch):
        return [(f'work {w.tile_id}, block "{blk.key}"', blk.data) for w in msg.works for blk in w.blocks]
    if isinstance(msg, ResultBatch):
        return [(f"result {r.tile_id}, C", r.c) for r in msg.results]
    if isinstance(msg, Blocks):
        return [(f"block {blk.key[:12]}...", blk.data) for blk in msg.blocks]
    return []


def render_frame(msg: Message) -> str:
    """The page's text for one frame: its constructor, size, prefix, header and payload, every
    byte of it taken from ``encode(msg)``."""
    frame = encode(msg)
    magic, version, head_len = _PREFIX.unpack_from(frame)
    header = frame[_PREFIX.size : _PREFIX.size + head_len].decode("utf-8")
    payload = len(frame) - _PREFIX.size - head_len
    lines = [
        constructor(msg),
        f"{len(frame)} bytes: 8-byte prefix, {head_len}-byte header, {payload}-byte payload",
        "",
        _HEAD + "bytes",
        f"{0:<8}{3:<6}{'magic':<12}{_hex(magic)}  ({magic.decode('ascii')!r})",
        f"{3:<8}{1:<6}{'version':<12}{_hex(frame[3:4])}  ({version})",
        f"{4:<8}{4:<6}{'header_len':<12}{_hex(frame[4:8])}  ({head_len}, u32 little-endian)",
        f"{8:<8}{head_len:<6}{'header':<12}{header}",
    ]
    offset = _PREFIX.size + head_len
    for i, (what, t) in enumerate(_tensors_of(msg)):
        nbytes = t.numel() * t.element_size()
        lines.append(f"{offset:<8}{nbytes:<6}{f'tensor {i}':<12}{what}: {_WIRE_NAMES[t.dtype]} {list(t.shape)}")
        lines.extend(_tensor_rows(t))
        offset += nbytes
    if offset != len(frame):  # pragma: no cover - a message kind whose tensors this module misses
        raise RuntimeError(f"{type(msg).__name__}: rendered {offset} of {len(frame)} bytes")
    if magic != MAGIC:  # pragma: no cover
        raise RuntimeError("encode no longer starts frames with MAGIC")
    return "```\n" + "\n".join(line.rstrip() for line in lines) + "\n```\n"


def render(kind: str, name: str) -> str:
    """The text that belongs between the markers ``<!-- kind:name -->`` and ``<!-- /kind -->``."""
    if kind == "vector" and name == "proof":
        return render_vector()
    if kind == "frame":
        found = examples().get(name)
        if found is not None:
            return render_frame(found)
    raise KeyError(f"no example <!-- {kind}:{name} -->")


# --------------------------------------------------------------------------- the page

MARKED = re.compile(r"(<!-- (frame|vector):([a-z0-9-]+) -->\n)(.*?)(<!-- /\2 -->)", re.S)


def regions(page: str) -> list[tuple[str, str, str]]:
    """``(kind, name, text)`` of every marked region of ``page``, in order."""
    return [(m.group(2), m.group(3), m.group(4)) for m in MARKED.finditer(page)]


def rewrite(page: str) -> str:
    """``page`` with every marked region replaced by what this module renders for it."""
    return MARKED.sub(lambda m: m.group(1) + render(m.group(2), m.group(3)) + m.group(5), page)


def main(argv: list[str] | None = None) -> int:
    """Print the examples, or rewrite (``--write``) or check (``--check``) a page's copies."""
    parser = argparse.ArgumentParser(prog="python -m cleave.wire.examples", description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="PAGE", help="rewrite the marked examples of PAGE in place")
    group.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if PAGE's marked examples differ")
    args = parser.parse_args(argv)
    if args.write is None and args.check is None:
        sys.stdout.write(render_vector())
        for name, msg in examples().items():
            sys.stdout.write(f"\n<!-- frame:{name} -->\n{render_frame(msg)}")
        return 0
    page_path: Path = args.write or args.check
    page = page_path.read_text(encoding="utf-8")
    fresh = rewrite(page)
    if args.check is not None:
        if fresh != page:
            print(f"{page_path}: examples differ from the encoder's; run {WRITE_COMMAND}", file=sys.stderr)
            return 1
        return 0
    if fresh != page:
        page_path.write_text(fresh, encoding="utf-8")
    print(f"{page_path}: {len(regions(fresh))} examples up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
