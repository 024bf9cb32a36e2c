"""Faults with real processes: churn, frozen and slow clients, and a coordinator killed mid-run.
Whatever happens, every tile is verified exactly once and the losses equal plain torch."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import TIMEOUT
from procs import Coordinator, Proc, double, free_port, join, local_losses, wait_until

pytestmark = pytest.mark.drill  # real processes train through real sockets (README: the parts of the suite)


def assert_same_losses(got: Sequence[float], want: Sequence[float]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= 1e-4 * abs(w), f"step {step}: {g} vs undisturbed {w}"


def assert_every_tile_verified_once(coord: Coordinator) -> None:
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
    assert (
        coord.query("SELECT tile_id FROM leases WHERE outcome = 'verified' GROUP BY tile_id HAVING COUNT(*) > 1") == []
    )  # no result used twice
    assert coord.query("SELECT COUNT(*) FROM leases WHERE ended_at IS NULL") == [(0,)]  # none left hanging


def test_chaos_kills_and_freezes_clients_without_changing_a_loss(tmp_path: Path) -> None:
    # An event a step from step 2, the freezes first: a frozen client is found out only by the
    # heartbeat timeout (3 s, a few steps), so the last freeze, at about step 4, leaves it 8 steps.
    steps, options = 12, {"batch_size": 16, "seq_len": 128}
    coord = Coordinator(
        tmp_path,
        "--batch-size",
        "16",
        "--seq-len",
        "128",
        "--heartbeat-timeout",
        "3",
        "--min-devices",
        "4",
        steps=steps,
    )
    clients: list[Proc] = [join(coord.url, f"c{i}") for i in range(4)]
    frozen: list[Proc] = []
    rng = random.Random(3)
    events = []
    coord.wait_for_step(2)
    while coord.proc.poll() is None and len(events) < 4:  # two freezes, two kills
        enrolled = {name for (name,) in coord.query("SELECT name FROM devices")}
        live = [c for c in clients if c.proc.poll() is None and c not in frozen and c.name in enrolled]
        if not live:
            time.sleep(0.05)
            continue
        victim = rng.choice(live)
        if len(events) % 2 == 0:
            victim.proc.send_signal(signal.SIGSTOP)  # frozen: connected, silent, holding tiles
            frozen.append(victim)
            events.append(("stop", victim.name, coord.steps_done(), time.time()))
        else:
            victim.proc.send_signal(signal.SIGKILL)
            events.append(("kill", victim.name, coord.steps_done(), time.time()))
        clients.append(join(coord.url, f"c{len(clients)}"))
        coord.wait_for_step(min(coord.steps_done() + 1, steps))
    assert coord.wait(4 * TIMEOUT) == 0, coord.output
    for p in frozen:
        p.kill()
    assert {kind for kind, *_ in events} == {"kill", "stop"} and len(events) >= 4, events
    assert events[-1][2] < steps, "the chaos must happen while training"
    assert_same_losses(coord.losses(), local_losses(steps, **options))
    assert_every_tile_verified_once(coord)
    # Tiles really were held by the victims when the fault struck (or leased to a frozen one
    # after it) and finished by others: lost with a killed client, or cancelled when a copy won
    # over a frozen one (a late owner's tiles are copied before its heartbeat runs out, so which
    # one depends on timing). The records' clock is the wall clock (Core.wall): 0.5 s of slack.
    held = [
        n
        for _, name, _, at in events
        for (n,) in coord.query(
            "SELECT COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id WHERE d.name = ? "
            "AND l.outcome != 'verified' AND (l.ended_at IS NULL OR l.ended_at >= ?)",
            name,
            at - 0.5,
        )
    ]
    assert sum(held) > 0, (events, held)
    # A frozen client is dropped after the heartbeat timeout, or sooner, when the tiles it keeps
    # taking all go to other copies (cut for stalling): either way it is gone, and so are its tiles.
    # Victims are picked among enrolled clients, so each frozen one has a row saying why it went.
    for p in frozen:
        (reason,) = coord.query("SELECT reason FROM devices WHERE name = ?", p.name)[0]
        assert reason.startswith("no heartbeat") or "without a result from it" in reason, (p.name, reason)


def test_a_straggler_does_not_hold_the_steps_back(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "2", steps=8)
    snail = double("slow", coord.url, "snail", "2.0")  # 2 s a tile: ~300 s for the run if waited on
    hare = join(coord.url, "hare")
    started = time.monotonic()
    assert coord.wait(2 * TIMEOUT) == 0, coord.output
    elapsed = time.monotonic() - started
    assert hare.wait() == 0
    snail.kill()
    assert elapsed < 2 * TIMEOUT
    wins = coord.query("SELECT COUNT(*) FROM leases WHERE issued = 'speculative' AND outcome = 'verified'")[0][0]
    assert wins > 0
    snail_cancelled = coord.query(
        "SELECT COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id "
        "WHERE d.name = 'snail' AND l.outcome = 'cancelled'"
    )[0][0]
    assert snail_cancelled > 0
    assert_same_losses(coord.losses(), local_losses(8))
    assert_every_tile_verified_once(coord)


@pytest.mark.parametrize("damage", [False, True], ids=["clean", "truncated-checkpoint"])
def test_a_killed_coordinator_resumes_with_the_same_losses(tmp_path: Path, damage: bool) -> None:
    port = free_port()
    steps, args = 10, ("--checkpoint-every", "2", "--min-devices", "2")
    # The optimizer's settings are the job's: the second start names others, and the resumed job
    # keeps those it was first started with (as it does --lr).
    first = ("--warmup", "3", "--min-lr", "0.0005", "--weight-decay", "0.05", "--grad-clip", "0.5")
    options = {"warmup": 3, "min_lr": 5e-4, "weight_decay": 0.05, "grad_clip": 0.5}
    coord = Coordinator(tmp_path, *args, *first, steps=steps, port=port)
    clients = [join(coord.url, f"c{i}") for i in range(2)]
    kill_at = 7  # past three checkpoints (2, 4, 6): one damaged, an older one is left
    coord.wait_for_step(kill_at)
    coord.proc.send_signal(signal.SIGKILL)
    coord.wait()
    ckpts = sorted((tmp_path / "cleave.db-checkpoints").glob("*.pt"))
    assert ckpts, "checkpoints were written before the kill"
    if damage:
        # The newest checkpoint the database knows of (a file written just before the kill may
        # not have its row yet, and a resume never looks at it): damage that one.
        known = coord.query("SELECT path FROM checkpoints WHERE job_id = 1 ORDER BY step DESC")
        assert len(known) >= 2, "an older checkpoint to fall back to"
        newest = Path(known[0][0])
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    again = Coordinator(tmp_path, *args, "--warmup", "0", "--grad-clip", "0", steps=steps, port=port)
    assert again.wait(3 * TIMEOUT) == 0, again.output
    assert [c.wait() for c in clients] == [0, 0], [c.output for c in clients]  # they reconnected by themselves
    assert "resuming job 1" in again.output
    if damage:
        assert "truncated" in again.output and "trying an older one" in again.output
    losses = [row[0] for row in again.query("SELECT loss FROM steps WHERE job_id = 1 ORDER BY step")]
    assert_same_losses(losses, local_losses(steps, **options))
    assert_same_losses(again.losses(), local_losses(steps, **options))  # the metrics file agrees
    assert again.query("SELECT state FROM jobs") == [("finished",)]
    wait_until(lambda: True)
