"""The data path at scale: a coordinator's resident memory on a 1 GB+ token corpus against a 1 MB
one, and the time to draw a batch against the step.

Builds two corpora of random byte ids as ``uint16`` token shards with a ``shards.json`` (under
/tmp, deleted afterwards unless --keep): --tokens ids (default 2^30: 2.1 GB on disk, 1.07 G
tokens) in --shards files, and 1 MB. Runs the same job on each as real processes on loopback
(``cleave coordinator start`` with every GEMM shipped, ``--planner uniform``, and one ``cleave
join``), sampling the coordinator's VmRSS and its peak (VmHWM) from /proc. Then draws batches
in this process from the big corpus, with its pages in the page cache and after dropping them
(``posix_fadvise(DONTNEED)`` on its own files), against the steps' median time.

    nice -n 19 .venv/bin/python bench/bench_data.py [--tokens N] [--steps N] [--keep]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loopback import run_job  # noqa: E402

from cleave.coordinator.training import shards  # noqa: E402
from cleave.coordinator.training.data import ByteBatches, open_tokens, split  # noqa: E402

CHUNK = 1 << 26  # ids generated and written at a time (128 MiB of uint16)
VOCAB = 256  # the tiny preset's byte ids
SAMPLE_S = 0.2  # seconds between RSS samples


def build(folder: Path, tokens: int, n_shards: int, seed: int) -> None:
    """``tokens`` random ids in ``n_shards`` shards and their ``shards.json``."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    per = -(-tokens // n_shards)
    listed = []
    left = tokens
    for i in range(n_shards):
        n, name = min(per, left), f"shard-{i:05d}.bin"
        with open(folder / name, "wb") as f:
            for lo in range(0, n, CHUNK):
                f.write(rng.integers(0, VOCAB, size=min(CHUNK, n - lo), dtype=np.uint16).tobytes())
        listed.append({"file": name, "tokens": n})
        left -= n
    shards.Meta("uint16", VOCAB, tokens, listed, "bytes", "random ids (bench_data.py)").write(folder)


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _coordinator_pid(db: Path) -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"start" in cmd and str(db).encode() in cmd:
                return int(entry)
    return None


def job(args: argparse.Namespace, data: Path, tmp: Path) -> tuple[dict[str, float], list[dict]]:
    """The job on ``data``; the coordinator's RSS (median of the second half of the run, last
    sample, peak) and its metrics rows."""
    tmp.mkdir()
    samples: list[int] = []
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        pid = None
        while not done.is_set():
            pid = pid or _coordinator_pid(tmp / "ps.db")
            if pid is not None:
                try:
                    s = _status(pid)
                except OSError:
                    pid = None
                else:
                    if "VmRSS" in s:  # (not once it has exited, before it is reaped)
                        samples.append(s["VmRSS"])
                        peak[0] = max(peak[0], s["VmHWM"])
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        rows = run_job(
            args, tmp, coordinator_args=("--quiet", "--data", str(data), "--eval-every", str(args.eval_every))
        )
    finally:
        done.set()
        sampler.join()
    late = samples[len(samples) // 2 :] or [0]
    return {"median": statistics.median(late), "last": late[-1], "peak": peak[0]}, rows


def draw_cost(data: Path, seq_len: int, batch_size: int, draws: int, cold: bool) -> float:
    """Seconds to draw one training batch from ``data`` (median of ``draws``)."""
    stream = open_tokens(str(data), vocab_size=VOCAB, tokenize=None)
    if cold:  # this corpus's pages out of the page cache (only its own files)
        for seg in stream.segments:
            fd = os.open(seg.path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    batches = ByteBatches(split(stream, None, 0.01, seq_len).train, seq_len, batch_size, np.random.default_rng(1))
    times = []
    for _ in range(draws):
        t = time.perf_counter()
        batches.next()
        times.append(time.perf_counter() - t)
    stream.close()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1 << 30, help="ids in the big corpus (uint16: 2 bytes each)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--small-bytes", type=int, default=1 << 20)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--keep", action="store_true", help="keep the corpora and logs (their folder is printed)")
    args = parser.parse_args()
    args.clients = 1
    tmp = Path(tempfile.mkdtemp(prefix="cleave-bench-data-"))
    try:
        t = time.perf_counter()
        build(tmp / "big", args.tokens, args.shards, seed=1)
        build(tmp / "small", args.small_bytes // 2, 1, seed=2)
        big_bytes = sum(p.stat().st_size for p in (tmp / "big").glob("*.bin"))
        print(f"corpora: {args.tokens:,} tokens ({big_bytes / 1e9:.2f} GB) and {args.small_bytes // 2:,} tokens "
              f"({args.small_bytes / 1e6:.1f} MB), written in {time.perf_counter() - t:.0f} s")  # fmt: skip
        rss_small, _ = job(args, tmp / "small", tmp / "run-small")
        rss_big, rows = job(args, tmp / "big", tmp / "run-big")
        mib = 1 << 20
        for name, r in (("1 MB corpus", rss_small), (f"{big_bytes / 1e9:.2f} GB corpus", rss_big)):
            print(f"coordinator RSS, {name}: {r['median'] / mib:.0f} MiB (median, 2nd half), "
                  f"{r['last'] / mib:.0f} MiB last, peak {r['peak'] / mib:.0f} MiB")  # fmt: skip
        print(f"difference (big - small): median {(rss_big['median'] - rss_small['median']) / mib:+.1f} MiB, "
              f"peak {(rss_big['peak'] - rss_small['peak']) / mib:+.1f} MiB (goal: within 100 MiB)")  # fmt: skip
        step = statistics.median(r["seconds"] for r in rows)
        vals = [r["val_loss"] for r in rows if "val_loss" in r]
        warm = draw_cost(tmp / "big", args.seq_len, args.batch_size, 500, cold=False)
        cold = draw_cost(tmp / "big", args.seq_len, args.batch_size, 200, cold=True)
        print(f"step (median of {len(rows)}): {step * 1e3:.1f} ms; held-out loss at {len(vals)} evaluations: "
              + ", ".join(f"{v:.3f}" for v in vals))  # fmt: skip
        print(f"draw a batch of {args.batch_size} x {args.seq_len + 1} ids from the big corpus: "
              f"{warm * 1e6:.0f} us from the page cache ({warm / step:.2%} of the step), "
              f"{cold * 1e6:.0f} us from disk after dropping its pages ({cold / step:.2%})")  # fmt: skip
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
