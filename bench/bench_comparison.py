"""The comparison of docs/simulation.md: Cleave (simulated) against the DTFM-style and cloud
baselines over models, fleets, device counts, PS links and downlink/uplink ratios.

Every row is one ``cleave simulate`` report (coordinator/whatif/experiments.py ``simulate_one``: the
simulation with churn and one injected crash, its churn-free twin, and both baselines), printed
as a markdown table row. Then the "what closes the gap" rows: one configuration where Cleave
ships its GEMMs, re-run with each lever.

Run: ``.venv/bin/python bench/bench_comparison.py`` (``--counts``, ``--links``, ``--ratios`` for a smaller grid;
``--json``
for the raw reports; ``--energy`` for the energy table: each report's joules, kWh and grams of CO2e a
step for Cleave and both baselines). Simulated time does not depend on this machine's load; wall time does.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cleave.coordinator.engine.live_plan import Planner  # noqa: E402
from cleave.coordinator.planning.costmodel import ITEMSIZE  # noqa: E402
from cleave.coordinator.planning.tier import Tier  # noqa: E402
from cleave.coordinator.whatif.experiments import (  # noqa: E402
    Settings,
    Setup,
    adjust_fleet,
    coordinator_ps,
    default_ps,
    simulate_one,
    with_relays,
)
from cleave.coordinator.whatif.presets import resolve_fleet  # noqa: E402
from cleave.coordinator.whatif.report import run_report  # noqa: E402


def fmt(value: float | None) -> str:
    if value is None:
        return "does not fit"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def run(
    model: str,
    fleet: str,
    devices: int,
    gbps: float,
    ratio: float,
    *,
    batch: int,
    seq: int,
    ps_gflops: float | None = None,
    planner: Planner = Planner.COST,
    wire_half: bool = False,
) -> dict:
    ps = default_ps(gbps)
    if ps_gflops is not None:
        ps = dataclasses.replace(ps, gflops={d: ps_gflops for d in ITEMSIZE})
    dtype = "bf16" if wire_half else "fp32"
    classes = adjust_fleet(resolve_fleet(fleet, "fp32", devices), down_up_ratio=ratio, wire_half=wire_half, dtype=dtype)
    setup = Setup(model, fleet, devices, ps, gbps, batch=batch, seq=seq, dtype=dtype)
    settings = Settings(setup, seed=0, steps=1, planner=planner, churn=True, heartbeat_timeout=30.0)
    return run_report(simulate_one(classes, settings))


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


# The tier's comparison (issue 21): bf16, a 400 Gbit/s coordinator link, home links at the fleet's
# own ratios, churn and one crash, the cost model's micro-batches, coordinators on 100 Gbit/s.
TIER_COLUMNS = [
    "model",
    "devices",
    "batch",
    "coordinators",
    "Cleave s",
    "binds",
    "tier s",
    "parts",
    "GEMMs shipped",
    "fleet util.",
    "DTFM s",
    "cloud s",
    "vs DTFM",
    "vs cloud",
    "wall s",
]


def tier_run(
    model: str,
    devices: int,
    batch: int,
    seq: int,
    coordinator: str,
    ranks: int,
    args: argparse.Namespace,
    relays: int = 0,
) -> dict:
    ps = with_relays(coordinator_ps(coordinator, args.tier_ps_gbps), relays, args.relay_gbps, args.relay_gb)
    classes = resolve_fleet(args.tier_fleet, "bf16", devices)
    tier = Tier.from_gbps(ranks, args.tier_link_gbps)
    setup = Setup(model, args.tier_fleet, devices, ps, args.tier_ps_gbps, coordinator, tier, batch, seq, "bf16")
    settings = Settings(
        setup,
        seed=0,
        steps=1,
        planner=Planner.COST,
        churn=True,
        heartbeat_timeout=30.0,
        micro_batches=0,  # auto: the cost model's choice, as cleave runs it
        batched=True,
    )
    return run_report(simulate_one(classes, settings))


def tier_grid(args: argparse.Namespace) -> list[dict]:
    """One row per (model, devices, batch, coordinator x count), streamed as it completes."""
    print(row(TIER_COLUMNS))
    print(row(["---"] * len(TIER_COLUMNS)), flush=True)
    batches = [tuple(int(x) for x in b.split("x")) for b in args.tier_batches.split(",")]
    # COORDINATOR:COUNT[:rRELAYS], relays per coordinator
    setups = [
        (c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2][1:]) if c.count(":") == 2 else 0)
        for c in args.tier_setups.split(",")
    ]
    reports = []
    for model, devices, (batch, seq), (coordinator, ranks, relays) in itertools.product(
        args.tier_models.split(","), [int(c) for c in args.counts.split(",")], batches, setups
    ):
        if batch % ranks:  # a tier cuts the batch into equal slices: 8 sequences do not make 16
            continue
        r = tier_run(model, devices, batch, seq, coordinator, ranks, args, relays)
        reports.append(
            {"model": model, "devices": devices, "coordinator": coordinator, "ranks": ranks, "relays": relays, **r}
        )
        c, vs, vc = r["cleave"], r["speedup"]["vs_dtfm"], r["speedup"]["vs_cloud"]
        print(
            row(
                [
                    model,
                    f"{devices:,}",
                    f"{batch} x {seq}",
                    f"{ranks} {coordinator}" + (f" + {relays} relays" if relays else ""),
                    fmt(c["step_s"]),
                    c["bound"],
                    fmt(c["tier_s"]) if ranks > 1 else "-",
                    str(c["micro_batches"]),
                    f"{c['remote_gemms'] / max(1, c['remote_gemms'] + c['local_gemms']):.0%}",
                    f"{c['fleet_utilisation']:.1%}",
                    fmt(r["dtfm"]["step_s"]),
                    fmt(r["cloud"]["step_s"]),
                    "-" if vs is None else f"{vs:.3g}x",
                    "-" if vc is None else f"{vc:.3g}x",
                    f"{c['wall_s']:.0f}",
                ]
            ),
            flush=True,
        )
    return reports


# The energy table (issue 23): the comparison's rows, each system's joules, kWh and grams of CO2e a
# step (coordinator/whatif/energy.py; docs/simulation.md "Energy").
ENERGY_COLUMNS = [
    "model",
    "fleet",
    "devices",
    "PS Gbit/s",
    "system",
    "step s",
    "kJ/step",
    "devices busy kJ",
    "devices waiting kJ",
    "datacentre kJ",
    "J/GFLOP",
    "kWh/step",
    "gCO2e/step",
    "kWh/1,000 steps",
    "network kJ (apart)",
]


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _kj(value: float) -> str:
    return _num(value / 1e3)


def energy_rows(model: str, fleet: str, devices: int, gbps: float, r: dict) -> list[list[str]]:
    """Cleave, the DTFM-style pipeline and the cloud for one report: three table rows."""
    out = []
    for system, part in (("Cleave", r["cleave"]), ("DTFM-style", r["dtfm"]), ("8 x A100", r["cloud"])):
        e = part.get("energy")
        head = [model, fleet, f"{devices:,}", f"{gbps:g}", system]
        if e is None:
            out.append(head + ["does not fit"] + ["-"] * 9)
            continue
        out.append(
            head
            + [
                fmt(part["step_s"]),
                _kj(e["energy_j"]),
                _kj(e["devices_busy_j"]),
                _kj(e["devices_waiting_j"]),
                _kj(e["datacentre_j"]),
                _num(e["energy_j_per_gflop"]),
                _num(e["kwh"]),
                _num(e["co2_g"]),
                _num(e["kwh"] * 1000),
                _kj(e["network_j"]),
            ]
        )
    return out


def energy_grid(args: argparse.Namespace) -> list[dict]:
    """The energy table: the comparison's setting (batch 8 x 256 fp32, server PS, home links at
    the given ratio), models x fleets x counts x links, streamed row by row."""
    print(row(ENERGY_COLUMNS))
    print(row(["---"] * len(ENERGY_COLUMNS)), flush=True)
    reports = []
    for model, fleet, devices, gbps, ratio in itertools.product(
        args.energy_models.split(","),
        args.energy_fleets.split(","),
        [int(c) for c in args.counts.split(",")],
        [float(g) for g in args.links.split(",")],
        [float(x) for x in args.ratios.split(",")],
    ):
        r = run(model, fleet, devices, gbps, ratio, batch=args.batch_size, seq=args.seq_len)
        reports.append({"model": model, "fleet": fleet, "devices": devices, "gbps": gbps, "ratio": ratio, **r})
        for cells in energy_rows(model, fleet, devices, gbps, r):
            print(row(cells), flush=True)
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="16,256,1024,10000", help="device counts")
    parser.add_argument("--links", default="10,100,400", help="PS links, Gbit/s")
    parser.add_argument("--ratios", default="2,10", help="downlink / uplink ratios")
    parser.add_argument("--lever-devices", type=int, default=1024, help="fleet size of the 'what closes the gap' rows")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--no-levers", action="store_true", help="only the grid")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tier", action="store_true", help="the tier's comparison instead (issue 21)")
    parser.add_argument("--tier-models", default="llama2-7b", help="--tier: models")
    parser.add_argument("--tier-fleet", default="mixed", help="--tier: the fleet preset")
    parser.add_argument("--tier-batches", default="8x256,256x1024", help="--tier: batches, SEQUENCESxTOKENS")
    parser.add_argument(
        "--tier-setups",
        default="server:1,server:4,server:16,h100:1,h100:16",
        help="--tier: COORDINATOR:COUNT[:rRELAYS] (relays per coordinator)",
    )
    parser.add_argument("--tier-ps-gbps", type=float, default=400.0, help="--tier: each coordinator's link")
    parser.add_argument("--tier-link-gbps", type=float, default=100.0, help="--tier: the ranks' links")
    parser.add_argument("--relay-gbps", type=float, default=10.0, help="--tier: each relay's link (Gbit/s)")
    parser.add_argument("--relay-gb", type=float, default=16.0, help="--tier: each relay's block cache (GB)")
    parser.add_argument("--energy", action="store_true", help="the energy table instead (issue 23)")
    parser.add_argument("--energy-models", default="llama2-7b,opt-13b", help="--energy: models")
    parser.add_argument("--energy-fleets", default="mixed,laptops", help="--energy: fleet presets")
    args = parser.parse_args()
    if args.energy:
        reports = energy_grid(args)
        if args.json:
            Path("comparison-energy.json").write_text(json.dumps(reports))
        return 0
    if args.tier:
        reports = tier_grid(args)
        if args.json:
            Path("comparison-tier.json").write_text(json.dumps(reports))
        return 0
    counts = [int(c) for c in args.counts.split(",")]
    links = [float(g) for g in args.links.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    reports = []
    print(
        row(
            [
                "model",
                "fleet",
                "devices",
                "PS Gbit/s",
                "down/up",
                "Cleave s",
                "binds",
                "DTFM s",
                "cloud s",
                "Cleave vs DTFM",
                "recovery Cleave s",
                "recovery DTFM s",
            ]
        )
    )
    print(row(["---"] * 12))
    started = time.perf_counter()
    for model, fleet, devices, gbps, ratio in itertools.product(
        ("opt-13b", "llama2-7b"), ("phones", "laptops", "mixed"), counts, links, ratios
    ):
        r = run(model, fleet, devices, gbps, ratio, batch=args.batch_size, seq=args.seq_len)
        reports.append({"model": model, "fleet": fleet, "devices": devices, "gbps": gbps, "ratio": ratio, **r})
        c, d = r["cleave"], r["dtfm"]
        vs = r["speedup"]["vs_dtfm"]
        print(
            row(
                [
                    model,
                    fleet,
                    f"{devices:,}",
                    f"{gbps:g}",
                    f"{ratio:g}",
                    fmt(c["step_s"]),
                    c["bound"],
                    fmt(d["step_s"]),
                    fmt(r["cloud"]["step_s"]),
                    "-" if vs is None else f"{vs:.3g}x",
                    fmt(c["recovery_s"]) if c["recovery_s"] is not None else "none lost",
                    fmt(d["recovery_s"]) if d["step_s"] is not None else "-",
                ]
            ),
            flush=True,
        )
    print(f"\n({time.perf_counter() - started:.0f} s of wall time)\n", file=sys.stderr)
    if args.no_levers:
        return 0
    # What closes the gap: a coordinator that must ship (100 GFLOP/s of its own), one fleet.
    base = dict(
        model="llama2-7b",
        fleet="mixed",
        devices=args.lever_devices,
        gbps=10.0,
        ratio=10.0,
        batch=args.batch_size,
        seq=args.seq_len,
        ps_gflops=100.0,
    )
    levers = [
        ("round-robin tiles (--planner uniform)", dict(planner=Planner.UNIFORM)),
        ("cost model: output, split-K, 3D, reuse (default)", {}),
        ("... and a 100 Gbit/s PS link", dict(gbps=100.0)),
        ("... and a 400 Gbit/s PS link", dict(gbps=400.0)),
        ("... 400 Gbit/s and bf16 on the wire (--wire-half)", dict(gbps=400.0, wire_half=True)),
    ]
    print(
        row(
            [
                f"lever (llama2-7b, mixed, {args.lever_devices:,} devices, PS 100 GFLOP/s)",
                "Cleave s",
                "binds",
                "PS sent GB",
                "PS CPU s",
                "DTFM s",
            ]
        )
    )
    print(row(["---"] * 6))
    for name, change in levers:
        r = run(**{**base, **change})
        reports.append({"lever": name, **r})
        c = r["cleave"]
        print(
            row(
                [
                    name,
                    fmt(c["step_s"]),
                    c["bound"],
                    f"{c['bytes']['ps_egress'] / 1e9:.1f}",
                    fmt(c["busy_s"]["ps_cpu"]),
                    fmt(r["dtfm"]["step_s"]),
                ]
            ),
            flush=True,
        )
    if args.json:
        Path("comparison.json").write_text(json.dumps(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
