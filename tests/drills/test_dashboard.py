"""The web dashboard in a real headless browser (Debian's chromium; `.ci/run` installs it): the
page renders from the coordinator's own port, its numbers change as steps complete, and the
devices table shows only with the operator token. Also the API's answers to bad tokens."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT
from procs import OPERATOR, TOKEN, join
from websockets.sync.client import connect as ws_connect

from cleave.coordinator.config import CoordinatorConfig
from cleave.coordinator.engine.live_plan import Planner
from cleave.coordinator.job import serve_job
from cleave.coordinator.net.dashboard import Curve, Dashboard
from cleave.coordinator.training.loop import StepResult, TrainConfig

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
                shown = step.split(" / ")[0]
                # A page per step shown: under load a step can outlast a browse, and the same
                # step seen twice says nothing about the numbers moving.
                if shown not in ("-", "0") and int(shown.replace(",", "")) not in seen["steps"]:
                    seen["steps"].append(int(shown.replace(",", "")))
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
    js = (ROOT / "coordinator" / "net" / "web" / "dashboard.js").read_text()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js
    curve = Curve(limit=100)
    for step in range(1, 10_001):
        curve.add(step, 1.0 / step)
    assert len(curve.points) < 100 and curve.points[0][0] == 1 and curve.points[-1][0] > 9_000


def test_the_held_out_loss_flows_from_a_steps_row_to_the_store_the_status_and_its_own_curve(tmp_path: Path) -> None:
    """A step that evaluated the held-out split (``val_loss`` in its metrics row): the row keeps
    it in SQLite, the status document (``status --json``) and /metrics' books show the last one
    with its step, and the dashboard draws it as its own curve at those steps only."""
    import numpy as np

    from cleave.coordinator.engine import report
    from cleave.coordinator.engine.books import Books
    from cleave.coordinator.engine.core import Core
    from cleave.db.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / "v.db")
    core = Core(store, store.create_job("v", {}, 5, 0.0), rng=np.random.default_rng(0))
    board = Dashboard(lambda: report.status(core, 10.0), lambda token: False, clock=lambda: 0.0)
    core.start_training(0.0)
    rows = [(1, 5.5, {}), (2, 5.0, {"val_loss": 5.25}), (3, 4.75, {}), (4, 4.5, {"val_loss": 4.625}), (5, 4.4, {})]
    for step, loss, extra in rows:
        if step == 2:
            before = report.status(core, 1.0)["job"]
            assert before["val_loss"] is None and before["val_step"] is None  # none evaluated yet
        core.record_step(step, loss, 512, 0.1, extra, float(step))
        board.step(step, loss, extra.get("val_loss"))
    job = report.status(core, 10.0)["job"]
    assert (job["loss"], job["val_loss"], job["val_step"]) == (4.4, 4.625, 4)  # the last evaluation's
    assert report.books(core)["job"]["val_loss"] == 4.625
    assert [r.extra.get("val_loss") for r in Books(store, core.job_id).steps()] == [None, 5.25, None, 4.625, None]
    view = json.loads(board.respond("/api/status", None)[2])
    assert view["job"]["val_loss"] == 4.625 and view["job"]["val_step"] == 4
    assert view["losses"] == [[s, loss] for s, loss, _ in rows]
    assert view["val_losses"] == [[2, 5.25], [4, 4.625]]  # drawn only at the steps that have it
    board.step(6, 4.3, float("nan"))  # a diverged evaluation is not drawn
    assert board.val_curve.points == [(2, 5.25), (4, 4.625)]
    store.close()


def test_the_status_is_built_at_most_once_a_second_for_both_views() -> None:
    builds = []
    now = [0.0]
    board = Dashboard(lambda: builds.append(1) or {}, lambda t: t == "op", clock=lambda: now[0])
    for _ in range(100):
        assert board.respond("/api/status", None)[0] == 200
        assert board.respond("/api/status", "Bearer wrong")[0] == 401
    assert board.respond("/api/status", "Bearer op")[0] == 200
    assert len(builds) == 1  # one status document serves the public view and the operator's
    now[0] += 1.0
    board.respond("/api/status", None)
    board.respond("/api/status", "Bearer op")
    assert len(builds) == 2


class _Page:
    """A page in headless chromium, driven over the DevTools protocol (a websocket): it runs the
    page's own script in real time, and answers questions about its layout."""

    def __init__(self, url: str, width: int, height: int, profile: Path) -> None:
        assert CHROMIUM is not None
        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.exists() and active.read_text().strip()):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = int(active.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        (page,) = [t for t in targets if t["type"] == "page"]
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(ws_connect(page["webSocketDebuggerUrl"], max_size=64 << 20, proxy=None))
        self.calls = 0
        # The window has a minimum width; the viewport is set as a phone's (or a desktop's) exactly.
        self.call(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=width < 600
        )

    def call(self, method: str, **params: object) -> dict:
        self.calls += 1
        self.ws.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=30))
            if reply.get("id") == self.calls:
                assert "error" not in reply, reply
                return reply["result"]

    def js(self, expression: str) -> object:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str) -> None:
        deadline = time.monotonic() + 30
        while not self.js(expression):
            assert time.monotonic() < deadline, f"the page never showed {what}"
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        self._stack.close()
        self.proc.kill()
        self.proc.wait()


