"""Freivalds' check: is ``C == A @ B`` (to floating-point error) without redoing the GEMM?

With a random +-1 vector r, compare ``A (B r)`` with ``C r``: O(mk + kn + mn) work against the
GEMM's O(mnk). A wrong C passes only if its error happens to be orthogonal to r, which a +-1
vector makes unlikely (and ``rounds`` independent vectors make vanishingly so).

Tolerance, per row i::

    tol_i = TOL_FACTOR * eps * (||A_i|| ||B||_F + sqrt(n) * min(||C_i||, ||A_i|| ||B||_F))

The first term is the error of an honest float32 product (it carries the operands' magnitudes
and, through ||A_i||, the reduction length k). The second is the rounding of the check itself:
``C r`` sums n terms, and when C's entries are correlated (real activations and gradients are)
that error grows as sqrt(n) ||C_i||. ||C_i|| comes from the untrusted result, so it is capped by
its honest bound ||A_i|| ||B||_F: inflating C cannot loosen the check.

Measured with real clients on real training tiles, honest residuals reached 0.40 of an 8x
bracket (dW tiles: gradient rows are heavy-tailed and correlated with X); TOL_FACTOR = 16 keeps
a 5x margin, since three false rejects in a row would ban an honest device. It still catches a
single element off by 2.5e-3 of C's rms or more on every shape tried (tests/test_verify.py
asserts 1e-2).
``eps`` is the unit roundoff of the dtype the device computed in: bf16 work gets its own bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# 5x the largest honest residual measured on real training tiles (see the docstring).
TOL_FACTOR = 16.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str = ""
    worst_ratio: float = 0.0  # max_i residual_i / tol_i; < 1 means accepted


def rademacher(n: int, rng: np.random.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 2, size=n, dtype=np.int8) * 2 - 1).to(dtype)


def _row_norms(a: torch.Tensor) -> torch.Tensor:
    # vector_norm is fast on contiguous rows but 20x slower on a transposed view (dW's dY^T).
    return torch.linalg.vector_norm(a, dim=1) if a.is_contiguous() else (a * a).sum(1).sqrt()


def freivalds(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rng: np.random.Generator,
    *,
    compute_dtype: torch.dtype = torch.float32,
    rounds: int = 1,
    a_row_norms: torch.Tensor | None = None,
    b_norm: float | None = None,
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
    if k == 0:
        ok = not bool(c.any())
        return Verdict(ok, "" if ok else "nonzero result of an empty product", 0.0 if ok else float("inf"))
    eps = torch.finfo(compute_dtype).eps
    row_norms = _row_norms(a) if a_row_norms is None else a_row_norms  # ||A_i||
    ab = row_norms * (float(torch.linalg.vector_norm(b)) if b_norm is None else b_norm)  # ||A_i|| ||B||_F
    c_norms = torch.minimum(torch.linalg.vector_norm(c, dim=1), ab)  # untrusted, so capped
    tol = TOL_FACTOR * eps * (ab + math.sqrt(n) * c_norms) + torch.finfo(torch.float32).tiny
    worst = 0.0
    for _ in range(rounds):
        r = rademacher(n, rng, a.dtype)
        residual = (a @ (b @ r) - c @ r).abs()
        ratio = float((residual / tol).max())
        worst = max(worst, ratio)
        if not ratio <= 1.0:  # NaN or Inf anywhere in C makes the ratio NaN or Inf: rejected here
            if not bool(torch.isfinite(c).all()):
                return Verdict(False, "result holds NaN or Inf", float("inf"))
            row = int(torch.argmax(residual / tol))
            return Verdict(False, f"Freivalds residual {ratio:.3g}x the tolerance at row {row}", ratio)
    return Verdict(True, "", worst)
