"""A tier's pools kept even: redirect tickets (wire/auth.py), the balancer's placement rule and its
single-use tickets (engine/balance.py), the client session's side, and the Core admitting and
redirecting newcomers on a real store."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import torch
from conftest import TIMEOUT
from test_core import Fleet, submit
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from cleave.client.session import Ending, Redirected, Session
from cleave.coordinator.engine.balance import (
    REDEEM_GRACE,
    SHUN,
    TICKET_TTL,
    UNMEASURED_GFLOPS,
    UNREDEEMED,
    Balancer,
    Pool,
    Redirecting,
)
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.outbound import Send
from cleave.coordinator.net.server import Server, listen
from cleave.coordinator.planning.tiles import TilingPolicy
from cleave.db.memory import MemoryStore
from cleave.wire import auth
from cleave.wire.codes import CloseCode
from cleave.wire.errors import AuthError
from cleave.wire.messages import Challenge, Credential, Hello, Redirect, Welcome, decode, encode

SECRET = b"the tier's secret"
LOCAL = "ws://127.0.0.1:8"  # a rank on this machine: it may send newcomers to others on it
NOW = 1_767_225_600.0


def test_a_ticket_opens_only_at_its_rank_before_it_expires_and_only_with_the_tiers_seal() -> None:
    ticket = auth.redirect_ticket(SECRET, 2, int(NOW) + 300, bytes(16))
    assert len(ticket) == auth.TICKET_BYTES == 60
    assert auth.open_ticket(SECRET, 2, ticket, NOW) == (bytes(16), int(NOW) + 300)
    for secret, rank, data, now, why in [
        (b"another tier", 2, ticket, NOW, "not sealed"),
        (SECRET, 1, ticket, NOW, "made for rank 2"),
        (SECRET, 2, ticket, NOW + 301, "expired"),
        (SECRET, 2, ticket[:-1], NOW, "not a ticket"),
        (SECRET, 2, ticket[:5] + bytes([ticket[5] ^ 1]) + ticket[6:], NOW, "not sealed"),  # its expiry moved
    ]:
        with pytest.raises(ValueError, match=why):
            auth.open_ticket(secret, rank, data, now)


def _balancer(rank: int = 0) -> Balancer:
    counter = iter(range(1000))
    return Balancer(rank, SECRET, random_bytes=lambda n: next(counter).to_bytes(n, "little"))


def test_a_newcomer_goes_to_the_weakest_pool_when_it_is_clearly_weaker_than_ours() -> None:
    b = _balancer()
    assert b.place(100.0, 10.0, NOW) is None  # no other rank known: stay
    b.update([Pool(1, "ws://r1:1", 95.0, seq=1), Pool(2, "ws://r2:1", 60.0, seq=1), Pool(0, "ws://me:1", 1.0, 1)])
    assert set(b.pools) == {1, 2}  # never itself
    go = b.place(100.0, 10.0, NOW)
    assert isinstance(go, Redirect) and go.rank == 2 and go.url == "ws://r2:1" and "needs devices more" in go.reason
    assert auth.open_ticket(SECRET, 2, bytes.fromhex(go.ticket), NOW + TICKET_TTL) is not None
    assert b.place(100.0, 10.0, NOW).rank == 2  # 70 counted (60 + the 10 sent): still the weakest
    assert b.place(100.0, 10.0, NOW).rank == 2  # 80
    assert b.place(100.0, 10.0, NOW) is None  # 90 >= 100 x 0.9 and 95 too: within the slack, stay
    b.update([Pool(1, "ws://r1:1", 95.0, seq=1), Pool(2, "ws://r2:1", 60.0, seq=1)])  # the same summary
    assert b.place(100.0, 10.0, NOW) is None  # what was sent still counts
    b.update([Pool(1, "ws://r1:1", 95.0, seq=1), Pool(2, "ws://r2:1", 92.0, seq=2)])  # rank 2's new summary
    assert b.place(100.0, 10.0, NOW) is None
    assert b.place(200.0, 10.0, NOW).rank == 2  # our pool grew: 92 is clearly weaker again
    assert b.redirected == 4


def test_a_rank_whose_tickets_are_never_redeemed_gets_no_newcomers_for_a_while() -> None:
    """Rank 1 is weakest but unreachable from outside (its URL names a host only the operator's
    network resolves): after UNREDEEMED tickets over REDEEM_GRACE seconds with none admitted
    there, newcomers stay here (or go to the next weakest) until SHUN has passed; a rank that
    admits its newcomers is never shunned."""
    b = _balancer()
    b.update([Pool(1, "ws://r1:1", 0.0, 1, admitted=5), Pool(2, "ws://r2:1", 40.0, 1, admitted=0)])
    for i in range(UNREDEEMED):  # the same newcomer coming back, say: each time sent to rank 1
        b.update([Pool(1, "ws://r1:1", 0.0, 1 + i, admitted=5), Pool(2, "ws://r2:1", 40.0, 1, admitted=0)])
        assert b.place(100.0, 1.0, NOW + i).rank == 1
    assert b.place(100.0, 1.0, NOW + REDEEM_GRACE - 1).rank == 1  # not yet: tickets take a while
    b.update([Pool(1, "ws://r1:1", 0.0, 9, admitted=5), Pool(2, "ws://r2:1", 40.0, 1, admitted=0)])
    assert b.place(100.0, 1.0, NOW + REDEEM_GRACE).rank == 2  # rank 1 shunned: the next weakest
    assert b.shunned(NOW + REDEEM_GRACE) == [1]
    b.update([Pool(1, "ws://r1:1", 0.0, 10, admitted=5), Pool(2, "ws://r2:1", 95.0, 2, admitted=0)])
    assert b.place(100.0, 1.0, NOW + REDEEM_GRACE + 1) is None  # nowhere else is weaker: stay here
    assert b.place(100.0, 1.0, NOW + REDEEM_GRACE + SHUN).rank == 1  # tried again after a while
    # A rank that admits what it is sent is never shunned, however many it is sent.
    ok = _balancer()
    for i in range(3 * UNREDEEMED):
        ok.update([Pool(1, "ws://r1:1", 0.0, 1 + i, admitted=i)])
        assert ok.place(100.0, 1.0, NOW + i * REDEEM_GRACE).rank == 1
    assert ok.shunned(NOW + 100 * REDEEM_GRACE) == []


def _admit(balancer: Balancer, ticket: str, now: float) -> None:
    balancer.spend(balancer.check(ticket, now))


def test_a_newcomer_is_only_sent_where_it_can_follow() -> None:
    """Not from a wss:// rank to a ws:// one (the client would not drop TLS), not to a loopback
    address from a rank that is not on one (a newcomer from elsewhere would reach itself)."""
    pools = [Pool(1, "ws://10.0.0.2:8765", 0.0, 1), Pool(2, "ws://127.0.0.1:8765", 0.0, 1),
             Pool(3, "wss://r3.example.org:8765", 0.0, 1), Pool(4, "http://r4:80", 0.0, 1)]  # fmt: skip
    for url, reachable in [
        ("wss://r0.example.org:8765", {3}),
        ("ws://10.0.0.1:8765", {1, 3}),
        ("ws://127.0.0.1:8765", {1, 2, 3}),
    ]:
        b = Balancer(0, SECRET, url=url)
        b.update(pools)
        assert set(b.pools) == reachable, url


def test_a_ticket_admits_once_at_its_rank() -> None:
    sender, receiver = _balancer(0), _balancer(1)
    sender.update([Pool(1, "ws://r1:1", 0.0, 1)])
    ticket = sender.place(50.0, 5.0, NOW).ticket
    receiver.check(ticket, NOW + 1)  # checked, not spent (its newcomer was told to wait): still good
    _admit(receiver, ticket, NOW + 1)
    with pytest.raises(AuthError, match="already used") as spent:
        receiver.check(ticket, NOW + 2)
    assert spent.value.code == CloseCode.AUTH
    with pytest.raises(AuthError, match="made for rank 1"):
        _balancer(2).check(ticket, NOW + 1)
    with pytest.raises(AuthError, match="expired"):
        _balancer(1).check(sender.place(50.0, 5.0, NOW).ticket, NOW + TICKET_TTL + 1)
    with pytest.raises(AuthError, match="not sealed by a rank of this tier"):
        receiver.check("00" * 60, NOW)
    with pytest.raises(AuthError, match="not a ticket"):
        receiver.check("00" * 59, NOW)
    assert receiver.admitted == 1


def _session(**kw: object) -> Session:
    return Session(Hello(name="lap"), now=0.0, token="join", **kw)  # type: ignore[arg-type]


def test_the_client_session_follows_a_redirect_only_in_answer_to_its_hello() -> None:
    s = _session()
    s.receive(Challenge(nonce="ab" * 32, coordinator="c0"), 0.0)
    (hello,) = s.messages_to_send()
    assert hello.token == "join" and not hello.ticket
    ticket = "cd" * 60
    (event,) = s.receive(Redirect("wss://r1:8765", 1, ticket, "rank 1 needs devices more"), 0.1)
    assert event == Redirected("wss://r1:8765", 1, ticket, "rank 1 needs devices more")
    assert s.ended == Ending.REDIRECTED and s.closed(CloseCode.REDIRECTED, "redirected to rank 1") == Ending.REDIRECTED
    # At the new rank: the ticket, never the first rank's join token.
    t = _session(ticket=ticket)
    t.receive(Challenge(nonce="ab" * 32, coordinator="c1"), 0.0)
    (hello,) = t.messages_to_send()
    assert hello.ticket == ticket and hello.token == "" and t.enrolling
    # After a welcome, a redirect is not taken.
    t.receive(Welcome(3, 9, "job", 2), 0.1)
    assert t.receive(Redirect("ws://127.0.0.1:1", 0, ticket), 0.2) == [] and t.ended is None


def _core(token: str = "tok") -> Core:
    store = MemoryStore()
    return Core(
        store, store.create_job("tier", {}, 10, 0.0), join_token=token, operator_token="op",
        rng=np.random.default_rng(0), epoch=NOW,
    )  # fmt: skip


def _credential(out: list) -> Credential:
    (cred,) = [o.message for o in out if isinstance(o, Send) and isinstance(o.message, Credential)]
    return cred


def test_a_rank_redirects_a_newcomer_before_enrolling_it_and_the_other_rank_admits_its_ticket_once() -> None:
    """Rank 0 (one device) learns rank 1's pool is empty: a newcomer with the join token is sent
    there with a ticket and leaves no identity behind; rank 1 (its own join token) admits it on
    the ticket, once. A wrong join token is refused before any placement, a device with an
    identity at rank 0 is never sent away, and a ticket means nothing to a coordinator that is
    no rank of a tier."""
    rank0, rank1 = _core(), _core(token="another-token")
    rank0.join_tier(Balancer(0, SECRET, url=LOCAL))
    rank1.join_tier(Balancer(1, SECRET, url=LOCAL))
    first, out = rank0.connect(Hello(name="first", token="tok", gflops=50.0), rank0.gate.challenge().nonce, 1.0)
    cred = _credential(out)
    rank0.disconnect(first, 1.5, "left")
    rank0.connect(Hello(name="second", token="tok", gflops=50.0), rank0.gate.challenge().nonce, 1.6)
    rank0.admissions.balancer.update([Pool(1, "ws://127.0.0.1:9", 0.0, seq=1)])
    with pytest.raises(AuthError, match="wrong join token"):
        rank0.connect(Hello(name="x", token="nope"), rank0.gate.challenge().nonce, 2.0)
    identities = len(rank0.store.identities())
    with pytest.raises(Redirecting) as sent:
        rank0.connect(Hello(name="newcomer", token="tok", gflops=50.0), rank0.gate.challenge().nonce, 2.0)
    redirect = sent.value.message
    assert redirect.rank == 1 and redirect.url == "ws://127.0.0.1:9"
    assert len(rank0.store.identities()) == identities  # nothing enrolled for it here
    assert "newcomer" not in [d.name for d in rank0.devices.values()]
    _, out = rank1.connect(
        Hello(name="newcomer", ticket=redirect.ticket, gflops=50.0), rank1.gate.challenge().nonce, 3.0
    )
    assert [d.name for d in rank1.devices.values()] == ["newcomer"] and _credential(out).identity
    with pytest.raises(AuthError, match="already used"):
        rank1.connect(Hello(name="again", ticket=redirect.ticket), rank1.gate.challenge().nonce, 4.0)
    # A device with an identity here stays, however weak the other pool.
    challenge = rank0.gate.challenge()
    proof = auth.proof(bytes.fromhex(cred.secret), cred.identity, bytes.fromhex(challenge.nonce)).hex()
    back, _ = rank0.connect(Hello(name="first", identity=cred.identity, proof=proof), challenge.nonce, 5.0)
    assert rank0.devices[back].identity == cred.identity
    # A coordinator that is no rank refuses tickets.
    plain = _core()
    with pytest.raises(AuthError, match="not a rank of a tier"):
        plain.connect(Hello(name="t", ticket=redirect.ticket), plain.gate.challenge().nonce, 5.0)


def test_a_burst_of_newcomers_on_tickets_waits_for_the_enrolment_rate_without_losing_its_tickets() -> None:
    """Thirty newcomers sent to rank 1 at once: past the enrolment burst they are told to come back
    (1013), their tickets unspent; coming back later, each enrols on the same ticket."""
    rank0, rank1 = _core(), _core(token="another-token")
    rank0.join_tier(Balancer(0, SECRET, url=LOCAL))
    rank1.join_tier(Balancer(1, SECRET, url=LOCAL))
    rank0.connect(Hello(name="anchor", token="tok", gflops=1000.0), rank0.gate.challenge().nonce, 0.0)
    rank0.admissions.balancer.update([Pool(1, "ws://127.0.0.1:9", 0.0, seq=1)])
    tickets = []
    for i in range(30):  # rank 0 sends them (its own enrolment rate counts them, spread over time)
        with pytest.raises(Redirecting) as sent:
            rank0.connect(Hello(name=f"n{i}", token="tok", gflops=1.0), rank0.gate.challenge().nonce, 0.5 * i)
        tickets.append(sent.value.message.ticket)
    busy = []
    for i, ticket in enumerate(tickets):
        try:
            rank1.connect(Hello(name=f"n{i}", ticket=ticket), rank1.gate.challenge().nonce, 20.0)
        except AuthError as exc:
            assert exc.code == CloseCode.BUSY, exc
            busy.append((i, ticket))
    assert busy and len(busy) < 30
    for n, (i, ticket) in enumerate(busy):  # later, at the enrolment rate
        rank1.connect(Hello(name=f"n{i}", ticket=ticket), rank1.gate.challenge().nonce, 30.0 + n)
    assert len(rank1.devices) == 30 and rank1.admissions.balancer.admitted == 30


def _placements(liars: bool) -> tuple[list[int | None], float]:
    """Twelve newcomers at rank 0 (four devices) while rank 1's pool is weak. With ``liars``,
    every other one claims 1e7 GFLOP/s (the most the wire allows) and never follows its
    redirect; without, an honest device of 400 GFLOP/s comes in its place. Where each went (a
    rank, or None: it enrolled here), and rank 0's pool after."""
    rank0 = _core()
    rank0.join_tier(Balancer(0, SECRET, url=LOCAL))
    for i in range(4):
        rank0.connect(Hello(name=f"anchor{i}", token="tok", gflops=400.0), rank0.gate.challenge().nonce, 1.0)
    rank0.admissions.balancer.update([Pool(1, "ws://127.0.0.1:9", 60.0, seq=1)])
    went: list[int | None] = []
    for i in range(12):
        claim = 1e7 if liars and i % 2 else 400.0
        try:
            rank0.connect(Hello(name=f"n{i}", token="tok", gflops=claim), rank0.gate.challenge().nonce, 2.0 + i)
            went.append(None)
        except Redirecting as sent:
            went.append(sent.message.rank)
    return went, rank0.pool()[1]


