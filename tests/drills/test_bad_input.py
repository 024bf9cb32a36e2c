"""Bad input never takes the coordinator down: a hostile peer attacks a live training job.

Each attack must get a clear error message or close code for that peer alone; the job goes on,
loses nothing, and its losses still equal plain torch.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import TIMEOUT
from procs import TOKEN, Coordinator, join, local_losses
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from cleave.wire import auth
from cleave.wire.codes import CloseCode, Code
from cleave.wire.messages import (
    MAGIC,
    PROTOCOL_VERSION,
    Challenge,
    Credential,
    Error,
    Hello,
    Result,
    StatusRequest,
    Welcome,
    Work,
    decode,
    encode,
)

pytestmark = pytest.mark.drill  # real processes train through real sockets (README: the parts of the suite)

# The attacks take under a step (0.2 s, a step 0.3 s here) and need the job training (the forgers
# get Work): they start after step 1 and leave the job 7 steps to go on after them.
STEPS = 8


async def _closed_with(ws: ClientConnection) -> tuple[int | None, str]:
    try:
        while True:
            await asyncio.wait_for(ws.recv(), TIMEOUT)
    except ConnectionClosed:
        pass
    return ws.close_code, ws.close_reason or ""


async def _send_then_close_code(url: str, *frames: bytes | str) -> tuple[int | None, str]:
    async with connect(url, compression=None, max_size=None) as ws:
        for frame in frames:
            await ws.send(frame)
        return await _closed_with(ws)


def _frame(header: dict, payload: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<3sBI", MAGIC, PROTOCOL_VERSION, len(head)) + head + payload


class Inbox:
    """Messages from the coordinator, taken by type in arrival order; none is dropped."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws, self.held = ws, []  # type: ignore[var-annotated]

    async def next(self, kind: type) -> object:
        for i, msg in enumerate(self.held):
            if isinstance(msg, kind):
                return self.held.pop(i)
        while True:
            msg = decode(await asyncio.wait_for(self.ws.recv(), TIMEOUT))
            if isinstance(msg, kind):
                return msg
            self.held.append(msg)


def _raw(head: str) -> bytes:
    data = head.encode("utf-8", "surrogatepass")
    return struct.pack("<3sBI", MAGIC, PROTOCOL_VERSION, len(data)) + data


async def _rejected_then_banned(url: str, name: str, forge: str) -> tuple[Error, int | None, Credential]:
    """A new identity returns one bad result: on probation, that bans it at once."""
    async with connect(url, compression=None, max_size=None) as ws:
        inbox = Inbox(ws)
        await inbox.next(Challenge)
        await ws.send(encode(Hello(token=TOKEN, name=name, slots=1)))
        credential = await inbox.next(Credential)
        await inbox.next(Welcome)
        work = await inbox.next(Work)
        assert isinstance(work, Work)
        operands = work.operands({b.key: b.data for b in work.blocks})
        assert operands is not None
        rows, cols = operands[0].shape[0], operands[1].shape[1]
        c = torch.zeros(3, 3) if forge == "shape" else torch.zeros(rows, cols, dtype=torch.float16)
        await ws.send(encode(Result(tile_id=work.tile_id, c=c)))
        error = await inbox.next(Error)
        code, _ = await _closed_with(ws)
    assert isinstance(error, Error) and isinstance(credential, Credential)
    return error, code, credential


async def _reconnect(url: str, credential: Credential, name: str) -> tuple[int | None, str]:
    async with connect(url, compression=None, max_size=None) as ws:
        challenge = decode(await ws.recv())
        assert isinstance(challenge, Challenge)
        proof = auth.proof(bytes.fromhex(credential.secret), credential.identity, bytes.fromhex(challenge.nonce))
        await ws.send(encode(Hello(name=name, identity=credential.identity, proof=proof.hex())))
        return await _closed_with(ws)


