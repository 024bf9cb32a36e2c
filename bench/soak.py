"""The soak: a real job for an hour under churn, forgers, a slow relay and coordinator kills.

    .venv/bin/python bench/soak.py                        # one coordinator, 60 minutes
    .venv/bin/python bench/soak.py --tier                 # a tier of two coordinators, 60 minutes
    .venv/bin/python bench/soak.py --minutes 3 --sample-every 15 --json --out soak.json

Not in CI. Real processes on 127.0.0.1, each in its own process group (all of them are killed
on exit, Ctrl-C or failure):

* ``cleave coordinator start`` (the ``tiny`` model, batch 8 x 64, ``--planner uniform`` so every
  GEMM goes out as tiles, ``--micro-batches 1``, a checkpoint every ``--checkpoint-every``
  steps, ``--steps`` far more than the run can do); with ``--tier``, two of them
  (``--world-size 2``, ``--tier-timeout 10``, ``--no-redirect``), each with its own database;
* ``cleave emulate``: ``--devices`` laptops per coordinator that leave and come back all along
  (``--leave-rate``, half of the leaves crashes);
* ``cleave join``: one real client per coordinator;
* ``cleave relay`` (rank 0's, a 50 MB block cache), reached by the devices through a delay line
  in this process that holds every byte the relay sends them for ``--relay-delay`` seconds: a
  slow relay;
* forgers: ``cleave emulate --byzantine 1`` (apple laptops, so their names tell them apart), two
  devices that forge every result; the coordinator bans them, the process exits, and a fresh one
  with new identities starts ``--forgers-every`` seconds later, all run long (in a tier they take
  turns at the ranks);
* an observer in this process polling every ``--poll-every`` seconds the public and the operator
  ``/api/status``, the public and the operator ``/metrics``, and the operator status over the
  websocket (what ``cleave status`` asks).

The schedule, scaled by ``--minutes``: the coordinator (every rank of the tier) is SIGKILLed at
1/3 and 2/3 of the run and restarted on the same database, port and options (it resumes from
its newest checkpoint; the relay, which exits when its coordinator goes, is restarted with it);
in a tier, rank 1 is SIGKILLed at 1/2: rank 0 must stop within the tier timeout, exit 1 and name
it, and both ranks are restarted (docs/operations.md, Running a tier).

Every ``--sample-every`` seconds (and just before each kill and after each restart) it samples
each process's resident memory and open descriptors (psutil), each database's size (the file,
its WAL, and the pages SQLite holds) and rows per table, the step, tiles lost and forged tiles
accepted. At the end it trains plain torch for as many steps and prints the samples and the
goals as PASS/FAIL lines (exit status 1 on any FAIL):

* losses: every step's loss in the database (after the restarts: the recomputed steps) equals
  plain torch's to 1e-5 relative; a tier's ranks log the same loss, bit for bit;
* forged tiles accepted: none (a lease of a forger's tile that ended verified), and forgeries
  were caught (rejected) at all;
* tiles reached the devices (verified tiles per coordinator);
* RSS: each long-lived process's resident memory after the warm-up (``--warmup-minutes``,
  default 1/6 of the run: 10 of 60 minutes) grows at most 5% over the rest of the run; a
  coordinator and the relay, restarted twice, are judged on their last incarnation's samples
  after its own warm-up;
* the store: bytes (SQLite pages) per step computed, after the warm-up, at most
  ``STORE_BYTES_PER_TILE`` per tile of a step, and flat: the second half's rate at most 1.25x the
  first half's; its WAL stays under ``WAL_BOUND``;
* open descriptors: after the warm-up, a process's count grows at most max(16, 25%) over its
  first reading (same samples as RSS);
* the observer: no malformed answer, and every endpoint answered in every incarnation;
* no process ended by itself (one that does is restarted, as a supervisor would, and named);
* (tier) the lost rank was named by the survivor, which stopped with exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import cleave.cli  # noqa: E402,F401 - OMP_WAIT_POLICY before torch loads

TOKEN, OPERATOR = "soak-join-token", "soak-operator-token"
MODEL, BATCH, SEQ_LEN, STEPS = "tiny", 8, 64, 100_000  # far more steps than an hour: losses compared as done
HONEST_FLEET, FORGER_FLEET, FORGER_PREFIX = "laptops", "apple-laptops", "emu-apple"
LOSS_REL = 1e-5
RSS_GROWTH = 0.05
FD_GROWTH, FD_SLACK = 0.25, 16
STORE_FLAT = 1.25  # the second half's bytes per step over the first half's, at most
STORE_BYTES_PER_TILE = 512  # the books of one tile (its row, its leases, its GEMM's share, indexes) at most
WAL_BOUND = 64 << 20
RELAY_CACHE_GB = 0.05  # the relay's block cache: full within a minute, so its memory is judged once it is
TIER_TIMEOUT = 10  # seconds: --tier-timeout of the tier's ranks
READY_S = 180.0  # a (re)started coordinator answers /api/status within this
STOP_S = 30.0  # a process asked to stop (SIGINT) is killed after this

err = Console(stderr=True, highlight=False, soft_wrap=True)  # progress lines unwrapped in a log file


class SoakError(Exception):
    """The run itself could not go on (a coordinator that does not come back, say)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cleave(*args: str) -> list[str]:
    return [sys.executable, "-m", "cleave", *args]


# --------------------------------------------------------------------------- processes


