"""The web dashboard: plain HTTP on the coordinator's own port, beside the websockets.

``GET /`` serves a page (``coordinator/net/web``: HTML, CSS and JavaScript shipped in the package,
nothing fetched from anywhere else) that polls ``GET /api/status`` once a second: the job's
progress, loss curve (with the held-out loss where the job evaluates one), tokens per second,
tile counts and the leaderboard. With the operator
token (``Authorization: Bearer TOKEN``; the page takes it from ``/#token=...`` and keeps it in
the tab, never in a URL the server sees) the reply adds the devices table: state, measured
compute and links. A request with a wrong token gets 401 and the public view.

Cost to the coordinator is bounded whatever the request rate: the status document is built at
most once per ``MIN_INTERVAL`` and shared by both views, each view is encoded at most once per
``MIN_INTERVAL`` and served from that copy otherwise (a build's store queries are index-ordered
LIMITs and counts kept in memory: the same work at a thousand enrolled identities and at
300,000, bench/bench_status.py), and the loss curve and the held-out loss's are kept in memory
with at most ``CURVE_POINTS`` points each (every other point is dropped when one fills, so a long
job keeps an even sample of its whole run).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

PATH_API = "/api/status"
ASSETS = {  # path -> (file in coordinator/web, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
MIN_INTERVAL = 1.0  # seconds between two builds of a view
CURVE_POINTS = 1000
HEADERS = {  # the page loads only what this server serves, and nobody frames it
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def handles(path: str) -> bool:
    return path == PATH_API or path in ASSETS


class Curve:
    """(step, loss) points of the run, evenly thinned to at most ``limit``."""

    def __init__(self, limit: int = CURVE_POINTS) -> None:
        self.limit, self.stride, self.points = limit, 1, []  # type: ignore[var-annotated]
        self._seen = 0

    def add(self, step: int, loss: float) -> None:
        self._seen += 1
        if (self._seen - 1) % self.stride:
            return
        self.points.append((step, round(float(loss), 6)))
        if len(self.points) >= self.limit:
            self.points = self.points[::2]
            self.stride *= 2


class Dashboard:
    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        is_operator: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.status, self.is_operator, self.clock = status, is_operator, clock
        self.curve = Curve()
        self.val_curve = Curve()  # (step, held-out loss) at the steps that evaluated one
        self._views: dict[bool, tuple[float, bytes]] = {}
        self._status: tuple[float, dict[str, Any]] | None = None  # the last build, shared by both views
        self._assets: dict[str, bytes] = {}

    def step(self, step: int, loss: float, val_loss: float | None = None) -> None:
        """A step's losses: ``val_loss`` only on a step that evaluated the held-out split."""
        if _finite(loss) is not None:  # a NaN or Inf step is not drawn
            self.curve.add(step, loss)
        if val_loss is not None and _finite(val_loss) is not None:
            self.val_curve.add(step, val_loss)

    def respond(self, path: str, authorization: str | None) -> tuple[int, str, bytes, dict[str, str]]:
        """(HTTP status, content type, body, headers) for a GET of ``path``."""
        if path in ASSETS:
            name, content_type = ASSETS[path]
            if name not in self._assets:
                self._assets[name] = (resources.files("cleave.coordinator.net") / "web" / name).read_bytes()
            return 200, content_type, self._assets[name], HEADERS
        operator = is_bearer(authorization, self.is_operator)
        status = 401 if operator is False else 200
        headers = HEADERS if status == 200 else {**HEADERS, "WWW-Authenticate": CHALLENGE}
        return status, "application/json", self._view(bool(operator)), headers

    def _view(self, operator: bool) -> bytes:
        now = self.clock()
        cached = self._views.get(operator)
        if cached is None or now - cached[0] >= MIN_INTERVAL:
            if self._status is None or now - self._status[0] >= MIN_INTERVAL:
                self._status = (now, self.status())
            body = json.dumps(_clean(self._build(self._status[1], operator)), allow_nan=False).encode()
            cached = self._views[operator] = (now, body)
        return cached[1]

    def _build(self, s: dict[str, Any], operator: bool) -> dict[str, Any]:
        job = s.get("job", {})
        share = (job.get("gemm_share") or {}).get("share")
        out: dict[str, Any] = {
            "job": {
                "name": job.get("name"),
                "state": job.get("state"),
                "step": job.get("step"),
                "steps": job.get("steps"),
                "loss": _finite(job.get("loss")),
                "val_loss": _finite(job.get("val_loss")),
                "val_step": job.get("val_step"),
                "tokens_per_s": job.get("tokens_per_s"),
                "gemm_share": share,
                "elapsed_s": job.get("elapsed_s"),
                "eta_s": job.get("eta_s"),
            },
            "tiles": {k: s.get("tiles", {}).get(k, 0) for k in ("queued", "leased", "verified", "rejected", "lost")},
            "connected": s.get("device_counts", {}).get("connected", 0),
            "standby": s.get("devices_standby", 0),  # of them, asleep: the plans leave them out
            "leaderboard": [_leader(r) for r in s.get("leaderboard", [])],
            "leaderboard_efficiency": [_leader(r) for r in s.get("leaderboard_efficiency", [])],
            # The job's energy, booked (aggregates only: no device's figure without the token).
            "energy": {k: v for k, v in (s.get("energy") or {}).items()},
            "losses": self.curve.points,
            "val_losses": self.val_curve.points,
        }
        tier = s.get("tier")
        if tier is not None:  # a rank of a tier: every rank's row (its URL is public: volunteers join it)
            keys = ("rank", "health", "step", "state", "devices", "tiles_per_s", "gflops", "url", "note")
            out["tier"] = {
                "rank": tier["rank"],
                "world": tier["world"],
                "ranks": [{k: r[k] for k in keys if k in r} for r in tier["ranks"]],
            }
        if operator:
            out["lost_reasons"] = s.get("lost_reasons") or {}
            out["devices"] = [
                {
                    "name": d.get("label") or d["name"],
                    "state": d["state"],
                    "reason": d.get("reason") or "",
                    "device": d["device"],
                    "gflops": d["gflops"],
                    "down_mbps": (d.get("profile") or {}).get("down_mbps"),
                    "up_mbps": (d.get("profile") or {}).get("up_mbps"),
                    "tiles_done": d["tiles_done"],
                    "tiles_rejected": d["tiles_rejected"],
                    "tiles_lost": d.get("tiles_lost", 0),
                    "tiles_revoked": d.get("tiles_revoked", 0),
                    "reliability": d["reliability"],
                    "gflop_verified": d.get("gflop_verified", 0.0),
                    "joules": d.get("joules", 0.0),
                    "energy_source": d.get("energy_source"),
                    "energy_flagged": d.get("energy_flagged", 0),
                }
                for d in s.get("devices", [])
            ]
        return out


def _leader(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": r.get("label") or r["name"],
        "gflop": r["gflop"],
        "tiles": r["tiles"],
        "joules": r.get("joules", 0.0),
        "gflop_per_j": r.get("gflop_per_j"),
    }


CHALLENGE = 'Bearer realm="cleave operator"'  # WWW-Authenticate of a 401


def is_bearer(authorization: str | None, is_operator: Callable[[str], bool]) -> bool | None:
    """None without an Authorization header; else whether it is ``Bearer <the operator token>``."""
    if not authorization:
        return None
    scheme, _, secret = authorization.partition(" ")
    return scheme.lower() == "bearer" and bool(secret.strip()) and is_operator(secret.strip())


def _clean(x: Any) -> Any:
    """JSON a browser parses: NaN and infinities (a diverged loss, an unmeasured rate) as null."""
    if isinstance(x, float):
        return _finite(x)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _finite(x: Any) -> Any:
    return x if isinstance(x, (int, float)) and x == x and abs(x) != float("inf") else None
