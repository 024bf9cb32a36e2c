"""Who may be a rank of a tier, and how the ranks notice one is gone.

``join_tier`` meets the other ranks at the rendezvous (``tcp://HOST:PORT``, rank 0 hosting
torch's TCPStore there, or ``env://`` under torchrun), forms the gloo process group, and then
makes every rank prove it holds the tier's secret before any of them trains: each draws a
fresh nonce, the nonces are gathered, and each rank sends ``HMAC(secret, rank | world | job |
nonces)`` (``wire/auth.py``). A rank whose proof fails, or that was started for another job (the
digest of its training options differs), stops every rank with ``TierRefused``.

torch's store has no authentication of its own: anyone who reaches the rendezvous port can
read and write its keys and could take a rank's place in the group. The proof keeps such a
stranger from ever counting as a rank (the tier refuses to start); it cannot keep it from
disturbing the rendezvous, which is why the port belongs on a private network
(docs/security.md).

Liveness: every rank bumps a counter in the store every ``HEARTBEAT`` seconds from a thread of
its own. Before each step's collectives a rank waits at the step's barrier until every rank has
arrived; while it waits it watches the counters, and a rank whose counter has not moved for
``timeout`` seconds is lost: ``RankLost`` names it and the job stops (exit 1). A rank that is
merely slow (its volunteers are) keeps beating and is waited for. A lost rank 0 takes the store
with it: the others then name rank 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from coordinator.training.parallel import DataParallel, all_gather
from coordinator.wire import auth
from coordinator.wire.errors import ConfigError, JobAborted

TIER_TIMEOUT = 60.0  # seconds without a heartbeat before a rank counts as lost (--tier-timeout)
HEARTBEAT = 1.0  # seconds between a rank's heartbeats
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


@dataclass
class Tier:
    """This process's membership of a tier, once proven."""

    rank: int
    world: int
    store: dist.Store
    timeout: float = TIER_TIMEOUT
    clock: Callable[[], float] = time.monotonic
    _beats: dist.Store | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def parallel(self) -> DataParallel:
        """What the trainer needs: its place, and this tier's barrier before each step's sums."""
        return DataParallel(self.rank, self.world, before_sum=self.arrive)

    def start_heartbeat(self, beats: dist.Store) -> None:
        self._beats = beats

        def beat() -> None:
            while not self._stop.wait(HEARTBEAT):
                try:
                    beats.add(f"alive/{self.rank}", 1)
                except Exception:  # the store (rank 0) is gone: the barrier will say so
                    return

        beats.add(f"alive/{self.rank}", 1)
        self._thread = threading.Thread(target=beat, name=f"cleave-tier-beat-{self.rank}", daemon=True)
        self._thread.start()

    def _beat_counts(self) -> list[int]:
        try:
            return [int(self.store.add(f"alive/{r}", 0)) for r in range(self.world)]
        except Exception as exc:  # rank 0 hosts the store
            raise RankLost(0, f"the rendezvous store on rank 0 stopped answering: {exc}") from None

    def arrive(self, step: int) -> None:
        """Wait until every rank reached ``step``'s sums; raise ``RankLost`` for one that stopped
        beating for ``timeout`` seconds meanwhile."""
        key = f"step/{step}"
        try:
            arrived = int(self.store.add(key, 1))
        except Exception as exc:
            raise RankLost(0, f"the rendezvous store on rank 0 stopped answering: {exc}") from None
        last = self._beat_counts()
        moved = [self.clock()] * self.world
        while arrived < self.world:
            time.sleep(POLL)
            now = self.clock()
            counts = self._beat_counts()
            for r, (old, new) in enumerate(zip(last, counts, strict=True)):
                if new != old:
                    moved[r] = now
                elif r != self.rank and now - moved[r] > self.timeout:
                    raise RankLost(r, f"no heartbeat for {self.timeout:g} s")
            last = counts
            try:
                arrived = int(self.store.add(key, 0))
            except Exception as exc:
                raise RankLost(0, f"the rendezvous store on rank 0 stopped answering: {exc}") from None

    def close(self) -> None:
        self._stop.set()
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
        raise ConfigError("a tier needs its secret: --tier-secret or CLEAVE_TIER_SECRET, the same on every rank")
    host, port, rank, world = _place(rendezvous, rank, world)
    wait = timedelta(seconds=timeout)
    try:
        # Under torchrun the agent already serves the store at MASTER_PORT: rank 0 is then a client.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        host_it = rank == 0 and not agent
        store = dist.TCPStore(host, port, world, is_master=host_it, timeout=wait, wait_for_workers=False)
        prefixed = dist.PrefixStore("cleave-tier/", store)
        group = dist.PrefixStore("pg/", prefixed)
        dist.init_process_group("gloo", store=group, rank=rank, world_size=world, timeout=wait)
    except (RuntimeError, TimeoutError) as exc:  # DistNetworkError and DistStoreError are RuntimeErrors
        raise JobAborted(f"could not form the tier at {rendezvous} as rank {rank} of {world}: {exc}") from None
    tier = Tier(rank, world, prefixed, timeout)
    try:
        _prove(tier, secret.encode(), job, random_bytes)
    except BaseException:
        tier.close()
        raise
    beats = dist.PrefixStore("cleave-tier/", dist.TCPStore(host, port, world, is_master=False, timeout=wait))
    tier.start_heartbeat(beats)
    return tier


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


def job_digest(options: dict) -> bytes:
    """The digest every rank of one job shares: its training options (``TrainConfig.to_dict``)."""
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).digest()