@dataclass
class Child:
    """One process this run started, in its own process group, output to ``log``."""

    name: str  # what it is sampled as: "coordinator-0", "emulator", ...
    popen: subprocess.Popen
    log: Path
    started: float  # monotonic
    incarnation: int = 1
    rank: int = 0  # the coordinator it works for (forgers: where they were sent)
    out: Path | None = None  # its stdout, when that is a JSON summary

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Children:
    """Every process started, so that each one is gone when this run ends, however it ends."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder = folder
        self.env = env
        self.all: list[Child] = []
        atexit.register(self.kill_all)

    def start(
        self, name: str, cmd: list[str], *, incarnation: int = 1, stdout: Path | None = None, env: dict | None = None
    ) -> Child:
        log = self.folder / f"{name}-{incarnation}.log"
        with log.open("w") as out, stdout.open("w") if stdout else contextlib.nullcontext(out) as so:
            popen = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=so,
                stderr=out,
                start_new_session=True,  # its own group: Ctrl-C here reaches it only through us
            )
        child = Child(name, popen, log, time.monotonic(), incarnation)
        self.all.append(child)
        return child

    @staticmethod
    def signal(child: Child, sig: int) -> None:
        if child.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, sig)

    def stop(self, child: Child, timeout: float = STOP_S) -> int:
        """SIGINT (a graceful leave), then SIGKILL after ``timeout``; its exit status."""
        self.signal(child, signal.SIGINT)
        try:
            return child.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(child, signal.SIGKILL)
            return child.popen.wait()

    def kill_all(self) -> None:
        for child in self.all:
            self.signal(child, signal.SIGKILL)
        for child in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(5)


# --------------------------------------------------------------------------- the slow relay


class SlowLink:
    """A TCP delay line in front of the relay: what devices send passes at once, every byte the
    relay sends back is held ``delay`` seconds (order kept). A thread with its own event loop."""

    def __init__(self, target_port: int, delay: float) -> None:
        self.target_port = target_port
        self.delay = delay
        self.port = _free_port()
        self.connections = 0
        self.bytes_delayed = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-link", daemon=True)

    def start(self) -> SlowLink:
        self._thread.start()
        if not self._ready.wait(10):
            raise SoakError("the slow link did not start")
        return self

    def close(self) -> None:
        if self._thread.is_alive() and self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            down_w.close()
            return
        self.connections += 1
        pumps = [
            asyncio.create_task(self._pipe(down_r, up_w, 0.0)),
            asyncio.create_task(self._pipe(up_r, down_w, self.delay)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (up_w, down_w):
            w.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: float) -> None:
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def feed() -> None:
            while data := await r.read(1 << 16):
                await line.put((loop.time() + delay, data))
            await line.put(None)

        feeder = asyncio.create_task(feed())
        try:
            while (item := await line.get()) is not None:
                due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                w.write(data)
                await w.drain()
                if delay:
                    self.bytes_delayed += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            feeder.cancel()


# --------------------------------------------------------------------------- the observer

ENDPOINTS = ("api_status", "api_status_operator", "metrics", "metrics_operator", "ws_status_operator")


@dataclass
class Tally:
    ok: int = 0
    down: int = 0  # refused or reset: the coordinator was not there (a kill, a restart)
    timeouts: int = 0
    bad: int = 0  # an answer that is not what the endpoint promises
    bad_examples: list[str] = field(default_factory=list)
    ok_at: list[float] = field(default_factory=list)  # monotonic times of the answers
    slowest_s: float = 0.0


class Observer:
    """Polls every coordinator's status and metrics endpoints, in a thread, all run long."""

    def __init__(self, ports: list[int], every: float) -> None:
        self.ports = ports
        self.every = every
        self.tallies = {(rank, e): Tally() for rank in range(len(ports)) for e in ENDPOINTS}
        self.last_metrics: dict[int, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="observer", daemon=True)

    def start(self) -> Observer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for rank, port in enumerate(self.ports):
                for endpoint in ENDPOINTS:
                    self._poll(rank, port, endpoint)

    def _poll(self, rank: int, port: int, endpoint: str) -> None:
        tally = self.tallies[(rank, endpoint)]
        started = time.monotonic()
        try:
            problem = self._ask(rank, port, endpoint)
        except TimeoutError:
            tally.timeouts += 1
            return
        except http.client.IncompleteRead:  # cut off mid-answer: killed while answering
            tally.down += 1
            return
        except (ConnectionError, urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                tally.timeouts += 1
            elif isinstance(reason, (ConnectionError, OSError)):
                tally.down += 1
            else:
                self._bad(tally, f"{endpoint}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is a finding, not a crash of the soak
            if "cannot reach a coordinator" in str(exc) or "did not greet us" in str(exc):
                tally.down += 1
            else:
                self._bad(tally, f"{endpoint}: {type(exc).__name__}: {exc}")
            return
        if problem:
            self._bad(tally, f"{endpoint}: {problem}")
            return
        tally.ok += 1
        tally.ok_at.append(time.monotonic())
        tally.slowest_s = max(tally.slowest_s, time.monotonic() - started)

    @staticmethod
    def _bad(tally: Tally, what: str) -> None:
        tally.bad += 1
        if len(tally.bad_examples) < 5:
            tally.bad_examples.append(what[:300])

    def _ask(self, rank: int, port: int, endpoint: str) -> str | None:
        """None when the answer is what the endpoint promises, else what is wrong with it."""
        if endpoint == "ws_status_operator":
            from cleave.cli.status import fetch_status

            snapshot = fetch_status(f"ws://127.0.0.1:{port}", OPERATOR)
            return None if "job" in snapshot and "devices" in snapshot else f"keys {sorted(snapshot)[:8]}"
        operator = endpoint.endswith("_operator")
        path = "/api/status" if endpoint.startswith("api_status") else "/metrics"
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
        if operator:
            req.add_header("Authorization", f"Bearer {OPERATOR}")
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        if path == "/api/status":
            doc = json.loads(body)
            if "job" not in doc:
                return "no job in the status"
            if operator != ("devices" in doc):
                return "the operator view and the public one are mixed up"
            return None
        text = body.decode()
        if "cleave_steps_total" not in text:
            return "no cleave_steps_total"
        if not operator and "cleave_device_" in text:
            return "per-device series without the token"
        if operator:
            self.last_metrics[rank] = _scalars(text)
        return None


def _scalars(text: str) -> dict[str, float]:
    """A few of a scrape's series, by name with labels."""
    out = {}
    for line in text.splitlines():
        if line.startswith(("cleave_steps_total", "cleave_tiles_total", "cleave_devices_connected")):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


# --------------------------------------------------------------------------- one coordinator


@dataclass
class Site:
    """One coordinator (a rank of the tier, or the only one) and what runs beside it."""

    rank: int
    folder: Path
    port: int = field(default_factory=_free_port)
    coordinator: Child | None = None
    emulator: Child | None = None
    client: Child | None = None
    incarnations: list[tuple[float, float | None]] = field(default_factory=list)  # (started, ended) monotonic
    last_step: int = 0
    computed: int = 0  # steps computed, recomputed ones counted again

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def db(self) -> Path:
        return self.folder / "soak.db"


class Soak:
    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        self.args = args
        self.folder = folder
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONUNBUFFERED": "1",
            "XDG_CONFIG_HOME": str(folder / "config"),  # the clients' config and benchmark cache stay here
            "XDG_CACHE_HOME": str(folder / "cache"),
            "CLEAVE_TIER_SECRET": "soak-tier-secret-" + os.urandom(8).hex(),
            "COLUMNS": "160",
        }
        self.children = Children(folder, env)
        world = 2 if args.tier else 1
        self.sites = [Site(rank, folder / f"rank{rank}") for rank in range(world)]
        for site in self.sites:
            site.folder.mkdir()
        self.t0 = time.monotonic()
        self.relay: Child | None = None
        self.relay_port = _free_port()
        self.link = SlowLink(self.relay_port, args.relay_delay)
        self.observer = Observer([s.port for s in self.sites], args.poll_every)
        self.forger: Child | None = None
        self.forger_runs: list[dict] = []
        self.forger_next = 0.0
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.cpu_prev: dict[int, tuple[float, float]] = {}
        self.rank_lost: dict[str, Any] | None = None
        self.emulator_summaries: list[dict] = []
        self.unexpected: list[str] = []  # processes that ended when nothing should have ended them

    # ------------------------------------------------------------------ helpers

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        if not self.args.quiet:
            m, s = divmod(int(self.now()), 60)
            err.print(f"[{m:3d}:{s:02d}] {text}")

    def event(self, kind: str, **detail: Any) -> None:
        self.events.append({"t": round(self.now(), 1), "kind": kind, **detail})

    # ------------------------------------------------------------------ starting things

    def start_coordinator(self, site: Site, rendezvous: str | None) -> None:
        a = self.args
        n = len(site.incarnations) + 1
        cmd = _cleave(
            "coordinator", "start",
            *("--port", str(site.port), "--db", str(site.db), "--token", TOKEN, "--operator-token", OPERATOR),
            *("--model", MODEL, "--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN)),
            *("--micro-batches", "1", "--planner", "uniform", "--checkpoint-every", str(a.checkpoint_every)),
            *("--min-devices", "1" if a.tier else "2", "--linger", "0"),
            *("--metrics", str(site.folder / "metrics.jsonl")),
            "--quiet",
        )  # fmt: skip
        if rendezvous:
            cmd += [
                *("--world-size", str(len(self.sites)), "--rank", str(site.rank), "--rendezvous", rendezvous),
                *("--tier-timeout", str(TIER_TIMEOUT), "--no-redirect"),
            ]
        site.coordinator = self.children.start(f"coordinator-{site.rank}", cmd, incarnation=n)
        site.incarnations.append((time.monotonic(), None))

    def wait_ready(self, site: Site) -> None:
        """Until its /api/status answers (the coordinator listens, its job loaded)."""
        deadline = time.monotonic() + READY_S
        assert site.coordinator is not None
        while time.monotonic() < deadline:
            if not site.coordinator.alive():
                raise SoakError(
                    f"coordinator {site.rank} exited with {site.coordinator.popen.returncode} before it listened:\n"
                    + site.coordinator.tail()
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{site.port}/api/status", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise SoakError(f"coordinator {site.rank} did not answer within {READY_S:.0f} s:\n" + site.coordinator.tail())

    def start_coordinators(self) -> None:
        rendezvous = f"tcp://127.0.0.1:{_free_port()}" if self.args.tier else None
        for site in self.sites:
            self.start_coordinator(site, rendezvous)
        for site in self.sites:
            self.wait_ready(site)

    def start_relay(self) -> None:
        site = self.sites[0]
        n = 1 if self.relay is None else self.relay.incarnation + 1
        cmd = _cleave(
            "relay", site.url, "--token", TOKEN,
            *("--listen", f"127.0.0.1:{self.relay_port}", "--public-url", f"ws://127.0.0.1:{self.link.port}"),
            *("--name", "slow-relay", "--memory-gb", str(RELAY_CACHE_GB)),
            *("--credentials", str(self.folder / "relay.json")),
        )  # fmt: skip
        self.relay = self.children.start("relay", cmd, incarnation=n)

    def start_emulator(self, site: Site) -> None:
        a = self.args
        n = 1 if site.emulator is None else site.emulator.incarnation + 1
        out = site.folder / f"emulator-{n}.json"
        cmd = _cleave(
            "emulate", site.url, "--token", TOKEN,
            *("--devices", str(a.devices), "--fleet", HONEST_FLEET, "--leave-rate", str(a.leave_rate)),
            *("--away-seconds", "10", "--seed", str(11 + site.rank), "--json", "--quiet"),
        )  # fmt: skip
        site.emulator = self.children.start(f"emulator-{site.rank}", cmd, incarnation=n, stdout=out)
        site.emulator.rank, site.emulator.out = site.rank, out

    def start_client(self, site: Site) -> None:
        n = 1 if site.client is None else site.client.incarnation + 1
        cmd = _cleave(
            "join", site.url, "--token", TOKEN,
            *("--threads", "1", "--device", "cpu", "--always", "--quiet", "--name", f"soak-client-{site.rank}"),
            *("--credentials", str(site.folder / "client.json")),
        )  # fmt: skip
        site.client = self.children.start(f"client-{site.rank}", cmd, incarnation=n)
        site.client.rank = site.rank

    def maybe_start_forger(self) -> None:
        """One forger process at a time; a fresh one (new identities) once the last is over."""
        a = self.args
        if self.forger is not None:
            if self.forger.alive() and time.monotonic() - self.forger.started < 3 * a.forgers_every:
                return
            if self.forger.alive():  # never banned: not dealt a tile? Replace it all the same
                self.children.stop(self.forger)
            self._forger_done()
        if time.monotonic() < self.forger_next:
            return
        runs = len(self.forger_runs)
        site = self.sites[runs % len(self.sites)]
        out = self.folder / f"forgers-{runs + 1}.json"
        self.forger = self.children.start(
            "forgers",
            _cleave(
                "emulate",
                site.url,
                "--token",
                TOKEN,
                *("--devices", "2", "--fleet", FORGER_FLEET, "--byzantine", "1", "--seed", str(100 + runs)),
                "--json",
                "--quiet",
            ),  # fmt: skip
            incarnation=runs + 1,
            stdout=out,
        )
        self.forger.rank, self.forger.out = site.rank, out
        self.say(f"forgers #{runs + 1} start at rank {site.rank}")

    def _forger_done(self) -> None:
        f = self.forger
        assert f is not None
        summary: dict = {}
        with contextlib.suppress(OSError, json.JSONDecodeError):
            summary = json.loads(f.out.read_text() or "{}") if f.out else {}
        run = {
            "rank": f.rank,
            "exit": f.popen.returncode,
            "seconds": round(time.monotonic() - f.started, 1),
            "forged": summary.get("forged"),
            "forged_rejected": summary.get("forged_rejected"),
            "banned": len(summary.get("banned", [])),
        }
        self.forger_runs.append(run)
        self.say(f"forgers #{len(self.forger_runs)} done: {run}")
        self.forger = None
        self.forger_next = time.monotonic() + self.args.forgers_every

    # ------------------------------------------------------------------ faults

    def kill_coordinators(self, why: str) -> None:
        """SIGKILL every coordinator, restart them on the same databases and ports."""
        self.sample(f"before {why}")
        self.say(f"{why}: SIGKILL every coordinator")
        for site in self.sites:
            assert site.coordinator is not None
            self.children.signal(site.coordinator, signal.SIGKILL)
        for site in self.sites:
            assert site.coordinator is not None
            site.coordinator.popen.wait()
            self._ended(site)
        self.event("kill", why=why, steps=[s.last_step for s in self.sites])
        self.restart()

    def lose_rank(self) -> None:
        """SIGKILL rank 1 alone: rank 0 must stop within the tier timeout, exit 1 and name it."""
        self.sample("before the lost rank")
        lost, survivor = self.sites[1], self.sites[0]
        assert lost.coordinator is not None and survivor.coordinator is not None
        self.say("a rank lost: SIGKILL rank 1; rank 0 must stop and name it")
        killed = time.monotonic()
        self.children.signal(lost.coordinator, signal.SIGKILL)
        lost.coordinator.popen.wait()
        self._ended(lost)
        try:
            code: int | None = survivor.coordinator.popen.wait(TIER_TIMEOUT + 120)
        except subprocess.TimeoutExpired:
            code = None
            self.children.signal(survivor.coordinator, signal.SIGKILL)
            survivor.coordinator.popen.wait()
        stopped_s = time.monotonic() - killed
        self._ended(survivor)
        named = "rank 1 of the tier was lost" in survivor.coordinator.tail(20_000)
        self.rank_lost = {"survivor_exit": code, "named": named, "stopped_after_s": round(stopped_s, 1)}
        self.say(f"rank 0 exited {code} after {stopped_s:.1f} s; named rank 1: {named}")
        self.event("rank lost", **self.rank_lost)
        self.restart()

    def _ended(self, site: Site) -> None:
        started, _ = site.incarnations[-1]
        site.incarnations[-1] = (started, time.monotonic())

    def restart(self) -> None:
        if self.relay is not None and self.relay.alive():
            self.children.stop(self.relay, 15)  # it leaves by itself when its coordinator goes
        began = time.monotonic()
        self.start_coordinators()
        self.start_relay()
        self.say(f"restarted in {time.monotonic() - began:.1f} s")
        self.sample("after restart")
        self.event("restart", seconds=round(time.monotonic() - began, 1), steps=[s.last_step for s in self.sites])

    def check_children(self) -> None:
        """Restart what ended though nothing ended it, as a supervisor would, and count it: a goal."""
        if self.relay is not None and not self.relay.alive():
            self._unexpected(self.relay)
            self.start_relay()
        gone = [s for s in self.sites if s.coordinator is not None and not s.coordinator.alive()]
        if gone:
            for site in gone:
                assert site.coordinator is not None
                self._unexpected(site.coordinator)
            self.sample("a coordinator ended")
            for site in self.sites:  # a tier restarts together (the others stop anyway)
                assert site.coordinator is not None
                self.children.signal(site.coordinator, signal.SIGKILL)
                site.coordinator.popen.wait()
                self._ended(site)
            self.restart()
        for site in self.sites:
            if site.emulator is not None and not site.emulator.alive():
                self._unexpected(site.emulator)
                self._collect(site.emulator)
                self.start_emulator(site)
            if site.client is not None and not site.client.alive():
                self._unexpected(site.client)
                self.start_client(site)

    def _unexpected(self, child: Child) -> None:
        what = f"{child.name} (incarnation {child.incarnation}) exited {child.popen.returncode} at {self.now():.0f} s"
        self.unexpected.append(what)
        self.say(f"[red]{what}[/]: {child.tail(400).strip()[-300:]}; restarting it")
        self.event("unexpected exit", what=what)

    def _collect(self, emulator: Child) -> None:
        """An emulator's JSON summary (it prints one when it stops)."""
        if emulator.out is None:
            return
        with contextlib.suppress(OSError, json.JSONDecodeError):
            self.emulator_summaries.append(json.loads(emulator.out.read_text()))

    # ------------------------------------------------------------------ samples

    def processes(self) -> list[Child]:
        procs = [c for s in self.sites for c in (s.coordinator, s.emulator, s.client) if c is not None]
        procs += [c for c in (self.relay, self.forger) if c is not None]
        return [c for c in procs if c.alive()]

    def _proc(self, pid: int, name: str, incarnation: int, started: float) -> dict | None:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                rss, fds, cpu = p.memory_info().rss, p.num_fds(), sum(p.cpu_times()[:2])
        except psutil.Error:
            return None
        now = time.monotonic()
        before = self.cpu_prev.get(pid)
        self.cpu_prev[pid] = (now, cpu)
        cores = (cpu - before[1]) / max(1e-9, now - before[0]) if before else None
        return {
            "rss_mb": round(rss / 1e6, 1),
            "fds": fds,
            "cores": None if cores is None else round(cores, 3),
            "incarnation": incarnation,
            "age_s": round(now - started, 1),
        }

    def sample(self, label: str = "") -> dict:
        row: dict[str, Any] = {"t": round(self.now(), 1), "label": label, "procs": {}, "sites": []}
        for c in self.processes():
            got = self._proc(c.pid, c.name, c.incarnation, c.started)
            if got is not None:
                row["procs"][c.name] = got
        me = self._proc(os.getpid(), "soak", 1, self.t0)
        if me is not None:
            row["procs"]["soak (observer)"] = me
        for site in self.sites:
            row["sites"].append(self._store(site))
        row["observer"] = {
            "ok": sum(t.ok for t in self.observer.tallies.values()),
            "down": sum(t.down for t in self.observer.tallies.values()),
            "bad": sum(t.bad for t in self.observer.tallies.values()),
            "timeouts": sum(t.timeouts for t in self.observer.tallies.values()),
        }
        self.samples.append(row)
        return row

    def _store(self, site: Site) -> dict:
        out: dict[str, Any] = {"rank": site.rank}
        files = {"db": site.db, "wal": Path(f"{site.db}-wal")}
        for key, path in files.items():
            out[f"{key}_bytes"] = path.stat().st_size if path.exists() else 0
        ck = Path(f"{site.db}-checkpoints")
        out["checkpoint_bytes"] = sum(f.stat().st_size for f in ck.glob("*.pt")) if ck.exists() else 0
        try:
            conn = sqlite3.connect(f"file:{site.db}?mode=ro", uri=True, timeout=30)
            try:
                tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
                out["rows"] = {t: conn.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables}
                pages = conn.execute("PRAGMA page_count").fetchone()[0]
                out["pages_bytes"] = pages * conn.execute("PRAGMA page_size").fetchone()[0]
                out["step"] = conn.execute("SELECT COALESCE(MAX(step), 0) FROM steps").fetchone()[0]
                outcomes = dict(conn.execute("SELECT outcome, COUNT(*) FROM leases GROUP BY outcome"))
                out["lost"] = outcomes.get("lost", 0)
                out["lost_why"] = dict(
                    conn.execute("SELECT reason, COUNT(*) FROM leases WHERE outcome = 'lost' GROUP BY reason")
                )
                out["verified"] = outcomes.get("verified", 0)
                forged = dict(
                    conn.execute(
                        "SELECT l.outcome, COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id "
                        "WHERE d.name LIKE ? GROUP BY l.outcome",
                        (FORGER_PREFIX + "%",),
                    )
                )
                out["forged_accepted"] = forged.get("verified", 0)
                out["forged_rejected"] = forged.get("rejected", 0)
                out["forgers_banned"] = conn.execute(
                    "SELECT COUNT(*) FROM identities WHERE name LIKE ? AND state = 'banned'", (FORGER_PREFIX + "%",)
                ).fetchone()[0]
            finally:
                conn.close()
        except sqlite3.Error as exc:  # the database being created: next time
            out["error"] = str(exc)
            return out
        if out["step"] > site.last_step:
            site.computed += out["step"] - site.last_step
        site.last_step = out["step"]
        out["computed_steps"] = site.computed
        return out

    def progress(self, row: dict) -> None:
        parts = []
        before = self.samples[-2] if len(self.samples) > 1 else None
        for s in row["sites"]:
            if "error" in s:
                parts.append(f"rank {s['rank']}: {s['error']}")
                continue
            rate = ""
            if before is not None and "computed_steps" in before["sites"][s["rank"]] and row["t"] > before["t"]:
                done = s["computed_steps"] - before["sites"][s["rank"]]["computed_steps"]
                rate = f", {60 * done / (row['t'] - before['t']):.0f}/min"
            parts.append(
                f"rank {s['rank']} step {s['step']:,} (computed {s['computed_steps']:,}{rate}), store "
                f"{s['pages_bytes'] / 1e6:.1f} MB, lost {s['lost']}, forged accepted {s['forged_accepted']} "
                f"/ rejected {s['forged_rejected']}"
            )
        rss = ", ".join(f"{n} {p['rss_mb']:.0f}" for n, p in row["procs"].items())
        cores = sum(p["cores"] or 0.0 for p in row["procs"].values())
        o = row["observer"]
        self.say(
            " | ".join(parts)
            + f" | RSS MB: {rss} | {cores:.2f} cores"
            + f" | observer {o['ok']} ok, {o['down']} down, {o['bad']} bad, {o['timeouts']} slow"
        )

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        a = self.args
        total = a.minutes * 60
        schedule = [(total / 3, "kill 1"), (2 * total / 3, "kill 2")]
        if a.tier:
            schedule.append((total / 2, "rank lost"))
        schedule.sort()
        self.say(
            f"{'a tier of 2 coordinators' if a.tier else 'one coordinator'}, {a.minutes:g} minutes; "
            f"files in {self.folder}"
        )
        self.link.start()
        self.start_coordinators()
        for site in self.sites:
            self.start_emulator(site)
            self.start_client(site)
        self.start_relay()
        self.observer.start()
        self.forger_next = time.monotonic() + min(30.0, total / 10)
        next_sample = 0.0
        while (now := self.now()) < total:
            if schedule and now >= schedule[0][0]:
                _, what = schedule.pop(0)
                if what == "rank lost":
                    self.lose_rank()
                else:
                    self.kill_coordinators(what)
                continue
            self.check_children()
            self.maybe_start_forger()
            if now >= next_sample:
                self.progress(self.sample())
                next_sample = now + a.sample_every
            time.sleep(0.5)
        self.progress(self.sample("end"))
        self.stop()

    def stop(self) -> None:
        self.say("stopping: devices leave, then the coordinators")
        self.observer.close()
        if self.forger is not None:
            self.children.stop(self.forger)
            self._forger_done()
        for site in self.sites:
            for child in (site.emulator, site.client):
                if child is not None:
                    self.children.stop(child)
            if site.emulator is not None:
                self._collect(site.emulator)
        for site in self.sites:
            if site.coordinator is not None:
                self.children.stop(site.coordinator)
                self._ended(site)
        if self.relay is not None:
            self.children.stop(self.relay, 10)
        self.link.close()
        self.children.kill_all()


# --------------------------------------------------------------------------- figures and goals


def _losses(db: Path) -> list[float]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return [r[0] for r in conn.execute("SELECT loss FROM steps WHERE job_id = 1 ORDER BY step")]


def plain_losses(steps: int, parts: int = 1) -> list[float]:
    """Plain torch, the same job (the same --steps, so the same learning-rate schedule). A tier
    of ``parts`` ranks adds its ranks' gradients: its losses are plain torch's with the batch in
    ``parts`` micro-batches, bit for bit (docs/operations.md, Running a tier); with one part the
    sums' order differs and training drifts apart by float error (4.4e-2 after 1,644 steps)."""
    from cleave.coordinator.training.loop import TrainConfig, Trainer

    config = TrainConfig(model=MODEL, steps=STEPS, batch_size=BATCH, seq_len=SEQ_LEN, micro_batches=parts)
    trainer = Trainer(config)
    return [trainer.train_step().loss for _ in range(steps)]


def _judged(samples: list[dict], name: str, warmup: float) -> list[dict]:
    """A process's samples after its warm-up: a long-lived one's after the run's first
    ``warmup`` seconds; a restarted one's (coordinator, relay) of its last incarnation, after its
    own first ``warmup`` seconds."""
    mine = [(s["t"], s["procs"][name]) for s in samples if name in s["procs"]]
    if not mine:
        return []
    last = max(p["incarnation"] for _, p in mine)
    return [{"t": t, **p} for t, p in mine if p["incarnation"] == last and p["age_s"] >= warmup]


def growth(samples: list[dict], warmup: float) -> dict[str, dict]:
    names = sorted({n for s in samples for n in s["procs"]})
    out = {}
    for name in names:
        rows = _judged(samples, name, warmup)
        incarnations = max((s["procs"][name]["incarnation"] for s in samples if name in s["procs"]), default=1)
        item: dict[str, Any] = {"samples": len(rows), "incarnation": incarnations}
        if len(rows) >= 2:
            first, rest = rows[0], rows[1:]
            item.update(
                rss_first_mb=first["rss_mb"],
                rss_last_mb=rows[-1]["rss_mb"],
                rss_max_mb=max(r["rss_mb"] for r in rest),
                rss_growth=max(r["rss_mb"] for r in rest) / first["rss_mb"] - 1,
                fds_first=first["fds"],
                fds_max=max(r["fds"] for r in rest),
            )
        out[name] = item
    return out


def store_figures(samples: list[dict], rank: int, warmup: float) -> dict[str, Any]:
    rows = [s["sites"][rank] for s in samples if s["t"] >= warmup and "pages_bytes" in s["sites"][rank]]
    rows = [r for r in rows if r["computed_steps"] > 0]
    out: dict[str, Any] = {"samples": len(rows)}
    if rows:
        last = rows[-1]
        out.update(
            pages_mb=round(last["pages_bytes"] / 1e6, 2),
            file_mb=round(last["db_bytes"] / 1e6, 2),
            wal_max_mb=round(max(r["wal_bytes"] for r in rows) / 1e6, 2),
            checkpoints_mb=round(last["checkpoint_bytes"] / 1e6, 2),
            rows=last["rows"],
            identities=last["rows"].get("identities", 0),
        )
    if len(rows) < 3 or rows[-1]["computed_steps"] - rows[0]["computed_steps"] < 4:
        return out
    mid = len(rows) // 2

    def rate(a: dict, b: dict, key: str = "pages_bytes") -> float:
        steps = b["computed_steps"] - a["computed_steps"]
        if key == "pages_bytes":
            return (b[key] - a[key]) / max(1, steps)
        return (b["rows"].get(key, 0) - a["rows"].get(key, 0)) / max(1, steps)

    out.update(
        bytes_per_step=rate(rows[0], rows[-1]),
        bytes_per_step_first_half=rate(rows[0], rows[mid]),
        bytes_per_step_second_half=rate(rows[mid], rows[-1]),
        tiles_per_step=rate(rows[0], rows[-1], "tiles"),
        rows_per_step={t: round(rate(rows[0], rows[-1], t), 2) for t in rows[-1]["rows"]},
    )
    out["bound_bytes_per_step"] = STORE_BYTES_PER_TILE * out["tiles_per_step"]
    return out


@dataclass
class Goal:
    name: str
    status: str  # PASS, FAIL or SKIP (too few samples to judge)
    detail: str


def goals(soak: Soak, figs: dict) -> list[Goal]:
    out: list[Goal] = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        out.append(Goal(name, "SKIP" if ok is None else "PASS" if ok else "FAIL", detail))

    loss = figs["losses"]
    add(
        "losses equal plain torch (1e-5 relative)",
        loss["steps"] > 0 and loss["max_rel"] <= LOSS_REL and loss.get("ranks_alike", True),
        f"{loss['steps']:,} steps, max relative difference {loss['max_rel']:.2e}"
        + (f"; the ranks log one loss, bit for bit: {loss['ranks_alike']}" if "ranks_alike" in loss else ""),
    )
    stores = figs["stores"]
    accepted = sum(s["last"].get("forged_accepted", 0) for s in stores)
    rejected = sum(s["last"].get("forged_rejected", 0) for s in stores)
    banned = sum(s["last"].get("forgers_banned", 0) for s in stores)
    add(
        "zero forged tiles accepted",
        accepted == 0 and rejected > 0,
        f"{accepted} accepted; {rejected} forged results rejected, {banned} forger identities banned, "
        f"{len(soak.forger_runs)} forger processes",
    )
    verified = [s["last"].get("verified", 0) for s in stores]
    add(
        "tiles were shipped to the devices", all(v > 0 for v in verified), f"verified tiles per coordinator: {verified}"
    )
    for name, g in figs["growth"].items():
        if name.startswith(("forgers", "soak")):
            continue  # short-lived, or this process
        if g["samples"] < 2:
            add(f"RSS of {name}", None, f"{g['samples']} samples after its warm-up")
            continue
        which = f"incarnation {g['incarnation']}, " if g["incarnation"] > 1 else ""
        add(
            f"RSS of {name} grows at most {RSS_GROWTH:.0%} after the warm-up",
            g["rss_growth"] <= RSS_GROWTH,
            f"{which}{g['rss_first_mb']:.0f} -> max {g['rss_max_mb']:.0f} MB ({g['rss_growth']:+.1%}) over "
            f"{g['samples']} samples",
        )
        add(
            f"open fds of {name} bounded",
            g["fds_max"] <= g["fds_first"] + max(FD_SLACK, FD_GROWTH * g["fds_first"]),
            f"{g['fds_first']} -> max {g['fds_max']}",
        )
    for s in stores:
        f = s["figures"]
        if "bytes_per_step" not in f:
            add(f"store of rank {s['rank']} grows linearly", None, f"{f['samples']} samples after the warm-up")
            continue
        flat = f["bytes_per_step_second_half"] <= STORE_FLAT * f["bytes_per_step_first_half"] + 1024
        bounded = f["bytes_per_step"] <= f["bound_bytes_per_step"]
        add(
            f"store of rank {s['rank']} grows linearly in steps (<= {STORE_BYTES_PER_TILE} B a tile, flat)",
            flat and bounded and f["wal_max_mb"] * 1e6 <= WAL_BOUND,
            f"{f['bytes_per_step'] / 1e3:.1f} kB/step (first half {f['bytes_per_step_first_half'] / 1e3:.1f}, "
            f"second {f['bytes_per_step_second_half'] / 1e3:.1f}; bound {f['bound_bytes_per_step'] / 1e3:.1f} = "
            f"{f['tiles_per_step']:.0f} tiles/step x {STORE_BYTES_PER_TILE} B); WAL max {f['wal_max_mb']:.1f} MB",
        )
    add(
        "no process ended by itself (each was restarted if one did)",
        not soak.unexpected,
        "; ".join(soak.unexpected) or "none did",
    )
    o = figs["observer"]
    add(
        "observer: every endpoint answered in every incarnation, nothing malformed",
        o["bad"] == 0 and not o["unanswered"],
        f"{o['ok']} answers, {o['down']} while down, {o['timeouts']} slow, {o['bad']} malformed"
        + (f"; unanswered: {o['unanswered']}" if o["unanswered"] else "")
        + (f"; e.g. {o['bad_examples'][:2]}" if o["bad_examples"] else ""),
    )
    if soak.args.tier:
        lost = soak.rank_lost or {}
        add(
            "tier: a lost rank stops the survivor (exit 1), which names it",
            lost.get("survivor_exit") == 1 and bool(lost.get("named")),
            f"{lost}",
        )
    return out


def observer_figures(soak: Soak) -> dict:
    tallies = soak.observer.tallies
    unanswered = []
    for site in soak.sites:
        for n, (start, end) in enumerate(site.incarnations, start=1):
            for endpoint in ENDPOINTS:
                t = tallies[(site.rank, endpoint)]
                if not any(start <= at <= (end or float("inf")) for at in t.ok_at):
                    unanswered.append(f"rank {site.rank} incarnation {n}: {endpoint}")
    return {
        "ok": sum(t.ok for t in tallies.values()),
        "down": sum(t.down for t in tallies.values()),
        "timeouts": sum(t.timeouts for t in tallies.values()),
        "bad": sum(t.bad for t in tallies.values()),
        "bad_examples": [e for t in tallies.values() for e in t.bad_examples],
        "slowest_s": round(max(t.slowest_s for t in tallies.values()), 2),
        "unanswered": unanswered,
        "per_endpoint": {
            f"{rank}/{e}": {"ok": t.ok, "down": t.down, "timeouts": t.timeouts, "bad": t.bad}
            for (rank, e), t in tallies.items()
        },
    }


def figures(soak: Soak, warmup: float) -> dict:
    a = soak.args
    stores = []
    for site in soak.sites:
        last = next((s["sites"][site.rank] for s in reversed(soak.samples) if "step" in s["sites"][site.rank]), {})
        stores.append({"rank": site.rank, "last": last, "figures": store_figures(soak.samples, site.rank, warmup)})
    logged = [_losses(site.db) for site in soak.sites]
    steps = min(len(x) for x in logged)
    soak.say(f"plain torch: {steps:,} steps of the same job ...")
    want = plain_losses(steps, len(soak.sites))  # one part a rank
    got = logged[0][:steps]
    rel = max((abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)), default=float("inf"))
    losses: dict[str, Any] = {"steps": steps, "max_rel": rel, "first": got[:1], "last": got[-1:]}
    if a.tier:
        losses["ranks_alike"] = all(x[:steps] == logged[0][:steps] for x in logged)
    devices = [s.get("device_list", []) for s in soak.emulator_summaries]
    churn = {
        "leaves": sum(
            s.get("leaves", {}).get("graceful", 0) + s.get("leaves", {}).get("crash", 0)
            for s in soak.emulator_summaries
        ),
        "crashes": sum(s.get("leaves", {}).get("crash", 0) for s in soak.emulator_summaries),
        "rejoins": sum(s.get("rejoins", 0) for s in soak.emulator_summaries),
        "tiles": sum(s.get("tiles", 0) for s in soak.emulator_summaries),
        "overruns": sum(s.get("overruns", 0) for s in soak.emulator_summaries),
        "devices": sum(len(d) for d in devices),
    }
    return {
        "losses": losses,
        "stores": stores,
        "growth": growth(soak.samples, warmup),
        "observer": observer_figures(soak),
        "churn": churn,
        "relay": {
            "delay_s": a.relay_delay,
            "restarts": (soak.relay.incarnation - 1) if soak.relay else 0,
            "connections": soak.link.connections,
            "mb_delayed": round(soak.link.bytes_delayed / 1e6, 1),
            "unexpected_exits": soak.unexpected,
        },
        "forger_runs": soak.forger_runs,
        "rank_lost": soak.rank_lost,
    }


def _short(name: str) -> str:
    return name.replace("coordinator", "coord").replace("emulator", "emu").replace(" (observer)", "")


def tables(soak: Soak) -> list[Table]:
    """The samples: resident memory per process, open descriptors per process, and the books."""
    names = sorted({n for s in soak.samples for n in s["procs"]})
    mode = "a tier of 2" if soak.args.tier else "one coordinator"
    out = []
    for key, what, fmt in (("rss_mb", "resident memory (MB)", "{:.0f}"), ("fds", "open descriptors", "{}")):
        t = Table(title=f"soak, {mode}: {what} per process", title_justify="left")
        t.add_column("min", justify="right")
        t.add_column("sample")
        for n in names:
            t.add_column(_short(n), justify="right")
        for s in soak.samples:
            cells = [f"{s['t'] / 60:.1f}", s["label"]]
            cells += [fmt.format(s["procs"][n][key]) if n in s["procs"] else "-" for n in names]
            t.add_row(*cells)
        out.append(t)
    t = Table(title=f"soak, {mode}: the books per coordinator", title_justify="left")
    t.add_column("min", justify="right")
    t.add_column("sample")
    for site in soak.sites:
        r = f" r{site.rank}" if soak.args.tier else ""
        t.add_column(f"step{r}\n(computed)", justify="right")
        t.add_column(f"store MB{r}\npages / WAL", justify="right")
        t.add_column(f"rows{r}\ntiles / leases", justify="right")
        t.add_column(f"lost{r}", justify="right")
        t.add_column(f"forged{r}\nacc. / rej.", justify="right")
    for s in soak.samples:
        cells = [f"{s['t'] / 60:.1f}", s["label"]]
        for x in s["sites"]:
            if "step" not in x:
                cells += ["-"] * 5
                continue
            cells += [
                f"{x['step']:,} ({x['computed_steps']:,})",
                f"{x['pages_bytes'] / 1e6:.2f} / {x['wal_bytes'] / 1e6:.1f}",
                f"{x['rows'].get('tiles', 0):,} / {x['rows'].get('leases', 0):,}",
                str(x["lost"]),
                f"{x['forged_accepted']} / {x['forged_rejected']}",
            ]
        t.add_row(*cells)
    out.append(t)
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=60.0, help="length of the run (default: 60)")
    p.add_argument("--tier", action="store_true", help="a tier of two coordinators instead of one")
    p.add_argument("--sample-every", type=float, default=60.0, help="seconds between samples (default: 60)")
    p.add_argument("--warmup-minutes", type=float, default=None, help="minutes not judged (default: 1/6 of the run)")
    p.add_argument("--poll-every", type=float, default=5.0, help="seconds between the observer's polls (default: 5)")
    p.add_argument("--devices", type=int, default=4, help="emulated devices per coordinator (default: 4)")
    p.add_argument("--leave-rate", type=float, default=0.5, help="their leaves per device per minute (default: 0.5)")
    p.add_argument("--relay-delay", type=float, default=0.1, help="seconds the relay's replies are held (default: 0.1)")
    p.add_argument("--forgers-every", type=float, default=60.0, help="seconds between forger processes (default: 60)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default: 10)")
    p.add_argument("--keep", action="store_true", help="keep the run's folder (databases, logs)")
    p.add_argument("--json", action="store_true", help="print one JSON summary on stdout")
    p.add_argument("--out", type=Path, help="also write the JSON summary to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args()
    if args.minutes <= 0 or args.sample_every <= 0 or args.poll_every <= 0:
        p.error("--minutes, --sample-every and --poll-every must be above 0")
    warmup = 60 * (args.warmup_minutes if args.warmup_minutes is not None else args.minutes / 6)

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    folder = Path(tempfile.mkdtemp(prefix="cleave-soak-"))
    keep = args.keep
    try:
        return soak_and_report(args, folder, warmup)
    except SoakError as exc:
        keep = True
        err.print(f"[red]FAIL the soak could not go on:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        err.print("interrupted: every process this run started was killed")
        return 130
    finally:
        if keep:
            err.print(f"files kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


def _event(e: dict) -> str:
    steps = "/".join(str(x) for x in e.get("steps", []))
    if e["kind"] == "kill":
        return f"{e['why']} at {e['t'] / 60:.1f} min (step {steps})"
    if e["kind"] == "restart":
        return f"back {e['seconds']:.0f} s later, resumed at step {steps}"
    if e["kind"] == "rank lost":
        return (
            f"rank 1 lost at {e['t'] / 60:.1f} min: rank 0 exited {e['survivor_exit']} "
            f"{e['stopped_after_s']:.0f} s later{', naming it' if e['named'] else ''}"
        )
    if e["kind"] == "unexpected exit":
        return e["what"]
    return f"{e['kind']} at {e['t'] / 60:.1f} min"


def soak_and_report(args: argparse.Namespace, folder: Path, warmup: float) -> int:
    soak = Soak(args, folder)
    try:
        soak.run()
    finally:
        soak.observer.close()
        soak.link.close()
        soak.children.kill_all()
    figs = figures(soak, warmup)
    result_goals = goals(soak, figs)
    summary = {
        "config": {
            "mode": "tier" if args.tier else "single",
            "minutes": args.minutes,
            "warmup_minutes": warmup / 60,
            "sample_every_s": args.sample_every,
            "model": MODEL,
            "batch_size": BATCH,
            "seq_len": SEQ_LEN,
            "steps_configured": STEPS,
            "devices_per_coordinator": args.devices,
            "leave_rate": args.leave_rate,
            "relay_delay_s": args.relay_delay,
            "relay_cache_gb": RELAY_CACHE_GB,
            "forgers_every_s": args.forgers_every,
            "checkpoint_every": args.checkpoint_every,
            "cpu_count": os.cpu_count(),
        },
        "events": soak.events,
        "figures": figs,
        "goals": [g.__dict__ for g in result_goals],
        "samples": soak.samples,
        "passed": all(g.status != "FAIL" for g in result_goals),
    }
    text = json.dumps(summary, indent=2, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    console = Console(width=max(160, Console().width))
    if args.json:
        print(text)
    else:
        for t in tables(soak):
            console.print(t)
        f = figs
        console.print(
            f"churn: {f['churn']['leaves']} leaves ({f['churn']['crashes']} crashes), {f['churn']['rejoins']} "
            f"rejoins; slow relay ({args.relay_delay:g} s): {f['relay']['restarts']} restarts, "
            f"{f['relay']['mb_delayed']} MB held back; tiles lost: "
            f"{[s['last'].get('lost_why') for s in f['stores']]}; " + "; ".join(_event(e) for e in soak.events),
            highlight=False,
        )
    for g in result_goals:
        colour = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}[g.status]
        (err if args.json else console).print(f"[{colour}]{g.status}[/] {g.name}: {g.detail}", highlight=False)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
