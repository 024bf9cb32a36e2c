"""The one seam between a model and the network: Linear layers that call an injected matmul.

``offload_linears(model, engine)`` swaps every linear-like module of *any* torch model
(``nn.Linear``, ``transformers``' ``Conv1D``, and their subclasses that keep the base
``forward``) for a ``TiledLinear`` that shares its parameters. Forward and backward then run their three GEMMs

    forward   Y  = X  @ W^T      (tokens x out)      output tiles
    backward  dX = dY @ W        (tokens x in)       output tiles
              dW = dY^T @ X      (out x in)          split along tokens, partial sums at the PS

through ``engine.run``, which may compute them locally or as tiles on volunteers. Bias, reshapes
and everything else stay here, on the parameter server. The model never knows about the network.

An engine may also take weight gradients in the background (``DeferringEngine``): nothing below
a layer needs its dW, so backward goes on down while the devices compute it, and the trainer
collects every dW into ``.grad`` with ``engine.finish_backward()`` before the optimizer reads it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from cleave.coordinator.planning.tiles import GemmKind


@dataclass(frozen=True)
class GemmRequest:
    a: torch.Tensor
    b: torch.Tensor
    kind: GemmKind = GemmKind.PLAIN
    # A forward whose X a backward will read again (its dW): devices keep X's blocks till then.
    # False for a forward without autograd (an evaluation): they go when the GEMM is done.
    retain: bool = True


class MatmulEngine(Protocol):
    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        """Return ``[r.a @ r.b for r in requests]``; independent GEMMs may run concurrently."""
        ...


class DeferringEngine(MatmulEngine, Protocol):
    def defer(self, request: GemmRequest, param: torch.Tensor) -> None:
        """Start ``request``; its product is added to ``param.grad`` by ``finish_backward``.
        (An engine with ``part()`` gets the forward's part as ``part=`` here and in ``run``.)"""
        ...

    def finish_backward(self) -> None:
        """Wait for every deferred product and add it to its parameter's ``.grad``."""
        ...


class LocalEngine:
    """Plain torch matmul: the reference every other engine must agree with."""

    def run(self, requests: Sequence[GemmRequest]) -> list[torch.Tensor]:
        return [r.a @ r.b for r in requests]


class _TiledLinearFn(torch.autograd.Function):
    """``y = x2d @ W^T`` (``nn.Linear``: W is out x in) or ``y = x2d @ W`` (``in_out``: a
    ``transformers`` ``Conv1D``, W is in x out), with its three GEMMs through the engine."""

    @staticmethod
    def forward(
        ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, engine: MatmulEngine, in_out: bool, retain: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(x2d, weight)
        ctx.engine = engine
        ctx.in_out = in_out
        ctx.param = weight  # the parameter itself, whose .grad a deferred dW goes into
        # The micro-batch this forward belongs to, for an engine that keeps one's state (its
        # deferred dWs): backward may run on another thread (autograd's own, on a GPU).
        part = getattr(engine, "part", None)
        ctx.part = {} if part is None else {"part": part()}
        (y,) = engine.run([GemmRequest(x2d, weight if in_out else weight.t(), GemmKind.FORWARD, retain)])
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x2d, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # dW has W's layout: dY^T X (out x in) for a Linear, X^T dY (in x out) for a Conv1D.
        dw = (
            GemmRequest(x2d.t(), grad_y, GemmKind.GRAD_WEIGHT)
            if ctx.in_out
            else GemmRequest(grad_y.t(), x2d, GemmKind.GRAD_WEIGHT)
        )
        requests = []
        defer = getattr(ctx.engine, "defer", None)
        if want_w and defer is not None and ctx.param.is_leaf:
            defer(dw, ctx.param, **ctx.part)
            want_w = False  # autograd leaves .grad alone; finish_backward adds it
        if want_x:
            requests.append(GemmRequest(grad_y, weight.t() if ctx.in_out else weight, GemmKind.GRAD_INPUT))
        if want_w:
            requests.append(dw)
        # dX and dW are independent: submitted together, they are tiled and computed together.
        results = iter(ctx.engine.run(requests, **ctx.part) if requests else ())
        grad_x = next(results) if want_x else None
        grad_w = next(results) if want_w else None
        return grad_x, grad_w, None, None, None


class TiledLinear(nn.Module):
    """Drop-in ``nn.Linear`` (or ``transformers`` ``Conv1D``) whose GEMMs go through ``engine``;
    it shares the original's parameters (tied weights stay tied)."""

    def __init__(self, linear: nn.Module, engine: MatmulEngine) -> None:
        super().__init__()
        self.in_out = not isinstance(linear, nn.Linear)  # a Conv1D keeps W as (in, out)
        if self.in_out:
            self.in_features, self.out_features = linear.weight.shape
        else:
            self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.engine = engine
        self.replaced = type(linear).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).contiguous()  # (tokens, in)
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):
            # As F.linear under autocast: both operands (and the bias) in the autocast dtype. The
            # cast weight is no leaf, so its gradient flows back through the cast to the float32
            # parameter (autograd's, not deferred).
            dtype = torch.get_autocast_dtype(x.device.type)
            x2d, weight = x2d.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        elif x2d.dtype != weight.dtype:
            raise TypeError(
                f"{self.replaced} input is {x2d.dtype} but its weight is {weight.dtype} (as nn.Linear, "
                "outside autocast both must match)"
            )
        # (Inside the Function grad mode is off: whether a backward will follow is known here.)
        backward = torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad)
        y = _TiledLinearFn.apply(x2d, weight, self.engine, self.in_out, backward)  # (tokens, out)
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"replaces={self.replaced}"
        )


def _conv1d_type() -> type | None:
    """``transformers``' Conv1D (GPT-2's projections), if transformers is loaded: a model
    built from it means it is, and a preset never needs it imported."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _is_plain_linear(module: nn.Module, conv1d: type | None) -> bool:
    """An ``nn.Linear`` (or ``Conv1D``), or a subclass that computes exactly what it does: its
    ``forward`` is the base class's. A subclass with its own ``forward`` (a MoE router that
    returns top-k indices, a block-diagonal layer) is left alone, on the PS."""
    for base in (nn.Linear,) if conv1d is None else (nn.Linear, conv1d):
        if isinstance(module, base):
            return type(module).forward is base.forward and module.weight.dim() == 2
    return False


def offload_linears(model: nn.Module, engine: MatmulEngine) -> int:
    """Replace every linear-like module of ``model`` (in place, parameters shared): ``nn.Linear``
    and ``transformers``' ``Conv1D``, and their subclasses that keep the base ``forward``.
    Returns how many. What stays on the PS (attention's products, a subclass with a ``forward``
    of its own, a module that reads a child's weight directly, as ``nn.MultiheadAttention``
    does its ``out_proj``'s) is what ``flops.gemm_share`` counts and names."""
    conv1d = _conv1d_type()
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_plain_linear(child, conv1d):
                setattr(parent, name, TiledLinear(child, engine))
                count += 1
    return count
