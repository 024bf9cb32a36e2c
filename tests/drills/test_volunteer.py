"""A good volunteer client, end to end: it steps aside when the owner needs the machine, comes
back when allowed, reports what it measured, and shows it all on a terminal."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from conftest import TIMEOUT
from procs import (
    OPERATOR,
    TOKEN,
    Coordinator,
    Proc,
    Terminal,
    cleave_cmd,
    join,
    join_cmd,
    local_losses,
    run_all,
    wait_until,
)

from cleave.cli.status import fetch_status

pytestmark = pytest.mark.drill  # real processes train through real sockets (README: the parts of the suite)


def _device(url: str, name: str) -> dict:
    return next((d for d in fetch_status(url, OPERATOR)["devices"] if d["name"] == name), {})


def test_a_client_unplugged_mid_run_pauses_within_a_second_and_resumes(tmp_path: Path) -> None:
    probe = tmp_path / "probe.json"
    # Other programs' CPU is stated, not read: a loaded test machine would hold the resume back.
    probe.write_text(json.dumps({"on_ac": True, "battery_percent": 90, "other_cpu_percent": 0}))
    policy = tmp_path / "client.toml"
    policy.write_text("[policy]\nidle_minutes = 0\nmax_other_cpu = 100\nresume_after = 0.5\n")
    # The pause comes at about step 4 and the plug back at about step 7; the resumed work is credited
    # a second (the probe's read, resume_after) and a step's end later: 13 leaves it 4 steps or more.
    steps = 13
    coord = Coordinator(tmp_path, "--min-devices", "2", "--batch-size", "16", "--seq-len", "128", steps=steps)
    laptop = Proc(
        cleave_cmd(
            "join",
            coord.url,
            "--token",
            TOKEN,
            "--once",
            "--threads",
            "1",
            "--name",
            "laptop",
            "--device",
            "cpu",
            "--config",
            str(policy),
            "--probe-file",
            str(probe),
        ),
        "laptop",
    )
    desktop = join(coord.url, "desktop")
    coord.wait_for_step(3)
    wait_until(lambda: _device(coord.url, "laptop").get("tiles_done", 0) > 0, TIMEOUT, "laptop to work")

    unplugged = time.monotonic()
    probe.write_text(json.dumps({"on_ac": False, "battery_percent": 88, "other_cpu_percent": 0}))
    wait_until(lambda: _device(coord.url, "laptop").get("state") == "paused", TIMEOUT, "the pause")
    assert time.monotonic() - unplugged < 1.0
    row = _device(coord.url, "laptop")
    assert row["reason"] == "on battery" and row["inflight"] == 0  # its tiles went back at once
    step_at_pause = coord.steps_done()
    # Results it returned before the pause are credited once their row bands are checked, at the
    # latest when the step they belong to ends: count from the next step on.
    wait_until(lambda: coord.steps_done() >= step_at_pause + 1, 2 * TIMEOUT, "the step of the pause to end")
    done_while_paused = _device(coord.url, "laptop")["tiles_done"]
    wait_until(lambda: coord.steps_done() >= step_at_pause + 3, 2 * TIMEOUT, "the desktop to carry on alone")
    assert _device(coord.url, "laptop")["tiles_done"] == done_while_paused  # paused means no work

    probe.write_text(json.dumps({"on_ac": True, "battery_percent": 88, "other_cpu_percent": 0}))
    wait_until(lambda: _device(coord.url, "laptop").get("tiles_done", 0) > done_while_paused, TIMEOUT, "resume")
    assert coord.wait(2 * TIMEOUT) == 0, coord.output
    assert laptop.wait() == 0 and desktop.wait() == 0
    for got, want in zip(coord.losses(), local_losses(steps, batch_size=16, seq_len=128), strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    assert coord.query(
        "SELECT COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id "
        "WHERE d.name = 'laptop' AND l.outcome = 'lost'"
    ) == [(0,)]
    credit = [line for line in laptop.lines if line.startswith("left:")]
    assert credit and "GFLOP verified to your credit" in credit[0]
    claimed = float(credit[0].split("tiles computed, ")[1].split(" GFLOP")[0].replace(",", ""))
    verified = coord.query("SELECT gflop_verified FROM devices WHERE name = 'laptop'")[0][0]
    assert claimed > 0 and abs(claimed - verified) <= 0.01 * verified  # what the client shows is what was verified


def test_benchmark_json_has_stable_keys_and_plausible_numbers(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "1", steps=3)
    run, wrong = run_all(
        cleave_cmd("benchmark", "--json", "--seconds", "0.1", "--url", coord.url, "--token", OPERATOR),
        cleave_cmd("benchmark", "--seconds", "0.05", "--url", coord.url, "--token", "nope"),
        timeout=2 * TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert set(result) >= {"device", "threads", "torch", "machine", "memory_bytes", "gflops", "gemm", "link"}
    assert result["device"] == "cpu" and result["memory_bytes"] > 2**28 and 1 < result["gflops"] < 1e5
    dtypes = {(g["dtype"], g["size"]) for g in result["gemm"]}
    assert dtypes == {(d, s) for d in ("float32", "bfloat16", "float16") for s in (512, 1024)}
    link = result["link"]
    assert link["url"] == coord.url and 0 < link["rtt_ms"] < 1000 and link["down_mb_s"] > 1 and link["up_mb_s"] > 1
    assert wrong.returncode == 1 and len(wrong.stderr.strip().splitlines()) == 1
    finisher = join(coord.url, "finisher")
    assert coord.wait() == 0 and finisher.wait() == 0
    board = coord.query("SELECT name, gflop_verified FROM devices")
    assert board and board[0][1] > 0


def test_show_config_merges_file_and_flags_and_bad_files_get_one_line(tmp_path: Path) -> None:
    good = tmp_path / "client.toml"
    good.write_text('[policy]\nidle_minutes = 10\nhours = "22:00-07:00"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text("[policy]\nmax_other_cpu = 'lots'\n")
    run, defaults, refused = run_all(
        cleave_cmd("join", "--show-config", "--config", str(good), "--max-cpu", "25"),
        cleave_cmd("join", "--show-config"),
        cleave_cmd("join", "ws://127.0.0.1:1", "--token", "t", "--config", str(bad)),
    )
    assert run.returncode == 0, run.stderr
    assert "idle_minutes = 10.0" in run.stdout and 'hours = "22:00-07:00"' in run.stdout
    assert "max_other_cpu = 25.0" in run.stdout and str(good) in run.stdout
    assert "require_ac = true" in defaults.stdout and "idle_minutes = 3.0" in defaults.stdout
    assert refused.returncode == 2 and "max_other_cpu must be a float" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_the_live_panel_renders_and_updates_in_a_real_terminal(tmp_path: Path) -> None:
    # The panel shows work and its update within step 1 (the refresh is a fraction of a second, a
    # step of this size most of one): 4 steps leave it 3 more.
    coord = Coordinator(tmp_path, "--min-devices", "1", "--batch-size", "16", "--seq-len", "128", steps=4)
    with Terminal(join_cmd(coord.url, "tty-laptop")) as terminal:

        def tiles() -> int:
            for line in terminal.screen().splitlines():
                if "tiles" in line and "done" in line:
                    return int(line.split("tiles", 1)[1].split("done")[0].strip(" │").replace(",", ""))
            return -1

        wait_until(lambda: tiles() > 0, TIMEOUT, "the panel to show work")
        first = tiles()
        shown = terminal.screen()
        assert "cleave join" in shown and "state" in shown and "credit" in shown and "uptime" in shown
        wait_until(lambda: tiles() > first, TIMEOUT, "the panel to update")
        assert coord.wait(2 * TIMEOUT) == 0
