"""Freivalds' check: honest products pass, corrupted and forged ones fail, at a fraction of the GEMM's cost."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from forgeries import (
    FORGERIES,
    NON_FINITE,
    SCALABLE,
    HonestWithinTolerance,
    error_ratio,
    forge_nan,
    forge_pair,
    forge_scaled,
    forge_swap_rows,
    single_round_rademacher,
)

from cleave.coordinator.planning.tiles import GemmKind, TilingPolicy, a_block, b_block, plan_gemm
from cleave.coordinator.training.loop import TrainConfig, Trainer
from cleave.wire.verify import (
    GAMMA,
    ROUNDS,
    STACK_BELOW,
    TARGET_BOUND,
    Band,
    Product,
    acceptance_bound,
    detection_threshold,
    freivalds,
    freivalds_band,
    freivalds_batch,
    rademacher,
    random_vectors,
    round_bound,
    tolerance,
)

SHAPES = [(1, 1, 1), (3, 1000, 7), (512, 384, 512), (2048, 64, 128), (64, 4096, 64), (384, 2048, 384)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("mean", [0.0, 1.0])  # zero-mean and strongly correlated operands
def test_honest_products_pass_and_single_corrupted_elements_fail(m: int, k: int, n: int, mean: float) -> None:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    for _ in range(5):
        a = torch.randn(m, k) * 3 + mean
        b = torch.randn(k, n) * 0.1 + mean * 0.1
        c = a @ b
        verdict = freivalds(a, b, c, rng)
        assert verdict.ok, verdict.reason
        assert verdict.worst_ratio < 0.5  # a wide margin, not a near miss
        bad = c.clone()
        bad[m // 2, n // 2] += 1e-2 * float(c.pow(2).mean().sqrt())
        assert not freivalds(a, b, bad, rng).ok


def test_every_kind_of_corruption_is_caught() -> None:
    rng = np.random.default_rng(1)
    a, b = torch.randn(256, 128), torch.randn(128, 192)
    c = a @ b
    corruptions = {
        "zeros": torch.zeros_like(c),
        "noise": c + 1e-3 * torch.randn_like(c) * c.std(),
        "swapped rows": c[torch.randperm(256)],
        "scaled": c * 1.001,
        "transposed-ish": (b.t() @ a.t()).t().roll(1, 0),
        "nan": c.masked_fill(torch.rand_like(c) < 1e-4, float("nan")),
        "inflated": c + 1e6,  # inflating C must not loosen the tolerance
    }
    for name, bad in corruptions.items():
        assert not freivalds(a, b, bad, rng).ok, name


def test_wrong_shape_or_dtype_is_rejected_with_a_reason() -> None:
    rng = np.random.default_rng(2)
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    v = freivalds(a, b, torch.zeros(5, 4), rng)
    assert not v.ok and "shape" in v.reason
    v = freivalds(a, b, (a @ b).half(), rng)
    assert not v.ok and "dtype" in v.reason


def test_empty_products() -> None:
    rng = np.random.default_rng(3)
    assert freivalds(torch.randn(0, 3), torch.randn(3, 4), torch.zeros(0, 4), rng).ok
    assert freivalds(torch.randn(2, 0), torch.randn(0, 4), torch.zeros(2, 4), rng).ok
    assert not freivalds(torch.randn(2, 0), torch.randn(0, 4), torch.ones(2, 4), rng).ok


def test_no_false_rejects_on_real_training_tiles() -> None:
    """Every tile of a few real training steps (fwd, dX, dW), computed the way clients do."""
    rng = np.random.default_rng(4)
    worst = 0.0

    class CheckingEngine:
        def run(self, requests):  # noqa: ANN001, ANN202 - MatmulEngine
            outs = []
            for r in requests:
                plan = plan_gemm(r.a.shape[0], r.b.shape[1], r.a.shape[1], r.kind, 2, TilingPolicy())
                for t in plan.tiles:
                    a, b = a_block(r.a, t), b_block(r.b, t)
                    verdict = freivalds(a, b, a @ b, rng)
                    assert verdict.ok, (r.kind, verdict.reason)
                    nonlocal worst
                    worst = max(worst, verdict.worst_ratio)
                outs.append(r.a @ r.b)
            return outs

    Trainer(TrainConfig(steps=4), CheckingEngine()).run()
    # Over 1,000 steps of this model the worst was 0.22 (docs/security.md); 4 steps stay far below.
    assert worst < 0.25
    assert GemmKind.GRAD_WEIGHT.split_k


# --- soundness against forgers ---------------------------------------------------------------


def test_the_chosen_constants_bound_acceptance_of_a_forgery_by_2_to_the_minus_40() -> None:
    assert acceptance_bound(ROUNDS, GAMMA) <= TARGET_BOUND == 2.0**-40
    assert acceptance_bound(ROUNDS, GAMMA, n=4096) <= acceptance_bound(ROUNDS, GAMMA)  # n only loosens it
    assert acceptance_bound(ROUNDS, 1.5 * GAMMA) < acceptance_bound(ROUNDS, GAMMA)  # bigger errors: smaller
    assert acceptance_bound(ROUNDS - 4, GAMMA) > TARGET_BOUND  # the rounds are needed
    # Ball's bound for unit-variance uniform entries: P(|e.r| <= 2 tol) <= 2 sqrt(2/3) tol / ||e||.
    assert round_bound(GAMMA, 1) == pytest.approx(2 * math.sqrt(2 / 3) / GAMMA, rel=1e-5)
    assert round_bound(0.5, 64) == 1.0


def _operands(kind: str, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An honest tile: zero-mean operands, or correlated ones like activations times weights."""
    m, k, n = 96, 160, 128
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    if kind == "zero-mean":
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g) * 0.1
    else:
        a = torch.randn(m, k, generator=g) + torch.randn(1, k, generator=g) * 2  # shared direction
        b = torch.randn(k, n, generator=g) * 0.05 + 0.02
    return a, b, a @ b


