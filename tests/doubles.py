"""Misbehaving clients for end-to-end tests: ``python tests/doubles.py MODE URL TOKEN NAME [ARG]``.

corrupt  every C block is off by a little (one element +1e-2 of the block's rms): verification
         must catch each one.
hold     computes honestly, but on its Nth tile (ARG N) touches the file FILE (next argument)
         and sleeps: a test SIGKILLs it there, with tiles outstanding.
slow     computes honestly but sleeps ARG seconds per tile: a straggler.
stall    takes tiles, keeps heartbeating and never returns a result (its compute never ends).

Exit codes are those of ``cleave join`` (3 when the coordinator bans the device).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from client.runner import ClientError, Worker, WorkerConfig  # noqa: E402


def main() -> int:
    mode, url, token, name = sys.argv[1:5]
    extra = sys.argv[5:]
    count = 0

    def corrupt(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        c = a @ b
        c.view(-1)[c.numel() // 2] += 1e-2 * float(c.pow(2).mean().sqrt()) + 1e-3
        return c, 0.001

    def hold(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        nonlocal count
        count += 1
        if count == int(extra[0]):
            Path(extra[1]).touch()
            time.sleep(600)
        return a @ b, 0.001

    def slow(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        time.sleep(float(extra[0]))
        return a @ b, 0.001

    def stall(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        threading.Event().wait()  # forever: the connection stays alive, the tile never comes back
        raise AssertionError("unreachable")

    compute = {"corrupt": corrupt, "hold": hold, "slow": slow, "stall": stall}[mode]
    worker = Worker(WorkerConfig(url=url, token=token, name=name, device="cpu", threads=1, once=True,
                                 benchmark_seconds=0.05), compute=compute)
    try:
        return asyncio.run(worker.run())
    except ClientError as exc:
        print(f"{name}: {exc}", flush=True)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
