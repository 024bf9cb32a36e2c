"""Misbehaving clients for end-to-end tests: ``python tests/doubles.py MODE URL TOKEN NAME [ARG]``.

corrupt  every C block is off by a little (one element +1e-2 of the block's rms): verification
         must catch each one.
hold     computes honestly, but on its Nth tile (ARG N) touches the file FILE (next argument)
         and sleeps: a test SIGKILLs it there, with tiles outstanding.
slow     computes honestly but sleeps ARG seconds per tile: a straggler.
slowed   computes honestly, then waits (ARG - 1) times its matmul's time: a device ARG times
         slower than this one, which reports the whole time as its matmul's.
stall    takes tiles, keeps heartbeating and never returns a result (its compute never ends).
forge    ARG is a comma-separated list of forgery kinds (tests/forgeries.py, plus "replay" and
         "stale", which return real results kept from earlier tiles of the same shape: another
         tile's, and one from an older GEMM). One device per kind, named NAME-KIND, all in this
         process: each computes honestly for its first ``WARMUP`` tiles (to leave probation), then
         forges every result at twice the detection threshold, until it is banned; it then
         reconnects with its credential once. Prints one JSON line per device: the tiles it
         forged, its honest results, and the close it got each time.

Exit codes are those of ``cleave join`` (3 when the coordinator bans the device).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cleave.client.runner import Worker, WorkerConfig  # noqa: E402
from cleave.wire.errors import ClientError

WARMUP = 25  # honest tiles before a forger starts lying: past the 20 of probation
RUN_LIMIT = 90.0  # seconds a forger's run may take, so the test fails rather than hangs
MAGNITUDE = 2.0  # forged errors at twice the detection threshold: the smallest that must be caught


class Forger:
    """One forging device's compute: honest at first, then every result forged."""

    def __init__(self, kind: str, seed: int) -> None:
        import forgeries

        self.kind = kind
        self.forge = forgeries.FORGERIES.get(kind)
        self.honest_within = forgeries.HonestWithinTolerance
        self.fallback = forgeries.forge_pair
        self.rng = np.random.default_rng(seed)
        self.history: dict[tuple[int, ...], deque[tuple[int, torch.Tensor]]] = {}
        self.results = 0
        self.forged: list[int] = []
        self.honest = 0
        self.tile: int | None = None  # the tile being computed (set by the worker's hook)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        c = a @ b
        self.results += 1
        seen = self.history.setdefault(tuple(c.shape), deque(maxlen=64))
        if self.results <= WARMUP:
            seen.append((self.results, c.clone()))
            self.honest += 1
            return c, 0.001
        if self.kind in ("replay", "stale") and seen:
            old = seen[-1][1] if self.kind == "replay" else seen[0][1]  # another tile / an older GEMM
            forged = old.clone()
        else:
            try:
                forged = (self.forge or self.fallback)(a, b, c, self.rng, MAGNITUDE)
            except self.honest_within:
                forged = self.fallback(a, b, c, self.rng, MAGNITUDE)
        seen.append((self.results, c.clone()))
        self.forged.append(self.results)
        return forged, 0.001


async def forge_all(url: str, token: str, name: str, kinds: list[str]) -> list[dict]:
    async def one(i: int, kind: str) -> dict:
        forger = Forger(kind, seed=1000 + i)
        cfg = WorkerConfig(
            url=url,
            token=token,
            name=f"{name}-{kind}",
            device="cpu",
            threads=1,
            once=True,
            benchmark_seconds=0.05,
            backoff_max=1.0,
        )
        closes = []
        for _ in range(2):  # the second run: the stored credential of a banned identity
            worker = Worker(cfg, compute=forger)
            try:  # bounded: a worker retries a coordinator that has gone for ever
                closes.append(("exit", await asyncio.wait_for(worker.run(), RUN_LIMIT)))
            except ClientError as exc:
                closes.append(("error", exc.exit_code, str(exc)))
            except (TimeoutError, asyncio.TimeoutError):  # cancelled by wait_for
                closes.append(("timeout", RUN_LIMIT))
        return {"kind": kind, "name": cfg.name, "forged": len(forger.forged), "honest": forger.honest, "closes": closes}

    return await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds)))


def main() -> int:
    mode, url, token, name = sys.argv[1:5]
    extra = sys.argv[5:]
    if mode == "forge":
        torch.set_num_threads(1)
        for report in asyncio.run(forge_all(url, token, name, extra[0].split(","))):
            print(json.dumps(report), flush=True)
        return 0
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

    def slowed(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        c = a @ b
        spent = time.perf_counter() - started
        time.sleep(spent * (float(extra[0]) - 1))
        return c, time.perf_counter() - started

    def stall(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
        threading.Event().wait()  # forever: the connection stays alive, the tile never comes back
        raise AssertionError("unreachable")

    compute = {"corrupt": corrupt, "hold": hold, "slow": slow, "slowed": slowed, "stall": stall}[mode]
    worker = Worker(
        WorkerConfig(url=url, token=token, name=name, device="cpu", threads=1, once=True, benchmark_seconds=0.05),
        compute=compute,
    )
    try:
        return asyncio.run(worker.run())
    except ClientError as exc:
        print(f"{name}: {exc}", flush=True)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
