"""Hostile volunteers against a real coordinator process on 127.0.0.1: devices that hold work
and never return it, floods of unauthenticated connections and oversized frames, stolen or
revoked credentials, TLS. Every job still trains exactly like plain torch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import TIMEOUT
from procs import OPERATOR, TOKEN, Coordinator, Proc, cleave_cmd, double, join, local_losses, run_all, wait_until

from cleave.client.credentials import CredentialStore
from cleave.coordinator.engine.limits import Limits, memory_bound
from cleave.wire import auth
from cleave.wire.codes import CloseCode
from cleave.wire.messages import Challenge, Hello, decode, encode

pytestmark = pytest.mark.drill  # real processes train through real sockets (README: the parts of the suite)


def _exact(coord: Coordinator, steps: int) -> None:
    for got, want in zip(coord.losses(), local_losses(steps), strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)


def test_three_stalling_clients_cannot_stop_an_honest_one(tmp_path: Path) -> None:
    """They take tiles, keep heartbeating and never answer: the honest client finishes the job."""
    steps = 6
    coord = Coordinator(tmp_path, "--min-devices", "4", steps=steps)
    stallers = [double("stall", coord.url, f"staller{i}") for i in range(3)]
    wait_until(lambda: coord.query("SELECT COUNT(*) FROM devices")[0][0] == 3, TIMEOUT, "the stallers")
    started = time.monotonic()
    honest = join(coord.url, "honest")
    assert coord.wait() == 0, coord.output
    elapsed = time.monotonic() - started
    assert honest.wait() == 0, honest.output
    _exact(coord, steps)
    # Bounded by the deadlines: far less than one lease floor per tile the stallers took.
    taken = coord.query(
        "SELECT COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id WHERE d.name LIKE 'staller%'"
    )[0][0]
    assert taken > 0 and elapsed < 60, (taken, elapsed)
    assert coord.query(
        "SELECT COUNT(*) FROM leases l JOIN devices d ON d.id = l.device_id "
        "WHERE d.name LIKE 'staller%' AND l.outcome = 'verified'"
    ) == [(0,)]
    # Found out: cut after their tiles kept going to others, and cooling off.
    reasons = [r for (r,) in coord.query("SELECT reason FROM devices WHERE name LIKE 'staller%'")]
    assert any("come back in" in r for r in reasons), reasons
    for s in stallers:
        s.kill()


def _upgrade(port: int) -> socket.socket:
    """A raw websocket upgrade: the attacker needs no token to get this far."""
    import base64

    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        key = base64.b64encode(os.urandom(16))
        s.sendall(
            b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise ConnectionError("closed during the upgrade")
            head += chunk
    except BaseException:
        s.close()
        raise
    return s


def _huge_frame(port: int, nbytes: int) -> tuple[int, int | None]:
    """Declare one binary frame of ``nbytes`` and stream it until the server's close frame comes
    back. Returns (bytes sent, the close code, or None if the connection was refused or cut
    without one)."""
    import select
    import struct

    try:
        s = _upgrade(port)
    except OSError:
        return 0, None  # refused at a cap
    sent, got = 0, b""
    try:
        s.sendall(b"\x82\xff" + struct.pack(">Q", nbytes) + os.urandom(4))
        chunk = bytes(1 << 20)
        while sent < nbytes:
            # The server refuses at the frame header; its close frame is read as soon as it comes
            # (once it cuts the socket, data left unread may be lost with the reset).
            while select.select([s], [], [], 0)[0]:
                more = s.recv(4096)
                if not more:
                    break
                got += more
                if (code := _close_code(got)) is not None:
                    return sent, code
            s.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass  # the coordinator closed it
    finally:
        s.close()
    return sent, _close_code(got)


def _close_code(data: bytes) -> int | None:
    """The code of the first close frame in what a server sent (its frames are unmasked)."""
    import struct

    at = 0
    while at + 2 <= len(data):
        opcode, length, at = data[at] & 0x0F, data[at + 1] & 0x7F, at + 2
        if length >= 126:
            size = 2 if length == 126 else 8
            if at + size > len(data):
                return None
            length, at = int.from_bytes(data[at : at + size], "big"), at + size
        if opcode == 0x8:
            return struct.unpack(">H", data[at : at + 2])[0] if at + 2 <= len(data) else None
        at += length
    return None


def test_unauthenticated_floods_stay_within_the_stated_memory_bound(tmp_path: Path) -> None:
    """Huge frames and hundreds of connections before any token: memory stays inside the bound
    of docs/security.md, and a job training meanwhile is exact."""
    from concurrent.futures import ThreadPoolExecutor

    # The floods take about a second from step 3 (a step or two here): 10 steps leave the job 5 more.
    steps, max_connections = 10, 300
    coord = Coordinator(tmp_path, "--min-devices", "1", "--max-connections", str(max_connections), steps=steps)
    port = int(coord.url.rsplit(":", 1)[1])
    honest = join(coord.url, "honest")
    coord.wait_for_step(3)
    proc = psutil.Process(coord.proc.pid)
    baseline = max(proc.memory_info().rss for _ in range(5) if time.sleep(0.02) is None)
    peak = baseline
    with ThreadPoolExecutor(48) as pool:
        # The floods first, so that they get connections before the idle ones fill the cap.
        floods = [pool.submit(_huge_frame, port, 96 << 20) for _ in range(32)]
        waiting = [pool.submit(_try, lambda: _upgrade(port)) for _ in range(400)]  # never say hello
        while not all(f.done() for f in floods + waiting):
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.02)
        refused = [f.result() for f in floods]
        idle = [f.result() for f in waiting]
        for _ in range(20):
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.02)
    assert coord.steps_done() < steps, "the floods must hit a job that trains"
    opened = [s for s in idle if s is not None]
    for s in opened:
        s.close()
    limits = Limits(max_connections=max_connections)
    bound = memory_bound(limits, devices_holding=0, largest_result=0, largest_frame=0)["unauthenticated"]
    assert peak - baseline <= bound, (peak - baseline, bound)
    # Nobody got to send a 96 MiB frame: every flood that got a connection was refused at the
    # frame's header with "too big", before its end (after the refusal the server only discards
    # bytes until it cuts the socket, 2 s later, so how many an attacker pushes is no measure).
    assert all(sent < 96 << 20 and code == CloseCode.TOO_BIG for sent, code in refused if sent), refused
    assert coord.wait() == 0, coord.output
    assert honest.wait() == 0
    _exact(coord, steps)
    assert "Traceback" not in coord.output
    print(
        f"rss growth {(peak - baseline) / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB, "
        f"{len(opened)} of 400 idle connections accepted, {sum(1 for sent, _ in refused if sent)} of 32 floods "
        "refused at their frame's header"
    )


def _try(fn):  # noqa: ANN001, ANN202
    try:
        return fn()
    except OSError:
        return None


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_all(cleave_cmd(*args), timeout=2 * TIMEOUT)[0]


def _devices_list(coord: Coordinator) -> list[str]:
    return cleave_cmd("coordinator", "devices", "list", "--db", str(coord.db), "--json")


def _listed(run: subprocess.CompletedProcess[str]) -> dict[str, dict]:
    assert run.returncode == 0, run.stderr
    return {row["name"]: row for row in json.loads(run.stdout)}


def test_credentials_revocation_rotation_and_the_operator_token(tmp_path: Path) -> None:
    # The job waits for more devices than ever join: enrolment, credentials and revocation need a
    # live coordinator, not training (which would only spend the CPU the other tests need).
    coord = Coordinator(tmp_path, "--min-devices", "9", steps=100_000)
    first = join(coord.url, "alice")
    wait_until(lambda: coord.query("SELECT value FROM settings WHERE key = 'coordinator_id'"), TIMEOUT, "the id")
    (coordinator_id,) = coord.query("SELECT value FROM settings WHERE key = 'coordinator_id'")[0]
    wait_until(lambda: CredentialStore().get(coordinator_id, "alice", coord.url), TIMEOUT, "alice's credential")
    first.kill()
    again = join(coord.url, "alice", token="not-needed-any-more")  # the stored credential, not the token
    wait_until(
        lambda: coord.query("SELECT COUNT(*) FROM devices WHERE state = 'online'") == [(1,)], TIMEOUT, "alice back"
    )
    # Three commands that only read, side by side: the devices list, and the status as a volunteer
    # (refused) and as the operator.
    listed, as_volunteer, as_operator = run_all(
        _devices_list(coord),
        cleave_cmd("status", "--url", coord.url, "--token", TOKEN, "--json"),
        cleave_cmd("status", "--url", coord.url, "--token", OPERATOR, "--json"),
        timeout=2 * TIMEOUT,
    )
    alice = _listed(listed)["alice"]
    assert coord.query("SELECT COUNT(*) FROM identities") == [(1,)] and alice["state"] == "active"

    # Someone else's hello, with a wrong, missing or replayed proof, gets nothing.
    stolen = CredentialStore().get(coordinator_id, "alice", coord.url)
    assert stolen is not None and stolen.identity == alice["id"]
    assert asyncio.run(_refusals(coord.url, stolen.identity, stolen.secret)) == [
        (CloseCode.AUTH, "unknown identity or wrong credential")
    ] * 3 + [(CloseCode.IN_USE, "this identity is already connected")]

    # Volunteers cannot read the dashboard; the operator can.
    assert as_volunteer.returncode == 2
    assert json.loads(as_operator.stdout)["job"]

    # A new join token: enrolled devices carry on, the old token enrols nobody.
    rotated = _cli("coordinator", "token", "rotate", "--db", str(coord.db))
    new_token = rotated.stdout.strip().rsplit(" ", 1)[1]
    time.sleep(1.5)
    late = join(coord.url, "bob")
    assert late.wait() == 2 and "refused the join token" in late.output
    bob = join(coord.url, "bob", token=new_token)
    wait_until(lambda: coord.query("SELECT name FROM identities WHERE name = 'bob'") == [("bob",)], TIMEOUT, "bob")
    # Revoked: cut at once, and refused from then on (no silent re-enrolment). The list is read
    # beside the revocation: bob is listed whatever alice's state.
    listed, revoked = run_all(
        _devices_list(coord),
        cleave_cmd(
            "coordinator", "devices", "revoke", str(alice["id"]), "--db", str(coord.db), "--reason", "laptop stolen"
        ),
        timeout=2 * TIMEOUT,
    )
    assert "bob" in _listed(listed)  # bob enrolled
    assert revoked.returncode == 0
    assert again.wait() == 2 and "laptop stolen" in again.output
    # A revoked credential cannot be unbanned (asked while the joins below run).
    unban = Proc(cleave_cmd("coordinator", "devices", "unban", str(alice["id"]), "--db", str(coord.db)), "unban")
    refused = join(coord.url, "alice", token=new_token)
    assert refused.wait() == 2 and "revoked" in refused.output
    fresh = join(coord.url, "alice", "--new-identity", token=new_token)  # enrols as a new device
    wait_until(
        lambda: coord.query("SELECT COUNT(*) FROM identities WHERE name = 'alice'") == [(2,)], TIMEOUT, "a new identity"
    )
    states = sorted(s for (s,) in coord.query("SELECT state FROM identities WHERE name = 'alice'"))
    assert states == ["active", "revoked"]
    assert unban.wait() == 2
    for p in (bob, fresh, coord):
        p.kill()


async def _refusals(url: str, identity: int, secret: bytes) -> list[tuple[int | None, str]]:
    """Hellos for ``identity``: a wrong secret, no proof, a proof recorded on another
    connection (a replay), and the right one while the device is connected."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def attempt(make_proof) -> tuple[int | None, str]:  # noqa: ANN001
        async with connect(url, compression=None) as ws:
            challenge = decode(await ws.recv())
            assert isinstance(challenge, Challenge)
            await ws.send(encode(Hello(name="thief", identity=identity, proof=make_proof(challenge.nonce))))
            try:
                while True:
                    await ws.recv()
            except ConnectionClosed:
                return ws.close_code, ws.close_reason

    recorded = auth.proof(secret, identity, bytes(32)).hex()  # as if captured from an earlier connection
    return [
        await attempt(lambda nonce: auth.proof(os.urandom(32), identity, bytes.fromhex(nonce)).hex()),
        await attempt(lambda nonce: ""),
        await attempt(lambda nonce: recorded),
        await attempt(lambda nonce: auth.proof(secret, identity, bytes.fromhex(nonce)).hex()),
    ]


