"""docs/protocol.md against the code: its example frames are the encoder's bytes, its credential
test vector is what the proof computes, the limits it quotes are the constants' values, and what
it says the decoder accepts is what the decoder accepts. The page cannot drift from the code.

The examples are rendered by wire/examples.py; a stale page is fixed with
``python -m cleave.wire.examples --write docs/protocol.md``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from cleave.client.runner import MAX_FRAME
from cleave.coordinator.engine.limits import Limits, TrustPolicy
from cleave.wire import auth, examples, messages
from cleave.wire.errors import ProtocolError
from cleave.wire.messages import PROTOCOL_VERSION, Hello, Result, Work, decode, encode

DOC = ROOT / "docs" / "protocol.md"
FIX = f"docs/protocol.md is stale: run {examples.WRITE_COMMAND}"


def _page() -> str:
    return DOC.read_text(encoding="utf-8")


def _regions(kind: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for k, name, text in examples.regions(_page()):
        if k == kind:
            found.setdefault(name, text)
    return found


# --------------------------------------------------------------------------- generated text


def test_every_marked_example_is_what_the_encoder_renders() -> None:
    regions = examples.regions(_page())
    assert regions, "docs/protocol.md has no <!-- frame:NAME --> regions"
    for kind, name, text in regions:
        assert text == examples.render(kind, name), f"<!-- {kind}:{name} --> differs from the code; {FIX}"


def test_every_example_and_the_vector_are_on_the_page() -> None:
    assert set(_regions("frame")) == set(examples.examples()), FIX
    assert set(_regions("vector")) == {"proof"}, FIX


def test_check_fails_on_a_stale_page_and_write_repairs_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page = tmp_path / "protocol.md"
    page.write_text(_page().replace('"tile_id":7', '"tile_id":8', 1), encoding="utf-8")
    assert examples.main(["--check", str(page)]) == 1
    assert examples.WRITE_COMMAND in capsys.readouterr().err
    assert examples.main(["--write", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == _page()
    assert examples.main(["--check", str(page)]) == 0


# --------------------------------------------------------------------------- frames, read as an outsider would

_ROW = re.compile(r"^(\d+)\s+(\d+)\s+(magic|version|header_len|header|tensor \d+)\s+(.*)$")
_TENSOR = re.compile(r": (f32|f16|bf16|u8) \[([\d, ]*)\]$")
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1}


def _element(dtype: str, raw: bytes) -> float:
    if dtype == "f32":
        return struct.unpack("<f", raw)[0]
    if dtype == "f16":
        return struct.unpack("<e", raw)[0]
    if dtype == "bf16":  # the upper half of a float32
        return struct.unpack("<f", b"\0\0" + raw)[0]
    return raw[0]


def _read_frame(text: str) -> tuple[str, int, bytes]:
    """(constructor, stated length, the bytes) of one rendered example, from its text alone; each
    value printed under a tensor's bytes is checked against those bytes."""
    lines = text.removeprefix("```\n").removesuffix("```\n").splitlines()
    constructor, sizes = lines[0], lines[1]
    stated = int(sizes.split(" bytes:")[0])
    frame = b""
    dtype = ""
    pending: list[str] = []  # a tensor row's byte cells, waiting for their values line
    for line in lines[4:]:
        row = _ROW.match(line)
        if row is not None:
            offset, size, field, rest = int(row[1]), int(row[2]), row[3], row[4]
            assert offset == len(frame), f"{constructor}: {field} at {offset}, expected {len(frame)}"
            if field == "header":
                frame += rest.encode("utf-8")
            elif field.startswith("tensor"):
                desc = _TENSOR.search(rest)
                assert desc is not None, line
                dtype = desc[1]
                continue
            else:
                frame += bytes.fromhex(rest.split("  (")[0])
            assert len(frame) - offset == size, f"{constructor}: {field} is {len(frame) - offset} bytes, not {size}"
            continue
        body = re.sub(r"^\s*row \d+: ", "", line).strip()
        if body == "(no bytes)":
            continue
        if not pending:
            octets = body.split()
            size = _ITEMSIZE[dtype]
            pending = ["".join(octets[i : i + size]) for i in range(0, len(octets), size)]
            frame += bytes.fromhex("".join(octets))
            continue
        values = body.split()
        assert len(values) == len(pending), line
        for cell, value in zip(pending, values):
            assert _element(dtype, bytes.fromhex(cell)) == float(value), f"{constructor}: {cell} is not {value}"
        pending = []
    assert not pending, f"{constructor}: a row of bytes without its values"
    return constructor, stated, frame