@pytest.mark.parametrize("operands", ["zero-mean", "correlated"])
@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_every_forgery_past_the_detection_threshold_is_rejected_in_every_trial(name: str, operands: str) -> None:
    rng = np.random.default_rng(10)
    a, b, c = _operands(operands, rng)
    for magnitude in (1.5, 2.0):
        forged = FORGERIES[name](a, b, c, rng, magnitude)
        ratio = error_ratio(a, b, forged)
        if name in SCALABLE:
            assert magnitude * 0.9 <= ratio <= magnitude * 1.1, (name, ratio)
        else:
            assert ratio >= 1.5, (name, ratio)  # the generator made a real forgery, not an honest variant
        for _ in range(100):  # fresh vectors every time
            verdict = freivalds(a, b, forged, rng)
            assert not verdict.ok, (name, magnitude, verdict)
            if name in NON_FINITE:
                assert "NaN or Inf" in verdict.reason


def test_forgeries_that_would_be_honest_are_refused_by_the_generator() -> None:
    rng = np.random.default_rng(11)
    a = torch.randn(1, 32).repeat(8, 1)  # every row of C is the same: swapping two changes nothing
    b = torch.randn(32, 16)
    with pytest.raises(HonestWithinTolerance):
        forge_swap_rows(a, b, a @ b, rng, 1.0)


def test_a_paired_forgery_fools_one_rademacher_round_half_the_time_but_never_the_new_check() -> None:
    rng = np.random.default_rng(12)
    a, b, c = _operands("zero-mean", rng)
    old_passes = new_passes = 0
    for trial in range(200):
        forged = forge_pair(a, b, c, rng, 2.0 if trial % 2 else 1e4)  # whatever the size of u
        old_passes += single_round_rademacher(a, b, forged, rng).ok
        new_passes += freivalds(a, b, forged, rng).ok
    assert 0.3 <= old_passes / 200 <= 0.7
    assert new_passes == 0


@pytest.mark.parametrize("rounds", [1, 3])
def test_acceptance_below_the_threshold_stays_within_the_per_round_bound(rounds: int) -> None:
    """A pair at GAMMA/4 tolerances (below the threshold) passes sometimes, never more often than the bound allows."""
    rng = np.random.default_rng(13)
    a, b = torch.randn(24, 40, dtype=torch.float64), torch.randn(40, 32, dtype=torch.float64)
    c = a @ b
    trials, accepted = 3000, 0
    for _ in range(trials):
        forged = forge_pair(a, b, c, rng, 0.25)  # ||e|| = GAMMA/4 tol = Delta/4
        accepted += freivalds(a, b, forged, rng, rounds=rounds).ok
    bound = round_bound(GAMMA / 4, b.shape[1]) ** rounds
    rate = accepted / trials
    assert rate <= bound
    assert rate > 0  # errors this small are indistinguishable from rounding: some pass


