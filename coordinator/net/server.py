"""The websocket layer: accepts peers, decodes frames, calls the Core, sends what it returns.

Everything here runs on one asyncio event loop, and so does every Core call: the Core and the
store have a single writer and need no locks. The trainer runs in its own thread and reaches the
Core only through ``RemoteEngine``, which hops onto the loop with ``call_soon_threadsafe``; it
also puts each GEMM's tiles together itself (``submit(lazy=True)``). A result's Freivalds check
runs on a verifier thread (``Core.receive`` hands it out as a ``Check``, torch releases the GIL
in its products) and its verdict comes back to the loop (``Core.settle``); a device's next
message waits for that verdict, so what each device sends still acts in order.

What a peer may cost is bounded (``Limits``; the formula is in docs/security.md):

* connections are counted from the TCP accept (coordinator/net/listener.py), before TLS: past the
  cap they are refused (close 1013 after the upgrade, or closed at accept past a small
  headroom), and so are connections that have not yet passed their hello past
  ``max_unauthenticated``;
* before its hello is accepted a peer may send frames of ``pre_auth_frame`` bytes, and it has
  ``hello_timeout`` seconds to do it; afterwards the Core says how large a device's frames may
  be (``Limit``: small unless it holds a tile whose result is large);
* each connection has a writer task with a byte-counted queue: a peer whose small frames pile up
  past ``control_queue`` bytes, whose queue passes ``outbound_queue``, or that leaves one frame
  unread for ``write_timeout``, is cut; when every queue together passes ``outbound_total``,
  the peer with the longest queue is cut;
* observers (``cleave status``, link tests) need the operator token and are closed when idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from cleave.coordinator.engine import report
from cleave.coordinator.engine.balance import Redirecting
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.devices import Departure
from cleave.coordinator.engine.gemms import BandCheck, Check, Product, run_bands, run_checks
from cleave.coordinator.engine.limits import Limits
from cleave.coordinator.engine.outbound import Abort, Close, Limit, Outbound, Send
from cleave.coordinator.engine.upkeep import TICK
from cleave.coordinator.net.dashboard import CHALLENGE, Dashboard, is_bearer
from cleave.coordinator.net.dashboard import handles as dashboard_handles
from cleave.coordinator.net.framing import OffLoopTransport, SendThreads, unjoined_frames
from cleave.coordinator.net.listener import ConnectionCounter, bind
from cleave.coordinator.net.metrics import PATH as METRICS_PATH
from cleave.coordinator.net.metrics import Metrics
from cleave.coordinator.planning.costmodel import CHECK_BATCH
from cleave.coordinator.planning.tiles import GemmKind
from cleave.coordinator.training.linear import GemmRequest
from cleave.wire.codes import CloseCode, Code
from cleave.wire.errors import AuthError, JobAborted, ProtocolError
from cleave.wire.handshake import bound_handshakes
from cleave.wire.messages import (
    DEVICE_MESSAGES,
    MAX_BATCH_TENSORS,
    MAX_SPEEDTEST_BYTES,
    RELAY_MESSAGES,
    Blocks,
    Hello,
    Leave,
    ResultBatch,
    SpeedTest,
    StatusReply,
    StatusRequest,
    Work,
    WorkBatch,
    decode,
    encode,
    encode_parts,
)
from cleave.wire.verify import Verdict

log = logging.getLogger("cleave.server")

CHUNK = 256 << 10  # large replies go out in fragments of this size, so a slow reader costs little
REFUSE_GRACE = 0.2  # seconds a refused peer has to answer our close before its socket is dropped
CHECK_WAIT = 10.0  # seconds a closed connection's last result may take to be judged before it is let go
_zeros: bytearray | None = None  # shared payload of every speed-test reply (never written)


@dataclass(frozen=True)
class _Frame:
    # One frame, or a large work message's fragments: its header, then views of its blocks (not
    # copied). A GEMM's operands do not change while it is live; a frame that outlives its GEMM
    # (a cancelled copy's) may carry weights the optimizer is updating, under keys of a source
    # version no later work names: its result is dropped, its blocks never read again.
    data: bytes | list[bytes | memoryview]
    size: int
    control: bool  # anything but work: counted against Limits.control_queue
    tiles: tuple[int, ...] = ()  # a work frame's tiles: the Core learns when they go on the wire


@dataclass
class _Conn:
    ws: ServerConnection
    queue: asyncio.Queue[_Frame | tuple[int, str]] = field(default_factory=asyncio.Queue)
    writer: asyncio.Task[None] | None = None
    control_bytes: int = 0  # queued bytes of frames other than work
    queued_bytes: int = 0  # queued bytes of every frame, work included
    sending: _Frame | None = None  # the frame being written now (still counted)
    done: bool = False  # its writer has ended: nothing more is queued or counted
    cut: str | None = None  # why the server cut this peer
    # Its results under check: one frame's (a result, or a result batch's). The next message
    # waits for their verdicts, so the device's messages act in the order sent and the frames
    # held stay within the stated bound.
    checks: set[asyncio.Future[tuple[Verdict, float]]] = field(default_factory=set)
    checked: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Traffic:
    bytes_down: int = 0
    bytes_up: int = 0
    frames_up: int = 0
    work_frames: int = 0  # frames queued that carry tiles (a fragmented one counts once)
    work_tiles: int = 0  # the tiles they carry: work_tiles / work_frames a frame


def _reason(text: str) -> str:
    # A close reason must fit in 123 UTF-8 bytes.
    return text.encode()[:120].decode(errors="ignore")


async def _refuse(ws: ServerConnection, code: int, reason: str) -> bool:
    """Close with a code and a reason, without waiting on a peer that may never answer, or that
    keeps streaming a frame we refused: its socket is dropped after a short grace. True when the
    peer answered the close within it."""
    try:
        await asyncio.wait_for(ws.close(code, reason), REFUSE_GRACE)
        return True
    except (TimeoutError, asyncio.TimeoutError):
        return False
    finally:
        ws.transport.abort()


class Server:
    def __init__(
        self,
        core: Core,
        clock: Callable[[], float] = time.monotonic,
        limits: Limits | None = None,
        *,
        send_threads: int = 0,
    ) -> None:
        self.core = core
        self.clock = clock
        self.limits = limits or core.limits
        self.conns: dict[int, _Conn] = {}
        self.traffic = Traffic()
        self.metrics = Metrics(self._books, clock, devices=lambda: self.status()["devices"])
        self.dashboard = Dashboard(self.status, core.is_operator, clock)
        # A rank of a tier: the whole tier as this rank sees it (tier/group.py; set by the job).
        self.tier_view: Callable[[], dict[str, Any]] | None = None
        self.counter = ConnectionCounter(self.limits)  # fed by the listening socket (listen())
        self._observing: set[ServerConnection] = set()  # cleave status and link tests, connected
        self.refused = 0  # connections refused at a cap after the upgrade
        self.outbound_bytes = 0  # queued on every connection together
        self._pending: set[concurrent.futures.Future[Product]] = set()
        self._devices_changed = asyncio.Event()
        self._device_count = 0
        self._aborted: str | None = None
        self._closing = False
        # Results are verified on a thread of their own (torch releases the GIL in the products),
        # so the loop keeps framing and sending while a check runs. One thread: checks of one
        # device's results run in arrival order, and its generator is never shared. Seeded from
        # the Core's (OS entropy in a job), so a seeded test stays reproducible.
        self._verifier: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first check
        self._verify_rng = core.child_rng()
        self._checks: set[asyncio.Future[tuple[Verdict, float]]] = set()
        # Results wait here while the verifier is busy, then go to it together as one batch
        # (``run_checks``): the busier it is, the more each batch shares. At most one frame's
        # results per connection wait (its next message waits for their verdicts), and a batch
        # takes at most ``CHECK_BATCH`` of them.
        self._waiting: list[tuple[Check, asyncio.Future[tuple[Verdict, float]]]] = []
        # Bands whose results are all in (``Core.take_band_checks``): the verifier takes them
        # before single results, since a GEMM waits on them. Bounded by the live GEMMs' bands.
        self._bands_waiting: list[BandCheck] = []
        self._bands_last = False  # the verifier's last job was bands
        self._batch: asyncio.Future[list[tuple[Verdict, float]]] | None = None
        self.check_batches = 0  # batches verified (results per batch: checked / batches)
        self.band_batches = 0  # jobs of band checks verified
        self.checked = 0
        self._stopped = False
        # Devices' bytes written to their sockets by threads beside the loop (net/framing.py);
        # 0: by the loop itself.
        self.senders = SendThreads(send_threads) if send_threads else None

    # ------------------------------------------------------------------ connection counting

    @property
    def observers(self) -> int:
        return len(self._observing)

    @property
    def tcp_open(self) -> int:
        return self.counter.open

    @property
    def pending(self) -> int:
        return len(self.counter.pending)

    @staticmethod
    def _fd(ws: ServerConnection) -> int:
        sock = ws.transport.get_extra_info("socket")
        return sock.fileno() if sock is not None else -1

    def _authenticated(self, ws: ServerConnection) -> None:
        self.counter.authenticated(self._fd(ws))

    # ------------------------------------------------------------------ peers

    async def handler(self, ws: ServerConnection) -> None:
        lim = self.limits
        unjoined_frames(ws.protocol)  # work frames' blocks go to the socket without a copy
        if self.counter.over_cap():
            self.refused += 1
            await _refuse(ws, CloseCode.BUSY, "coordinator is at its connection limit; try again later")
            return
        challenge = self.core.challenge()
        try:
            await ws.send(encode(challenge))
            first = await asyncio.wait_for(ws.recv(), lim.hello_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            await _refuse(ws, CloseCode.PROTOCOL, f"no hello within {lim.hello_timeout:g} s")
            return
        except ConnectionClosed:
            ws.transport.abort()  # a frame over the limit, say: stop reading what follows it
            return
        self.traffic.bytes_up += len(first)
        self.traffic.frames_up += 1
        try:
            msg = decode(first)
        except ProtocolError as exc:
            await _refuse(ws, CloseCode.PROTOCOL, _reason(f"{exc.code.value}: {exc}"))
            return
        if isinstance(msg, (StatusRequest, SpeedTest)):
            await self._observe(ws, msg)
            return
        if not isinstance(msg, Hello):
            await _refuse(ws, CloseCode.PROTOCOL, "first message must be hello, status_request or speedtest")
            return
        try:
            device_id, out = self.core.connect(msg, challenge.nonce, self.clock())
        except AuthError as exc:  # never log what the peer presented: it may be someone's secret
            log.warning("refused a device from %s: %s", ws.remote_address, exc.reason)
            await _refuse(ws, exc.code, _reason(exc.reason))
            return
        except Redirecting as exc:  # a rank of a tier: another rank needs devices more
            log.info("sent a newcomer from %s to rank %d", ws.remote_address, exc.message.rank)
            try:
                await asyncio.wait_for(ws.send(encode(exc.message)), REFUSE_GRACE)
            except (ConnectionClosed, TimeoutError, asyncio.TimeoutError):
                return
            if not await _refuse(ws, CloseCode.REDIRECTED, f"redirected to rank {exc.message.rank}"):
                # It ignored the redirect: dropped, and its unredeemed ticket is put down to it,
                # not to the rank it was sent to (engine/balance.py, ``ignored_by``).
                log.info("a newcomer from %s ignored its redirect to rank %d", ws.remote_address, exc.message.rank)
                self.core.redirect_ignored(exc.message.rank)
            return
        self._authenticated(ws)
        if self.senders is not None:  # the loop's own transport if this one cannot be had (no descriptor left)
            ws.transport = self.senders.wrap(ws.transport)
        allowed = RELAY_MESSAGES if msg.relay else DEVICE_MESSAGES  # a relay asks for blocks, nothing else

        def here() -> bool:  # not dropped by the Core (banned, rate-limited, ...)
            return self.core.connected(device_id)

        conn = _Conn(ws)
        conn.writer = asyncio.create_task(self._write(conn, device_id))
        self.conns[device_id] = conn
        self._devices_changed.set()
        log.info("device %d (%s) joined from %s", device_id, msg.name, ws.remote_address)
        self.deliver(out)
        reason: str = Departure.CLOSED
        try:
            async for frame in ws:
                self.traffic.bytes_up += len(frame)
                self.traffic.frames_up += 1
                try:
                    msg = decode(frame)
                    if not isinstance(msg, allowed) or isinstance(msg, Hello):
                        raise ProtocolError(f"{msg.TYPE} is not a message a device may send", Code.UNEXPECTED)
                except ProtocolError as exc:
                    reason = f"{exc.code.value}: {exc}"
                    conn.queue.put_nowait((CloseCode.PROTOCOL, _reason(reason)))
                    break
                if conn.checks:  # its last results' verdicts come first
                    await conn.checked.wait()
                try:
                    # A result batch's results as one piece of bookkeeping (Core.receive_all).
                    got, checks = self.core.receive_all(
                        device_id, msg.results if isinstance(msg, ResultBatch) else (msg,), self.clock()
                    )
                    self.deliver(got)
                    for check in checks:
                        self._verify(check, conn)
                    self._pump_bands()
                except Exception:  # a bug must not pass silently, nor take the server down
                    log.exception("handling %s from device %d failed", msg.TYPE, device_id)
                    reason = f"internal error on {msg.TYPE}"
                    conn.queue.put_nowait((CloseCode.INTERNAL, "internal error"))
                    # A frame's books are one write group without a savepoint per call
                    # (Core.receive_all): never go on as if half of it had not been written.
                    self.abort("internal error in the coordinator's bookkeeping (see the log)")
                    break
                if isinstance(msg, Leave):
                    reason = Departure.LEFT
                    break
                if not here():  # the Core dropped it (banned, rate-limited...)
                    break
        except ConnectionClosed:
            if ws.close_code == CloseCode.TOO_BIG:  # a frame over its limit: do not read (and discard) the rest of it
                ws.transport.abort()
        finally:
            try:
                if conn.checks:  # a forgery is still judged (and banned) while it is here
                    try:
                        await asyncio.wait_for(conn.checked.wait(), CHECK_WAIT)
                    except (TimeoutError, asyncio.TimeoutError):
                        pass
                if self.conns.get(device_id) is conn:
                    del self.conns[device_id]
                if conn.cut is not None:
                    reason = conn.cut
                if self._aborted is not None:
                    reason = Departure.SHUTDOWN  # the coordinator is going: not the device's fault
                elif self._closing:
                    reason = Departure.FINISHED
                self.deliver(self.core.disconnect(device_id, self.clock(), reason))
                self._devices_changed.set()
                log.info("device %d left: %s", device_id, reason)
                await self._finish_writer(conn)
            finally:  # its own handle on the socket goes however the rest ended
                if isinstance(ws.transport, OffLoopTransport):
                    ws.transport.release()

    async def _observe(self, ws: ServerConnection, first: StatusRequest | SpeedTest) -> None:
        """A ``cleave status`` or ``cleave benchmark --url`` peer: one reply per request.

        Everything an observer may ask for needs the operator token (volunteers hold the join
        token only); requests are rate-limited, and an observer idle for ``observer_idle``
        seconds is closed, so a few cannot keep the operator out."""
        lim = self.limits
        if not self.core.is_operator(first.token):
            await _refuse(ws, CloseCode.AUTH, "observers need the operator token")
            return
        if self.observers >= lim.observers:
            self.refused += 1
            await _refuse(ws, CloseCode.BUSY, "too many observers; try again later")
            return
        self._authenticated(ws)
        self._observing.add(ws)
        ws.protocol.max_message_size = lim.observer_frame
        status, volume = lim.status.bucket(), lim.speedtest_bytes.bucket()
        request: object = first
        try:
            while True:
                now = self.clock()
                if isinstance(request, SpeedTest):
                    if not volume.take(now, request.reply_bytes + request.data.numel()):
                        await _refuse(ws, CloseCode.RATE_LIMITED, "link tests over their byte allowance")
                        return
                    await ws.send(_speedtest_reply(request.reply_bytes))
                elif isinstance(request, StatusRequest):
                    if not self.core.is_operator(request.token):
                        await _refuse(ws, CloseCode.AUTH, "status needs the operator token")
                        return
                    if not status.take(now):
                        await _refuse(ws, CloseCode.RATE_LIMITED, "status requests too often")
                        return
                    await ws.send(encode(StatusReply(self.status())))
                else:
                    await _refuse(ws, CloseCode.PROTOCOL, "observers may only send status_request or speedtest")
                    return
                try:
                    request = decode(await asyncio.wait_for(ws.recv(), lim.observer_idle))
                except (TimeoutError, asyncio.TimeoutError):
                    await _refuse(ws, CloseCode.IDLE, f"idle for {lim.observer_idle:g} s")
                    return
                except ProtocolError as exc:
                    await _refuse(ws, CloseCode.PROTOCOL, _reason(f"{exc.code.value}: {exc}"))
                    return
        except ConnectionClosed:
            ws.transport.abort()  # a frame over the limit, say: stop reading what follows it
            return
        finally:
            self._observing.discard(ws)

    def _books(self) -> dict[str, Any]:
        """What ``/metrics`` reports: the engine's books and this server's traffic."""
        t = self.traffic
        return {
            **report.books(self.core),
            "traffic": {
                "bytes_down": t.bytes_down,
                "bytes_up": t.bytes_up,
                "bytes_relay_out": self.core.relay_bytes()[0],
            },
        }

    def record_step(self, step: int, loss: float, seconds: float, val_loss: float | None = None) -> None:
        """A step finished (on the loop): the metrics' histogram and the dashboard's curves
        (``val_loss``: the held-out loss, on a step that evaluated one)."""
        self.metrics.step(seconds)
        self.dashboard.step(step, loss, val_loss)

    def http(self, connection: ServerConnection, request: Request) -> Response | None:
        """Plain HTTP on the websocket port: the dashboard (``/``, its assets, ``/api/status``)
        and ``GET /metrics`` (Prometheus). A websocket upgrade, or any other path, goes on to
        the handshake (which answers 426 to a request that is not an upgrade)."""
        upgrade = request.headers.get_all("Upgrade")
        if any(u.lower() == "websocket" for u in upgrade):
            return None
        path = request.path.split("?", 1)[0]
        auth = request.headers.get_all("Authorization")
        # Two Authorization headers are one too many: answered as a wrong token.
        authorization = auth[0] if len(auth) == 1 else ("invalid" if auth else None)
        try:
            if path == METRICS_PATH:
                operator = is_bearer(authorization, self.core.is_operator)
                if operator is False:
                    status, content_type, body = 401, "text/plain; charset=utf-8", b"wrong operator token\n"
                    headers = {"Cache-Control": "no-store", "WWW-Authenticate": CHALLENGE}
                else:
                    status, content_type, body = self.metrics.render(operator=bool(operator))
                    headers = {"Cache-Control": "no-store"}
            elif dashboard_handles(path):
                status, content_type, body, headers = self.dashboard.respond(path, authorization)
            else:
                return None
        except Exception:  # a bug must not take the port down, nor pass silently
            log.exception("answering GET %s failed", path[:100])
            return connection.respond(500, "internal error\n")
        response = connection.respond(status, "")
        response.body = body
        del response.headers["Content-Type"], response.headers["Content-Length"]
        response.headers["Content-Type"] = content_type
        response.headers["Content-Length"] = str(len(body))
        for name, value in headers.items():
            response.headers[name] = value
        return response

    def status(self) -> dict[str, Any]:
        snapshot = report.status(self.core, self.clock())
        t = self.traffic
        snapshot["traffic"] = {
            "mb_down": round(t.bytes_down / 1e6, 2),
            "mb_up": round(t.bytes_up / 1e6, 2),
            # Everything that left the coordinator (to devices and to relays), and what relays
            # were asked to serve in its stead (the bytes its devices were told to fetch there).
            "mb_ps_out": round(t.bytes_down / 1e6, 2),
            "mb_relay_out": round(self.core.relay_bytes()[0] / 1e6, 2),
        }
        snapshot["relays"] = report.relays(self.core)
        snapshot["connections"] = {
            "open": self.tcp_open,
            "unauthenticated": self.pending,
            "observers": self.observers,
            "refused": self.refused + self.counter.refused,
            "mb_queued": round(self.outbound_bytes / 1e6, 2),
        }
        if self.tier_view is not None:
            snapshot["tier"] = self.tier_view()
        return snapshot

    async def _write(self, conn: _Conn, device_id: int) -> None:
        """Send the connection's queue in order. However it ends (closed, cut, cancelled), what
        is left is uncounted, and nothing more is queued for it."""
        try:
            while True:
                item = await conn.queue.get()
                if isinstance(item, tuple):
                    await conn.ws.close(*item)
                    return
                conn.sending = item
                for tile in item.tiles:
                    self.core.on_wire(device_id, tile, self.clock())
                try:
                    # A peer that does not read would hold the frame (and the queue behind it) forever.
                    await asyncio.wait_for(conn.ws.send(item.data), self.limits.write_timeout)
                except (TimeoutError, asyncio.TimeoutError):
                    self._cut(conn, f"did not read for {self.limits.write_timeout:g} s")
                    return
                except ConnectionClosed:
                    return
                finally:
                    self._uncount_sending(conn)
        finally:
            conn.done = True
            self._drain(conn)

    def _sent(self, conn: _Conn, item: _Frame) -> None:
        conn.queued_bytes -= item.size
        self.outbound_bytes -= item.size
        if item.control:
            conn.control_bytes -= item.size

    def _uncount_sending(self, conn: _Conn) -> None:
        if conn.sending is not None:
            self._sent(conn, conn.sending)
            conn.sending = None

    def _drain(self, conn: _Conn) -> None:
        """Drop (and uncount) every frame still queued for a peer."""
        while not conn.queue.empty():
            item = conn.queue.get_nowait()
            if isinstance(item, _Frame):
                self._sent(conn, item)

    def _cut(self, conn: _Conn, why: str) -> None:
        log.warning("cutting a device that stopped reading (%s)", why)
        conn.cut = why
        self._abort(conn)
        # Uncounted now, not when its cancelled writer next runs: the budget loop in _queue
        # must see the bytes gone, or it would cut one peer after another.
        self._uncount_sending(conn)
        self._drain(conn)

    async def _finish_writer(self, conn: _Conn) -> None:
        if conn.writer is None:
            return
        if not conn.writer.done():
            conn.queue.put_nowait((CloseCode.FINISHED, "bye"))
            try:
                await asyncio.wait_for(conn.writer, 5.0)
            except (TimeoutError, asyncio.TimeoutError):
                conn.writer.cancel()

    def _verify(self, check: Check, conn: _Conn) -> None:
        """Verify a result off the loop; ``settle`` acts on the verdict back on the loop, as soon
        as it is known. One frame's results per connection at a time (the handler waits before
        the next message), so pending checks are bounded by the connections' slots."""
        if self._stopped:  # the job is over: nobody needs the result
            self.core.abandon(check)
            return
        future: asyncio.Future[tuple[Verdict, float]] = asyncio.get_running_loop().create_future()
        self._checks.add(future)
        conn.checks.add(future)
        conn.checked.clear()
        future.add_done_callback(lambda f: self._checked(conn, f))
        self._waiting.append((check, future))
        self._next_batch()

    def _pump_bands(self) -> None:
        """Bands whose last result just came in go to the verifier."""
        bands = self.core.take_band_checks()
        if bands:
            self._bands_waiting.extend(bands)
            self._next_batch()

    def _next_batch(self) -> None:
        """Hand the verifier the bands due, or else every result waiting for it (up to
        ``CHECK_BATCH``), if it is idle."""
        if self._batch is not None or self._stopped or not (self._bands_waiting or self._waiting):
            return
        if self._verifier is None:
            self._verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cleave-verify")
        # Bands first (a GEMM waits on them), but never twice in a row while results wait: a
        # newcomer's connection reads its next message only once its last result is judged.
        if self._bands_waiting and not (self._bands_last and self._waiting):
            self._bands_last = True
            bands, self._bands_waiting = self._bands_waiting, []
            job = asyncio.get_running_loop().run_in_executor(self._verifier, run_bands, bands, self._verify_rng)
            self._batch = job
            job.add_done_callback(lambda f: self._bands_done(bands, f))
            return
        self._bands_last = False
        take = self._waiting[:CHECK_BATCH]
        checks = [check for check, _ in take]
        batch = asyncio.get_running_loop().run_in_executor(self._verifier, run_checks, checks, self._verify_rng)
        del self._waiting[: len(take)]  # handed over only once the verifier has them
        self._batch = batch
        batch.add_done_callback(lambda f: self._batch_done(take, f))

    def _batch_done(
        self, take: list[tuple[Check, asyncio.Future[tuple[Verdict, float]]]], batch: asyncio.Future
    ) -> None:
        """Settle each result on its verdict, then dispatch once and send what they decided
        together: the slots the batch freed are granted at one moment, so the tiles go out in as
        few frames as the devices take (``_batched``), and the batch's store rows and credits are
        one piece of bookkeeping (``Core.batch``); the next batch starts."""
        self._batch = None
        out: list[Outbound] = []
        try:
            if batch.cancelled():
                for _, future in take:
                    future.cancel()
                return
            error = batch.exception()
            verdicts = batch.result() if error is None else []
            if error is None and len(verdicts) != len(take):  # a bug: never pair a verdict with the wrong result
                error = RuntimeError(f"{len(verdicts)} verdicts for {len(take)} results")
            self.check_batches += 1
            self.checked += len(take)
            if error is not None:  # a bug in verification must stop the job, never pass a result unchecked
                log.error("verifying a batch of %d results failed", len(take), exc_info=error)
                self.abort("internal error in the coordinator's verification (see the log)")
                for _, future in take:
                    if not future.done():
                        future.set_exception(error)
                return
            try:
                with self.core.batch():
                    self._settle_all(take, verdicts, out)
            except Exception:  # the batch's bookkeeping failed: never go on as if it had not
                log.exception("writing a batch of %d results failed", len(take))
                self.abort("internal error in the coordinator's verification (see the log)")
        finally:
            self.deliver(out)
            self._pump_bands()  # a result checked alone may have completed its band
            self._next_batch()

    def _bands_done(self, bands: list[BandCheck], job: asyncio.Future) -> None:
        """Settle each band's check as one piece of bookkeeping, dispatch once, send what they
        decided; the next job starts."""
        self._batch = None
        out: list[Outbound] = []
        try:
            if job.cancelled():
                return
            error = job.exception()
            outcomes = job.result() if error is None else []
            if error is None and len(outcomes) != len(bands):
                error = RuntimeError(f"{len(outcomes)} outcomes for {len(bands)} bands")
            if error is not None:  # a bug in verification must stop the job, never pass a result unchecked
                log.error("checking %d bands failed", len(bands), exc_info=error)
                self.abort("internal error in the coordinator's verification (see the log)")
                return
            self.band_batches += 1
            try:
                with self.core.batch():
                    now = self.clock()
                    for band, (passed, verdicts, seconds) in zip(bands, outcomes, strict=True):
                        self.checked += len(verdicts)
                        out.extend(self.core.settle_band(band, passed, verdicts, seconds, now))
                    if not self._stopped:
                        out.extend(self.core.dispatch(now))
            except Exception:  # the bookkeeping failed: never go on as if it had not
                log.exception("settling %d bands failed", len(bands))
                self.abort("internal error in the coordinator's verification (see the log)")
        finally:
            self.deliver(out)
            self._pump_bands()
            self._next_batch()

    def _settle_all(
        self,
        take: list[tuple[Check, asyncio.Future[tuple[Verdict, float]]]],
        verdicts: list[tuple[Verdict, float]],
        out: list[Outbound],
    ) -> None:
        """Settle every verdict, then dispatch once; what they decide goes into ``out`` as it is
        decided (sent even if the batch's bookkeeping then fails: a ban's close, say)."""
        for (check, future), (verdict, seconds) in zip(take, verdicts, strict=True):
            if future.done():  # cancelled: the server is stopping
                continue
            try:  # the slots it frees are granted once the whole batch is settled
                out.extend(self.core.settle(check, verdict, seconds, self.clock(), dispatch=False))
            except Exception as exc:  # a bug must not pass a result unchecked, nor go unheard
                log.exception("settling tile %d of device %d failed", check.msg.tile_id, check.dev.id)
                self.abort("internal error in the coordinator's verification (see the log)")
                future.set_exception(exc)
                continue
            future.set_result((verdict, seconds))
        if not self._stopped:
            try:
                out.extend(self.core.dispatch(self.clock()))
            except Exception:  # a bug must not go unheard, nor leave the batch's verdicts unsent
                log.exception("dispatching after a batch of %d results failed", len(take))
                self.abort("internal error in the coordinator's scheduling (see the log)")

    def _checked(self, conn: _Conn, future: asyncio.Future[tuple[Verdict, float]]) -> None:
        """A result's verdict is settled (or the server is stopping): its connection may read on
        once every result of its frame is."""
        self._checks.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: logged and acted on in _batch_done
        conn.checks.discard(future)
        if not conn.checks:
            conn.checked.set()

    def stop_verifying(self) -> None:
        """Drop the checks still pending (the job is over; their results are not needed)."""
        self._stopped = True
        self._waiting.clear()
        self._bands_waiting.clear()
        if self._batch is not None:
            self._batch.cancel()
        for future in list(self._checks):
            future.cancel()
        if self._verifier is not None:
            self._verifier.shutdown(wait=False, cancel_futures=True)

    def deliver(self, outbound: Sequence[Outbound]) -> None:
        """Queue the Core's messages on their sockets (never blocks the loop); a device's work
        goes out in batches as large as it takes (``_batched``)."""
        for item in _batched(outbound, self.core.batch_of):
            if isinstance(item, Abort):  # training cannot go on: the trainer hears why
                log.error("stopping the job: %s", item.reason)
                self.abort(item.reason)
                continue
            conn = self.conns.get(item.device)
            if conn is None or conn.cut is not None or conn.done:
                continue
            if isinstance(item, Send):
                msg = item.message
                works = (msg,) if isinstance(msg, Work) else msg.works if isinstance(msg, WorkBatch) else ()
                tiles = tuple(w.tile_id for w in works)
                # Blocks to a relay travel as work's blocks do (its bulk, not its control messages).
                bulk = bool(works) or isinstance(msg, Blocks)
                carries = any(w.blocks for w in works) or (isinstance(msg, Blocks) and bool(msg.blocks))
                parts = encode_parts(msg) if carries else None
                if parts is not None and sum(len(p) for p in parts) > CHUNK:
                    # Large: views of the blocks in fragments. Small ones are joined: one frame
                    # costs less than two, and the copy is cheap.
                    parts = _fragments(parts)
                    frame = _Frame(parts, sum(len(p) for p in parts), False, tiles)
                else:
                    data = encode(msg) if parts is None else b"".join(parts)
                    frame = _Frame(data, len(data), not bulk, tiles)
                t = self.traffic
                t.bytes_down += frame.size
                if tiles:
                    t.work_frames += 1
                    t.work_tiles += len(tiles)
                self._queue(conn, frame)
            elif isinstance(item, Limit):
                conn.ws.protocol.max_message_size = item.nbytes

            elif isinstance(item, Close) and item.code == CloseCode.SILENT:
                self._abort(conn)  # a frozen peer reads nothing: a closing handshake would hang
            else:
                conn.queue.put_nowait((item.code, _reason(item.reason)))

    def _queue(self, conn: _Conn, frame: _Frame) -> None:
        """Queue a frame, within the per-connection and global outbound bounds."""
        lim = self.limits
        size = frame.size
        conn.queued_bytes += size
        self.outbound_bytes += size
        if frame.control:
            conn.control_bytes += size
        conn.queue.put_nowait(frame)
        if conn.control_bytes > lim.control_queue:
            self._cut(conn, f"{conn.control_bytes} bytes of unread messages")
        elif conn.queued_bytes > lim.outbound_queue:
            self._cut(conn, f"{conn.queued_bytes} bytes queued for it, unread")
        while self.outbound_bytes > lim.outbound_total:  # rare: O(connections) only then
            hog = max((c for c in self.conns.values() if c.cut is None), key=lambda c: c.queued_bytes, default=None)
            if hog is None or hog.queued_bytes == 0:
                break
            self._cut(hog, f"the longest of {self.outbound_bytes} bytes queued on every connection")

    @staticmethod
    def _abort(conn: _Conn) -> None:
        if conn.writer is not None:
            conn.writer.cancel()
        conn.ws.transport.abort()

    async def tick_forever(self, interval: float = TICK) -> None:
        """Let time pass in the Core: silent devices, passed deadlines, stragglers, heartbeats."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.deliver(self.core.tick(self.clock()))
            except Exception:  # without ticks, deadlines and heartbeats stop: fail the job loudly
                log.exception("the coordinator's clock tick failed; stopping the job")
                self.abort("internal error in the coordinator's tick (see the log)")
                raise
            if self.core.active_devices != self._device_count:  # joins, leaves, pauses, resumes
                self._device_count = self.core.active_devices
                self._devices_changed.set()

    async def wait_for_devices(self, count: int, on_wait: Callable[[int], None] | None = None) -> None:
        while self.core.active_devices < count:
            if on_wait is not None:
                on_wait(self.core.active_devices)
            self._devices_changed.clear()
            await self._devices_changed.wait()

    async def close_all(self, reason: str = "job finished", timeout: float = 5.0) -> None:
        """Close every connection after its queued messages (the job is over: each device's
        departure reads ``job finished``); abort any peer that stopped reading."""
        self._closing = True
        conns = list(self.conns.values())
        for conn in conns:
            conn.queue.put_nowait((CloseCode.FINISHED, reason))
        writers = [c.writer for c in conns if c.writer is not None]
        if writers:
            await asyncio.wait(writers, timeout=timeout)
        for conn in conns:
            if conn.writer is not None and not conn.writer.done():
                self._abort(conn)
        if self.senders is not None:
            self.senders.close()

    async def close_observers(self, reason: str = "job finished") -> None:
        """Close every observer with 1000: the job is over and the coordinator is leaving (an
        observer's ``cleave status`` then ends with the job's summary, not an error)."""
        watching = list(self._observing)
        if watching:
            await asyncio.wait([asyncio.ensure_future(_refuse(ws, CloseCode.FINISHED, reason)) for ws in watching])

    # ------------------------------------------------------------------ GEMMs from the trainer thread

    def submit(
        self,
        requests: Sequence[GemmRequest],
        futures: Sequence[concurrent.futures.Future[Product]],
        out_dtypes: Sequence[torch.dtype | None] | None = None,
        kept: Sequence[Product | None] | None = None,
        deferred: bool = False,
    ) -> None:
        """Runs on the loop: queue each GEMM; its future resolves when all its tiles are verified.
        ``out_dtypes``: each product's dtype where it differs from its operands' (wire casts);
        ``kept``: how to compute it should the planner keep it on the PS (from the originals);
        ``deferred``: needed only at the step's end (see ``Core.submit``)."""
        none = [None] * len(requests)
        for request, future, out_dtype, local in zip(requests, futures, out_dtypes or none, kept or none):
            if self._aborted is not None:  # shutting down: the trainer thread must not wait forever
                future.set_exception(JobAborted(self._aborted))
                continue
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
            try:
                # Checked for NaN by RemoteEngine.run and assembled by it, on the trainer thread.
                self.start(
                    request.a,
                    request.b,
                    request.kind,
                    lambda result, f=future: None if f.done() else f.set_result(result),
                    finite_checked=True,
                    lazy=True,
                    out_dtype=out_dtype,
                    kept=local,
                    deferred=deferred,
                    retain=request.retain,
                )
            except Exception as exc:  # surfaced in the trainer thread, not swallowed here
                if not future.done():
                    future.set_exception(exc)
                continue

    def start(
        self, a: torch.Tensor, b: torch.Tensor, kind: GemmKind, on_done: Callable[[Any], None], **options: Any
    ) -> int:
        """Runs on the loop: ``Core.submit`` and send what it decides. Returns the GEMM's id
        (-1: kept on the coordinator)."""
        gemm_id, out = self.core.submit(a, b, kind, self.clock(), on_done, **options)
        self.deliver(out)
        return gemm_id

    def abort(self, reason: str) -> None:
        self._aborted = reason
        for future in list(self._pending):
            if not future.done():
                future.set_exception(JobAborted(reason))