async def _attack(url: str) -> dict[str, object]:
    seen: dict[str, object] = {}
    hello = encode(Hello(token=TOKEN, name="attacker", slots=1))
    seen["garbage"] = await _send_then_close_code(url, b"\x00\x01\x02 definitely not a frame")
    seen["text"] = await _send_then_close_code(url, '{"type": "hello"}')
    seen["truncated"] = await _send_then_close_code(url, hello[: len(hello) // 2])
    seen["unknown type"] = await _send_then_close_code(url, _frame({"type": "launch_missiles"}))
    # Each of these escaped as a traceback from protocol version 1.
    seen["list as dtype"] = await _send_then_close_code(
        url, _frame({"type": "speedtest", "reply_bytes": 0, "tensors": [{"dtype": [], "shape": [0]}]})
    )
    seen["nested header"] = await _send_then_close_code(url, _raw("[" * 5000 + "]" * 5000))
    seen["lone surrogate"] = await _send_then_close_code(url, _raw('{"type":"hello","name":"x","token":"\\udc80"}'))
    seen["huge integer"] = await _send_then_close_code(url, _frame({"type": "hello", "name": "x", "cores": 10**40}))
    seen["wrong token"] = await _send_then_close_code(url, encode(Hello(token="guess", name="intruder")))
    seen["observer wrong token"] = await _send_then_close_code(url, encode(StatusRequest(token="guess")))
    seen["volunteer reads status"] = await _send_then_close_code(url, encode(StatusRequest(token=TOKEN)))
    seen["server message"] = await _send_then_close_code(url, hello, encode(Welcome(1, 1, "j", 1)))
    seen["garbage after hello"] = await _send_then_close_code(url, hello, b"CLV\x02junk")

    async with connect(url, compression=None, max_size=None) as ws:
        await ws.send(hello)
        inbox = Inbox(ws)
        await inbox.next(Welcome)
        await ws.send(encode(Result(tile_id=10**9, c=torch.zeros(2, 2))))
        seen["never leased"] = await inbox.next(Error)
        await ws.send(encode(Result(tile_id=10**9 + 1, c=torch.zeros(2, 2), seconds=86400.0)))
        seen["stale tile"] = await inbox.next(Error)
    seen["wrong shape"] = await _rejected_then_banned(url, "forger-shape", "shape")
    seen["wrong dtype"] = await _rejected_then_banned(url, "forger-dtype", "dtype")
    seen["banned comes back"] = await _reconnect(url, seen["wrong shape"][2], "forger-shape")  # type: ignore[index]
    return seen


def test_a_hostile_peer_cannot_disturb_training(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "1", steps=STEPS)
    honest = join(coord.url, "honest")
    coord.wait_for_step(1)
    seen = asyncio.run(_attack(coord.url))
    assert coord.steps_done() < STEPS, "the attacks must land while the job trains"

    for name in (
        "garbage",
        "text",
        "truncated",
        "unknown type",
        "server message",
        "garbage after hello",
        "list as dtype",
        "nested header",
        "lone surrogate",
        "huge integer",
    ):
        code, reason = seen[name]  # type: ignore[misc]
        assert code == CloseCode.PROTOCOL, (name, code, reason)
        assert reason, name  # says why
    assert seen["truncated"][1].startswith("truncated")  # type: ignore[index]
    assert seen["unknown type"][1].startswith("unknown_type")  # type: ignore[index]
    assert seen["lone surrogate"][1].startswith("bad_frame") and "surrogate" in seen["lone surrogate"][1]  # type: ignore[index]
    for name in ("wrong token", "observer wrong token", "volunteer reads status"):
        assert seen[name][0] == CloseCode.AUTH, name  # type: ignore[index]
    for name in ("never leased", "stale tile"):
        error = seen[name]
        assert isinstance(error, Error) and error.code == Code.NOT_LEASED, (name, error)
    for name, word in (("wrong shape", "shape"), ("wrong dtype", "dtype")):
        error, code, _ = seen[name]  # type: ignore[misc]
        assert error.code == Code.REJECTED and word in error.message, (name, error)
        assert code == CloseCode.BANNED, name  # one forgery on probation is enough
    assert seen["banned comes back"][0] == CloseCode.BANNED  # type: ignore[index]

    assert coord.wait() == 0, coord.output
    assert honest.wait() == 0
    assert "Traceback" not in coord.output
    for got, want in zip(coord.losses(), local_losses(STEPS), strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    # Nothing lost: every tile verified, each forger's bad result counted against it, both banned.
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
    assert coord.query("SELECT name, tiles_rejected FROM devices WHERE name LIKE 'forger%' ORDER BY name") == [
        ("forger-dtype", 1),
        ("forger-shape", 1),
    ]
    assert coord.query("SELECT name, state FROM identities WHERE name LIKE 'forger%' ORDER BY name") == [
        ("forger-dtype", "banned"),
        ("forger-shape", "banned"),
    ]
