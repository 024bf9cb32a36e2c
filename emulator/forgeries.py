"""Forged GEMM results, built the way an attacker who knows wire/verify.py would.

Used by the security tests (through tests/forgeries.py) and by ``cleave emulate --byzantine``
(emulator/devices.py), whose byzantine devices return these instead of their products.

Every ``forge_<kind>(a, b, c, rng, magnitude) -> c_forged`` takes the operands, the honest
result ``c`` and the forger's own generator (the forger never sees the verifier's vectors).
Scalable kinds (``SCALABLE``) put their worst row error at ``magnitude`` times the public
detection threshold ``Delta_i = GAMMA tol_i`` (forgers know the formula); the others have a
natural size (a swap, a replay, zeros, NaN) and ignore ``magnitude``. A fixed-size forgery
that would be honest to within the threshold (swapping two equal rows) raises
``HonestWithinTolerance`` instead of returning something that is not a forgery.

``error_ratio`` measures what a forgery really is: its worst row error against the exact
(float64) product, in units of the threshold the verifier computes from the forged result.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from numpy.random import Generator
from torch import Tensor

from cleave.wire.errors import CleaveError
from cleave.wire.verify import Verdict, detection_threshold, rademacher, tolerance

Forgery = Callable[[Tensor, Tensor, Tensor, Generator, float], Tensor]


class HonestWithinTolerance(CleaveError, ValueError):
    """The requested fixed-size forgery would not differ from the honest result by Delta."""


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the verifier is told the device computed in (the coordinator passes the GEMM's)."""
    return x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32


def error_ratio(a: torch.Tensor, b: torch.Tensor, forged: torch.Tensor) -> float:
    """max_i ||forged_i - (A B)_i|| / Delta_i, against the exact product; inf when not finite."""
    exact = a.double() @ b.double()
    err = torch.linalg.vector_norm(forged.double() - exact, dim=1)
    if not bool(torch.isfinite(err).all()):
        return float("inf")
    delta = detection_threshold(a, b, forged.to(a.dtype), compute_dtype=_compute_dtype(a)).double()
    return float((err / delta).max())


