"""Relays that cheat on purpose, speaking the real protocol (client/relay.py underneath).

    python tests/relay_doubles.py MODE URL TOKEN LISTEN_PORT CREDENTIALS

MODE: ``wrong`` serves every block with one element changed (sealed, as a lying relay would:
its seal is its word on what it sent); ``stale`` serves the first block it ever served under
every digest (bytes of another block); ``stall`` never answers a device; ``flood`` sends the
coordinator block requests as fast as it can.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from client.relay import Relay, RelayConfig  # noqa: E402


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
    relay = Relay(cfg, tamper=tamper)
    if mode == "stall":

        async def never(digests: tuple[str, ...]) -> object:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

        relay._answer = never  # type: ignore[method-assign]
    if mode == "flood":
        from coordinator.wire.messages import BlockRequest, encode

        async def flood(up: object) -> None:
            while True:
                await up.send(encode(BlockRequest(("ab" * 32,))))  # type: ignore[attr-defined]
                await asyncio.sleep(0)

        relay._beat = flood  # type: ignore[method-assign]
    print(asyncio.run(relay.run()), flush=True)


if __name__ == "__main__":
    main()
