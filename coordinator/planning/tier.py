"""What a tier of coordinators adds to each step, priced from what the tier does.

A job on ``ranks`` coordinators (``coordinator/training/parallel.py``) cuts every global batch
into equal slices, one per rank, and each rank trains its slice through its own share of the
fleet. After backward the ranks reduce-scatter their float32 gradients (each sends every owner
its slice, and the owner adds the slices in rank order), each steps AdamW on its own
``1/ranks`` of the parameters (ZeRO-1), and the updated weights are all-gathered. Per rank and
step that is ``(ranks - 1) / ranks`` of the parameters' float32 bytes each way for each of the
two collectives while the shares are even (parameters are sharded whole: past about ``params /
largest parameter`` ranks the largest one's owner takes in more, and every round waits for it),
one round trip per bucket of ``TIER_BUCKET_BYTES``, and the owner's sum of ``ranks`` slices.
The ranks meet at every step's barrier, so the tier goes at the pace of its slowest rank: the
one with the fewest devices when each class is dealt out round-robin (``Tier.share``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cleave.coordinator.planning.costmodel import CostModelError

TIER_BUCKET_BYTES = 16 << 20  # float32 bytes a bucket of the tier's collectives holds, over every rank
TIER_GRAD_BYTES = 4  # gradients and weights cross the tier in float32, whatever the job's dtype
# One round trip between two ranks on one LAN (seconds): each bucket of a collective waits for
# one, every rank sending to the others at once. A datacenter fabric is below it, a WAN far above.
TIER_RTT = 2e-4
DEFAULT_TIER_GBPS = 100.0  # a rank's link to the others, each way (--tier-link-gbps)
MAX_RANKS = 1024


def partition(sizes: Sequence[int], world: int) -> list[int]:
    """The owner of each of ``sizes`` (parameters in order): contiguous runs, rank 0 first, each
    parameter going to the rank whose equal share of the total holds its middle element (so a
    rank's load is within one parameter of ``total / world``; a rank may own none). Parameters
    are never split: past ``total / largest`` ranks the largest parameter's owner carries more
    than its share (``Tier`` prices that)."""
    total = sum(sizes)
    owners, start = [], 0
    for n in sizes:
        middle = start + n / 2
        owners.append(min(world - 1, int(middle * world / total)) if total else 0)
        start += n
    return owners


def largest_share(sizes: Sequence[int], world: int) -> int:
    """Elements of the largest run ``partition`` gives one rank."""
    loads = [0] * world
    for n, owner in zip(sizes, partition(sizes, world)):
        loads[owner] += n
    return max(loads)


@dataclass(frozen=True)
class Tier:
    """``ranks`` coordinators, each with a ``link`` of bytes/s each way to the others."""

    ranks: int = 1
    link: float = DEFAULT_TIER_GBPS * 1e9 / 8
    rtt: float = TIER_RTT

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or not 1 <= self.ranks <= MAX_RANKS:
            raise CostModelError(f"a tier has 1 to {MAX_RANKS} coordinators, got {self.ranks!r}")
        if not (math.isfinite(self.link) and self.link > 0):
            raise CostModelError(f"the tier's link must be a positive rate, got {self.link!r}")
        if not (math.isfinite(self.rtt) and self.rtt >= 0):
            raise CostModelError(f"the tier's round trip must be a non-negative time, got {self.rtt!r}")

    @classmethod
    def from_gbps(cls, ranks: int, gbps: float) -> Tier:
        """A tier whose ranks' links run at ``gbps`` Gbit/s each way."""
        return cls(ranks, gbps * 1e9 / 8)

    def slice(self, batch: int) -> int:
        """Sequences of a global batch of ``batch`` each rank trains."""
        if batch % self.ranks:
            raise CostModelError(f"a batch of {batch} does not cut into {self.ranks} equal slices, one per rank")
        return batch // self.ranks

    def share(self, count: int) -> int:
        """Devices of a class of ``count`` that the tier's slowest rank serves (dealt round-robin:
        the last rank gets the fewest)."""
        return count // self.ranks

    def buckets(self, sizes: Sequence[int]) -> int:
        """Bucket rounds each collective takes (one round trip each): the largest share over the
        elements a rank moves a round."""
        per_round = max(1, TIER_BUCKET_BYTES // TIER_GRAD_BYTES // self.ranks)
        return math.ceil(self.optimizer_share(sizes) / per_round)

    def _wire(self, sizes: Sequence[int]) -> float:
        """Seconds one collective takes: every round waits for the rank with the most to take in,
        the owner of the largest share, which takes it from each of the others: ``(ranks - 1)`` x
        its float32 bytes (``(ranks - 1) / ranks`` of the model's when the shares are even)."""
        if self.ranks == 1:
            return 0.0
        moved = (self.ranks - 1) * TIER_GRAD_BYTES * self.optimizer_share(sizes)
        return moved / self.link + self.buckets(sizes) * self.rtt

    def reduce_seconds(self, sizes: Sequence[int], memory_bw: float) -> float:
        """The gradients' reduce-scatter: its collective, and the owner's rank-order sum (reading
        ``ranks`` slices of its share in float32). ``sizes``: the parameters, in order."""
        if self.ranks == 1:
            return 0.0
        return self._wire(sizes) + self.ranks * TIER_GRAD_BYTES * self.optimizer_share(sizes) / memory_bw

    def gather_seconds(self, sizes: Sequence[int]) -> float:
        """The updated weights' all-gather."""
        return self._wire(sizes)

    def optimizer_share(self, sizes: Sequence[int]) -> int:
        """Parameters the busiest rank holds AdamW's state for and steps (ZeRO-1 by whole
        parameters: its share of the partition)."""
        return largest_share(sizes, self.ranks) if self.ranks > 1 else sum(sizes)


SOLO = Tier()  # one coordinator: no tier
