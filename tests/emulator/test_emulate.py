"""``cleave emulate``: the pacing model's arithmetic, and a drill of an emulated fleet (slow
devices, churn, one byzantine device) on a real coordinator over real websockets."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import threading
from pathlib import Path

import pytest
import torch
from conftest import TIMEOUT
from procs import OPERATOR, TOKEN, Coordinator, Proc, cleave_cmd, metrics, run_all

from cleave.cli.status import fetch_status
from cleave.coordinator.planning.costmodel import Profile
from cleave.emulator.devices import Pacer, Pacing, SharedCompute, byzantine_indices, device_name

# --------------------------------------------------------------------------- the pacing model


def test_pacing_serialises_download_compute_and_upload() -> None:
    p = Pacing(flops_per_s=1e9, down=1e6, up=5e5, latency=0.01, overhead=0.002)
    # Downlink: 100 kB take 0.1 s, then the one-way latency.
    assert p.download(100_000, t_recv=0.0) == pytest.approx(0.11)
    # A frame arriving while the link is busy waits for it; latency overlaps (paid once per frame).
    assert p.download(200_000, t_recv=0.05) == pytest.approx(0.1 + 0.2 + 0.01)
    # A frame arriving after the link is free starts at its arrival.
    assert p.download(100_000, t_recv=1.0) == pytest.approx(1.11)
    # Compute: flops / F + overhead, serial.
    assert p.start(0.11) == pytest.approx(0.11)
    end, overrun = p.computed(0.11, 1e7, real_end=0.115)
    assert (end, overrun) == (pytest.approx(0.11 + 0.01 + 0.002), False)
    assert p.start(0.115) == pytest.approx(0.122)  # ready earlier, waits for the tile before it
    end2, _ = p.computed(0.122, 2e7, real_end=0.13)
    assert end2 == pytest.approx(0.122 + 0.022)
    # Uplink: R / U from max(ready, up_free), then the latency.
    assert p.upload(50_000, ready=end) == pytest.approx(0.122 + 0.1 + 0.01)
    assert p.upload(50_000, ready=end2) == pytest.approx(0.222 + 0.1 + 0.01)  # behind the first result
    assert p.upload(50_000, ready=5.0) == pytest.approx(5.11)


def test_pacing_counts_an_overrun_when_the_host_is_slower_than_the_profile() -> None:
    p = Pacing(flops_per_s=1e9, down=1e6, up=1e6, latency=0.0, overhead=0.0)
    end, overrun = p.computed(1.0, 1e7, real_end=1.05)  # 10 ms paced, 50 ms real
    assert (end, overrun) == (1.05, True)
    assert p.compute_free == 1.05 and p.start(1.0) == 1.05  # the real time counts


def test_pacing_from_a_profile_and_a_speed() -> None:
    prof = Profile(gflops={"fp32": 4.0, "bf16": 0.0}, memory=1 << 30, down=2e6, up=1e6, rtt=0.04, overhead=0.002)
    p = Pacing.from_profile(prof, "fp32", speed=2.0)  # two times slower in every respect
    assert (p.flops_per_s, p.down, p.up) == (2e9, 1e6, 5e5)
    assert (p.latency, p.overhead) == (pytest.approx(0.04), pytest.approx(0.004))
    with pytest.raises(ValueError, match="bf16"):
        Pacing.from_profile(prof, "bf16")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_pacer_sleeps_the_model_and_reports_paced_seconds() -> None:
    clock = FakeClock()
    pacer = Pacer(Pacing(flops_per_s=1e9, down=1e6, up=5e5, latency=0.01, overhead=0.002), clock, clock.sleep)

    async def tile(nbytes: int, flops: float, real: float) -> tuple[float, float, float]:
        ready = pacer.arrived(nbytes)
        start = await pacer.start(ready)
        clock.now += real  # the real product
        seconds = await pacer.finish(start, flops)
        return start - ready, seconds, pacer.deliver_at(50_000)

    waited, seconds, sent = asyncio.run(tile(100_000, 1e7, 0.001))
    assert clock.now == pytest.approx(0.122)  # slept to the download's end, then to the compute's
    assert (waited, seconds, sent) == (0.0, pytest.approx(0.012), pytest.approx(0.232))
    assert pacer.overruns == 0
    waited, seconds, _ = asyncio.run(tile(0, 1e7, 0.05))  # a slow host: no sleep, the real time counts
    assert seconds == pytest.approx(0.05) and pacer.overruns == 1
    assert pacer.tiles == 2 and pacer.down_bytes == 100_000 and pacer.up_bytes == 100_000


def test_names_and_byzantine_choice_are_seeded() -> None:
    assert device_name("phone", 3) == "emu-phone-3"
    assert len(device_name("x" * 64, 12345)) == 64
    assert byzantine_indices(20, 0.05, 7) == byzantine_indices(20, 0.05, 7)
    assert len(byzantine_indices(20, 0.05, 7)) == 1 and len(byzantine_indices(3, 0.01, 1)) == 1
    assert byzantine_indices(20, 0.0, 7) == set() and len(byzantine_indices(20, 0.5, 7)) == 10


def test_products_stay_on_the_fleets_threads_whichever_worker_asks() -> None:
    """Every rejoin is a new Worker with a new thread: the products must not follow it onto a
    fresh thread each time (torch/MKL on a new thread per rejoin grew the emulator's heap)."""
    ran_on: set[int] = set()

    class Spy(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            if "matmul" in getattr(func, "__name__", ""):
                ran_on.add(threading.get_ident())
            return super().__torch_function__(func, types, args, kwargs or {})

    a = torch.eye(3).as_subclass(Spy)
    compute = SharedCompute(threads=2)
    callers: set[int] = set()

    def worker_thread() -> None:
        callers.add(threading.get_ident())
        c, seconds = compute(a, a)
        assert torch.equal(c, torch.eye(3)) and seconds >= 0

    try:
        for _ in range(12):  # twelve incarnations, each on its own thread, one after another
            t = threading.Thread(target=worker_thread)
            t.start()
            t.join()
    finally:
        compute.close()
    assert 1 <= len(ran_on) <= 2 and not ran_on & callers


# --------------------------------------------------------------------------- a drill

# A larger drill for the record: CLEAVE_DRILL_DEVICES=100 CLEAVE_DRILL_STEPS=6 (docs/simulation.md).
STEPS = int(os.environ.get("CLEAVE_DRILL_STEPS", "4"))
DEVICES = int(os.environ.get("CLEAVE_DRILL_DEVICES", "20"))
REL = 1e-4  # as tests/drills/test_e2e.py
FLEET = """
[[class]]
name = "slow"
count = 3
gflops = 2
memory_gb = 1
down_mbps = 32
up_mbps = 16
rtt_ms = 30

[[class]]
name = "fast"
count = 1
gflops = 5
memory_gb = 1
down_mbps = 64
up_mbps = 32
rtt_ms = 10
"""


def _local_losses(tmp: Path) -> list[float]:
    path = tmp / "local.jsonl"
    (run,) = run_all(
        cleave_cmd("train", "--local", "--steps", str(STEPS), "--metrics", str(path), "--quiet"),
        timeout=2 * TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    return [row["loss"] for row in metrics(path)]


@pytest.mark.drill
def test_an_emulated_fleet_with_churn_and_a_forger_trains_exactly(tmp_path: Path) -> None:
    """20 slow emulated devices (2-5 GFLOP/s, a few MB/s), leaving and coming back, one of them
    forging: the job finishes with the losses of local torch, the forger is banned (the
    dashboard's status says so) and no honest device is."""
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    coord = Coordinator(
        tmp_path, "--min-devices", str(DEVICES // 2), "--heartbeat-timeout", "2", "--verbose", steps=STEPS
    )
    emu = Proc(
        cleave_cmd(
            "emulate",
            coord.url,
            "--devices",
            str(DEVICES),
            "--fleet",
            str(fleet),
            "--leave-rate",
            "3",
            "--away-seconds",
            "2",
            "--byzantine",
            "0.05",
            "--seed",
            "3",
            "--json",
            "--interval",
            "2",
        ),
        "emulate",
        extra_env={"CLEAVE_TOKEN": TOKEN},  # by environment, as docs/cli.md advises
    )
    snapshots: list[dict] = []
    done = threading.Event()

    def watch() -> None:  # the operator's view while the job runs
        while not done.is_set() and coord.proc.poll() is None:
            try:
                snapshots.append(fetch_status(coord.url, OPERATOR))
            except Exception:  # noqa: BLE001 - the coordinator may be gone between two polls
                pass
            done.wait(1.0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    want = _local_losses(tmp_path)
    try:
        assert coord.wait(2 * TIMEOUT) == 0, coord.output
        assert emu.wait(TIMEOUT) == 0, emu.output
    finally:
        done.set()
        watcher.join(5)

    got = coord.losses()
    assert len(got) == len(want) == STEPS
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= REL * abs(w), f"step {step}: {g} vs local {w}"

    report = json.loads(next(line for line in emu.lines if line.startswith("{")))
    assert report["finished"] and report["devices"] == DEVICES
    assert [c["devices"] for c in report["classes"]] == [DEVICES - DEVICES // 4, DEVICES // 4]
    assert report["tiles"] > 0 and all(c["tiles"] > 0 for c in report["classes"])
    assert report["leaves"]["graceful"] >= 1 and report["leaves"]["crash"] >= 1, report["leaves"]  # churn happened
    assert report["rejoins"] >= 1
    forgers = set(report["byzantine"])
    assert len(forgers) == max(1, round(0.05 * DEVICES)) and set(report["banned"]) == forgers
    assert report["forged"] >= len(forgers) and report["forged_rejected"] >= len(forgers)
    names = {d["name"] for d in report["device_list"]}
    assert len(names) == DEVICES and all(n.startswith(("emu-slow-", "emu-fast-")) for n in names)

    # The dashboard showed the forger banned, and only it; it never had a tile verified.
    banned = {d["name"] for s in snapshots for d in s["devices"] if d["state"] == "banned"}
    assert banned == forgers, banned
    for forger in forgers:
        rows = [d for s in snapshots for d in s["devices"] if d["name"] == forger]
        assert rows and all(d["tiles_done"] == 0 for d in rows) and rows[-1]["tiles_rejected"] >= 1
        (state,) = coord.query("SELECT state FROM identities WHERE name = ?", forger)[0]
        assert state == "banned"
        assert coord.query(
            "SELECT COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id "
            "WHERE d.name = ? AND l.outcome = 'verified'",
            forger,
        ) == [(0,)]
    assert coord.query("SELECT COUNT(*) FROM identities WHERE state = 'banned'") == [(len(forgers),)]
    # The coordinator saw graceful leaves, and lost connections: the forger's and crashes' (found
    # by heartbeat timeout, lost copies, or the reset when the device came back).
    assert len(re.findall(r"device \d+ left: left", coord.output)) >= 1, coord.output
    assert len(re.findall(r"device \d+ left: connection closed", coord.output)) >= 2, coord.output
    # Every emulated device enrolled and kept its credential over its rejoins (one that left in
    # the milliseconds between its hello and its credential would enrol again: allow one).
    ((distinct, enrolled),) = coord.query("SELECT COUNT(DISTINCT name), COUNT(*) FROM identities")
    assert distinct == DEVICES and enrolled <= DEVICES + 1
    # Paced, not at this host's speed: no honest device measured faster than its profile.
    rate = {"slow": 2.0, "fast": 5.0}
    for snap in snapshots:
        for d in snap["devices"]:
            if d["state"] in ("working", "idle") and d["profile"] and d["profile"]["measured_results"]:
                assert d["gflops"] <= rate[d["name"].split("-")[1]] * 1.05, d
    assert math.isfinite(report["seconds"])
    # For the record (pytest -s): what the drill did.
    print(
        json.dumps(
            {
                "devices": DEVICES,
                "steps": STEPS,
                "losses": got,
                "local": want,
                "tiles": report["tiles"],
                "leaves": report["leaves"],
                "rejoins": report["rejoins"],
                "forgers": sorted(forgers),
                "banned": sorted(report["banned"]),
                "forged": report["forged"],
                "forged_rejected": report["forged_rejected"],
                "seconds": report["seconds"],
            }
        )
    )
