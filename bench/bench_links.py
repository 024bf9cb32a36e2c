"""A real coordinator and real clients on real rate-limited links, against the simulator's step.

Run from the repository root, as root (network namespaces)::

    .venv/bin/python bench/bench_links.py                       # tiny, PS 20 Mbit/s, 2 clients at 10/5
    .venv/bin/python bench/bench_links.py --ps-mbps 40 --clients 3 --steps 8 --json

``emulator/netns.py`` builds a star of network namespaces: the coordinator behind a link of
``--ps-mbps`` each way (the one bottleneck every device shares), each client behind
``--down-mbps`` / ``--up-mbps``, all shaped by tc's token bucket. The coordinator
(``cleave coordinator start``) and the clients (``cleave join``) run inside them as they would
on separate machines, over ws:// on the lab's own addresses. Every GEMM goes out as round-robin
tiles (``--planner uniform``): the bench is about links, so they must carry the step.

Then ``cleave simulate`` prices the same job on the same fleet: a fleet file with the clients'
links and the GEMM rate the coordinator measured for them in the run, the same coordinator link,
its own rate ``--ps-gflops`` (for its attention and AdamW), the same tiles, no churn, one part a
step. One JSON line (``--json``) or a table:

* ``measured_step_s``: the mean real step after ``--warmup``;
* ``predicted_step_s``: the simulator's step for that fleet and those links;
* ``ps_link_mbps`` and ``ps_egress_utilisation``: the bits that left the coordinator's interface
  in the measured steps (its counters) over what its link could carry in that time.

Round trips are the kernel's own here (no netem): home links' latency is not in the run, and the
fleet file says 1 ms. Every namespace is removed at the end, even after a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cleave.emulator.netns import Lab, Link, available  # noqa: E402

PORT = 8765
TIMEOUT = 900.0  # seconds the job may take
START_TIMEOUT = 120.0  # seconds the coordinator may take to listen, and the relay to enrol


def _cleave(*args: str) -> list[str]:
    return [sys.executable, "-m", "cleave", *args]


def _await(what: str, ready: Callable[[], bool], proc: subprocess.Popen, log: Path) -> None:
    """Poll until ``ready()``: a start is seconds of imports, more on a loaded machine, so a fixed
    sleep is either too long or too short."""
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} never came:\n" + (log.read_text()[-2000:] if log.exists() else ""))
        time.sleep(0.1)


def _enrolled(db: Path, device: str) -> bool:
    """Whether a device of this kind ("relay") has its row in the coordinator's database yet."""
    try:
        with closing(sqlite3.connect(f"{db.as_uri()}?mode=rw", uri=True, timeout=1)) as conn:  # never creates it
            return conn.execute("SELECT 1 FROM devices WHERE device = ?", (device,)).fetchone() is not None
    except sqlite3.Error:  # not created yet, or busy
        return False


