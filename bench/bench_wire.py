"""The half-precision wire (``--wire-dtype``) against float32 and plain torch, in one run.

Run from the repository root::

    .venv/bin/python bench/bench_wire.py                                   # tiny, 200 steps
    .venv/bin/python bench/bench_wire.py --model small --steps 8 --seq-len 256

Trains the same job (same seed) in plain torch, then through a coordinator in this process with
``--clients`` ``cleave join`` processes for each wire dtype (``--planner uniform``, so every GEMM
travels), and prints per wire dtype: frame bytes down and up per step, the mean step after two
warm-up steps, the largest and the final relative loss difference from plain torch, tiles
rejected, and the worst honest residual as a share of the tolerance. One JSON object per line
with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported (2 cores!)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_distributed import CLIENT_EXIT_TIMEOUT_S, BenchReporter, ProgressUI  # noqa: E402

from cleave.cli.local import serve_with_local_clients  # noqa: E402
from cleave.coordinator.config import CoordinatorConfig  # noqa: E402
from cleave.coordinator.engine.identity import new_token  # noqa: E402
from cleave.coordinator.engine.live_plan import Planner  # noqa: E402
from cleave.coordinator.training.loop import TrainConfig, Trainer  # noqa: E402
from cleave.wire.messages import WireDtype  # noqa: E402

WARMUP = 2


def run(train: TrainConfig, wire: WireDtype, clients: int, local: list[float], ui: ProgressUI) -> dict:
    with tempfile.TemporaryDirectory(prefix="cleave-bench-wire-") as tmp:
        cfg = CoordinatorConfig(
            train=train,
            port=0,
            db=str(Path(tmp) / "wire.db"),
            token=new_token(),
            min_devices=clients,
            planner=Planner.UNIFORM,
            wire_dtype=wire,
        )
        out = asyncio.run(
            serve_with_local_clients(
                cfg,
                BenchReporter(ui, train.steps),
                clients=clients,
                threads=1,
                name="wire",
                exit_timeout=CLIENT_EXIT_TIMEOUT_S,
                quiet_clients=True,
            )
        )
    losses = [r.loss for r in out.results]
    rel = [abs(x - y) / abs(y) for x, y in zip(losses, local, strict=True)]
    last, measured = out.results[-1].extra, out.results[WARMUP:] or out.results
    return {
        "wire": wire.value,
        "mb_down_per_step": last["mb_down"] / train.steps,
        "mb_up_per_step": last["mb_up"] / train.steps,
        "step_s": sum(r.seconds for r in measured) / len(measured),
        "max_rel_loss_diff": max(rel),
        "final_rel_loss_diff": rel[-1],
        "final_loss": losses[-1],
        "local_final_loss": local[-1],
        "tiles_rejected": out.status["tiles"]["rejected"],
        "worst_honest_ratio": out.status["verify"]["worst_honest_ratio"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--wires", default="fp32,bf16,fp16", help="comma-separated wire dtypes (default: all three)")
    p.add_argument("--json", action="store_true", help="one JSON object per wire dtype on stdout")
    args = p.parse_args(argv)
    wires = [WireDtype(w) for w in args.wires.split(",")]
    train = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    ui = ProgressUI(enabled=not args.json)
    try:
        local = [r.loss for r in Trainer(train).run()]
        rows = [run(train, wire, args.clients, local, ui) for wire in wires]
    finally:
        ui.close()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    table = Table(
        title=f"--wire-dtype: {args.model}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps, "
        f"{args.clients} clients",
        title_justify="left",
    )
    for name in (
        "wire",
        "MB down/step",
        "MB up/step",
        "step",
        "max loss drift",
        "final drift",
        "rejected",
        "worst honest",
    ):
        table.add_column(name, justify="left" if name == "wire" else "right")
    for r in rows:
        table.add_row(
            r["wire"],
            f"{r['mb_down_per_step']:.1f}",
            f"{r['mb_up_per_step']:.1f}",
            f"{r['step_s']:.3f} s",
            f"{r['max_rel_loss_diff']:.1e}",
            f"{r['final_rel_loss_diff']:.1e}",
            str(r["tiles_rejected"]),
            f"{r['worst_honest_ratio']:.3f}",
        )
    Console(highlight=False).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
