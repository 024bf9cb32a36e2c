"""Who may be a rank of a tier, and how the ranks notice one is gone.

``join_tier`` meets the other ranks at the rendezvous (``tcp://HOST:PORT``, rank 0 hosting
torch's TCPStore there, or ``env://`` under torchrun), forms the gloo process group, and then
makes every rank prove it holds the tier's secret before any of them trains: each draws a
fresh nonce, the nonces are gathered, and each rank sends ``HMAC(secret, rank | world | job |
nonces)`` (``wire/auth.py``). A rank whose proof fails, or that was started for another job (the
digest of its training options differs), stops every rank with ``TierRefused``; so does a rank
given another secret, as soon as a rank waiting at the rendezvous sees its arrival there (under
another namespace, at a place this tier's lacks: it never meets the others). A stranger's other
keys there stop nothing.

torch's store has no authentication of its own: anyone who reaches the rendezvous port can
read, list and write its keys. Rank 0 listens only on the address ``--rendezvous`` names; every
key lives under a namespace only the secret names, and every value a rank reads back is sealed
(gloo's addresses under the secret and rank 0's nonce for this run, the tier's own heartbeats,
arrivals, notices and summaries under the meeting's key) and bounded, so a stranger's is ignored
with a logged line (``rendezvous.py``). The proof keeps a stranger from ever counting as a rank;
none of this keeps it from deleting keys or filling the store, which is why the port belongs on
a private network (docs/security.md).

The tier's view: every ``STATUS_EVERY`` seconds the same thread publishes this rank's summary
(its step, devices, tiles a second, its pool's measured GFLOP/s, its URL) under ``status/<rank>``
in the store, sealed with an HMAC under the tier's secret (``wire/auth.tier_status_mac``), and
reads the others'. ``Tier.view()`` is what ``cleave status``, the dashboard and ``/metrics`` show
of the whole tier: a row per rank, with its health from its heartbeats. A summary whose seal fails
(written by a stranger at the port, or in an earlier run of the tier), that is too big or
malformed, or older than one already seen, is not believed: the rank's row then says so and
carries no figures. (The store hands over a value whole, however big: the size check is damage
control, not a bound on what a stranger at the port can make a rank read. The exchange runs on
a thread of its own with a 5 s store timeout, so it can never hold up a heartbeat.)

Liveness: every rank writes its heartbeat count to the store (``alive/<rank>``, sealed) every
``HEARTBEAT`` seconds from a thread of its own. Before each step's collectives a rank marks its
arrival (``step/<step>/<rank>``, sealed) and waits at the step's barrier until every rank's is
there; while it waits it watches the counts, and a rank whose count has not risen for
``timeout`` seconds is lost: ``RankLost`` names it and the job stops (exit 1). The rank that
notices first writes the loss to the store, and the others name the same rank from it (rank 0,
which hosts the store, waits up to ``ANNOUNCE_GRACE`` for them to read it before it leaves). A
rank that is merely slow (its volunteers are) keeps beating and is waited for. A lost rank 0
takes the store with it: the others then name rank 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from cleave.coordinator.tier.rendezvous import (
    HERE,
    LOOKOUT,
    RUN,
    Doubts,
    SealedStore,
    foreign,
    listen,
    namespace,
    seal,
    unseal,
)
from cleave.coordinator.training.parallel import DataParallel, all_gather
from cleave.wire import auth
from cleave.wire.errors import ConfigError, JobAborted

log = logging.getLogger("cleave.tier")

TIER_TIMEOUT = 60.0  # seconds without a heartbeat before a rank counts as lost (--tier-timeout)
HEARTBEAT = 1.0  # seconds between a rank's heartbeats
STATUS_EVERY = 2  # heartbeats between two publications of a rank's summary
MAX_STATUS_BYTES = 2048  # a published summary's JSON, at most (a bigger one is not believed)
VIEW_TIMEOUT = 5.0  # seconds a look at the store for the tier's view may wait
LOST, LOST_ACK = "lost", "lost/ack/{rank}"  # store keys: which rank was lost and why; a rank that read it
MAX_NEWS = 512  # bytes of a loss's notice, at most
MAX_COUNT = 20  # digits of a heartbeat count, at most
OTHER_SECRET = (
    "the rendezvous store holds keys under another secret: every rank needs the same --tier-secret"
    " (or a stranger at the port wrote them)"
)
ANNOUNCE_GRACE = 5.0  # seconds rank 0 keeps the store up for the others to read a loss
MAX_URL = 256
POLL = 0.02  # seconds between looks at a barrier
NONCE_BYTES = 32
MAX_WORLD = 1024


class RankLost(JobAborted):
    """A rank of the tier stopped answering: the others stop too, naming it."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"rank {rank} of the tier was lost ({why}); restart the ranks to resume")
        self.rank = rank


