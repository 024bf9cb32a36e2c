"""Real processes for end-to-end tests: a coordinator, clients, test doubles, on 127.0.0.1."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from conftest import ROOT, TIMEOUT

TOKEN = "test-token"  # the join token
OPERATOR = "test-operator"  # the operator token (cleave status)
_URL = re.compile(r"listening on (wss?://\S+)")


def cleave_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cleave", *args]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_WAIT_POLICY"] = "PASSIVE"
    e["PYTHONUNBUFFERED"] = "1"
    return e


# --------------------------------------------------------------------------- the fork server
#
# tests/zygote.py imports torch once and forks the tests' `cleave` processes from it: a process
# that would spend 2.3 s of CPU importing torch starts in milliseconds (the suite is CPU-bound
# on two cores). CLEAVE_TEST_ZYGOTE=0 starts every process afresh instead.

_ZYGOTE: list = []  # (its Popen, its socket's path), started once per test process


def _zygote_path() -> str | None:
    if os.environ.get("CLEAVE_TEST_ZYGOTE", "1") == "0" or not hasattr(socket, "send_fds"):
        return None
    if not _ZYGOTE:
        path = os.path.join(tempfile.mkdtemp(prefix="cleave-zygote-"), "sock")
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "zygote.py"), path],
            stdin=subprocess.PIPE,  # the zygote leaves when this process does (its stdin closes)
            stdout=subprocess.PIPE,
            text=True,
            env=env(),
            cwd=ROOT,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "the zygote did not start"
        _ZYGOTE.append((proc, path))
    return _ZYGOTE[0][1]


class Forked:
    """A process the zygote forked, with the part of Popen's interface the tests use."""

    def __init__(
        self, args: list[str], path: str, stdin: int, stdout: int, stderr: int, extra_env: dict[str, str] | None = None
    ) -> None:
        self.args = args
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(path)
        request = {"argv": args[1:], "env": {**env(), **(extra_env or {})}, "cwd": str(ROOT)}
        socket.send_fds(self._conn, [json.dumps(request).encode()], [stdin, stdout, stderr])
        self._reader = self._conn.makefile("r")
        self.pid = int(json.loads(self._reader.readline())["pid"])
        self.returncode: int | None = None
        self.stdout = None
        self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def _ended(self) -> None:
        line = self._reader.readline()
        status = json.loads(line)["status"] if line else 9  # the zygote gone: as if killed
        self.returncode = os.waitstatus_to_exitcode(status)
        self._reader.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def start(
    cmd: list[str], *, stdout: int, stderr: int, extra_env: dict[str, str] | None = None
) -> subprocess.Popen | Forked:
    """``cmd`` as a child with stdin from /dev/null: forked by the zygote when it is a Python
    command (``[sys.executable, ...]``), else started afresh. ``stdout``/``stderr``: pipes'
    write ends or ``subprocess.STDOUT`` (stderr with stdout); the caller closes them.
    ``extra_env``: variables added to its environment (secrets: other users can read argv)."""
    path = _zygote_path() if cmd and cmd[0] == sys.executable else None
    if path is None:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env={**env(), **(extra_env or {})}, cwd=ROOT
        )
    with open(os.devnull, "rb") as devnull:
        out = stdout if stderr == subprocess.STDOUT else stderr
        return Forked(cmd, path, devnull.fileno(), stdout, out, extra_env)


def _pipe() -> tuple[io.TextIOWrapper, int]:
    r, w = os.pipe()
    return os.fdopen(r, "r"), w


class Proc:
    """A child process whose output is collected by a thread (so its pipe never fills)."""

    running: list[Proc] = []  # killed after each test by conftest, whatever happened

    def __init__(self, cmd: list[str], name: str, extra_env: dict[str, str] | None = None) -> None:
        Proc.running.append(self)
        self.name = name
        self.lines: list[str] = []
        out, w = _pipe()
        try:
            self.proc = start(cmd, stdout=w, stderr=subprocess.STDOUT, extra_env=extra_env)
        finally:
            os.close(w)
        self.proc.stdout = out  # type: ignore[assignment]
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout: float = 2 * TIMEOUT) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.name} did not finish in {timeout} s; output:\n{self.output}") from None
        self._reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Coordinator(Proc):
    def __init__(
        self,
        tmp: Path,
        *args: str,
        steps: int = 20,
        token: str = TOKEN,
        port: int = 0,
        operator: str = OPERATOR,
        planner: str = "uniform",
        linger: float = 0,
    ) -> None:
        # ``uniform`` unless a test asks for the cost planner: these tests are about tiles on
        # clients, and the cost model rightly keeps every GEMM of the tiny model on the PS.
        self.db = tmp / "cleave.db"
        self.metrics_path = tmp / "metrics.jsonl"
        super().__init__(
            cleave_cmd(
                "coordinator",
                "start",
                "--port",
                str(port),
                "--db",
                str(self.db),
                "--steps",
                str(steps),
                "--metrics",
                str(self.metrics_path),
                "--planner",
                planner,
                "--linger",
                str(linger),
                # One held-out batch for the evaluation at the job's last step, not 4: it still goes
                # through the fleet, at a quarter of the cost, and the training losses do not depend
                # on it. A test's own --eval-batches, after, wins.
                "--eval-batches",
                "1",
                *args,
            ),
            "coordinator",
            # The tokens as an operator should pass them: by environment, never on the command line.
            extra_env={"CLEAVE_TOKEN": token, "CLEAVE_OPERATOR_TOKEN": operator},
        )
        self.url = self._await_url()

    def _await_url(self) -> str:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := _URL.search(line):
                    return m.group(1)
            if self.proc.poll() is not None:
                raise AssertionError(f"coordinator exited early:\n{self.output}")
            time.sleep(0.05)
        raise AssertionError(f"coordinator never listened:\n{self.output}")

    def losses(self) -> list[float]:
        return [row["loss"] for row in metrics(self.metrics_path)]

    def rows(self) -> list[dict]:
        """Every step's metrics row (loss, seconds, predicted_s, traffic...)."""
        return metrics(self.metrics_path)

    def steps_done(self) -> int:
        return len(metrics(self.metrics_path)) if self.metrics_path.exists() else 0

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + 2 * TIMEOUT
        while self.steps_done() < step:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"step {step} never came:\n{self.output}")
            time.sleep(0.05)

    def query(self, sql: str, *params: object) -> list[tuple]:
        with sqlite3.connect(self.db) as conn:
            return conn.execute(sql, params).fetchall()