def test_newcomers_claiming_huge_rates_move_balancing_no_differently_from_honest_ones() -> None:
    """A hello's claim is not believed beyond UNMEASURED_GFLOPS: liars sent to rank 1 do not
    fill its pool (which would keep every later newcomer here), nor do those enrolled here swell
    this rank's; the placements are those of an honest run."""
    honest, liars = _placements(liars=False), _placements(liars=True)
    assert honest == liars
    went, pool = honest
    assert went.count(1) >= 5 and went.count(None) >= 3  # balancing did move devices
    assert pool <= (4 + went.count(None)) * UNMEASURED_GFLOPS


def test_a_device_counts_in_its_pool_at_its_measured_rate_once_it_returned_verified_work() -> None:
    store = MemoryStore()
    core = Core(
        store, store.create_job("t", {}, 10, 0.0), join_token="tok", rng=np.random.default_rng(0),
        policy=TilingPolicy(max_edge=64, min_edge=16, min_k=32, min_tile_flops=1),
    )  # fmt: skip
    fleet = Fleet(core)
    liar = fleet.join("liar", slots=1, gflops=1e7)
    assert core.pool() == (1, UNMEASURED_GFLOPS)  # not 1e7, nor 1e7 / 4
    box = submit(core, fleet, torch.randn(64, 32), torch.randn(32, 64))
    fleet.drain()
    measured = core.fleet.profiles[liar].profile(core.dtype).flops_per_s(core.dtype) / 1e9
    assert "result" in box and core.fleet.profiles[liar].results > 0
    assert core.pool()[1] == pytest.approx(measured) and measured < UNMEASURED_GFLOPS


