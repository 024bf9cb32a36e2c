"""The trainer's side of the coordinator: ``RemoteEngine``, the ``MatmulEngine`` whose GEMMs
become tiles on volunteers. It runs on the trainer thread and reaches the server (and through it
the engine) only by hopping onto the event loop; it checks inputs for NaN, casts for the wire
and assembles products there, so the loop does not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cleave.coordinator.engine.blocks import row_norms
from cleave.coordinator.engine.gemms import Product, check_finite
from cleave.coordinator.net.server import Server
from cleave.coordinator.planning.tiles import GemmKind
from cleave.coordinator.training.hardware import to_host
from cleave.coordinator.training.linear import GemmRequest
from cleave.wire.messages import WireDtype


def _fits_fp16(r: GemmRequest) -> bool:
    """Whether every product of ``r`` stays within fp16's range (|C_ij| <= ||A_i|| ||B_j||),
    with a factor 2 to spare; the norms are taken in float32."""
    if not (r.a.numel() and r.b.numel()):
        return True
    bound = float(_row_norms(r.a.float()).max()) * float(_row_norms(r.b.t().float()).max())
    return bound <= torch.finfo(torch.float16).max / 2


def _row_norms(t: torch.Tensor) -> torch.Tensor:
    """``||t_i||`` per row, read along memory whether ``t`` lies as it is or transposed."""
    return row_norms(t.t(), True) if t.t().is_contiguous() else row_norms(t.contiguous(), False)


@dataclass
class Part:
    """One micro-batch's own state (one trainer thread's; several run at once with parts at
    once). Its layers' backward hands it back explicitly: on a GPU, autograd runs backward on
    its own device thread, not the thread that ran the forward and will collect the dWs."""

    deferred: list[tuple[torch.Tensor, concurrent.futures.Future[Product]]] = field(default_factory=list)
    # Casts of deferred dWs' operands, dropped at this part's next GEMM waited on.
    evict: list[tuple] = field(default_factory=list)


class _Mine(threading.local):
    def __init__(self) -> None:
        self.part = Part()


class RemoteEngine:
    """The MatmulEngine the trainer sees: GEMMs become tiles on volunteers.

    With a half-precision ``wire``, float32 operands are cast here, on the trainer thread, and
    the products come back in float32. Each operand's whole tensor is cast once per step and
    the GEMM reads a view of the copy, laid out as the original: the forward's X and the dW
    that reads it again then share blocks, as in float32.

    A trainer on a GPU (``Trainer(device=cuda)``) hands CUDA operands: they are staged to the
    host the same way (one pinned copy per tensor and step, in the wire's dtype), a GEMM the
    planner keeps home is multiplied on the GPU from the originals, and each product comes back
    to the GPU in one copy."""

    # The trainer may run micro-batches on several threads at once (Trainer.parts_at_once).
    takes_parts_at_once = True

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop, wire: WireDtype = WireDtype.FP32) -> None:
        self.server = server
        self.loop = loop
        self.wire = wire
        # base's identity -> (base, its copy); read and filled by every part's thread (dict
        # operations are atomic: setdefault keeps one copy of a weight however many cast it)
        self._casts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mine = _Mine()
        # Set by a Trainer with a loss scaler: a GEMM with Inf or NaN inputs is an fp16 overflow
        # the scaler will skip, not divergence. It is multiplied here instead of stopping the job.
        self.overflow_here = False

    def begin_step(self, step: int) -> None:
        self._casts.clear()  # the step's activations and the weights before their update
        self._mine.part.deferred.clear()  # left over only by a step that failed
        self._mine.part.evict.clear()
        # Queued before the step's first GEMM (same FIFO), so every GEMM row carries its step.
        self.loop.call_soon_threadsafe(lambda: self.server.core.begin_step(step, self.server.clock()))

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        base = t._base if t._base is not None else t
        # Two tensors over one storage (slices detached from a larger one) differ by offset.
        return base, (
            base.untyped_storage().data_ptr(),
            base.storage_offset(),
            tuple(base.shape),
            base.dtype,
            base._version,
        )

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` in ``dtype`` on the host: a view of its whole tensor's one copy this step."""
        base, key = self._key(t)
        if not base.is_contiguous():
            return to_host(t, dtype)
        hit = self._casts.get(key)
        if hit is None:  # the original is kept with its copy: its memory cannot be reused meanwhile
            hit = self._casts.setdefault(key, (base, to_host(base, dtype)))
        return hit[1].as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())

    def _wire_for(self, r: GemmRequest) -> torch.dtype | None:
        """The dtype this GEMM travels in: the wire's, unless its operands are not float32 or,
        for fp16, its products could pass fp16's range (|C_ij| <= ||A_i|| ||B_j||): a GEMM whose
        honest results would round to Inf goes exact instead, never to be rejected."""
        dtype = self.wire.torch
        if dtype is None or r.a.dtype != torch.float32 or r.b.dtype != torch.float32:
            return None
        if dtype == torch.float16 and not _fits_fp16(r):
            return None
        return dtype

    def part(self) -> Part:
        """The calling thread's micro-batch: a layer's forward takes it for its backward."""
        return self._mine.part

    def run(self, requests: Sequence[GemmRequest], part: Part | None = None) -> list[torch.Tensor]:
        futures = self._submit(requests, deferred=False, part=part or self._mine.part)
        # Each GEMM is put together here (partial sums, or the PS's own product), off the loop.
        return [_on(r.a.device, f.result()()) for r, f in zip(requests, futures, strict=True)]

    def defer(self, request: GemmRequest, param: torch.Tensor, part: Part | None = None) -> None:
        """Start ``request`` (a weight gradient) and add its product to ``param.grad`` at
        ``finish_backward`` of ``part`` (the micro-batch whose forward read the layer; the
        calling thread's by default): backward goes on to the layers below meanwhile, and the
        GEMMs it waits on go ahead of this one's tiles on the devices."""
        part = part or self._mine.part
        (future,) = self._submit([request], deferred=True, part=part)
        part.deferred.append((param, future))
        # (param lives where the trainer does: take_deferred brings the product there)

    def finish_backward(self) -> None:
        """Wait for the deferred weight gradients and add each to its parameter's ``.grad``, in
        the order backward produced them (as autograd would have, had it waited)."""
        for param, grad in self.take_deferred():
            param.grad = grad if param.grad is None else param.grad + grad

    def take_deferred(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Wait for this thread's deferred weight gradients: (param, its dW), in the order
        backward deferred them. A micro-batch run beside others keeps them as its own."""
        part = self._mine.part
        deferred, part.deferred = part.deferred, []
        return [(param, _on(param.device, future.result()())) for param, future in deferred]

    def _submit(
        self, requests: Sequence[GemmRequest], *, deferred: bool, part: Part | None = None
    ) -> list[concurrent.futures.Future[Product]]:
        part = part or self._mine.part
        sent, out, kept = [], [], []
        mine: list[concurrent.futures.Future[Product] | None] = []  # per request: answered here, or None
        for r in requests:  # here, on the trainer thread (idle while tiles are out), not on the loop
            try:
                check_finite(r.a, r.b, r.kind)
                # Honest fp16 products that could pass fp16's range would be rejected as Inf.
                here = r.a.dtype == torch.float16 and not _fits_fp16(r)
            except FloatingPointError:
                if not self.overflow_here:
                    raise
                here = True  # a loss scaler's overflow: the step will be skipped
            if here:  # multiplied here, as torch would (Inf); never sent to honest devices
                done: concurrent.futures.Future[Product] = concurrent.futures.Future()
                done.set_result(functools.partial(torch.matmul, r.a.detach(), r.b.detach()))
                mine.append(done)
                continue
            mine.append(None)
            dtype = self._wire_for(r)
            if dtype is None and r.a.device.type == "cpu":
                sent.append(r)
                out.append(None)
                kept.append(None)
                continue
            if dtype is None:  # a GPU's operands, staged to the host as they are
                sent.append(GemmRequest(self._cast(r.a, r.a.dtype), self._cast(r.b, r.b.dtype), r.kind, r.retain))
                out.append(None)
                kept.append(functools.partial(torch.matmul, r.a.detach(), r.b.detach()))
                continue
            half = GemmRequest(self._cast(r.a, dtype), self._cast(r.b, dtype), r.kind, r.retain)
            if dtype == torch.float16:  # fp16 cannot hold what float32 can (bf16 can)
                check_finite(half.a, half.b, r.kind, self.wire.value)
            sent.append(half)
            out.append(torch.float32)
            # Kept on the PS, a GEMM is multiplied from the float32 originals: exact, and as fast.
            kept.append(functools.partial(torch.matmul, r.a.detach(), r.b.detach()))
        futures: list[concurrent.futures.Future[Product]] = [concurrent.futures.Future() for _ in sent]
        if sent:
            self.loop.call_soon_threadsafe(
                functools.partial(self.server.submit, sent, futures, out, kept, deferred=deferred)
            )
        # dW is the last to read its X and dY: their copies can go (its GEMM holds them), once
        # the dX that a deferred dW precedes has cast the same dY (the next GEMM waited on).
        evict = [self._key(t)[1] for r in requests if r.kind is GemmKind.GRAD_WEIGHT for t in (r.a, r.b)]
        # A forward no backward follows (an evaluation): nothing reads its X's copy again.
        evict += [self._key(r.a)[1] for r in requests if r.kind is GemmKind.FORWARD and not r.retain]
        if deferred:
            part.evict.extend(evict)
        else:
            for key in (*part.evict, *evict):
                self._casts.pop(key, None)
            part.evict.clear()
        sent_futures = iter(futures)
        return [f if f is not None else next(sent_futures) for f in mine]


def _on(device: torch.device, product: torch.Tensor) -> torch.Tensor:
    """A product where the trainer wants it: tiles are assembled on the host, a kept GEMM is
    multiplied where its operands are."""
    return product if product.device == device else product.to(device)
