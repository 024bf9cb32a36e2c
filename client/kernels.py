"""The only place a client does tile math: ``C = A @ B`` on the chosen torch device."""

from __future__ import annotations

import time

import torch

from cleave.wire.errors import ConfigError


class DeviceUnavailable(ConfigError):
    """``--device`` names a device this machine does not have."""


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
        # TF32 would fail float32 verification: keep full-precision products. Half-precision
        # tiles (the opt-in wire) must be summed in float32 too: no reduced-precision split-K.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


def release_memory(device: torch.device) -> None:
    """Hand the memory the device's allocator keeps cached back to the machine (its tensors must
    be dropped first): a GPU's cache would otherwise keep what the blocks held while in standby."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if device.type == "cpu" else t.to(device, non_blocking=False)


_HALF_FAST: dict[tuple[str, torch.dtype], bool] = {}  # measured once per device type and dtype


def half_is_fast(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` multiplies faster than float32 here (measured once, at a tile-like size).
    Many CPUs without native half-precision units run bf16 and fp16 far slower than float32.
    Only CPU and CUDA qualify: their half-precision kernels sum in float32 (CUDA's with reduced
    precision reductions off, see ``configure``), which verification requires; MPS's need not."""
    key = (device.type, dtype)
    if key not in _HALF_FAST:
        fast = False
        if device.type in ("cpu", "cuda"):
            try:
                fast = gemm_gflops(device, size=256, seconds=0.1, dtype=dtype) > gemm_gflops(
                    device, size=256, seconds=0.1
                )
            except (RuntimeError, TypeError):  # no kernel for it here
                fast = False
        _HALF_FAST[key] = fast
    return _HALF_FAST[key]


def matmul(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, float]:
    """Compute one tile; returns the C block on the CPU and the seconds the product took.

    Half-precision tiles are multiplied and summed in float32, then rounded once, unless the
    device's half-precision path is faster (the result must come back in the tile's dtype)."""
    if a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype and not half_is_fast(device, a.dtype):
        c, seconds = _product(a.float(), b.float(), device)
        return c.to(a.dtype), seconds
    return _product(a, b, device)


def _product(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, float]:
    """``a @ b`` in the operands' dtype, timed to completion on the device."""
    started = time.perf_counter()
    c = a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()
    seconds = time.perf_counter() - started
    return (c if device.type == "cpu" else c.cpu()), seconds


SLOW_PRODUCT = 1.0  # seconds: a warm-up this slow is measured, not thrown away


def gemm_gflops(
    device: torch.device, size: int = 512, seconds: float = 0.3, dtype: torch.dtype = torch.float32
) -> float:
    """A quick self-benchmark at a tile-like shape: GFLOP/s of the fastest of repeated timed
    ``size^3`` products after one untimed warm-up. Products are timed until ``seconds`` have
    passed, at least three of them while each fits in the budget; a product that alone takes
    longer than ``seconds`` (bfloat16 on many CPUs: seconds at 1024) is timed once, so a slow
    dtype costs its warm-up and one product, not four. A warm-up longer than both ``seconds`` and
    a second is itself the figure: the one-time costs it carries (kernel choice, first touches of
    memory) are milliseconds, under 1% of such a product."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    warm = _product(a, b, device)[1]
    if warm > max(seconds, SLOW_PRODUCT):
        return 2 * size**3 / warm / 1e9
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs == 0 or (runs < 3 and best < seconds) or time.perf_counter() < deadline:
        best = min(best, _product(a, b, device)[1])
        runs += 1
        if runs >= 200:
            break
    return 2 * size**3 / best / 1e9
