"""``cleave plan``: one step's plan over a fleet, as a table or one JSON object, and the same
numbers as the planner gives for the same inputs."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cleave.cli import render
from cleave.cli.app import app
from cleave.coordinator.planning.planner import Gemm, baseline, plan_step
from cleave.coordinator.planning.tier import Tier
from cleave.coordinator.whatif.experiments import default_ps
from cleave.coordinator.whatif.presets import model_shape, resolve_fleet, step_gemms

RUNNER = CliRunner(env={"COLUMNS": "200"})  # rich's width off a terminal; tables are cut at 80

FLEET_TOML = """
[[class]]
name = "gpu"
count = 12
gflops = 20000
memory_gb = 8
down_mbps = 500
up_mbps = 100
rtt_ms = 20

[[class]]
name = "laptop"
count = 40
gflops = 300
memory_gb = 4
down_mbps = 100
up_mbps = 20
rtt_ms = 30
session_hours = 3
"""


def _no_constant(name: str) -> None:
    raise AssertionError(f"JSON holds {name}")


def _run(*args: str) -> Any:
    return RUNNER.invoke(app, ["plan", *args])


def _plan_json(*args: str) -> dict[str, Any]:
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, "one JSON object on one line"
    return json.loads(lines[0], parse_constant=_no_constant)  # NaN and Infinity are refused


def test_json_agrees_with_plan_step_and_the_round_robin_baseline() -> None:
    # Prepare: the documented inputs, recomputed here from the documented formulas.
    model, fleet_name, devices, batch, seq, dtype = "opt-1.3b", "desktop-gpus", 50, 8, 256, "bf16"
    shape = model_shape(model)
    fleet = resolve_fleet(fleet_name, dtype, devices)
    ps = default_ps(10.0)
    other = 3 * shape.attention_flops(batch, seq) / ps.flops_per_s(dtype) + shape.params * (28 + 2) / ps.memory_bw
    gemms = [
        (Gemm(g.m, g.n, g.k, dtype, g.kind, f"{g.layer}.{g.kind}"), g.count) for g in step_gemms(shape, batch, seq)
    ]
    expected = plan_step(gemms, fleet, ps, ps_other_seconds=other)
    base = sum(baseline(g, fleet, ps).seconds * c for g, c in gemms) + other  # type: ignore[union-attr]

    # Execute
    report = _plan_json("--model", model, "--fleet", fleet_name, "--devices", str(devices), "--dtype", dtype)

    # Assert
    step = report["step"]
    assert step["seconds"] == pytest.approx(expected.seconds, rel=1e-9)
    assert step["gemm_seconds"] == pytest.approx(expected.gemm_seconds, rel=1e-9)
    assert step["ps_other_seconds"] == pytest.approx(other, rel=1e-9)
    assert step["utilisation"] == pytest.approx(expected.utilisation, rel=1e-9)
    for key, attr in [
        ("egress_bytes", "egress_bytes"),
        ("ingress_bytes", "ingress_bytes"),
        ("egress_floor_bytes", "egress_floor"),
        ("compute_seconds", "compute_seconds"),
        ("down_seconds", "down_seconds"),
        ("up_seconds", "up_seconds"),
        ("ps_seconds", "ps_seconds"),
    ]:
        assert step[key] == pytest.approx(expected.total(attr), rel=1e-9), key
    assert sum(step["seconds_by_bound"].values()) == pytest.approx(step["gemm_seconds"], rel=1e-9)
    assert step["baseline_seconds"] == pytest.approx(base, rel=1e-9)
    assert step["speedup"] == pytest.approx(base / expected.seconds, rel=1e-9)
    assert len(report["gemms"]) == len(expected.plans)
    for row, (plan, count) in zip(report["gemms"], expected.plans):
        assert f"{row['layer']}.{row['kind']}" == plan.gemm.label and row["count"] == count
        assert (row["m"], row["n"], row["k"]) == (plan.gemm.m, plan.gemm.n, plan.gemm.k)
        assert row["partition"] == plan.kind.value and tuple(row["grid"]) == plan.grid
        assert row["devices"] == plan.devices == sum(s["devices"] for s in row["shares"])
        assert row["seconds"] == pytest.approx(plan.seconds, rel=1e-9) and row["bound"] == plan.bound
        assert row["egress_bytes"] >= row["egress_floor_bytes"] * (1 - 1e-9), "no partition beats its floor"
    used = {
        name: max((s["devices"] for g in report["gemms"] for s in g["shares"] if s["class"] == name), default=0)
        for name in (c.name for c in fleet)
    }
    assert {c["name"]: c["used"] for c in report["classes"]} == used
    assert {c["name"]: c["count"] for c in report["fleet"]["classes"]} == {c.name: c.count for c in fleet}
    assert (report["batch_size"], report["seq_len"], report["dtype"], report["model"]["name"]) == (
        batch,
        seq,
        dtype,
        model,
    )
    assert report["ps"]["gflops"] == ps.gflops[dtype] and report["ps"]["egress"] == ps.egress


@pytest.mark.parametrize(
    "args",
    [
        ("--model", "tiny", "--fleet", "laptops", "--devices", "2"),
        ("--model", "base", "--fleet", "mixed", "--devices", "300", "--batch-size", "32", "--seq-len", "512"),
        ("--model", "opt-1.3b", "--fleet", "phones", "--devices", "200", "--ps-link-gbps", "1"),
    ],
)
def test_the_plan_is_never_slower_than_round_robin(args: tuple[str, ...]) -> None:
    step = _plan_json(*args)["step"]
    assert step["speedup"] >= 1 - 1e-9
    assert 0 <= step["fleet_utilisation"] <= step["utilisation"] <= 1


def test_a_toml_fleet_file_is_planned(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET_TOML)
    # A long bf16 batch: some GEMMs are big enough to be worth sending out of a 1 TFLOP/s PS.
    report = _plan_json(
        "--model", "opt-1.3b", "--fleet", str(path), "--dtype", "bf16", "--batch-size", "32", "--seq-len", "1024"
    )
    assert report["fleet"]["spec"] == str(path) and report["fleet"]["devices"] == 52
    assert [(c["name"], c["count"], c["gflops"]) for c in report["fleet"]["classes"]] == [
        ("gpu", 12, 20000),
        ("laptop", 40, 300),
    ]
    assert report["step"]["devices"] > 0, "some GEMM of this step is worth sending out"
    assert all(s["memory_bytes"] <= 8 * 2**30 for g in report["gemms"] for s in g["shares"])


def test_a_round_robin_that_cannot_run_is_null_not_infinity(tmp_path: Path) -> None:
    # 1 MiB per device holds no tile of the fixed grid: round-robin never finishes, the plan
    # keeps everything on the parameter server.
    path = tmp_path / "fleet.toml"
    path.write_text(
        FLEET_TOML.replace("memory_gb = 8", "memory_gb = 0.001").replace("memory_gb = 4", "memory_gb = 0.001")
    )
    report = _plan_json("--model", "small", "--fleet", str(path))
    assert report["step"]["baseline_seconds"] is None and report["step"]["speedup"] is None
    assert {g["partition"] for g in report["gemms"]} == {"local"}
    assert math.isfinite(report["step"]["seconds"])
    assert "never" in _text(report)


@pytest.mark.parametrize(
    "args, message",
    [
        (("--model", "gpt-5"), "unknown model preset 'gpt-5'"),
        (("--fleet", "datacenter"), "unknown fleet 'datacenter'"),
        (("--devices", "0"), "--devices must be between 1 and"),
        (("--model", "small", "--seq-len", "4096"), "--seq-len 4096 exceeds small's 1024 positions"),
        (("--dtype", "bogus"), "unknown --dtype 'bogus'"),
        (("--batch-size", "0"), "--batch-size must be between 1 and"),
        (("--ps-link-gbps", "0"), "--ps-link-gbps must be above 0"),
        (("--coordinators", "0"), "--coordinators must be between 1 and 1024"),
        (("--coordinators", "3"), "--batch-size 8 does not cut into 3 equal slices"),
        (("--tier-link-gbps", "-1", "--coordinators", "2"), "--tier-link-gbps must be above 0"),
        (("--coordinator", "tpu"), "unknown coordinator 'tpu'; use one of server, h100"),
        (("--ps-gflops", "0"), "--ps-gflops must be above 0"),
        (("--ps-workers", "0"), "--ps-workers must be between 1 and"),
        (("--coordinators", "8", "--devices", "7"), "8 coordinators leave the slowest of them no devices"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    result = _run(*args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_a_malformed_fleet_file_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text("[[class]\nname = 'x'\n")
    result = _run("--fleet", str(path))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: not valid TOML")


def _text(report: dict[str, Any], width: int = 160) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(render.plan_report(report))
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_the_table_names_each_gemm_its_partition_and_the_speedup() -> None:
    report = _plan_json("--model", "opt-1.3b", "--fleet", "desktop-gpus", "--devices", "100", "--dtype", "bf16")
    out = _text(report)
    partitions = {g["partition"] for g in report["gemms"]}
    assert len(partitions) >= 2, "this step mixes partitions"
    for name in partitions:
        assert f" {name} " in out
    for g in report["gemms"]:
        assert f"{g['layer']}.{g['kind']}" in out
    for c in report["fleet"]["classes"]:
        assert c["name"] in out
    assert f"{report['step']['speedup']:,.3g}x faster" in out
    assert "round-robin" in out and "egress" in out and "utilisation" in out


def test_without_json_the_command_prints_the_table() -> None:
    result = _run("--model", "tiny", "--fleet", "laptops", "--devices", "2")
    assert result.exit_code == 0, result.stderr
    assert "cleave plan" in result.stdout and "local" in result.stdout and "laptop-low" in result.stdout


def test_a_tier_plans_its_slowest_coordinators_slice_with_the_collectives_priced() -> None:
    """--coordinators 4: the step is one coordinator's quarter of the batch on its quarter of the
    fleet (each class dealt round-robin, the last getting the fewest), its AdamW on a quarter of
    the parameters, and the collectives' seconds from the tier's own formula."""
    args = ("--model", "opt-1.3b", "--fleet", "mixed", "--devices", "1003", "--batch-size", "16", "--ps-gflops", "50")
    one = _plan_json(*args)
    tier = _plan_json(*args, "--coordinators", "4", "--tier-link-gbps", "25")
    assert tier["coordinators"] == 4 and tier["batch_size"] == 16 and tier["tokens"] == one["tokens"]
    t = tier["tier"]
    assert t["batch_per_rank"] == 4 and t["link_gbps"] == 25
    assert t["devices_per_rank"] == sum(c["count"] // 4 for c in one["fleet"]["classes"]) < 1003 / 4
    params = one["model"]["params"]
    sizes = model_shape("opt-1.3b").parameter_sizes()
    want = Tier.from_gbps(4, 25).reduce_seconds(sizes, 10e9) + Tier.from_gbps(4, 25).gather_seconds(sizes)
    assert t["seconds"] == pytest.approx(want) and tier["step"]["tier_seconds"] == pytest.approx(want)
    # 3/4 of the float32 parameters each way, twice, on 25 Gbit/s: most of those seconds.
    assert want > 2 * 0.75 * 4 * params / (25e9 / 8)
    share = Tier.from_gbps(4, 25).optimizer_share(sizes) / params  # the busiest rank's, whole parameters
    assert 0.25 <= share < 0.26
    assert tier["step"]["optimizer_seconds"] == pytest.approx(one["step"]["optimizer_seconds"] * share, rel=1e-6)
    # A quarter of the batch on a quarter of the fleet: the slowest coordinator's attention is a quarter.
    assert tier["step"]["attention_seconds"] == pytest.approx(one["step"]["attention_seconds"] / 4)
    assert "4 coordinators on 25 Gbit/s" in _text(tier, width=220)
    assert one["coordinators"] == 1 and one["tier"]["seconds"] == 0


def test_the_h100_coordinator_preset_is_priced_as_documented() -> None:
    report = _plan_json("--coordinator", "h100", "--dtype", "bf16")
    ps = report["ps"]
    assert ps["preset"] == "h100" and ps["gflops"] == 600_000 and ps["verify_gflops"] == 20_000
    assert ps["memory_bw"] == 50e9
    server = _plan_json("--dtype", "bf16")["step"]
    assert report["step"]["optimizer_seconds"] < server["optimizer_seconds"] / 100  # HBM, not a socket
