"""Wire messages: round trips, pinned golden bytes, and malformed frames."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from cleave.wire.addresses import is_loopback, url_host
from cleave.wire.codes import Code, EnergySource, ReleaseWhy, StandbyWhy
from cleave.wire.errors import ProtocolError
from cleave.wire.messages import (
    MAGIC,
    PROTOCOL_VERSION,
    Block,
    Cancel,
    Challenge,
    Credential,
    Credit,
    Energy,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Leave,
    Pause,
    Redirect,
    Release,
    Result,
    ResultBatch,
    Resume,
    SpeedTest,
    Standby,
    StatusReply,
    StatusRequest,
    Wake,
    Welcome,
    Work,
    WorkBatch,
    decode,
    encode,
)

PLAIN = [
    Challenge(nonce="0f" * 32, coordinator="4ad726207a9beb99"),
    Hello(
        token="t",
        name="n",
        platform="Linux",
        cores=4,
        memory_bytes=8 << 30,
        device="cpu",
        gflops=12.5,
        slots=3,
        client_version="0.2.0",
    ),
    Hello(name="n", identity=7, proof="ab" * 32),
    Credential(identity=7, secret="cd" * 32),
    StatusRequest(token="secret"),
    Leave(reason="owner is back"),
    Release(tile_ids=(3, 4)),
    Release(tile_ids=(5,), why=ReleaseWhy.COMPUTE_FAILED, reason="out of memory"),
    Heartbeat(sent_at=12.5),
    Pause(reason="on battery"),
    Resume(),
    Credit(session_gflop=1.5, total_gflop=12.25),
    Cancel(tile_ids=(9,), reason="another copy was verified first"),
    Welcome(device_id=3, identity=7, job="tiny, 20 steps", slots=2, heartbeat=1.5),
    StatusReply(status={"job": {"step": 1, "loss": 2.5}, "devices": []}),
    Finished(reason="job complete"),
    Error(code=Code.NOT_LEASED, message="tile 9 is not leased to you"),
    Standby(keepalive=60.0, reason=StandbyWhy.IDLE),
    Wake(),
]


@pytest.mark.parametrize("msg", PLAIN, ids=lambda m: type(m).__name__)
def test_plain_messages_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_work_round_trips_blocks_bit_exact(dtype: torch.dtype) -> None:
    a = torch.randn(5, 3).to(dtype)
    b = torch.randn(4, 3).to(dtype)  # used transposed: B is 3 x 4
    msg = Work(
        tile_id=11, a="2.0.5x3", b="3.0.4x3", b_t=True, blocks=(Block("2.0.5x3", a), Block("3.0.4x3", b)), forget=(1, 2)
    )
    out = decode(encode(msg))
    assert isinstance(out, Work)
    assert (out.tile_id, out.a, out.b, out.a_t, out.b_t, out.forget) == (11, "2.0.5x3", "3.0.4x3", False, True, (1, 2))
    assert [blk.key for blk in out.blocks] == ["2.0.5x3", "3.0.4x3"]
    assert torch.equal(out.blocks[0].data, a) and out.blocks[0].data.dtype == dtype
    cache = {blk.key: blk.data for blk in out.blocks}
    operands = out.operands(cache)
    assert operands is not None and torch.equal(operands[0], a) and torch.equal(operands[1], b.t())
    assert out.operands({}) is None


def test_work_with_more_pairs_multiplies_to_the_sum_of_their_products() -> None:
    a1, a2, b1, b2 = torch.randn(5, 3), torch.randn(5, 2), torch.randn(4, 3), torch.randn(4, 2)  # B used transposed
    blocks = tuple(Block(k, t) for k, t in (("a1", a1), ("a2", a2), ("b1", b1), ("b2", b2)))
    msg = Work(tile_id=3, a="a1", b="b1", b_t=True, blocks=blocks, more=("a2", "b2"), more_t=(False, True))
    out = decode(encode(msg))
    assert out == Work(tile_id=3, a="a1", b="b1", b_t=True, blocks=out.blocks, more=("a2", "b2"), more_t=(False, True))
    a, b = out.operands({blk.key: blk.data for blk in out.blocks})
    torch.testing.assert_close(a @ b, a1 @ b1.t() + a2 @ b2.t())
    assert out.operands({"a1": a1, "b1": b1, "a2": a2}) is None  # a missing block: given back
    assert b'"more"' not in encode(Work(tile_id=3, a="a1", b="b1"))  # one-pair frames are unchanged


@pytest.mark.parametrize(
    "more, more_t",
    [
        (["a"], [False]),
        (["a", 1], [False, False]),
        (["a", "b"] * 8, [False, False] * 8),
        ("ab", [False, False]),
        (["a", "b\x00"], [False, False]),
        (["a", "b"], [False]),
        (["a", "b"], [0, 1]),
        (["a1", "b1"], [False, False]),
        (["a", "b", "a", "b"], [False] * 4),
    ],
)
def test_work_with_bad_pairs_is_refused(more: object, more_t: object) -> None:
    # odd, not text, too many pairs (a frame carries at most 16 blocks), unprintable, flags that
    # do not match the keys, a pair repeated
    frame = encode(Work(tile_id=3, a="a1", b="b1"))
    head_len = int.from_bytes(frame[4:8], "little")
    header = json.loads(frame[8 : 8 + head_len])
    header["more"], header["more_t"] = more, more_t
    with pytest.raises(ProtocolError):
        decode(_frame(header))


def test_result_round_trips_and_decoded_tensor_is_writable() -> None:
    c = torch.randn(7, 2)
    out = decode(encode(Result(tile_id=4, c=c, seconds=0.125)))
    assert isinstance(out, Result) and out.tile_id == 4 and out.seconds == 0.125
    assert torch.equal(out.c, c)
    # Decoded tensors are views of the frame (no copy, no read-only buffer warning). Cleave never
    # writes them; a frame received into a bytearray may be, and the view sees the writes.
    frame = bytearray(encode(Result(tile_id=4, c=c, seconds=0.125)))
    mine = decode(frame)
    assert isinstance(mine, Result)
    mine.c.add_(1)
    assert torch.equal(decode(frame).c, c + 1)


def test_speedtest_carries_bytes_both_ways() -> None:
    payload = torch.arange(300, dtype=torch.int32).to(torch.uint8)
    out = decode(encode(SpeedTest(reply_bytes=1 << 20, data=payload)))
    assert isinstance(out, SpeedTest) and out.reply_bytes == 1 << 20 and torch.equal(out.data, payload)
    with pytest.raises(ProtocolError):
        decode(encode(SpeedTest(reply_bytes=1 << 40, data=payload)))
    out = decode(encode(SpeedTest(reply_bytes=0, data=payload[:0], token="join")))
    assert isinstance(out, SpeedTest) and out.token == "join"
    with pytest.raises(ProtocolError):  # u8 payloads only
        decode(_frame({"type": "speedtest", "reply_bytes": 1, "tensors": [{"dtype": "f32", "shape": [1]}]}, b"\0" * 4))


def test_empty_and_size_one_tensors_round_trip() -> None:
    for shape in [(0, 3), (1, 1), (3, 0)]:
        c = torch.ones(shape)
        out = decode(encode(Result(1, c)))
        assert isinstance(out, Result) and out.c.shape == c.shape


def test_non_contiguous_tensors_are_sent_by_value() -> None:
    base = torch.arange(12.0).view(3, 4)
    out = decode(encode(Result(1, base[:, 1:3])))
    assert isinstance(out, Result) and torch.equal(out.c, base[:, 1:3])


GOLDEN = {
    "challenge": (
        Challenge(nonce="ab" * 32, coordinator="c0ffee"),
        b'CLV\x09\x83\x00\x00\x00{"coordinator":"c0ffee","nonce":"'
        + b"ab" * 32
        + b'","tensors":[],"type":"challenge"}',
    ),
    "hello": (
        Hello(
            name="n",
            token="t",
            platform="p",
            cores=2,
            memory_bytes=4,
            device="cpu",
            gflops=1.5,
            slots=2,
            client_version="0.2.0",
        ),
        b'CLV\x09\xf3\x00\x00\x00{"batch":1,"block_budget":0,"client_version":"0.2.0","cores":2,"device":"cpu","gflops":1.5,'
        b'"identity":0,"memory_bytes":4,"name":"n","paused":"","platform":"p","proof":"","relay":"","slots":2,'
        b'"tensors":[],"ticket":"","token":"t","type":"hello"}',
    ),
    "work": (
        Work(
            tile_id=7,
            a="1.0.1x2",
            b="2.0.2x1",
            b_t=True,
            blocks=(Block("1.0.1x2", torch.tensor([[1.0, 2.0]])),),
            forget=(3,),
        ),
        bytes.fromhex(
            "434c56099a0000007b2261223a22312e302e317832222c22615f74223a66616c73652c2262223a22322e302e327831222c22"
            "625f74223a747275652c22626c6f636b73223a5b22312e302e317832225d2c22666f72676574223a5b335d2c2274656e736f"
            "7273223a5b7b226474797065223a22663332222c227368617065223a5b312c325d7d5d2c2274696c655f6964223a372c2274"
            "797065223a22776f726b227d0000803f00000040"
        ),
    ),
    "result": (
        Result(tile_id=7, c=torch.tensor([[0.5]]), seconds=0.25, waited=0.125),
        bytes.fromhex(
            "434c5609650000007b227365636f6e6473223a302e32352c2274656e736f7273223a5b7b226474797065223a22663332222c"
            "227368617065223a5b312c315d7d5d2c2274696c655f6964223a372c2274797065223a22726573756c74222c227761697465"
            "64223a302e3132357d0000003f"
        ),
    ),
    # Two tiles under one header: each work's blocks in order (1.0, 2.0 | 3.0, 4.0).
    "work_batch": (
        WorkBatch(
            (
                Work(
                    7,
                    "1.0.1x2",
                    "2.0.2x1",
                    b_t=True,
                    blocks=(Block("1.0.1x2", torch.tensor([[1.0, 2.0]])),),
                    forget=(3,),
                ),
                Work(8, "1.0.1x2", "2.1.2x1", b_t=True, blocks=(Block("2.1.2x1", torch.tensor([[3.0, 4.0]])),)),
            )
        ),
        bytes.fromhex(
            "434c56092c0100007b2274656e736f7273223a5b7b226474797065223a22663332222c227368617065223a5b312c325d7d2c"
            "7b226474797065223a22663332222c227368617065223a5b312c325d7d5d2c2274797065223a22776f726b5f626174636822"
            "2c22776f726b73223a5b7b2261223a22312e302e317832222c22615f74223a66616c73652c2262223a22322e302e32783122"
            "2c22625f74223a747275652c22626c6f636b73223a5b22312e302e317832225d2c22666f72676574223a5b335d2c2274696c"
            "655f6964223a377d2c7b2261223a22312e302e317832222c22615f74223a66616c73652c2262223a22322e312e327831222c"
            "22625f74223a747275652c22626c6f636b73223a5b22322e312e327831225d2c22666f72676574223a5b5d2c2274696c655f"
            "6964223a387d5d7d0000803f000000400000404000008040"
        ),
    ),
    "result_batch": (
        ResultBatch((Result(7, torch.tensor([[0.5]]), 0.25, 0.125), Result(8, torch.tensor([[11.0]]), 0.25, 0.0))),
        bytes.fromhex(
            "434c5609c10000007b22726573756c7473223a5b7b227365636f6e6473223a302e32352c2274696c655f6964223a372c2277"
            "6169746564223a302e3132357d2c7b227365636f6e6473223a302e32352c2274696c655f6964223a382c2277616974656422"
            "3a302e307d5d2c2274656e736f7273223a5b7b226474797065223a22663332222c227368617065223a5b312c315d7d2c7b22"
            "6474797065223a22663332222c227368617065223a5b312c315d7d5d2c2274797065223a22726573756c745f626174636822"
            "7d0000003f00003041"
        ),
    ),
    # A rank of a tier sends a newcomer on: where to, and the ticket to enrol there with.
    "redirect": (
        Redirect(url="wss://rank1.example.org:8765", rank=1, ticket="ab" * 60, reason="rank 1 needs devices more"),
        b'CLV\x09\xf7\x00\x00\x00{"rank":1,"reason":"rank 1 needs devices more","tensors":[],"ticket":"'
        + b"ab" * 60
        + b'","type":"redirect","url":"wss://rank1.example.org:8765"}',
    ),
    # A device's energy since its last report, batched with its results (protocol 8).
    "energy": (
        Energy(joules=1520.5, seconds=30.0, source=EnergySource.RAPL, gpu_joules=12.25, grid_gco2_kwh=250.0),
        b'CLV\x09v\x00\x00\x00{"gpu_joules":12.25,"grid_gco2_kwh":250.0,"joules":1520.5,"seconds":30.0,'
        b'"source":"rapl","tensors":[],"type":"energy"}',
    ),
    # No work for the device for now: it sleeps, beating once a minute, until woken (protocol 9).
    "standby": (
        Standby(keepalive=60.0, reason=StandbyWhy.UNPLANNED),
        b'CLV\x09E\x00\x00\x00{"keepalive":60.0,"reason":"unplanned","tensors":[],"type":"standby"}',
    ),
    "wake": (Wake(), b'CLV\x09\x1c\x00\x00\x00{"tensors":[],"type":"wake"}'),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes_are_stable(name: str) -> None:
    msg, frame = GOLDEN[name]
    assert encode(msg) == frame
    again = decode(frame)
    assert type(again) is type(msg)


def _frame(header: dict, payload: bytes = b"", version: int = PROTOCOL_VERSION) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<3sBI", MAGIC, version, len(head)) + head + payload


def _raw_frame(head: str) -> bytes:
    data = head.encode()
    return struct.pack("<3sBI", MAGIC, PROTOCOL_VERSION, len(data)) + data


MALFORMED = {
    "garbage": (b"\x00\xffhello there, not a frame at all", "bad_frame"),
    "empty": (b"", "truncated"),
    "short prefix": (b"CLV\x01", "truncated"),
    "bad version": (_frame({"type": "leave"}, version=99), "bad_version"),
    "header past end": (struct.pack("<3sBI", MAGIC, PROTOCOL_VERSION, 1000) + b"{}", "truncated"),
    "header not json": (struct.pack("<3sBI", MAGIC, PROTOCOL_VERSION, 3) + b"{x}", "bad_frame"),
    "header not object": (_frame([1, 2]), "bad_frame"),  # type: ignore[arg-type]
    "unknown type": (_frame({"type": "launch_missiles"}), "unknown_type"),
    "missing field": (_frame({"type": "welcome", "job": "j", "slots": 1}), "bad_frame"),
    "wrong field type": (_frame({"type": "error", "code": 3, "message": "m"}), "bad_frame"),
    "bool is not int": (_frame({"type": "welcome", "device_id": True, "job": "j", "slots": 1}), "bad_frame"),
    "nan float": (
        _frame(
            {"type": "result", "tile_id": 1, "seconds": 1e999, "tensors": [{"dtype": "f32", "shape": [1]}]}, b"\0" * 4
        ),
        "bad_frame",
    ),
    "truncated tensor": (
        _frame({"type": "result", "tile_id": 1, "tensors": [{"dtype": "f32", "shape": [2, 2]}]}, b"\0" * 12),
        "truncated",
    ),
    "stray bytes": (
        _frame({"type": "result", "tile_id": 1, "tensors": [{"dtype": "f32", "shape": [1]}]}, b"\0" * 8),
        "bad_frame",
    ),
    "bad dtype": (
        _frame({"type": "result", "tile_id": 1, "tensors": [{"dtype": "f64", "shape": [1]}]}, b"\0" * 8),
        "bad_tensor",
    ),
    "negative shape": (
        _frame({"type": "result", "tile_id": 1, "tensors": [{"dtype": "f32", "shape": [-1]}]}),
        "bad_tensor",
    ),
    "two tensors in result": (
        _frame({"type": "result", "tile_id": 1, "tensors": [{"dtype": "f32", "shape": [1]}] * 2}, b"\0" * 8),
        "bad_tensor",
    ),
    "tensor on plain message": (
        _frame({"type": "leave", "tensors": [{"dtype": "f32", "shape": [1]}]}, b"\0" * 4),
        "bad_tensor",
    ),
    "release ids not ints": (_frame({"type": "release", "tile_ids": [1, "x"]}), "bad_frame"),
    "work block count mismatch": (
        _frame(
            {
                "type": "work",
                "tile_id": 1,
                "a": "x",
                "b": "y",
                "blocks": [],
                "tensors": [{"dtype": "f32", "shape": [1, 1]}],
            },
            b"\0" * 4,
        ),
        "bad_frame",
    ),
    "work flag not bool": (_frame({"type": "work", "tile_id": 1, "a": "x", "b": "y", "a_t": 1}), "bad_frame"),
    # Found by an attacker on protocol version 1: each escaped as something other than ProtocolError.
    "list as dtype": (
        _frame({"type": "result", "tile_id": 1, "tensors": [{"dtype": ["f32"], "shape": [1]}]}, b"\0" * 4),
        "bad_tensor",
    ),
    "deeply nested header": (
        struct.pack("<3sBI", MAGIC, PROTOCOL_VERSION, 200_001) + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "bad_frame",
    ),
    "lone surrogate in token": (_raw_frame('{"type":"hello","name":"n","token":"\\ud800"}'), "bad_frame"),
    "huge integer": (_frame({"type": "hello", "name": "n", "cores": 10**30}), "bad_frame"),
    "integer of 5000 digits": (_raw_frame('{"type":"leave","reason":"x","n":' + "9" * 5000 + "}"), "bad_frame"),
    "absurd seconds": (
        _frame(
            {"type": "result", "tile_id": 1, "seconds": 1e308, "tensors": [{"dtype": "f32", "shape": [1]}]}, b"\0" * 4
        ),
        "bad_frame",
    ),
    "NaN literal": (_raw_frame('{"type":"heartbeat","sent_at":NaN}'), "bad_frame"),
    "negative tile id": (_frame({"type": "release", "tile_ids": [-1]}), "bad_frame"),
    "too many tile ids": (_frame({"type": "cancel", "tile_ids": list(range(2000))}), "bad_frame"),
    "control characters in a name": (_frame({"type": "hello", "name": "evil\x1b[2J"}), "bad_frame"),
    "name too long": (_frame({"type": "hello", "name": "n" * 65}), "bad_frame"),
    "proof not hex": (_frame({"type": "hello", "name": "n", "identity": 1, "proof": "zz" * 32}), "bad_frame"),
    "unknown release reason": (_frame({"type": "release", "tile_ids": [1], "why": "bored"}), "bad_frame"),
    "unknown error code": (_frame({"type": "error", "code": "teapot", "message": "m"}), "bad_frame"),
    "slots out of range": (_frame({"type": "hello", "name": "n", "slots": 10_000}), "bad_frame"),
    "too many tensors": (
        _frame({"type": "result", "tile_id": 1, "tensors": [{"dtype": "u8", "shape": [0]}] * 17}),
        "bad_tensor",
    ),
    # A standby's keep-alive is bounded both ways: a client never beats 1,000 times a second, nor
    # goes silent for a day; and it has one.
    "standby keepalive too short": (_frame({"type": "standby", "keepalive": 0.001}), "bad_frame"),
    "standby keepalive too long": (_frame({"type": "standby", "keepalive": 86400.0}), "bad_frame"),
    "standby without keepalive": (_frame({"type": "standby", "reason": "idle"}), "bad_frame"),
    "unknown standby reason": (_frame({"type": "standby", "keepalive": 60, "reason": "bored"}), "bad_frame"),
    "tensor on a wake": (
        _frame({"type": "wake", "tensors": [{"dtype": "f32", "shape": [1]}]}, b"\0" * 4),
        "bad_tensor",
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_raise_protocol_error_with_code(name: str) -> None:
    frame, code = MALFORMED[name]
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert info.value.code == code
    assert str(info.value)  # a message a human can read


def test_text_frames_are_refused() -> None:
    with pytest.raises(ProtocolError) as info:
        decode('{"type": "hello"}')
    assert info.value.code == Code.TEXT_FRAME


def test_random_bytes_never_raise_anything_but_protocol_error() -> None:
    rng = torch.Generator().manual_seed(0)
    good = encode(Result(tile_id=1, c=torch.ones(2, 2)))
    for i in range(300):
        n = int(torch.randint(0, len(good) + 8, (1,), generator=rng))
        junk = bytes(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).tolist())
        mutated = bytearray(good)
        mutated[i % len(good)] ^= 0xFF
        for frame in (junk, bytes(mutated), good[: i % len(good)]):
            try:
                decode(frame)
            except ProtocolError:
                pass


def test_free_text_loses_control_characters_but_names_keep_theirs_out() -> None:
    out = decode(_frame({"type": "pause", "reason": "on\nbattery\x1b[31m"}))
    assert isinstance(out, Pause) and out.reason == "on battery [31m"
    with pytest.raises(ProtocolError):
        decode(_frame({"type": "status_request", "token": "tok\nen"}))


def test_loopback_addresses_are_recognised_without_resolving_names() -> None:
    for host in ("127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "app.localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "192.168.1.10", "example.org", "10.0.0.1", "", "localhost.example.org"):
        assert not is_loopback(host), host
    assert url_host("wss://Example.org:8765/path") == "example.org" and url_host("ws://[::1]:1") == "::1"
    assert url_host("not a url") == ""


def _batch_frame(header: dict, tensors: list[torch.Tensor]) -> bytes:
    header = {**header, "tensors": [{"dtype": "f32", "shape": list(t.shape)} for t in tensors]}
    head = json.dumps(header).encode()
    return (
        struct.pack("<3sBI", MAGIC, PROTOCOL_VERSION, len(head)) + head + b"".join(t.numpy().tobytes() for t in tensors)
    )


def _work_entry(tile: int, blocks: list[str]) -> dict:
    return {"tile_id": tile, "a": "1.a", "b": "1.b", "blocks": blocks, "forget": []}


@pytest.mark.parametrize(
    "header, tensors, message",
    [
        ({"type": "result_batch", "results": []}, [], "1 to 64"),
        ({"type": "result_batch", "results": [{"tile_id": 1}] * 65}, [torch.ones(1, 1)] * 64, "1 to 64"),
        ({"type": "result_batch", "results": [{"tile_id": 1}, {"tile_id": 2}]}, [torch.ones(1, 1)], "one tensor per"),
        ({"type": "result_batch", "results": [{"tile_id": 1}, {"tile_id": 1}]}, [torch.ones(1, 1)] * 2, "twice"),
        ({"type": "result_batch", "results": [{"tile_id": -1}]}, [torch.ones(1, 1)], "between"),
        ({"type": "result_batch", "results": [7]}, [torch.ones(1, 1)], "must be an object"),
        ({"type": "result_batch", "results": {"tile_id": 1}}, [torch.ones(1, 1)], "must be a list"),
        ({"type": "work_batch", "works": [_work_entry(1, ["1.a", "1.b"])]}, [torch.ones(1, 1)], "more blocks than"),
        ({"type": "work_batch", "works": [_work_entry(1, [])]}, [torch.ones(1, 1)], "one block descriptor"),
        ({"type": "work_batch", "works": [_work_entry(1, []), _work_entry(1, [])]}, [], "twice"),
        ({"type": "work_batch", "works": [_work_entry(1, ["1.a"])]}, [torch.ones(2)], "2-D"),
        ({"type": "work_batch", "works": [{**_work_entry(1, []), "a_t": 1}]}, [], "booleans"),
        ({"type": "work_batch", "works": []}, [], "1 to 64"),
    ],
)
def test_hostile_batches_are_refused_with_one_line(header: dict, tensors: list, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(_batch_frame(header, tensors))


def test_batches_round_trip_and_act_as_their_parts() -> None:
    blocks = [Block(f"1.k{i}", torch.full((2, 2), float(i))) for i in range(3)]
    works = tuple(Work(i, "1.k0", f"1.k{i}", blocks=(blocks[i],)) for i in range(3))
    got = decode(encode(WorkBatch(works)))
    assert isinstance(got, WorkBatch) and [w.tile_id for w in got.works] == [0, 1, 2]
    assert all(torch.equal(g.blocks[0].data, w.blocks[0].data) for g, w in zip(got.works, works))
    results = tuple(Result(i, torch.full((2, 2), float(i)), 0.1 * i, 0.0) for i in range(1, 4))
    back = decode(encode(ResultBatch(results)))
    assert isinstance(back, ResultBatch) and [r.tile_id for r in back.results] == [1, 2, 3]
    assert all(torch.equal(b.c, r.c) and b.seconds == r.seconds for b, r in zip(back.results, results))
    # 64 tensors fit a batch frame; a plain work frame still takes at most 16.
    many = ResultBatch(tuple(Result(i, torch.ones(1, 1)) for i in range(64)))
    assert len(decode(encode(many)).results) == 64
