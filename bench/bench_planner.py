"""The cost planner against the uniform grid on unequal clients, its predicted step time against
the measured one, bytes per step, and the scheduler's cost per decision at 10,000 devices.

Each scenario runs the same job twice on this machine, once per ``--planner``: a coordinator
(``cleave coordinator start``), one ``cleave join --threads 1`` client and one client slowed
``--slow`` times (``tests/doubles.py slowed``: it computes honestly, then waits). Scenarios:

* ``home``: the tiny model, the coordinator's GEMM rate measured at start. The cost model keeps
  GEMMs this small on the coordinator, where they are cheaper than shipped.
* ``ship``: the small model with ``--ps-gflops 1``: every GEMM must go to the clients, so the
  cost model has to share it out between a fast client and a slow one.

Figures (steps after ``--warmup`` only): mean step seconds per planner and the speedup
(uniform / cost); the cost model's predicted step seconds (``predicted_s`` in each step's
metrics: its GEMMs' predicted seconds plus the coordinator's own time in the step before) and
the median of |predicted - measured| / measured; megabytes sent down and up per step. Then the
scheduler alone and the whole Core at 10,000 devices (bench/bench_scheduler.py).

Run: ``.venv/bin/python bench/bench_planner.py`` (``--json`` for one JSON object; progress on
stderr). The coordinator and both clients share this machine's cores, so absolute times move
with its load; compare the planners within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TOKEN, OPERATOR = "bench-join-token-1234", "bench-operator-token-1234"
URL = re.compile(r"(wss?://[0-9.]+:\d+)")
SCENARIOS = {
    "home": dict(model="tiny", extra=[]),
    "ship": dict(model="small", extra=["--batch-size", "4", "--seq-len", "128", "--ps-gflops", "1"]),
}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def start_coordinator(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str, list[str]]:
    """``cleave coordinator start ARGS`` on a free port; returns it, its URL and its first lines."""
    coord = subprocess.Popen(
        [sys.executable, "-m", "cleave", "coordinator", "start", "--port", "0", "--linger", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
    )
    lines = []
    assert coord.stdout is not None
    for line in coord.stdout:
        lines.append(line)
        if m := URL.search(line):
            return coord, m.group(1), lines
    raise SystemExit("coordinator did not start:\n" + "".join(lines))


def finish_job(
    coord: subprocess.Popen, lines: list[str], others: list[subprocess.Popen], metrics: Path, timeout: float = 30.0
) -> list[dict]:
    """Wait for the coordinator to end the job, then for ``others`` (killed after ``timeout``);
    returns its ``--metrics`` rows, or exits with its output when it failed."""
    assert coord.stdout is not None
    rest = coord.stdout.read()
    code = coord.wait()
    for proc in others:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    if code != 0:
        raise SystemExit(f"coordinator exited {code}:\n" + "".join(lines) + rest)
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def run_job(planner: str, scenario: str, steps: int, slow: float, tmp: Path) -> list[dict]:
    """One job; returns its per-step metrics rows."""
    py = sys.executable
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    metrics = tmp / f"{scenario}-{planner}.jsonl"
    spec = SCENARIOS[scenario]
    coord, url, lines = start_coordinator(
        [
            "--db",
            str(tmp / f"{scenario}-{planner}.db"),
            "--token",
            TOKEN,
            "--operator-token",
            OPERATOR,
            "--steps",
            str(steps),
            "--model",
            spec["model"],
            "--min-devices",
            "2",
            "--planner",
            planner,
            "--metrics",
            str(metrics),
            "--quiet",
            *spec["extra"],
        ],
        env,
    )
    clients = [
        subprocess.Popen(
            [
                py,
                "-m",
                "cleave_cli",
                "join",
                url,
                "--token",
                TOKEN,
                "--threads",
                "1",
                "--once",
                "--quiet",
                "--always",
                "--name",
                "fast",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [py, str(ROOT / "tests" / "doubles.py"), "slowed", url, TOKEN, "slow", str(slow)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    return finish_job(coord, lines, clients, metrics)


def figures(rows: list[dict], warmup: int) -> dict:
    kept = rows[warmup:]
    seconds = [r["seconds"] for r in kept]
    errors = [abs(r["predicted_s"] - r["seconds"]) / r["seconds"] for r in kept if r.get("predicted_s") is not None]
    first, last = rows[warmup - 1] if warmup else {"mb_down": 0.0, "mb_up": 0.0}, rows[-1]
    return {
        "step_s": statistics.fmean(seconds),
        "predicted_s": statistics.fmean(r["predicted_s"] for r in kept if r.get("predicted_s") is not None)
        if errors
        else None,
        "prediction_error": statistics.median(errors) if errors else None,
        "mb_down_per_step": (last["mb_down"] - first["mb_down"]) / len(kept),
        "mb_up_per_step": (last["mb_up"] - first["mb_up"]) / len(kept),
        "losses": [r["loss"] for r in rows],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="home,ship")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (profiles are still priors)")
    parser.add_argument("--slow", type=float, default=4.0, help="how many times slower the second client is")
    parser.add_argument("--devices", type=int, default=10_000, help="fleet size for the scheduler's cost per decision")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out: dict = {"scenarios": {}, "slow": args.slow, "steps": args.steps, "warmup": args.warmup}
    with tempfile.TemporaryDirectory(prefix="cleave-bench-planner-") as tmp:
        for scenario in args.scenarios.split(","):
            res = {}
            for planner in ("uniform", "cost"):
                log(f"{scenario}: --planner {planner} ...")
                started = time.perf_counter()
                res[planner] = figures(run_job(planner, scenario, args.steps, args.slow, Path(tmp)), args.warmup)
                log(f"  {time.perf_counter() - started:.0f} s")
            res["speedup"] = res["uniform"]["step_s"] / res["cost"]["step_s"]
            res["max_loss_rel_diff"] = max(
                abs(a - b) / abs(b) for a, b in zip(res["cost"]["losses"], res["uniform"]["losses"])
            )
            out["scenarios"][scenario] = res
    from bench_scheduler import bench_core, bench_scheduler

    log(f"scheduler at {args.devices:,} devices ...")
    out["scheduler_us_per_decision"] = {
        "100": bench_scheduler(100, 5000) * 1e6,
        str(args.devices): bench_scheduler(args.devices, 5000) * 1e6,
    }
    out["core_us_per_result"] = {
        "100": bench_core(100, 1000) * 1e6,
        str(args.devices): bench_core(args.devices, 1000) * 1e6,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"unequal clients: one at 1 thread, one {args.slow:g}x slower; steps {args.warmup + 1}-{args.steps}")
    print(f"{'scenario':<8} {'planner':<8} {'step s':>8} {'predicted':>10} {'pred err':>9} {'MB down':>9} {'MB up':>8}")
    for name, res in out["scenarios"].items():
        for planner in ("uniform", "cost"):
            f = res[planner]
            pred = "-" if f["predicted_s"] is None else f"{f['predicted_s']:.3f}"
            err = "-" if f["prediction_error"] is None else f"{100 * f['prediction_error']:.1f}%"
            print(
                f"{name:<8} {planner:<8} {f['step_s']:>8.3f} {pred:>10} {err:>9} {f['mb_down_per_step']:>9.1f} "
                f"{f['mb_up_per_step']:>8.1f}"
            )
        print(
            f"{name:<8} speedup of cost over uniform: {res['speedup']:.2f}x   "
            f"(losses agree to {res['max_loss_rel_diff']:.1e} relative)"
        )
    s, c = out["scheduler_us_per_decision"], out["core_us_per_result"]
    print(
        f"scheduler per message: {s['100']:.1f} us at 100 devices, {s[str(args.devices)]:.1f} us at {args.devices:,}; "
        f"Core.handle(Result): {c['100']:.1f} us and {c[str(args.devices)]:.1f} us"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
