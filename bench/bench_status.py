"""What one build of the status document costs at 1,000 and at 300,000 enrolled identities
(issue 35): the public ``/api/status`` is built from it once a second, so it must not grow
with the identities a coordinator has enrolled over its life.

    .venv/bin/python bench/bench_status.py            # 1,000 and 300,000 identities
    .venv/bin/python bench/bench_status.py --sizes 1000 30000 300000 --json

Each size is a real SQLite file: every identity has one device row in one of three jobs
(filled job by job, in one transaction), one in a hundred of them was credited verified work and energy
through ``credit_device``. A status build (``report.status``) is timed after one warm-up build,
the best (and the median) of ``--repeat`` builds; the ratio is of the best, the figure a shared
machine disturbs least. Its SQLite virtual-machine steps are counted too (a progress handler:
deterministic where the time is not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from cleave.coordinator.engine import report  # noqa: E402
from cleave.coordinator.engine.core import Core  # noqa: E402
from cleave.db.sqlite import SQLiteStore  # noqa: E402

JOBS = 3
WORKED = 100  # one identity in this many was credited work


def crowd(path: Path, identities: int) -> tuple[SQLiteStore, Core]:
    """A store with ``identities`` enrolled identities, each with one device row, and a Core on its
    last job."""
    store = SQLiteStore(path)
    jobs = [store.create_job(f"job{j}", {}, 10, 0.0) for j in range(JOBS)]
    with store.atomic() as c:  # in SQLite, one transaction: 300,000 rows in about a second
        c.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :n)"
            " INSERT INTO identities (id, name, key, state, reason, created_at, last_seen)"
            " SELECT i, 'v' || i, x'00', 'active', '', 0, 0 FROM n",
            {"n": identities},
        )
        c.execute(  # job by job: the last job's rows come after every other job's
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :n)"
            " INSERT INTO devices (job_id, name, platform, cores, memory_bytes, device, gflops, state, joined_at,"
            " last_seen, identity_id) SELECT :first + (i - 1) * :jobs / :n, 'v' || i, 'Linux', 4, 1, 'cpu', 10.0,"
            " 'offline', 0, 0, i FROM n",
            {"n": identities, "jobs": JOBS, "first": jobs[0]},
        )
    with store.batch():
        for device in range(1, identities + 1, WORKED):
            store.credit_device(device, verified=device % 7 + 1, gflop=float(device), now=1.0)
            store.credit_device(device, joules=float(device % 13 + 1), gflop_metered=float(device), now=1.0)
    core = Core(store, jobs[-1], join_token="tok", operator_token="op", rng=np.random.default_rng(0))
    return store, core


def measure(identities: int, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        store, core = crowd(Path(tmp) / "status.db", identities)
        fill_s = time.perf_counter() - t0
        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0

        report.status(core, 0.0)  # warm-up: the counts kept in memory are counted once here
        store.conn.set_progress_handler(count, 100)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            status = report.status(core, 0.0)
            times.append(time.perf_counter() - t)
        store.conn.set_progress_handler(None, 0)
        assert len(status["leaderboard"]) == 10 and status["leaderboard_efficiency"], status["leaderboard"]
        store.close()
    return {
        "identities": identities,
        "fill_s": round(fill_s, 2),
        "build_ms": round(min(times) * 1e3, 3),  # the best of --repeat: least disturbed by a busy machine
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "vm_steps": steps[0] * 100 // repeat,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 300_000])
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(n, args.repeat) for n in args.sizes]
    ratio = rows[-1]["build_ms"] / rows[0]["build_ms"]
    if args.json:
        print(json.dumps({"sizes": rows, "ratio": round(ratio, 2)}))
        return
    for r in rows:
        print(
            f"{r['identities']:>9,} identities: status build {r['build_ms']:7.3f} ms (median {r['median_ms']:.3f}),"
            f" {r['vm_steps']:>10,} SQLite VM steps (filled in {r['fill_s']} s)"
        )
    print(f"ratio, {rows[-1]['identities']:,} over {rows[0]['identities']:,}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