@pytest.mark.drill
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (.ci/run installs it)")
def test_a_finished_job_stays_on_the_page_and_the_page_fits_a_phone(tmp_path: Path) -> None:
    """The page of a finished job during the coordinator's linger, at desktop and phone widths.
    With CLEAVE_SCREENSHOTS=DIR the screenshots are written there (docs/ holds the last ones)."""
    cfg = CoordinatorConfig(
        train=TrainConfig(steps=6, eval_every=0),  # no held-out split: no held-out curve
        port=0,
        db=str(tmp_path / "f.db"),
        token=TOKEN,
        operator_token=OPERATOR,
        min_devices=2,
        planner=Planner.UNIFORM,
        linger=120,
    )
    shots = os.environ.get("CLEAVE_SCREENSHOTS")

    def look(http: str) -> dict:
        seen = {}
        for name, width in (("desktop", 1280), ("phone", 420)):
            page = _Page(f"{http}/#token={OPERATOR}", width, 1400, tmp_path / name)
            try:
                page.wait_for("document.getElementById('job-state')?.textContent === 'finished'", "the job finished")
                page.wait_for("document.getElementById('devices')?.hidden === false", "the devices table")
                seen[name] = page.js(
                    "({overflow: document.documentElement.scrollWidth - document.documentElement.clientWidth,"
                    " caption: document.getElementById('curve-range').textContent,"
                    " timing: document.getElementById('timing').textContent,"
                    " ticks: document.querySelectorAll('#curve text').length,"
                    " lines: document.querySelectorAll('#curve polyline').length,"
                    " held: document.querySelectorAll('#curve .held, #curve .held-point').length,"
                    " heldLegend: !document.getElementById('legend-held').hidden,"
                    " devices: [...document.querySelectorAll('#devices tbody tr')].map((r) => r.innerText),"
                    " box: document.querySelector('#devices').parentElement.clientWidth,"
                    " emptyShown: !document.getElementById('curve-empty').hidden})"
                )
                if shots:
                    page.screenshot(Path(shots) / f"dashboard-finished-{name}.png")
            finally:
                page.close()
        return seen

    async def run() -> tuple[dict, list[int]]:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[str] = loop.create_future()
        job = asyncio.create_task(serve_job(cfg, _Quiet(), ready=ready.set_result))
        url = await ready
        clients = [join(url, f"phone-{i}") for i in range(2)]
        codes = await asyncio.gather(*(asyncio.to_thread(c.wait) for c in clients))  # they leave at the end
        seen = await asyncio.to_thread(look, url.replace("ws://", "http://"))
        job.cancel()  # Ctrl-C during the linger: the job stays finished
        outcome = await job
        assert outcome.status["job"]["state"] == "finished"
        return seen, codes

    seen, codes = asyncio.run(run())
    assert codes == [0, 0]
    for name, page in seen.items():
        assert page["overflow"] <= 0, f"{name}: the page is {page['overflow']} px wider than the screen"
        assert page["lines"] == 2 and page["ticks"] >= 6 and not page["emptyShown"], page
        assert page["held"] == 0 and not page["heldLegend"], page  # no held-out split: no held-out curve
        assert re.match(r"steps 1 to 6: loss 5\.5\d\d at the first, \d\.\d{3} at the last", page["caption"]), page
        assert "elapsed" in page["timing"] and "left" not in page["timing"], page
        assert len(page["devices"]) == 2 and all("phone-" in row and " #" in row for row in page["devices"]), page
    assert seen["phone"]["box"] <= 420  # the devices table scrolls in its own box


