"""Real processes for end-to-end tests: a coordinator, clients, test doubles, on 127.0.0.1."""

from __future__ import annotations

import functools
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ROOT, TIMEOUT

TOKEN = "test-token"  # the join token
OPERATOR = "test-operator"  # the operator token (cleave status)
_URL = re.compile(r"listening on (wss?://\S+)")


def cleave_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cleave_cli", *args]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_WAIT_POLICY"] = "PASSIVE"
    e["PYTHONUNBUFFERED"] = "1"
    return e


class Proc:
    """A child process whose output is collected by a thread (so its pipe never fills)."""

    running: list[Proc] = []  # killed after each test by conftest, whatever happened

    def __init__(self, cmd: list[str], name: str) -> None:
        Proc.running.append(self)
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env(),
            cwd=ROOT,
        )
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
                "--token",
                token,
                "--operator-token",
                operator,
                "--steps",
                str(steps),
                "--metrics",
                str(self.metrics_path),
                "--planner",
                planner,
                "--linger",
                str(linger),
                *args,
            ),
            "coordinator",
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


def join_cmd(url: str, name: str, *args: str, token: str = TOKEN) -> list[str]:
    """``cleave join`` as the tests run it: one thread, on the CPU, always idle, until the job ends."""
    return cleave_cmd(
        "join", url, "--token", token, "--once", "--threads", "1", "--name", name, "--device", "cpu", "--always", *args
    )


def join(url: str, name: str, *args: str, token: str = TOKEN) -> Proc:
    return Proc(join_cmd(url, name, "--quiet", *args, token=token), name)


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
    """Independent commands run side by side (each mostly imports torch: two cores, half the wait);
    like ``subprocess.run(command, capture_output=True, text=True)`` for each, in order."""
    started = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
        for command in commands
    ]
    done = []
    for command, proc in zip(commands, started):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in started:
                p.kill()
            raise AssertionError(f"{command} did not finish in {timeout} s") from None
        done.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
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
    from coordinator.training.loop import TrainConfig, Trainer

    return tuple(r.loss for r in Trainer(TrainConfig(steps=steps, **options)).run())  # type: ignore[arg-type]
