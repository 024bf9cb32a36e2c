"""``cleave simulate``: one JSON object (or tables) with Cleave's simulated step beside the DTFM-style
and cloud baselines, sweeps, a plot, and one-line errors."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cleave.cli import render
from cleave.cli.app import app
from cleave.coordinator.whatif.baselines import cloud_step, dtfm_step
from cleave.coordinator.whatif.presets import model_shape, resolve_fleet
from cleave.coordinator.whatif.simulator import MICRO_BATCH_SLACK

RUNNER = CliRunner()
FAST = ["--model", "small", "--fleet", "laptops", "--ps-gflops", "2", "--batch-size", "2", "--seq-len", "64"]


def simulate(*args: str) -> dict:
    result = RUNNER.invoke(app, ["simulate", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_holds_cleave_dtfm_and_cloud_step_times_and_the_breakdown() -> None:
    report = simulate(*FAST, "--devices", "24", "--seed", "3")
    assert report["cleave"]["step_s"] > 0 and report["cloud"]["step_s"] > 0
    assert "step_s" in report["dtfm"]
    c = report["cleave"]
    assert c["remote_gemms"] > 25 and c["units"] > 0  # a 2 GFLOP/s PS ships most GEMMs
    busy = {"compute", "downlink", "uplink", "ps_egress", "ps_ingress", "relay_egress", "ps_cpu", "ps_loop"}
    assert set(c["busy_s"]) == busy
    # The coordinator's own resources, each's share of the step, and which binds it.
    assert set(c["coordinator_share"]) == {"loop", "verifier", "trainer", "egress", "ingress"}
    assert c["coordinator_busiest"] == max(c["coordinator_busy_s"], key=c["coordinator_busy_s"].get)
    assert c["busy_s"]["relay_egress"] == 0 and c["bytes"]["relay_out"] == 0  # no relays
    assert c["bound"] in {*c["busy_s"], "latency"}
    assert c["bytes"]["ps_egress"] >= c["bytes"]["device_down_max"] > 0
    assert c["recovery_s"] is None or c["recovery_s"] > 0
    # The baselines are the pure functions' figures for the same model and fleet.
    fleet = resolve_fleet("laptops", "fp32", 24)
    model = model_shape("small")
    assert report["cloud"]["step_s"] == pytest.approx(cloud_step(model, 2, 64, "fp32").step_s)
    assert report["dtfm"]["step_s"] == pytest.approx(dtfm_step(model, fleet, 2, 64, "fp32").step_s)
    assert report["speedup"]["vs_cloud"] == pytest.approx(report["cloud"]["step_s"] / c["step_s"])
    # The same seed, the same answer.
    again = simulate(*FAST, "--devices", "24", "--seed", "3")
    assert again["cleave"]["steps_s"] == c["steps_s"]
    # --micro-batches auto (the default): the cost model's choice and what it weighed.
    assert report["micro_batches"] == "auto"
    forecasts = c["micro_batch_forecasts_s"]
    assert set(forecasts) == {"1", "2"} and str(c["micro_batches"]) in forecasts  # the divisors of batch 2
    assert forecasts[str(c["micro_batches"])] <= min(forecasts.values()) * (1 + MICRO_BATCH_SLACK)
    # The fleet's utilisation: the mean over the devices that joined, its spread, GEMMs in flight.
    assert 0 < c["fleet_utilisation"] <= c["utilisation_ceiling"] <= 1
    q = c["utilisation_quantiles"]
    assert 0 <= q["p10"] <= q["p50"] <= q["p90"] <= 1
    assert 1 <= c["gemms_in_flight"]["mean"] <= c["gemms_in_flight"]["max"]
    console = Console(file=io.StringIO(), width=200)
    console.print(render.simulate_report(report))
    text = console.file.getvalue()
    assert f"micro-batches: {c['micro_batches']}, the cost model's choice" in text
    assert "fleet: devices computed" in text and "GEMMs in flight" in text
    fixed = simulate(*FAST, "--devices", "24", "--seed", "3", "--micro-batches", "2")
    assert fixed["micro_batches"] == fixed["cleave"]["micro_batches"] == 2
    assert fixed["cleave"]["micro_batch_forecasts_s"] is None


def test_a_sweep_reports_every_count_and_the_table_renders(tmp_path: Path) -> None:
    report = simulate(*FAST, "--sweep", "4,16", "--no-churn")
    assert [r["devices"] for r in report["sweep"]] == [4, 16]
    assert len(report["cleave"]["step_s"]) == len(report["dtfm"]["step_s"]) == len(report["cloud"]["step_s"]) == 2
    console = Console(file=io.StringIO(), width=160)
    console.print(render.simulate_report(report))
    text = console.file.getvalue()
    assert "sweep" in text and "DTFM-style" in text and "PS egress" in text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.png"
    result = RUNNER.invoke(app, ["simulate", *FAST, "--sweep", "4,8", "--no-churn", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sweep", "4,x"], "--sweep takes device counts"),
        (["--devices", "0"], "--devices must be between"),
        (["--dtype", "fp8"], "unknown --dtype"),
        (["--model", "gpt-5"], "unknown model preset"),
        (["--fleet", "nowhere"], "unknown fleet"),
        (["--ps-link-gbps", "0"], "--ps-link-gbps must be above 0"),
        (["--seq-len", "100000"], "exceeds"),
        (["--micro-batches", "3"], "--micro-batches must divide"),
        (["--micro-batches", "some"], "--micro-batches must be a whole number or auto"),
        (["--ps-workers", "0"], "--ps-workers must be between 1 and"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = RUNNER.invoke(app, ["simulate", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_relays_carry_the_devices_bytes_and_bad_relay_options_are_usage_errors() -> None:
    args = [*FAST, "--devices", "16", "--no-churn", "--planner", "uniform", "--micro-batches", "1"]
    alone, relayed = simulate(*args), simulate(*args, "--relays", "2", "--relay-link-gbps", "40")
    a, r = alone["cleave"], relayed["cleave"]
    assert relayed["ps"]["relays"] == 2 and relayed["ps"]["relay_link_gbps"] == 40
    assert r["bytes"]["relay_out"] > 0 and r["busy_s"]["relay_egress"] > 0
    assert r["bytes"]["ps_egress"] < a["bytes"]["ps_egress"]
    for bad in (["--relays", "-1"], ["--relay-link-gbps", "0"], ["--relay-memory-gb", "nan"]):
        result = RUNNER.invoke(app, ["simulate", *FAST, *bad])
        assert result.exit_code == 2 and bad[0] in result.output, result.output


def test_ps_workers_share_the_loop_and_the_verifier() -> None:
    one = simulate(*FAST, "--devices", "8", "--no-churn")
    four = simulate(*FAST, "--devices", "8", "--no-churn", "--ps-workers", "4")
    assert one["ps"]["workers"] == 1 and four["ps"]["workers"] == 4
    busy = [r["cleave"]["coordinator_busy_s"]["loop"] for r in (one, four)]
    assert busy[0] > 0 and busy[1] < 0.5 * busy[0]  # each of 4 loops carries about a quarter
