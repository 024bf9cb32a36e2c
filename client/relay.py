"""``cleave relay``: a volunteer with a good link that serves operand blocks to devices.

It enrols at the coordinator like a device (the join token once, then its credential) with
``hello.relay`` set to the URL devices reach it at, and listens there. A device the coordinator
put behind it asks for blocks by digest (``block_request`` with its ticket); the relay answers
from its cache, and asks the coordinator for what it lacks: one sender batches the digests its
devices wait on (``MAX_FETCH`` a request, at most ``OUTSTANDING`` requests unanswered, at most
``UPSTREAM_PER_S`` a second: well within the coordinator's allowance, whatever its devices ask),
each digest asked once however many devices want it, one the coordinator left out of a reply
(past its byte cap) asked again, and one it said it lacks answered as missing at once for
``MISSING_S`` seconds. It gives up on the coordinator after ``UPSTREAM_TIMEOUT`` seconds, well
within a device's deadline, and says the block is missing (a device reports that, striking no one).
Every block it serves carries its seal (``relay_tag``, on the digest
asked for and the digest of the bytes sent), so a
device can show the coordinator what it was given. Results never pass through a relay.

Memory: the cache holds at most ``memory_bytes`` of blocks (least recently used go first, each a
copy: not a view keeping its whole upstream frame alive), plus the replies being gathered or
written: at most ``REPLIES`` at once over all devices, one per device (whatever connections it
opens), each of at most ``REPLY_BYTES`` of blocks (always one; a device asks again for those
left out) and its frame, a copy of them; a reply not written within ``SEND_S`` seconds (a device
that does not read) loses its connection and its place. A reply holds its own blocks, so eviction
under other devices' requests cannot empty it; those it lacks are fetched in order, a chunk at a
time, until it is full (a request for 64 lacking blocks holds about one reply of them). At most
``MAX_UNTICKETED`` connections that have not yet sent a ticketed request (closed after
``FIRST_REQUEST_S`` seconds without one), at most
``MAX_DEVICES`` ticketed ones, at most ``CONNECTIONS_PER_DEVICE`` of them for one ticketed device,
each with one request at a time of at most ``MAX_FETCH`` digests; a device's allowance
(``REQUESTS_PER_S``) is its own, however many connections it opens. docs/security.md adds it up.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from cleave.client.connection import client_tls
from cleave.client.credentials import Credential, CredentialStore
from cleave.wire import auth
from cleave.wire.codes import CloseCode
from cleave.wire.digest import block_digest, relay_tag, ticket_ok
from cleave.wire.errors import ConfigError, ProtocolError
from cleave.wire.handshake import bound_handshakes
from cleave.wire.messages import (
    MAX_FETCH,
    Block,
    BlockRequest,
    Blocks,
    Challenge,
    Error,
    Finished,
    Heartbeat,
    Hello,
    Welcome,
    decode,
    encode,
)
from cleave.wire.messages import Credential as CredentialMessage

log = logging.getLogger(__name__)

MAX_DEVICES = 1024  # ticketed device connections at once
MAX_UNTICKETED = 256  # connections yet to send a ticketed request
FIRST_REQUEST_S = 10.0  # seconds a new connection has to send one
# Seconds to wait for the coordinator's blocks. A device may give up sooner (use_relay.wait): a
# block that comes late is kept for the next device that asks.
UPSTREAM_TIMEOUT = 6.0
UPSTREAM_PER_S = 100.0  # block requests a second to the coordinator (its allowance: 200, bursts of 400)
# Block requests to the coordinator unanswered at once: two keep its link busy between replies,
# and two replies (16 MiB each) stay within the 64 MiB it queues for one peer.
OUTSTANDING = 2
MISSING_S = 5.0  # seconds a digest the coordinator said it lacks is answered as missing at once
MAX_MISSING = 1 << 14  # such digests remembered at most
DEVICE_FRAME = 64 << 10  # a device's block_request: 64 digests and a ticket fit many times over
UPSTREAM_FRAME = 256 << 20  # the coordinator's blocks frame (as a device's client allows)
REQUESTS_PER_S = 50.0  # a device's requests a second (bursts of 100), over all its connections
CONNECTIONS_PER_DEVICE = 2  # a device reconnecting while its old connection closes
# Block bytes in one reply to a device (always at least one block: a block is at most 16 MiB,
# as the coordinator's replies to a relay); those past it are left out and the device asks again.
REPLY_BYTES = 16 << 20
REPLIES = 16  # replies gathered or written at once, over every device: 2 x 256 MiB, and chunks being fetched
SEND_S = 5.0  # seconds a request waits for its turn, and a reply to be written, before its connection closes


class _Allowance:
    """``rate`` requests a second, ``burst`` at once (a device's allowance at this relay)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level, self.at = rate, burst, burst, None

    def take(self, now: float) -> bool:
        if self.at is not None:
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1:
            return False
        self.level -= 1
        return True


class RelayError(ConfigError):
    """The coordinator refused this relay, or it cannot enrol (exit 2)."""


@dataclass(frozen=True)
class RelayConfig:
    url: str  # the coordinator
    listen: tuple[str, int]  # where devices connect
    public_url: str  # what the coordinator tells devices (defaults to ws://listen)
    token: str = ""
    name: str = "relay"
    memory_bytes: int = 4 << 30
    credentials: Path | None = None
    cafile: str | None = None
    certfile: str | None = None  # serve wss:// to devices
    keyfile: str | None = None


class BlockCache:
    """Blocks by digest, least recently used evicted past ``capacity`` bytes, each with its seal."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._blocks: OrderedDict[str, tuple[torch.Tensor, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, digest: str) -> tuple[torch.Tensor, str] | None:
        hit = self._blocks.get(digest)
        if hit is not None:
            self._blocks.move_to_end(digest)
        return hit

    def put(self, digest: str, block: torch.Tensor, tag: str) -> None:
        if digest in self._blocks:
            return
        self._blocks[digest] = (block, tag)
        self.held += block.numel() * block.element_size()
        while self.held > self.capacity and len(self._blocks) > 1:
            _, (old, _) = self._blocks.popitem(last=False)
            self.held -= old.numel() * old.element_size()


class Relay:
    """One relay process: its upstream session with the coordinator and its device server.
    ``tamper``: a test double's hook on what it serves (an honest relay has none)."""

    def __init__(self, cfg: RelayConfig, *, tamper: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
        self.cfg = cfg
        self.cache = BlockCache(cfg.memory_bytes)
        self.tamper = tamper
        self.relay_id = 0
        self.key = b""
        self._upstream = None
        self._stopped = False  # its session with the coordinator ended
        self._waiting: dict[str, asyncio.Future[torch.Tensor | None]] = {}  # digest -> its devices' wait
        self._queue: OrderedDict[str, None] = OrderedDict()  # digests waited on, not yet asked for
        # Requests sent (when, digests), oldest first: replies come in order.
        self._asked: deque[tuple[float, tuple[str, ...]]] = deque()
        self._wake = asyncio.Event()  # digests were queued, or a request was answered
        self._missing: dict[str, float] = {}  # digest the coordinator lacks -> until when we say so
        self._devices = 0
        self._unticketed = 0
        self._allowances: dict[int, _Allowance] = {}  # ticketed device -> its allowance (kept across reconnects)
        self._conns: dict[int, int] = {}  # ticketed device -> its open connections
        self._turns: dict[int, asyncio.Lock] = {}  # ticketed device -> its one request in hand at a time
        self._replies = asyncio.Semaphore(REPLIES)  # replies gathered or written at once
        self.replying = 0  # bytes of reply frames built and not yet written
        self._largest = 0  # bytes of the largest block it has served or fetched: sizes its fetches
        self.served_bytes = 0  # to devices
        self.fetched_bytes = 0  # from the coordinator
        self.ready = asyncio.Event()
        self._credentials = CredentialStore(cfg.credentials)

    async def run(self) -> str:
        """Serve until the coordinator finishes the job or closes; returns why it ended."""
        tls = client_tls(self.cfg.url, self.cfg.cafile)
        async with connect(
            self.cfg.url, max_size=UPSTREAM_FRAME, compression=None, ssl=tls, proxy=None, open_timeout=10
        ) as up:
            self._upstream = up
            await self._enrol(up)
            server_tls = None
            if self.cfg.certfile and self.cfg.keyfile:
                server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                server_tls.load_cert_chain(self.cfg.certfile, self.cfg.keyfile)
            host, port = self.cfg.listen
            bound_handshakes()  # a relay is a server too: the coordinator's limits on an upgrade
            async with serve(
                self._serve_device, host, port, max_size=DEVICE_FRAME, compression=None, ssl=server_tls
            ) as server:
                self.port = next(iter(server.sockets)).getsockname()[1]
                self.ready.set()
                beat = asyncio.create_task(self._beat(up))
                sender = asyncio.create_task(self._send_upstream(up))
                try:
                    return await self._read_upstream(up)
                finally:
                    self._stopped = True  # requests still in hand are answered at once, with nothing
                    beat.cancel()
                    sender.cancel()
                    for fut in self._waiting.values():
                        if not fut.done():
                            fut.set_result(None)

    async def _enrol(self, up: object) -> None:
        challenge = decode(await up.recv())  # type: ignore[attr-defined]
        if not isinstance(challenge, Challenge):
            raise RelayError("the coordinator did not open with a challenge")
        stored = self._credentials.get(challenge.coordinator, self.cfg.name, self.cfg.url)
        hello = Hello(name=self.cfg.name, relay=self.cfg.public_url, device="relay")
        if stored is not None:
            proof = auth.proof(stored.secret, stored.identity, bytes.fromhex(challenge.nonce))
            hello = Hello(
                name=self.cfg.name,
                identity=stored.identity,
                proof=proof.hex(),
                relay=self.cfg.public_url,
                device="relay",
            )
        elif not self.cfg.token:
            raise RelayError(
                "no credential for this coordinator: set CLEAVE_TOKEN (or pass --token-file) to the join token to enrol"
            )
        else:
            hello = Hello(name=self.cfg.name, token=self.cfg.token, relay=self.cfg.public_url, device="relay")
        await up.send(encode(hello))  # type: ignore[attr-defined]
        secret = stored.secret if stored is not None else None
        while True:
            try:
                msg = decode(await up.recv())  # type: ignore[attr-defined]
            except ConnectionClosed as exc:
                raise RelayError(
                    f"the coordinator refused this relay: {exc.rcvd.reason if exc.rcvd else exc}"
                ) from None
            if isinstance(msg, CredentialMessage):
                secret = bytes.fromhex(msg.secret)
                self._credentials.put(
                    challenge.coordinator, self.cfg.name, Credential(msg.identity, secret, self.cfg.url)
                )
            elif isinstance(msg, Welcome):
                if secret is None:
                    raise RelayError("welcomed without a credential")
                self.relay_id = msg.device_id
                self.key = auth.stored_key(secret)
                log.info("relay %d of %s, serving devices at %s", self.relay_id, self.cfg.url, self.cfg.public_url)
                return

    async def _beat(self, up: object) -> None:
        while True:
            await asyncio.sleep(2.0)
            await up.send(encode(Heartbeat()))  # type: ignore[attr-defined]

    async def _read_upstream(self, up: object) -> str:
        try:
            async for frame in up:  # type: ignore[attr-defined]
                try:
                    msg = decode(frame)
                except ProtocolError as exc:
                    log.error("the coordinator sent a bad frame: %s", exc)
                    continue
                if isinstance(msg, Blocks):
                    self._answered(msg)
                elif isinstance(msg, Finished):
                    return "the job is complete"
                elif isinstance(msg, Error):
                    log.warning("coordinator: %s (%s)", msg.message, msg.code)
        except ConnectionClosed:
            pass
        return f"the coordinator closed ({getattr(up, 'close_code', None)})"

    def _answered(self, msg: Blocks) -> None:
        """The coordinator's reply to the oldest request unanswered: its blocks and what it lacks
        go to the devices waiting on them; digests it neither sent nor said it lacks (it leaves
        blocks out past its byte cap) are asked again."""
        asked = self._asked.popleft()[1] if self._asked else ()
        now = asyncio.get_running_loop().time()
        for blk in msg.blocks:
            self.fetched_bytes += blk.data.numel() * blk.data.element_size()
            fut = self._waiting.pop(blk.key, None)
            if fut is not None and not fut.done():
                fut.set_result(blk.data)
            elif self.cache.get(blk.key) is None and block_digest(blk.data) == blk.key:
                # Late (its devices gave up on it): kept, as the coordinator counted it served.
                self.cache.put(blk.key, blk.data.clone(), relay_tag(self.key, blk.key, blk.key))
        if msg.missing and len(self._missing) + len(msg.missing) > MAX_MISSING:
            self._missing = {d: t for d, t in self._missing.items() if t > now}
        for digest in msg.missing:
            if len(self._missing) < MAX_MISSING:
                self._missing[digest] = now + MISSING_S
            fut = self._waiting.pop(digest, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        answered = {b.key for b in msg.blocks} | set(msg.missing)
        for digest in reversed(asked):  # left out: first in line again, in their order
            if digest not in answered and digest in self._waiting and digest not in self._queue:
                self._queue[digest] = None
                self._queue.move_to_end(digest, last=False)
        self._wake.set()

    async def _send_upstream(self, up: object) -> None:
        """The one sender of block requests: what devices wait on, batched, paced, and at most
        ``OUTSTANDING`` requests unanswered (the coordinator answers each request, in order)."""
        loop = asyncio.get_running_loop()
        last = float("-inf")
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._queue and len(self._asked) < OUTSTANDING:
                    pause = last + 1.0 / UPSTREAM_PER_S - loop.time()
                    if pause > 0:
                        await asyncio.sleep(pause)
                    batch: list[str] = []
                    while self._queue and len(batch) < MAX_FETCH:
                        digest, _ = self._queue.popitem(last=False)
                        if digest in self._waiting:  # a device still waits on it
                            batch.append(digest)
                    if not batch:
                        continue
                    self._asked.append((loop.time(), tuple(batch)))
                    last = loop.time()
                    await up.send(encode(BlockRequest(tuple(batch))))  # type: ignore[attr-defined]
        except ConnectionClosed:
            return

    async def _fetch(self, digests: list[str]) -> dict[str, torch.Tensor | None]:
        """The coordinator's blocks for ``digests`` (None: it did not send one in
        ``UPSTREAM_TIMEOUT`` seconds, or lacks it); one upstream wait per digest however many
        devices want it at once."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        got: dict[str, torch.Tensor | None] = {}
        if self._stopped:  # the coordinator is gone: nothing will come
            return dict.fromkeys(digests)
        futures: dict[str, asyncio.Future[torch.Tensor | None]] = {}
        for d in digests:
            if self._missing.get(d, 0.0) > now:  # it said it lacks this a moment ago
                got[d] = None
                continue
            if d not in self._waiting:
                self._waiting[d] = loop.create_future()
                self._queue[d] = None
                self._wake.set()
            futures[d] = self._waiting[d]
        deadline = now + UPSTREAM_TIMEOUT
        for d, fut in futures.items():
            try:
                got[d] = await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - loop.time()))
            except (TimeoutError, asyncio.TimeoutError):
                if self._waiting.get(d) is fut:
                    del self._waiting[d]
                    self._queue.pop(d, None)
                got[d] = None
        if self._asked and loop.time() - self._asked[0][0] > 2 * UPSTREAM_TIMEOUT and self._upstream is not None:
            # A request the coordinator never answered: replies would pair with the wrong requests.
            log.error("the coordinator left a block request unanswered for %.0f s; leaving", 2 * UPSTREAM_TIMEOUT)
            asyncio.ensure_future(self._upstream.close(CloseCode.PROTOCOL, "a block request went unanswered"))  # type: ignore[attr-defined]
        return got

    async def _serve_device(self, ws: ServerConnection) -> None:
        # A connection counts among the unticketed until its first ticketed request, which it
        # must send within FIRST_REQUEST_S: idle sockets cannot take the devices' places.
        if self._unticketed >= MAX_UNTICKETED:
            await ws.close(CloseCode.BUSY, "relay is at its connection limit")
            return
        self._unticketed += 1
        loop = asyncio.get_running_loop()
        device: int | None = None  # the ticketed device this connection serves (fixed by its first request)
        try:
            try:
                frame = await asyncio.wait_for(ws.recv(), FIRST_REQUEST_S)
            except (TimeoutError, asyncio.TimeoutError):
                await ws.close(CloseCode.PROTOCOL, "no block_request in time")
                return
            while True:
                try:
                    msg = decode(frame)
                except ProtocolError as exc:
                    await ws.close(CloseCode.PROTOCOL, str(exc)[:120])
                    return
                if not isinstance(msg, BlockRequest):
                    await ws.close(CloseCode.PROTOCOL, "a relay answers block_request only")
                    return
                if device is not None and msg.device != device:
                    await ws.close(CloseCode.PROTOCOL, "one connection serves one device")
                    return
                if not ticket_ok(self.key, self.relay_id, msg.device, msg.ticket):
                    await ws.close(CloseCode.AUTH, "ticket refused")
                    return
                if device is None:
                    if self._devices >= MAX_DEVICES:
                        await ws.close(CloseCode.BUSY, "relay is at its connection limit")
                        return
                    if self._conns.get(msg.device, 0) >= CONNECTIONS_PER_DEVICE:
                        await ws.close(CloseCode.BUSY, "this device has its connections here already")
                        return
                    device = msg.device
                    self._conns[device] = self._conns.get(device, 0) + 1
                    self._unticketed -= 1
                    self._devices += 1
                allowance = self._allowances.setdefault(device, _Allowance(REQUESTS_PER_S, 2 * REQUESTS_PER_S))
                if not allowance.take(loop.time()):
                    await ws.close(CloseCode.RATE_LIMITED, "too many requests")
                    return
                if not await self._reply(ws, device, msg.digests):
                    return
                frame = await ws.recv()
        except ConnectionClosed:
            pass
        finally:
            if device is None:
                self._unticketed -= 1
            else:
                self._devices -= 1
                self._conns[device] -= 1
                if not self._conns[device]:
                    del self._conns[device]
                    self._turns.pop(device, None)  # none of its requests is in hand here any more

    async def _reply(self, ws: ServerConnection, device: int, digests: tuple[str, ...]) -> bool:
        """Answer one request of ``device``: in its turn (one of its requests at a time, however
        many connections it opens) and one of ``REPLIES`` places (over every device), each waited
        for at most ``SEND_S``; the reply written within ``SEND_S`` too, else its connection is
        dropped (a device that does not read would hold the reply's bytes for ever). False: the
        connection is closed."""
        turn = self._turns.setdefault(device, asyncio.Lock())
        try:
            await asyncio.wait_for(turn.acquire(), SEND_S)
        except (TimeoutError, asyncio.TimeoutError):  # its last reply unread this long: it would not read a close
            ws.transport.abort()
            return False
        try:
            try:
                await asyncio.wait_for(self._replies.acquire(), SEND_S)
            except (TimeoutError, asyncio.TimeoutError):
                await ws.close(CloseCode.BUSY, "relay is at its reply limit")
                return False
            try:
                frame = encode(await self._answer(digests))
                self.replying += len(frame)
                try:
                    await asyncio.wait_for(ws.send(frame), SEND_S)
                except (TimeoutError, asyncio.TimeoutError):
                    ws.transport.abort()  # its bytes go with the connection
                    return False
                finally:
                    self.replying -= len(frame)
            finally:
                self._replies.release()
        finally:
            turn.release()
        return True

    async def _answer(self, digests: tuple[str, ...]) -> Blocks:
        """The blocks of ``digests`` it holds or the coordinator sends, in order, up to
        ``REPLY_BYTES`` of them (always one): those past the cap are left out of both ``blocks``
        and ``missing`` (the device asks again), and none is fetched once the reply is full."""
        # The reply's blocks are held here, not looked up again: while this request waited on the
        # coordinator, other devices' blocks may have evicted them from the cache.
        held: dict[str, tuple[torch.Tensor, str]] = {}
        size = 0

        def fits(block: torch.Tensor) -> bool:
            nonlocal size
            nbytes = block.numel() * block.element_size()
            if held and size + nbytes > REPLY_BYTES:
                return False
            size += nbytes
            return True

        lacking = []
        for d in digests:
            hit = self.cache.get(d)
            if hit is None:
                lacking.append(d)
            elif fits(hit[0]):
                held[d] = hit
                self._largest = max(self._largest, hit[0].numel() * hit[0].element_size())
        unsent: set[str] = set()  # the coordinator did not send them (in time): missing
        # Fetched in order, a chunk at a time, until the reply is full: a chunk is as many blocks
        # as would fill the rest of it at the largest block this relay has seen (one until it has
        # seen any), so a request for 64 lacking blocks holds about one reply's bytes, not 64
        # blocks. A block fetched past the cap is only cached (within the cache's bound).
        full = False
        while lacking and not full and size < REPLY_BYTES:
            n = 1 if not self._largest else max(1, min(MAX_FETCH, (REPLY_BYTES - size) // self._largest))
            chunk, lacking = lacking[:n], lacking[n:]
            fetched = await self._fetch(chunk)
            for digest in chunk:
                block = fetched.pop(digest, None)
                if block is None:
                    unsent.add(digest)
                    continue
                if block_digest(block) != digest:  # the coordinator is trusted, but a bug is not served
                    log.error("the coordinator's block does not match its digest %s", digest[:16])
                    unsent.add(digest)
                    continue
                block = block.clone()  # its own bytes: a view would keep the whole upstream frame alive
                self._largest = max(self._largest, block.numel() * block.element_size())
                hit = (block, relay_tag(self.key, digest, digest))  # checked above
                self.cache.put(digest, *hit)
                if not full and fits(block):
                    held[digest] = hit
                else:
                    full = True  # the rest are left out (the device asks again), none fetched
            del fetched
        blocks, tags, missing = [], [], []
        for digest in digests:
            hit = held.get(digest)
            if hit is None:
                if digest in unsent:
                    missing.append(digest)
                continue  # else past the cap: left out, asked again
            block, tag = hit
            if self.tamper is not None:  # a hostile double's doing
                block = self.tamper(digest, block)
                tag = relay_tag(self.key, digest, block_digest(block))  # an honest seal on what it sends
            blocks.append(Block(digest, block))
            tags.append(tag)
            self.served_bytes += block.numel() * block.element_size()
        return Blocks(tuple(blocks), tuple(missing), tuple(tags))
