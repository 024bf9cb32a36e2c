"""Tiling: plans partition the GEMM, and tiled products equal ``A @ B``."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cleave.coordinator.planning.tiles import (
    GemmKind,
    TilingPolicy,
    a_block,
    assemble,
    b_block,
    covers_exactly,
    even_cuts,
    plan_gemm,
    tiled_matmul,
    wire_layout,
)

AWKWARD = [(1, 1, 1), (1, 7, 1), (7, 1, 5), (5, 3, 1), (513, 257, 129), (1000, 3, 999), (0, 4, 4), (4, 0, 4), (4, 4, 0)]


def test_even_cuts_cover_range_without_empty_pieces() -> None:
    for size in range(0, 40):
        for parts in range(1, 12):
            cuts = even_cuts(size, parts)
            assert cuts[0] == 0 and cuts[-1] == size
            if size:
                assert all(b > a for a, b in zip(cuts, cuts[1:]))


@pytest.mark.parametrize("kind", list(GemmKind))
@pytest.mark.parametrize("m,k,n", AWKWARD)
def test_tiled_matmul_equals_dense_for_awkward_shapes(kind: GemmKind, m: int, k: int, n: int) -> None:
    policy = TilingPolicy(max_edge=128, min_edge=16, min_k=32, tiles_per_device=3, min_tile_flops=1)
    a, b = torch.randn(m, k), torch.randn(k, n)
    plan = plan_gemm(m, n, k, kind, devices=3, policy=policy)
    tiles = plan.tiles
    assert covers_exactly(plan, tiles)
    out = tiled_matmul(a, b, tiles, plan)
    torch.testing.assert_close(out, a @ b, rtol=1e-5, atol=1e-4)  # split-K sums reorder ~k terms


def test_output_tiles_keep_the_full_reduction_and_dw_splits_tokens() -> None:
    policy = TilingPolicy(max_edge=256, min_edge=64, min_k=128)
    fwd = plan_gemm(2048, 384, 384, GemmKind.FORWARD, devices=2, policy=policy)
    assert fwd.shape[2] == 1 and fwd.shape[0] * fwd.shape[1] >= 4
    dw = plan_gemm(384, 384, 2048, GemmKind.GRAD_WEIGHT, devices=2, policy=TilingPolicy(min_k=128))
    assert dw.shape[2] >= 2  # partial sums over token ranges
    assert all(t.k1 - t.k0 >= policy.min_k for t in dw.tiles)


def test_plans_respect_limits_on_random_shapes() -> None:
    rng = random.Random(7)
    policy = TilingPolicy()
    for _ in range(500):
        m, n, k = rng.randint(1, 5000), rng.randint(1, 5000), rng.randint(1, 5000)
        kind = rng.choice(list(GemmKind))
        devices = rng.randint(1, 64)
        plan = plan_gemm(m, n, k, kind, devices, policy)
        tiles = plan.tiles
        assert covers_exactly(plan, tiles)
        gr, gc, gk = plan.shape
        if kind.split_k:
            assert (m / gr) * (n / gc) <= policy.max_partial_elems
            assert gk >= math.ceil(k / policy.max_edge)
        else:
            assert all(t.r1 - t.r0 <= policy.max_edge and t.c1 - t.c0 <= policy.max_edge for t in tiles)
            assert gk == 1
        # Enough tiles for every device to prefetch, unless the GEMM is too small to cut further.
        want = min(devices * policy.tiles_per_device, int(2 * m * n * k // policy.min_tile_flops) or 1)
        if len(tiles) < want:
            assert kind.split_k or (n / gc < 2 * policy.min_edge and m / gr < 2 * policy.min_edge)


def test_token_cuts_line_up_across_forward_dx_and_dw() -> None:
    """dW's token pieces are exactly the rows of forward and dX: cached blocks serve all three."""
    policy = TilingPolicy()
    for tokens in (512, 2048, 3000, 8192):
        fwd = plan_gemm(tokens, 1152, 384, GemmKind.FORWARD, 2, policy)
        dx = plan_gemm(tokens, 384, 1152, GemmKind.GRAD_INPUT, 2, policy)
        dw = plan_gemm(1152, 384, tokens, GemmKind.GRAD_WEIGHT, 2, policy)
        if tokens >= 2 * policy.max_edge:
            assert fwd.row_cuts == dx.row_cuts == dw.k_cuts


def test_split_k_partials_are_summed_in_tile_order_whatever_the_arrival_order() -> None:
    a, b = torch.randn(64, 4096), torch.randn(4096, 32)
    plan = plan_gemm(64, 32, 4096, GemmKind.GRAD_WEIGHT, 4, TilingPolicy(min_k=256))
    parts = {t.index: a_block(a, t) @ b_block(b, t) for t in plan.tiles}
    forward = assemble(plan, parts)
    backward = assemble(plan, dict(reversed(list(parts.items()))))
    assert torch.equal(forward, backward)


def test_wire_layout_recognises_transposed_and_strided_slices() -> None:
    w = torch.randn(96, 64)
    assert wire_layout(w[10:20]) == "plain"
    assert wire_layout(w.t()[0:64, 0:32]) == "t"  # a block of W^T, as in the forward pass
    assert wire_layout(w[:, 0:10]) == "copy"
    assert wire_layout(w[:, 0:10].t()) == "copy_t"  # dW's A block, dY[k0:k1, r0:r1]^T


def test_invalid_policy_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError):
        TilingPolicy(max_edge=8, min_edge=16)
    with pytest.raises(ValueError):
        plan_gemm(-1, 2, 2, GemmKind.FORWARD, 1, TilingPolicy())
