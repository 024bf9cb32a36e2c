"""Relays that cheat on purpose, speaking the real protocol (client/relay.py underneath).

    python tests/relay_doubles.py MODE URL TOKEN LISTEN_PORT CREDENTIALS

MODE: ``wrong`` serves every block with one element changed (sealed, as a lying relay would:
its seal is its word on what it sent); ``stale`` serves the first block it ever served under
every digest (bytes of another block); ``stall`` never answers a device; ``slow`` answers every
device with the true blocks, ``SLOW_S`` seconds late (past any lease's deadline); ``flood`` sends
the coordinator block requests as fast as it can.

In process: ``slowed`` makes a relay slow; ``hoard`` is a device that asks a relay for its
largest replies on every connection it may open and never reads them.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cleave.client.relay import Relay, RelayConfig  # noqa: E402

SLOW_S = 8.0  # seconds a ``slow`` relay takes to answer a device


def slowed(relay: Relay, delay: float = SLOW_S) -> Relay:
    """``relay`` answering every device ``delay`` seconds late, with the true blocks, sealed.
    Its ``late`` holds the requests it sits on (a test that is done with it cancels them)."""
    answer = relay._answer
    relay.late = set()  # type: ignore[attr-defined]

    async def late(digests: tuple[str, ...]) -> object:
        task = asyncio.current_task()
        relay.late.add(task)  # type: ignore[attr-defined]
        try:
            await asyncio.sleep(delay)
        finally:
            relay.late.discard(task)  # type: ignore[attr-defined]
        return await answer(digests)

    relay._answer = late  # type: ignore[method-assign]
    return relay


async def hoard(url: str, device: int, ticket: str, digests: tuple[str, ...], connections: int) -> list[object]:
    """A device (a real ticket) that opens ``connections`` to its relay, asks for every block on
    each, again and again, and never reads a reply: its sockets take a few KiB each, so what the
    relay has not written stays in the relay's hands. Returns the connections (the caller closes
    them)."""
    import socket

    from websockets.asyncio.client import connect

    from cleave.wire.messages import BlockRequest, encode

    out = []
    host, port = url.removeprefix("ws://").rsplit(":", 1)
    for _ in range(connections):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connecting: no window to fill
        sock.connect((host, int(port)))
        ws = await connect(url, sock=sock, compression=None, proxy=None, max_size=None)
        ws.transport.pause_reading()  # never reads again (not even its library)
        for _ in range(3):
            await ws.send(encode(BlockRequest(digests, device, ticket)))
        out.append(ws)
    return out


def main() -> None:
    mode, url, token, port, credentials = sys.argv[1:6]
    first: list[torch.Tensor] = []

    def tamper(digest: str, block: torch.Tensor) -> torch.Tensor:
        if mode == "wrong":
            bad = block.clone()
            bad.view(-1)[0] += 1.0
            return bad
        if mode == "stale":
            if not first:
                first.append(block.clone())
            return first[0] if first[0].shape == block.shape else block.clone().fill_(0.5)
        return block

    cfg = RelayConfig(
        url, ("127.0.0.1", int(port)), f"ws://127.0.0.1:{port}", token=token, name=f"hostile-{mode}",
        credentials=Path(credentials),
    )  # fmt: skip
    relay = Relay(cfg, tamper=None if mode == "slow" else tamper)
    if mode == "slow":
        slowed(relay)
    if mode == "stall":

        async def never(digests: tuple[str, ...]) -> object:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        relay._answer = never  # type: ignore[method-assign]
    if mode == "flood":
        from cleave.wire.messages import BlockRequest, encode

        async def flood(up: object) -> None:
            while True:
                await up.send(encode(BlockRequest(("ab" * 32,))))  # type: ignore[attr-defined]
                await asyncio.sleep(0)

        relay._beat = flood  # type: ignore[method-assign]
    print(asyncio.run(relay.run()), flush=True)


if __name__ == "__main__":
    main()
