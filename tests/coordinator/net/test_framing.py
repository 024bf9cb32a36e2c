"""Large server frames queued as header and payload: the same bytes as websockets' own, no copy;
and written to the socket by threads beside the loop, in order, with back-pressure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import pytest
import torch
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.protocol import OPEN, Protocol, Side

from cleave.coordinator.net.framing import SMALL, OffLoopTransport, SendThreads, unjoined_frames


def _sent(protocol: Protocol, *frames: tuple[bytes | memoryview, bool, bool]) -> bytes:
    for data, fin, first in frames:
        if first:
            protocol.send_binary(data, fin=fin)
        else:
            protocol.send_continuation(data, fin=fin)
    return b"".join(bytes(chunk) for chunk in protocol.data_to_send())


@pytest.mark.parametrize("size", [0, 125, 126, SMALL - 1, SMALL, 65535, 65536, 300_000])
def test_frames_are_the_bytes_websockets_would_write(size: int) -> None:
    payload = bytes(range(256)) * (size // 256 + 1)
    view = memoryview(payload)[:size]
    fragmented = [(view, False, True), (view[: size // 2], False, False), (b"", True, False)]
    ours = Protocol(Side.SERVER, state=OPEN)
    assert unjoined_frames(ours)
    theirs = Protocol(Side.SERVER, state=OPEN)
    assert _sent(ours, (view, True, True)) == _sent(theirs, (view, True, True))
    assert _sent(ours, *fragmented) == _sent(theirs, *fragmented)


def test_a_large_payload_is_queued_as_a_view_not_a_copy() -> None:
    ours = Protocol(Side.SERVER, state=OPEN)
    unjoined_frames(ours)
    payload = memoryview(bytearray(1 << 20))
    ours.send_binary(payload)
    head, body = ours.data_to_send()
    assert len(head) == 10 and body is payload  # the caller's view itself goes to the transport


def test_clients_and_small_frames_keep_the_librarys_path() -> None:
    assert not unjoined_frames(Protocol(Side.CLIENT, state=OPEN))  # client frames are masked
    ours = Protocol(Side.SERVER, state=OPEN)
    unjoined_frames(ours)
    ours.send_binary(b"x" * (SMALL - 1))
    (joined,) = ours.data_to_send()  # one write: header and payload together
    assert len(joined) == SMALL - 1 + 4


# ------------------------------------------------------------------ sending off the loop


async def _serve(threads: SendThreads, handler: Any) -> Any:
    async def wrapped(ws: ServerConnection) -> None:
        unjoined_frames(ws.protocol)
        ws.transport = threads.wrap(ws.transport)
        assert isinstance(ws.transport, OffLoopTransport)
        await handler(ws)

    return await serve(wrapped, "127.0.0.1", 0, compression=None, max_size=None)


def test_a_send_thread_writes_every_frame_in_order_and_closes_cleanly() -> None:
    """Large frames (views, fragmented or whole), small ones and websockets' own pings and close
    frame share one connection: the peer reads each message whole and in order."""
    tensor = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB
    whole = memoryview(tensor.numpy()).cast("B")
    messages: list[Any] = [b"first", whole, [whole[: 1 << 20], whole[1 << 20 :]], b"x" * 10, whole[:5000], b"last"]

    async def run() -> tuple[list[bytes], int | None, int]:
        threads = SendThreads(2)

        async def handler(ws: ServerConnection) -> None:
            for message in messages:
                await ws.send(message)
                await ws.ping()
            await ws.close()

        server = await _serve(threads, handler)
        try:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            async with connect(url, compression=None, max_size=None) as ws:
                got = [await asyncio.wait_for(ws.recv(), 10.0) for _ in messages]
                with pytest.raises(ConnectionClosed):
                    await asyncio.wait_for(ws.recv(), 10.0)
                return got, ws.close_code, threads.bytes_sent
        finally:
            server.close()
            await server.wait_closed()
            threads.close()

    got, code, sent = asyncio.run(run())
    want = [b"first", bytes(whole), bytes(whole), b"x" * 10, bytes(whole[:5000]), b"last"]
    assert got == want and code == 1000
    assert sent > 2 * len(whole)  # the large frames went through the threads


def test_a_peer_that_stops_reading_holds_back_its_sender_but_no_thread() -> None:
    """Back-pressure reaches websockets (its send waits once the queue passes its high water);
    the thread never waits for a peer that does not read, so the one thread serves another
    connection meanwhile."""
    big = bytes(32 << 20)

    async def run() -> tuple[bool, bytes, float]:
        threads = SendThreads(1)
        stuck: list[bool] = []

        async def handler(ws: ServerConnection) -> None:
            if ws.request.path == "/slow":
                try:
                    await asyncio.wait_for(ws.send(big), 0.5)
                    stuck.append(False)
                except (TimeoutError, asyncio.TimeoutError):
                    stuck.append(True)
                    ws.transport.abort()
                return
            await ws.send(b"served")
            await ws.close()

        server = await _serve(threads, handler)
        try:
            port = server.sockets[0].getsockname()[1]
            slow = await connect(f"ws://127.0.0.1:{port}/slow", compression=None, max_size=None)
            slow.transport.pause_reading()  # reads nothing more: the kernel's buffers fill
            while not stuck:
                await asyncio.sleep(0.05)
            started = time.monotonic()
            async with connect(f"ws://127.0.0.1:{port}/fast", compression=None) as fast:
                reply = await asyncio.wait_for(fast.recv(), 5.0)
            took = time.monotonic() - started
            slow.transport.abort()
            return stuck[0], reply, took
        finally:
            server.close()
            await server.wait_closed()
            threads.close()

    stuck, reply, took = asyncio.run(run())
    assert stuck and reply == b"served" and took < 5.0


def test_only_plain_tcp_transports_are_written_from_threads() -> None:
    threads = SendThreads(1)
    try:

        class Pipe:  # what a TLS or unknown transport looks like to wrap(): left alone
            def get_extra_info(self, name: str) -> Any:
                return None

        pipe = Pipe()
        assert threads.wrap(pipe) is pipe
        with pytest.raises(ValueError):
            SendThreads(0)
    finally:
        threads.close()


def test_every_handle_a_send_thread_took_is_closed_however_its_connection_ends() -> None:
    """Connections that close cleanly, that the peer drops mid-frame, and that the server aborts
    leave no descriptor behind (each OffLoopTransport holds its own handle on the socket)."""
    big = bytes(8 << 20)

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def run() -> tuple[int, int]:
        threads = SendThreads(1)

        async def handler(ws: ServerConnection) -> None:
            try:
                await ws.send(big)
                if ws.request.path == "/abort":
                    ws.transport.abort()
                    return
                await ws.close()
            except ConnectionClosed:
                pass
            finally:
                ws.transport.release()

        before = fds()
        server = await _serve(threads, handler)
        port = server.sockets[0].getsockname()[1]
        try:
            for path in ("/clean", "/drop", "/abort", "/clean"):
                ws = await connect(f"ws://127.0.0.1:{port}{path}", compression=None, max_size=None)
                if path == "/drop":
                    ws.transport.abort()  # gone mid-frame
                else:
                    with contextlib.suppress(ConnectionClosed):
                        await asyncio.wait_for(ws.recv(), 10.0)
                    await ws.close()
        finally:
            server.close()
            await server.wait_closed()
            threads.close()
        for _ in range(50):  # the server's side of each connection closes as its handler ends
            await asyncio.sleep(0.05)
            if fds() <= before:
                break
        return before, fds()

    before, after = asyncio.run(run())
    assert after <= before
