"""``--wire-dtype bf16|fp16``: float32 jobs whose GEMM operands and results travel in half
precision. Opt-in and not exact: it halves the bytes, keeps every honest result verified, and its
losses stay near plain torch's (docs/cli.md has the measured drift)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from procs import Coordinator, join, local_losses

from cleave.client import kernels
from cleave.coordinator.engine.gemms import check_finite
from cleave.coordinator.net.remote import RemoteEngine
from cleave.coordinator.planning.planner import Kind
from cleave.coordinator.planning.tiles import GemmKind
from cleave.coordinator.training.linear import GemmRequest
from cleave.wire.messages import WireDtype
from cleave.wire.verify import freivalds
from tests.coordinator.engine.test_live_plan import Fleet, make_core

STEPS = 6


def _job(tmp: Path, wire: str) -> tuple[list[dict], int]:
    tmp.mkdir()
    coord = Coordinator(tmp, "--min-devices", "2", "--wire-dtype", wire, steps=STEPS, planner="uniform")
    clients = [join(coord.url, f"c{i}") for i in range(2)]
    assert coord.wait() == 0, coord.output
    assert all(c.wait() == 0 for c in clients)
    rejected = coord.query("SELECT COUNT(*) FROM leases WHERE outcome = 'rejected'")[0][0]
    return coord.rows(), rejected


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The float32-wire job both half-precision wires are compared with: run once."""
    rows, _ = _job(tmp_path_factory.mktemp("exact") / "fp32", "fp32")
    return rows


@pytest.mark.drill
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_a_half_precision_wire_halves_the_bytes_and_stays_near_plain_torch(
    tmp_path: Path, wire: str, exact: list[dict]
) -> None:
    half, rejected = _job(tmp_path / wire, wire)
    assert rejected == 0  # every honest half-precision result verified
    local = local_losses(STEPS)
    for row, want in zip(half, local, strict=True):
        assert abs(row["loss"] - want) <= 2e-2 * abs(want)  # rounded operands: near, not equal
    assert any(row["loss"] != want for row, want in zip(half, local))
    down = half[-1]["mb_down"] / exact[-1]["mb_down"]
    up = half[-1]["mb_up"] / exact[-1]["mb_up"]
    assert 0.4 < down < 0.6 and 0.4 < up < 0.6, (down, up)


def test_fp16_results_of_tiny_gradients_pass_and_forgeries_still_fail() -> None:
    """Below fp16's normal range a result's rounding is absolute (half of 2^-24): the bound
    allows it, so small gradients never get an honest device rejected; a real error still fails."""
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(128, 192, generator=gen) * 1e-3).half()
    b = (torch.randn(192, 64, generator=gen) * 1e-3).half()
    c = (a.float() @ b.float()).half()  # entries ~1e-5: subnormal in fp16
    assert freivalds(a, b, c, rng, compute_dtype=torch.float16).ok
    forged = c.clone()
    forged[5, 7] += 1e-3  # far above any rounding of this product
    assert not freivalds(a, b, forged, rng, compute_dtype=torch.float16).ok


def test_values_beyond_fp16_fail_with_a_clear_error_before_any_tile_goes_out() -> None:
    big = torch.full((4, 4), 1e5).half()  # inf in fp16
    with pytest.raises(FloatingPointError, match="once cast to fp16 for the wire.*--wire-dtype bf16"):
        check_finite(big, torch.ones(4, 4).half(), GemmKind.FORWARD, "fp16")


