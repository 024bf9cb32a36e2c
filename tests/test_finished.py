"""A finished job stays visible for --linger seconds (the page, /api/status, /metrics, cleave
status), and `cleave status` handles every way its connection ends: the job's summary and exit 0
when the job finished, one line and exit 1 when the coordinator died. Real processes, a real
terminal (tmux)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import urllib.request
from pathlib import Path

import pytest
from conftest import TIMEOUT
from procs import OPERATOR, Coordinator, Terminal, cleave_cmd, join, run_all, wait_until

pytestmark = [pytest.mark.drill, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


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
    late = join(coord.url, "late")  # a device that joins a finished job is told so, and leaves
    assert late.wait() == 0, late.output

    coord.proc.send_signal(signal.SIGINT)  # Ctrl-C ends the linger, not the job
    assert coord.wait(TIMEOUT) == 0, coord.output
    assert coord.query("SELECT state FROM jobs") == [("finished",)]


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
