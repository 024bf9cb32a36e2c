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
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKEN, OPERATOR = "bench-relay-join-token", "bench-relay-operator"


def _cleave(*args: str) -> list[str]:
    return [sys.executable, "-m", "cleave_cli", *args]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace, tmp: Path, relay: bool) -> dict[str, Any]:
    port, metrics = _port(), tmp / "metrics.jsonl"
    coordinator = subprocess.Popen(
        _cleave(
            "coordinator", "start", "--host", "127.0.0.1", "--port", str(port), "--db", str(tmp / "ps.db"),
            "--token", TOKEN, "--operator-token", OPERATOR, "--metrics", str(metrics),
            "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--min-devices", str(args.clients), "--micro-batches", "1",
            "--checkpoint-every", "0", "--planner", "uniform", "--linger", "0", "--quiet",
        ),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(tmp / "coordinator.log").open("w"),
    )  # fmt: skip
    url = f"ws://127.0.0.1:{port}"
    time.sleep(3.0)
    others = []
    if relay:
        others.append(
            subprocess.Popen(
                _cleave(
                    "relay",
                    url,
                    "--token",
                    TOKEN,
                    "--listen",
                    f"127.0.0.1:{_port()}",
                    "--credentials",
                    str(tmp / "relay.json"),
                ),
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=(tmp / "relay.log").open("w"),
            )  # fmt: skip
        )
        time.sleep(3.0)
    others += [
        subprocess.Popen(
            _cleave(
                "join",
                url,
                "--token",
                TOKEN,
                "--once",
                "--always",
                "--quiet",
                "--threads",
                "1",
                "--device",
                "cpu",
                "--name",
                f"c{i}",
                "--credentials",
                str(tmp / f"c{i}.json"),
            ),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for i in range(args.clients)
    ]
    try:
        if coordinator.wait(1800):
            raise SystemExit("the coordinator failed:\n" + (tmp / "coordinator.log").read_text()[-2000:])
    finally:
        for p in (coordinator, *others):
            if p.poll() is None:
                p.kill()
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return {"rows": rows, "losses": [r["loss"] for r in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)  # the job's default
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from coordinator.training.loop import TrainConfig, Trainer

    want = [
        r.loss
        for r in Trainer(
            TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
        ).run()
    ]
    with tempfile.TemporaryDirectory(prefix="cleave-bench-relay-") as a, tempfile.TemporaryDirectory() as b:
        alone, relayed = run(args, Path(a), relay=False), run(args, Path(b), relay=True)
    last_a, last_r = alone["rows"][-1], relayed["rows"][-1]
    exact = all(
        abs(x - w) <= 1e-5 * abs(w)
        for losses in (alone["losses"], relayed["losses"])
        for x, w in zip(losses, want, strict=True)
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
