"""Freivalds' check: is ``C == A @ B`` (to floating-point error) without redoing the GEMM?

A result comes from an untrusted device, so the check must hold against a forger who knows
this code, not just against random corruption. docs/security.md (## Verification) has the
threat, the argument and the measured figures; in short:

* ``ROUNDS`` independent vectors with i.i.d. entries uniform on [-1/2, 1/2), batched as one
  ``n x ROUNDS`` matrix R, so the check is one pass over A, B and C: compare ``A (B R)`` with
  ``C R``, O(ROUNDS (mk + kn + mn)) work against the GEMM's O(mnk). R comes from the caller's
  generator, which must be seeded from OS entropy (the coordinator's is) and never shown to a
  device. A +-1 vector cannot do this: an error ``+u, -u`` in two entries of a row cancels for
  half of all sign vectors, whatever the size of u.
* A row i with error e_i (C_i minus the exact product) passes only if ``|e_i . r| <= 2 tol_i``
  for every column r of R (one tol for the tolerance, one for the check's own rounding). A
  continuous vector lands in that slab with probability at most ``SLAB * tol_i / ||e_i||``
  (Ball's cube-slicing bound), independently per round. So any block with a row whose error
  reaches the detection threshold ``GAMMA tol_i`` is accepted with probability at most
  ``acceptance_bound(ROUNDS, GAMMA)``, below 2^-40. Errors below that threshold are as small as
  the rounding of an honest product and cannot be told from it.

Tolerance, per row i, for vectors of unit variance::

    tol_i = TOL_FACTOR * (eps * ||A_i|| ||B||_F + eps_check * sqrt(n) * min(||C_i||, ||A_i|| ||B||_F))

The first term is the error of an honest product (it carries the operands' magnitudes and,
through ||A_i||, the reduction length k). The second is the rounding of the check itself:
``C r`` sums n terms, and when C's entries are correlated (real activations and gradients are)
that error grows as sqrt(n) ||C_i||. ||C_i|| comes from the untrusted result, so it is capped by
its honest bound ||A_i|| ||B||_F: inflating C cannot loosen the check. A row whose norm exceeds
``NORM_CAP`` times that bound cannot be an honest product and is rejected before the products.

Measured with real clients on real training tiles, honest residuals reached 0.40 of an 8x
bracket with one +-1 vector (dW tiles: gradient rows are heavy-tailed and correlated with X).
The worst of ROUNDS vectors is two to three times the worst of one, mostly from the float32
rounding of A (B R) on dW rows with heavy cancellation: over about 860,000 honest tile checks of
training runs it reached 0.23 of the tolerance with TOL_FACTOR = 40, a 4.4x margin: a false
reject counts against an honest device and can get it banned (docs/security.md).
``eps`` is the machine epsilon of the dtype the device computed in (bf16 work gets its own,
far looser bound); ``eps_check`` that of the dtype the check runs in. float16 and bfloat16
operands are checked in float32 with norms computed here, so tiny values cannot square to zero
and large ones cannot overflow to an infinite tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# 4.4x the largest honest residual over ROUNDS vectors measured on real training tiles
# (docs/security.md): the maximum over 16 rounds reaches two to three times that of one.
TOL_FACTOR = 40.0
# Independent random vectors per check, batched as the columns of R. MKL runs the skinny
# products as fast with 16 columns as with 4 (bench/bench_verify.py); 24 or 32 cost ~1.5x.
ROUNDS = 16
# Detection threshold in tolerances: a row off by GAMMA tol_i or more is caught except with
# probability acceptance_bound(ROUNDS, GAMMA) <= 2^-40.
GAMMA = 10.0
# Largest acceptance probability of one result whose worst row error reaches GAMMA tol_i.
TARGET_BOUND = 2.0**-40
# An honest row satisfies ||C_i|| <= ||A_i|| ||B||_2 <= ||A_i|| ||B||_F up to rounding.
NORM_CAP = 2.0
# A result summed in float32 and then rounded to a half dtype (``rounded_to``: the opt-in
# half-precision wire) carries a row error ||e_i|| <= u ||C_i||, u its unit roundoff. Each round
# adds e_i . r, a sum of independent terms bounded by |e_ij| / 2, so Hoeffding puts it beyond
# ROUNDING_FACTOR * R_RMS * ||e_i|| with probability 2 exp(-2 (16 R_RMS)^2) ~ 1e-18 a round.
ROUNDING_FACTOR = 16.0
# The 2^-40 guarantee then covers a wire row error from GAMMA * ROUNDING_FACTOR * u of the row's
# norm: 0.625 in bf16, 0.078 in fp16. Below 1, so replacing a row outright is always caught.
if not all(GAMMA * ROUNDING_FACTOR * torch.finfo(d).eps / 2 < 1 for d in (torch.bfloat16, torch.float16)):
    raise ImportError("GAMMA * ROUNDING_FACTOR * u must stay below 1 for every wire dtype")

# Entries of R: uniform on [-1/2, 1/2), drawn as float32 (24-bit grid, see _GRID), rms 1/sqrt(12).
R_RMS = 1.0 / math.sqrt(12.0)
# Products with at most this many elements in A, B and C together are checked stacked with the
# others of their shape (``_stacked``): below it a tile's check costs its torch calls, not its
# arithmetic (bench/bench_verify.py). 0: never stacked.
STACK_BELOW = 1 << 16
# Density of a . X for a unit vector a and X uniform on [-1/2, 1/2]^n is at most sqrt(2)
# (K. Ball, "Cube slicing in R^n", 1986). With unit-variance entries (X sqrt(12)), the slab
# |e . r| <= 2 tol has probability at most 2 * 2 tol * sqrt(2) / (sqrt(12) ||e||) = SLAB tol / ||e||.
SLAB = 4.0 * math.sqrt(2.0) / math.sqrt(12.0)  # = 2 sqrt(2/3) ~ 1.633
# numpy draws float32 uniforms as j / 2^24: each entry is a continuous uniform moved down by
# less than 2^-24, which shifts e . r by at most 2^-24 ||e||_1 <= 2^-24 sqrt(n) ||e||.
_GRID = 2.0**-24


@dataclass(frozen=True)
class Verdict:
    """A check's outcome: ``ok``, why not, and how close honest work came to the bound."""

    ok: bool
    reason: str = ""
    worst_ratio: float = 0.0  # max over rows and rounds of residual / tol; <= 1 means accepted


