"""The scheduler's cost per decision does not grow with the fleet: 100, 1,000 and 10,000 devices.

Two measurements, each at every fleet size, in one run:

* ``scheduler``: the pure scheduler (coordinator/engine/scheduler.py) alone. Every device holds two
  units; each "message" is one verified result followed by the dispatch it triggers (deadlines,
  a new lease, copies), exactly the calls ``Core.handle`` makes.
* ``core``: the whole ``Core`` with an in-memory store: real Hello/Work/Result messages, real
  Freivalds verification of small (16 x 16) tiles, N devices connected at once. Each message is
  one ``Core.handle(Result)``.

Prints microseconds per message and the ratio to the 100-device figure: flat means per-message
work does not grow with devices x tiles. Run: ``.venv/bin/python bench/bench_scheduler.py``
(``--sizes 100,1000,10000``, ``--messages N``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cleave.coordinator.engine.core import Core  # noqa: E402
from cleave.coordinator.engine.limits import Limits, Rate, TrustPolicy  # noqa: E402
from cleave.coordinator.engine.outbound import Send
from cleave.coordinator.engine.scheduler import Assign, FaultPolicy, Scheduler, UnitSpec  # noqa: E402
from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy  # noqa: E402
from cleave.db.memory import MemoryStore  # noqa: E402
from cleave.wire.messages import Hello, Result, Work  # noqa: E402

FAULTS = FaultPolicy(heartbeat=5.0, heartbeat_timeout=1e6, lease_floor=1e5)  # no deadline fires mid-run


def bench_scheduler(devices: int, messages: int, seed: int = 0) -> float:
    """Seconds per message: one result, then the dispatch it triggers."""
    rng = random.Random(seed)
    s = Scheduler(FAULTS)
    for d in range(devices):
        s.join(d, slots=2, seconds_per_gflop=rng.uniform(0.05, 5.0), trusted=rng.random() > 0.1)
    units_per_gemm = 4 * devices
    next_unit, gemm = 0, 0

    def submit() -> None:
        nonlocal next_unit, gemm
        gemm += 1
        specs = [
            UnitSpec(
                next_unit + i,
                gemm,
                f"a{gemm}.{i % 64}",
                f"b{gemm}.{i // 64}",
                10**8,
                owner=(i % devices) if i % 2 else None,
            )
            for i in range(units_per_gemm)
        ]
        next_unit += units_per_gemm
        s.add_gemm(gemm, specs)

    held: list[tuple[int, int]] = []

    def dispatch(now: float) -> None:
        s.expire(now)
        for a in s.assign(now):
            held.append((a.unit, a.device))
        for d in s.copies(now):
            if isinstance(d, Assign):
                held.append((d.unit, d.device))

    submit()
    submit()
    dispatch(0.0)
    now = 0.0
    started = time.perf_counter()
    for _ in range(messages):
        if s.queued < devices:
            submit()  # keep the queue deep: the steady state of a big GEMM
        now += 1e-4
        i = rng.randrange(len(held))
        held[i], held[-1] = held[-1], held[i]
        unit, device = held.pop()
        if unit in s.units and device in s.units[unit].holders:
            s.done(unit, device)
        dispatch(now)
    return (time.perf_counter() - started) / messages


def bench_core(devices: int, messages: int, seed: int = 0) -> float:
    """Seconds per ``Core.handle(Result)`` with ``devices`` connected."""
    torch.manual_seed(seed)
    store = MemoryStore()
    job = store.create_job("bench", {}, 1, 0.0)
    limits = Limits(enrolments=Rate(1e9, 1e9), messages=Rate(1e9, 1e9))
    policy = TilingPolicy(max_edge=16, min_edge=16, min_k=16, tiles_per_device=1, min_tile_flops=1)
    core = Core(
        store,
        job,
        join_token="tok",
        rng=np.random.default_rng(seed),
        policy=policy,
        faults=FAULTS,
        trust=TrustPolicy(probation_tiles=0),
        limits=limits,
    )
    works: dict[int, list[Work]] = {}
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    now = 1.0

    def route(out: list) -> None:
        for item in out:
            if isinstance(item, Send) and isinstance(item.message, Work):
                for blk in item.message.blocks:
                    blocks.setdefault(item.device, {})[blk.key] = blk.data
                works.setdefault(item.device, []).append(item.message)

    ids = []
    for i in range(devices):
        device, out = core.connect(Hello(token="tok", name=f"d{i}", slots=2), core.gate.challenge().nonce, now)
        ids.append(device)
        route(out)

    def submit() -> None:
        # Enough 16 x 16 tiles for two per device: the queue stays deep.
        rows = 16 * 2 * devices
        route(core.submit(torch.randn(rows, 16), torch.randn(16, 16), GemmKind.FORWARD, now, lambda r: None)[1])

    submit()
    submit()
    pending = [(d, w) for d, ws in works.items() for w in ws]
    works.clear()
    times = []
    for _ in range(messages):
        if len(core.gemms) < 2:
            submit()
            pending += [(d, w) for d, ws in works.items() for w in ws]
            works.clear()
        now += 1e-4
        device, work = pending.pop(random.randrange(len(pending)))
        a, b = work.operands(blocks[device])
        msg = Result(work.tile_id, a @ b, 1e-4)
        started = time.perf_counter()
        out = core.handle(device, msg, now)
        times.append(time.perf_counter() - started)
        route(out)
        pending += [(d, w) for d, ws in works.items() for w in ws]
        works.clear()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--core-messages", type=int, default=3000)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    torch.set_num_threads(1)
    print(f"{'devices':>8}  {'scheduler us/msg':>17}  {'ratio':>6}  {'core us/msg (median)':>21}  {'ratio':>6}")
    base_s = base_c = None
    for n in sizes:
        s = bench_scheduler(n, args.messages) * 1e6
        c = bench_core(n, args.core_messages) * 1e6
        base_s, base_c = base_s or s, base_c or c
        print(f"{n:>8,}  {s:>17.1f}  {s / base_s:>6.2f}  {c:>21.1f}  {c / base_c:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
