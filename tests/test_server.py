"""The websocket layer in-process: a real server on 127.0.0.1 port 0 around a Core."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import torch
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from conftest import ROOT, TIMEOUT
from coordinator.core import Core
from coordinator.protocol import Hello, Result, Welcome, Work, decode, encode
from coordinator.server import Server
from coordinator.tiles import GemmKind, TilingPolicy
from db.memory import MemoryStore


def _server(hello_timeout: float = 10.0) -> Server:
    store = MemoryStore()
    job = store.create_job("t", {}, 1, 0.0)
    core = Core(store, job, token="tok", rng=np.random.default_rng(0), policy=TilingPolicy(max_edge=32, min_edge=8, min_tile_flops=1))
    return Server(core, hello_timeout=hello_timeout)


def test_a_peer_that_never_says_hello_is_dropped_with_a_reason() -> None:
    async def run() -> tuple[int | None, str | None]:
        server = _server(hello_timeout=0.2)
        async with serve(server.handler, "127.0.0.1", 0, compression=None) as ws_server:
            port = ws_server.sockets[0].getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}", compression=None) as ws:
                try:
                    await asyncio.wait_for(ws.recv(), TIMEOUT)
                except ConnectionClosed:
                    pass
                return ws.close_code, ws.close_reason

    code, reason = asyncio.run(run())
    assert code == 4000 and reason == "no hello within 0.2 s"


def test_gemm_over_real_websockets_equals_dense_product() -> None:
    async def run() -> tuple[torch.Tensor, torch.Tensor]:
        server = _server()
        async with serve(server.handler, "127.0.0.1", 0, compression=None, max_size=None) as ws_server:
            url = f"ws://127.0.0.1:{ws_server.sockets[0].getsockname()[1]}"
            async with connect(url, compression=None, max_size=None) as ws:
                await ws.send(encode(Hello(token="tok", name="d", slots=2)))
                assert isinstance(decode(await ws.recv()), Welcome)
                a, b = torch.randn(70, 20), torch.randn(20, 45)
                done: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
                gemm_id, out = server.core.submit(a, b, GemmKind.FORWARD, 0.0, done.set_result)
                tiles = len(server.core.gemms[gemm_id].tiles)
                assert tiles > 2
                server.deliver(out)
                blocks: dict[str, torch.Tensor] = {}
                for _ in range(tiles):
                    work = decode(await asyncio.wait_for(ws.recv(), TIMEOUT))
                    assert isinstance(work, Work)
                    blocks.update({blk.key: blk.data for blk in work.blocks})
                    operands = work.operands(blocks)
                    assert operands is not None
                    await ws.send(encode(Result(work.tile_id, operands[0] @ operands[1])))
                return await asyncio.wait_for(done, TIMEOUT), a @ b

    got, want = asyncio.run(run())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_importing_the_client_loads_no_server_or_database_code() -> None:
    code = (
        "import sys, client.runner, client.kernels; "
        "bad = [m for m in sys.modules if m.startswith(('coordinator.server', 'coordinator.core', 'coordinator.job', "
        "'db', 'sqlite_utils', 'websockets.asyncio.server'))]; "
        "assert not bad, bad"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
