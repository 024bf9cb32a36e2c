"""A device's link to the relay its coordinator put it behind (``use_relay``): blocks by digest.

The device believes the relay about nothing but bytes with the right digest. A block that does
not hash to what the work named, a relay that does not send a work frame's blocks within the
``wait`` its coordinator set from the frame's arrival (``work.fetch_wait``, else ``use_relay.wait``:
well within the leases' deadlines), one it
cannot reach or that refuses its ticket, or one that says it lacks a block: ``RelayFailed``,
which the runner reports to the coordinator (``relay_report``) before giving the tiles back (the
coordinator then sends their blocks itself). A relay sends at most its byte cap in one reply and
leaves the rest out: the link asks again for those, within the same deadline.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

import torch
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidHandshake, WebSocketException

from cleave.wire.codes import RelayFault
from cleave.wire.digest import block_digest
from cleave.wire.errors import CleaveError, ProtocolError
from cleave.wire.messages import MAX_FETCH, BlockRequest, Blocks, decode, encode

TIMEOUT = 1.0  # seconds for one work frame's blocks (connecting included) when use_relay sets no wait
MAX_FRAME = 256 << 20  # as from the coordinator


class RelayFailed(CleaveError):
    """The relay failed this device: ``fault`` on block ``digest`` (``tag``: its seal on what it
    sent, for wrong bytes)."""

    def __init__(self, fault: RelayFault, digest: str, why: str, tag: str = "", got: str = "") -> None:
        super().__init__(why)
        self.fault, self.digest, self.tag, self.got = fault, digest, tag, got


@dataclass
class RelayLink:
    relay: int
    url: str
    ticket: str
    device: int
    tls: ssl.SSLContext | None = None
    wait: float = TIMEOUT  # seconds for one work frame's blocks, all of them (use_relay.wait)
    bytes_in: int = 0
    _ws: ClientConnection | None = None

    async def fetch(
        self, digests: list[str], wait: float | None = None, left: float | None = None
    ) -> dict[str, torch.Tensor]:
        """Every block of ``digests``, checked, within one deadline for them all (``wait``
        seconds from the work frame's arrival, of which ``left`` remain now: a frame that waited
        behind another's blocks has less; a relay that dribbles its replies out is cut at the
        same point as one that is silent); asked ``MAX_FETCH`` at a time, and again for those a
        reply left out (past the relay's byte cap). Raises ``RelayFailed``."""
        loop = asyncio.get_running_loop()
        wait = self.wait if wait is None else wait  # the frame's own (work.fetch_wait), else use_relay's
        deadline = loop.time() + (wait if left is None else min(wait, left))
        got: dict[str, torch.Tensor] = {}
        want = list(digests)
        while want:
            got.update(await self._fetch(want[:MAX_FETCH], max(0.0, deadline - loop.time()), wait))
            want = [d for d in want if d not in got]
        return got

    async def _fetch(self, digests: list[str], left: float, wait: float) -> dict[str, torch.Tensor]:
        first = digests[0] if digests else ""

        async def exchange() -> bytes:
            if self._ws is None:
                self._ws = await connect(  # max_queue=1: a relay cannot make it buffer frames it did not ask for
                    self.url,
                    max_size=MAX_FRAME,
                    max_queue=1,
                    compression=None,
                    ssl=self.tls,
                    proxy=None,
                    open_timeout=None,
                )
            await self._ws.send(encode(BlockRequest(tuple(digests), self.device, self.ticket)))
            return await self._ws.recv()

        try:
            frame = await asyncio.wait_for(exchange(), left)
        except (TimeoutError, asyncio.TimeoutError):
            self._drop()
            raise RelayFailed(
                RelayFault.STALLED,
                first,
                f"relay {self.relay} did not send the blocks in time ({wait:.3g} s from the work's arrival)",
            ) from None
        except (OSError, InvalidHandshake, WebSocketException) as exc:
            self._drop()
            raise RelayFailed(RelayFault.UNREACHABLE, first, f"relay {self.relay} unreachable: {exc}") from None
        self.bytes_in += len(frame)
        try:
            msg = decode(frame)
        except ProtocolError as exc:
            self._drop()
            raise RelayFailed(RelayFault.WRONG, first, f"relay {self.relay} sent a bad frame: {exc}") from None
        if not isinstance(msg, Blocks):
            self._drop()
            raise RelayFailed(RelayFault.WRONG, first, f"relay {self.relay} answered with {msg.TYPE}")
        if msg.missing:
            raise RelayFailed(RelayFault.UNREACHABLE, msg.missing[0], f"relay {self.relay} lacks a block")
        tags = dict(zip([b.key for b in msg.blocks], msg.tags, strict=False))
        out: dict[str, torch.Tensor] = {}
        for blk in msg.blocks:
            if blk.key not in digests:
                continue  # not asked for: ignored
            got = block_digest(blk.data)
            if got != blk.key:
                self._drop()
                raise RelayFailed(
                    RelayFault.WRONG, blk.key, f"relay {self.relay} sent bytes that are not block {blk.key[:16]}",
                    tags.get(blk.key, ""), got,
                )  # fmt: skip
            out[blk.key] = blk.data  # read only, as the coordinator's blocks are
        if not out:  # an honest relay sends at least one block a reply: this one would keep it asking
            raise RelayFailed(RelayFault.STALLED, first, f"relay {self.relay} sent none of the blocks asked for")
        return out  # those left out (past its byte cap) are asked for again

    def _drop(self) -> None:
        """A relay that failed: its connection goes at once, with no closing handshake to wait
        for (the device reports the relay before its leases' deadlines)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.transport.abort()

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), 2.0)
            except Exception:  # noqa: BLE001 - closing a failed relay: nothing to save
                pass