def _delta(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return detection_threshold(a, b, c, compute_dtype=_compute_dtype(a)).double()


def _scaled(c: torch.Tensor, d: torch.Tensor, delta: torch.Tensor, magnitude: float) -> torch.Tensor:
    """c + s d with s chosen so that the worst row of s d is ``magnitude`` thresholds."""
    d = d.double()
    worst = float((torch.linalg.vector_norm(d, dim=1) / delta).max())
    return (c.double() + d * (magnitude / worst)).to(c.dtype)


def _per_row(c: torch.Tensor, d: torch.Tensor, delta: torch.Tensor, magnitude: float) -> torch.Tensor:
    """c + d with every nonzero row of d scaled to ``magnitude`` thresholds."""
    d = d.double()
    norms = torch.linalg.vector_norm(d, dim=1)
    scale = torch.where(norms > 0, magnitude * delta / norms.clamp_min(1e-300), torch.zeros_like(norms))
    return (c.double() + d * scale[:, None]).to(c.dtype)


def _two(rng: np.random.Generator, n: int) -> tuple[int, int]:
    j1, j2 = rng.choice(n, size=2, replace=False)
    return int(j1), int(j2)


# --- perturbations that cancel against many sign vectors -----------------------------------


def forge_pair(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """+u and -u in two entries of one row: e . r = 0 for half of all +-1 vectors."""
    m, n = c.shape
    d = torch.zeros(m, n, dtype=torch.float64)
    i, (j1, j2) = int(rng.integers(m)), _two(rng, n)
    d[i, j1], d[i, j2] = 1.0, -1.0
    return _scaled(c, d, _delta(a, b, c), magnitude)


def forge_hadamard4(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """u (1, -1, 1, -1) on four entries of one row (a Hadamard row): cancels for 6 of 16 sign patterns."""
    m, n = c.shape
    d = torch.zeros(m, n, dtype=torch.float64)
    i, cols = int(rng.integers(m)), rng.choice(n, size=4, replace=False)
    d[i, torch.from_numpy(cols)] = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    return _scaled(c, d, _delta(a, b, c), magnitude)


def forge_orthogonal(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """A few rows perturbed orthogonally to n/2 fixed +-1 vectors: invisible to all of them."""
    m, n = c.shape
    signs = torch.from_numpy(rng.integers(0, 2, size=(n, n // 2)) * 2.0 - 1.0)  # (n, n/2)
    q, _ = torch.linalg.qr(signs)  # orthonormal basis of their span
    rows = torch.from_numpy(rng.choice(m, size=min(m, 4), replace=False))
    g = torch.from_numpy(rng.standard_normal((len(rows), n)))
    d = torch.zeros(m, n, dtype=torch.float64)
    d[rows] = g - (g @ q) @ q.t()  # e . s = 0 for every fixed sign vector s
    return _per_row(c, d, _delta(a, b, c), magnitude)


def forge_pairs_many_rows(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """A +-u pair in every row, each at ``magnitude`` thresholds: every row cancels half the time."""
    m, n = c.shape
    d = torch.zeros(m, n, dtype=torch.float64)
    for i in range(m):
        j1, j2 = _two(rng, n)
        d[i, j1], d[i, j2] = 1.0, -1.0
    return _per_row(c, d, _delta(a, b, c), magnitude)


def forge_pairs_one_row(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """Eight disjoint +-u pairs in one row: the sum of their sign differences is often zero."""
    m, n = c.shape
    d = torch.zeros(m, n, dtype=torch.float64)
    i, cols = int(rng.integers(m)), rng.choice(n, size=min(16, n - n % 2), replace=False)
    d[i, torch.from_numpy(cols[0::2])], d[i, torch.from_numpy(cols[1::2])] = 1.0, -1.0
    return _scaled(c, d, _delta(a, b, c), magnitude)


# --- structured perturbations -------------------------------------------------------------


def forge_low_rank(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """C + U V^T with U (m x 2), V (n x 2): a rank-2 change to every row."""
    m, n = c.shape
    u, v = torch.from_numpy(rng.standard_normal((m, 2))), torch.from_numpy(rng.standard_normal((n, 2)))
    return _scaled(c, u @ v.t(), _delta(a, b, c), magnitude)


def forge_perturbed_operands(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """(A + s A')(B + s B'): the exact product of slightly different operands."""
    da = torch.from_numpy(rng.standard_normal(tuple(a.shape))).to(a.dtype) * a.float().pow(2).mean().sqrt().to(a.dtype)
    db = torch.from_numpy(rng.standard_normal(tuple(b.shape))).to(b.dtype) * b.float().pow(2).mean().sqrt().to(b.dtype)
    first_order = da.double() @ b.double() + a.double() @ db.double()
    d_norms = torch.linalg.vector_norm(first_order, dim=1)
    s = magnitude / float((d_norms / _delta(a, b, c)).max())
    return (a + s * da) @ (b + s * db)


def forge_scaled(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """(1 + s) C: every row off in its own direction."""
    return _scaled(c, c.double(), _delta(a, b, c), magnitude)


def _adamw_update(b: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """An AdamW-like step direction for weights ``b``: m_hat / sqrt(v_hat) after a few steps, plus decay."""
    g = [torch.from_numpy(rng.standard_normal(tuple(b.shape))) * (1 + 0.3 * s) for s in range(3)]
    m = sum(0.9 ** (2 - s) * 0.1 * g[s] for s in range(3)) / (1 - 0.9**3)
    v = sum(0.999 ** (2 - s) * 0.001 * g[s] ** 2 for s in range(3)) / (1 - 0.999**3)
    return m / (v.sqrt() + 1e-8) + 0.1 * b.double()


def forge_stale_weights(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """A @ B_old: the right tile, computed with the weights from before an optimizer step.

    The step is scaled (like a small learning rate) so that the worst row is ``magnitude``
    thresholds off; a real step at lr 1e-3 is far larger than the threshold.
    """
    update = _adamw_update(b, rng)
    d_norms = torch.linalg.vector_norm(a.double() @ update, dim=1)
    lr = magnitude / float((d_norms / _delta(a, b, c)).max())
    return a @ (b.double() - lr * update).to(b.dtype)


def _moment_matched(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Fresh rows with the column means and spreads of ``x``: another batch through the same layer."""
    xd = x.double()
    mean = xd.mean(0, keepdim=True)
    std = xd.std(0, keepdim=True) if x.shape[0] > 1 else xd.abs()
    return (mean + std * torch.from_numpy(rng.standard_normal(tuple(x.shape)))).to(x.dtype)


def forge_previous_batch(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """A_prev @ B: the right weights applied to the previous step's activations (another batch)."""
    return _moment_matched(a, rng) @ b


def forge_replay(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """The result of another tile of the same shape: other rows of A times other columns of B."""
    return _moment_matched(a, rng) @ _moment_matched(b.t(), rng).t()


def _far_pair(x: torch.Tensor, delta: torch.Tensor, rng: np.random.Generator) -> tuple[int, int]:
    """Two row indices of ``x`` whose swap moves both rows by >= 2 thresholds; raises if none."""
    m = x.shape[0]
    if m < 2:
        raise HonestWithinTolerance("a single row cannot be swapped")
    for _ in range(64):
        i, j = _two(rng, m)
        gap = float(torch.linalg.vector_norm(x[i].double() - x[j].double()))
        if gap >= 2 * max(float(delta[i]), float(delta[j])):
            return i, j
    raise HonestWithinTolerance("no two rows differ by more than the threshold")


def forge_swap_rows(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """Two rows of C exchanged (an assembly or bookkeeping error a forger could fake)."""
    i, j = _far_pair(c, _delta(a, b, c), rng)
    out = c.clone()
    out[[i, j]] = c[[j, i]]
    return out


def forge_swap_cols(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """Two columns of C exchanged: in every row a +-u pair, the worst one past the threshold."""
    delta = _delta(a, b, c)
    n = c.shape[1]
    if n < 2:
        raise HonestWithinTolerance("a single column cannot be swapped")
    for _ in range(64):
        j1, j2 = _two(rng, n)
        row_err = (c[:, j1].double() - c[:, j2].double()).abs() * 2**0.5
        if float((row_err / delta).max()) >= 2:
            out = c.clone()
            out[:, [j1, j2]] = c[:, [j2, j1]]
            return out
    raise HonestWithinTolerance("no two columns differ by more than the threshold")


def forge_zeros(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """All zeros: the cheapest lie."""
    if float((torch.linalg.vector_norm(c.double(), dim=1) / _delta(a, b, c)).max()) < 2:
        raise HonestWithinTolerance("the honest result is already zero to within the threshold")
    return torch.zeros_like(c)


def forge_nan(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """One NaN, hoping a NaN comparison reads as a pass."""
    out = c.clone()
    out[int(rng.integers(c.shape[0])), int(rng.integers(c.shape[1]))] = float("nan")
    return out


def forge_inf(a: Tensor, b: Tensor, c: Tensor, rng: Generator, magnitude: float) -> Tensor:
    """+Inf and -Inf in one row (their sum in C r is NaN, not a number to compare)."""
    out = c.clone()
    i, (j1, j2) = int(rng.integers(c.shape[0])), _two(rng, c.shape[1])
    out[i, j1], out[i, j2] = float("inf"), float("-inf")
    return out


FORGERIES: dict[str, Forgery] = {
    "pair": forge_pair,
    "hadamard4": forge_hadamard4,
    "orthogonal": forge_orthogonal,
    "pairs_many_rows": forge_pairs_many_rows,
    "pairs_one_row": forge_pairs_one_row,
    "low_rank": forge_low_rank,
    "perturbed_operands": forge_perturbed_operands,
    "scaled": forge_scaled,
    "stale_weights": forge_stale_weights,
    "previous_batch": forge_previous_batch,
    "replay": forge_replay,
    "swap_rows": forge_swap_rows,
    "swap_cols": forge_swap_cols,
    "zeros": forge_zeros,
    "nan": forge_nan,
    "inf": forge_inf,
}
SCALABLE = frozenset(
    {
        "pair",
        "hadamard4",
        "orthogonal",
        "pairs_many_rows",
        "pairs_one_row",
        "low_rank",
        "perturbed_operands",
        "scaled",
        "stale_weights",
    }
)
NON_FINITE = frozenset({"nan", "inf"})


def single_round_rademacher(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, rng: np.random.Generator) -> Verdict:
    """The check as it was landed: one +-1 vector, the same tolerance. Kept to show its weakness."""
    tol = tolerance(a, b, c)
    r = rademacher(b.shape[1], rng, a.dtype)
    ratio = float(((a @ (b @ r) - c @ r).abs() / tol).max())
    return Verdict(ratio <= 1.0, "" if ratio <= 1.0 else "residual above tolerance", ratio)


__all__ = ["FORGERIES", "HonestWithinTolerance", "NON_FINITE", "SCALABLE", "error_ratio", "single_round_rademacher"] + [
    f.__name__ for f in FORGERIES.values()
]
