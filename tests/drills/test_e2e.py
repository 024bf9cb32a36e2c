"""End to end, with real processes on 127.0.0.1: a coordinator, `cleave join` clients,
misbehaving test doubles, SIGKILL, SIGINT, and a peer that sends garbage."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from conftest import TIMEOUT
from procs import OPERATOR, Coordinator, Proc, cleave_cmd, double, join, metrics, run_all, wait_until

pytestmark = pytest.mark.drill  # real processes train through real sockets (README: the parts of the suite)

STEPS = 12  # past the warm-up of 10: the loss has fallen by 0.9 (the test of learning asks 0.5)
# The tests of faults need no learning: a job of SHORT steps, all in the warm-up (whose rates do
# not depend on --steps), has the first SHORT losses of the STEPS-step baseline.
SHORT = 6
REL = 1e-4


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The baseline: `cleave train --local` with the same options."""
    path = tmp_path_factory.mktemp("local") / "local.jsonl"
    (run,) = run_all(
        cleave_cmd("train", "--local", "--steps", str(STEPS), "--metrics", str(path), "--quiet"),
        timeout=2 * TIMEOUT,
    )
    assert run.returncode == 0, run.stderr
    losses = [row["loss"] for row in metrics(path)]
    assert len(losses) == STEPS
    return losses


def assert_same_losses(got: list[float], want: list[float], rel: float = REL) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= rel * abs(w), f"step {step}: {g} vs local {w}"


def test_two_clients_train_exactly_like_local_torch(tmp_path: Path, local_losses: list[float]) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "2", steps=STEPS)
    clients = [join(coord.url, f"laptop-{i}") for i in range(2)]
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0, 0], [c.output for c in clients]
    losses = coord.losses()
    assert_same_losses(losses, local_losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
    rows = metrics(coord.metrics_path)
    assert all({"step", "loss", "tokens", "seconds"} <= set(r) for r in rows)
    # The database tells the same story: every tile verified, shared by both devices.
    assert coord.query("SELECT state, COUNT(*) FROM tiles GROUP BY state")[0][0] == "verified"
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
    done = dict(coord.query("SELECT name, tiles_done FROM devices"))
    assert set(done) == {"laptop-0", "laptop-1"} and all(n > 0 for n in done.values())
    assert coord.query("SELECT state FROM jobs") == [("finished",)]
    assert [r[0] for r in coord.query("SELECT loss FROM steps ORDER BY step")] == losses
    # --micro-batches auto (the default): the cost model chose on the two devices that joined,
    # then again once the first step had measured them.
    for basis in ("the devices that joined", "the devices as step 1 measured them"):
        assert re.search(rf"micro-batches: [1248], chosen by the cost model on {basis} \(forecast", coord.output)


def test_micro_batches_through_clients_take_the_whole_batchs_step(tmp_path: Path, local_losses: list[float]) -> None:
    """--micro-batches 4: the parts go through the model at once, their GEMMs to the clients as
    tiles side by side, and the step is plain torch's whole-batch step (the first 4 steps: in the
    warm-up, the same whatever --steps)."""
    coord = Coordinator(tmp_path, "--min-devices", "2", "--micro-batches", "4", steps=4)
    clients = [join(coord.url, f"part-{i}") for i in range(2)]
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0, 0]
    assert_same_losses(coord.losses(), local_losses[:4], rel=1e-5)  # what docs/architecture.md states
    done = dict(coord.query("SELECT name, tiles_done FROM devices"))
    assert set(done) == {"part-0", "part-1"} and all(n > 0 for n in done.values())  # tiles were shipped
    # The parts ran at once: GEMMs the trainer waited on were out side by side.
    assert max(row["waited_gemms_max"] for row in metrics(coord.metrics_path)) >= 2


def test_corrupted_results_are_always_caught_and_never_used(tmp_path: Path, local_losses: list[float]) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "2", steps=SHORT)
    liar = double("corrupt", coord.url, "liar")
    honest = join(coord.url, "honest")
    assert coord.wait() == 0, coord.output
    assert honest.wait() == 0
    assert liar.wait() == 3, liar.output  # banned after repeated failures
    assert_same_losses(coord.losses(), local_losses[:SHORT])
    (liar_id,) = coord.query("SELECT id FROM devices WHERE name = 'liar'")[0]
    outcomes = dict(coord.query("SELECT outcome, COUNT(*) FROM leases WHERE device_id = ? GROUP BY outcome", liar_id))
    assert outcomes.get("rejected", 0) >= 1, outcomes
    assert "verified" not in outcomes  # not one corrupted block entered training
    assert coord.query("SELECT state, reason FROM devices WHERE id = ?", liar_id)[0][0] == "banned"