def _batched(outbound: Sequence[Outbound], batch_of: Callable[[int], int]) -> list[Outbound]:
    """``outbound`` with each device's work sent together as one ``WorkBatch`` where it takes
    batches (its hello's ``batch``): at most that many tiles and ``MAX_BATCH_TENSORS`` new
    blocks a frame. A batch goes out where its first work was; any other message to the device
    (a cancel, an error, a close) ends it, so each device hears everything in the order the
    Core decided. A ``Limit`` does not: it takes effect at once, before any frame is written."""
    out: list[Any] = []
    open_: dict[int, int] = {}  # device -> index in ``out`` of its batch still taking work
    for item in outbound:
        if isinstance(item, Send) and isinstance(item.message, Work):
            cap = batch_of(item.device)
            i = open_.get(item.device)
            if i is not None:
                works = out[i][1]
                blocks = sum(len(w.blocks) for w in works) + len(item.message.blocks)
                if len(works) < cap and blocks <= MAX_BATCH_TENSORS:
                    works.append(item.message)
                    continue
            if cap > 1:
                open_[item.device] = len(out)
                out.append((item.device, [item.message]))
                continue
        elif isinstance(item, (Send, Close)):
            open_.pop(item.device, None)
        out.append(item)
    return [
        (
            Send(item[0], item[1][0] if len(item[1]) == 1 else WorkBatch(tuple(item[1])))
            if isinstance(item, tuple)
            else item
        )
        for item in out
    ]


