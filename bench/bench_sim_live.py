"""The simulator against the live coordinator, on bench_tax.py's configuration.

Run from the repository root::

    .venv/bin/python bench/bench_sim_live.py bench/results/bench_tax-2026-11-28-send-threads.json   # a stored run
    .venv/bin/python bench/bench_sim_live.py --live --shapes qkv-fwd                    # measure live too
    .venv/bin/python bench/bench_sim_live.py tax.json --json

The simulator (coordinator/whatif/simulator.py) runs bench_tax's GEMMs as bench_tax's pump
issues them: ``--gemms`` (2) chains side by side, each submitting the next GEMM of its shape
as the last one completes, every GEMM on operands of its own (so every block goes down again),
laid out as training lays them (forward ``X W^T``, dW ``dY^T X``, dX ``dY W``), cut into the
shape's scaled grid (bench_tax's ``FixedGrid``), on 6 trusted devices of 2 slots (``--devices``,
``--slots``). The assumptions, each stated:

* the devices compute in no time (``--device-gflops``, 1e6 GFLOP/s, no per-tile overhead): the
  clients replay their products;
* loopback links: the PS's egress and ingress and each device's links at ``--link-gbps`` (80
  Gbit/s, about what one sender pushes over loopback here), a round trip of 0.1 ms;
* the PS is this machine's coordinator: its checks at ``--verify-gflops`` (40 GFLOP/s, one core
  of bench_verify.py at 16 columns), copies at 10 GB/s, ``unit_overhead`` as the profile's
  default; its event loop priced by ``costmodel.LOOP_COSTS``, fitted from bench_tax's run
  (bench/calibrate_loop.py): comparing against that same run is a check of the fit and of the
  simulator's bytes and tile counts, not an independent validation of the constants;
* the clients' process (``--clients``): in bench_tax all devices replay in one Python process
  on the same two cores, busy 0.83-0.98 of a core, and it binds the live rate. The simulator
  gives every unit a turn of ``SimConfig.host_cpu`` seconds in one process the devices share
  (FIFO), on top of its (zero) compute. The assumption: the clients' process CPU per tile,
  ``clients_cores / tiles_per_s`` of the live run, is spent serially, one tile at a time, in
  that one process (the GIL serialises it; its decode, replay and encode of a tile do not
  overlap another tile's), so 6 devices sharing it each see a tile take that CPU plus their
  wait behind the other devices' tiles, not 6x it when fewer are busy. ``fit``: each shape
  gets its own live figure (its tiles/s is then a fit on the same run, not a prediction);
  ``predict``: each shape gets the other shapes' clients' CPU per MB sent down (leave one
  out; the clients' work is mostly decoding the frames' bytes), times the MB down per tile
  its live run sent (the simulated MB differ, below): its tiles/s is predicted from the other
  shapes' clients; ``none``: not modelled, the coordinator's own ceiling.

It prints, per shape, simulated against live: verified tiles per second, the event loop's and
the verifier's CPU per tile, MB down and up per tile, and each ratio (goal: within 15%). Which
rows are fits: the loop's constants were fitted from bench_tax-2026-11-28-send-threads.json (so its row is
a fit against that run), tiles/s with ``--clients fit``; predictions: tiles/s with ``--clients
predict``, the verifier's CPU (40 GFLOP/s from bench_verify.py, the profile's overhead), MB
down and up (the simulator's block accounting).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_tax import SHAPES, FixedGrid, Shape, send_threads_of
from rich.console import Console
from rich.table import Table

from cleave.coordinator.engine.scheduler import FaultPolicy
from cleave.coordinator.planning.costmodel import DeviceClass, Profile, PSProfile
from cleave.coordinator.planning.tiles import GemmKind
from cleave.coordinator.whatif.presets import model_shape
from cleave.coordinator.whatif.simulator import GemmCall, Operand, SimConfig, Simulation

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.15


def chains(shape: Shape, gemms: int, each: int) -> list[list[tuple[GemmCall, ...]]]:
    """bench_tax's pump: ``gemms`` chains of ``each`` GEMMs of the shape, every one on operands
    of its own, laid out as ``Shape.operands`` lays them."""
    m, n, k = shape.gemm
    out = []
    for chain in range(gemms):
        ops = []
        for i in range(each):
            tag = ("bench", chain, i)
            if shape.kind is GemmKind.FORWARD:  # X (m x k) @ W^T, W stored n x k
                a, b = Operand(("X", *tag), False, k), Operand(("W", *tag), True, k)
            elif shape.kind is GemmKind.GRAD_WEIGHT:  # dY^T (dY stored k x m) @ X (k x n)
                a, b = Operand(("dY", *tag), True, m), Operand(("X", *tag), False, n)
            else:  # dY (m x k) @ W (k x n)
                a, b = Operand(("dY", *tag), False, k), Operand(("W", *tag), False, n)
            ops.append((GemmCall(m, n, k, shape.kind, a, b, f"{shape.name}.{i}"),))
        out.append(ops)
    return out


def clients_cpu(live: dict[str, Any], check: str) -> dict[str, dict[str, float]]:
    """Per shape, the live clients' process CPU per tile (s) and per MB sent down (s/MB):
    ``clients_cores / tiles_per_s``, the process's CPU seconds over the tiles it returned."""
    out = {}
    for s in live["shapes"]:
        run = s["runs"].get(check)
        if run and "error" not in run and run.get("tiles_per_s") and run.get("clients_cores"):
            per_tile = run["clients_cores"] / run["tiles_per_s"]
            out[s["shape"]] = {"per_tile": per_tile, "per_mb": per_tile / run["mb_down_per_tile"]}
    return out