def test_newcomers_that_ignore_their_redirect_are_dropped_and_do_not_get_the_weak_rank_shunned() -> None:
    """Over real websockets: three newcomers claim 1e7 GFLOP/s, take their redirect and stop
    reading (they never answer the close that follows). Each is dropped after the grace with
    4013, and its unredeemed ticket is put down to it: a minute later rank 1 is not shunned,
    and an honest newcomer is still sent there."""
    clock = [10.0]
    store = MemoryStore()
    core = Core(store, store.create_job("tier", {}, 10, 0.0), join_token="tok", rng=np.random.default_rng(0), epoch=NOW)
    core.join_tier(Balancer(0, SECRET, url=LOCAL))
    for i in range(4):
        core.connect(Hello(name=f"anchor{i}", token="tok", gflops=400.0), core.gate.challenge().nonce, 1.0)
    core.admissions.balancer.update([Pool(1, "ws://127.0.0.1:9", 0.0, seq=1)])
    server = Server(core, clock=lambda: clock[0])

    async def newcomer(url: str, gflops: float, *, ignore: bool) -> tuple[object, int | None]:
        async with connect(url, compression=None) as ws:
            assert isinstance(decode(await ws.recv()), Challenge)
            await ws.send(encode(Hello(token="tok", name="n", gflops=gflops)))
            first = decode(await ws.recv())
            if not isinstance(first, Redirect):  # enrolled here (its credential): balancing sent it nowhere
                return first, None
            if ignore:  # it reads nothing more: the close after the redirect goes unanswered
                ignored = core.admissions.balancer.ignored
                ws.transport.pause_reading()
                for _ in range(int(TIMEOUT / 0.02)):
                    if core.admissions.balancer.ignored > ignored:
                        break
                    await asyncio.sleep(0.02)
                ws.transport.resume_reading()
            with contextlib.suppress(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), TIMEOUT)
            return first, ws.close_code

    async def run() -> list[tuple[object, int | None]]:
        async with listen(server, "127.0.0.1", 0) as ws_server:
            url = f"ws://127.0.0.1:{ws_server.sockets[0].getsockname()[1]}"
            out = [await newcomer(url, 1e7, ignore=True) for _ in range(UNREDEEMED)]
            clock[0] += REDEEM_GRACE + 1
            out.append(await newcomer(url, 400.0, ignore=False))
            return out

    got = asyncio.run(run())
    for first, code in got[:UNREDEEMED]:
        assert isinstance(first, Redirect) and first.rank == 1 and code == CloseCode.REDIRECTED
    balancer = core.admissions.balancer
    assert balancer is not None
    assert balancer.ignored == UNREDEEMED and balancer.shunned(core.wall(clock[0])) == []
    first, code = got[-1]
    assert isinstance(first, Redirect) and first.rank == 1, first  # still sent where it is needed
