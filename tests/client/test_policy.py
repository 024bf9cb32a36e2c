"""The volunteer's rules: probes with faked inputs, and the policy state machine."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from cleave.client.idle import FileProbe, Reading, SystemProbe, _logind_idle, _macos_idle
from cleave.client.policy import Policy, PolicyConfig, PolicyError, load_config, parse_hours, within

NOON = dt.time(12, 0)
FREE = Reading(on_ac=True, battery_percent=90.0, other_cpu_percent=5.0, user_idle_seconds=3600.0, temperature_c=50.0)


def _policy(**config: object) -> Policy:
    config.setdefault("resume_after", 30.0)
    return Policy(PolicyConfig(**config))  # type: ignore[arg-type]


def test_a_free_machine_works() -> None:
    assert _policy().decide(FREE, 0.0, NOON).run


@pytest.mark.parametrize(
    "reading, reason",
    [
        (Reading(on_ac=False, battery_percent=95.0), "on battery"),
        (Reading(user_idle_seconds=12.0), "owner active 12 s ago"),
        (Reading(temperature_c=97.0), "too hot: 97 C"),
    ],
)
def test_each_rule_pauses_at_once_and_says_why(reading: Reading, reason: str) -> None:
    policy = _policy()
    assert policy.decide(FREE, 0.0, NOON).run
    decision = policy.decide(reading, 1.0, NOON)
    assert not decision.run and decision.reason.startswith(reason)


def test_sustained_load_from_other_programs_pauses_within_seconds() -> None:
    policy = _policy(max_other_cpu=50.0)
    for t in range(5):
        policy.decide(Reading(other_cpu_percent=10.0), float(t), NOON)
    decisions = [policy.decide(Reading(other_cpu_percent=95.0), float(t), NOON) for t in range(5, 9)]
    assert decisions[0].run  # one busy second is not a trend
    assert not decisions[1].run and decisions[1].reason.startswith("other programs use")
    assert "(limit 50%)" in decisions[1].reason and "(resumes below 35%)" in decisions[2].reason


def test_battery_floor_applies_when_battery_work_is_allowed() -> None:
    policy = _policy(require_ac=False, min_battery=40.0)
    assert policy.decide(Reading(on_ac=False, battery_percent=80.0), 0.0, NOON).run
    decision = policy.decide(Reading(on_ac=False, battery_percent=35.0), 1.0, NOON)
    assert not decision.run and "battery at 35% (floor 40%)" in decision.reason


def test_outside_allowed_hours_including_across_midnight() -> None:
    policy = _policy(hours="22:00-07:00")
    assert not policy.decide(FREE, 0.0, NOON).run
    assert policy.decide(FREE, 0.0, NOON).reason == "outside allowed hours 22:00-07:00"
    night = _policy(hours="22:00-07:00")
    assert night.decide(FREE, 0.0, dt.time(23, 30)).run and night.decide(FREE, 1.0, dt.time(6, 59)).run


def test_unknown_readings_do_not_object() -> None:
    assert _policy().decide(Reading(), 0.0, NOON).run  # headless desktop: no battery, no input info


def test_resuming_waits_for_the_machine_to_stay_free() -> None:
    policy = _policy()
    assert not policy.decide(Reading(on_ac=False), 0.0, NOON).run
    assert not policy.decide(FREE, 1.0, NOON).run  # plugged back in: not yet
    assert "resuming in 29 s" in policy.decide(FREE, 2.0, NOON).reason
    assert not policy.decide(Reading(on_ac=False), 10.0, NOON).run  # unplugged again: the wait restarts
    assert not policy.decide(FREE, 11.0, NOON).run
    assert not policy.decide(FREE, 40.0, NOON).run
    assert policy.decide(FREE, 41.0, NOON).run


def test_hysteresis_stops_flapping_around_a_limit() -> None:
    policy = _policy(max_other_cpu=50.0, resume_after=0.0)
    for t in range(5):  # a machine that keeps running at 60% other load pauses and stays paused
        policy.decide(Reading(other_cpu_percent=60.0), float(t), NOON)
    assert not policy.decide(Reading(other_cpu_percent=60.0), 5.0, NOON).run
    for t in range(6, 20):  # back to 42%: below the limit but inside the margin: still paused
        decision = policy.decide(Reading(other_cpu_percent=42.0), float(t), NOON)
    assert not decision.run and "resumes below 35%" in decision.reason
    for t in range(20, 30):
        decision = policy.decide(Reading(other_cpu_percent=10.0), float(t), NOON)
    assert decision.run
    hot = _policy(max_temp=90.0, resume_after=0.0)
    hot.decide(Reading(temperature_c=95.0), 0.0, NOON)
    assert not hot.decide(Reading(temperature_c=85.0), 1.0, NOON).run  # needs 80 C to resume
    assert hot.decide(Reading(temperature_c=79.0), 2.0, NOON).run


def test_a_single_cpu_spike_does_not_pause() -> None:
    policy = _policy(max_other_cpu=50.0)
    for t in range(5):
        policy.decide(Reading(other_cpu_percent=10.0), float(t), NOON)
    assert policy.decide(Reading(other_cpu_percent=90.0), 5.0, NOON).run  # smoothed: 42%


def test_config_file_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text('[policy]\nidle_minutes = 10\nrequire_ac = false\nhours = "22:00-06:00"\n')
    config, used = load_config(path, {"idle_minutes": 1.5, "max_temp": None})
    assert used == path and config.idle_minutes == 1.5 and not config.require_ac and config.hours == "22:00-06:00"
    assert 'hours = "22:00-06:00"' in config.to_toml() and "[policy]" in config.to_toml()


@pytest.mark.parametrize(
    "text, message",
    [
        ("[policy]\nidle_minuts = 3\n", "unknown setting 'idle_minuts'"),
        ("[policy]\nrequire_ac = 3\n", "require_ac must be a bool"),
        ("[policy]\nmax_other_cpu = 0\n", "max_other_cpu"),
        ('[policy]\nhours = "late"\n', "hours must look like"),
        ("[policy\n", "cannot read"),
    ],
)
def test_bad_config_files_get_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "client.toml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=message):
        load_config(path, {})


def test_a_named_config_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no such file"):
        load_config(tmp_path / "missing.toml", {})


def test_hours_parsing() -> None:
    assert parse_hours("") is None
    assert within(parse_hours("08:00-18:00"), NOON) and not within(parse_hours("08:00-11:00"), NOON)


def test_macos_and_logind_idle_parsers() -> None:
    assert _macos_idle('  | |   "HIDIdleTime" = 5000000000\n') == 5.0
    assert _logind_idle("IdleHint=no\nIdleSinceHintMonotonic=0\n", 100.0) == 0.0
    assert _logind_idle("IdleHint=yes\nIdleSinceHintMonotonic=40000000\n", 100.0) == 60.0
    with pytest.raises(ValueError):
        _macos_idle("nothing here")


def test_system_probe_reads_this_machine_and_explains_what_it_cannot() -> None:
    reading = SystemProbe().read()
    assert reading.other_cpu_percent is None or 0.0 <= reading.other_cpu_percent <= 100.0
    for name, value in (
        ("power", reading.on_ac),
        ("input", reading.user_idle_seconds),
        ("heat", reading.temperature_c),
    ):
        if value is None:
            assert reading.notes.get(name), f"{name} unknown without a reason"


def test_system_probe_on_a_mac_asks_ioreg() -> None:
    calls = []

    def run(cmd: list[str]) -> str:
        calls.append(cmd)
        return '"HIDIdleTime" = 2500000000'

    assert SystemProbe(run=run, system="Darwin").read().user_idle_seconds == 2.5
    assert calls[0][0] == "ioreg"


def test_system_probe_survives_a_failing_command() -> None:
    def run(cmd: list[str]) -> str:
        raise OSError("ioreg: not found")

    reading = SystemProbe(run=run, system="Darwin").read()
    assert reading.user_idle_seconds is None and "ioreg: not found" in reading.notes["input"]


def test_file_probe_overrides_only_what_the_file_says(tmp_path: Path) -> None:
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"on_ac": False, "battery_percent": 50}))

    class Base:
        def read(self) -> Reading:
            return Reading(temperature_c=40.0)

    reading = FileProbe(path, Base()).read()
    assert (reading.on_ac, reading.battery_percent, reading.temperature_c) == (False, 50, 40.0)
    path.write_text("{broken")
    assert "probe.json" in FileProbe(path).read().notes["file"]


def test_power_probe_reads_the_battery_and_explains_a_desktop(monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    import psutil

    Battery = collections.namedtuple("Battery", "percent secsleft power_plugged")
    monkeypatch.setattr(psutil, "sensors_battery", lambda: Battery(37.0, 3600, False))
    reading = SystemProbe(system="Linux").read()
    assert (reading.on_ac, reading.battery_percent) == (False, 37.0)
    monkeypatch.setattr(psutil, "sensors_battery", lambda: None)
    reading = SystemProbe(system="Linux").read()
    assert reading.on_ac is None and "no battery" in reading.notes["power"]


def test_heat_probe_takes_the_hottest_sensor(monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    import psutil

    Temp = collections.namedtuple("Temp", "label current high critical")
    monkeypatch.setattr(
        psutil,
        "sensors_temperatures",
        lambda: {"coretemp": [Temp("a", 55.0, 90, 100), Temp("b", 71.5, 90, 100)], "nvme": []},
    )
    assert SystemProbe(system="Linux").read().temperature_c == 71.5
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {})
    reading = SystemProbe(system="Linux").read()
    assert reading.temperature_c is None and "no temperature sensor" in reading.notes["heat"]


def test_cpu_probe_leaves_out_cleaves_own_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    probe = SystemProbe(system="Linux")

    class Own:
        def cpu_percent(self, interval: object = None) -> float:
            return 100.0  # one whole core, ours

    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 60.0)
    monkeypatch.setattr(psutil, "cpu_count", lambda: 2)
    monkeypatch.setattr(probe, "_own_processes", lambda: [Own()])
    assert probe.read().other_cpu_percent == 10.0  # 60% of the machine, 50% of it Cleave's


def test_only_real_cleave_processes_are_left_out_of_the_load() -> None:
    from cleave.client.idle import is_cleave

    assert is_cleave(["/home/me/.venv/bin/cleave", "join", "ws://x"])
    assert is_cleave(["/usr/bin/python3", "-m", "cleave", "coordinator", "start"])
    assert not is_cleave(["vim", "/home/me/cleave/README.md"])
    assert not is_cleave(["python3", "train.py", "--out", "/data/cleave"])
    assert not is_cleave([])


def test_equal_hours_mean_the_whole_day() -> None:
    assert within(parse_hours("00:00-00:00"), NOON) and within(parse_hours("22:00-22:00"), dt.time(3, 0))
