"""Bad input never takes the coordinator down: a hostile peer attacks a live training job.

Each attack must get a clear error message or close code for that peer alone; the job goes on,
loses nothing, and its losses still equal plain torch.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from conftest import TIMEOUT
from coordinator.protocol import MAGIC, PROTOCOL_VERSION, Error, Hello, Result, StatusRequest, Welcome, Work, decode, encode
from coordinator.training.loop import TrainConfig, Trainer
from procs import TOKEN, Coordinator, join

STEPS = 40


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


async def _attack(url: str) -> dict[str, object]:
    seen: dict[str, object] = {}
    hello = encode(Hello(token=TOKEN, name="attacker", slots=1))
    seen["garbage"] = await _send_then_close_code(url, b"\x00\x01\x02 definitely not a frame")
    seen["text"] = await _send_then_close_code(url, '{"type": "hello"}')
    seen["truncated"] = await _send_then_close_code(url, hello[: len(hello) // 2])
    seen["unknown type"] = await _send_then_close_code(url, _frame({"type": "launch_missiles"}))
    seen["wrong token"] = await _send_then_close_code(url, encode(Hello(token="guess", name="intruder")))
    seen["observer wrong token"] = await _send_then_close_code(url, encode(StatusRequest(token="guess")))
    seen["server message"] = await _send_then_close_code(url, hello, encode(Welcome(1, "j", 1)))
    seen["garbage after hello"] = await _send_then_close_code(url, hello, b"CLV\x01junk")

    async with connect(url, compression=None, max_size=None) as ws:
        await ws.send(hello)
        inbox = Inbox(ws)
        await inbox.next(Welcome)
        await ws.send(encode(Result(tile_id=10**9, c=torch.zeros(2, 2))))
        seen["never leased"] = await inbox.next(Error)
        work = await inbox.next(Work)
        assert isinstance(work, Work)
        blocks = {b.key: b.data for b in work.blocks}  # cached across Works, as a real client does
        await ws.send(encode(Result(tile_id=work.tile_id, c=torch.zeros(3, 3))))
        seen["wrong shape"] = await inbox.next(Error)
        work = await inbox.next(Work)
        assert isinstance(work, Work)
        blocks.update({b.key: b.data for b in work.blocks})
        operands = work.operands(blocks)
        assert operands is not None
        rows, cols = operands[0].shape[0], operands[1].shape[1]
        await ws.send(encode(Result(tile_id=work.tile_id, c=torch.zeros(rows, cols, dtype=torch.float16))))
        seen["wrong dtype"] = await inbox.next(Error)
        await ws.send(encode(Result(tile_id=work.tile_id, c=torch.zeros(1, 1))))  # already refused: not leased now
        seen["stale tile"] = await inbox.next(Error)
    return seen


def test_a_hostile_peer_cannot_disturb_training(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "1", steps=STEPS)
    honest = join(coord.url, "honest")
    coord.wait_for_step(1)
    seen = asyncio.run(_attack(coord.url))

    for name in ("garbage", "text", "truncated", "unknown type", "server message", "garbage after hello"):
        code, reason = seen[name]  # type: ignore[misc]
        assert code == 4000, (name, code, reason)
        assert reason, name  # says why
    assert seen["truncated"][1].startswith("truncated")  # type: ignore[index]
    assert seen["unknown type"][1].startswith("unknown_type")  # type: ignore[index]
    assert seen["wrong token"][0] == 4001 and seen["observer wrong token"][0] == 4001  # type: ignore[index]
    for name, code in (("never leased", "not_leased"), ("wrong shape", "rejected"), ("wrong dtype", "rejected"),
                       ("stale tile", "not_leased")):
        error = seen[name]
        assert isinstance(error, Error) and error.code == code, (name, error)
    assert "shape" in seen["wrong shape"].message and "dtype" in seen["wrong dtype"].message  # type: ignore[union-attr]

    assert coord.wait() == 0, coord.output
    assert honest.wait() == 0
    assert "Traceback" not in coord.output
    local = [r.loss for r in Trainer(TrainConfig(steps=STEPS)).run()]
    for got, want in zip(coord.losses(), local, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    # Nothing lost: every tile verified, the attacker's two bad results counted against it.
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
    assert coord.query("SELECT SUM(tiles_rejected) FROM devices WHERE name = 'attacker'") == [(2,)]
