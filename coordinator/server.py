"""The websocket layer: accepts peers, decodes frames, calls the Core, sends what it returns.

Everything here runs on one asyncio event loop, and so does every Core call: the Core and the
store have a single writer and need no locks. The trainer runs in its own thread and reaches the
Core only through ``RemoteEngine``, which hops onto the loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from coordinator.core import (
    SHUTDOWN, AuthError, Core, Outbound, Send,
)
from coordinator.protocol import (
    CLOSE_AUTH, CLOSE_FINISHED, CLOSE_PROTOCOL, CLOSE_SILENT, Heartbeat, Hello, Leave, Pause, ProtocolError, Release, Result, Resume, SpeedTest, StatusReply, StatusRequest,
    decode, encode,
)
from coordinator.training.linear import GemmRequest

log = logging.getLogger("cleave.server")

HELLO_TIMEOUT = 10.0  # a peer must introduce itself this fast
MAX_FRAME = 256 << 20  # results of big split-K tiles are tens of MB; anything past this is refused
_CLIENT_MESSAGES = (Result, Release, Heartbeat, Pause, Resume, Leave, StatusRequest)
TICK = 0.05  # seconds between Core.tick calls: deadlines, heartbeats, speculation


class JobAborted(RuntimeError):
    """The coordinator is shutting down; GEMMs still in flight will never complete."""


@dataclass
class _Conn:
    ws: ServerConnection
    queue: asyncio.Queue[bytes | tuple[int, str]] = field(default_factory=asyncio.Queue)
    writer: asyncio.Task[None] | None = None


@dataclass
class Traffic:
    bytes_down: int = 0
    bytes_up: int = 0


def _reason(text: str) -> str:
    # A close reason must fit in 123 UTF-8 bytes.
    return text.encode()[:120].decode(errors="ignore")


class Server:
    def __init__(self, core: Core, clock: Callable[[], float] = time.time, hello_timeout: float = HELLO_TIMEOUT) -> None:
        self.core = core
        self.hello_timeout = hello_timeout
        self.clock = clock
        self.conns: dict[int, _Conn] = {}
        self.traffic = Traffic()
        self._pending: set[concurrent.futures.Future[torch.Tensor]] = set()
        self._devices_changed = asyncio.Event()
        self._device_count = 0
        self._aborted: str | None = None
        self._closing = False

    # ------------------------------------------------------------------ peers

    async def handler(self, ws: ServerConnection) -> None:
        try:
            first = await asyncio.wait_for(ws.recv(), self.hello_timeout)
        except (TimeoutError, asyncio.TimeoutError):
            await ws.close(CLOSE_PROTOCOL, f"no hello within {self.hello_timeout:g} s")
            return
        except ConnectionClosed:
            return
        self.traffic.bytes_up += len(first)
        try:
            msg = decode(first)
        except ProtocolError as exc:
            await ws.close(CLOSE_PROTOCOL, _reason(f"{exc.code}: {exc}"))
            return
        if isinstance(msg, StatusRequest):
            await self._observe(ws, msg)
            return
        if not isinstance(msg, Hello):
            await ws.close(CLOSE_PROTOCOL, "first message must be hello or status_request")
            return
        try:
            device_id, out = self.core.connect(msg, self.clock())
        except AuthError:
            log.warning("refused %s: wrong token", ws.remote_address)
            await ws.close(CLOSE_AUTH, "wrong token")
            return
        conn = _Conn(ws)
        conn.writer = asyncio.create_task(self._write(conn))
        self.conns[device_id] = conn
        self._devices_changed.set()
        log.info("device %d (%s) joined from %s", device_id, msg.name, ws.remote_address)
        self.deliver(out)
        reason = "connection closed"
        try:
            async for frame in ws:
                self.traffic.bytes_up += len(frame)
                try:
                    msg = decode(frame)
                    if not isinstance(msg, _CLIENT_MESSAGES):
                        raise ProtocolError(f"{msg.TYPE} is not a message a device may send", "unexpected")
                except ProtocolError as exc:
                    reason = f"{exc.code}: {exc}"
                    conn.queue.put_nowait((CLOSE_PROTOCOL, _reason(reason)))
                    break
                try:
                    self.deliver(self.core.handle(device_id, msg, self.clock()))
                except Exception:  # a bug must not pass silently, nor take the server down
                    log.exception("handling %s from device %d failed", msg.TYPE, device_id)
                    reason = f"internal error on {msg.TYPE}"
                    conn.queue.put_nowait((1011, "internal error"))
                    break
                if isinstance(msg, Leave):
                    reason = "left"
                    break
        except ConnectionClosed:
            pass
        finally:
            self.conns.pop(device_id, None)
            if self._aborted is not None or self._closing:
                reason = SHUTDOWN  # the coordinator is going: not the device's fault
            self.deliver(self.core.disconnect(device_id, self.clock(), reason))
            self._devices_changed.set()
            log.info("device %d left: %s", device_id, reason)
            await self._finish_writer(conn)

    async def _observe(self, ws: ServerConnection, first: StatusRequest) -> None:
        """A ``cleave status`` or ``cleave benchmark --url`` peer: one reply per request.

        Its first message carried the token; after that it may ask for status again or run
        speed tests (the coordinator echoes the requested number of bytes)."""
        request: object = first
        try:
            self.core.check_token(first.token)
        except AuthError:
            await ws.close(CLOSE_AUTH, "wrong token")
            return
        try:
            while True:
                if isinstance(request, SpeedTest):
                    await ws.send(encode(SpeedTest(0, torch.zeros(request.reply_bytes, dtype=torch.uint8))))
                elif isinstance(request, StatusRequest):
                    try:
                        self.core.check_token(request.token)
                    except AuthError:
                        await ws.close(CLOSE_AUTH, "wrong token")
                        return
                    await ws.send(encode(StatusReply(self.status())))
                else:
                    await ws.close(CLOSE_PROTOCOL, "observers may only send status_request or speedtest")
                    return
                try:
                    request = decode(await ws.recv())
                except ProtocolError as exc:
                    await ws.close(CLOSE_PROTOCOL, _reason(f"{exc.code}: {exc}"))
                    return
        except ConnectionClosed:
            return

    def status(self) -> dict:
        snapshot = self.core.status(self.clock())
        t = self.traffic
        snapshot["traffic"] = {"mb_down": round(t.bytes_down / 1e6, 2), "mb_up": round(t.bytes_up / 1e6, 2)}
        return snapshot

    async def _write(self, conn: _Conn) -> None:
        while True:
            item = await conn.queue.get()
            if isinstance(item, tuple):
                await conn.ws.close(*item)
                return
            try:
                await conn.ws.send(item)
            except ConnectionClosed:
                return

    async def _finish_writer(self, conn: _Conn) -> None:
        if conn.writer is None:
            return
        if not conn.writer.done():
            conn.queue.put_nowait((CLOSE_FINISHED, "bye"))
            try:
                await asyncio.wait_for(conn.writer, 5.0)
            except (TimeoutError, asyncio.TimeoutError):
                conn.writer.cancel()

    def deliver(self, outbound: Sequence[Outbound]) -> None:
        """Queue the Core's messages on their sockets (never blocks the loop)."""
        for item in outbound:
            conn = self.conns.get(item.device)
            if conn is None:
                continue
            if isinstance(item, Send):
                frame = encode(item.message)
                self.traffic.bytes_down += len(frame)
                conn.queue.put_nowait(frame)
            elif item.code == CLOSE_SILENT:
                self._abort(conn)  # a frozen peer reads nothing: a closing handshake would hang
            else:
                conn.queue.put_nowait((item.code, _reason(item.reason)))

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
        """Close every connection after its queued messages; abort any peer that stopped reading."""
        self._closing = True
        conns = list(self.conns.values())
        for conn in conns:
            conn.queue.put_nowait((CLOSE_FINISHED, reason))
        writers = [c.writer for c in conns if c.writer is not None]
        if writers:
            await asyncio.wait(writers, timeout=timeout)
        for conn in conns:
            if conn.writer is not None and not conn.writer.done():
                self._abort(conn)

    # ------------------------------------------------------------------ GEMMs from the trainer thread

    def submit(self, requests: Sequence[GemmRequest], futures: Sequence[concurrent.futures.Future[torch.Tensor]]) -> None:
        """Runs on the loop: queue each GEMM; its future resolves when all its tiles are verified."""
        for request, future in zip(requests, futures):
            if self._aborted is not None:  # shutting down: the trainer thread must not wait forever
                future.set_exception(JobAborted(self._aborted))
                continue
            self._pending.add(future)
            future.add_done_callback(self._pending.discard)
            try:
                _, out = self.core.submit(request.a, request.b, request.kind, self.clock(),
                                          lambda result, f=future: None if f.done() else f.set_result(result))
            except Exception as exc:  # surfaced in the trainer thread, not swallowed here
                if not future.done():
                    future.set_exception(exc)
                continue
            self.deliver(out)

    def abort(self, reason: str) -> None:
        self._aborted = reason
        for future in list(self._pending):
            if not future.done():
                future.set_exception(JobAborted(reason))


class RemoteEngine:
    """The MatmulEngine the trainer sees: GEMMs become tiles on volunteers."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop

    def begin_step(self, step: int) -> None:
        # Queued before the step's first GEMM (same FIFO), so every GEMM row carries its step.
        self.loop.call_soon_threadsafe(self.server.core.begin_step, step)

    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        futures: list[concurrent.futures.Future[torch.Tensor]] = [concurrent.futures.Future() for _ in requests]
        self.loop.call_soon_threadsafe(self.server.submit, list(requests), futures)
        return [f.result() for f in futures]