def test_a_client_killed_mid_step_costs_only_its_tiles(tmp_path: Path, local_losses: list[float]) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "2", steps=SHORT)  # the victim holds its 40th tile in step 1
    flag = tmp_path / "holding"
    victim = double("hold", coord.url, "victim", "40", str(flag))
    survivor = join(coord.url, "survivor")
    wait_until(flag.exists, 2 * TIMEOUT, "the victim to hold a tile")
    victim.proc.send_signal(signal.SIGKILL)
    victim.wait()
    assert coord.wait() == 0, coord.output
    assert survivor.wait() == 0
    assert_same_losses(coord.losses(), local_losses[:SHORT])
    (victim_id,) = coord.query("SELECT id FROM devices WHERE name = 'victim'")[0]
    lost = coord.query("SELECT tile_id FROM leases WHERE device_id = ? AND outcome = 'lost'", victim_id)
    # On a loaded machine the held tile may be copied to the survivor, and that copy verified,
    # before the kill lands: the victim's lease then ends cancelled, not lost.
    raced = coord.query("SELECT tile_id FROM leases WHERE device_id = ? AND outcome = 'cancelled'", victim_id)
    assert lost or raced, "the victim held tiles when it died"
    for (tile,) in lost + raced:  # each was computed by the survivor and verified
        history = coord.query("SELECT outcome FROM leases WHERE tile_id = ? ORDER BY id", tile)
        # (Not necessarily last: on a loaded machine the victim may have held a speculative copy
        # of a tile the survivor then returned first, and died holding it.)
        assert ("verified",) in history, history


def test_ctrl_c_leaves_gracefully(tmp_path: Path, local_losses: list[float]) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "2", steps=SHORT)
    leaver = join(coord.url, "leaver")
    stayer = join(coord.url, "stayer")
    coord.wait_for_step(3)
    leaver.proc.send_signal(signal.SIGINT)
    assert leaver.wait() == 0, leaver.output
    assert coord.wait() == 0, coord.output
    assert stayer.wait() == 0
    assert_same_losses(coord.losses(), local_losses[:SHORT])
    state, reason = coord.query("SELECT state, reason FROM devices WHERE name = 'leaver'")[0]
    assert (state, reason) == ("offline", "left")
    assert coord.query(
        "SELECT COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id "
        "WHERE d.name = 'leaver' AND l.outcome = 'lost'"
    ) == [(0,)]


def test_status_reports_the_job_as_json_and_a_dashboard(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "2", steps=5)
    first = join(coord.url, "first")
    wait_until(lambda: "first" in _status(coord.url).get("names", []), TIMEOUT, "the first device")
    run, board, wrong = run_all(
        cleave_cmd("status", "--url", coord.url, "--token", OPERATOR, "--json"),
        cleave_cmd("status", "--url", coord.url, "--token", OPERATOR, "--once"),
        cleave_cmd("status", "--url", coord.url, "--token", "nope", "--json"),
    )
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert {"step", "steps", "loss"} <= set(status["job"]) and status["job"]["steps"] == 5
    assert {"queued", "leased", "verified", "rejected"} <= set(status["tiles"])
    (device,) = status["devices"]
    assert {"name", "state", "tiles_done", "tiles_rejected", "gflops"} <= set(device)
    assert device["name"] == "first" and device["gflops"] > 0
    assert board.returncode == 0 and "first" in board.stdout and "devices" in board.stdout
    assert wrong.returncode == 2 and "refused the token" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1
    second = join(coord.url, "second")
    assert coord.wait() == 0, coord.output
    assert first.wait() == 0 and second.wait() == 0


def _status(url: str) -> dict:
    from cleave.cli.status import fetch_status

    status = fetch_status(url, OPERATOR)
    status["names"] = [d["name"] for d in status["devices"]]
    return status


def test_wrong_token_client_exits_with_a_clear_error(tmp_path: Path) -> None:
    coord = Coordinator(tmp_path, "--min-devices", "1", steps=2)
    intruder = join(coord.url, "intruder", token="wrong")
    assert intruder.wait() == 2
    assert "refused the join token" in intruder.output
    good = join(coord.url, "good")
    assert coord.wait() == 0 and good.wait() == 0


def test_unreachable_coordinator_is_retried_until_stopped(tmp_path: Path) -> None:
    client = Proc(cleave_cmd("join", "ws://127.0.0.1:9", "--token", "t", "--threads", "1"), "lonely")
    wait_until(lambda: "retrying" in client.output, TIMEOUT, "a retry message")
    client.proc.send_signal(signal.SIGINT)
    assert client.wait() == 0