class TierRefused(ConfigError):
    """A rank could not prove it holds the tier's secret, or was started for another job."""


class Health(str, Enum):
    """A rank as the others see it, from its heartbeats."""

    ALIVE = "alive"  # beating
    SILENT = "silent"  # no heartbeat for a few seconds (slow, or on its way to lost)
    LOST = "lost"  # no heartbeat for the tier's timeout: the others stop at their next step
    SELF = "self"  # this rank


@dataclass(frozen=True)
class RankSummary:
    """What one rank publishes of itself (``Tier.publish``), checked field by field on reading."""

    seq: int  # publications so far: a summary older than one seen is a replay
    step: int
    state: str
    devices: int
    tiles_per_s: float
    gflops: float  # its connected devices' measured GEMM rates, summed: its pool's strength
    url: str
    admitted: int = 0  # newcomers admitted on redirect tickets so far (who reaches it)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RankSummary:
        """Raises ValueError on anything but a well-formed summary within bounds."""
        if len(data) > MAX_STATUS_BYTES:
            raise ValueError("too big")
        raw = json.loads(data)
        if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("not a summary")
        ints = {"seq": 2**53, "step": 10**9, "devices": 10**7, "admitted": 2**53}
        floats = {"tiles_per_s": 1e9, "gflops": 1e12}
        for key, top in ints.items():
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
                raise ValueError(f"bad {key}")
        for key, top in floats.items():
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 <= v <= top):
                raise ValueError(f"bad {key}")
        for key, limit in (("state", 32), ("url", MAX_URL)):
            v = raw[key]
            if not isinstance(v, str) or len(v) > limit or not v.isprintable():
                raise ValueError(f"bad {key}")
        if raw["url"] and not raw["url"].startswith(("ws://", "wss://")):
            raise ValueError("bad url")
        return cls(**raw)