TIER_STATUS = {
    "job": {"name": "tiered", "state": "training", "step": 5, "steps": 20, "loss": 3.2, "val_loss": 3.3, "val_step": 4},
    "tiles": {},
    "device_counts": {"connected": 3},
    "leaderboard": [],
    "tier": {
        "rank": 1,
        "world": 3,
        "ranks": [
            {"rank": 0, "health": "alive", "silent_s": 0.3, "step": 5, "state": "training", "devices": 4,
             "tiles_per_s": 12.5, "gflops": 250.0, "url": "wss://rank0.example.org:8765"},
            {"rank": 1, "health": "self", "silent_s": 0.0, "step": 5, "state": "training", "devices": 3,
             "tiles_per_s": 9.0, "gflops": 180.0, "url": "ws://10.0.0.2:8765"},
            {"rank": 2, "health": "silent", "silent_s": 4.0,
             "note": "its published status failed the tier's seal: not believed"},
        ],
    },
}  # fmt: skip


@pytest.mark.drill
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (.ci/run installs it)")
def test_a_rank_of_a_tier_shows_every_rank_with_a_link_to_its_page(tmp_path: Path) -> None:
    """The page of rank 1 of 3 (the real Dashboard and page over HTTP, a status with a tier):
    its header says which rank it is, the tier's table has a row per rank with its figures and a
    link to that rank's own page (https for wss), and a rank whose status is not believed says
    why, with no figures. Its loss chart also draws the held-out loss: a dashed line of its own
    colour through a point at each step that evaluated it, with a legend."""
    import http.server
    import threading

    board = Dashboard(lambda: TIER_STATUS, lambda token: False)
    for step, loss in enumerate((4.0, 3.8, 3.5, 3.4, 3.2), start=1):
        board.step(step, loss, {2: 3.6, 4: 3.3}.get(step))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            path = "/" if self.path.startswith("/?") else self.path
            status, ctype, body, headers = board.respond(path, self.headers.get("Authorization"))
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    page = _Page(f"http://127.0.0.1:{httpd.server_address[1]}/", 1100, 900, tmp_path / "profile")
    try:
        page.wait_for("document.getElementById('tier-section')?.hidden === false", "the tier")
        assert page.js("document.getElementById('job-rank').textContent") == "rank 1 of 3"
        cells = "[...document.querySelectorAll('#tier tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
        rows = page.js(cells)
        assert [r[0] for r in rows] == ["0", "* 1", "2"]
        assert rows[0][1:7] == ["alive", "training", "5", "4", "12.5", "250.0"]
        assert "failed the tier's seal" in rows[2][2] and rows[2][3] == "-"
        links = page.js("[...document.querySelectorAll('#tier a')].map(a => a.href)")
        assert links[:2] == ["https://rank0.example.org:8765/", "http://10.0.0.2:8765/"]
        assert page.js("document.querySelectorAll('#tier a')[2].hasAttribute('href')") is False  # no URL: no link
        chart = page.js(
            "({card: document.getElementById('val-loss').textContent,"
            " caption: document.getElementById('curve-range').textContent,"
            " legend: !document.getElementById('curve-legend').hidden"
            " && !document.getElementById('legend-held').hidden,"
            " lines: [...document.querySelectorAll('#curve polyline')].map((l) => l.getAttribute('class')),"
            " points: [...document.querySelectorAll('#curve circle.held-point')].map((c) => +c.getAttribute('cx')),"
            " colours: ['.smooth', '.held']"
            ".map((c) => getComputedStyle(document.querySelector('#curve ' + c)).stroke)})"
        )
        assert chart["card"] == "held-out 3.3000 at step 4" and chart["legend"], chart
        assert "held-out 3.300 at step 4" in chart["caption"], chart
        assert chart["lines"] == ["raw", "smooth", "held"], chart
        assert len(chart["points"]) == 2 and chart["points"][0] < chart["points"][1], chart  # steps 2 and 4 only
        assert chart["colours"][0] != chart["colours"][1], chart
    finally:
        page.close()
        httpd.shutdown()
        httpd.server_close()
