"""Data parallel across the ranks of a coordinator tier: the collectives the trainer calls.

The global batch is cut into fixed slices, one per rank in rank order; each rank computes its
slice's gradient (through its own volunteers). The optimizer is sharded by whole parameters
(ZeRO-1, ``ShardedAdamW``): rank r owns a contiguous run of the parameters (in model order,
balanced by size), keeps AdamW's state for those only, and steps them. Each step then moves
each gradient element across the tier once and each updated weight once, as a ring all-reduce
would (``2 (N-1)/N`` of the parameters' float32 bytes in and out per rank), never gathering
every rank's whole gradient:

- ``ShardedAdamW.reduce_gradients`` (a reduce-scatter): every rank sends each owner its slice
  of the gradient (``all_to_all``, float32 buckets, never half precision), and each owner adds
  the slices up in rank order, ``g_0 + g_1 + ... + g_{N-1}``: the order in which one process adds
  its micro-batches, so the sum has the same bits run after run and as one coordinator running
  the slices as micro-batches in order (gloo's own all-reduce is not the rank-order sum at 3
  ranks). A rank keeps the summed gradients of its own parameters only.
- ``clip_grad_norm_``: each owner takes its parameters' norms, every rank gathers them all and
  makes the total as torch's ``clip_grad_norm_`` does from the same per-parameter norms (the
  same bits), and each scales its own gradients.
- ``step``: torch's AdamW (``foreach=False``, as the unsharded trainer) on the owned parameters,
  then every owner's updated weights are all-gathered (float32 buckets).
- ``DataParallel.all_sum``: float64 scalars (the loss, the token count) summed in rank order.

The group is torch.distributed's default, gloo, on CPU tensors; who may be a rank is decided
before (``coordinator/tier/``). A rank on a GPU (``--device cuda``) stages each bucket through
host memory: one copy of the bucket each way over PCIe (tens of GB/s), against a tier link of
1-100 Gbit/s that the bucket crosses anyway. So ranks may share a GPU, or have none, and the sums
stay the CPU's rank-order float32 adds. (NCCL would need a GPU of its own per rank.)
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cleave.coordinator.planning.tier import TIER_BUCKET_BYTES, partition
from cleave.wire.errors import ConfigError

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the tier: rank ``rank`` of ``world``, the default process group.
    ``before_sum(step)``: called before a step's sums (the tier's barrier, which notices a rank
    that is gone rather than hanging in a collective). ``on_failure(error)``: called when a
    step's collectives raised, to name a rank that went during them (it raises; if it returns,
    the error stands)."""

    rank: int
    world: int
    before_sum: Callable[[int], None] | None = None
    on_failure: Callable[[BaseException], None] | None = None

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

    def gather_rows(self, values: Sequence[float], width: int) -> list[list[float]]:
        """Every rank's ``values`` (at most ``width`` float64s, padded with NaN), in rank order."""
        if len(values) > width:
            raise ValueError(f"{len(values)} values do not fit a row of {width}")
        mine = torch.full((width,), float("nan"), dtype=torch.float64)
        mine[: len(values)] = torch.tensor(list(values), dtype=torch.float64)
        if self.world == 1:
            return [list(values)]
        out = torch.empty(self.world * width, dtype=torch.float64)
        all_gather(out, mine)
        return [[v for v in row.tolist() if v == v] for row in out.view(self.world, width)]

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over ranks in float64, rank order: the same floats on every rank."""
        return [float(v) for v in self.gather_sum(torch.tensor(list(values), dtype=torch.float64))]

    def arrive(self, step: int) -> None:
        """Every rank is at ``step``'s sums (a no-op outside a tier's barrier)."""
        if self.before_sum is not None:
            self.before_sum(step)


class ShardedAdamW:
    """ZeRO-1 AdamW, sharded by whole parameters: this rank's optimizer state, and the tier's
    gradient reduce-scatter, clip and weight all-gather (see the module doc).

    ``groups``: ``(params, weight_decay)`` as torch's AdamW takes them; ``order``: every
    parameter in the model's order (default: the groups' order), which sets who owns what and
    the order of the norms in the clip, as the unsharded trainer's ``clip_grad_norm_`` over
    ``model.parameters()``. Memory per rank: AdamW's two moments for its parameters (about
    ``1/world`` of them), and two bucket buffers of ``world`` x ``bucket_bytes / world`` for the
    collectives; after ``reduce_gradients`` it holds the gradients of its own parameters only."""

    def __init__(
        self,
        groups: Sequence[tuple[Sequence[torch.Tensor], float]],
        dp: DataParallel,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        order: Sequence[torch.Tensor] | None = None,
        bucket_bytes: int = TIER_BUCKET_BYTES,
    ) -> None:
        self.dp = dp
        decay = {id(p): wd for params, wd in groups for p in params}
        self.params = list(order) if order is not None else [p for params, _ in groups for p in params]
        if {id(p) for p in self.params} != set(decay) or len(self.params) != len(decay):
            raise ValueError("order must hold every parameter of the groups once")
        self.owners = partition([p.numel() for p in self.params], dp.world)
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        lo = [self.offsets[self.owners.index(r)] if r in self.owners else None for r in range(dp.world)]
        self.regions = []  # (flat start, elements) of each rank's parameters
        for r in range(dp.world):
            idx = [i for i, o in enumerate(self.owners) if o == r]
            self.regions.append((lo[r] or 0, self.offsets[idx[-1] + 1] - self.offsets[idx[0]]) if idx else (0, 0))
        self.mine = [p for p, o in zip(self.params, self.owners) if o == dp.rank]
        self.device = self.params[0].device if self.params else torch.device("cpu")  # buckets fill here
        self.chunk = max(1, bucket_bytes // 4 // dp.world)  # elements per rank per bucket
        self.gather_seconds = 0.0  # the last step's weight all-gather
        self._has = [True] * len(self.params)  # which parameters had a gradient on some rank (the last reduce)
        # torch's AdamW on this rank's parameters, in the groups' order with their weight decay.
        own = {id(p) for p in self.mine}
        self.inner = (
            torch.optim.AdamW(
                [{"params": [p for p in params if id(p) in own], "weight_decay": wd} for params, wd in groups],
                lr=lr,
                betas=betas,
                eps=eps,
                foreach=False,
            )
            if self.mine
            else None
        )
        self._groups = [{"lr": lr} for _ in groups] if self.inner is None else None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Where the trainer sets each step's learning rate."""
        return self.inner.param_groups if self.inner is not None else self._groups or []

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """AdamW's state of this rank's parameters (empty before its first step)."""
        return self.inner.state if self.inner is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    # ------------------------------------------------------------------ the collectives

    def _spans(self, lo: int, n: int) -> Iterable[tuple[int, int, int]]:
        """(parameter index, start within it, elements) covering flat elements [lo, lo + n)."""
        i = bisect.bisect_right(self.offsets, lo) - 1
        while n > 0:
            start = lo - self.offsets[i]
            take = min(n, self.params[i].numel() - start)
            yield i, start, take
            lo, n = lo + take, n - take
            i += 1

    def _read_grads(self, lo: int, n: int, out: torch.Tensor) -> None:
        at = 0
        for i, start, take in self._spans(lo, n):
            g = self.params[i].grad
            if g is None:  # no gradient here: zeros (another rank's slice may reach it)
                out[at : at + take].zero_()
            else:
                out[at : at + take].copy_(g.detach().reshape(-1)[start : start + take])
            at += take

    def _rounds(self) -> int:
        longest = max(n for _, n in self.regions)
        return -(-longest // self.chunk)

    def _sizes(self, k: int) -> list[int]:
        """Elements of each rank's region in bucket round ``k``."""
        return [max(0, min(self.chunk, n - k * self.chunk)) for _, n in self.regions]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Each rank's own parameters get the rank-order sum of every rank's gradient; the others'
        gradients are dropped. A parameter without a gradient on a rank counts as zeros there; one
        without a gradient on any rank (frozen, or unused by this batch) keeps none, so AdamW
        leaves it alone, as it would in one process."""
        world, me = self.dp.world, self.dp.rank
        start, mine = self.regions[me]
        has = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
        if world > 1:
            dist.all_reduce(has, op=dist.ReduceOp.MAX)
        self._has = [bool(h) for h in has.tolist()]
        total = torch.empty(mine, dtype=torch.float32)  # this rank's summed region
        for k in range(self._rounds()):
            sizes = self._sizes(k)
            send = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
            at = 0
            for r, n in enumerate(sizes):
                self._read_grads(self.regions[r][0] + k * self.chunk, n, send[at : at + n])
                at += n
            send = send.cpu()  # a GPU rank's bucket to host memory, once (gloo sends host tensors)
            m = sizes[me]
            got = torch.empty(world * m, dtype=torch.float32)
            if world == 1:
                got.copy_(send)
            else:
                dist.all_to_all_single(got, send, [m] * world, sizes)
            parts = got.view(world, m)
            acc = total[k * self.chunk : k * self.chunk + m]
            acc.copy_(parts[0])
            for r in range(1, world):  # rank order: the bits of one process's micro-batches
                acc += parts[r]
        for p, o in zip(self.params, self.owners):
            if o != me:
                p.grad = None
        for i, begin, take in self._spans(start, mine):
            p = self.params[i]
            at = self.offsets[i] + begin - start
            p.grad = total[at : at + take].view_as(p).to(p.device, p.dtype) if self._has[i] else None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over every parameter of the tier (2-norm, ``foreach=False``):
        the total from each parameter's norm, taken where the parameter is owned; this rank's
        gradients scaled. Returns the total norm (the same on every rank)."""
        world = self.dp.world
        counts = [self.owners.count(r) for r in range(world)]
        width = max(counts)
        own = torch.zeros(width, dtype=torch.float32)
        for j, p in enumerate(self.mine):
            if p.grad is not None:
                own[j] = torch.linalg.vector_norm(p.grad, 2.0).to("cpu", torch.float32)
        if world == 1:
            every = own.view(1, width)
        else:
            every = torch.empty(world * width, dtype=torch.float32)
            all_gather(every, own)
            every = every.view(world, width)
        norms, seen = [], [0] * world
        for i, (p, o) in enumerate(zip(self.params, self.owners)):  # the model's order, each in its dtype
            if self._has[i]:  # as clip_grad_norm_ skips a parameter without a gradient
                norms.append(every[o, seen[o]].to(p.device, p.dtype))  # the total where the weights are
            seen[o] += 1
        total = torch.nn.utils.get_total_norm(norms, 2.0, foreach=False)
        torch.nn.utils.clip_grads_with_norm_(self.mine, max_norm, total, foreach=False)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's parameters, then every rank's updated weights to every rank."""
        if self.inner is not None:
            self.inner.step()
        self.gather_seconds = 0.0
        if self.dp.world == 1:
            return
        started = time.perf_counter()
        world = self.dp.world
        for k in range(self._rounds()):
            sizes = self._sizes(k)
            width = max(sizes)
            if not width:
                continue
            mine = torch.zeros(width, dtype=torch.float32, device=self.device)  # padded: all_gather needs equal parts
            lo, n = self.regions[self.dp.rank][0] + k * self.chunk, sizes[self.dp.rank]
            at = 0
            for i, begin, take in self._spans(lo, n):
                mine[at : at + take].copy_(self.params[i].detach().reshape(-1)[begin : begin + take])
                at += take
            whole = torch.empty(world * width, dtype=torch.float32)
            all_gather(whole, mine.cpu())
            whole = whole.to(self.device)  # back to a GPU rank's memory, once
            for r, n in enumerate(sizes):
                if r == self.dp.rank or not n:
                    continue
                at = r * width
                for i, begin, take in self._spans(self.regions[r][0] + k * self.chunk, n):
                    p = self.params[i]
                    if p.is_contiguous():  # float32 holds bf16/fp16 exactly
                        p.view(-1)[begin : begin + take].copy_(whole[at : at + take])
                    else:
                        flat = p.detach().reshape(-1).clone()
                        flat[begin : begin + take] = whole[at : at + take]
                        p.copy_(flat.view_as(p))
                    at += take
        self.gather_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's share of the optimizer: its parameters' moments, and which they are."""
        return {
            "inner": self.inner.state_dict() if self.inner is not None else None,
            "rank": self.dp.rank,
            "world": self.dp.world,
            "owners": list(self.owners),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("rank"), state.get("world")) != (self.dp.rank, self.dp.world):
            raise ValueError(
                f"the optimizer state is rank {state.get('rank')} of {state.get('world')}, "
                f"this is rank {self.dp.rank} of {self.dp.world}"
            )
        if state.get("owners") != self.owners:
            raise ConfigError(
                "this rank's checkpoint shards the optimizer otherwise (another model, or a checkpoint from "
                "before the tier sharded AdamW by whole parameters): start the tier anew with --new-job"
            )
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])