def test_the_detection_threshold_is_gamma_tolerances() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 12)
    c = a @ b
    assert torch.allclose(detection_threshold(a, b, c), GAMMA * tolerance(a, b, c))


# --- honest products of other dtypes, and non-finite results ----------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # 1e-3: fp16 squares underflow to zero
def test_honest_half_precision_products_pass_with_their_own_eps(dtype: torch.dtype, scale: float) -> None:
    rng = np.random.default_rng(20)
    torch.manual_seed(20)
    for m, k, n in [(64, 256, 96), (128, 64, 128)]:
        for mean in (0.0, 1.0):
            a = ((torch.randn(m, k) + mean) * scale).to(dtype)
            b = ((torch.randn(k, n) + mean) * scale).to(dtype)
            c = a @ b
            # Norms a caller computed in the half dtype are not trusted (fp16 overflows, underflows).
            norms = torch.linalg.vector_norm(a, dim=1)
            for verdict in (
                freivalds(a, b, c, rng, compute_dtype=dtype),
                freivalds(a, b, c, rng, compute_dtype=dtype, a_row_norms=norms, b_norm=0.0),
            ):
                assert verdict.ok, verdict.reason
                assert verdict.worst_ratio < 0.25
            # Half-precision work has a loose threshold (Delta ~ ||A_i|| ||B||_F for bf16), but past it: caught.
            for forge in (forge_pair, forge_scaled):
                forged = forge(a, b, c, rng, 2.0)
                assert not freivalds(a, b, forged, rng, compute_dtype=dtype).ok
            assert not freivalds(a, b, forge_nan(a, b, c, rng, 1.0), rng, compute_dtype=dtype).ok


def test_honest_float32_products_of_various_shapes_never_fail_over_many_checks() -> None:
    rng = np.random.default_rng(21)
    torch.manual_seed(21)
    worst = 0.0
    for m, k, n in [(1, 512, 1), (200, 3, 300), (128, 1024, 64), (300, 300, 300), (33, 777, 65)]:
        for mean in (0.0, 1.0):
            a, b = torch.randn(m, k) + mean, torch.randn(k, n) * 0.02 + mean * 0.01
            c = a @ b
            for _ in range(20):
                verdict = freivalds(a, b, c, rng)
                assert verdict.ok, (m, k, n, verdict.reason)
                worst = max(worst, verdict.worst_ratio)
    assert worst < 0.25


def test_non_finite_results_are_rejected_however_they_are_placed() -> None:
    rng = np.random.default_rng(22)
    a, b = torch.randn(16, 8), torch.randn(8, 12)
    c = a @ b
    for value in (float("nan"), float("inf"), float("-inf")):
        for where in [(0, 0), (15, 11), (7, slice(None)), (slice(None), 3)]:
            bad = c.clone()
            bad[where] = value
            verdict = freivalds(a, b, bad, rng)
            assert not verdict.ok and "NaN or Inf" in verdict.reason
            assert verdict.worst_ratio == math.inf


def test_a_row_above_the_largest_honest_norm_is_rejected_without_the_products() -> None:
    rng = np.random.default_rng(23)
    a, b = torch.randn(16, 8), torch.randn(8, 12)
    bad = a @ b
    bad[5] *= 100
    verdict = freivalds(a, b, bad, rng)
    assert not verdict.ok and "row 5" in verdict.reason


def test_rademacher_vectors_are_plus_or_minus_one() -> None:
    r = rademacher(1000, np.random.default_rng(24))
    assert set(r.unique().tolist()) == {-1.0, 1.0}


# --- batched checks: many results, one pass over each operand block ----------------------------


