"""What a step costs in energy on this machine: plain local torch against a coordinator and its
clients (issue 23).

Run from the repository root::

    .venv/bin/python bench/bench_energy.py                  # small, 8 x 64, 2 clients, 4 steps
    .venv/bin/python bench/bench_energy.py --clients 4 --json

First the same job as plain torch in this process, metered with ``meters/`` (the
best source this machine has: RAPL if readable, else the stated estimate of CPU seconds x 10 W
per busy core). Then as real processes on loopback: ``cleave coordinator start`` (``--planner
uniform``, so every GEMM goes to the clients: on one machine the cost model rightly keeps them
home) and ``--clients`` ``cleave join`` processes, each metering its own machine. Prints what
each meter read from, the joules per step of both (the served run's from its metrics rows:
devices' reports as booked, and the coordinator's own), joules per verified GFLOP, grams of CO2,
the ratio served / local, and whether the losses equal plain torch's (1e-5). The first served
step is left out of the per-step figures (start-up); devices report every ``--energy-every`` s,
so a step's device figure is what arrived during it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loopback import run_job  # noqa: E402 - after the path is set


def local(args: argparse.Namespace) -> dict[str, Any]:
    """Plain torch in this process, metered the way the coordinator meters itself."""
    from cleave.coordinator.training.loop import TrainConfig, Trainer
    from cleave.meters import EnergyMeter

    trainer = Trainer(TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len))
    meter = EnergyMeter()
    losses, joules, seconds = [], [], []
    for _ in range(args.steps):
        meter.restart()
        result = trainer.train_step()
        span = meter.span()
        losses.append(result.loss)
        joules.append(span.total)
        seconds.append(span.seconds)
    return {
        "losses": losses,
        "joules": joules,
        "seconds": seconds,
        "meter": meter.describe(),
        "source": span.source.value,
    }


def served(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The job on a coordinator and its clients; its metrics rows and what its meter read."""
    rows = run_job(args, tmp, coordinator_args=(), client_args=("--energy-every", str(args.energy_every)))
    said = (tmp / "coordinator.log").read_text()
    meter = next((line.split("energy: ", 1)[1].strip() for line in said.splitlines() if "energy: " in line), "?")
    return {"rows": rows, "meter": meter}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--energy-every", type=float, default=1.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first served step is start-up)")
    plain = local(args)
    with tempfile.TemporaryDirectory(prefix="cleave-bench-energy-") as tmp:
        run = served(args, Path(tmp))
    rows = run["rows"][1:]  # the first step carries start-up
    n = len(rows)
    devices = sum(r["j_devices"] for r in rows) / n
    coordinator = sum(r["j_coordinator"] for r in rows) / n
    per_gflop = [r["j_per_gflop"] for r in rows if r.get("j_per_gflop") is not None]
    sources: dict[str, float] = {}
    for r in rows:
        for source, j in r["energy_sources"].items():
            sources[source] = sources.get(source, 0.0) + j
    local_j = sum(plain["joules"][1:]) / (args.steps - 1)
    want = plain["losses"]
    exact = all(abs(x - w) <= 1e-5 * abs(w) for x, w in zip([r["loss"] for r in run["rows"]], want, strict=True))
    out = {
        "model": args.model,
        "batch": f"{args.batch_size}x{args.seq_len}",
        "clients": args.clients,
        "steps": args.steps,
        "meter_local": plain["meter"],
        "meter_coordinator": run["meter"],
        "local_j_per_step": round(local_j, 2),
        "local_s_per_step": round(sum(plain["seconds"][1:]) / (args.steps - 1), 3),
        "served_j_per_step": round(devices + coordinator, 2),
        "served_devices_j_per_step": round(devices, 2),
        "served_coordinator_j_per_step": round(coordinator, 2),
        "served_s_per_step": round(sum(r["seconds"] for r in rows) / n, 3),
        "served_j_per_verified_gflop": round(sum(per_gflop) / len(per_gflop), 3) if per_gflop else None,
        "served_gco2_per_step": round(sum(r["gco2"] for r in rows) / n, 4),
        "served_sources_j": {k: round(v, 2) for k, v in sorted(sources.items())},
        "flagged": sum(r["energy_flagged"] for r in run["rows"]),
        "served_over_local": round((devices + coordinator) / local_j, 2) if local_j else None,
        "losses_equal_plain_torch": exact,
    }
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        for key, value in out.items():
            print(f"{key:30} {value}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
