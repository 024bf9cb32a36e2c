"""Freivalds' check: honest products pass, corrupted ones fail, at a fraction of the GEMM's cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.tiles import GemmKind, TilingPolicy, a_block, b_block, plan_gemm
from coordinator.training.loop import TrainConfig, Trainer
from coordinator.verify import freivalds

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
    assert worst < 0.5
    assert GemmKind.GRAD_WEIGHT.split_k