@pytest.mark.parametrize("name", sorted(examples.examples()))
def test_each_example_page_bytes_are_the_encoders(name: str) -> None:
    msg = examples.examples()[name]
    constructor, stated, frame = _read_frame(_regions("frame")[name])
    assert frame == encode(msg), f"{name}: the page's bytes are not encode()'s; {FIX}"
    assert stated == len(frame)
    assert frame[3] == PROTOCOL_VERSION
    assert constructor.startswith(type(msg).__name__ + "(")
    assert type(decode(frame)) is type(msg)


def test_each_result_example_is_its_works_product() -> None:
    ex = examples.examples()
    cache: dict[str, torch.Tensor] = {}
    for work_name, result_name in (("work", "result"), ("work-more", "result-more"), ("work-bf16", "result-bf16")):
        work, result = decode(encode(ex[work_name])), decode(encode(ex[result_name]))
        assert isinstance(work, Work) and isinstance(result, Result)
        assert result.tile_id == work.tile_id
        cache.update({blk.key: blk.data for blk in work.blocks})
        operands = work.operands(cache)
        assert operands is not None, f"{work_name} names a block no earlier example sent"
        a, b = operands
        assert torch.equal(result.c, (a.double() @ b.double()).to(a.dtype)), result_name  # exact in float64


def test_the_bf16_example_shows_one_rounding_of_a_float32_sum() -> None:
    # The page: summed in float32 and rounded once, C is 1 + 2^-7; summed in bf16 it would be 1.0.
    work = examples.WORK_BF16
    a, b = work.blocks[0].data, work.blocks[1].data
    total = torch.zeros((), dtype=torch.bfloat16)
    for x, y in zip(a[0], b[:, 0]):
        total = (total + x * y).to(torch.bfloat16)
    assert total.item() == 1.0
    assert examples.product(work).item() == 1.0 + 2**-7
    assert "(1.0078125, bytes `81 3f`)" in _page() and "1.0 (`80 3f`)" in _page()


# --------------------------------------------------------------------------- the credential vector


def _vector_on_page() -> dict[str, str]:
    lines = _regions("vector")["proof"].removeprefix("```\n").removesuffix("```\n").splitlines()
    return {lines[i].split()[0]: lines[i + 1].strip() for i in range(0, len(lines), 2)}


def test_the_credential_vector_recomputes_from_the_pages_numbers() -> None:
    v = _vector_on_page()
    secret, nonce, identity = bytes.fromhex(v["S"]), bytes.fromhex(v["N"]), int(v["identity"])
    assert len(secret) == auth.SECRET_BYTES and len(nonce) == auth.NONCE_BYTES
    # As an outsider would, with nothing but SHA-256 and HMAC and the page's formulas.
    key = hashlib.sha256(b"cleave-identity-v1|" + secret).digest()
    message = b"cleave-auth-v1|" + str(identity).encode("ascii") + b"|" + nonce
    mac = hmac.new(key, message, hashlib.sha256).digest()
    proof = bytes(s ^ h for s, h in zip(secret, mac))
    assert (key.hex(), message.hex(), mac.hex(), proof.hex()) == (v["K"], v["M"], v["H"], v["proof"]), FIX
    # And as the code does.
    assert auth.stored_key(secret) == key
    assert auth.proof(secret, identity, nonce) == proof
    assert auth.verify_proof(key, identity, nonce, proof)
    assert not auth.verify_proof(key, identity, v["N"].encode(), proof)  # hashing the hex text fails


def test_the_session_examples_carry_the_vectors_nonce_and_proof() -> None:
    v = _vector_on_page()
    ex = examples.examples()
    assert ex["challenge"].nonce == v["N"]  # type: ignore[union-attr]
    hello = ex["hello-credential"]
    assert isinstance(hello, Hello) and (hello.identity, hello.proof) == (int(v["identity"]), v["proof"])
    assert ex["credential"].secret == v["S"]  # type: ignore[union-attr]


# --------------------------------------------------------------------------- quoted constants

