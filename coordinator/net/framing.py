"""Large frames out without copying their payload.

websockets serialises every outgoing frame into one new bytes object (header and payload through
a ``BytesIO``: two copies of the payload) before the transport copies it into the kernel. For a
coordinator that sends 10-15 MB of operand blocks per tile, those copies were a third of the
event loop's CPU for sending (bench/bench_tax.py). ``unjoined_frames`` makes a server
connection queue a large frame's header and its payload apart: the transport hands the payload's
view straight to the socket. What the kernel does not take at once, asyncio 3.11 copies into its
buffer; 3.12 and later keep the view itself until it is written. A work frame's blocks are views
of the GEMM's operands or copies made for the wire, and a queued frame held those views before
this too: operands stay unchanged while their GEMM is live, and a frame for a GEMM that finished
meanwhile names a namespace the device is told to forget.

The frames on the wire are the very bytes websockets would write (an unmasked server frame
without extensions); websockets' own state machine still decides every frame, only its
serialisation changes. Connections with extensions (compression, which Cleave never negotiates),
small frames and any websockets whose protocol object lacks what this relies on keep the
library's own path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import struct
import types
from typing import Any

SMALL = 4096  # below this a joined frame costs less than two writes


def unjoined_frames(protocol: Any) -> bool:
    """Queue this server connection's large frames as header and payload (see the module doc).
    True if the connection now does; False leaves the library's path (an unknown version)."""
    try:
        from websockets.protocol import Side
    except ImportError:  # pragma: no cover - a websockets without the sans-I/O protocol
        return False
    if getattr(protocol, "side", None) is not Side.SERVER or not isinstance(getattr(protocol, "writes", None), list):
        return False
    library = type(protocol).send_frame

    def send_frame(self: Any, frame: Any) -> None:
        data = frame.data
        if self.extensions or len(data) < SMALL or frame.rsv1 or frame.rsv2 or frame.rsv3:
            library(self, frame)
            return
        frame.check()  # as the library's serialisation does (a control frame this large raises)
        n = len(data)
        first = (0x80 if frame.fin else 0) | int(frame.opcode)
        if n < 65536:
            head = struct.pack("!BBH", first, 126, n)
        else:
            head = struct.pack("!BBQ", first, 127, n)
        self.writes.append(head)
        self.writes.append(data)

    protocol.send_frame = types.MethodType(send_frame, protocol)
    return True


# --------------------------------------------------------------------- sending off the loop

IOV = 64  # buffers per sendmsg call (well under every platform's IOV_MAX)
# A write this small with nothing queued ahead goes straight to the socket on the loop: a hop to
# a thread and back costs more than the kernel's copy of it (control messages, small tiles' work).
DIRECT = 64 << 10
HIGH_WATER = 4 << 20  # bytes a connection may have queued for its sender before websockets waits
LOW_WATER = 1 << 20


