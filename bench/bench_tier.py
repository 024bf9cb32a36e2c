"""One coordinator with two clients against a tier of two coordinators with one client each.

Run from the repository root::

    .venv/bin/python bench/bench_tier.py                     # small, batch 8 x 256, 6 steps
    .venv/bin/python bench/bench_tier.py --steps 8 --json

Three runs of the same job (``--model``, ``--batch-size`` x ``--seq-len``, ``--steps``), one
after the other on this machine:

- ``plain``: plain torch (the reference for exactness);
- ``one``: one coordinator in this process with two ``cleave join`` processes;
- ``tier``: two ``cleave coordinator start --world-size 2`` processes on loopback, each with its
  own ``cleave join`` process: each rank trains half of every batch, and the ranks reduce-scatter
  their gradients and all-gather their weights every step (docs/operations.md, Running a tier).

Both Cleave runs deal every GEMM to the clients as round-robin tiles (``--planner uniform``: on
one machine the cost model would rightly keep the small model's GEMMs home) and cut each batch
(or rank's slice) into one part: the tier adds its two halves' gradients where one coordinator
takes the whole batch at once, so their losses agree to float error (the tier's are those of one
coordinator with ``--micro-batches 2``, bit for bit: tests/coordinator/tier/test_tier.py). Figures, over the
steps after ``--warmup-steps``:

* the step time of the tier over one coordinator's;
* the tier's own share of its step: the collectives (the gradients' reduce-scatter with the
  scalars and the clip's norms, the weights' all-gather: ``tier_sum_s`` + ``tier_gather_s`` in
  each rank's ``--metrics`` rows) and the wait at the step's barrier for the slower rank
  (``tier_wait_s``);
* exactness: the ranks' logged losses against each other (bit for bit), against one
  coordinator's and against plain torch's;
* tiles verified on each client (every client must have computed tiles).

On this two-core machine the tier's four processes share the cores that one coordinator's three
share: the ratio shows what the tier costs, not the speedup of more machines.
"""

from __future__ import annotations

# isort: off
import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported (2 cores!)
# isort: on

import argparse
import asyncio
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_distributed import BenchReporter, ProgressUI
from rich.console import Console
from rich.table import Table