def join_cmd(url: str, name: str, *args: str, token: str | None = TOKEN) -> list[str]:
    """``cleave join`` as the tests run it: one thread, on the CPU, always idle, until the job ends
    (``token`` None: no --token, for a token given by environment)."""
    given = ("--token", token) if token is not None else ()
    return cleave_cmd(
        "join", url, *given, "--once", "--threads", "1", "--name", name, "--device", "cpu", "--always", *args
    )


def join(url: str, name: str, *args: str, token: str = TOKEN) -> Proc:
    """A volunteer, its join token in its environment (CLEAVE_TOKEN), as it should be given."""
    return Proc(join_cmd(url, name, "--quiet", *args, token=None), name, extra_env={"CLEAVE_TOKEN": token})


def double(mode: str, url: str, name: str, *args: str) -> Proc:
    """A misbehaving client from tests/doubles.py."""
    return Proc([sys.executable, str(ROOT / "tests" / "doubles.py"), mode, url, TOKEN, name, *args], name)


def metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until(predicate, timeout: float = TIMEOUT, what: str = "condition") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_all(*commands: list[str], timeout: float = TIMEOUT) -> list[subprocess.CompletedProcess[str]]:
    """Independent commands run side by side; like ``subprocess.run(command, capture_output=True,
    text=True)`` for each, in order."""
    started = []
    for command in commands:
        (out, w_out), (err, w_err) = _pipe(), _pipe()
        try:
            proc = start(command, stdout=w_out, stderr=w_err)
        finally:
            os.close(w_out)
            os.close(w_err)
        texts: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda f=f, k=k, t=texts: t.__setitem__(k, f.read()), daemon=True)
            for f, k in ((out, "out"), (err, "err"))
        ]
        for t in readers:
            t.start()
        started.append((command, proc, readers, texts, (out, err)))
    done = []
    deadline = time.monotonic() + timeout
    for command, proc, readers, texts, files in started:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, p, *_ in started:
                p.kill()
            raise AssertionError(f"{command} did not finish in {timeout} s") from None
        for t in readers:
            t.join(10)
        for f in files:
            f.close()
        done.append(subprocess.CompletedProcess(command, proc.returncode, texts.get("out", ""), texts.get("err", "")))
    return done


class Terminal:
    """A command in a real terminal (a detached tmux session, ``width`` x ``height``): what a
    person would see. The command's exit status is printed after it as ``exit=N``; the session
    stays open for a minute so the screen can still be read, and ``close`` ends it."""

    def __init__(self, command: list[str], width: int = 110, height: int = 20) -> None:
        self.session = f"cleave-test-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        environment = " ".join(
            f"{k}={v}"
            for k, v in env().items()
            if k in ("PYTHONPATH", "OMP_WAIT_POLICY", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
        )
        line = f"cd {ROOT} && env {environment} {' '.join(command)}; echo exit=$?; sleep 60"
        subprocess.run(
            ["tmux", "new-session", "-d", "-s", self.session, "-x", str(width), "-y", str(height), line], check=True
        )

    def screen(self, history: bool = False) -> str:
        """The visible screen (and, with ``history``, the lines scrolled off it)."""
        back = ["-S", "-500"] if history else []
        return subprocess.run(
            ["tmux", "capture-pane", "-p", *back, "-t", self.session], capture_output=True, text=True
        ).stdout

    def exit_code(self) -> int | None:
        """The command's exit status once it has ended, else None."""
        found = re.findall(r"^exit=(\d+)\s*$", self.screen(history=True), re.M)
        return int(found[-1]) if found else None

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@functools.cache
def local_losses(steps: int, **options: object) -> tuple[float, ...]:
    """Plain torch's losses for these ``TrainConfig`` options, in this process; computed once per
    configuration for the whole session (training is deterministic: same options, same losses)."""
    from cleave.coordinator.training.loop import TrainConfig, Trainer

    return tuple(r.loss for r in Trainer(TrainConfig(steps=steps, **options)).run())  # type: ignore[arg-type]
