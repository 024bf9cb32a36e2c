"""What a tier of coordinators adds to each step, priced from what the tier does.

A job on ``ranks`` coordinators (``coordinator/training/parallel.py``) cuts every global batch
into equal slices, one per rank, and each rank trains its slice through its own share of the
fleet. After backward the ranks reduce-scatter their float32 gradients (each sends every owner
its slice, and the owner adds the slices in rank order), each steps AdamW on its own
``1/ranks`` of the parameters (ZeRO-1), and the updated weights are all-gathered. Per rank and
step that is ``(ranks - 1) / ranks`` of the parameters' float32 bytes each way for each of the
two collectives, one round trip per bucket of ``TIER_BUCKET_BYTES``, and the owner's sum of
``ranks`` slices. The ranks meet at every step's barrier, so the tier goes at the pace of its
slowest rank: the one with the fewest devices when each class is dealt out round-robin
(``Tier.share``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coordinator.planning.costmodel import CostModelError

TIER_BUCKET_BYTES = 16 << 20  # float32 bytes a bucket of the tier's collectives holds, over every rank
TIER_GRAD_BYTES = 4  # gradients and weights cross the tier in float32, whatever the job's dtype
# One round trip between two ranks on one LAN (seconds): each bucket of a collective waits for
# one, every rank sending to the others at once. A datacenter fabric is below it, a WAN far above.
TIER_RTT = 2e-4
DEFAULT_TIER_GBPS = 100.0  # a rank's link to the others, each way (--tier-link-gbps)
MAX_RANKS = 1024


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

    def buckets(self, params: int) -> int:
        """Buckets each collective moves the parameters in (one round trip each)."""
        return math.ceil(TIER_GRAD_BYTES * params / TIER_BUCKET_BYTES)

    def _wire(self, params: int) -> float:
        if self.ranks == 1:
            return 0.0
        moved = (self.ranks - 1) / self.ranks * TIER_GRAD_BYTES * params
        return moved / self.link + self.buckets(params) * self.rtt

    def reduce_seconds(self, params: int, memory_bw: float) -> float:
        """The gradients' reduce-scatter on one rank: its bytes each way on the link, and the
        owner's rank-order sum (reading ``ranks`` slices of ``params / ranks`` float32)."""
        if self.ranks == 1:
            return 0.0
        return self._wire(params) + TIER_GRAD_BYTES * params / memory_bw

    def gather_seconds(self, params: int) -> float:
        """The updated weights' all-gather on one rank."""
        return self._wire(params)

    def optimizer_share(self, params: int) -> int:
        """Parameters whose AdamW state and update one rank holds (ZeRO-1; the largest share)."""
        return math.ceil(params / self.ranks)


SOLO = Tier()  # one coordinator: no tier