def host_seconds(name: str, cpu: dict[str, dict[str, float]], mode: str, mb_down: float) -> float:
    """``SimConfig.host_cpu`` for shape ``name``: its own live figure (``fit``), the other
    shapes' mean CPU per MB down times its ``mb_down`` (``predict``), or 0 (``none``)."""
    if mode == "none" or name not in cpu:
        return 0.0
    if mode == "fit":
        return cpu[name]["per_tile"]
    others = [v["per_mb"] for k, v in cpu.items() if k != name]
    return mb_down * sum(others) / len(others) if others else cpu[name]["per_tile"]


def simulate(shape: Shape, args: argparse.Namespace, host_cpu: float = 0.0) -> dict[str, Any]:
    """The simulated figures for one shape on bench_tax's configuration, each unit also taking
    ``host_cpu`` seconds of the devices' one shared process."""
    link = args.link_gbps * 1e9 / 8
    device = Profile(
        {"fp32": args.device_gflops}, memory=args.memory_mb << 20, down=link, up=link, rtt=1e-4, overhead=0.0
    )
    ps = PSProfile(
        egress=link,
        ingress=link,
        gflops={"fp32": 90.0},
        verify_flops=args.verify_gflops * 1e9,
        memory_bw=10e9,
        workers=args.workers,
    )
    cfg = SimConfig(
        model=model_shape("tiny"),  # unused: the program is bench_tax's GEMMs
        fleet=(DeviceClass("replay", args.devices, device),),
        ps=ps,
        dtype="fp32",
        churn=False,
        slots=args.slots,
        faults=FaultPolicy(),
        band_checks=args.check.startswith("band"),
        host_cpu=host_cpu,
    )
    sim = Simulation(cfg)
    planner = FixedGrid(shape.grid)
    warm = sim.run_ops(chains(shape, args.gemms, args.warmup_gemms), planner)  # every device seated, blocks cold
    st = sim.run_ops(chains(shape, args.gemms, args.measure_gemms), planner)
    tiles = st.checked
    rows, cols, slabs = shape.grid
    return {
        "tiles": tiles,
        "seconds": st.seconds,
        "tiles_per_s": tiles / st.seconds,
        "loop_ms_per_tile": 1e3 * st.loop_s / tiles,
        "verify_ms_per_tile": 1e3 * st.ps_cpu["verify"] / tiles,
        "trainer_ms_per_tile": 1e3 * (sum(st.ps_cpu.values()) - st.ps_cpu["verify"]) / tiles,
        "mb_down_per_tile": st.egress_bytes / tiles / 1e6,
        "mb_up_per_tile": st.ingress_bytes / tiles / 1e6,
        "bands": st.bands,
        "alone": st.alone,
        "tiles_per_gemm": rows * cols * slabs,
        "busy_share": st.ps_shares,
        "busiest": st.busiest,
        "warmup_s": warm.seconds,
        "host_ms_per_tile": 1e3 * host_cpu,
    }


RATIOS = (
    ("tiles_per_s", "verified tiles per second"),
    ("loop_ms_per_tile", "event loop CPU per tile (ms)"),
    ("verify_ms_per_tile", "verifier CPU per tile (ms)"),
    ("mb_down_per_tile", "MB down per tile"),
    ("mb_up_per_tile", "MB up per tile"),
)