def test_tls_end_to_end_with_a_private_ca_and_plain_ws_refused_off_this_machine(tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    certfile, keyfile, cafile = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    ca.cert_pem.write_to_path(str(cafile))
    steps = 5
    coord = Coordinator(
        tmp_path, "--min-devices", "1", "--certfile", str(certfile), "--keyfile", str(keyfile), steps=steps
    )
    assert coord.url.startswith("wss://")
    url = coord.url.replace("127.0.0.1", "localhost")
    untrusting = join(url, "untrusting")  # the system store does not know this CA
    assert untrusting.wait() == 2 and "certificate does not verify" in untrusting.output
    status = _cli("status", "--url", url, "--token", OPERATOR, "--json", "--cafile", str(cafile))
    assert status.returncode == 0, status.stderr
    # The dashboard and the metrics are served over the same TLS.
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=str(cafile))
    page = url.replace("wss://", "https://")
    with urllib.request.urlopen(page + "/", context=context, timeout=TIMEOUT) as r:
        assert r.status == 200 and b'src="/static/dashboard.js"' in r.read()
    with urllib.request.urlopen(page + "/api/status", context=context, timeout=TIMEOUT) as r:
        assert json.loads(r.read())["job"]["steps"] == steps
    with urllib.request.urlopen(page + "/metrics", context=context, timeout=TIMEOUT) as r:
        assert b"cleave_steps_total" in r.read()
    client = join(url, "trusting", "--cafile", str(cafile))
    assert coord.wait() == 0, coord.output
    assert client.wait() == 0, client.output
    _exact(coord, steps)
    plain = Proc(cleave_cmd("join", "ws://192.0.2.1:8765", "--token", TOKEN, "--once"), "plain")
    assert plain.wait() == 2 and "refusing unencrypted ws://" in plain.output
    ok = Proc(cleave_cmd("join", "ws://192.0.2.1:9", "--token", TOKEN, "--insecure", "--quiet"), "consenting")
    wait_until(lambda: ok.proc.poll() is None and time.sleep(1.0) is None, TIMEOUT, "a retrying client")
    ok.kill()