from cleave.cli.local import serve_with_local_clients
from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.engine.identity import new_token
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.training.loop import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT = 900.0  # seconds the tier's processes may take


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _tiles_per_device(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT name, tiles_done FROM devices"))


def run_plain(train: TrainConfig, ui: ProgressUI) -> dict[str, Any]:
    task = ui.phase("plain torch", 1)
    results = Trainer(train).run()
    ui.advance(task, f"final loss {results[-1].loss:.4f}")
    return {"losses": [r.loss for r in results], "seconds": [r.seconds for r in results]}


def run_one(train: TrainConfig, ui: ProgressUI) -> dict[str, Any]:
    """One coordinator in this process, two local clients."""
    with tempfile.TemporaryDirectory(prefix="cleave-bench-tier-one-") as tmp:
        db = Path(tmp) / "one.db"
        cfg = CoordinatorConfig(
            train=train,
            port=0,
            db=str(db),
            token=new_token(),
            min_devices=2,
            planner=Planner.UNIFORM,
            checkpoint_every=0,
        )
        outcome = asyncio.run(
            serve_with_local_clients(
                cfg, BenchReporter(ui, train.steps), clients=2, threads=1, name="one", quiet_clients=True
            )
        )
        tiles = _tiles_per_device(db)
    return {
        "losses": [r.loss for r in outcome.results],
        "seconds": [r.seconds for r in outcome.results],
        "tiles": tiles,
    }


def _cleave(*args: str) -> list[str]:
    return [sys.executable, "-m", "cleave", *args]


def run_tier(train: TrainConfig, ui: ProgressUI, world: int = 2) -> dict[str, Any]:
    """``world`` coordinator processes on loopback, one tier, each with one client process."""
    secret, token, rendezvous = new_token(), new_token(), f"tcp://127.0.0.1:{_port()}"
    env = {**os.environ, "CLEAVE_TIER_SECRET": secret}
    task = ui.phase(f"tier of {world} ranks", 1)
    with tempfile.TemporaryDirectory(prefix="cleave-bench-tier-") as tmp:
        procs: list[subprocess.Popen] = []
        folders = [Path(tmp) / f"rank{r}" for r in range(world)]
        try:
            for r, folder in enumerate(folders):
                folder.mkdir()
                port = _port()
                procs.append(
                    subprocess.Popen(
                        _cleave(
                            "coordinator",
                            "start",
                            *("--port", str(port), "--db", str(folder / "rank.db"), "--token", token),
                            *("--model", train.model, "--steps", str(train.steps)),
                            *("--batch-size", str(train.batch_size), "--seq-len", str(train.seq_len)),
                            *("--micro-batches", "1", "--planner", "uniform", "--min-devices", "1"),
                            *("--checkpoint-every", "0", "--linger", "0", "--metrics", str(folder / "metrics.jsonl")),
                            *("--world-size", str(world), "--rank", str(r), "--rendezvous", rendezvous, "--quiet"),
                        ),
                        cwd=ROOT,
                        env=env,
                        stdout=(folder / "coordinator.log").open("w"),
                        stderr=subprocess.STDOUT,
                    )
                )
                procs.append(
                    subprocess.Popen(
                        _cleave(
                            "join",
                            f"ws://127.0.0.1:{port}",
                            *("--token", token, "--once", "--quiet", "--always", "--threads", "1"),
                            *("--device", "cpu", "--name", f"rank{r}-client"),
                            *("--credentials", str(folder / "credentials.json")),
                        ),
                        cwd=ROOT,
                        stdout=subprocess.DEVNULL,
                        stderr=(folder / "client.log").open("w"),
                    )
                )
            deadline = time.monotonic() + RUN_TIMEOUT
            for p in procs:
                code = p.wait(max(1.0, deadline - time.monotonic()))
                if code:
                    logs = "\n".join((f / "coordinator.log").read_text()[-1500:] for f in folders)
                    raise SystemExit(f"a tier process exited with {code}:\n{logs}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        ranks = []
        for folder in folders:
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
            ranks.append({"rows": rows, "tiles": _tiles_per_device(folder / "rank.db")})
    ui.advance(task, f"final loss {ranks[0]['rows'][-1]['loss']:.4f}")
    return {"ranks": ranks}


def figures(args: argparse.Namespace, plain: dict, one: dict, tier: dict) -> dict[str, Any]:
    w = args.warmup_steps
    ranks = tier["ranks"]
    tier_losses = [[row["loss"] for row in rank["rows"]] for rank in ranks]
    # A step of the tier ends when its slower rank's does (they meet at every step's barrier).
    tier_steps = [max(rank["rows"][i]["seconds"] for rank in ranks) for i in range(args.steps)]
    one_s = statistics.fmean(one["seconds"][w:])
    tier_s = statistics.fmean(tier_steps[w:])

    def share(key: str) -> float:
        return statistics.fmean(
            statistics.fmean(row.get(key, 0.0) / row["seconds"] for row in rank["rows"][w:]) for rank in ranks
        )

    return {
        "config": {
            "model": args.model,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "warmup_steps": w,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
        },
        "plain_step_s": statistics.fmean(plain["seconds"][w:]),
        "one_step_s": one_s,
        "tier_step_s": tier_s,
        "tier_over_one": tier_s / one_s,
        "tier_collectives_share": share("tier_sum_s") + share("tier_gather_s"),
        "tier_sum_share": share("tier_sum_s"),
        "tier_gather_share": share("tier_gather_s"),
        "tier_wait_share": share("tier_wait_s"),
        "tier_collectives_ms": 1e3
        * statistics.fmean(
            row.get("tier_sum_s", 0.0) + row.get("tier_gather_s", 0.0) for rank in ranks for row in rank["rows"][w:]
        ),
        "ranks_log_one_loss": all(losses == tier_losses[0] for losses in tier_losses),
        "tier_vs_one_max_rel": _rel(tier_losses[0], one["losses"]),
        "tier_vs_plain_max_rel": _rel(tier_losses[0], plain["losses"]),
        "one_vs_plain_max_rel": _rel(one["losses"], plain["losses"]),
        "tiles_one": one["tiles"],
        "tiles_tier": [rank["tiles"] for rank in ranks],
    }


def render(fig: dict[str, Any], console: Console) -> None:
    c = fig["config"]
    table = Table(
        title=f"A tier of 2 coordinators (1 client each) against one coordinator with 2 clients: {c['model']}, "
        f"batch {c['batch_size']} x {c['seq_len']}, {c['steps'] - c['warmup_steps']} steps after "
        f"{c['warmup_steps']} warm-up",
        title_justify="left",
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("step: one coordinator / plain torch", f"{fig['one_step_s']:.2f} s / {fig['plain_step_s']:.2f} s")
    table.add_row("step: the tier", f"{fig['tier_step_s']:.2f} s")
    table.add_row("the tier's step / one coordinator's", f"{fig['tier_over_one']:.2f}x")
    table.add_row(
        "the tier's collectives / its step\n(reduce-scatter and scalars + weights' all-gather)",
        f"{fig['tier_collectives_share']:.1%} ({fig['tier_sum_share']:.1%} + {fig['tier_gather_share']:.1%}; "
        f"{fig['tier_collectives_ms']:.0f} ms)",
    )
    table.add_row("waiting at the barrier for the other rank / its step", f"{fig['tier_wait_share']:.1%}")
    table.add_row(
        "losses: ranks alike / tier vs one / tier vs plain",
        f"{'bit for bit' if fig['ranks_log_one_loss'] else 'DIFFER'} / {fig['tier_vs_one_max_rel']:.1e} / "
        f"{fig['tier_vs_plain_max_rel']:.1e}",
    )
    table.add_row(
        "tiles verified per client: one / tier",
        f"{sorted(fig['tiles_one'].values())} / {[sorted(t.values()) for t in fig['tiles_tier']]}",
    )
    console.print(table)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="small", help="model preset (default: small)")
    p.add_argument("--batch-size", type=int, default=8, help="global batch in sequences (default: 8; even)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--steps", type=int, default=6, help="steps of each run (default: 6)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the figures (default: 2)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args()
    if args.batch_size % 2 or args.batch_size < 2 or not 0 <= args.warmup_steps < args.steps:
        p.error("--batch-size must be even and >= 2, and --warmup-steps below --steps")
    ui = ProgressUI(not args.quiet)
    train = TrainConfig(
        model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, micro_batches=1
    )
    try:
        plain = run_plain(train, ui)
        one = run_one(train, ui)
        tier = run_tier(train, ui)
    finally:
        ui.close()
    fig = figures(args, plain, one, tier)
    if not all(fig["tiles_one"].values()) or not all(all(t.values()) for t in fig["tiles_tier"]):
        print(f"a client computed no tiles: {fig['tiles_one']} {fig['tiles_tier']}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(fig, indent=2))
    else:
        render(fig, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
