"""The only place a client does tile math: ``C = A @ B`` on the chosen torch device."""

from __future__ import annotations

import time

import torch


class DeviceUnavailable(RuntimeError):
    pass


def pick_device(requested: str = "auto") -> torch.device:
    """``auto`` prefers CUDA, then Apple's MPS, then the CPU; an explicit choice must exist."""
    requested = requested.lower()
    cuda = torch.cuda.is_available()
    mps = bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    if requested == "auto":
        return torch.device("cuda" if cuda else "mps" if mps else "cpu")
    if requested == "cuda" and not cuda:
        raise DeviceUnavailable("--device cuda: torch sees no CUDA device here")
    if requested == "mps" and not mps:
        raise DeviceUnavailable("--device mps: Apple MPS is not available here")
    if requested not in ("cpu", "cuda", "mps"):
        raise DeviceUnavailable(f"--device must be auto, cpu, mps or cuda, not {requested!r}")
    return torch.device(requested)


def configure(device: torch.device, threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        # TF32 would fail float32 verification: keep full-precision products.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if device.type == "cpu" else t.to(device, non_blocking=False)


def matmul(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, float]:
    """Compute one tile; returns the C block on the CPU and the seconds the product took."""
    started = time.perf_counter()
    c = a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()
    seconds = time.perf_counter() - started
    return (c if device.type == "cpu" else c.cpu()), seconds


def gemm_gflops(device: torch.device, size: int = 512, seconds: float = 0.3, dtype: torch.dtype = torch.float32) -> float:
    """A quick self-benchmark at a tile-like shape: best of repeated ``size^3`` products."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    matmul(a, b, device)  # warm-up
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        best = min(best, matmul(a, b, device)[1])
        runs += 1
        if runs >= 200:
            break
    return 2 * size**3 / best / 1e9
