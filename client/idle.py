"""Is this machine free to work? Power, battery, other processes' CPU, user input, heat.

Each probe degrades on its own: a value it cannot read is ``None`` together with a sentence in
``Reading.notes`` saying why (shown by ``cleave join --verbose``). The policy treats unknown
values as "no objection", so a desktop without a battery or a headless server without a login
session still works, and says so.

``SystemProbe`` reads the real machine (psutil where it serves); ``FileProbe`` reads a JSON file
so tests and demos can play "the owner unplugged the laptop" on a running client.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import psutil


@dataclass(frozen=True)
class Reading:
    on_ac: bool | None = None  # None: no battery (a desktop) or unknown
    battery_percent: float | None = None
    other_cpu_percent: float | None = None  # 0-100 of the whole machine, Cleave's own excluded
    user_idle_seconds: float | None = None
    temperature_c: float | None = None  # hottest readable sensor
    notes: dict[str, str] = field(default_factory=dict)  # probe -> why it reads None


class Probe(Protocol):
    def read(self) -> Reading: ...


Run = Callable[[list[str]], str]


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=2, check=True).stdout


class SystemProbe:
    """The real machine. Cheap enough to call every second."""

    def __init__(self, run: Run = _run, system: str | None = None) -> None:
        self._run = run
        self._system = system or platform.system()
        self._own: dict[int, psutil.Process] = {}
        self._own_scanned = 0.0
        psutil.cpu_percent(interval=None)  # prime: the first call always says 0

    def read(self) -> Reading:
        notes: dict[str, str] = {}
        on_ac, battery = self._power(notes)
        return Reading(on_ac, battery, self._other_cpu(notes), self._user_idle(notes), self._temperature(notes), notes)

    # --- power
    def _power(self, notes: dict[str, str]) -> tuple[bool | None, float | None]:
        try:
            battery = psutil.sensors_battery()
        except (AttributeError, NotImplementedError, OSError) as exc:
            notes["power"] = f"battery not readable here ({type(exc).__name__})"
            return None, None
        if battery is None:
            notes["power"] = "no battery: treated as a machine on mains power"
            return None, None
        return bool(battery.power_plugged) if battery.power_plugged is not None else None, float(battery.percent)

    # --- CPU used by everything except Cleave
    def _own_processes(self) -> list[psutil.Process]:
        now = time.monotonic()
        if now - self._own_scanned > 10.0:  # a full scan is costly: every 10 s is plenty
            self._own_scanned = now
            found = {}
            for proc in psutil.process_iter(["cmdline"]):
                if proc.pid == os.getpid() or is_cleave(proc.info.get("cmdline") or []):
                    found[proc.pid] = self._own.get(proc.pid, proc)
            self._own = found
        return list(self._own.values())

    def _other_cpu(self, notes: dict[str, str]) -> float | None:
        try:
            total = psutil.cpu_percent(interval=None)  # whole machine, since the last call
            ours = 0.0
            for proc in self._own_processes():
                try:
                    ours += proc.cpu_percent(interval=None)  # per core, since the last call
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            return max(0.0, total - ours / (psutil.cpu_count() or 1))
        except (OSError, RuntimeError) as exc:
            notes["cpu"] = f"CPU load not readable ({exc})"
            return None

    # --- user input
    def _user_idle(self, notes: dict[str, str]) -> float | None:
        try:
            if self._system == "Darwin":
                return _macos_idle(self._run(["ioreg", "-c", "IOHIDSystem"]))
            if self._system == "Windows":
                return _windows_idle()
            return self._linux_idle(notes)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            notes["input"] = f"user idle time not readable ({type(exc).__name__}: {exc})"
            return None

    def _linux_idle(self, notes: dict[str, str]) -> float | None:
        if shutil.which("xprintidle") and os.environ.get("DISPLAY"):
            return int(self._run(["xprintidle"]).strip()) / 1000.0
        session = os.environ.get("XDG_SESSION_ID")
        if session and shutil.which("loginctl"):
            out = self._run(["loginctl", "show-session", session, "-p", "IdleHint", "-p", "IdleSinceHintMonotonic"])
            return _logind_idle(out, time.clock_gettime(time.CLOCK_MONOTONIC))
        notes["input"] = (
            "no graphical or logind session to ask (headless?): keyboard and mouse activity "
            "unknown, so only CPU load, power and heat decide"
        )
        return None

    # --- heat
    def _temperature(self, notes: dict[str, str]) -> float | None:
        reader = getattr(psutil, "sensors_temperatures", None)
        if reader is None:
            notes["heat"] = "temperature sensors not supported on this platform"
            return None
        try:
            sensors = reader()
        except (OSError, RuntimeError) as exc:
            notes["heat"] = f"temperature sensors not readable ({exc})"
            return None
        temps = [t.current for entries in sensors.values() for t in entries if t.current and t.current > 0]
        if not temps:
            notes["heat"] = "no temperature sensor readable"
            return None
        return max(temps)


def is_cleave(cmdline: list[str]) -> bool:
    """``cleave ...`` or ``python -m cleave ...``: not an editor that happens to be in a
    folder called cleave."""
    if not cmdline:
        return False
    if Path(cmdline[0]).name in ("cleave", "cleave.exe"):
        return True
    return any(Path(arg).name in ("cleave", "cleave.exe") or arg in ("cleave", "cleave.cli") for arg in cmdline[1:3])


def _macos_idle(ioreg: str) -> float:
    match = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', ioreg)
    if match is None:
        raise ValueError("HIDIdleTime missing from ioreg output")
    return int(match.group(1)) / 1e9  # nanoseconds


def _logind_idle(show_session: str, monotonic_now: float) -> float:
    values = dict(line.split("=", 1) for line in show_session.strip().splitlines() if "=" in line)
    if values.get("IdleHint") != "yes":
        return 0.0  # logind says the user is active
    since = int(values.get("IdleSinceHintMonotonic", "0"))  # microseconds
    return max(0.0, monotonic_now - since / 1e6) if since else 0.0


def _windows_idle() -> float:  # pragma: no cover - Windows only
    class LastInput(ctypes.Structure):
        _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]

    info = LastInput()
    info.cbSize = ctypes.sizeof(info)
    if not ctypes.windll.user32.GetLastInputInfo(ctypes.byref(info)):  # type: ignore[attr-defined]
        raise OSError("GetLastInputInfo failed")
    return (ctypes.windll.kernel32.GetTickCount() - info.dwTime) / 1000.0  # type: ignore[attr-defined]


class FileProbe:
    """Readings from a JSON file (keys as in Reading), re-read on every call; for tests and demos.
    Fields the file leaves out come from ``base`` (or are unknown)."""

    def __init__(self, path: str | Path, base: Probe | None = None) -> None:
        self.path = Path(path)
        self.base = base

    def read(self) -> Reading:
        reading = self.base.read() if self.base is not None else Reading()
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            return replace(reading, notes={**reading.notes, "file": f"{self.path}: {exc}"})
        known = {k: v for k, v in data.items() if k in Reading.__dataclass_fields__ and k != "notes"}
        return replace(reading, **known)
