"""Where the coordinator's own tensors live: ``--device auto|cpu|cuda``.

The coordinator runs everything that is not a shipped GEMM (attention, norms, the loss, the
optimizer, the GEMMs the planner keeps home) on this device. Blocks cross to and from the wire
on the host, staged through pinned memory (``to_host``), because sockets read host memory.
"""

from __future__ import annotations

import torch

from cleave.wire.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def coordinator_device(requested: str = "auto") -> torch.device:
    """``auto``: CUDA where torch sees one, else the CPU; ``cuda`` must exist. (Apple's MPS
    is for volunteers: its kernels need not sum half precision in float32, and the coordinator's
    kept GEMMs must equal the reference's.)"""
    name = requested.lower()
    if name not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ConfigError("--device cuda: torch sees no CUDA device here (try --device cpu)")
    device = torch.device("cuda" if name == "cuda" or (name == "auto" and cuda) else "cpu")
    if device.type == "cuda":
        # TF32 rounds float32 products to 10 mantissa bits: the coordinator's kept GEMMs and
        # checks would then disagree with the float32 reference. Half-precision products are
        # summed in float32, as volunteers must (client/kernels.py).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    return device


def describe(device: torch.device) -> str:
    """A line for the log: ``cpu (8 threads)`` or ``cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB)``."""
    if device.type != "cuda":
        return f"cpu ({torch.get_num_threads()} threads)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return f"cuda:{index} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (in ``dtype``) as a contiguous host tensor. A CUDA tensor is copied into pinned
    memory (DMA without a bounce buffer) and waited for; a CPU one is converted as ``.to``
    would."""
    dtype = dtype or t.dtype
    if t.device.type == "cpu":
        return t.detach().to(dtype).contiguous()
    src = t.detach() if t.dtype == dtype else t.detach().to(dtype)  # cast on the device: fewer bytes cross
    host = torch.empty(t.shape, dtype=dtype, pin_memory=True)
    host.copy_(src, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings of CUDA work mean nothing without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
