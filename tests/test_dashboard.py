"""The web dashboard in a real headless browser (Debian's chromium; `.ci/run` installs it): the
page renders from the coordinator's own port, its numbers change as steps complete, and the
devices table shows only with the operator token. Also the API's answers to bad tokens."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from procs import OPERATOR, TOKEN, join

from coordinator.engine.live_plan import Planner
from coordinator.job import CoordinatorConfig, serve_job
from coordinator.net.dashboard import Curve, Dashboard
from coordinator.training.loop import StepResult, TrainConfig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STEPS = 40  # 15 s of training here: the browses end at 8 s (13 s beside a load of 6 on two cores)


class _Quiet:
    def listening(self, info: object) -> None: ...
    def note(self, text: str) -> None: ...
    def waiting(self, have: int, want: int) -> None: ...
    def step(self, result: StepResult, status: dict) -> None: ...
    def finished(self, results: list[StepResult], status: dict) -> None: ...


def _browse(url: str) -> str:
    """The page's DOM after its script has run for a few (virtual) seconds."""
    assert CHROMIUM is not None
    run = subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--virtual-time-budget=3000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def _text(dom: str, element: str) -> str:
    m = re.search(rf'id="{element}"[^>]*>(.*?)</', dom, re.S)
    assert m is not None, f"no #{element} in the page"
    return m.group(1).strip()


def _raw(http: str, request: bytes) -> bytes:
    import socket

    host, port = http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        return s.recv(65536)


def _get(url: str, token: str | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.mark.drill
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (.ci/run installs it)")
def test_the_dashboard_renders_live_numbers_and_hides_operator_data_without_the_token(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(
        train=TrainConfig(steps=STEPS),
        port=0,
        db=str(tmp_path / "d.db"),
        token=TOKEN,
        operator_token=OPERATOR,
        min_devices=2,
        planner=Planner.UNIFORM,
    )

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[str] = loop.create_future()
        job = asyncio.create_task(serve_job(cfg, _Quiet(), ready=ready.set_result))
        http = (await ready).replace("ws://", "http://")
        clients = [join(http.replace("http://", "ws://"), f"volunteer-{i}") for i in range(2)]
        seen: dict = {"steps": []}
        while not job.done() and ((await asyncio.to_thread(_get, http + "/api/status"))[2]["job"]["step"] or 0) < 1:
            await asyncio.sleep(0.2)  # each browse takes seconds: the first waits for training to begin
        operator = None
        try:
            while not job.done() and len(seen["steps"]) < 2:
                dom = await asyncio.to_thread(_browse, http + "/")
                step = _text(dom, "step")
                if step.split(" / ")[0] not in ("-", "0"):
                    seen["steps"].append(int(step.split(" / ")[0].replace(",", "")))
                    seen["public"] = dom
                    # The operator's page beside the second public one: both within the job's steps.
                    operator = operator or asyncio.ensure_future(
                        asyncio.to_thread(_browse, f"{http}/#token={OPERATOR}")
                    )
                await asyncio.sleep(0.5)
            assert len(seen["steps"]) == 2 and operator is not None, f"the job ended first: {seen['steps']}"
            seen["operator"] = await operator
        finally:
            if operator is not None and not operator.done():
                operator.cancel()
        seen["api"] = await asyncio.to_thread(_get, http + "/api/status")
        seen["wrong"] = await asyncio.to_thread(_get, http + "/api/status", "not-the-operator-token")
        seen["joiner"] = await asyncio.to_thread(_get, http + "/api/status", TOKEN)  # a volunteer's token
        seen["doubled"] = await asyncio.to_thread(
            _raw,
            http,
            b"GET /api/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n",
        )
        await job
        seen["codes"] = [c.wait() for c in clients]
        return seen

    seen = asyncio.run(run())
    assert seen["codes"] == [0, 0]
    first, second = seen["steps"]
    assert second > first > 0  # the numbers change as steps complete
    public = seen["public"]
    assert _text(public, "job-state") == "training" and _text(public, "loss") not in ("", "-")
    assert "<polyline" in public  # the loss curve
    assert "volunteer-0" in public  # the leaderboard is public
    assert re.search(r'id="devices" hidden', public) and "devices-locked" in public
    operator = seen["operator"]
    assert not re.search(r'id="devices" hidden', operator)
    devices = re.search(r'id="devices".*?</table>', operator, re.S).group(0)  # type: ignore[union-attr]
    assert "volunteer-0" in devices and "volunteer-1" in devices
    status, headers, body = seen["api"]
    assert status == 200 and "devices" not in body and body["job"]["steps"] == STEPS
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    for status, headers, body in (seen["wrong"], seen["joiner"]):
        assert status == 401 and "devices" not in body and headers["WWW-Authenticate"].startswith("Bearer")
    assert seen["doubled"].startswith(b"HTTP/1.1 401")  # refused, not an internal error


def test_names_from_volunteers_are_never_html_and_the_curve_stays_bounded() -> None:
    js = (Path(__file__).resolve().parents[1] / "coordinator" / "net" / "web" / "dashboard.js").read_text()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js
    curve = Curve(limit=100)
    for step in range(1, 10_001):
        curve.add(step, 1.0 / step)
    assert len(curve.points) < 100 and curve.points[0][0] == 1 and curve.points[-1][0] > 9_000


def test_each_view_is_built_at_most_once_a_second() -> None:
    builds = []
    now = [0.0]
    board = Dashboard(lambda: builds.append(1) or {}, lambda t: t == "op", clock=lambda: now[0])
    for _ in range(100):
        assert board.respond("/api/status", None)[0] == 200
        assert board.respond("/api/status", "Bearer wrong")[0] == 401
    assert board.respond("/api/status", "Bearer op")[0] == 200
    assert len(builds) == 2  # public and operator, once each
    now[0] += 1.0
    board.respond("/api/status", None)
    assert len(builds) == 3
