"""Real rate-limited links (emulator/netns.py): network namespaces around a bridge, links shaped
by tc's token bucket. Needs root and iproute2; skipped with the reason elsewhere."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from cleave.emulator.netns import Lab, LabError, Link, available, leftovers

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")

SEND = f"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 9000)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); c.sendall(b"x" * {1_000_000}); c.close()
"""
RECEIVE = """
import socket, sys
s = socket.create_connection((sys.argv[1], 9000)); n = 0
while (b := s.recv(1 << 16)):
    n += len(b)
print(n)
"""


def _rate(lab: Lab, sender: str, receiver: str) -> float:
    """Bits a second that 1 MB crosses from ``sender`` to ``receiver`` at, over TCP."""
    command = lab.command(sender, [sys.executable, "-c", SEND, lab.nodes[sender].address])
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as server:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        started = time.monotonic()
        done = subprocess.run(
            lab.command(receiver, [sys.executable, "-c", RECEIVE, lab.nodes[sender].address]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        seconds = time.monotonic() - started
        server.wait(10)
    assert done.stdout.strip() == "1000000", done.stderr
    return 8e6 / seconds


def test_links_are_shaped_each_way_and_the_lab_leaves_nothing_behind() -> None:
    """A node's downlink and uplink are each its own token bucket: 1 MB crosses at about the
    slower end's rate (TCP's overhead and the bucket's burst keep it within 0.75 to 1.1 of it),
    the counters see the bytes, and every namespace is gone afterwards, an exception or not."""
    with pytest.raises(RuntimeError, match="boom"), Lab() as lab:
        lab.add("ps", Link(down=0, up=16e6))
        lab.add("d0", Link(down=8e6, up=4e6))
        names = [n.netns for n in lab.nodes.values()]
        assert set(names) <= set(leftovers(lab.prefix))
        down, up = _rate(lab, "ps", "d0") / 8e6, _rate(lab, "d0", "ps") / 4e6  # of d0's downlink and uplink
        assert 0.75 <= down <= 1.1 and 0.75 <= up <= 1.1, (down, up)
        sent, _ = lab.counters("ps")
        assert sent > 1_000_000
        raise RuntimeError("boom")
    assert leftovers(lab.prefix) == []
    with pytest.raises(LabError, match="unique, alphanumeric"), Lab() as other:
        other.add("bad name", Link(0, 0))
    assert leftovers(other.prefix) == []


@pytest.mark.drill
def test_bench_links_runs_a_relay_on_shaped_links_against_the_simulator() -> None:
    """bench/bench_links.py, short: a real coordinator, a relay and two clients in namespaces on
    shaped links. It prints its one JSON line with the measured and predicted steps and the
    coordinator's link use; the relay served blocks, every client computed tiles, and no
    namespace is left behind. (The figures' goals are the bench's, measured on an idle machine:
    bench/README.md. Here they only have to be sane.)"""
    import json

    from conftest import ROOT

    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_links.py"), "--steps", "2", "--warmup", "1",
         "--ps-mbps", "20", "--down-mbps", "40", "--up-mbps", "20", "--relay-mbps", "100", "--json"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    fig = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("measured_step_s", "predicted_step_s", "ps_egress_utilisation", "ps_link_mbps"):
        assert isinstance(fig[key], float) and fig[key] > 0, (key, fig)
    assert 0.3 < fig["predicted_over_measured"] < 3, fig
    assert fig["mb_relay_out_per_step"] > 0 and all(n > 0 for n in fig["tiles_per_client"]), fig
    assert [n for n in leftovers() if n.endswith("-relay")] == []  # (another test's lab may be up meanwhile)