@dataclass
class Tier:
    """This process's membership of a tier, once proven."""

    rank: int
    world: int
    store: dist.Store
    timeout: float = TIER_TIMEOUT
    clock: Callable[[], float] = time.monotonic
    secret: bytes = b""
    # This meeting's key: HMAC(secret, the job and every rank's fresh nonce), made when the ranks
    # prove themselves. It seals the summaries and the redirect tickets, so neither outlives this
    # run of the tier (a replay from an earlier run, under the same secret, fails its seal).
    key: bytes = b""
    # This rank's summary now (set by the job; read by the heartbeat thread, so it must not touch
    # the store or the engine: the job refreshes a snapshot on its loop).
    summary: Callable[[], RankSummary | None] | None = None
    # A client of the same store whose reads wait at most a heartbeat (``join_tier`` makes one):
    # a key a stranger deletes between a look and the read then costs a heartbeat, not the
    # store's whole timeout. None: ``store`` itself.
    reads: dist.Store | None = None
    _beats: dist.Store | None = None
    _beats_sent: int = 0
    _gloo: dist.Store | None = None  # the sealed store gloo met through (its C++ side calls back into it)
    _arrivals: list[str] = field(default_factory=list)  # this rank's arrival keys at the last barriers
    _lost_rank: int | None = None
    _doubts: Doubts = field(default_factory=Doubts)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rows: list[dict[str, Any]] = field(default_factory=list)
    _lost_announced: bool = False  # this rank told the others one was lost
    _seen: dict[int, RankSummary] = field(default_factory=dict)  # the newest believed summary of each rank
    _moved: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (beat count, when it last moved)

    @property
    def parallel(self) -> DataParallel:
        """What the trainer needs: its place, and this tier's barrier before each step's sums."""
        return DataParallel(self.rank, self.world, before_sum=self.arrive, on_failure=self.lost_in_collective)

    def start_heartbeat(self, beats: dist.Store, views: dist.Store | None = None) -> None:
        """Beat from a thread of its own on ``beats``, and exchange summaries from another on
        ``views`` (a store client with a short timeout): nothing a stranger does to a summary in
        the store can hold up a heartbeat, and so get this rank counted as lost."""
        self._beats = beats

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT):
                try:
                    self.beat(beats)
                except Exception:  # a slow store, or rank 0 gone (the barrier says so): beat on
                    continue

        # Every rank reads every rank's summary: O(world^2) store reads a round over the tier, so
        # a big tier exchanges less often (every 2 s up to 64 ranks, every 32 s at 1,024).
        every = max(STATUS_EVERY, math.ceil(self.world / 32)) * HEARTBEAT

        def look() -> None:
            failed = 0
            while not self._stop.wait(every):
                try:
                    self.exchange(views)
                    failed = 0
                except Exception as exc:  # a stranger's key, a slow store: the view waits, training does not
                    failed += 1
                    if failed == 1:
                        log.warning("tier: could not refresh the view of the other ranks: %s", exc)

        self.beat(beats)
        self._thread = threading.Thread(target=beat, name=f"cleave-tier-beat-{self.rank}", daemon=True)
        self._thread.start()
        if views is not None:
            threading.Thread(target=look, name=f"cleave-tier-view-{self.rank}", daemon=True).start()

    def _sealed(self, name: str, value: bytes) -> bytes:
        return seal(self.key, name, value)

    def _believed(
        self, store: dist.Store, names: list[str], limit: int, reads: dist.Store | None = None
    ) -> list[bytes | None]:
        """The values under ``names`` that a rank of this meeting sealed; None for one absent, or
        not believed (forged, moved from another key, from another run, too big: logged once).
        ``reads``: the client that reads what ``store`` found there (a short timeout). A key gone
        between the look and the read (a stranger deleted it) reads as absent, once the read's
        timeout is over. Raises what the store raises otherwise (it is gone)."""
        reads = store if reads is None else reads
        raw: list[bytes | None] | None = None
        if store.check(names):  # the usual case: one read for all
            try:
                raw = list(reads.multi_get(names))
            except dist.DistStoreError:  # one went meanwhile: a key at a time
                raw = None
        if raw is None:
            raw = [self._read_now(store, reads, name) for name in names]
        out: list[bytes | None] = []
        for name, data in zip(names, raw, strict=True):
            value, why = unseal(self.key, name, data, limit) if data is not None else (None, "")
            if why:
                self._doubts.note(name, why)
            elif value is not None:
                self._doubts.clear(name)
            out.append(value)
        return out

    @staticmethod
    def _read_now(store: dist.Store, reads: dist.Store, name: str) -> bytes | None:
        """``name``'s value, or None: absent, or gone before ``reads`` could read it."""
        if not store.check([name]):
            return None
        try:
            return reads.get(name)
        except dist.DistStoreError:  # (a wait's timeout: the key went after the look)
            return None

    def beat(self, store: dist.Store) -> None:
        """One heartbeat: this rank's count, sealed, so no one else can make it rise."""
        self._beats_sent += 1
        name = f"alive/{self.rank}"
        store.set(name, self._sealed(name, str(self._beats_sent).encode()))

    def _counts(self, store: dist.Store) -> list[int]:
        """Every rank's heartbeat count as sealed in the store (-1: none believed)."""
        got = self._believed(store, [f"alive/{r}" for r in range(self.world)], MAX_COUNT)
        return [int(v) if v and v.isdigit() else -1 for v in got]

    def _beat_counts(self) -> list[int]:
        try:
            got = self._believed(self.store, [f"alive/{r}" for r in range(self.world)], MAX_COUNT, self.reads)
            return [int(v) if v and v.isdigit() else -1 for v in got]
        except Exception as exc:  # rank 0 hosts the store
            raise RankLost(0, f"the rendezvous store on rank 0 stopped answering: {exc}") from None

    def _still_waiting(self, names: list[str], waiting: list[int], read: bool) -> tuple[list[int], bool]:
        """The ranks of ``waiting`` whose sealed arrival is not in the store yet, and whether a
        key of theirs holds a value not believed. One read while any is missing."""
        if not read:  # (asked only while a value is doubted: it stays so until the next read)
            return waiting, True
        keys = [names[r] for r in waiting]
        if not self.store.check(keys):
            return waiting, False
        values = self._believed(self.store, keys, 0, self.reads)
        left = [r for r, value in zip(waiting, values, strict=True) if value is None]
        return left, bool(left)

    def arrive(self, step: int) -> None:
        """Wait until every rank reached ``step``'s sums; raise ``RankLost`` for one that stopped
        beating for ``timeout`` seconds meanwhile."""
        names = [f"step/{step}/{r}" for r in range(self.world)]
        mine = names[self.rank]
        waiting = [r for r in range(self.world) if r != self.rank]
        try:
            self.store.set(mine, self._sealed(mine, b""))
            # Every rank has passed the barrier before last (it arrived at the last): its key can go.
            self._arrivals.append(mine)
            if len(self._arrivals) > 2:
                self.store.delete_key(self._arrivals.pop(0))
            waiting, doubted = self._still_waiting(names, waiting, read=True)
        except Exception as exc:
            raise RankLost(0, f"the rendezvous store on rank 0 stopped answering: {exc}") from None
        last = self._beat_counts()
        moved = [self.clock()] * self.world
        # Arrivals are one read; every rank's heartbeat is ``world`` reads, of counts that rise
        # once a second: read them once a heartbeat (less often in a big tier), not every poll.
        # So are arrivals once a key holds a value not believed (it may be big).
        looked = self.clock()
        every = HEARTBEAT * max(1, self.world // 64)
        while waiting:
            time.sleep(POLL)
            now = self.clock()
            look = now - looked >= every
            if look:
                looked = now
                self._heard_of_a_loss()
                counts = self._beat_counts()
                for r, (old, new) in enumerate(zip(last, counts, strict=True)):
                    if new > old:
                        moved[r] = now
                    elif r != self.rank and now - moved[r] > self.timeout:
                        self._announce(r, f"no heartbeat for {self.timeout:g} s")
                last = [max(old, new) for old, new in zip(last, counts, strict=True)]
            try:
                if look:  # again: a stranger may have deleted or overwritten it
                    self.store.set(mine, self._sealed(mine, b""))
                waiting, doubted = self._still_waiting(names, waiting, read=look or not doubted)
            except Exception as exc:
                raise RankLost(0, f"the rendezvous store on rank 0 stopped answering: {exc}") from None

    def lost_in_collective(self, error: BaseException) -> None:
        """A collective failed (gloo: a peer's connection closed, or its own timeout). A rank that
        dies after it reached the barrier (the fastest, say) leaves the others in the sums, not
        at the barrier: find it as the barrier would, from a sealed notice of another rank or a
        rank silent for ``timeout`` seconds, and raise ``RankLost`` naming it (within ``timeout``
        plus a few heartbeats). Returns, leaving the caller to re-raise, when every rank still
        beats: then the failure is not a lost rank's."""
        log.warning("tier: a collective failed (%s); looking for the rank that went", error)
        last = self._beat_counts()
        start = self.clock()
        moved = [start] * self.world
        while self.clock() - start < self.timeout + 3 * HEARTBEAT:
            time.sleep(HEARTBEAT / 2)
            self._heard_of_a_loss()
            now = self.clock()
            counts = self._beat_counts()
            for r, (old, new) in enumerate(zip(last, counts, strict=True)):
                if new > old:
                    moved[r] = now
                elif r != self.rank and now - moved[r] > self.timeout:
                    self._announce(r, f"no heartbeat for {self.timeout:g} s after a collective failed")
            last = [max(old, new) for old, new in zip(last, counts, strict=True)]

    def _announce(self, rank: int, why: str) -> None:
        """Rank ``rank`` is lost: tell the others through the store (so each names the same rank,
        whoever noticed first, even once rank 0 leaves and takes the store), then stop."""
        self._lost_announced, self._lost_rank = True, rank
        try:
            news = f"lost|{rank}|{why}".encode()[:MAX_NEWS]  # sealed: a stranger at the port cannot stop the tier so
            self.store.set(LOST, auth.tier_lost_mac(self.key, rank, news) + news)
            if self.rank != 0:  # it knows: rank 0 need not wait for it to read the news
                self._acknowledge()
        except Exception:  # the store is gone too: the others will say so
            pass
        raise RankLost(rank, why)

    def _acknowledge(self) -> None:
        name = LOST_ACK.format(rank=self.rank)
        self.store.set(name, self._sealed(name, b""))

    def _heard_of_a_loss(self) -> None:
        """Another rank announced a lost one: acknowledge, and stop naming the same rank."""
        try:
            data = self._read_now(self.store, self.reads or self.store, LOST)
            if data is None:
                return
        except Exception:  # the store went while we looked: the caller's next look says so
            return
        mac, news = data[:32], data[32:]
        _, rank, why = news.decode(errors="replace").split("|", 2) if news.count(b"|") >= 2 else ("", "", "")
        if len(news) > MAX_NEWS or not (
            rank.isdigit() and 0 <= int(rank) < self.world and auth.tier_lost_ok(self.key, int(rank), news, mac)
        ):
            self._doubts.note(LOST, "too big" if len(news) > MAX_NEWS else "it fails the tier's seal")
            return  # not a rank's word: not believed
        if not self._lost_announced:  # its own notice is no other rank's acknowledgement
            try:
                self._acknowledge()
            except Exception:
                pass
        raise RankLost(int(rank), why[:200] or "announced by another rank")

    # ------------------------------------------------------------------ the tier's view

    def publish(self, store: dist.Store, summary: RankSummary) -> None:
        """Seal and publish this rank's summary (the heartbeat thread's store client)."""
        payload = summary.to_json()
        store.set(f"status/{self.rank}", auth.tier_status_mac(self.key, self.rank, payload) + payload)

    def exchange(self, store: dist.Store) -> None:
        """Publish this rank's summary, read every rank's and their heartbeats: the view."""
        if self.summary is not None:
            mine = self.summary()
            if mine is not None:
                self.publish(store, mine)
        now = self.clock()
        rows = []
        for r, count in enumerate(self._counts(store)):
            last, since = self._moved.get(r, (count, now))
            if count > last:
                since = now
            self._moved[r] = (max(count, last), since)
            quiet = now - since
            health = (
                Health.SELF
                if r == self.rank
                else Health.LOST
                if quiet > self.timeout
                else Health.SILENT
                if quiet > 3 * HEARTBEAT
                else Health.ALIVE
            )
            row: dict[str, Any] = {"rank": r, "health": health.value, "silent_s": round(quiet, 1)}
            summary, note = self._read(store, r)
            if summary is not None:
                row.update(dataclasses.asdict(summary))
                del row["seq"]
            elif note:
                row["note"] = note
            rows.append(row)
        with self._lock:
            self._rows = rows

    def _read(self, store: dist.Store, r: int) -> tuple[RankSummary | None, str | None]:
        """Rank ``r``'s newest believable summary, or why none is."""
        key = f"status/{r}"
        if not store.check([key]):
            return self._seen.get(r), None
        data = store.get(key)
        mac, payload = data[:32], data[32:]
        if len(data) > 32 + MAX_STATUS_BYTES or not auth.tier_status_ok(self.key, r, payload, mac):
            self._doubts.note(key, "too big" if len(data) > 32 + MAX_STATUS_BYTES else "it fails the tier's seal")
            return None, "its published status failed the tier's seal: not believed"
        try:
            summary = RankSummary.from_json(payload)
        except ValueError as exc:
            self._doubts.note(key, f"malformed: {exc}")
            return None, f"its published status is malformed ({exc}): not believed"
        self._doubts.clear(key)
        seen = self._seen.get(r)
        if seen is not None and summary.seq < seen.seq:  # an old one again: a replay
            return seen, None
        with self._lock:
            self._seen[r] = summary
        return summary, None

    def summaries(self) -> dict[int, RankSummary]:
        """The newest believed summary of every other rank that is alive now (the balancer's)."""
        with self._lock:
            alive = {row["rank"] for row in self._rows if row["health"] == Health.ALIVE.value}
            return {r: s for r, s in self._seen.items() if r in alive}

    def view(self) -> dict[str, Any]:
        """The whole tier as this rank last saw it (no I/O: the heartbeat thread refreshes it)."""
        with self._lock:
            rows = [dict(row) for row in self._rows]
        return {"rank": self.rank, "world": self.world, "ranks": rows}

    def close(self) -> None:
        self._stop.set()
        if self._lost_announced and self.rank == 0:  # rank 0 holds the store: let the others read it
            deadline = time.monotonic() + ANNOUNCE_GRACE
            acks = [LOST_ACK.format(rank=r) for r in range(1, self.world) if r != self._lost_rank]
            try:
                while time.monotonic() < deadline:
                    if not acks or (
                        self.store.check(acks) and None not in self._believed(self.store, acks, 0, self.reads)
                    ):
                        break
                    time.sleep(POLL)
            except Exception:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


def _place(rendezvous: str, rank: int | None, world: int | None) -> tuple[str, int, int, int]:
    """``(host, port, rank, world)`` from the options, or from torchrun's environment."""
    url = urlparse(rendezvous)
    if url.scheme == "env":
        try:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            rank = int(os.environ["RANK"]) if rank is None else rank
            world = int(os.environ["WORLD_SIZE"]) if world is None else world
        except (KeyError, ValueError) as exc:
            need = "MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE"
            raise ConfigError(f"--rendezvous env:// needs {need} ({exc})") from None
    elif url.scheme == "tcp" and url.hostname and url.port:
        host, port = url.hostname, url.port
    else:
        raise ConfigError(f"--rendezvous must be tcp://HOST:PORT or env://, got {rendezvous!r}")
    if world is None or rank is None:
        raise ConfigError("a tier needs --world-size and --rank (or env:// under torchrun)")
    if not 1 <= world <= MAX_WORLD:
        raise ConfigError(f"--world-size must be between 1 and {MAX_WORLD}, got {world}")
    if not 0 <= rank < world:
        raise ConfigError(f"--rank must be between 0 and {world - 1}, got {rank}")
    return host, port, rank, world


def join_tier(
    rendezvous: str,
    rank: int | None,
    world: int | None,
    secret: str,
    job: bytes,
    *,
    timeout: float = TIER_TIMEOUT,
    random_bytes: Callable[[int], bytes] = os.urandom,
) -> Tier:
    """Meet the other ranks, form the gloo group and prove membership (see the module doc).
    ``job``: a digest of the training options every rank must share. Blocks until every rank
    came (at most ``timeout`` seconds)."""
    if not secret:
        raise ConfigError(
            "a tier needs its secret: CLEAVE_TIER_SECRET or --tier-secret-file (or --tier-secret), the same on every "
            "rank"
        )
    host, port, rank, world = _place(rendezvous, rank, world)
    wait = timedelta(seconds=timeout)
    # Under torchrun the agent already serves the store at MASTER_PORT (every interface, its
    # choice): rank 0 is then a client, and each restart of the ranks meets under a prefix of its own.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host_it = rank == 0 and not agent
    space = namespace(secret.encode(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agent else None)
    listening = listen(host, port, world) if host_it else None  # the named address only, not every one
    store: dist.Store | None = None
    try:
        store = dist.TCPStore(
            host, port, world, is_master=host_it, timeout=wait, wait_for_workers=False, master_listen_fd=listening
        )
        prefixed = dist.PrefixStore(space, store)
        gloo = _sealed_for_gloo(store, prefixed, space, secret.encode(), rank, world, wait, random_bytes)
        dist.init_process_group("gloo", store=dist.PrefixStore("pg/", gloo), rank=rank, world_size=world, timeout=wait)
    except (RuntimeError, TimeoutError) as exc:  # DistNetworkError and DistStoreError are RuntimeErrors
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if OTHER_SECRET in why:  # (raised by the lookout from inside gloo, which re-raises it so)
            raise TierRefused(OTHER_SECRET) from None
        raise JobAborted(f"could not form the tier at {rendezvous} as rank {rank} of {world}: {why}") from None
    tier = Tier(rank, world, prefixed, timeout, secret=secret.encode(), _gloo=gloo)
    try:
        _prove(tier, secret.encode(), job, random_bytes)
    except BaseException:
        tier.close()
        raise
    beats = dist.PrefixStore(space, dist.TCPStore(host, port, world, is_master=False, timeout=wait))
    quick = timedelta(seconds=HEARTBEAT)
    tier.reads = dist.PrefixStore(space, dist.TCPStore(host, port, world, is_master=False, timeout=quick))
    look = timedelta(seconds=VIEW_TIMEOUT)
    views = dist.PrefixStore(space, dist.TCPStore(host, port, world, is_master=False, timeout=look))
    tier.start_heartbeat(beats, views)
    return tier


def _sealed_for_gloo(
    store: dist.Store,
    space: dist.Store,
    prefix: str,
    secret: bytes,
    rank: int,
    world: int,
    wait: timedelta,
    random_bytes: Callable[[int], bytes],
) -> SealedStore:
    """What gloo meets through: rank 0 draws this run's nonce, and every rank seals its address
    under the secret and that nonce (an address sealed in an earlier run does not pass; a
    replayed nonce, sealed under the key without one, fails the meeting: see rendezvous.py). A rank
    given another secret waits in another namespace: any rank that sees its arrival there, at a
    place this tier's namespace lacks, refuses at once, rather than wait out the timeout. Other
    keys outside the namespace are a stranger's: logged once, and waited past."""
    said = [False]

    def lookout() -> None:
        arrivals, junk = foreign(store, secret, prefix, world)
        if arrivals:
            raise TierRefused(OTHER_SECRET)
        if junk and not said[0]:
            said[0] = True
            log.warning(
                "tier: %d keys in the rendezvous store are outside this tier's namespace and no rank's "
                "(e.g. %r): a stranger at the port? Ignored",
                len(junk),
                junk[0][:80],
            )

    every = LOOKOUT * max(1, world // 64)  # (a look lists every key in the store)
    door = SealedStore(auth.tier_store_key(secret), space, wait, lookout=lookout, every=every)
    if rank == 0:
        nonce = random_bytes(NONCE_BYTES)
        door.set(RUN, nonce)
    else:
        door.set(HERE.format(rank=rank), b"")  # (so rank 0, should this rank hold another secret, can say so)
        nonce = door.get(RUN)  # waits for rank 0's, past a stranger's
        if len(nonce) != NONCE_BYTES:
            raise dist.DistStoreError("rank 0's nonce for this run is malformed")
    return SealedStore(auth.tier_store_key(secret, nonce), space, wait, lookout=lookout, every=every)


def _gather(tensor: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype)
    all_gather(out, tensor)
    return out.view(world, tensor.numel())


def _prove(tier: Tier, secret: bytes, job: bytes, random_bytes: Callable[[int], bytes]) -> None:
    """Every rank proves the secret over every rank's fresh nonce; each checks all proofs."""
    world = tier.world
    nonce = torch.frombuffer(bytearray(random_bytes(NONCE_BYTES)), dtype=torch.uint8)
    nonces = _gather(nonce, world).numpy().tobytes()
    if len(job) != 32:
        raise ValueError("job must be a 32-byte digest of the training options")
    digest = job
    mine = auth.rank_proof(secret, tier.rank, world, digest, nonces)
    proofs = _gather(torch.frombuffer(bytearray(mine), dtype=torch.uint8), world).numpy()
    jobs = _gather(torch.frombuffer(bytearray(digest), dtype=torch.uint8), world).numpy()
    for r in range(world):
        if not auth.rank_proof_ok(secret, r, world, jobs[r].tobytes(), nonces, proofs[r].tobytes()):
            raise TierRefused(f"rank {r} did not prove it holds the tier's secret: the tier will not start")
        if jobs[r].tobytes() != digest:
            raise TierRefused(f"rank {r} was started with other training options than rank {tier.rank}")
    tier.key = auth.tier_session_key(secret, digest, nonces)


def job_digest(options: dict) -> bytes:
    """The digest every rank of one job shares: its training options (``TrainConfig.to_dict``)."""
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).digest()
