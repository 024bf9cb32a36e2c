"""A finished job stays visible for --linger seconds (the page, /api/status, /metrics, cleave
status), and `cleave status` handles every way its connection ends: the job's summary and exit 0
when the job finished, one line and exit 1 when the coordinator died. Real processes, a real
terminal (tmux)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import TIMEOUT
from procs import OPERATOR, Coordinator, Terminal, cleave_cmd, join, run_all, wait_until

pytestmark = [pytest.mark.drill, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]


PROMTOOL = shutil.which("promtool")  # Debian's prometheus package; .ci/run installs it


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _lint(scrape: bytes) -> None:
    """``promtool check metrics``: the exposition parses and follows Prometheus' naming rules."""
    if PROMTOOL is None:
        pytest.skip("needs promtool (.ci/run installs Debian's prometheus)")
    run = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape, capture_output=True, timeout=TIMEOUT)
    assert run.returncode == 0 and not run.stdout.strip() and not run.stderr.strip(), run.stdout + run.stderr


def _series(scrape: bytes) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in scrape.decode().splitlines()
        if line and not line.startswith("#")
    }


def _watch(url: str) -> Terminal:
    return Terminal(cleave_cmd("status", "--url", url, "--token", OPERATOR, "--interval", "0.5"), height=40)


def test_a_finished_job_stays_visible_until_its_linger_ends_and_ctrl_c_ends_it_cleanly(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "1", steps=4, linger=60)
    with _watch(coord.url) as watching:
        wait_until(lambda: "devices" in watching.screen(), TIMEOUT, "the live status")
        worker = join(coord.url, "worker")
        assert worker.wait() == 0, worker.output
        wait_until(lambda: "stay up for 60 s" in coord.output, TIMEOUT, "the linger to start")
        wait_until(lambda: watching.exit_code() is not None, TIMEOUT, "cleave status to end")
        shown = watching.screen(history=True)
        assert watching.exit_code() == 0, shown
        assert "Traceback" not in shown and "job finished: 4/4 steps, final loss" in shown

    # During the linger: the coordinator still answers, and says the job is finished.
    http = coord.url.replace("ws://", "http://")
    once, as_json = run_all(
        cleave_cmd("status", "--url", coord.url, "--token", OPERATOR, "--once"),
        cleave_cmd("status", "--url", coord.url, "--token", OPERATOR, "--json"),
    )
    assert once.returncode == 0 and "job finished: 4/4 steps" in once.stdout, once.stdout + once.stderr
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["job"]["state"] == "finished"
    status, body = _get(http + "/api/status")
    assert status == 200 and json.loads(body)["job"] == {**json.loads(body)["job"], "state": "finished", "step": 4}
    status, page = _get(http + "/")
    assert status == 200 and b"<html" in page.lower()
    status, metrics = _get(http + "/metrics")
    assert status == 200 and re.search(rb"^cleave_steps_total 4(\.0)?$", metrics, re.M), metrics[:2000]
    public = _series(metrics)
    assert public['cleave_job_state{state="finished"}'] == 1 and public['cleave_job_state{state="training"}'] == 0
    assert public["cleave_job_steps"] == 4 and public["cleave_devices_connected"] == 0
    assert any(k.startswith("cleave_build_info{") for k in public) and "_created" not in metrics.decode()
    states = {k: v for k, v in public.items() if k.startswith("cleave_devices{")}
    assert sum(states.values()) == 1, states  # one device, in one state: the states do not overlap
    assert not any(k.startswith("cleave_device_") for k in public)  # per device: the operator's only
    status, operator = _get(http + "/metrics", OPERATOR)
    mine = _series(operator)
    assert status == 200 and mine['cleave_device_tiles_total{device="worker #1",outcome="verified"}'] > 0
    assert mine['cleave_device_connected{device="worker #1"}'] == 0
    assert _get(http + "/metrics", "not-the-operator-token")[0] == 401
    late = join(coord.url, "late")  # a device that joins a finished job is told so, and leaves
    assert late.wait() == 0, late.output

    coord.proc.send_signal(signal.SIGINT)  # Ctrl-C ends the linger, not the job
    assert coord.wait(TIMEOUT) == 0, coord.output
    assert coord.query("SELECT state FROM jobs") == [("finished",)]
    _lint(metrics)  # last: without promtool, everything else above still ran
    _lint(operator)


def test_status_says_in_one_line_that_a_killed_coordinator_went_away(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "1", steps=100_000)  # waits for a device forever
    with _watch(coord.url) as watching:
        wait_until(lambda: "devices" in watching.screen(), TIMEOUT, "the live status")
        coord.proc.send_signal(signal.SIGKILL)
        coord.wait()
        wait_until(lambda: watching.exit_code() is not None, TIMEOUT, "cleave status to end")
        shown = watching.screen(history=True)
        assert watching.exit_code() == 1, shown
        assert "Traceback" not in shown
        (line,) = [row for row in shown.splitlines() if "coordinator" in row and "job was at" in row]
        assert "closed the connection" in line and "step 0/100,000" in line
    gone = run_all(cleave_cmd("status", "--url", coord.url, "--token", OPERATOR, "--json"))[0]
    assert gone.returncode == 1 and len(gone.stderr.strip().splitlines()) == 1 and "cannot reach" in gone.stderr