def round_bound(ratio: float, n: int) -> float:
    """Largest chance that one round accepts a row whose error is ``ratio`` tolerances.

    Assumes the check's own rounding stays within one tolerance (what "no false rejects"
    measures); ``n`` is the length of the random vector (C's column count).
    """
    if not ratio > 0:
        return 1.0
    density = SLAB / ratio  # continuous uniform, Ball's bound
    grid = 2.0 * math.sqrt(2.0) * _GRID * math.sqrt(n)  # the float32 grid of the draws
    return min(1.0, density + grid)


def acceptance_bound(rounds: int = ROUNDS, gamma: float = GAMMA, n: int = 1 << 16) -> float:
    """Upper bound on accepting a result with some row error >= ``gamma`` tolerances.

    Rounds are independent, so the per-round bound multiplies. ``n`` (default 65,536, larger
    than any tile) only enters through the float32 grid of the draws, a 4e-5 term at most.
    """
    return round_bound(gamma, n) ** rounds


def rademacher(n: int, rng: np.random.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A +-1 vector. Not used by ``freivalds`` (unsound against forgers); kept for benchmarks."""
    return torch.from_numpy(rng.integers(0, 2, size=n, dtype=np.int8) * 2 - 1).to(dtype)


def random_vectors(n: int, rounds: int, rng: np.random.Generator) -> torch.Tensor:
    """``n x rounds`` float32 matrix of i.i.d. entries uniform on [-1/2, 1/2).

    numpy's float32 uniform is the fastest generator measured here (2 ns an entry, 4x faster
    than its Gaussian, 1.3x faster than torch.rand), and ``j/2^24 - 1/2`` is exact in float32.
    """
    return torch.from_numpy(rng.random((n, rounds), dtype=np.float32)).sub_(0.5)


def _row_norms(a: torch.Tensor) -> torch.Tensor:
    # vector_norm is fast on contiguous rows but 20x slower on a transposed view (dW's dY^T).
    return torch.linalg.vector_norm(a, dim=1) if a.is_contiguous() else (a * a).sum(1).sqrt()


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision operands are checked in float32: squares of small fp16 values underflow
    # to zero (a zero tolerance), and the products would round far more than the bound allows.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def tolerance(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
    a_row_norms: torch.Tensor | None = None,
    b_norm: float | None = None,
    rounded_to: torch.dtype | None = None,
) -> torch.Tensor:
    """``tol_i`` for every row (vectors of unit variance), in the check's working dtype.

    Public so that tests, benchmarks and forgers use the very formula ``freivalds`` uses.
    """
    work, result = _work_dtype(a.dtype), a.dtype
    if a.dtype != work:
        a, b, c, a_row_norms, b_norm = a.to(work), b.to(work), c.to(work), None, None
    return torch.from_numpy(_bounds(a, b, c, compute_dtype, a_row_norms, b_norm, result, rounded_to)[0])


def detection_threshold(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    compute_dtype: torch.dtype = torch.float32,
    gamma: float = GAMMA,
    rounded_to: torch.dtype | None = None,
) -> torch.Tensor:
    """``Delta_i = gamma tol_i``: a row error this large is caught except w.p. acceptance_bound."""
    return gamma * tolerance(a, b, c, compute_dtype=compute_dtype, rounded_to=rounded_to)


def _bounds(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    compute_dtype: torch.dtype,
    a_row_norms: torch.Tensor | None,
    b_norm: float | None,
    result_dtype: torch.dtype,
    rounded_to: torch.dtype | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tol, ||C_i||, ||A_i|| ||B||_F) per row, for operands already in the working dtype;
    ``result_dtype``: the dtype the device returned C in.

    Per-row arithmetic runs in numpy: on a few hundred values each torch call costs 5-10 us
    of dispatch right after a GEMM, several times numpy's.
    """
    work = a.dtype
    a_norms = None if a_row_norms is None or a_row_norms.dtype != work else a_row_norms.detach().cpu().numpy()
    if a_norms is None or not np.isfinite(a_norms).all():
        a_norms = _row_norms(a).numpy()
    if b_norm is None or not math.isfinite(b_norm):
        b_norm = float(torch.linalg.vector_norm(b))
    ab = a_norms * b_norm  # ||A_i|| ||B||_F
    c_norms = _row_norms(c).numpy()  # untrusted
    return _tolerance(ab, c_norms, c.shape[1], compute_dtype, work, result_dtype, rounded_to), c_norms, ab


