"""Rendering builds rich objects; rendered into a string console they say the right things."""

from __future__ import annotations

import io

from rich.console import Console

from cleave.cli import render
from cleave.client.runner import WorkerStats
from cleave.coordinator.job import Listening
from cleave.db.store import IdentityRow


def _text(renderable: object, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


STATUS = {
    "job": {
        "name": "tiny, 20 steps",
        "step": 5,
        "steps": 20,
        "loss": 4.25,
        "state": "training",
        "tokens_per_s": 2500.0,
    },
    "devices": [
        {
            "name": "laptop",
            "state": "working",
            "device": "cpu",
            "gflops": 42.0,
            "tiles_done": 120,
            "tiles_rejected": 0,
            "gflop_verified": 3.5,
            "reason": "",
            "tiles_lost": 2,
            "reliability": 0.9836,
        },
        {
            "name": "liar",
            "state": "banned",
            "device": "cpu",
            "gflops": 1.0,
            "tiles_done": 0,
            "tiles_rejected": 3,
            "gflop_verified": 0.0,
            "reason": "results failed verification",
        },
    ],
    "tiles": {
        "queued": 4,
        "leased": 2,
        "verified": 120,
        "rejected": 3,
        "requeued": 5,
        "expired": 1,
        "speculative": 7,
        "cancelled": 6,
        "lost": 2,
    },
    "queue_depth": 4,
    "traffic": {"mb_down": 12.5, "mb_up": 3.25},
}


def test_dashboard_shows_job_tiles_and_every_device() -> None:
    out = _text(render.dashboard(STATUS), width=140)
    assert "5/20  (25%)" in out and "4.2500" in out and "2,500 tokens/s" in out
    assert "120 verified, 2 leased, 4 queued, 3 rejected" in out
    assert "laptop" in out and "working" in out and "42.0" in out
    assert "liar" in out and "banned (results failed verification)" in out
    assert "12.5 MB down" in out
    assert "5 re-queued, 1 expired, 7 speculative, 6 cancelled, 2 lost" in out
    assert "98.4%" in out
    assert "to devices" not in out  # not counted yet: nothing claimed


def test_dashboard_shows_the_share_of_gemm_flops_sent_to_devices() -> None:
    status = {**STATUS, "job": {**STATUS["job"], "gemm_share": {"share": 0.9333, "left_on_ps": {"h.0.attn": 1.0}}}}
    assert "can take 93.3% of the model's matrix work" in _text(render.dashboard(status), width=140)


def test_dashboard_shows_time_left_why_tiles_were_lost_and_never_hides_a_failure() -> None:
    device = {**STATUS["devices"][0], "tiles_done": 20_000, "tiles_lost": 6, "reliability": 20_000 / 20_006}
    status = {
        **STATUS,
        "job": {**STATUS["job"], "elapsed_s": 125.0, "eta_s": 3_725.0},
        "lost_reasons": {"no heartbeat for 30.0 s": 4, "connection closed": 2},
        "devices": [{**device, "label": "laptop #3", "profile": {"down_mbps": 80.0, "up_mbps": None}}],
    }
    out = _text(render.dashboard(status), width=200)
    assert "2m 05s elapsed, about 1h 02m left" in out
    assert "no heartbeat for 30.0 s: 4, connection closed: 2" in out
    assert "laptop #3" in out and "99.9%" in out and "100.0%" not in out and "80/-" in out
    assert render.job_summary({**status, "job": {**status["job"], "state": "finished"}}).startswith("job finished: ")


def test_dashboard_before_any_device_joined() -> None:
    out = _text(render.dashboard({"job": {"steps": 3}, "tiles": {}, "devices": []}), width=140)
    assert "(no devices yet)" in out and "0/3" in out and "loss" in out


def test_step_lines() -> None:
    line = render.step_line(3, 20, 4.5, 0.125, STATUS)
    assert line.plain.startswith("step  3/20  loss 4.5000") and "2 devices" not in line.plain
    assert "1 device " in line.plain and "3 rejected" in line.plain
    local = render.step_line(3, 20, 4.5, 0.125, None, tokens_per_s=1000)
    assert "(local torch)" in local.plain and "1,000 tok/s" in local.plain
    assert not render.step_line(3, 20, 4.5, 0.1, STATUS, show_step=False).plain.startswith("step")


def test_client_line_and_listening_banner() -> None:
    stats = WorkerStats(state="working", device="cpu", tiles=7, flops=2e9, compute_seconds=0.5, bytes_down=3_000_000)
    line = render.client_line(stats, "ws://h:1").plain
    assert "working" in line and "tiles 7" in line and "4.0 GFLOP/s" in line and "3.0 MB in" in line
    banner = render.listening(
        Listening("ws://0.0.0.0:8765", "ws://box:8765", "tok", "op", ("join",), exposed=True)
    ).plain
    assert (
        "listening on ws://0.0.0.0:8765" in banner and "CLEAVE_TOKEN=tok cleave join ws://box:8765 --insecure" in banner
    )
    assert "CLEAVE_OPERATOR_TOKEN=op cleave status --url ws://box:8765 --insecure" in banner
    assert "join token generated" in banner and "unencrypted" in banner and "--token " not in banner  # not on argv
    kept = render.listening(Listening("wss://h:1", "wss://h:1", None, None, tls=True)).plain
    assert "CLEAVE_TOKEN=<the join token>" in kept and "kept from the database" in kept and "--insecure" not in kept
    quoted = render.listening(Listening("ws://h:1", "ws://h:1", "a b$", "op", ())).plain
    assert "CLEAVE_TOKEN='a b$' cleave join ws://h:1" in quoted  # pasted into a shell as it is


def test_enrolled_devices_table() -> None:
    rows = [
        IdentityRow(2, "laptop", "banned", "results failed verification", 1.7e9, 1.7e9, 3, 2, 0, 1, 0.5),
        IdentityRow(1, "desk", "active", "", 1.7e9, 1.7e9, 100, 0, 0, 0, 12.25),
    ]
    out = _text(render.identities(rows), width=200)
    assert "banned" in out and "results failed verification" in out and "laptop" in out and "12.25" in out
    assert "50.0%" in out and "100.0%" in out
    assert "(no device has enrolled yet)" in _text(render.identities([]), width=200)


def test_comparison_says_match_or_mismatch() -> None:
    ok = _text(render.comparison([("final loss", 3.0, 3.0)], 1e-7, 1e-4))
    bad = _text(render.comparison([("final loss", 3.0, 3.1)], 0.03, 1e-4))
    assert "(match)" in ok and "MISMATCH" in bad


def test_peer_supplied_strings_are_shown_as_text_never_as_markup() -> None:
    evil = "[/bold][link=https://example.org]laptop[/link]"
    status = {
        **STATUS,
        "devices": [{**STATUS["devices"][0], "name": evil, "device": "[red]cpu"}],
        "leaderboard": [{"identity": 3, "name": evil, "label": f"{evil} #3", "gflop": 1.0, "tiles": 2}],
        "job": {**STATUS["job"], "name": "[/]"},
    }
    out = _text(render.dashboard(status), width=200)
    assert evil in out and "[red]cpu" in out and f"{evil} #3" in out and "[/]" in out
    rows = [IdentityRow(1, evil, "banned", "[/bold]", 1.7e9, 1.7e9)]
    assert evil in _text(render.identities(rows), width=250)
    panel = _text(render.client_panel(WorkerStats(state="working", job="[/bold]", device="[x]"), "ws://h:1"))
    assert "job: [/bold]" in panel


def test_dashboard_shows_the_plan_and_measured_links() -> None:
    status = {
        **STATUS,
        "plan": {
            "planner": "cost",
            "predicted_step_s": 1.25,
            "predicted_home_step_s": 3.5,
            "measured_step_s": 1.5,
            "partitions": {"output": 20, "local": 7},
        },
        "devices": [
            {**STATUS["devices"][0], "profile": {"down_mbps": 980.4, "up_mbps": 120.0, "measured_results": 12}}
        ],
    }
    out = _text(render.dashboard(status), width=220)
    assert (
        "cost planner: step 1.250 s predicted, 1.500 s measured, 3.500 s predicted on the coordinator alone  "
        "(last step's GEMMs, by how each was cut: " in out
    )
    assert "7 local, 20 output)" in out
    assert "980/120" in out and "(prior)" not in out


def test_energy_shows_in_the_dashboard_the_leaderboard_and_the_volunteers_panel() -> None:
    status = {
        **STATUS,
        "energy": {
            "joules": 7_200_000.0,
            "devices_j": 6_840_000.0,
            "coordinator_j": 360_000.0,
            "devices_sources": {"rapl": 5_000_000.0, "capped": 1_840_000.0},
            "coordinator_sources": {"estimate": 360_000.0},
            "j_per_gflop": 12.5,
            "gco2": 872.0,
            "grid_gco2_kwh": 436.0,
            "flagged": 3,
            "increment_j": 1_800_000.0,
        },
        "leaderboard": [{"label": "laptop #1", "gflop": 3.5, "tiles": 120, "joules": 1500.0, "gflop_per_j": 0.0023}],
    }
    text = _text(render.dashboard(status), width=240)  # the energy line in full
    assert "energy" in text and "2.00 kWh" in text and "capped 27%, rapl 73%" in text and "estimate 100%" in text
    assert (
        "12.500 J per verified GFLOP" in text
        and "872.0 g CO2 at 436 g/kWh" in text
        and "3 device claims capped" in text
        and "increment 1.80 MJ" in text
    )
    assert "1.5 kJ" in text and "GFLOP/J" in text
    assert render.energy_line({}) == "no energy reported yet"
    stats = WorkerStats(state="computing", device="cpu", credit_gflop=30.0, energy_j=600.0, energy_source="rapl")
    panel = _text(render.client_panel(stats, "ws://coordinator:8765"))
    assert "600 J while serving (rapl), 0.05 verified GFLOP per joule" in panel
    waiting = _text(render.client_panel(WorkerStats(state="computing", device="cpu"), "ws://c:8765"))
    assert "measured from the first report" in waiting
    assert "600 J (rapl)" in _text(render.client_line(stats, "ws://coordinator:8765"), width=200)


def test_the_terminal_leaderboard_ranks_by_gflop_per_joule_when_asked() -> None:
    rows = [
        {"label": "busy #1", "gflop": 90.0, "tiles": 9, "joules": 900.0, "gflop_per_j": 0.1},
        {"label": "frugal #2", "gflop": 10.0, "tiles": 1, "joules": 10.0, "gflop_per_j": 1.0},
    ]
    status = {**STATUS, "leaderboard": rows, "leaderboard_efficiency": rows[::-1]}
    by_work = _text(render.dashboard(status), width=160)
    by_joule = _text(render.dashboard(status, rank_by="efficiency"), width=160)
    assert "verified work by device" in by_work and by_work.index("busy #1") < by_work.index("frugal #2")
    assert "verified GFLOP per joule" in by_joule and by_joule.index("frugal #2") < by_joule.index("busy #1")


def test_the_held_out_loss_shows_once_evaluated_in_status_step_lines_and_the_summary() -> None:
    evaluated = {**STATUS, "job": {**STATUS["job"], "val_loss": 4.5, "val_step": 4}}
    out = _text(render.dashboard(evaluated), width=140)
    assert "held-out loss  4.5000  (evaluated after step 4)" in out
    assert "held-out" not in _text(render.dashboard(STATUS), width=140)  # none evaluated yet: no row
    diverged = {**STATUS, "job": {**STATUS["job"], "val_loss": None, "val_step": 4}}
    assert "held-out loss  -  (evaluated after step 4)" in _text(render.dashboard(diverged), width=140)
    line = render.step_line(4, 20, 4.25, 0.125, STATUS, val_loss=4.5).plain
    assert line.startswith("step  4/20  loss 4.2500  held-out 4.5000  ")
    assert "held-out" not in render.step_line(5, 20, 4.25, 0.125, STATUS).plain
    finished = {**evaluated, "job": {**evaluated["job"], "state": "finished"}}
    assert render.job_summary(finished).startswith(
        "job finished: 5/20 steps, final loss 4.2500, held-out 4.5000 (step 4);"
    )
    assert "held-out" not in render.job_summary({**STATUS, "job": {**STATUS["job"], "state": "finished"}})
