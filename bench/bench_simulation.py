"""The simulator against emulated runs: per-batch time of the same job, fleet and sizes, both ways.

For each device count: a real coordinator (``cleave coordinator start``) trains the model with
``cleave emulate`` devices (real clients on real websockets, computing for real, paced to the
fleet's profiles); then the simulator (coordinator/whatif/simulator.py) runs the same model, batch,
fleet and planner with the coordinator's own profile measured on this machine: its GEMM,
verification and copy rates (``measure_ps``) and its CPU per result (``Core.handle``, timed as
bench/bench_scheduler.py times it, plus the server's framing of a work frame and a result).

Figures, per count: the mean seconds per step of the emulated run (steps after ``--warmup``)
and of the simulation (the same steps), and simulated / emulated. The issue's bar: within 15%.

Run: ``.venv/bin/python bench/bench_simulation.py`` (``--counts 20,50,100,200``, ``--json`` for
one object; progress on stderr). The coordinator and the emulator share this machine's two
cores, so the emulator's own CPU competes with the coordinator's at large counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_planner import OPERATOR, TOKEN, finish_job, start_coordinator  # noqa: E402

# Slow enough that 200 of them compute for real on one core of this machine within their pace.
FLEET = """
[[class]]
name = "slow"
count = 3
gflops = 1.0
memory_gb = 1
down_mbps = 16
up_mbps = 4
rtt_ms = 40

[[class]]
name = "fast"
count = 1
gflops = 3.0
memory_gb = 2
down_mbps = 40
up_mbps = 10
rtt_ms = 20
"""


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def emulated(count: int, args: argparse.Namespace, fleet: Path, tmp: Path) -> list[float]:
    """Seconds of each step of a real coordinator with ``count`` emulated devices."""
    py = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    metrics = tmp / f"emu-{count}.jsonl"
    coord, url, lines = start_coordinator(
        [
            "--db",
            str(tmp / f"emu-{count}.db"),
            "--token",
            TOKEN,
            "--operator-token",
            OPERATOR,
            "--steps",
            str(args.steps),
            "--model",
            args.model,
            "--batch-size",
            str(args.batch_size),
            "--seq-len",
            str(args.seq_len),
            "--min-devices",
            str(count),
            "--planner",
            args.planner,
            "--metrics",
            str(metrics),
            "--quiet",
        ],
        env,
    )
    emu = subprocess.Popen(
        [
            py,
            "-m",
            "cleave_cli",
            "emulate",
            url,
            "--token",
            TOKEN,
            "--devices",
            str(count),
            "--fleet",
            str(fleet),
            "--quiet",
            "--seed",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return [r["seconds"] for r in finish_job(coord, lines, [emu], metrics, timeout=60)]


def core_seconds_per_result(devices: int) -> float:
    from bench_scheduler import bench_core

    return bench_core(devices, 1000)


def simulated(count: int, args: argparse.Namespace, fleet: Path, ps) -> list[float]:
    from cleave.coordinator.engine.live_plan import Planner
    from cleave.coordinator.whatif.presets import model_shape, resolve_fleet
    from cleave.coordinator.whatif.simulator import SimConfig, Simulation

    cfg = SimConfig(
        model_shape(args.model),
        resolve_fleet(str(fleet), "fp32", count),
        ps,
        batch=args.batch_size,
        seq=args.seq_len,
        steps=args.steps,
        planner=Planner(args.planner),
        churn=False,
        veterans=False,
        seed=1,
    )
    return [s.seconds for s in Simulation(cfg).run().steps]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="20,50,100,200")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (probation, speed estimates)")
    parser.add_argument("--planner", default="uniform")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import dataclasses

    from cleave.coordinator.engine.profiles import measure_ps

    counts = [int(c) for c in args.counts.split(",")]
    ps = measure_ps(10.0)
    per_result = core_seconds_per_result(max(counts))
    ps = dataclasses.replace(ps, unit_overhead=per_result)
    log(
        f"PS measured: {ps.gflops['fp32']:.0f} GFLOP/s, verify {ps.verify_flops / 1e9:.0f} GFLOP/s, "
        f"copies {ps.memory_bw / 1e9:.1f} GB/s, {per_result * 1e6:.0f} us per result"
    )
    out: dict = {
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "planner": args.planner,
        "steps": args.steps,
        "warmup": args.warmup,
        "fleet": FLEET,
        "ps": {
            "gflops": ps.gflops["fp32"],
            "verify_gflops": ps.verify_flops / 1e9,
            "memory_bw": ps.memory_bw,
            "unit_overhead": ps.unit_overhead,
        },
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="cleave-bench-sim-") as tmp:
        fleet = Path(tmp) / "fleet.toml"
        fleet.write_text(FLEET)
        for count in counts:
            log(f"{count} devices: emulated run ...")
            started = time.perf_counter()
            emu = emulated(count, args, fleet, Path(tmp))
            emu_wall = time.perf_counter() - started
            log(f"  {emu_wall:.0f} s; simulating ...")
            started = time.perf_counter()
            sim = simulated(count, args, fleet, ps)
            sim_wall = time.perf_counter() - started
            kept = slice(args.warmup, None)
            e, s = statistics.fmean(emu[kept]), statistics.fmean(sim[kept])
            out["runs"].append(
                {
                    "devices": count,
                    "emulated_s": e,
                    "simulated_s": s,
                    "ratio": s / e,
                    "emulated_steps": emu,
                    "simulated_steps": sim,
                    "emulated_wall_s": emu_wall,
                    "simulated_wall_s": sim_wall,
                }
            )
            log(f"  emulated {e:.3f} s/step, simulated {s:.3f} s/step ({s / e:.2f}x)")
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{args.model}, batch {args.batch_size} x {args.seq_len}, --planner {args.planner}, steps "
        f"{args.warmup + 1}-{args.steps}"
    )
    print(f"{'devices':>8} {'emulated s':>11} {'simulated s':>12} {'sim/emu':>8}")
    for r in out["runs"]:
        print(f"{r['devices']:>8} {r['emulated_s']:>11.3f} {r['simulated_s']:>12.3f} {r['ratio']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