def _speedtest_reply(nbytes: int) -> list[bytes | memoryview]:
    """A speed-test reply in fragments of the shared zero buffer: nothing allocated per request,
    and a slow reader holds at most one fragment."""
    global _zeros
    if _zeros is None:
        _zeros = bytearray(MAX_SPEEDTEST_BYTES)
    payload = torch.frombuffer(_zeros, dtype=torch.uint8, count=nbytes) if nbytes else torch.zeros(0, dtype=torch.uint8)
    return _fragments(encode_parts(SpeedTest(nbytes, payload)))


def _fragments(parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """A message's header, then its payload views cut in CHUNK fragments (no copies)."""
    head, *rest = parts
    return [head, *(view[i : i + CHUNK] for view in rest for i in range(0, len(view), CHUNK))]


def listen(server: Server, host: str, port: int, tls: ssl.SSLContext | None = None) -> Any:
    """The websocket server around ``server`` (an async context manager): no compression, a
    small frame limit until each peer authenticates, connections counted from the TCP accept."""
    lim = server.limits
    bound_handshakes()  # here, not at import: the Python API's coordinator gets them too
    return serve(
        server.handler,
        sock=bind(host, port, server.counter),
        compression=None,
        ssl=tls,
        max_size=lim.pre_auth_frame,  # raised per peer once it is authenticated
        max_queue=lim.max_queue,
        ping_interval=20,
        ping_timeout=120,
        close_timeout=2,  # a frozen peer never answers a close
        process_request=server.http,  # the dashboard and GET /metrics
    )
