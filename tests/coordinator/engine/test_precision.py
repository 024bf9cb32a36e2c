"""Mixed precision through real clients: bf16 weights, fp16 autocast with a loss scaler, bf16
autocast. Every run finishes, no honest tile is rejected (fp16's small gradients included), and
the losses stay near plain torch's in the same mode (docs/cli.md has the long-run figures)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from procs import Coordinator, join, local_losses
from test_core import Fleet

from cleave.coordinator.engine import report
from cleave.coordinator.engine.core import Core
from cleave.coordinator.engine.limits import TrustPolicy
from cleave.coordinator.planning.tiles import GemmKind, TilePlan, TilingPolicy, assemble, plan_gemm
from cleave.db.memory import MemoryStore

STEPS = 8
NEAR = {"bf16": 2e-2, "fp16": 1e-3, "autocast": 1e-3}  # relative, per step, over these few steps


@pytest.mark.drill
@pytest.mark.parametrize("precision, parts", [("bf16", 1), ("fp16", 1), ("autocast", 1), ("fp16", 4)])
def test_a_mixed_precision_job_finishes_with_honest_tiles_and_near_local_losses(
    precision: str, parts: int, tmp_path: Path
) -> None:
    """``parts`` 4: the micro-batches run at once, each scaled by the one loss scaler."""
    micro = ("--micro-batches", str(parts))
    coord = Coordinator(tmp_path, "--precision", precision, "--min-devices", "2", *micro, steps=STEPS)
    clients = [join(coord.url, f"{precision}-{i}") for i in range(2)]
    want = local_losses(STEPS, precision=precision, micro_batches=parts)  # plain torch, while the clients start
    assert coord.wait() == 0, coord.output
    assert [c.wait() for c in clients] == [0, 0]
    got = coord.losses()
    assert len(got) == STEPS and all(g == g for g in got)
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= NEAR[precision] * abs(w), f"{precision} step {step}: {g} vs local {w}"
    assert coord.query("SELECT COUNT(*) FROM leases WHERE outcome = 'rejected'") == [(0,)]
    assert coord.query("SELECT COUNT(*) FROM tiles WHERE state != 'verified'") == [(0,)]
    done = dict(coord.query("SELECT name, tiles_done FROM devices"))  # the half tiles reached the clients
    assert len(done) == 2 and all(n > 0 for n in done.values()), done


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_k_partials_of_half_tiles_are_summed_in_float32_and_rounded_once(dtype: torch.dtype) -> None:
    a, b = torch.randn(64, 4096).to(dtype), torch.randn(4096, 32).to(dtype)
    plan = plan_gemm(
        64, 32, 4096, GemmKind.GRAD_WEIGHT, 4, TilingPolicy(max_edge=64, min_edge=16, min_k=256, min_tile_flops=1)
    )
    assert isinstance(plan, TilePlan) and max(t.p for t in plan.tiles) >= 3  # several partials a block
    parts = {
        t.index: (a[t.r0 : t.r1, t.k0 : t.k1].float() @ b[t.k0 : t.k1, t.c0 : t.c1].float()).to(dtype)
        for t in plan.tiles
    }  # each partial rounded once, as a device returns it
    exact = a.double() @ b.double()
    ours = assemble(plan, parts, dtype).double()
    naive = torch.zeros(64, 32, dtype=dtype)
    for t in plan.tiles:  # what summing in the half dtype would give
        naive[t.r0 : t.r1, t.c0 : t.c1] += parts[t.index]
    assert (ours - exact).abs().mean() < (naive.double() - exact).abs().mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bands", [False, True])  # each result alone; a row band at a time
def test_forged_half_tiles_of_a_half_precision_job_are_rejected(dtype: torch.dtype, bands: bool) -> None:
    """A bf16 job's tiles are checked against one rounding of a float32 sum, not against bf16
    products: a result of zeros, negated or random fails; the honest one passes."""

    def forgery(kind: str):  # noqa: ANN202
        def compute(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            honest = (a.float() @ b.float()).to(a.dtype)
            return {
                "zeros": torch.zeros_like(honest),
                "negated": -honest,
                "random": torch.randn_like(honest.float()).to(a.dtype) * honest.float().std().to(a.dtype),
            }[kind]

        return compute

    for kind in ("zeros", "negated", "random"):
        store = MemoryStore()
        core = Core(
            store,
            store.create_job("t", {}, 1, 0.0),
            join_token="tok",
            operator_token="op",
            rng=np.random.default_rng(),
            policy=TilingPolicy(max_edge=64, min_edge=16, min_k=1024, min_tile_flops=1),
            trust=TrustPolicy(probation_tiles=0, first_slots=8),
            band_checks=bands,
        )
        fleet = Fleet(core)
        liar = fleet.join("liar", compute=forgery(kind), slots=1)
        a, b = torch.randn(64, 1024).to(dtype), torch.randn(1024, 64).to(dtype)
        box: dict = {}
        _, out = core.submit(a, b, GemmKind.FORWARD, fleet.now, lambda c: box.setdefault("c", c))  # noqa: B023
        fleet.route(out)
        assert fleet.step(only=liar)
        if not bands:  # judged at once; by band, once the honest device has completed its band
            assert report.status(core, fleet.now)["tiles"]["rejected"] == 1, kind
        fleet.join("honest", slots=1)
        fleet.drain()
        torch.testing.assert_close(box["c"].float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1)
        assert report.status(core, fleet.now)["tiles"]["rejected"] >= 1