def _device_share(
    rows: int = 2, cols: int = 3, m: int = 48, k: int = 160, n: int = 40, seed: int = 30
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[Product]]:
    """A device's share of one GEMM: ``rows`` row bands of A times ``cols`` column blocks of B,
    every tile an honest product, keyed by the blocks it reads."""
    g = torch.Generator().manual_seed(seed)
    a_blocks = [torch.randn(m, k, generator=g) + torch.randn(1, k, generator=g) for _ in range(rows)]
    b_blocks = [torch.randn(k, n, generator=g) * 0.05 + 0.01 for _ in range(cols)]
    products = [
        Product(a, b, a @ b, a_key=("a", i), b_key=("b", j))
        for i, a in enumerate(a_blocks)
        for j, b in enumerate(b_blocks)
    ]
    return a_blocks, b_blocks, products


# Small products of one shape are checked stacked (verify._stacked) unless stack_below is 0: every
# batch test runs both ways, so both paths keep the per-tile guarantees.
STACKED_OR_NOT = [0, STACK_BELOW]


def test_a_batch_of_one_is_the_single_check_draw_for_draw() -> None:
    a, b = torch.randn(40, 64), torch.randn(64, 24)
    c = a @ b
    c[3, 5] += 1e-3
    single = freivalds(a, b, c, np.random.default_rng(40))
    (batched,) = freivalds_batch([Product(a, b, c)], np.random.default_rng(40))
    assert batched.ok == single.ok
    assert batched.worst_ratio == pytest.approx(single.worst_ratio, rel=1e-5)


@pytest.mark.parametrize("stack_below", STACKED_OR_NOT)
def test_an_honest_batch_passes_with_the_single_checks_margin(stack_below: int) -> None:
    rng = np.random.default_rng(41)
    _, _, products = _device_share()
    for _ in range(20):
        verdicts = freivalds_batch(products, rng, stack_below=stack_below)
        assert all(v.ok for v in verdicts), [v.reason for v in verdicts]
        assert max(v.worst_ratio for v in verdicts) < 0.25


@pytest.mark.parametrize("name", sorted(FORGERIES))
@pytest.mark.parametrize("stack_below", STACKED_OR_NOT)
def test_a_forged_tile_inside_a_batch_is_rejected_alone(name: str, stack_below: int) -> None:
    rng = np.random.default_rng(42)
    _, _, products = _device_share()
    for victim in (0, 4):
        p = products[victim]
        forged = FORGERIES[name](p.a, p.b, p.c, rng, 1.5)
        batch = list(products)
        batch[victim] = Product(p.a, p.b, forged, a_key=p.a_key, b_key=p.b_key)
        for _ in range(30):  # fresh vectors every time
            verdicts = freivalds_batch(batch, rng, stack_below=stack_below)
            assert [v.ok for v in verdicts] == [i != victim for i in range(len(batch))], (name, victim)
            if name in NON_FINITE:
                assert "NaN or Inf" in verdicts[victim].reason


@pytest.mark.parametrize("stack_below", STACKED_OR_NOT)
def test_a_forged_tile_among_many_is_caught_as_often_as_alone(stack_below: int) -> None:
    """The per-tile bound holds in a batch: below the threshold (GAMMA/4 tolerances, one round)
    a forged tile beside 11 honest ones passes no more often than Ball's bound allows alone."""
    rng = np.random.default_rng(43)
    a_blocks, b_blocks, _ = _device_share(rows=3, cols=4, m=24, k=40, n=32)
    a_blocks, b_blocks = [a.double() for a in a_blocks], [b.double() for b in b_blocks]
    batch = [Product(a, b, a @ b, a_key=i, b_key=j) for i, a in enumerate(a_blocks) for j, b in enumerate(b_blocks)]
    victim = batch[5]
    a, b = victim.a, victim.b
    trials, accepted = 1000, 0  # about 30% accepted against a bound of 65%: a margin of 20 standard errors
    for _ in range(trials):
        forged = forge_pair(a, b, a @ b, rng, 0.25)
        batch[5] = Product(a, b, forged, a_key=victim.a_key, b_key=victim.b_key)
        verdicts = freivalds_batch(batch, rng, rounds=1, stack_below=stack_below)
        assert all(v.ok for i, v in enumerate(verdicts) if i != 5)
        accepted += verdicts[5].ok
    rate = accepted / trials
    assert 0 < rate <= round_bound(GAMMA / 4, b.shape[1])