class SendThreads:
    """A pool of threads that write connections' bytes to their sockets (``OffLoopTransport``).

    The kernel's copy of a sent byte is most of what the event loop paid to send: on loopback
    the sender pays the receiver's TCP too (bench/bench_tax.py, ``socket_floor``). ``send`` and
    ``sendmsg`` release the GIL, so that copy runs on these threads beside the loop, which only
    queues views. Each connection has at most one write in flight, so its bytes stay in order.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"send threads: at least 1, not {workers}")
        self.workers = workers
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cleave-send")
        self.bytes_sent = 0  # by the threads (the loop's direct small writes not counted)
        self.direct = DIRECT  # larger writes, or any behind a queue, go to the threads

    def wrap(self, transport: Any) -> Any:
        """``transport``, or an ``OffLoopTransport`` around it where its socket may be written
        from a thread: plain TCP on a selector loop (not TLS, not uvloop, not a pipe)."""
        if type(transport).__name__ != "_SelectorSocketTransport" or transport.get_extra_info("sslcontext"):
            return transport
        sock = transport.get_extra_info("socket")
        if sock is None or transport.is_closing():
            return transport
        try:
            return OffLoopTransport(transport, self, sock.fileno())
        except OSError:  # no descriptor left (EMFILE): the loop writes this connection itself
            return transport

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _send_some(sock: socket.socket, chunks: list[Any]) -> tuple[int, list[Any]]:
    """Write what the kernel takes now of ``chunks`` (bytes or views) to the non-blocking
    ``sock``, a few dozen per system call; returns the bytes written and what is left. On a
    thread: it never waits for room (a peer that reads slowly holds no thread), the loop does."""
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    total = 0
    while views:
        try:
            n = sock.sendmsg(views[:IOV])
        except (BlockingIOError, InterruptedError):
            break
        total += n
        while n and views:
            size = len(views[0])
            if n >= size:
                n -= size
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return total, views


class OffLoopTransport:
    """The transport a websockets connection writes to, its bytes sent by ``SendThreads``.

    websockets calls ``write`` (frames), ``write_eof``/``close``/``abort`` and reads
    ``is_closing``; it learns of back-pressure through its protocol's ``pause_writing`` and
    ``resume_writing``, which this calls as its queue passes ``HIGH_WATER`` and falls below
    ``LOW_WATER``. Reading stays with the loop's own transport (``__getattr__``). Queued
    chunks are the caller's objects (views of operands), never copied here. A thread writes
    what the kernel takes at once and returns; when the socket is full the loop waits for room
    (``add_writer`` on this transport's own handle) and hands the rest to a thread again, so a
    slow reader holds no thread and the others' writes go on. What the kernel takes at once of
    a write of at most ``DIRECT`` bytes with nothing queued goes straight out on the loop.
    Bounded: a connection holds at most ``HIGH_WATER`` plus one write of websockets here.
    """

    def __init__(self, inner: Any, threads: SendThreads, fd: int) -> None:
        self._inner = inner
        self._threads = threads
        # Its own handle on the connection's socket (non-blocking, as the loop's): the threads
        # write through it and the loop waits on it for room, beside the transport's reader.
        dup = os.dup(fd)
        try:
            self._sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            raise
        self._sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._pending: list[Any] = []
        self._queued = 0  # bytes pending or being written
        self._job: asyncio.Future[tuple[int, list[Any]]] | None = None
        self._waiting = False  # for room in the socket (add_writer)
        self._then: str | None = None  # "eof" or "close", once the queue is written
        self._aborted = False
        self._closed = False
        self._paused = False
        self.failed: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # -- what websockets calls
    def write(self, data: Any) -> None:
        if self._aborted or self._then is not None or not len(data):
            return
        if (
            not self._pending
            and self._job is None
            and not self._waiting
            and len(data) <= self._threads.direct
            and not self._inner.get_write_buffer_size()  # bytes written before this took over go first
        ):
            try:  # a small frame with nothing ahead of it: straight out, as asyncio would
                n = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                self._fail(exc)
                return
            if n == len(data):
                return
            data = memoryview(data)[n:]
        self._pending.append(data)
        self._queued += len(data)
        if self._queued > HIGH_WATER and not self._paused:
            self._paused = True
            protocol = self._inner.get_protocol()
            if not getattr(protocol, "paused", False):
                protocol.pause_writing()
        self._kick()

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def get_write_buffer_size(self) -> int:
        return self._queued + self._inner.get_write_buffer_size()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self._finish("eof")

    def close(self) -> None:
        self._finish("close")

    def is_closing(self) -> bool:
        return self._aborted or self._then == "close" or self._inner.is_closing()

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._pending.clear()
        self._inner.abort()
        self._release()

    # -- the queue
    def _finish(self, then: str) -> None:
        if self._aborted:
            return
        if self._then != "close":
            self._then = then
        self._kick()

    def _kick(self) -> None:
        if self._job is not None or self._waiting or self._aborted:
            return
        if self._pending:
            if self._inner.get_write_buffer_size():  # bytes written before this took over: theirs first
                self._loop.call_later(0.001, self._kick)
                return
            chunks, self._pending = self._pending, []
            try:
                self._job = self._loop.run_in_executor(self._threads.pool, _send_some, self._sock, chunks)
            except RuntimeError as exc:  # the pool is shut down: the coordinator is stopping
                self._fail(exc)
                return
            self._job.add_done_callback(self._written)
            return
        if self._then is not None:  # everything is out: the half-close or close itself
            then, self._then = self._then, "done"
            if then == "eof":
                self._inner.write_eof()
            elif then == "close":
                self._inner.close()
            self._release()

    def _written(self, job: asyncio.Future[tuple[int, list[Any]]]) -> None:
        self._job = None
        if self._aborted or self._then == "done":  # aborted, or over (its handle waited for this write)
            self._release()
            return
        if job.cancelled():
            self._fail(ConnectionError("the coordinator is stopping"))
            return
        exc = job.exception()
        if exc is not None:
            self._fail(exc)
            return
        sent, rest = job.result()
        self._threads.bytes_sent += sent
        self._queued -= sent
        if self._paused and self._queued <= LOW_WATER:
            self._paused = False
            protocol = self._inner.get_protocol()
            if getattr(protocol, "paused", False):
                protocol.resume_writing()
        if rest:  # the socket is full: the rest goes first once it has room
            self._pending[:0] = rest
            self._waiting = True
            self._loop.add_writer(self._sock.fileno(), self._room)
            return
        self._kick()

    def _room(self) -> None:
        self._loop.remove_writer(self._sock.fileno())
        self._waiting = False
        self._kick()

    def _fail(self, exc: BaseException) -> None:
        """A write failed (the peer went): the connection is over, as a failed write on the
        loop's transport would end it."""
        self.failed = exc
        self.abort()

    def release(self) -> None:
        """The connection is over: nothing more is written, and its handle on the socket goes
        (after a write in flight)."""
        self._then = "done"
        self._pending.clear()
        self._release()

    def _release(self) -> None:
        if self._closed or self._job is not None:  # a write in flight releases it when it returns
            return
        self._closed = True
        if self._waiting:
            self._waiting = False
            self._loop.remove_writer(self._sock.fileno())
        self._sock.close()
