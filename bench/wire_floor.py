"""What moving bytes over loopback websockets costs this machine's CPU, with nothing else done.

``measure()`` runs a plain ``websockets`` server in this process (no compression, as Cleave's)
and a plain ``websockets`` client in a child process. The server sends ``--mb`` MB down in
messages of ``--message`` bytes, each in 256 KiB fragments as Cleave's server sends work; the
client answers every message with one of the same size, as one frame, as Cleave's client sends
results. Both count their process CPU over the transfer (socket calls, framing, masking and
unmasking, buffer copies). No tensors, no verification, no scheduling: any Cleave step that
moves the same bytes spends at least this CPU on them.

Used by ``bench_distributed.py`` for its "wire floor", and runnable alone::

    .venv/bin/python bench/wire_floor.py --mb 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

CHUNK = 256 << 10  # coordinator/net/server.py's fragment size
_CLIENT = r"""
import asyncio, json, sys, time
from websockets.asyncio.client import connect

async def main(port: int, count: int, size: int) -> None:
    reply = bytes(size)
    async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        started = time.process_time()
        for _ in range(count):
            message = await ws.recv()
            assert len(message) == size
            await ws.send(reply)
        print(json.dumps({"cpu_s": time.process_time() - started}), flush=True)
        await ws.wait_closed()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
"""


async def _measure(count: int, size: int) -> dict[str, Any]:
    payload = memoryview(bytearray(size))
    fragments = [payload[i : i + CHUNK] for i in range(0, size, CHUNK)]
    done: asyncio.Future[tuple[float, float]] = asyncio.get_running_loop().create_future()

    async def handler(ws: ServerConnection) -> None:
        cpu, wall = time.process_time(), time.perf_counter()

        async def down() -> None:
            for _ in range(count):
                await ws.send(fragments)

        sender = asyncio.create_task(down())
        for _ in range(count):
            assert len(await ws.recv()) == size
        await sender
        done.set_result((time.process_time() - cpu, time.perf_counter() - wall))

    async with serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        port = server.sockets[0].getsockname()[1]
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CLIENT, str(port), str(count), str(size), stdout=subprocess.PIPE
        )
        assert child.stdout is not None
        line = await child.stdout.readline()
        server_cpu, wall = await done
        await child.wait()
    client_cpu = float(json.loads(line)["cpu_s"])
    moved = 2 * count * size
    return {
        "bytes": moved,
        "message_bytes": size,
        "wall_s": wall,
        "server_cpu_s": server_cpu,
        "client_cpu_s": client_cpu,
        "cpu_s_per_gb": (server_cpu + client_cpu) / moved * 1e9,
        "server_cpu_s_per_gb": server_cpu / moved * 1e9,
    }


def measure(mb: int = 256, message: int = 1 << 20) -> dict[str, Any]:
    """CPU seconds per GB moved (both ends together), over ``mb`` MB each way."""
    return asyncio.run(_measure(max(1, (mb << 20) // message), message))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--mb", type=int, default=256, help="MB each way (default: 256)")
    p.add_argument("--message", type=int, default=1 << 20, help="bytes per message (default: 1 MiB)")
    args = p.parse_args()
    print(json.dumps(measure(args.mb, args.message), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