@pytest.mark.parametrize("stack_below", STACKED_OR_NOT)
def test_a_batch_reports_screened_results_in_place_and_judges_the_rest(stack_below: int) -> None:
    rng = np.random.default_rng(44)
    _, _, products = _device_share(rows=1, cols=4)
    p0, p1, p2, p3 = products
    wrong_shape = Product(p1.a, p1.b, p1.c[:-1], a_key=p1.a_key, b_key=p1.b_key)
    with_nan = p2.c.clone()
    with_nan[0, 0] = float("nan")
    nan_result = Product(p2.a, p2.b, with_nan, a_key=p2.a_key, b_key=p2.b_key)
    verdicts = freivalds_batch([p0, wrong_shape, nan_result, p3], rng, stack_below=stack_below)
    assert [v.ok for v in verdicts] == [True, False, False, True]
    assert "shape" in verdicts[1].reason and "NaN or Inf" in verdicts[2].reason
    assert freivalds_batch([], rng) == []


@pytest.mark.parametrize("stack_below", STACKED_OR_NOT)
def test_copies_of_one_tile_share_their_columns_and_are_judged_apart(stack_below: int) -> None:
    rng = np.random.default_rng(45)
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    honest = a @ b
    forged = forge_scaled(a, b, honest, rng, 2.0)
    verdicts = freivalds_batch(
        [Product(a, b, honest, a_key="a", b_key="b"), Product(a, b, forged, a_key="a", b_key="b")],
        rng,
        stack_below=stack_below,
    )
    assert [v.ok for v in verdicts] == [True, False]


@pytest.mark.parametrize("stack_below", STACKED_OR_NOT)
def test_honest_half_precision_batches_pass_and_forged_ones_fail(stack_below: int) -> None:
    rng = np.random.default_rng(46)
    for dtype in (torch.bfloat16, torch.float16):
        a_blocks, b_blocks, _ = _device_share(rows=2, cols=2)
        a_blocks = [a.to(dtype) for a in a_blocks]
        b_blocks = [b.to(dtype) for b in b_blocks]
        batch = [
            Product(a, b, (a.float() @ b.float()).to(dtype), a_key=i, b_key=j, rounded_to=dtype)
            for i, a in enumerate(a_blocks)
            for j, b in enumerate(b_blocks)
        ]
        assert all(v.ok for v in freivalds_batch(batch, rng, stack_below=stack_below)), dtype
        p = batch[1]
        batch[1] = dataclasses.replace(p, c=forge_scaled(p.a, p.b, p.c, rng, 2.0))  # rounded_to kept
        assert [v.ok for v in freivalds_batch(batch, rng, stack_below=stack_below)] == [True, False, True, True]


def test_keys_that_name_blocks_of_different_shapes_are_a_caller_error() -> None:
    rng = np.random.default_rng(47)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    other = torch.randn(9, 16)
    with pytest.raises(ValueError, match="A key"):
        freivalds_batch([Product(a, b, a @ b, a_key="x"), Product(other, b, other @ b, a_key="x")], rng)
    # Two blocks of one shape under one key: refused, never checked against the wrong A.
    twin = torch.randn(8, 16)
    with pytest.raises(ValueError, match="same block"):
        freivalds_batch([Product(a, b, a @ b, a_key="x"), Product(twin, b, a @ b, a_key="x")], rng)
    # The same memory seen through two views is one block; an unkeyed product shares with no key.
    (ok1, ok2) = freivalds_batch([Product(a, b, a @ b, a_key="x"), Product(a.view(8, 16), b, a @ b, a_key="x")], rng)
    assert ok1.ok and ok2.ok
    forged = a @ b * 2
    verdicts = freivalds_batch([Product(a, b, a @ b, a_key=("own", 1)), Product(twin, b, forged)], rng)
    assert [v.ok for v in verdicts] == [True, False]
    with pytest.raises(ValueError, match="B key"):
        wide = torch.randn(16, 5)
        freivalds_batch([Product(a, b, a @ b, b_key="y"), Product(a, wide, a @ wide, b_key="y")], rng)
    with pytest.raises(ValueError, match="rounds"):
        freivalds_batch([Product(a, b, a @ b)], rng, rounds=0)


