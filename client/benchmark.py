"""How fast is this device? GEMM throughput, usable memory, and the link to a coordinator.

``cleave benchmark`` runs the full version; ``cleave join`` runs a short one at start and caches
it per machine, torch version, device and thread count, so it is measured again only when one
of those changes. The coordinator keeps its own running estimate from verified tiles: the
benchmark is a first guess, never a claim that earns credit.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from cleave.client import kernels
from cleave.client.paths import user_dir

SHAPES = (512, 1024)  # tile-like square GEMMs
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GemmFigure:
    dtype: str
    size: int
    gflops: float | None  # None: not supported on this device
    note: str = ""


@dataclass
class LinkFigure:
    url: str
    rtt_ms: float
    down_mb_s: float
    up_mb_s: float


@dataclass
class BenchmarkResult:
    device: str
    threads: int
    torch: str
    machine: str
    memory_bytes: int  # usable for tiles now
    gemm: list[GemmFigure] = field(default_factory=list)
    link: LinkFigure | None = None

    @property
    def gflops(self) -> float:
        """The best float32 figure over the shapes measured: what training uses."""
        figures = [g.gflops for g in self.gemm if g.dtype == "float32" and g.gflops]
        return max(figures, default=0.0)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gflops"] = round(self.gflops, 2)
        return out


def machine_id() -> str:
    return f"{socket.gethostname()}|{platform.system()}|{platform.machine()}"


def usable_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def measure_gemm(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float | None:
    try:
        return kernels.gemm_gflops(device, size=size, seconds=seconds, dtype=dtype)
    except (RuntimeError, TypeError):  # dtype not supported for matmul on this device
        return None


def run(
    device: torch.device,
    *,
    seconds: float = 0.5,
    shapes: tuple[int, ...] = SHAPES,
    dtypes: tuple[str, ...] = tuple(DTYPES),
) -> BenchmarkResult:
    result = BenchmarkResult(
        str(device), torch.get_num_threads(), torch.__version__, machine_id(), usable_memory(device)
    )
    for name in dtypes:
        for size in shapes:
            gflops = measure_gemm(device, DTYPES[name], size, seconds)
            note = "" if gflops is not None else f"{name} matmul is not supported on {device.type}"
            result.gemm.append(GemmFigure(name, size, round(gflops, 2) if gflops else None, note))
    return result


# --------------------------------------------------------------------------- cache


def cache_path() -> Path:
    return user_dir("cache") / "benchmark.json"


def cache_key(device: torch.device) -> str:
    return f"{machine_id()}|torch {torch.__version__}|{device}|{torch.get_num_threads()} threads"


def quick_gflops(
    device: torch.device, path: Path | None = None, seconds: float = 0.3, *, refresh: bool = False
) -> tuple[float, bool]:
    """float32 GFLOP/s for ``cleave join``: cached, measured again when the machine, torch,
    device or thread count changes (or with ``refresh``). Returns (gflops, from_cache)."""
    path = path or cache_path()
    key = cache_key(device)
    try:
        cached = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        cached = {}
    if not refresh and isinstance(cached, dict) and isinstance(cached.get(key), (int, float)) and cached[key] > 0:
        return float(cached[key]), True
    gflops = kernels.gemm_gflops(device, size=512, seconds=seconds)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = cached if isinstance(cached, dict) else {}
        entries[key] = round(gflops, 3)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home is no reason to fail: measure again next time
    return gflops, False


# --------------------------------------------------------------------------- link


async def measure_link(
    url: str, token: str, *, rounds: int = 20, nbytes: int = 8 << 20, cafile: str | None = None
) -> LinkFigure:
    """Round trip and throughput to a coordinator, as an observer. ``token`` is the operator
    token: the coordinator checks it before it answers."""
    from websockets.asyncio.client import connect

    from cleave.client.connection import client_tls
    from cleave.wire.messages import Challenge, SpeedTest, decode, encode

    empty = torch.zeros(0, dtype=torch.uint8)
    async with connect(
        url, compression=None, max_size=2 * nbytes, open_timeout=10, proxy=None, ssl=client_tls(url, cafile)
    ) as ws:
        if not isinstance(decode(await ws.recv()), Challenge):
            raise RuntimeError("the coordinator did not greet us with a challenge (another version?)")
        await ws.send(encode(SpeedTest(0, empty, token=token)))  # the first one authenticates
        if not isinstance(decode(await ws.recv()), SpeedTest):
            raise RuntimeError("the coordinator did not answer the link test")
        rtts = []
        for _ in range(rounds):
            started = time.perf_counter()
            await ws.send(encode(SpeedTest(0, empty)))
            await ws.recv()
            rtts.append(time.perf_counter() - started)
        rtt = statistics.median(rtts)
        started = time.perf_counter()
        await ws.send(encode(SpeedTest(nbytes, empty)))
        await ws.recv()
        down = nbytes / max(1e-9, time.perf_counter() - started - rtt)
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        started = time.perf_counter()
        await ws.send(encode(SpeedTest(0, payload)))
        await ws.recv()
        up = nbytes / max(1e-9, time.perf_counter() - started - rtt)
    return LinkFigure(url, round(rtt * 1000, 3), round(down / 1e6, 1), round(up / 1e6, 1))
