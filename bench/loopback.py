"""A job as real processes on loopback, for the benches that compare two runs of it: a
coordinator (every GEMM shipped: ``--planner uniform``), optionally a relay, and ``cleave join``
clients, each a fresh Python process; the coordinator's metrics rows when it is done."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
TOKEN, OPERATOR = "bench-loopback-join-token", "bench-loopback-operator"
START_S = 3.0  # seconds a coordinator (or relay) is given to listen before its peers connect


def cleave(*args: str) -> list[str]:
    return [sys.executable, "-m", "cleave", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    args: argparse.Namespace,
    tmp: Path,
    *,
    relay: bool = False,
    coordinator_args: tuple[str, ...] = ("--quiet",),
    client_args: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """``args.model``/``steps``/``batch_size``/``seq_len`` on a coordinator with ``args.clients``
    clients (and one relay they all go behind, with ``relay``); its metrics rows. The
    coordinator's output is in ``tmp / "coordinator.log"``."""
    port, metrics, log = free_port(), tmp / "metrics.jsonl", tmp / "coordinator.log"
    coordinator = _start(
        cleave(
            "coordinator", "start", "--host", "127.0.0.1", "--port", str(port), "--db", str(tmp / "ps.db"),
            "--metrics", str(metrics),
            "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--min-devices", str(args.clients), "--micro-batches", "1",
            "--checkpoint-every", "0", "--planner", "uniform", "--linger", "0", *coordinator_args,
        ),
        log.open("w"),
    )  # fmt: skip
    url = f"ws://127.0.0.1:{port}"
    time.sleep(START_S)
    others = []
    if relay:
        others.append(
            _start(
                cleave(
                    "relay",
                    url,
                    "--listen",
                    f"127.0.0.1:{free_port()}",
                    "--credentials",
                    str(tmp / "relay.json"),
                ),
                (tmp / "relay.log").open("w"),
            )  # fmt: skip
        )
        time.sleep(START_S)
    others += [
        _start(
            cleave(
                "join",
                url,
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
                *client_args,
            ),
            subprocess.DEVNULL,
        )  # fmt: skip
        for i in range(args.clients)
    ]
    try:
        if coordinator.wait(1800):
            raise SystemExit("the coordinator failed:\n" + log.read_text()[-2000:])
        for p in others[1:] if relay else others:  # clients leave once told the job is over
            p.wait(60)
    finally:
        for p in (coordinator, *others):
            if p.poll() is None:
                p.kill()
    return [json.loads(line) for line in metrics.read_text().splitlines() if line]


def _start(cmd: list[str], out: IO[str] | int) -> subprocess.Popen:
    """``cmd`` from the repository root, its stdout and stderr to ``out``; the tokens in its
    environment, not on its command line (which every local user can read)."""
    env = {**os.environ, "CLEAVE_TOKEN": TOKEN, "CLEAVE_OPERATOR_TOKEN": OPERATOR}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