def test_small_tiles_are_checked_stacked_and_large_ones_alone_with_the_same_verdicts() -> None:
    """The stacked path (small products of one shape, one batched call a step) and the one by
    one path judge a mixed batch alike: honest results pass with the same margin, a forged one
    is rejected alone, whichever path its size sends it down."""
    rng = np.random.default_rng(47)
    small = [Product(a, b, a @ b) for a, b in ((torch.randn(16, 32), torch.randn(32, 16)) for _ in range(6))]
    big_a, big_b = torch.randn(256, 128), torch.randn(128, 256)
    big = Product(big_a, big_b, big_a @ big_b)
    assert 256 * 128 * 2 + 256 * 256 > STACK_BELOW >= 16 * 32 * 2 + 16 * 16
    for victim in (2, 6):
        batch = [*small, big]
        p = batch[victim]
        batch[victim] = Product(p.a, p.b, forge_scaled(p.a, p.b, p.c, rng, 2.0))
        for stack_below in STACKED_OR_NOT:
            verdicts = freivalds_batch(batch, rng, stack_below=stack_below)
            assert [v.ok for v in verdicts] == [i != victim for i in range(len(batch))], (victim, stack_below)
            assert max(v.worst_ratio for i, v in enumerate(verdicts) if i != victim) < 0.25


# --------------------------------------------------------------------------- checks by band


