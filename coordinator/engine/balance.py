"""Which rank of a tier a newcomer should serve: the tier's pools kept even by measured rate.

A job on a tier of coordinators trains equal slices of every batch on each rank, so the tier
goes at the pace of its weakest pool. Volunteers may all be given one rank's URL; that rank
sends a newcomer on (``Redirect``, with a ticket) to the rank whose pool is weakest, when that
pool is clearly weaker than its own: ``SLACK`` below it, as the ranks' published summaries say
(their ``gflops``: the devices' rates as each rank's cost model counts them, measured once a
device has returned work; until then at most ``UNMEASURED_GFLOPS``, whatever it claims). The
rank that gets it admits it once on its ticket (sealed under the tier's secret, for that rank,
for ``TICKET_TTL`` seconds, single-use).

Only newcomers move: a device that already has an identity on this rank keeps it (its record,
credit and trust are here), and one that came with a ticket stays where it was sent. The other
ranks' pools are a heartbeat or two old; this rank counts the devices it sent each rank since
that rank's last summary, so a burst of newcomers is spread rather than all sent to one rank.

Pure: no clock (``now`` is passed in), no I/O; randomness is injected.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cleave.wire import auth
from cleave.wire.addresses import is_loopback, url_host
from cleave.wire.codes import CloseCode
from cleave.wire.errors import AuthError, CleaveError
from cleave.wire.messages import Redirect

SLACK = 0.1  # another pool must be this much weaker than ours (a share of ours) to send a newcomer there
TICKET_TTL = 300  # seconds a ticket is good for (the ranks' clocks may disagree by a little)
MAX_TICKETS = 100_000  # tickets remembered as used, at most (each until it expires): ~10 MB
MIN_COUNTED = 1.0  # GFLOP/s a newcomer sent elsewhere counts for at least (a claim of 0 still fills a pool)
# GFLOP/s a device counts for at most in balancing until it has returned verified work (a modest
# CPU's): its hello's claim is not believed beyond it, so newcomers claiming huge rates neither
# fill the pool they are sent to nor swell the one they join. Measured rates replace it.
UNMEASURED_GFLOPS = 50.0
# A rank newcomers cannot reach (a host name that only resolves inside the operator's network, a
# firewall): this many tickets sent it over REDEEM_GRACE seconds with none admitted there, and no
# newcomer is sent it for SHUN seconds. They come back here and enrol (clients return to the URL
# their owner gave when a redirect fails), rather than being sent round until they give up.
UNREDEEMED = 3
REDEEM_GRACE = 60.0
SHUN = 600.0


@dataclass(frozen=True)
class Pool:
    """Another rank as its last believed summary describes it."""

    rank: int
    url: str
    gflops: float  # its devices' GEMM rate as its cost model counts them
    seq: int  # the summary's number: what this rank sent it since is counted until a newer one
    admitted: int = 0  # newcomers it admitted on tickets, so far (any rank's)


class Redirecting(CleaveError):  # noqa: N818 -- a decision, not an error: the server sends it and closes
    """``Core.connect``'s answer for a newcomer that should serve another rank."""

    def __init__(self, message: Redirect) -> None:
        super().__init__(f"redirected to rank {message.rank}")
        self.message = message