def _tolerance(
    ab: np.ndarray,
    c_norms: np.ndarray,
    n: int,
    compute_dtype: torch.dtype,
    work: torch.dtype,
    result_dtype: torch.dtype,
    rounded_to: torch.dtype | None,
) -> np.ndarray:
    """``tol_i`` from ``||A_i|| ||B||_F`` and ``||C_i||`` (arrays of any shape, elementwise), for
    rows of ``n`` columns: the one formula every check uses, one tile or a stack of them."""
    # The product's error scales with the dtype the device computed in; the check's own
    # rounding with the dtype the check runs in (float32 for half-precision operands).
    product = torch.finfo(compute_dtype).eps * ab
    check = torch.finfo(work).eps * math.sqrt(n) * np.minimum(c_norms, ab)
    # Below its normal range a result's rounding is absolute, not relative: up to half the
    # subnormal spacing per element (2^-25 in fp16, where small gradients live; negligible in
    # bf16 and float32), a bounded error per element that ROUNDING_FACTOR covers (Hoeffding).
    out = torch.finfo(result_dtype)
    subnormal = ROUNDING_FACTOR * math.sqrt(n) * out.smallest_normal * out.eps / 2
    tol: np.ndarray = TOL_FACTOR * (product + check) + subnormal + torch.finfo(work).tiny
    if rounded_to is not None:  # summed in compute_dtype, then rounded once (see ROUNDING_FACTOR)
        tol = tol + ROUNDING_FACTOR * torch.finfo(rounded_to).eps / 2 * np.minimum(c_norms, ab)
    return tol