def _band(
    a: torch.Tensor, b: torch.Tensor, cols: int, pieces: int, rng: np.random.Generator
) -> tuple[Band, list[Product]]:
    """Rows ``a`` of ``a @ b`` cut into ``cols`` column tiles of ``pieces`` split-K partials each,
    every tile computed honestly, with its own vectors, as the engine hands them to ``freivalds_band``."""
    k, n = b.shape
    col_cuts = [n * j // cols for j in range(cols + 1)]
    k_cuts = [k * p // pieces for p in range(pieces + 1)]
    products, vectors = [], []
    expected = {(k_cuts[p], k_cuts[p + 1]): torch.zeros(k_cuts[p + 1] - k_cuts[p], ROUNDS) for p in range(pieces)}
    for j in range(cols):
        for p in range(pieces):
            (k0, k1), (c0, c1) = (k_cuts[p], k_cuts[p + 1]), (col_cuts[j], col_cuts[j + 1])
            ta, tb = a[:, k0:k1], b[k0:k1, c0:c1]
            r = random_vectors(c1 - c0, ROUNDS, rng)
            products.append(Product(ta, tb, ta @ tb))
            vectors.append(r)
            expected[(k0, k1)] += tb @ r
    return Band(a, vectors, [(k0, k1, br) for (k0, k1), br in sorted(expected.items())], products), products


def _with(band: Band, i: int, c: torch.Tensor) -> Band:
    products = list(band.products)
    products[i] = dataclasses.replace(products[i], c=c)
    return dataclasses.replace(band, products=products)


def test_a_band_of_empty_products_passes_unless_one_is_not_empty() -> None:
    """Found by the fuzzer: a GEMM with no output columns (n = 0) has bands of empty products,
    whose tolerance is 0: each passes on its screen, with no residual divided by it."""
    rng = np.random.default_rng(5)
    a = torch.randn(3, 4)
    band, products = _band(a, torch.randn(4, 0), 1, 2, rng)
    with np.errstate(all="raise"):
        passed, verdicts = freivalds_band(band, rng)
    assert passed and [v.ok for v in verdicts] == [True, True]
    bad = products[0].c.new_ones(3, 1)  # a result that claims a column the GEMM does not have
    passed, verdicts = freivalds_band(_with(band, 0, bad), rng)
    assert not passed and [v.ok for v in verdicts] == [False, True]


@pytest.mark.parametrize("cols,pieces", [(1, 1), (5, 1), (3, 4), (1, 6)])
@pytest.mark.parametrize("operands", ["zero-mean", "correlated"])
def test_an_honest_band_passes_as_one_with_the_single_checks_margin(cols: int, pieces: int, operands: str) -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        a, b, _ = _operands(operands, rng)
        band, _ = _band(a, b, cols, pieces, rng)
        passed, verdicts = freivalds_band(band, rng)
        assert passed and all(v.ok for v in verdicts)
        assert verdicts[0].worst_ratio < 0.25  # the single check's honest residuals reach 0.23 (docs/security.md)


@pytest.mark.parametrize("name", sorted(FORGERIES))
@pytest.mark.parametrize("cols,pieces", [(5, 1), (3, 2)])
def test_a_forged_tile_inside_a_band_fails_the_band_and_is_rejected_alone(name: str, cols: int, pieces: int) -> None:
    rng = np.random.default_rng(11)
    a, b, _ = _operands("zero-mean", rng)
    band, products = _band(a, b, cols, pieces, rng)
    # The band row's tolerance is its tiles' in quadrature: a forgery past the band's detection
    # threshold (1.5x) is caught, however small it is against the tile's own.
    whole = torch.stack([tolerance(p.a, p.b, p.c) for p in products]).square().sum(0).sqrt()
    for victim in (0, len(products) - 1):
        p = products[victim]
        scale = float((whole / tolerance(p.a, p.b, p.c)).max())
        forged = _with(band, victim, FORGERIES[name](p.a, p.b, p.c, rng, 1.5 * scale))
        for _ in range(10):  # fresh vectors for the fallback every time (the band's own R is fixed)
            passed, verdicts = freivalds_band(forged, rng)
            assert not passed, (name, victim)
            assert [v.ok for v in verdicts] == [i != victim for i in range(len(products))], (name, victim)


def test_a_band_catches_a_row_error_past_its_threshold_whatever_the_vectors() -> None:
    rng = np.random.default_rng(3)
    a, b, _ = _operands("correlated", rng)
    caught = 0
    for _ in range(200):
        band, products = _band(a, b, 4, 1, rng)  # new R every time: the bound is over the vectors
        threshold = GAMMA * torch.stack([tolerance(p.a, p.b, p.c) for p in products]).square().sum(0).sqrt()
        row = int(rng.integers(a.shape[0]))
        c = products[2].c.clone()
        direction = torch.from_numpy(rng.standard_normal(c.shape[1])).float()
        c[row] += 1.01 * float(threshold[row]) * direction / direction.norm()
        caught += not freivalds_band(_with(band, 2, c), rng)[0]
    assert caught == 200


def test_split_k_partials_whose_errors_cancel_are_caught_and_each_rejected() -> None:
    # Each tile has vectors of its own: +E in one partial and -E in another of the same columns
    # do not cancel in the residual (nor loosen its tolerance for a forgery beside them).
    rng = np.random.default_rng(5)
    a, b, _ = _operands("zero-mean", rng)
    band, products = _band(a, b, 1, 2, rng)
    error = products[0].c.roll(1, dims=1)  # as large as the partial itself, within the honest norm cap
    for _ in range(20):
        band, products = _band(a, b, 1, 2, rng)
        passed, verdicts = freivalds_band(_with(_with(band, 0, products[0].c + error), 1, products[1].c - error), rng)
        assert not passed and [v.ok for v in verdicts] == [False, False]


@pytest.mark.parametrize("cols,pieces", [(4, 1), (1, 4), (4, 4)])
def test_a_bands_tolerance_is_its_tiles_added_in_quadrature(cols: int, pieces: int) -> None:
    rng = np.random.default_rng(2)
    a, b, _ = _operands("correlated", rng)
    band, products = _band(a, b, cols, pieces, rng)
    tiles = torch.stack([tolerance(p.a, p.b, p.c) for p in products])
    ratio = (tiles.square().sum(0).sqrt() / tiles.max(0).values).median()
    assert float(ratio) == pytest.approx(math.sqrt(cols * pieces), rel=0.25)  # docs/security.md: sqrt(T)


@pytest.mark.parametrize("bad", ["nan", "shape", "dtype", "too large"])
def test_a_result_that_fails_its_screen_is_rejected_alone_and_the_rest_checked_alone(bad: str) -> None:
    rng = np.random.default_rng(9)
    a, b, _ = _operands("zero-mean", rng)
    band, products = _band(a, b, 3, 1, rng)
    c = products[1].c.clone()
    if bad == "nan":
        c[3, 3] = float("nan")
    elif bad == "shape":
        c = c[:, 1:]
    elif bad == "dtype":
        c = c.double()
    else:
        c[0] *= 1e6
    passed, verdicts = freivalds_band(_with(band, 1, c), rng)
    assert not passed and [v.ok for v in verdicts] == [True, False, True]