# "VALUE (`NAME`)": a limit quoted with the constant that holds it. VALUE is terms such as 64,
# 1,024, 2^27, 16 MiB or 60 s, joined by + or −.
_TERM = r"\d[\d,]*(?:\^\d+)?(?: (?:KiB|MiB|GiB|s))?"
_VALUE = re.compile(rf"({_TERM}(?: [+−-] {_TERM})*) $")
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "s": 1}
# Constants the page must quote with their values.
REQUIRED = {
    "PROTOCOL_VERSION",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "MAX_DIM",
    "MAX_ELEMENTS",
    "MAX_ID",
    "MAX_IDS",
    "MAX_PAIRS",
    "MAX_NAME",
    "MAX_TOKEN",
    "MAX_GFLOPS",
    "MAX_SLOTS",
    "MAX_SPEEDTEST_BYTES",
    "NONCE_HEX",
    "SECRET_HEX",
}


def _constants() -> dict[str, float]:
    values: dict[str, float] = {"MAX_FRAME": MAX_FRAME}
    for module in (auth, messages):
        values.update({k: v for k, v in vars(module).items() if k.isupper() and type(v) in (int, float)})
    for policy in (Limits(), TrustPolicy()):
        for f in fields(policy):
            value = getattr(policy, f.name)
            if type(value) in (int, float):
                values[f"{type(policy).__name__}.{f.name}"] = value
    return values


def _evaluate(text: str) -> float:
    total, sign = 0.0, 1
    for token in re.split(r" ([+−-]) ", text):
        if token in "+−-":
            sign = 1 if token == "+" else -1
            continue
        number, _, unit = token.partition(" ")
        base, _, power = number.replace(",", "").partition("^")
        total += sign * int(base) ** int(power or 1) * _UNITS.get(unit, 1)
    return total


def test_every_quoted_constant_is_preceded_by_its_value() -> None:
    page, values = _page(), _constants()
    quoted: set[str] = set()
    for m in re.finditer(r"\(`([A-Za-z_.]+)`\)", page):
        name = m[1]
        if name not in values:
            continue
        before = _VALUE.search(page[max(0, m.start() - 40) : m.start()])
        line = page[page.rfind("\n", 0, m.start()) + 1 : m.end()]
        assert before is not None, f"docs/protocol.md: write `{name}` as 'VALUE (`{name}`)': {line!r}"
        assert _evaluate(before[1]) == values[name], f"docs/protocol.md: {name} is {values[name]}, not {before[1]}"
        quoted.add(name)
    missing = REQUIRED - quoted
    assert not missing, f"docs/protocol.md quotes no value for {sorted(missing)}"


# --------------------------------------------------------------------------- what the page says the decoder does


def _frame(header: str | bytes, payload: bytes = b"") -> bytes:
    head = header.encode() if isinstance(header, str) else header
    return struct.pack("<3sBI", b"CLV", PROTOCOL_VERSION, len(head)) + head + payload


def test_the_decoder_needs_neither_sorted_keys_nor_whitespace_nor_tensors() -> None:
    # "Keys need not be sorted, whitespace is allowed, and "tensors" may be left out."
    out = decode(_frame('{ "type": "release",\n "tile_ids": [3], "why": "compute_failed" }'))
    assert out == messages.Release(tile_ids=(3,), why=messages.ReleaseWhy.COMPUTE_FAILED)
    out = decode(_frame('{"type":"work","tile_id":1,"b":"1.b","a":"1.a"}'))
    assert isinstance(out, Work) and (out.a, out.b, out.blocks, out.forget, out.more) == ("1.a", "1.b", (), (), ())
    # Defaults fill what is left out; the last of a repeated key counts.
    assert decode(_frame('{"type":"hello","name":"n","name":"m"}')) == Hello(name="m")


@pytest.mark.parametrize(
    "header",
    [
        '{"type":"cancel","tile_ids":[2.0]}',  # an int written as a float
        '{"type":"release","tile_ids":[1],"tensors":null}',  # tensors must be a list
        '{"type":"hello","name":"n","cores":true}',  # a bool is not an int
        '{"type":"hello","name":"n","identity":3,"proof":"' + "AB" * 32 + '"}',  # hex is lowercase
        '{"type":"work","tile_id":1,"a":"1.a","b":"1.b","more":["2.a","2.b"]}',  # more without more_t
        '{"type":"work","tile_id":1,"a":"1.a","b":"1.b","more":["1.a","1.b"],"more_t":[true,false]}',  # a pair twice
        '{"type":"heartbeat","sent_at":1e400}',  # beyond float range
        '{"type":"hello"}',  # a required field missing
        '{"type":"welcome","device_id":1,"identity":1,"job":"j","slots":65}',  # past MAX_SLOTS
    ],
)
def test_the_decoder_refuses_what_the_page_says_it_refuses(header: str) -> None:
    with pytest.raises(ProtocolError):
        decode(_frame(header))
