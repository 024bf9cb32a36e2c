"""A relay against none: what leaves the coordinator, same job, same clients (issue 22's goal).

Run from the repository root::

    .venv/bin/python bench/bench_relay.py                   # small, 8 x 64, 4 clients, 3 steps, a table
    .venv/bin/python bench/bench_relay.py --steps 4 --json

The same job twice, as real processes on loopback: the coordinator (``--planner uniform``: every
GEMM shipped), ``--clients`` ``cleave join`` processes, and in the second run one ``cleave relay``
enrolled before them (every client goes behind it). Prints the MB that left the coordinator in
each run (its ``mb_ps_out``: frames to devices and to the relay), their ratio (goal: at most
0.6), what the relay served in its stead (``mb_relay_out``), and whether the losses of both runs
equal plain torch's (1e-5).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loopback import run_job  # noqa: E402 - after the path is set


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)  # the job's default
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from cleave.coordinator.training.loop import TrainConfig, Trainer

    want = [
        r.loss
        for r in Trainer(
            TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
        ).run()
    ]
    with tempfile.TemporaryDirectory(prefix="cleave-bench-relay-") as a, tempfile.TemporaryDirectory() as b:
        alone, relayed = run_job(args, Path(a)), run_job(args, Path(b), relay=True)
    last_a, last_r = alone[-1], relayed[-1]
    exact = all(
        abs(r["loss"] - w) <= 1e-5 * abs(w) for rows in (alone, relayed) for r, w in zip(rows, want, strict=True)
    )
    out = {
        "model": args.model,
        "clients": args.clients,
        "steps": args.steps,
        "mb_ps_out_without_relay": last_a["mb_ps_out"],
        "mb_ps_out_with_relay": last_r["mb_ps_out"],
        "ratio": last_r["mb_ps_out"] / last_a["mb_ps_out"],
        "goal_ratio": 0.6,
        "mb_to_relay": last_r["mb_to_relays"],
        "mb_relay_out": last_r["mb_relay_out"],
        "losses_equal_plain_torch": exact,
    }
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        for key, value in out.items():
            print(f"{key:28} {value}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
