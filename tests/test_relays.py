"""Relays (issue 22): a real coordinator, a real relay and real clients on loopback."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from procs import ROOT, TOKEN, Coordinator, Proc, cleave_cmd, join, wait_until

from coordinator.training.loop import TrainConfig, Trainer

STEPS = 3
MODEL = ("--model", "small", "--micro-batches", "1")  # the tiny model's grid shares too few blocks to say much


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relay(url: str, tmp: Path, *args: str, name: str = "relay-1") -> Proc:
    port = _port()
    return Proc(
        cleave_cmd(
            "relay", url, "--token", TOKEN, "--listen", f"127.0.0.1:{port}", "--name", name,
            "--credentials", str(tmp / f"{name}.json"), *args,
        ),
        name,
    )  # fmt: skip


def _look(coord: Coordinator) -> tuple[dict, str]:
    """The coordinator's status snapshot (as ``cleave status`` asks) and its /metrics text."""
    import urllib.request

    from procs import OPERATOR
    from websockets.sync.client import connect

    from coordinator.wire.messages import StatusReply, StatusRequest, decode, encode

    with connect(coord.url, compression=None, max_size=None, open_timeout=10, proxy=None) as ws:
        ws.recv(timeout=10)  # the challenge
        ws.send(encode(StatusRequest(token=OPERATOR)))
        reply = decode(ws.recv(timeout=10))
    assert isinstance(reply, StatusReply)
    http = coord.url.replace("ws://", "http://") + "/metrics?format=text"
    request = urllib.request.Request(http, headers={"Authorization": f"Bearer {OPERATOR}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return reply.status, r.read().decode()


def _run(tmp: Path, with_relay: bool) -> tuple[Coordinator, list[float]]:
    tmp.mkdir(parents=True, exist_ok=True)
    coord = Coordinator(tmp, "--min-devices", "4", "--checkpoint-every", "0", *MODEL, steps=STEPS)
    relays = [relay(coord.url, tmp)] if with_relay else []
    if relays:
        wait_until(lambda: coord.query("SELECT COUNT(*) FROM devices WHERE device = 'relay'") == [(1,)], what="relay")
    clients = [join(coord.url, f"laptop-{i}") for i in range(4)]
    if relays:  # mid-run: status --json and /metrics say what relays served in the coordinator's stead
        coord.wait_for_step(1)
        status, scraped = _look(coord)
        assert status["traffic"]["mb_relay_out"] > 0 and status["traffic"]["mb_ps_out"] > 0, status["traffic"]
        assert [r["devices"] for r in status["relays"]] == [4], status["relays"]
        relayed = [line for line in scraped.splitlines() if line.startswith("cleave_relay_bytes_total")]
        assert relayed and float(relayed[0].split()[-1]) > 0, scraped[-800:]
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0] * 4, [c.output for c in clients]
    for r in relays:
        r.kill()
    return coord, coord.losses()


@pytest.mark.drill
def test_a_relay_takes_most_of_the_coordinators_egress_and_training_stays_exact(tmp_path: Path) -> None:
    """One coordinator, four clients, the small model on the uniform grid: with a relay the
    coordinator sends at most 0.6x the bytes it sends without one; losses are plain torch's in
    both, and tiles reached every client."""
    want = [r.loss for r in Trainer(TrainConfig(model="small", steps=STEPS)).run()]
    alone, plain = _run(tmp_path / "alone", with_relay=False)
    relayed, losses = _run(tmp_path / "relayed", with_relay=True)
    assert plain == pytest.approx(want, rel=1e-5) and losses == pytest.approx(want, rel=1e-5)
    out_alone = alone.rows()[-1]["mb_ps_out"]
    out_relayed, relay_out = relayed.rows()[-1]["mb_ps_out"], relayed.rows()[-1]["mb_relay_out"]
    assert relay_out > 0 and out_relayed <= 0.6 * out_alone, (out_relayed, out_alone, relay_out)
    done = dict(relayed.query("SELECT name, tiles_done FROM devices WHERE device != 'relay'"))
    assert len(done) == 4 and all(n > 0 for n in done.values()), done
    assert relayed.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]


def hostile(mode: str, url: str, tmp: Path) -> Proc:
    return Proc(
        [sys.executable, str(ROOT / "tests" / "relay_doubles.py"), mode, url, TOKEN, str(_port()),
         str(tmp / f"hostile-{mode}.json")],
        f"hostile-{mode}",
    )  # fmt: skip


@pytest.mark.drill
@pytest.mark.parametrize("mode", ["wrong", "stale", "stall", "flood"])
def test_a_hostile_relay_is_caught_and_its_devices_take_their_blocks_from_the_coordinator(
    tmp_path: Path, mode: str
) -> None:
    """A relay that serves wrong bytes (sealed: its own word on them), stale bytes of another
    block, nothing at all, or floods the coordinator with requests (cut like any peer, 4029).
    Every device checks each block's digest and gives the relay up; the coordinator bans one its
    seal proves lied (wrong, stale); a stall proves nothing, and only costs the relay its
    devices. The job finishes with plain torch's losses, every tile verified."""
    coord = Coordinator(tmp_path, "--min-devices", "2", "--checkpoint-every", "0", steps=STEPS)
    bad = hostile(mode, coord.url, tmp_path)
    wait_until(lambda: coord.query("SELECT COUNT(*) FROM devices WHERE device = 'relay'") == [(1,)], what="relay")
    if mode == "flood":  # cut before the devices come: they take their blocks from the coordinator
        assert bad.wait() == 0 and "closed (4029)" in bad.output, bad.output
    clients = [join(coord.url, f"laptop-{i}") for i in range(2)]
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0, 0], [c.output for c in clients]
    bad.kill()
    want = [r.loss for r in Trainer(TrainConfig(steps=STEPS)).run()]
    assert coord.losses() == pytest.approx(want, rel=1e-5)
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
    if mode != "flood":
        assert all("taking blocks from the coordinator" in c.output for c in clients), [c.output for c in clients]
    relay_identity = coord.query("SELECT identity_id FROM devices WHERE device = 'relay'")[0][0]
    (state,) = coord.query("SELECT state FROM identities WHERE id = ?", relay_identity)[0]
    if mode in ("wrong", "stale"):
        assert state == "banned", state  # proven by its own seal
    else:
        assert state != "banned", state  # a stall proves nothing: its devices left it
    done = dict(coord.query("SELECT name, tiles_done FROM devices WHERE device != 'relay'"))
    assert len(done) == 2 and all(n > 0 for n in done.values()), done
