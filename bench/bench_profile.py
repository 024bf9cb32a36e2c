"""Where a distributed step's time goes on the coordinator: a sampling profile, before any change.

Runs the job of ``bench_distributed.py`` (the coordinator in this process, ``--clients`` ``cleave
join`` processes) under py-spy (``pip install py-spy``; it samples this process from outside, so
the coordinator runs unmodified), then sorts every sample of every coordinator thread into what
it was doing, by the innermost frame that names a part of Cleave:

* verification (wire/verify.py), assembly and partial sums (tiles.assemble, Intake.complete),
  framing (wire/messages.py encode/decode), websocket I/O (the websockets package),
  the store (db/, SQLite), scheduling and planning (scheduler, planner, live_plan), other Core
  bookkeeping (the engine: core.py and its parts), the optimizer (torch.optim, clipping), the model's non-GEMM work
  (coordinator/training: norms, attention, loss, on the PS), GEMMs the PS multiplies itself;
* idle: the event loop waiting for a socket, or the trainer waiting for a GEMM's tiles.

Figures: seconds and share of wall time per thread and category over the whole job (warm-up
steps included), and the job's mean step time. Run: ``.venv/bin/python bench/bench_profile.py``
(``--json`` for one object; ``--steps``, ``--model``, ``--batch-size``, ``--seq-len``, ``--clients``
as bench_distributed.py). Needs ptrace rights over this process (root, or
``kernel.yama.ptrace_scope = 0``).
"""

from __future__ import annotations

# isort: off
import cleave.cli  # noqa: F401  -- sets OMP_WAIT_POLICY=PASSIVE before torch is imported (2 cores!)
# isort: on

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RATE = 200  # samples per second per thread

# (category, substrings of a frame "function (file:line)"): the innermost matching frame decides.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("verification", ("/wire/verify.py",)),
    ("assembly and partial sums", ("assemble (", "Intake.complete (")),  # not run_until_complete
    ("framing (encode/decode)", ("/wire/messages.py",)),
    ("websocket I/O", ("/websockets/",)),
    ("store (SQLite)", ("/db/", "sqlite")),
    ("scheduling and planning", ("/engine/scheduler.py", "/engine/live_plan.py", "/planning/", "/engine/conduct.py")),
    ("core bookkeeping", ("/engine/", "/net/")),
    ("optimizer", ("/optim/", "clip_grad")),
    ("PS GEMMs", ("LocalEngine",)),
    ("model, non-GEMM (norms, attention, loss)", ("/training/",)),
)
IDLE = (
    "select (",
    "_worker (concurrent/futures/thread.py",  # an executor thread between jobs
    "epoll",
    "poll (",
    "wait (threading.py",
    "_wait_for_tstate_lock",
    "sleep (",
    "waitpid",
)


def categorise(frames: list[str]) -> str:
    if frames and any(marker in frames[-1] for marker in IDLE):
        return "idle (waiting: sockets, tiles)"
    for frame in reversed(frames):
        for name, needles in RULES:
            if any(n in frame for n in needles):
                return name
    return "other (torch, asyncio, python)"


def _innermost(frames: list[str], needle: str) -> str | None:
    for frame in reversed(frames):
        if needle in frame:
            return frame.split(" (", 1)[0]
    return None


def parse(path: Path) -> tuple[dict[str, Counter], Counter]:
    """py-spy's raw format: ``thread (id): name;frame;frame count`` per line. Also the functions
    of the engine that "core bookkeeping" samples were in (the largest category to break down)."""
    per_thread: dict[str, Counter] = defaultdict(Counter)
    core: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        thread = parts[0].split(": ", 1)[-1] if parts[0].startswith("thread") else "?"
        name = categorise(parts[1:])
        per_thread[thread][name] += int(count)
        if name == "core bookkeeping":
            leaf = parts[-1].split(" (", 1)[0]
            core[f"{_innermost(parts[1:], '/engine/') or _innermost(parts[1:], '.py')} > {leaf}"] += int(count)
    return per_thread, core


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--client-threads", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the coordinator's torch threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("bench_profile needs py-spy: .venv/bin/python -m pip install py-spy")
    from bench_distributed import ProgressUI, run_distributed

    from cleave.coordinator.training.loop import TrainConfig

    train = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len)
    with tempfile.TemporaryDirectory(prefix="cleave-bench-profile-") as tmp:
        out = Path(tmp) / "profile.txt"
        proc = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(os.getpid()),
                "--format",
                "raw",
                "--output",
                str(out),
                "--rate",
                str(RATE),
                "--threads",
                "--idle",
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)  # attached before the job starts
        if proc.poll() is not None:
            raise SystemExit(f"py-spy could not attach: {proc.stderr.read() if proc.stderr else ''}".strip())
        ui = ProgressUI(enabled=not args.json)
        started = time.perf_counter()
        try:
            dist = run_distributed(train, args.threads, args.clients, args.client_threads, ui)
        finally:
            ui.close()
            wall = time.perf_counter() - started
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        per_thread, core = parse(out)
    steps = [s.seconds for s in dist.snapshots] if dist.snapshots and hasattr(dist.snapshots[0], "seconds") else []
    report = {
        "model": args.model,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "clients": args.clients,
        "wall_s": wall,
        "rate": RATE,
        "threads": {},
    }
    for thread, counts in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counts.values())
        if total < RATE or counts["idle (waiting: sockets, tiles)"] == total:  # helpers: client reapers
            continue
        report["threads"][thread] = {
            name: {"seconds": n / RATE, "share": n / total} for name, n in counts.most_common()
        }
    if steps:
        report["step_s"] = sum(steps) / len(steps)
    report["core_bookkeeping_top"] = {k: n / RATE for k, n in core.most_common(8)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{args.model}, batch {args.batch_size} x {args.seq_len}, {args.steps} steps, {args.clients} clients x "
        f"{args.client_threads} thread; job wall {wall:.1f} s; samples at {RATE}/s per thread"
    )
    for thread, cats in report["threads"].items():
        print(f"\nthread {thread}:")
        for name, v in cats.items():
            print(f"  {name:<44} {v['seconds']:>8.2f} s  {100 * v['share']:5.1f}%")
    print("\ncore bookkeeping, innermost Core function > leaf:")
    for name, seconds in report["core_bookkeeping_top"].items():
        print(f"  {name:<60} {seconds:>7.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