def compare(live: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    cpu = clients_cpu(live, args.check)
    for s in live["shapes"]:
        run = s["runs"].get(args.check)
        if not run or "error" in run:
            continue
        shape = SHAPES[s["shape"]]
        sim = simulate(shape, args, host_seconds(s["shape"], cpu, args.clients, run["mb_down_per_tile"]))
        ratio = {key: sim[key] / run[key] if run.get(key) else None for key, _ in RATIOS}
        row = {"shape": s["shape"], "tile": s["tile"], "sim": sim, "live": run, "sim_over_live": ratio}
        if s["shape"] in cpu:
            row["live_clients_ms_per_tile"] = 1e3 * cpu[s["shape"]]["per_tile"]
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], args: argparse.Namespace, source: str) -> None:
    table = Table(
        title=f"Simulated against live, bench_tax's configuration ({args.check} checks, {args.devices} devices of "
        f"{args.slots} slots, {args.gemms} GEMMs in flight); live: {source}",
        title_justify="left",
    )
    for name in ("shape", "figure", "simulated", "live", "sim / live"):
        table.add_column(name, justify="left" if name in ("shape", "figure") else "right")
    for row in rows:
        first = True
        for key, label in RATIOS:
            r = row["sim_over_live"][key]
            mark = "" if r is None else ("" if abs(r - 1) <= GOAL else " [red]*[/]")
            table.add_row(
                row["shape"] if first else "",
                label,
                f"{row['sim'][key]:.2f}",
                f"{row['live'][key]:.2f}",
                "-" if r is None else f"{r:.2f}{mark}",
            )
            first = False
        shares = ", ".join(f"{k} {v:.0%}" for k, v in row["sim"]["busy_share"].items())
        table.add_row("", "simulated busy shares", shares, "", "")
        live_host = row.get("live_clients_ms_per_tile")
        table.add_row(
            "",
            "clients' process CPU per tile (ms)",
            f"{row['sim']['host_ms_per_tile']:.2f}",
            "-" if live_host is None else f"{live_host:.2f}",
            "",
        )
        live_cores = f"coordinator {row['live']['coordinator_cores']:.2f}, clients {row['live']['clients_cores']:.2f}"
        table.add_row("", "live cores busy", "", live_cores, "")
        table.add_section()
    Console(highlight=False).print(table)
    clients = {
        "none": "the clients' shared process is not modelled: the simulated rate is the coordinator's ceiling",
        "fit": "the clients' shared process takes each shape's own live CPU per tile: tiles/s is a fit",
        "predict": "the clients' shared process takes the other shapes' live CPU per MB down: tiles/s is a prediction",
    }[args.clients]
    Console(highlight=False).print(
        f"* outside {GOAL:.0%}. {clients}. The loop's constants were fitted from "
        "bench_tax-2026-11-28-send-threads.json (band+1s; bench/calibrate_loop.py): against that run "
        "its row checks the fit, not the constants.",
        style="dim",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("tax_json", nargs="?", type=Path, help="a bench_tax.py --json output (else --live)")
    p.add_argument("--live", action="store_true", help="run bench_tax.py first (about a minute a shape)")
    p.add_argument("--shapes", default="qkv-fwd,q-dw,gate-dx", help="with --live: bench_tax's --shapes")
    p.add_argument("--seconds", type=float, default=10.0, help="with --live: bench_tax's --seconds")
    p.add_argument(
        "--check",
        default="band+1s",
        help="the live run's mode: band, tile, band+1s... (default: band+1s, the default coordinator)",
    )
    p.add_argument("--devices", type=int, default=6)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--gemms", type=int, default=2, help="GEMMs in flight (bench_tax's --gemms)")
    p.add_argument("--warmup-gemms", type=int, default=2, help="GEMMs per chain before measuring")
    p.add_argument("--measure-gemms", type=int, default=8, help="GEMMs per chain measured")
    p.add_argument("--workers", type=int, default=1, help="the PS's loops and verifiers")
    p.add_argument(
        "--clients",
        choices=("predict", "fit", "none"),
        default="predict",
        help="the clients' shared process: the other shapes' CPU per MB (predict), the shape's own (fit), or none",
    )
    p.add_argument("--device-gflops", type=float, default=1e6)
    p.add_argument("--link-gbps", type=float, default=80.0)
    p.add_argument("--verify-gflops", type=float, default=40.0)
    p.add_argument("--memory-mb", type=int, default=1024, help="each device's block cache (bench_tax's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.live:
        check = args.check.partition("+")[0]
        cmd = [sys.executable, str(ROOT / "bench" / "bench_tax.py"), "--shapes", args.shapes, "--check", check]
        cmd += ["--send-threads", str(send_threads_of(args.check))]
        cmd += ["--seconds", str(args.seconds), "--json", "--quiet"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
        live, source = json.loads(done.stdout), "bench_tax.py run now"
    elif args.tax_json is not None:
        live, source = json.loads(args.tax_json.read_text()), str(args.tax_json)
    else:
        p.error("give a bench_tax --json file, or --live")
    rows = compare(live, args)
    if args.json:
        out = {"check": args.check, "clients": args.clients, "live_source": source, "shapes": rows}
        print(json.dumps(out, indent=2, default=str))
    else:
        render(rows, args, source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