def test_each_tensor_is_cast_once_a_step_and_its_views_share_the_copy() -> None:
    engine = RemoteEngine(server=None, loop=None, wire=WireDtype.BF16)  # type: ignore[arg-type]  # casts only
    x = torch.randn(64, 32)
    whole, rows, cols_t = (
        engine._cast(x, torch.bfloat16),
        engine._cast(x[16:48], torch.bfloat16),
        engine._cast(x.t(), torch.bfloat16),
    )
    assert (
        whole.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr() == cols_t.untyped_storage().data_ptr()
    )
    torch.testing.assert_close(rows, x[16:48].bfloat16())
    torch.testing.assert_close(cols_t, x.t().bfloat16())
    x.add_(1.0)  # an in-place change (an optimizer step): a new copy, not a stale one
    torch.testing.assert_close(engine._cast(x, torch.bfloat16), x.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_client_returns_half_tiles_computed_as_float32_rounded_once_or_natively(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 96, generator=gen).to(dtype), torch.randn(96, 32, generator=gen).to(dtype)
    c, seconds = kernels.matmul(a, b, torch.device("cpu"))
    assert c.dtype == dtype and seconds >= 0
    want = (a.float() @ b.float()).to(dtype)
    if kernels.half_is_fast(torch.device("cpu"), dtype):
        torch.testing.assert_close(c, a @ b)
    else:
        assert torch.equal(c, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_wire_bound_tolerates_one_rounding_and_catches_a_row_off_by_a_third(dtype: torch.dtype) -> None:
    """Summed in float32 and rounded once: only that rounding is tolerated. The bound for work
    done in half precision throughout (compute_dtype=dtype) would let this forgery through."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    for m, k, n in ((128, 512, 128), (384, 2048, 128), (128, 64, 512)):
        a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
        for c in (a @ b, (a.float() @ b.float()).to(dtype)):  # native and upcast: both honest
            verdict = freivalds(a, b, c, rng, compute_dtype=torch.float32, rounded_to=dtype)
            assert verdict.ok and verdict.worst_ratio < 0.5
        forged = (a.float() @ b.float()).to(dtype)
        forged[3] += (forged[3].float().norm() / 3 / n**0.5).to(dtype)  # row 3 off by a third of its norm
        assert not freivalds(a, b, forged, rng, compute_dtype=torch.float32, rounded_to=dtype).ok
    if dtype == torch.bfloat16:
        assert freivalds(a, b, forged, rng, compute_dtype=dtype).ok  # what the loose bound allows


def test_slices_detached_from_one_storage_get_copies_of_their_own() -> None:
    engine = RemoteEngine(server=None, loop=None, wire=WireDtype.BF16)  # type: ignore[arg-type]  # casts only
    big = torch.randn(8, 16)
    first, second = big[2:6].detach(), big[4:8].detach()  # same storage and shape, other offsets
    torch.testing.assert_close(engine._cast(first, torch.bfloat16), first.bfloat16())
    torch.testing.assert_close(engine._cast(second, torch.bfloat16), second.bfloat16())


def test_an_fp16_gemm_whose_products_could_overflow_travels_exact() -> None:
    engine = RemoteEngine(server=None, loop=None, wire=WireDtype.FP16)  # type: ignore[arg-type]
    small = GemmRequest(torch.randn(64, 32), torch.randn(32, 16), GemmKind.FORWARD)
    assert engine._wire_for(small) == torch.float16
    large = GemmRequest(torch.full((64, 1024), 100.0), torch.ones(1024, 16), GemmKind.FORWARD)  # |C| = 102,400
    assert engine._wire_for(large) is None  # in float32: honest devices never return Inf
    assert RemoteEngine(None, None, WireDtype.BF16)._wire_for(large) == torch.bfloat16  # type: ignore[arg-type]


def test_a_gemm_kept_on_the_coordinator_is_computed_as_the_engine_says() -> None:
    """RemoteEngine passes the float32 originals' product as ``kept``: a wire GEMM the planner
    keeps on the PS is then exact, not the rounded operands' product."""
    core = make_core(frozenset({Kind.LOCAL}))
    fleet = Fleet(core)
    fleet.join("d")
    a, b = torch.randn(192, 256), torch.randn(256, 160)
    exact = a.double() @ b.double()  # stands for the originals' product: distinguishable from a @ b
    box: dict = {}
    _, out = core.submit(a, b, GemmKind.FORWARD, fleet.now, lambda c: box.setdefault("c", c), kept=lambda: exact)
    fleet.route(out)
    fleet.drain()
    assert core.prediction.kinds == {"local": 1} and not fleet.computed
    assert box["c"] is exact


class _RecordingLoop:
    """Stands for the event loop: records what RemoteEngine submits, answers nothing."""

    def __init__(self) -> None:
        self.submitted: list[GemmRequest] = []

    def call_soon_threadsafe(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        self.submitted.extend(fn.args[0])  # functools.partial(server.submit, requests, ...)


def test_a_deferred_dw_and_the_dx_after_it_share_one_cast_of_dy() -> None:
    """Backward defers dW before it runs dX: dY's copy must outlive dW's submission, or dX
    casts it again (new blocks on the wire, and a retained source no dW ever releases)."""
    loop = _RecordingLoop()
    engine = RemoteEngine(
        server=type("S", (), {"submit": lambda *a, **k: None})(),
        loop=loop,  # type: ignore[arg-type]
        wire=WireDtype.BF16,
    )
    x, dy, w = torch.randn(64, 32), torch.randn(64, 48), torch.randn(48, 32)
    engine.defer(GemmRequest(dy.t(), x, GemmKind.GRAD_WEIGHT), torch.nn.Parameter(torch.zeros(48, 32)))
    engine._submit([GemmRequest(dy, w, GemmKind.GRAD_INPUT)], deferred=False)
    dw, dx = loop.submitted
    assert dw.a.untyped_storage().data_ptr() == dx.a.untyped_storage().data_ptr()
    # dW was the last reader of X and dY: their copies go after dX; W's stays for the step.
    assert [base for base, _ in engine._casts.values()] == [w]


def test_a_loss_scalers_overflow_is_multiplied_here_not_sent_nor_fatal() -> None:
    """fp16 with a loss scaler: a scaled gradient that overflowed reaches a GEMM as Inf. Torch
    would multiply it and the scaler would skip the step; sent out, honest devices' Inf results
    would fail verification. Without a scaler the same input stops the job (it diverged)."""
    loop = _RecordingLoop()
    engine = RemoteEngine(
        server=type("S", (), {"submit": lambda *a, **k: None})(),
        loop=loop,  # type: ignore[arg-type]
        wire=WireDtype.FP32,
    )
    dy = torch.full((8, 4), float("inf"), dtype=torch.float16)
    w = torch.ones(4, 6, dtype=torch.float16)
    ok = GemmRequest(torch.ones(8, 4, dtype=torch.float16), w, GemmKind.FORWARD)
    with pytest.raises(FloatingPointError):
        engine._submit([GemmRequest(dy, w, GemmKind.GRAD_INPUT)], deferred=False)
    engine.overflow_here = True
    overflow, normal = engine._submit([GemmRequest(dy, w, GemmKind.GRAD_INPUT), ok], deferred=False)
    assert torch.isinf(overflow.result()()).all()
    assert loop.submitted == [ok] and not normal.done()  # only the finite GEMM went to the devices


def test_an_fp16_gemm_whose_finite_products_would_overflow_is_multiplied_here() -> None:
    loop = _RecordingLoop()
    engine = RemoteEngine(
        server=type("S", (), {"submit": lambda *a, **k: None})(),
        loop=loop,  # type: ignore[arg-type]
        wire=WireDtype.FP32,
    )
    big = GemmRequest(
        torch.full((4, 512), 300.0, dtype=torch.float16), torch.ones(512, 4, dtype=torch.float16), GemmKind.GRAD_WEIGHT
    )  # finite inputs, products 153,600 > fp16's 65,504
    (product,) = engine._submit([big], deferred=False)
    assert torch.isinf(product.result()()).all() and loop.submitted == []  # as torch gives, nothing sent
