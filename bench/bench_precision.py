"""How close each --precision mode stays to plain torch, over a long run, through real clients.

Run from the repository root::

    .venv/bin/python bench/bench_precision.py                  # tiny, 200 steps, every mode
    .venv/bin/python bench/bench_precision.py --steps 50 --modes fp16 --json

For each mode: plain torch (``Trainer`` in this process) and the same job on a coordinator with
``--clients`` local ``cleave join`` processes (round-robin tiles, so every GEMM goes out), then
the largest and the final relative difference of their losses, step by step, and each run's
final loss against float32's plain torch. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_distributed import BenchReporter, ProgressUI
from rich.console import Console
from rich.table import Table

import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported (2 cores!)
from cleave.cli.local import serve_with_local_clients
from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.engine.identity import new_token
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.training.loop import PRECISIONS, TrainConfig, Trainer


def _rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def measure(model: str, steps: int, modes: list[str], clients: int, ui: ProgressUI) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "steps": steps, "clients": clients, "modes": {}}
    reference = None
    for mode in modes:
        train = TrainConfig(model=model, steps=steps, precision=mode)
        task = ui.phase(f"{mode}: plain torch", 1)
        local = [r.loss for r in Trainer(train).run()]
        ui.advance(task)
        if mode == "fp32" or reference is None:
            reference = local if mode == "fp32" else reference
        with tempfile.TemporaryDirectory(prefix="cleave-bench-precision-") as tmp:
            cfg = CoordinatorConfig(
                train=train,
                port=0,
                db=str(Path(tmp) / "p.db"),
                token=new_token(),
                min_devices=clients,
                planner=Planner.UNIFORM,
            )
            outcome = asyncio.run(
                serve_with_local_clients(
                    cfg, BenchReporter(ui, steps), clients=clients, threads=1, name=mode, quiet_clients=True
                )
            )
        dist = [r.loss for r in outcome.results]
        diffs = _rel(dist, local)
        out["modes"][mode] = {
            "max_rel_diff": max(diffs),
            "final_rel_diff": diffs[-1],
            "local_final": local[-1],
            "distributed_final": dist[-1],
            "rejected": outcome.status["tiles"]["rejected"],
        }
    fp32 = out["modes"].get("fp32")
    for row in out["modes"].values():
        row["final_vs_fp32"] = None if fp32 is None else row["local_final"] / fp32["local_final"] - 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--modes", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    ui = ProgressUI(enabled=True)
    try:
        result = measure(args.model, args.steps, args.modes, args.clients, ui)
    finally:
        ui.close()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    table = Table(
        title=f"{args.model}, {args.steps} steps, {args.clients} clients: distributed vs plain torch, same mode",
        title_justify="left",
    )
    for name in ("mode", "max rel. diff", "final rel. diff", "final loss (torch)", "vs fp32 torch", "rejected"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for mode, r in result["modes"].items():
        vs = "-" if r["final_vs_fp32"] is None else f"{r['final_vs_fp32']:+.2%}"
        table.add_row(
            mode,
            f"{r['max_rel_diff']:.2e}",
            f"{r['final_rel_diff']:.2e}",
            f"{r['local_final']:.4f}",
            vs,
            str(r["rejected"]),
        )
    Console(highlight=False).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