@dataclass(frozen=True, eq=False)
class Product:
    """One result of a batch check: ``c`` claimed to be ``a @ b`` (see ``freivalds``).

    ``a_key`` and ``b_key`` name the operand blocks: products with equal keys must hold the
    very same tensors (the coordinator's own operands, never a peer's), and share the work of
    the check. ``None`` shares with nothing."""

    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    a_key: Hashable = None
    b_key: Hashable = None
    compute_dtype: torch.dtype = torch.float32
    rounded_to: torch.dtype | None = None
    a_row_norms: torch.Tensor | None = None
    b_norm: float | None = None


@dataclass
class _Pending:
    """A product past the structural checks: its operands in the working dtype and its bounds."""

    index: int
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    tol: np.ndarray


class _Shared:
    """A batch's half-precision operands in float32 with their norms (computed here, never the
    caller's), once per block key: a block read by many products is converted once."""

    def __init__(self, a_keys: Sequence[Hashable], b_keys: Sequence[Hashable]) -> None:
        self._a_keys, self._b_keys = a_keys, b_keys
        self._as: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bs: dict[Hashable, tuple[torch.Tensor, float]] = {}

    def a(self, p: Product, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._a_keys[i]
        if key not in self._as:
            a = p.a.to(_work_dtype(p.a.dtype))
            self._as[key] = (a, _row_norms(a))
        return self._as[key]

    def b(self, p: Product, i: int) -> tuple[torch.Tensor, float]:
        key = self._b_keys[i]
        if key not in self._bs:
            b = p.b.to(_work_dtype(p.b.dtype))
            self._bs[key] = (b, float(torch.linalg.vector_norm(b)))
        return self._bs[key]


def structure(p: Product) -> Verdict | None:
    """Shapes, dtypes and empty products: a verdict, or None when the product needs the check.
    O(1) but for an empty reduction's result (all zero?)."""
    m, k = p.a.shape
    k2, n = p.b.shape
    if k != k2:
        raise ValueError(f"operands do not chain: {tuple(p.a.shape)} @ {tuple(p.b.shape)}")
    c = p.c
    if tuple(c.shape) != (m, n):
        return Verdict(False, f"result has shape {tuple(c.shape)}, expected {(m, n)}", float("inf"))
    if c.dtype != p.a.dtype:
        return Verdict(False, f"result has dtype {c.dtype}, expected {p.a.dtype}", float("inf"))
    if m == 0 or n == 0:
        return Verdict(True)
    if k == 0:
        ok = not bool(c.any())
        return Verdict(ok, "" if ok else "nonzero result of an empty product", 0.0 if ok else float("inf"))
    return None


def _too_large(c: torch.Tensor, c_norms: np.ndarray, ab: np.ndarray) -> Verdict | None:
    """Rows too large to be honest (NaN and Inf show in the row norms: ``not x <= y`` is true
    for NaN): a verdict, or None."""
    over = ~(c_norms <= NORM_CAP * ab)
    if not over.any():
        return None
    if not bool(torch.isfinite(c).all()):
        return Verdict(False, "result holds NaN or Inf", math.inf)
    row = int(np.flatnonzero(over)[0])
    return Verdict(
        False,
        f"row {row} has norm {c_norms[row]:.3g}, above the largest possible {ab[row]:.3g} of an honest product",
        math.inf,
    )


def _verdict(c: torch.Tensor, ratios: np.ndarray) -> Verdict:
    """The verdict from each row's worst residual over its tolerance (one product's rows)."""
    worst = float(ratios.max())  # NaN anywhere (from A or B) makes this NaN
    if not worst <= 1.0:  # NaN or Inf makes the comparison false: rejected here
        if not bool(torch.isfinite(c).all()):
            return Verdict(False, "result holds NaN or Inf", math.inf)
        row = int(np.argmax(np.nan_to_num(ratios, nan=math.inf)))
        return Verdict(False, f"Freivalds residual {worst:.3g}x the tolerance at row {row}", worst)
    return Verdict(True, "", worst)


def _screen(p: Product, shared: _Shared, i: int) -> Verdict | _Pending:
    """The checks that need no random vectors: shapes, dtypes, empty products, NaN and rows too
    large to be honest. A verdict, or the product ready for the residual. ``shared``: the
    batch's cache of operands in the working dtype and their norms, one per block (``i``: the
    product's place in the batch)."""
    structural = structure(p)
    if structural is not None:
        return structural
    c = p.c
    a, b, row_norms, b_norm = p.a, p.b, p.a_row_norms, p.b_norm
    work, result = _work_dtype(a.dtype), a.dtype
    if a.dtype != work:  # checked in float32, with norms of our own, once per block (_work_dtype)
        a, row_norms = shared.a(p, i)
        b, b_norm = shared.b(p, i)
        c = c.to(work)
    tol, c_norms, ab = _bounds(a, b, c, p.compute_dtype, row_norms, b_norm, result, p.rounded_to)
    large = _too_large(c, c_norms, ab)
    return large if large is not None else _Pending(-1, a, b, c, tol)


def _judge(p: _Pending, residual: torch.Tensor) -> Verdict:
    """The verdict from ``|A (B R) - C R|`` (m x rounds, this product's own columns)."""
    return _verdict(p.c, residual.amax(dim=1).numpy() / (p.tol * R_RMS))  # (m,) worst round of each row


def _stacked(
    products: Sequence[Product], b_keys: Sequence[Hashable], rng: np.random.Generator, rounds: int
) -> list[Verdict]:
    """``freivalds_batch`` for small products of one shape and dtypes, stacked: each step is one
    batched torch call for them all (``bmm``), not one call per product, which is what a small
    tile's check costs (torch's dispatch, 5-10 us a call). The same check: each distinct B block
    its own ``rounds`` vectors, shared by the products that read it; the same bounds
    (``_tolerance``) and verdicts. A and its norms are read per product (stacked copies): for
    small blocks that costs less than the calls it saves."""
    first = products[0]
    work, result = _work_dtype(first.a.dtype), first.a.dtype
    n = first.b.shape[1]
    slot: dict[Hashable, int] = {}  # b key -> its block's place in the stack of distinct Bs
    distinct: list[torch.Tensor] = []
    for p, key in zip(products, b_keys, strict=True):
        if key not in slot:
            slot[key] = len(distinct)
            distinct.append(p.b)
    which = torch.tensor([slot[key] for key in b_keys])
    a = torch.stack([p.a for p in products]).to(work)  # (G, m, k)
    c = torch.stack([p.c for p in products]).to(work)  # (G, m, n)
    b = torch.stack(distinct).to(work)  # (Gb, k, n)
    r = torch.from_numpy(rng.random((len(distinct), n, rounds), dtype=np.float32)).sub_(0.5).to(work)
    residual = (torch.bmm(a, torch.bmm(b, r)[which]) - torch.bmm(c, r[which])).abs_().amax(dim=2).numpy()  # (G, m)
    b_norms = torch.linalg.vector_norm(b, dim=(1, 2)).numpy()[which.numpy(), None]  # ||B||_F of each product's B
    ab = torch.linalg.vector_norm(a, dim=2).numpy() * b_norms  # (G, m): ||A_i|| ||B||_F
    c_norms = torch.linalg.vector_norm(c, dim=2).numpy()  # untrusted
    tol = _tolerance(ab, c_norms, n, first.compute_dtype, work, result, first.rounded_to)
    ratios = residual / (tol * R_RMS)
    verdicts = []
    for g, p in enumerate(products):
        large = _too_large(p.c, c_norms[g], ab[g])
        verdicts.append(large if large is not None else _verdict(p.c, ratios[g]))
    return verdicts


def freivalds(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rng: np.random.Generator,
    *,
    compute_dtype: torch.dtype = torch.float32,
    rounds: int = ROUNDS,
    a_row_norms: torch.Tensor | None = None,
    b_norm: float | None = None,
    rounded_to: torch.dtype | None = None,
) -> Verdict:
    """Check that ``c`` is ``a @ b`` computed honestly in ``compute_dtype``.

    ``rng`` must be unpredictable to whoever computed ``c`` (seeded from OS entropy). With the
    default ``rounds`` a result with a row off by ``GAMMA`` tolerances or more passes with
    probability at most ``acceptance_bound()``; fewer rounds weaken that bound.
    ``a_row_norms`` and ``b_norm`` may be passed to share them between tiles of one block.
    ``rounded_to``: C was summed in ``compute_dtype`` (float32) and then rounded once to this
    half dtype (the half-precision wire): its rounding is tolerated, nothing more.
    """
    p = Product(a, b, c, compute_dtype=compute_dtype, rounded_to=rounded_to, a_row_norms=a_row_norms, b_norm=b_norm)
    return freivalds_batch([p], rng, rounds=rounds)[0]


def freivalds_batch(
    products: Sequence[Product], rng: np.random.Generator, *, rounds: int = ROUNDS, stack_below: int = STACK_BELOW
) -> list[Verdict]:
    """``freivalds`` for many results at once, one verdict each, in order.

    Each product keeps a check of its own: its own ``rounds`` columns of the residual, drawn
    afresh for each distinct B block, so a forged result among many is caught with exactly the
    probability ``freivalds`` gives it alone, and a failed batch names its bad products with no
    second pass (no bisection to do). What the batch shares is work: ``B R`` once per B block,
    however many products read it, and one GEMM ``A [B_1 R_1 | B_2 R_2 | ...]`` per A block for
    all the products that read it, ``rounds`` columns each. A skinny GEMM is bound by reading A;
    a wide one reads A once for all its columns (bench/bench_verify.py, batched table). Two
    products of the same A and B blocks (copies of one tile) share the same columns.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    a_keys, b_keys = _keys(products)
    for which, keys in (("A", a_keys), ("B", b_keys)):
        first: dict[Hashable, torch.Tensor] = {}
        for p, key in zip(products, keys, strict=True):
            t = p.a if which == "A" else p.b
            held = first.setdefault(key, t)
            if held is not t and not _same_view(held, t):
                raise ValueError(f"products under {which} key {key!r} do not read the same block")
    shared = _Shared(a_keys, b_keys)
    verdicts: list[Verdict | None] = [None] * len(products)
    pending: list[_Pending] = []
    # Small products of one shape and dtypes are checked stacked (``_stacked``): one call per
    # step for all of them. The rest, one by one, sharing B R and each A block's pass.
    stacks: dict[tuple[int, int, int, torch.dtype, torch.dtype, torch.dtype | None], list[int]] = {}
    alone: list[int] = []
    for i, p in enumerate(products):
        structural = structure(p)
        if structural is not None:
            verdicts[i] = structural
            continue
        (m, k), n = p.a.shape, p.b.shape[1]
        if m * k + k * n + m * n <= stack_below:
            key = (m, k, n, p.a.dtype, p.compute_dtype, p.rounded_to)
            stacks.setdefault(key, []).append(i)
        else:
            alone.append(i)
    for members in stacks.values():
        if len(members) == 1:
            alone.extend(members)
            continue
        for i, verdict in zip(
            members, _stacked([products[i] for i in members], [b_keys[i] for i in members], rng, rounds), strict=True
        ):
            verdicts[i] = verdict
    for i in sorted(alone):
        p = products[i]
        screened = _screen(p, shared, i)
        if isinstance(screened, Verdict):
            verdicts[i] = screened
        else:
            screened.index = i
            pending.append(screened)
    vectors: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}  # b key -> (R, B R)
    for q in pending:
        bk = b_keys[q.index]
        if bk not in vectors:
            r = random_vectors(q.b.shape[1], rounds, rng).to(q.a.dtype)
            vectors[bk] = (r, q.b @ r)
    groups: dict[Hashable, list[_Pending]] = {}
    for q in pending:
        groups.setdefault(a_keys[q.index], []).append(q)
    for group in groups.values():
        columns: dict[Hashable, int] = {}  # b key -> its first column in the stacked product
        for q in group:
            columns.setdefault(b_keys[q.index], len(columns) * rounds)
        products_of = [vectors[bk][1] for bk in columns]
        stacked = products_of[0] if len(products_of) == 1 else torch.cat(products_of, dim=1)
        product = group[0].a @ stacked  # (m, rounds x distinct B blocks): A read once
        for q in group:
            bk = b_keys[q.index]
            first_column = columns[bk]
            residual = product[:, first_column : first_column + rounds] - q.c @ vectors[bk][0]
            verdicts[q.index] = _judge(q, residual.abs_())
    done = [v for v in verdicts if v is not None]
    if len(done) != len(products):  # every product is screened out or judged: a bug otherwise
        raise RuntimeError(f"freivalds_batch judged {len(done)} of {len(products)} products")
    return done


@dataclass(frozen=True, eq=False)
class Band:
    """Results that together make rows of one product ``A @ B``, checked as one.

    Each of ``products`` is a tile of those rows (all of them), reading ``A[rows, k0:k1]`` and
    ``B[k0:k1, cols]``, and has its own secret vectors ``vectors[i]`` (``cols x rounds``, drawn
    per tile position of the GEMM: ``random_vectors``), so that for an honest set
    ``sum_i C_i R_i = sum_K A[rows, K] BR_K`` where ``expected`` holds, for each reduction range
    ``K = (k0, k1)`` of the tiles, ``BR_K = sum of B[K, cols_i] R_i`` over the tile positions of
    that range. ``BR_K`` are the GEMM's (B is read once for every band), ``a`` is the band's rows
    of A over the whole reduction (read once per band), and each result is read once.

    Vectors are never shared by two tiles of a band: errors of two results cannot cancel in its
    residual (split-K partials of the same columns included). Each product keeps its own ``a``,
    ``b`` and cached norms: its screen (shape, dtype, NaN, rows too large to be honest) and its
    tolerance are its own, and so is its check when the band fails."""

    a: torch.Tensor
    vectors: Sequence[torch.Tensor]
    expected: Sequence[tuple[int, int, torch.Tensor]]
    products: Sequence[Product]


def freivalds_band(band: Band, rng: np.random.Generator, *, rounds: int = ROUNDS) -> tuple[bool, list[Verdict]]:
    """Check a band of results at once; when that fails, check each result alone.

    Row i's residual for one round is ``sum_t e_ti . r_t`` over the band's results, each
    result's row error ``e_ti`` against vectors ``r_t`` drawn for its tile alone and never seen
    by a device. Conditioned on every other term, Ball's bound holds for each one, so a result
    with a row error of ``GAMMA`` times the band row's tolerance passes with probability at
    most ``acceptance_bound()``, whatever the other results hold. The band row's tolerance is
    the results' own tolerances (``tolerance``, each of its tile) added in quadrature, as honest
    roundings add: ``sqrt(T)`` times one tile's for ``T`` like tiles (docs/security.md, "Checks
    by band").

    A result that fails its screen (shape, dtype, NaN, a row too large to be honest), or a band
    whose residual exceeds its tolerance, sends every result of the band to ``freivalds_batch``
    with fresh vectors from ``rng``: only the bad ones are rejected. Returns whether the band
    check ran and passed, and one verdict per product, in order.
    """
    products = list(band.products)
    if len(band.vectors) != len(products):
        raise ValueError(f"{len(band.vectors)} vector sets for {len(products)} products")
    if not products:
        return True, []
    m = band.a.shape[0]
    if m == 0:  # no rows: every product is empty (``structure`` says how)
        return False, freivalds_batch(products, rng, rounds=rounds)
    first = products[0]
    work = _work_dtype(first.a.dtype)
    acc = torch.zeros(m, band.vectors[0].shape[1], dtype=work)
    tol_sq = np.zeros(m)
    # Each result's screen and tolerance as a check of it alone has them (``_screen``), half
    # operands converted and their norms taken once per block key.
    shared = _Shared(*_keys(products))
    clean = True
    empty: list[Verdict] = []  # the screens of empty products (nothing to add)
    for i, (p, r) in enumerate(zip(products, band.vectors, strict=True)):
        if p.a.dtype != first.a.dtype or p.compute_dtype != first.compute_dtype or p.rounded_to != first.rounded_to:
            raise ValueError("a band's products must share dtypes")
        screened = _screen(p, shared, i)
        if isinstance(screened, Verdict):
            if not screened.ok:
                clean = False
                break
            empty.append(screened)
            continue  # an empty product: nothing to add
        if p.c.shape[0] != m or r.shape[0] != p.c.shape[1]:
            raise ValueError(f"a product of shape {tuple(p.c.shape)} does not fit the band's vectors {tuple(r.shape)}")
        acc.addmm_(screened.c, r.to(work))
        tol_sq += screened.tol.astype(np.float64) ** 2
    if clean and len(empty) == len(products):  # every product empty, each passed its screen
        return True, empty
    if clean:
        a = band.a if band.a.dtype == work else band.a.to(work)
        spans = [(k0, k1) for k0, k1, _ in band.expected]
        if (
            spans
            and spans[0][0] == 0
            and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
            and spans[-1][1] == a.shape[1]
        ):
            # The ranges tile the reduction: one pass.
            expected: torch.Tensor | int = a @ torch.cat([br for _, _, br in band.expected])
        else:
            expected = sum(a[:, k0:k1] @ br for k0, k1, br in band.expected)
        residual = torch.as_tensor(expected).sub(acc).abs_().amax(dim=1).numpy()
        verdict = _verdict(acc, residual / (np.sqrt(tol_sq) * R_RMS))
        if verdict.ok:
            return True, [verdict] * len(products)
    return False, freivalds_batch(products, rng, rounds=rounds)


_OWN = object()  # the key of an unkeyed product's blocks, paired with its index: shared with nothing


def _keys(products: Sequence[Product]) -> tuple[list[Hashable], list[Hashable]]:
    """Each product's A and B block keys: an unkeyed product's block is its own; products under
    one key must read one block (``freivalds_batch`` checks that)."""
    return (
        [p.a_key if p.a_key is not None else (_OWN, i) for i, p in enumerate(products)],
        [p.b_key if p.b_key is not None else (_OWN, i) for i, p in enumerate(products)],
    )


def _same_view(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Do two tensors read the very same memory the same way (hence hold the same values)?"""
    return (
        x.data_ptr() == y.data_ptr()
        and x.shape == y.shape
        and x.stride() == y.stride()
        and x.dtype == y.dtype
        and x.device == y.device
    )