def run_job(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The job inside the lab: its metrics rows, the clients' measured rates, the PS's counters."""
    token, operator = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with Lab() as lab:
        ps = lab.add("ps", Link(down=args.ps_mbps * 1e6, up=args.ps_mbps * 1e6))
        for i in range(args.clients):
            lab.add(f"d{i}", Link(down=args.down_mbps * 1e6, up=args.up_mbps * 1e6))
        relay = (
            lab.add("relay", Link(down=args.relay_mbps * 1e6, up=args.relay_mbps * 1e6)) if args.relay_mbps else None
        )
        metrics = tmp / "metrics.jsonl"
        coordinator = subprocess.Popen(
            lab.command(
                "ps",
                _cleave(
                    "coordinator",
                    "start",
                    *("--host", ps.address, "--port", str(PORT), "--db", str(tmp / "ps.db")),
                    *("--token", token, "--operator-token", operator, "--metrics", str(metrics)),
                    *("--model", args.model, "--steps", str(args.steps)),
                    *("--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)),
                    *("--min-devices", str(args.clients), "--micro-batches", "1", "--checkpoint-every", "0"),
                    *("--ps-link-gbps", str(args.ps_mbps / 1000), "--ps-gflops", str(args.ps_gflops)),
                    *("--planner", "uniform"),
                    # No held-out evaluation: the simulator prices training steps, and the last step's
                    # evaluation would add its bytes to the link's count (and seconds to the run).
                    *("--eval-every", "0"),
                    *("--linger", "0", "--quiet"),
                ),
            ),
            cwd=ROOT,
            env=env,
            stdout=(tmp / "coordinator.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        log = tmp / "coordinator.log"
        _await("the coordinator's listening", lambda: "listening on" in log.read_text(), coordinator, log)
        relays = []
        if relay is not None:  # enrolled before the clients: every client goes behind it
            relays.append(
                subprocess.Popen(
                    lab.command(
                        "relay",
                        _cleave(
                            "relay",
                            f"ws://{ps.address}:{PORT}",
                            *("--token", token, "--listen", f"{relay.address}:8766"),
                            *("--public-url", f"ws://{relay.address}:8766", "--name", "relay"),
                            *("--credentials", str(tmp / "relay.json")),
                        ),
                    ),
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=(tmp / "relay.log").open("w"),
                )
            )
            _await("the relay's enrolment", lambda: _enrolled(tmp / "ps.db", "relay"), relays[0], tmp / "relay.log")
        clients = [
            subprocess.Popen(
                lab.command(
                    f"d{i}",
                    _cleave(
                        "join",
                        f"ws://{ps.address}:{PORT}",
                        *("--token", token, "--insecure", "--always", "--once", "--quiet"),  # ws:// in the lab
                        *("--threads", "1", "--device", "cpu", "--name", f"d{i}"),
                        *("--credentials", str(tmp / f"d{i}.json")),
                    ),
                ),
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=(tmp / f"d{i}.log").open("w"),
            )
            for i in range(args.clients)
        ]
        sent: list[tuple[float, int]] = []  # (when, bytes the coordinator's interface has sent)
        deadline = time.monotonic() + TIMEOUT
        try:
            while coordinator.poll() is None:
                if time.monotonic() > deadline:
                    raise SystemExit("the job did not finish in time")
                rows = metrics.read_text().splitlines() if metrics.exists() else []
                sent.append((len(rows), lab.counters("ps")[0]))
                time.sleep(0.2)
            if coordinator.returncode:
                raise SystemExit(
                    f"the coordinator exited {coordinator.returncode}:\n"
                    + (tmp / "coordinator.log").read_text()[-2000:]
                )
            for c in clients:
                c.wait(60)
        finally:
            for p in (coordinator, *clients, *relays):
                if p.poll() is None:
                    p.kill()
        with sqlite3.connect(tmp / "ps.db") as conn:
            rates = [r[0] for r in conn.execute("SELECT gflops FROM devices WHERE device != 'relay'")]
            tiles = [r[0] for r in conn.execute("SELECT tiles_done FROM devices WHERE device != 'relay'")]
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return {"rows": rows, "sent": sent, "client_gflops": rates, "tiles": tiles}


def predict(args: argparse.Namespace, gflops: float, tmp: Path) -> dict[str, Any]:
    """``cleave simulate``'s step for the same job on the same fleet and links."""
    fleet = tmp / "fleet.toml"
    fleet.write_text(
        "[[class]]\n"
        f'name = "lab"\ncount = {args.clients}\ngflops = {gflops:.3f}\nmemory_gb = 4\n'
        f"down_mbps = {args.down_mbps}\nup_mbps = {args.up_mbps}\nrtt_ms = 1\n"
    )
    done = subprocess.run(
        _cleave(
            "simulate",
            *("--model", args.model, "--fleet", str(fleet), "--batch-size", str(args.batch_size)),
            *("--seq-len", str(args.seq_len), "--ps-link-gbps", str(args.ps_mbps / 1000)),
            *("--ps-gflops", str(args.ps_gflops), "--planner", "uniform", "--no-churn", "--steps", "3"),
            *("--micro-batches", "1", "--json"),
            *(("--relays", "1", "--relay-link-gbps", str(args.relay_mbps / 1000)) if args.relay_mbps else ()),
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def figures(args: argparse.Namespace, job: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    rows = job["rows"][args.warmup :]
    measured = statistics.fmean(r["seconds"] for r in rows)
    # Bytes that left the coordinator's interface while the measured steps ran.
    first = next(b for n, b in job["sent"] if n >= args.warmup)
    last = next(b for n, b in job["sent"] if n >= args.steps)
    seconds = sum(r["seconds"] for r in rows)
    predicted = sim["cleave"]["step_s"]
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "clients": args.clients,
        "ps_link_mbps": args.ps_mbps,
        "relay_link_mbps": args.relay_mbps or None,
        "device_down_mbps": args.down_mbps,
        "device_up_mbps": args.up_mbps,
        "measured_step_s": measured,
        "predicted_step_s": predicted,
        "predicted_over_measured": predicted / measured,
        "ps_egress_utilisation": (last - first) * 8 / (args.ps_mbps * 1e6 * seconds),
        "ps_mb_sent_per_step": (last - first) / 1e6 / len(rows),
        # The coordinator's own count of frame bytes (metrics rows), and the simulator's.
        "mb_down_per_step": (rows[-1]["mb_down"] - job["rows"][args.warmup - 1]["mb_down"]) / len(rows)
        if args.warmup
        else rows[-1]["mb_down"] / len(rows),
        "mb_up_per_step": (rows[-1]["mb_up"] - job["rows"][args.warmup - 1]["mb_up"]) / len(rows)
        if args.warmup
        else rows[-1]["mb_up"] / len(rows),
        "mb_relay_out_per_step": (rows[-1].get("mb_relay_out", 0) - job["rows"][args.warmup - 1].get("mb_relay_out", 0))
        / len(rows)
        if args.warmup
        else rows[-1].get("mb_relay_out", 0) / len(rows),
        "simulated_mb_down_per_step": sim["cleave"]["bytes"]["ps_egress"] / 1e6,
        "simulated_mb_relay_out_per_step": sim["cleave"]["bytes"].get("relay_out", 0) / 1e6,
        "simulated_mb_up_per_step": sim["cleave"]["bytes"]["ps_ingress"] / 1e6,
        "simulated_busy_s": sim["cleave"]["busy_s"],
        "simulated_bound": sim["cleave"]["bound"],
        "client_gflops": job["client_gflops"],
        "tiles_per_client": job["tiles"],
        "losses": [r["loss"] for r in job["rows"]],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out (default 2)")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--ps-mbps", type=float, default=20.0, help="the coordinator's link, Mbit/s each way")
    p.add_argument("--down-mbps", type=float, default=10.0, help="each client's downlink, Mbit/s")
    p.add_argument("--up-mbps", type=float, default=5.0, help="each client's uplink, Mbit/s")
    p.add_argument("--relay-mbps", type=float, default=0.0, help="a relay on this link, Mbit/s each way (0: none)")
    p.add_argument(
        "--ps-gflops",
        type=float,
        default=80.0,
        help="the coordinator's own GEMM rate, for the simulator's attention and AdamW (default 80: one core here)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = p.parse_args()
    why = available()
    if why is not None:
        print(f"bench_links needs network namespaces: {why}", file=sys.stderr)
        return 2
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be below --steps")
    with tempfile.TemporaryDirectory(prefix="cleave-bench-links-") as tmp:
        job = run_job(args, Path(tmp))
        gflops = statistics.fmean(job["client_gflops"])
        sim = predict(args, gflops, Path(tmp))
    fig = figures(args, job, sim)
    if not all(fig["tiles_per_client"]):
        print(f"a client computed no tiles: {fig['tiles_per_client']}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(fig, sort_keys=True))
    else:
        for key, value in fig.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
