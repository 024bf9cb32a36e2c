"""Fit the coordinator's event-loop costs (``costmodel.LoopCosts``) from a bench_tax.py run.

Run from the repository root::

    .venv/bin/python bench/bench_tax.py --repeat 3 --json > tax.json     # about 6 minutes
    .venv/bin/python bench/calibrate_loop.py tax.json                    # prints the constants
    .venv/bin/python bench/calibrate_loop.py bench/results/bench_tax-2026-11-28-send-threads.json --check band+1s

bench_tax sends one tile a work frame and gets one result a frame back, so its runs cannot tell
a cost per message from a cost per tile (both come once a tile); bench_throughput's tiny tiles,
whose bytes cost nearly nothing, give those two (``--per-message``, ``--per-tile``; the defaults
are the figures ``LoopCosts`` cites). What bench_tax measures is the rest: its loop's CPU per
tile, less one tile's messages and books, against the tile's bytes priced at the socket floor
measured in the same run (``MB down x send + MB up x receive``). One factor over that floor is
fitted by least squares over the run's shapes (every run of each when ``--repeat`` gave several),
and the per-byte costs are the floor's times that factor: framing, websockets and asyncio cost a
multiple of a raw ``sendall``. It prints the fit, each shape's loop against the fit's, and the
``LoopCosts(...)`` line to paste into coordinator/planning/costmodel.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cleave.coordinator.planning.costmodel import LOOP_COSTS, LoopCosts  # noqa: E402

MB = 1e6


def samples(result: Mapping[str, Any], check: str) -> list[dict[str, Any]]:
    """Every measured run of ``check`` in a bench_tax --json result (each repeat when present)."""
    out = []
    for shape in result["shapes"]:
        runs = shape.get("every_run", {}).get(check) or [shape["runs"].get(check, {})]
        out += [r for r in runs if r and "error" not in r and "loop_ms_per_tile" in r]
    return out


def fit(
    runs: Iterable[Mapping[str, Any]],
    floor: Mapping[str, float],
    per_message: float = LOOP_COSTS.per_message,
    per_tile: float = LOOP_COSTS.per_tile,
    messages_per_tile: float = 2.0,
) -> LoopCosts:
    """``LoopCosts`` whose per-byte costs are ``factor`` times the socket floor's, ``factor`` the
    least-squares fit of ``loop - (messages_per_tile x per_message + per_tile)`` against the
    floor's cost of each run's bytes per tile. Pure: figures in, constants out."""
    fixed = messages_per_tile * per_message + per_tile  # seconds a tile, bytes aside
    xs, ys = [], []
    for r in runs:
        floor_ms = r["mb_down_per_tile"] * floor["send_ms_per_mb"] + r["mb_up_per_tile"] * floor["recv_ms_per_mb"]
        xs.append(1e-3 * floor_ms)
        ys.append(1e-3 * r["loop_ms_per_tile"] - fixed)
    if not xs or sum(x * x for x in xs) <= 0:
        raise ValueError("no run with bytes to fit")
    factor = max(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs))
    return LoopCosts(
        per_message,
        per_tile,
        factor * floor["send_ms_per_mb"] * 1e-3 / MB,
        factor * floor["recv_ms_per_mb"] * 1e-3 / MB,
    )


def predicted_ms(costs: LoopCosts, run: Mapping[str, Any], messages_per_tile: float = 2.0) -> float:
    """The fit's loop CPU per tile (ms) for a run's bytes per tile."""
    return 1e3 * costs.seconds(messages_per_tile, 1.0, run["mb_down_per_tile"] * MB, run["mb_up_per_tile"] * MB)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("tax_json", type=Path, help="the output of bench/bench_tax.py --json")
    p.add_argument("--check", default="band", help="the run's mode to fit: band, tile, band+1s... (default: band)")
    p.add_argument(
        "--per-message", type=float, default=LOOP_COSTS.per_message * 1e3, help="ms a frame (bench_throughput)"
    )
    p.add_argument("--per-tile", type=float, default=LOOP_COSTS.per_tile * 1e3, help="ms a tile (bench_throughput)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    result = json.loads(args.tax_json.read_text())
    floor = result["socket_floor"]
    runs = samples(result, args.check)
    costs = fit(runs, floor, args.per_message * 1e-3, args.per_tile * 1e-3)
    factor = costs.per_byte_down * MB * 1e3 / floor["send_ms_per_mb"]
    rows = []
    for shape in result["shapes"]:
        r = shape["runs"].get(args.check, {})
        if "loop_ms_per_tile" in r:
            fitted = predicted_ms(costs, r)
            rows.append(
                {
                    "shape": shape["shape"],
                    "mb_down": r["mb_down_per_tile"],
                    "mb_up": r["mb_up_per_tile"],
                    "loop_ms": r["loop_ms_per_tile"],
                    "fit_ms": fitted,
                    "fit_over_live": fitted / r["loop_ms_per_tile"],
                }
            )
    if args.json:
        out = {"check": args.check, "socket_floor": floor, "factor_over_floor": factor, "runs": len(runs)}
        out["loop_costs"] = {f: getattr(costs, f) for f in ("per_message", "per_tile", "per_byte_down", "per_byte_up")}
        out["shapes"] = rows
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{args.tax_json}: {len(runs)} {args.check}-check runs; socket floor {floor['send_ms_per_mb']:.3f} ms a MB "
        f"sent, {floor['recv_ms_per_mb']:.3f} received; bytes cost {factor:.2f}x the floor on the loop"
    )
    for row in rows:
        print(
            f"  {row['shape']:8s} {row['mb_down']:5.2f} MB down {row['mb_up']:4.2f} up: loop {row['loop_ms']:5.2f} "
            f"ms a tile, fit {row['fit_ms']:5.2f} ({row['fit_over_live']:.2f}x)"
        )
    print(
        f"LoopCosts(per_message={costs.per_message:.3g}, per_tile={costs.per_tile:.3g}, "
        f"per_byte_down={costs.per_byte_down:.3g}, per_byte_up={costs.per_byte_up:.3g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
