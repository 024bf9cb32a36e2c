"""The coordinator on each device this machine has (``--device cpu`` and, with a GPU, ``cuda``).

Run from the repository root::

    .venv/bin/python bench/bench_device.py                      # small and base, 6 steps each
    .venv/bin/python bench/bench_device.py --models small --steps 4 --json

For each model and device, three runs of the same job:

- ``local``: plain torch (``cleave train --local --device D``), the floor of the PS's own step;
- ``ps``: the real coordinator with no devices (``--min-devices 0``, the cost planner): every
  GEMM is kept home, so the step is the PS's seconds per step, with the coordinator's own
  overhead (the engine, the store, staging operands to the host);
- ``tiles`` (``--clients N``, 0 skips it): the coordinator with N local ``cleave join``
  processes on the uniform grid, so every GEMM goes out as tiles; verified tiles per second.

Each figure is the median over the steps after the first (warm-up). Losses are compared with
plain torch on the CPU. One JSON object with ``--json``; progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_distributed import BenchReporter, ProgressUI
from rich.console import Console
from rich.table import Table

import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported
from cleave.cli.local import serve_with_local_clients
from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.engine.identity import new_token
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.training.hardware import coordinator_device, describe, synchronize
from cleave.coordinator.training.loop import TrainConfig, Trainer


def _median_after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _local(train: TrainConfig, device: str) -> tuple[list[float], list[float]]:
    where = coordinator_device(device)
    trainer = Trainer(train, device=where)
    losses, seconds = [], []
    for _ in range(train.steps):
        result = trainer.train_step()
        synchronize(where)
        losses.append(result.loss)
        seconds.append(result.seconds)
    return losses, seconds


def _served(train: TrainConfig, device: str, clients: int, ui: ProgressUI) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cleave-bench-device-") as tmp:
        cfg = CoordinatorConfig(
            train=train,
            port=0,
            db=str(Path(tmp) / "d.db"),
            token=new_token(),
            min_devices=clients,
            planner=Planner.UNIFORM if clients else Planner.COST,
            checkpoint_every=0,
            device=device,
        )
        outcome = asyncio.run(
            serve_with_local_clients(
                cfg, BenchReporter(ui, train.steps), clients=clients, threads=1, name=device, quiet_clients=True
            )
        )
    seconds = [r.seconds for r in outcome.results]
    tiles = outcome.status["tiles"]
    return {
        "losses": [r.loss for r in outcome.results],
        "step_s": _median_after_first(seconds),
        "tiles_verified": tiles.get("verified", 0),
        "tiles_rejected": tiles.get("rejected", 0),
        "tiles_per_s": tiles.get("verified", 0) / max(sum(seconds), 1e-9),
    }


def measure(models: list[str], steps: int, clients: int, ui: ProgressUI) -> dict[str, Any]:
    devices = ["cpu"] + (["cuda"] if coordinator_device("auto").type == "cuda" else [])
    out: dict[str, Any] = {
        "devices": {d: describe(coordinator_device(d)) for d in devices},
        "steps": steps,
        "clients": clients,
        "models": {},
    }
    for model in models:
        train = TrainConfig(model=model, steps=steps, micro_batches=1)
        rows: dict[str, Any] = {}
        reference: list[float] | None = None
        for device in devices:
            task = ui.phase(f"{model} on {device}: plain torch", 1)
            losses, seconds = _local(train, device)
            ui.advance(task)
            reference = reference or losses
            row: dict[str, Any] = {
                "local_step_s": _median_after_first(seconds),
                "local_rel_diff": _rel(losses, reference),
            }
            ps = _served(train, device, 0, ui)
            row["ps_step_s"] = ps["step_s"]
            row["ps_rel_diff"] = _rel(ps["losses"], reference)
            row["ps_over_local"] = ps["step_s"] / row["local_step_s"]
            if clients:
                tiled = _served(train, device, clients, ui)
                row.update(
                    tiles_step_s=tiled["step_s"],
                    tiles_rel_diff=_rel(tiled["losses"], reference),
                    tiles_per_s=tiled["tiles_per_s"],
                    tiles_rejected=tiled["tiles_rejected"],
                )
            rows[device] = row
        if "cuda" in rows:
            rows["cuda_speedup_ps"] = rows["cpu"]["ps_step_s"] / rows["cuda"]["ps_step_s"]
        out["models"][model] = rows
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--models", nargs="+", default=["small", "base"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--clients", type=int, default=2, help="local cleave join processes for the tiles run (0: none)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    ui = ProgressUI(enabled=True)
    try:
        result = measure(args.models, args.steps, args.clients, ui)
    finally:
        ui.close()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    table = Table(title=f"coordinator by device, {args.steps} steps (median after the first)", title_justify="left")
    for name in ("model", "device", "plain torch s", "PS alone s", "PS / torch", "tiles s", "tiles/s", "max rel. diff"):
        table.add_column(name, justify="left" if name in ("model", "device") else "right")
    for model, rows in result["models"].items():
        for device, r in rows.items():
            if not isinstance(r, dict):
                continue
            diff = max(r["local_rel_diff"], r["ps_rel_diff"], r.get("tiles_rel_diff", 0.0))
            table.add_row(
                model,
                result["devices"][device],
                f"{r['local_step_s']:.3f}",
                f"{r['ps_step_s']:.3f}",
                f"{r['ps_over_local']:.2f}x",
                f"{r['tiles_step_s']:.3f}" if "tiles_step_s" in r else "-",
                f"{r['tiles_per_s']:,.0f}" if "tiles_per_s" in r else "-",
                f"{diff:.1e}",
            )
    Console(file=sys.stdout).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
