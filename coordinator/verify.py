"""Freivalds' check: is ``C == A @ B`` (to floating-point error) without redoing the GEMM?

With a random +-1 vector r, compare ``A (B r)`` with ``C r``: O(mk + kn + mn) work against the
GEMM's O(mnk). A wrong C passes only if its error happens to be orthogonal to r, which a +-1
vector makes unlikely (and ``rounds`` independent vectors make vanishingly so).

Tolerance, per row i: ``TOL_FACTOR * eps * ||A_i||_2 * ||B||_F``. The norms carry the operands'
magnitudes and the reduction length k (||A_i|| grows as sqrt(k)); ``eps`` is the unit roundoff
of the dtype the device computed in, so bf16 work gets its own, looser bound. On this machine
honest float32 residuals stayed below 1.6x ``eps * ||A_i|| * ||B||_F`` in 9,600 checks
(shared/design/performance-notes.md); TOL_FACTOR is 8x that, and still catches a single element
off by 1e-2 of C's rms (see tests/test_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# ~8x the largest honest residual measured (1.6 eps ||A_i|| ||B||_F).
TOL_FACTOR = 12.8


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""
    worst_ratio: float = 0.0  # max_i residual_i / tol_i; < 1 means accepted


def rademacher(n: int, rng: np.random.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 2, size=n, dtype=np.int8) * 2 - 1).to(dtype)


def freivalds(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rng: np.random.Generator,
    *,
    compute_dtype: torch.dtype = torch.float32,
    rounds: int = 1,
) -> Verdict:
    """Check that ``c`` is ``a @ b`` computed honestly in ``compute_dtype``."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"operands do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    if tuple(c.shape) != (m, n):
        return Verdict(False, f"result has shape {tuple(c.shape)}, expected {(m, n)}", float("inf"))
    if c.dtype != a.dtype:
        return Verdict(False, f"result has dtype {c.dtype}, expected {a.dtype}", float("inf"))
    if m == 0 or n == 0:
        return Verdict(True)
    if not bool(torch.isfinite(c).all()):
        return Verdict(False, "result holds NaN or Inf", float("inf"))
    if k == 0:
        ok = not bool(c.any())
        return Verdict(ok, "" if ok else "nonzero result of an empty product", 0.0 if ok else float("inf"))
    eps = torch.finfo(compute_dtype).eps
    # Per-row bound: eps * ||A_i|| * ||B||_F (+ a tiny absolute floor for all-zero rows).
    b_norm = float(torch.linalg.vector_norm(b))
    row_norms = torch.linalg.vector_norm(a, dim=1)
    tol = TOL_FACTOR * eps * row_norms * b_norm + torch.finfo(torch.float32).tiny
    worst = 0.0
    for _ in range(rounds):
        r = rademacher(n, rng, a.dtype)
        residual = (a @ (b @ r) - c @ r).abs()
        ratio = float((residual / tol).max())
        worst = max(worst, ratio)
        if not ratio <= 1.0:  # also catches NaN
            row = int(torch.argmax(residual / tol))
            return Verdict(False, f"Freivalds residual {ratio:.3g}x the tolerance at row {row}", ratio)
    return Verdict(True, "", worst)
