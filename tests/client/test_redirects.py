"""A volunteer's side of a tier's redirects (client/runner.py): where it will and will not follow,
how many in a row, and back home when the rank it was sent to fails it."""

from __future__ import annotations

import pytest

from cleave.client.runner import MAX_REDIRECTS, Worker, WorkerConfig
from cleave.client.session import Redirected
from cleave.wire.errors import Refused

TICKET = "ab" * 60


def _worker(url: str, **kw: object) -> Worker:
    return Worker(WorkerConfig(url, token="join-token", device="cpu", **kw))  # type: ignore[arg-type]


def test_a_redirect_never_drops_tls_nor_goes_where_its_owner_could_not_send_it() -> None:
    secure = _worker("wss://rank0.example.org:8765")
    with pytest.raises(Refused, match="refusing unencrypted ws://"):
        secure._follow(Redirected("ws://rank1.example.org:8765", 1, TICKET, "weaker pool"))
    secure = _worker("wss://rank0.example.org:8765", insecure=True)  # even where plain ws:// is allowed
    with pytest.raises(Refused, match="would drop TLS"):
        secure._follow(Redirected("ws://rank1.example.org:8765", 1, TICKET, "weaker pool"))
    assert secure.url == "wss://rank0.example.org:8765" and secure._ticket == ""
    local = _worker("ws://127.0.0.1:8765")  # plain ws:// to this machine only, unless --insecure
    with pytest.raises(Refused, match="redirected this device to rank 1"):
        local._follow(Redirected("ws://10.0.0.2:8765", 1, TICKET, "weaker pool"))
    with pytest.raises(Refused):
        local._follow(Redirected("http://127.0.0.1:80", 1, TICKET, "not a websocket"))
    assert _worker("ws://10.0.0.1:8765", insecure=True)._follow(Redirected("ws://10.0.0.2:8765", 1, TICKET, "ok"))


def test_a_followed_redirect_takes_the_ticket_never_the_join_token_and_a_failure_goes_home() -> None:
    w = _worker("wss://rank0.example.org:8765")
    w._follow(Redirected("wss://rank1.example.org:8765", 1, TICKET, "weaker pool"))
    assert (w.url, w._ticket) == ("wss://rank1.example.org:8765", TICKET)
    # The session it opens there presents the ticket; the join token only ever goes home.
    assert (w.cfg.token if w.url == w.cfg.url else "") == ""
    why = w._back_home("rank 1 unreachable")
    assert "back to wss://rank0.example.org:8765" in why
    assert (w.url, w._ticket, w._redirects) == ("wss://rank0.example.org:8765", "", 0)


def test_ranks_sending_a_device_round_in_circles_stop_it_but_a_failed_rank_starts_the_count_over() -> None:
    w = _worker("wss://rank0.example.org:8765")
    for hop in range(MAX_REDIRECTS):
        w._follow(Redirected(f"wss://rank{hop % 2 + 1}.example.org:8765", hop % 2 + 1, TICKET, "weaker"))
    with pytest.raises(Refused, match=f"redirected {MAX_REDIRECTS} times without being welcomed"):
        w._follow(Redirected("wss://rank1.example.org:8765", 1, TICKET, "weaker"))
    again = _worker("wss://rank0.example.org:8765")
    for _ in range(3 * MAX_REDIRECTS):  # home keeps sending it to a rank it cannot reach
        again._follow(Redirected("wss://rank1.internal:8765", 1, TICKET, "weaker"))
        again._back_home("rank 1 unreachable")
