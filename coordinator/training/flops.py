"""How much of a model's GEMM work goes to the devices: counted, not assumed.

``gemm_share(model, seq_len)`` runs one forward and backward pass of a single sequence through
the job's own (offloaded) model under ``torch.utils.flop_counter``, with every linear-like
module's engine swapped for one that only counts: their products are tallied and answered with
zeros, so nothing is multiplied and no device is asked. Every other matrix product torch runs
(``mm``, ``bmm``, attention kernels) stays on the parameter server and is counted there, by the
module that ran it. Both parts grow linearly with the batch, so one sequence gives the share of
a whole step. The model's gradients and torch's random state are left as they were (dropout
draws are not consumed), so the training that follows is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from cleave.coordinator.training.linear import GemmRequest, TiledLinear

aten = torch.ops.aten


@dataclass(frozen=True)
class GemmShare:
    total: float  # FLOPs of every matrix product of one sequence's forward and backward pass
    offloaded: float  # of which through the engine: tiles on devices (or kept by the cost planner)
    left: dict[str, float] = field(default_factory=dict)  # module -> FLOPs multiplied on the PS

    @property
    def share(self) -> float:
        return self.offloaded / self.total if self.total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "share": round(self.share, 4),
            "gemm_flops_per_sequence": self.total,
            "offloaded_flops_per_sequence": self.offloaded,
            "left_on_ps": dict(sorted(self.left.items(), key=lambda kv: -kv[1])),
        }

    def summary(self) -> str:
        named = (
            ", ".join(
                f"{name} {flops / self.total:.1%}"
                for name, flops in sorted(self.left.items(), key=lambda kv: -kv[1])[:4]
            )
            if self.total
            else ""
        )
        # Offloadable, not offloaded: the planner decides each GEMM as it comes (one that is
        # cheaper on the coordinator stays there), and `cleave status` shows what was shipped.
        return (
            f"{self.share:.1%} of the model's GEMM FLOPs can go to devices (the planner decides, GEMM by GEMM, "
            "whether shipping one pays: cleave status shows what was shipped)"
            + (f"; always on the coordinator: {named}" if named else "")
        )


class _Counting:
    """An engine that multiplies nothing: it counts each product and answers zeros."""

    def __init__(self) -> None:
        self.flops = 0.0

    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        out = []
        for r in requests:
            self.flops += 2.0 * r.a.shape[0] * r.a.shape[1] * r.b.shape[1]
            out.append(torch.zeros(r.a.shape[0], r.b.shape[1], dtype=r.a.dtype))
        return out


def _sdpa_cpu(query: Sequence[int], key: Sequence[int], value: Sequence[int], *args: Any, **kwargs: Any) -> int:
    """CPU flash attention, which torch's counter does not know: softmax(QK^T)V, two products."""
    *lead, tq, d = query
    tk, dv = key[-2], value[-1]
    return 2 * math.prod(lead) * tq * tk * (d + dv)


def _sdpa_cpu_backward(
    grad: Sequence[int], query: Sequence[int], key: Sequence[int], value: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    return 2 * _sdpa_cpu(query, key, value)  # dQ, dK, dV and dP: four products


_CUSTOM: dict[Any, Any] = {}
for _name, _formula in (
    ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward),
):
    if hasattr(aten, _name):
        _CUSTOM[getattr(aten, _name)] = _formula


def gemm_share(model: nn.Module, seq_len: int) -> GemmShare:
    """The devices' share of ``model``'s GEMM FLOPs (its linear-like modules offloaded)."""
    tiled = [m for m in model.modules() if isinstance(m, TiledLinear)]
    engines = [m.engine for m in tiled]
    counting = _Counting()
    rng = torch.get_rng_state()
    forward = FlopCounterMode(display=False, custom_mapping=_CUSTOM)
    backward = FlopCounterMode(display=False, custom_mapping=_CUSTOM)
    try:
        for m in tiled:
            m.engine = counting
        ids = torch.zeros((1, seq_len), dtype=torch.long)
        with forward:
            _, loss = model(ids, ids)
        assert loss is not None
        with backward:
            loss.backward()
    finally:
        for m, engine in zip(tiled, engines):
            m.engine = engine
        torch.set_rng_state(rng)
        model.zero_grad(set_to_none=True)
    on_ps = float(forward.get_total_flops() + backward.get_total_flops())
    # Names come from the forward pass, where each product is counted at every module around
    # it: a module's own FLOPs are its count less that of the nearest counted modules inside it.
    # (The backward's products are those of the forward again, attributed less reliably.)
    counts = {name: float(sum(ops.values())) for name, ops in forward.get_flop_counts().items() if name != "Global"}
    own: dict[str, float] = {}
    for name, flops in counts.items():
        inner = [o for o in counts if o.startswith(name + ".")]
        nearest = [o for o in inner if not any(o.startswith(p + ".") for p in inner if p != o)]
        rest = flops - sum(counts[o] for o in nearest)
        if rest > 0:
            label = name.split(".", 1)[1] if "." in name else "(top level)"
            label = label.removeprefix("inner.")  # hf.HFCausalLM's wrapper: name modules as transformers does
            own[label] = own.get(label, 0.0) + rest
    spread = sum(own.values())
    left = {name: on_ps * f / spread for name, f in own.items()} if spread else {}
    return GemmShare(on_ps + counting.flops, counting.flops, left)