KINDS = [
    "pair",
    "hadamard4",
    "orthogonal",
    "pairs_many_rows",
    "pairs_one_row",
    "low_rank",
    "perturbed_operands",
    "scaled",
    "stale_weights",
    "previous_batch",
    "replay",
    "stale",
    "swap_rows",
    "swap_cols",
    "zeros",
    "nan",
    "inf",
]


def test_every_forging_double_is_caught_banned_and_stays_banned(tmp_path: Path) -> None:
    """One forger per kind of forgery (tests/forgeries.py), each honest until it has left
    probation, then forging every result at twice the detection threshold, next to one honest
    client: nothing forged is verified, each forger is banned and refused when it comes back."""
    steps = 14
    # It lingers: a forger banned by the last steps comes back after the job, and must still be
    # refused (not left retrying a coordinator that has gone).
    coord = Coordinator(tmp_path, "--min-devices", str(len(KINDS) + 1), steps=steps, linger=5)
    forgers = double("forge", coord.url, "forger", ",".join(KINDS))
    honest = join(coord.url, "honest")
    assert honest.wait(4 * TIMEOUT) == 0, honest.output
    assert forgers.wait() == 0, forgers.output  # each came back after its ban: during the job or its linger
    coord.proc.send_signal(signal.SIGINT)  # Ctrl-C ends the linger (not the job): nothing is left to wait for
    assert coord.wait() == 0, coord.output
    _exact(coord, steps)
    reports = {r["kind"]: r for r in map(json.loads, (line for line in forgers.lines if line.startswith("{")))}
    assert set(reports) == set(KINDS), forgers.output
    for kind, report in reports.items():
        name = report["name"]
        (state,) = coord.query("SELECT state FROM identities WHERE name = ?", name)[0]
        verified, rejected = coord.query("SELECT tiles_done, tiles_rejected FROM devices WHERE name = ?", name)[0]
        assert report["forged"] >= 1, (kind, report)  # it really forged
        assert rejected >= 1 and verified <= report["honest"], (kind, report, verified, rejected)  # caught, every time
        assert state == "banned", (kind, state)
        assert [c[:2] for c in report["closes"]] == [["error", 3], ["error", 3]], (kind, report)  # banned twice
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
