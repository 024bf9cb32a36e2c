"""When may this machine work? The volunteer's rules, and a state machine that keeps them.

Pausing is immediate: the moment a rule says stop (the owner touched the keyboard, pulled the
plug, started a game, the fans spin up), work stops. Resuming is patient: every rule must hold,
with a margin, for ``resume_after`` seconds, so a machine hovering around a limit does not flap.

Rules come from defaults < the TOML config file < command-line flags. Pure: readings and the
time of day are passed in.
"""

from __future__ import annotations

import datetime as dt
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from cleave.client.idle import Reading
from cleave.client.paths import user_dir
from cleave.wire.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CPU_MARGIN = 15.0  # resume only below max_other_cpu minus this
BATTERY_MARGIN = 5.0  # ... only above min_battery plus this
TEMP_MARGIN = 10.0  # ... only below max_temp minus this
CPU_SMOOTHING = 0.4  # weight of a new CPU sample: one busy second is not a trend


class PolicyError(ConfigError):
    """A volunteer's policy (client.toml or flags) that cannot be used."""


@dataclass(frozen=True)
class PolicyConfig:
    idle_minutes: float = 3.0  # keyboard and mouse untouched this long (where the OS tells)
    require_ac: bool = True  # laptops work only while plugged in
    min_battery: float = 40.0  # percent; the floor when require_ac is off
    max_other_cpu: float = 50.0  # percent of the machine other programs may use before we yield
    max_temp: float = 90.0  # degrees C of the hottest sensor
    hours: str = ""  # e.g. "22:00-07:00"; empty means any time
    max_threads: int = 0  # 0: torch's choice
    max_memory_mb: int = 0  # cap on cached tile blocks; 0: a quarter of the machine's memory
    resume_after: float = 30.0  # seconds every rule must hold before work resumes

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.idle_minutes <= 24 * 60, "idle_minutes must be between 0 and 1440"),
            (0 <= self.min_battery <= 100, "min_battery must be between 0 and 100"),
            (0 < self.max_other_cpu <= 100, "max_other_cpu must be in (0, 100]"),
            (30 <= self.max_temp <= 120, "max_temp must be between 30 and 120"),
            (0 <= self.max_threads <= 1024, "max_threads must be between 0 and 1024"),
            (0 <= self.max_memory_mb <= 10_000_000, "max_memory_mb must be between 0 and 10,000,000"),
            (0 <= self.resume_after <= 3600, "resume_after must be between 0 and 3600"),
        ]
        for ok, message in checks:
            if not ok:
                raise PolicyError(message)
        parse_hours(self.hours)

    @classmethod
    def always(cls) -> PolicyConfig:
        """No rules: dedicated machines, demos and tests (``cleave join --always``)."""
        return cls(
            idle_minutes=0.0, require_ac=False, min_battery=0.0, max_other_cpu=100.0, max_temp=120.0, resume_after=0.0
        )

    def to_toml(self) -> str:
        lines = ["[policy]"]
        for key, value in asdict(self).items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = f'"{value}"'
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        return "\n".join(lines) + "\n"


def parse_hours(hours: str) -> tuple[dt.time, dt.time] | None:
    """``"22:00-07:00"`` -> (start, end); wraps past midnight. Empty: any time."""
    if not hours.strip():
        return None
    try:
        start, end = (dt.time.fromisoformat(part.strip()) for part in hours.split("-"))
    except ValueError:
        raise PolicyError(f"hours must look like 22:00-07:00, got {hours!r}") from None
    return start, end


def within(hours: tuple[dt.time, dt.time] | None, now: dt.time) -> bool:
    if hours is None:
        return True
    start, end = hours
    if start == end:  # "00:00-00:00": the whole day
        return True
    return start <= now < end if start < end else (now >= start or now < end)


def default_config_path() -> Path:
    return user_dir("config") / "client.toml"


def load_config(path: Path | None, overrides: dict[str, Any]) -> tuple[PolicyConfig, Path | None]:
    """Defaults, then the file (``path``, or the default location if it exists), then flags."""
    source = path if path is not None else default_config_path()
    values: dict[str, Any] = {}
    used: Path | None = None
    if source.exists():
        try:
            data = tomllib.loads(source.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise PolicyError(f"cannot read {source}: {exc}") from None
        section = data.get("policy", {})
        known = {f.name: f for f in fields(PolicyConfig)}
        if not isinstance(section, dict):
            raise PolicyError(f"{source}: [policy] must be a table")
        for key, value in section.items():
            if key not in known:
                raise PolicyError(f"{source}: unknown setting {key!r} (known: {', '.join(known)})")
            want = type(getattr(PolicyConfig(), key))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise PolicyError(f"{source}: {key} must be a {want.__name__}, got {value!r}")
            values[key] = value
        used = source
    elif path is not None:
        raise PolicyError(f"--config {path}: no such file")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return PolicyConfig(**values), used


@dataclass(frozen=True)
class Decision:
    run: bool
    reason: str  # why not, or what the machine is doing; shown to owner and coordinator


class Policy:
    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._hours = parse_hours(config.hours)
        self._running = True
        self._clear_since: float | None = None
        self._cpu: float | None = None

    def _objection(self, r: Reading, clock: dt.time, running: bool) -> str | None:
        """Why the machine may not work; stricter thresholds when resuming (hysteresis)."""
        c = self.config
        cpu_limit = c.max_other_cpu if running else max(0.0, c.max_other_cpu - CPU_MARGIN)
        battery_floor = c.min_battery if running else min(100.0, c.min_battery + BATTERY_MARGIN)
        temp_limit = c.max_temp if running else c.max_temp - TEMP_MARGIN
        if not within(self._hours, clock):
            return f"outside allowed hours {c.hours}"
        if r.on_ac is False and c.require_ac:
            return "on battery"
        if r.on_ac is False and r.battery_percent is not None and r.battery_percent < battery_floor:
            bound = f"floor {battery_floor:.0f}%" if running else f"resumes above {battery_floor:.0f}%"
            return f"battery at {r.battery_percent:.0f}% ({bound})"
        if r.user_idle_seconds is not None and r.user_idle_seconds < 60 * c.idle_minutes:
            return f"owner active {r.user_idle_seconds:.0f} s ago (needs {c.idle_minutes:g} min idle)"
        if self._cpu is not None and self._cpu > cpu_limit:
            bound = f"limit {cpu_limit:.0f}%" if running else f"resumes below {cpu_limit:.0f}%"
            return f"other programs use {self._cpu:.0f}% CPU ({bound})"
        if r.temperature_c is not None and r.temperature_c > temp_limit:
            bound = f"limit {temp_limit:.0f} C" if running else f"resumes below {temp_limit:.0f} C"
            return f"too hot: {r.temperature_c:.0f} C ({bound})"
        return None

    def decide(self, reading: Reading, now: float, clock: dt.time) -> Decision:
        if reading.other_cpu_percent is not None:
            sample = reading.other_cpu_percent
            self._cpu = sample if self._cpu is None else (1 - CPU_SMOOTHING) * self._cpu + CPU_SMOOTHING * sample
        objection = self._objection(reading, clock, self._running)
        if self._running:
            if objection is not None:
                self._running, self._clear_since = False, None
                return Decision(False, objection)
            return Decision(True, "allowed")
        if objection is not None:
            self._clear_since = None
            return Decision(False, objection)
        if self._clear_since is None:
            self._clear_since = now
        waited = now - self._clear_since
        if waited >= self.config.resume_after:
            self._running = True
            return Decision(True, "allowed")
        return Decision(False, f"machine free again; resuming in {self.config.resume_after - waited:.0f} s")
