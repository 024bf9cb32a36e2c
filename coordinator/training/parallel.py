"""Data parallel across the ranks of a coordinator tier: the collectives the trainer calls.

The global batch is cut into fixed slices, one per rank in rank order; each rank computes its
slice's gradient (through its own volunteers), then:

- ``reduce_gradients``: every rank ends with the sum of all slices' gradients, in float32
  buckets (never half precision: a bf16 all-reduce sums in bf16). The sum's order is fixed: each
  bucket is all-gathered and added up in rank order, ``g_0 + g_1 + ... + g_{N-1}``, the order in
  which one process adds its micro-batches, so every rank holds the same bits, run after run,
  whatever order the network delivered them in (gloo's own all-reduce is not the rank-order sum
  at 3 ranks). Memory: the gather buffer is ``world`` buckets.
- ``ShardedAdamW`` (ZeRO-1): each rank keeps AdamW's state for a contiguous ``1/world`` of the
  flattened parameters only, steps that slice with torch's own AdamW (elementwise, so the
  slice's values are the bits an unsharded AdamW gives), and all-gathers the updated slices.
- ``all_sum``: float64 scalars (the loss, the token count) summed in rank order.

The group is torch.distributed's default (gloo on CPU tensors); who may be a rank is decided
before (``coordinator/tier/``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

BUCKET_BYTES = 16 << 20  # float32 bytes a gradient bucket holds; the gather buffer is world x this


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the tier: rank ``rank`` of ``world``, the default process group.
    ``before_sum(step)``: called before a step's sums (the tier's barrier, which notices a rank
    that is gone rather than hanging in a collective)."""

    rank: int
    world: int
    before_sum: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    def slice_of(self, batch: int) -> slice:
        """This rank's rows of a global batch of ``batch`` sequences (equal slices, rank order)."""
        if batch % self.world:
            raise ValueError(f"a batch of {batch} does not cut into {self.world} equal slices")
        size = batch // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def gather_sum(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``flat`` (1-D), added in rank order (see the module doc)."""
        if self.world == 1:
            return flat.clone()
        out = torch.empty(self.world * flat.numel(), dtype=flat.dtype)
        all_gather(out, flat.contiguous())
        parts = out.view(self.world, flat.numel())
        total = parts[0].clone()
        for r in range(1, self.world):
            total += parts[r]
        return total

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value`` (float64), in rank order."""
        mine = torch.tensor([float(value)], dtype=torch.float64)
        if self.world == 1:
            return [float(value)]
        out = torch.empty(self.world, dtype=torch.float64)
        all_gather(out, mine)
        return [float(v) for v in out]

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over ranks in float64, rank order: the same floats on every rank."""
        return [float(v) for v in self.gather_sum(torch.tensor(list(values), dtype=torch.float64))]

    def arrive(self, step: int) -> None:
        """Every rank is at ``step``'s sums (a no-op outside a tier's barrier)."""
        if self.before_sum is not None:
            self.before_sum(step)

    def reduce_gradients(self, params: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
        """Replace each parameter's ``.grad`` by the sum of every rank's, in float32 buckets. A
        parameter without a gradient here counts as zeros (another rank's slice may reach it)."""
        per_bucket = max(1, bucket_bytes // 4)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            if bucket and size + p.numel() > per_bucket:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel()
        if bucket:
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, params: list[torch.Tensor]) -> None:
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(torch.float32)
                for p in params
            ]
        )
        total = self.gather_sum(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).to(p.dtype)
            offset += n


def _flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


class ShardedAdamW:
    """ZeRO-1 AdamW: optimizer state for this rank's slice of the flattened parameters only.

    ``groups``: ``(params, weight_decay)`` as torch's AdamW takes them. Each group is flattened
    (in parameter order) and cut into ``world`` contiguous slices of ``ceil(numel / world)``
    elements; this rank holds its slice as a flat parameter of the group's dtype and steps it
    with ``torch.optim.AdamW`` (``foreach=False``, as the unsharded trainer). ``step`` reads the
    model's ``.grad`` (already summed over ranks), steps the slice and all-gathers every slice
    back into the model's parameters. Memory per rank: AdamW's two moments for ``1/world`` of
    the parameters, plus one flat copy of each group for the gather."""

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[torch.Tensor], float]],
        dp: DataParallel,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
    ) -> None:
        self.dp = dp
        self._groups: list[tuple[list[torch.Tensor], int, torch.nn.Parameter]] = []
        shards = []
        for params, weight_decay in groups:
            params = list(params)
            if len({p.dtype for p in params}) > 1:
                raise ValueError("a parameter group of mixed dtypes cannot be flattened")
            total = sum(p.numel() for p in params)
            per = math.ceil(total / dp.world) if total else 0
            lo, hi = min(total, dp.rank * per), min(total, (dp.rank + 1) * per)
            flat = _flat(params) if params else torch.empty(0)
            shard = torch.nn.Parameter(flat[lo:hi].clone())
            self._groups.append((params, per, shard))
            shards.append({"params": [shard], "weight_decay": weight_decay})
        self.inner = torch.optim.AdamW(shards, lr=lr, betas=betas, eps=eps, foreach=False)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups  # the trainer sets each step's learning rate here

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params, _, _ in self._groups:
            for p in params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for params, per, shard in self._groups:
            if not params:
                continue
            lo = self.dp.rank * per
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            shard.grad = _flat(grads)[lo : lo + shard.numel()].clone()
        self.inner.step()
        for params, per, shard in self._groups:
            if not params:
                continue
            # Every slice padded to ``per`` elements: all_gather needs equal parts.
            mine = torch.zeros(per, dtype=shard.dtype)
            mine[: shard.numel()] = shard.detach()
            whole = torch.empty(per * self.dp.world, dtype=shard.dtype)
            if self.dp.world == 1:
                whole.copy_(mine)
            else:
                all_gather(whole, mine)
            offset = 0
            for p in params:
                n = p.numel()
                p.copy_(whole[offset : offset + n].view_as(p))
                offset += n

    def state_dict(self) -> dict[str, Any]:
        """This rank's slice of the optimizer: its moments, and where the slice lies."""
        return {
            "inner": self.inner.state_dict(),
            "rank": self.dp.rank,
            "world": self.dp.world,
            "shards": [shard.detach().clone() for _, _, shard in self._groups],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("rank"), state.get("world")) != (self.dp.rank, self.dp.world):
            raise ValueError(
                f"the optimizer state is rank {state.get('rank')} of {state.get('world')}, "
                f"this is rank {self.dp.rank} of {self.dp.world}"
            )
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for (_, _, shard), saved in zip(self._groups, state["shards"], strict=True):
                shard.copy_(saved)