class Balancer:
    """This rank's side of keeping the tier's pools even (module doc)."""

    def __init__(
        self,
        rank: int,
        secret: bytes,
        *,
        url: str = "",
        slack: float = SLACK,
        ttl: int = TICKET_TTL,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.rank = rank
        self.url = url  # this rank's own public URL: which others its newcomers can follow to
        self.secret = secret
        self.slack = slack
        self.ttl = ttl
        self.random_bytes = random_bytes
        self.pools: dict[int, Pool] = {}
        self._sent: dict[int, tuple[int, float]] = {}  # rank -> (its summary's seq, GFLOP/s sent it since)
        self._used: OrderedDict[bytes, float] = OrderedDict()  # ticket nonce -> when it expires
        # rank -> (its admitted count when this rank first sent it one unredeemed, when, how many since)
        self._waiting: dict[int, tuple[int, float, int]] = {}
        self._shunned: dict[int, float] = {}  # rank -> until when no newcomer is sent it
        self.redirected = 0  # newcomers sent elsewhere
        self.ignored = 0  # of them, those that did not even answer the close after their redirect
        self.admitted = 0  # newcomers admitted on a ticket

    def update(self, pools: Iterable[Pool]) -> None:
        """The other ranks' pools, from the tier's view (alive ranks with a believed summary).
        Only ranks a newcomer here can follow to: not a plain ws:// one when this rank serves
        wss:// (the client would refuse to drop TLS), nor one on a loopback address unless this
        rank is on one too (a newcomer from elsewhere would be sent to itself)."""
        self.pools = {p.rank: p for p in pools if p.rank != self.rank and self._reachable(p.url)}
        for rank, (admitted, _, _) in list(self._waiting.items()):
            pool = self.pools.get(rank)
            if pool is not None and pool.admitted > admitted:  # newcomers reach it
                del self._waiting[rank]
        for rank, (seq, _) in list(self._sent.items()):
            pool = self.pools.get(rank)
            if pool is None or pool.seq != seq:  # a newer summary counts what was sent: start again
                del self._sent[rank]

    def _reachable(self, url: str) -> bool:
        if not url.startswith(("ws://", "wss://")):
            return False
        if self.url.startswith("wss://") and not url.startswith("wss://"):
            return False
        return not is_loopback(url_host(url)) or (bool(self.url) and is_loopback(url_host(self.url)))

    def place(self, mine: float, device: float, now: float) -> Redirect | None:
        """Where a newcomer claiming ``device`` GFLOP/s should go, this rank's pool being ``mine``:
        ``None`` to stay, else the redirect to send it (a fresh ticket). It counts for its claim
        within ``[MIN_COUNTED, UNMEASURED_GFLOPS]``: nothing it says is measured yet. O(ranks)."""
        if not math.isfinite(device) or device < 0:
            return None
        device = min(max(device, MIN_COUNTED), UNMEASURED_GFLOPS)
        for rank, (_, since, count) in list(self._waiting.items()):
            if count >= UNREDEEMED and now - since >= REDEEM_GRACE:
                self._shunned[rank] = now + SHUN
                del self._waiting[rank]
        open_ = [p for p in self.pools.values() if self._shunned.get(p.rank, -math.inf) <= now]
        weakest = min(open_, key=lambda p: (self._with_sent(p), p.rank), default=None)
        if weakest is None or self._with_sent(weakest) >= mine * (1 - self.slack):
            return None
        seq, sent = self._sent.get(weakest.rank, (weakest.seq, 0.0))
        self._sent[weakest.rank] = (seq, sent + device)
        admitted, since, count = self._waiting.get(weakest.rank, (weakest.admitted, now, 0))
        self._waiting[weakest.rank] = (admitted, since, count + 1)
        self.redirected += 1
        ticket = auth.redirect_ticket(self.secret, weakest.rank, int(now) + self.ttl, self.random_bytes(16))
        why = f"rank {weakest.rank}'s pool ({self._with_sent(weakest) - device:.0f} GFLOP/s) needs devices more"
        return Redirect(weakest.url, weakest.rank, ticket.hex(), why)

    def ignored_by(self, rank: int) -> None:
        """A newcomer sent to ``rank`` ignored its redirect (it did not answer the close that
        followed, within the grace): the server dropped it, and its ticket, never redeemed, is
        its doing, not a sign that ``rank`` cannot be reached: it does not count towards shunning."""
        self.ignored += 1
        waiting = self._waiting.get(rank)
        if waiting is not None:
            admitted, since, count = waiting
            if count <= 1:
                del self._waiting[rank]
            else:
                self._waiting[rank] = (admitted, since, count - 1)

    def shunned(self, now: float) -> list[int]:
        """Ranks no newcomer is sent to now: their tickets were not redeemed (``UNREDEEMED``)."""
        return sorted(r for r, until in self._shunned.items() if until > now)

    def _with_sent(self, pool: Pool) -> float:
        seq, sent = self._sent.get(pool.rank, (pool.seq, 0.0))
        return pool.gflops + (sent if seq == pool.seq else 0.0)

    def check(self, ticket: str, now: float) -> tuple[bytes, float]:
        """A newcomer's ticket for this rank, not yet spent: ``(nonce, expiry)`` for ``spend``.
        Raises ``AuthError``: 4001 for a ticket that is no good (one reason for the log, one
        message for the peer), 1013 while too many spent tickets are remembered."""
        try:
            nonce, expires = auth.open_ticket(self.secret, self.rank, bytes.fromhex(ticket), now)
        except ValueError as exc:
            raise AuthError(CloseCode.AUTH, f"redirect ticket refused ({exc})") from None
        while self._used and next(iter(self._used.values())) < now:  # expired ones cannot come back
            self._used.popitem(last=False)
        if nonce in self._used:
            raise AuthError(CloseCode.AUTH, "redirect ticket refused (already used)")
        if len(self._used) >= MAX_TICKETS:
            raise AuthError(CloseCode.BUSY, "too many newcomers on tickets at once; try again shortly")
        return nonce, expires

    def spend(self, ticket: tuple[bytes, float]) -> None:
        """The newcomer enrols on its ticket: it is used, until the ticket's own expiry."""
        nonce, expires = ticket
        self._used[nonce] = expires
        self.admitted += 1
