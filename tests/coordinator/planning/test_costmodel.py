"""The cost model: hand-computed cases, and the pipeline's closed form against its recurrence."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cleave.coordinator.planning.costmodel import (
    IN_FLIGHT,
    LOOP_COSTS,
    CostModelError,
    LoopCosts,
    Profile,
    PSProfile,
    Stage,
    Unit,
    batch_check_seconds,
    in_flight_memory,
    local_seconds,
    loop_seconds,
    output_egress_floor,
    output_tiles_egress_floor,
    pipeline,
    pipelined,
    ps_seconds,
    stage,
)


def test_a_unit_counts_its_bytes_flops_and_memory_by_hand() -> None:
    u = Unit(100, 200, 300, 4)  # C[100 x 200] = A[100 x 300] @ B[300 x 200], float32
    assert u.flops == 2 * 100 * 200 * 300 == 12_000_000
    assert u.a_bytes == 120_000 and u.b_bytes == 240_000
    assert u.down() == 360_000
    assert u.down(held_a=True) == 240_000 and u.down(held_b=True) == 120_000
    assert u.down(held_a=True, held_b=True) == 0
    assert u.up == 80_000  # the result is smaller than the inputs: 100 x 200
    assert u.memory == 440_000
    assert u.verify_flops() == 2 * 16 * (100 * 300 + 300 * 200 + 100 * 200)


def test_a_stage_divides_bytes_by_links_and_flops_by_the_dtype_rate() -> None:
    p = Profile({"fp32": 1.0, "bf16": 0.01}, memory=1 << 30, down=1e6, up=2e5, rtt=0.02, overhead=0.001)
    u = Unit(100, 200, 300, 4)
    s = stage(u, p, "fp32")
    assert s.down == pytest.approx(0.36)  # 360 kB at 1 MB/s
    assert s.compute == pytest.approx(0.012 + 0.001)  # 12 MFLOP at 1 GFLOP/s, plus overhead
    assert s.up == pytest.approx(0.4)  # 80 kB at 200 kB/s: a thin uplink dominates
    assert stage(u, p, "bf16").compute == pytest.approx(1.2 + 0.001)  # a slow dtype is priced as slow
    assert stage(u, p, "fp16").compute == math.inf  # and a missing one never runs
    assert stage(u, p, "fp32", down_bytes=0).down == 0


def test_the_pipeline_overlaps_stages_by_hand() -> None:
    # Three equal units of (1, 2, 3) s: the upload is the bottleneck, so 1 + 2 + 3 + 2 * 3.
    s = Stage(1, 2, 3)
    assert pipeline([s, s, s]) == 12
    assert pipelined(s, s, 3) == 12
    # Download-bound: the first compute waits for its download, the last upload follows.
    d = Stage(5, 1, 1)
    assert pipeline([d] * 4, rtt=0.5) == 4 * 5 + 1 + 1 + 0.5
    # A first unit that downloads blocks the others reuse.
    assert pipelined(Stage(10, 1, 1), Stage(0, 1, 1), 5) == 10 + 5 * 1 + 1
    assert pipelined(s, s, 0) == pipeline([]) == 0


finite = st.floats(min_value=0, max_value=1e3, allow_nan=False)
stages = st.builds(Stage, finite, finite, finite)


@settings(max_examples=300, deadline=None)
@given(stages, stages, st.integers(min_value=0, max_value=40), finite)
def test_the_closed_form_equals_the_flow_shop_recurrence(first: Stage, rest: Stage, count: int, rtt: float) -> None:
    units = ([first] + [rest] * (count - 1)) if count else []
    assert pipelined(first, rest, count, rtt) == pytest.approx(pipeline(units, rtt), rel=1e-9, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.lists(stages, min_size=1, max_size=20), stages)
def test_one_more_unit_never_finishes_sooner(units: list[Stage], extra: Stage) -> None:
    assert pipeline(units + [extra]) >= pipeline(units)


def test_output_tiles_cannot_send_less_than_the_square_bound() -> None:
    # 1024^3 in 4 square tiles of 512 x 512: each needs 1024 x (512 + 512) inputs, exactly the bound.
    floor = output_tiles_egress_floor(1024, 1024, 1024, 4, 4)
    assert floor == 2 * 4 * 1024 * math.sqrt(4 * 1024 * 1024)
    assert sum(Unit(512, 512, 1024, 4).down() for _ in range(4)) == pytest.approx(floor)
    # Any other cut of the same output into 4 tiles sends more: 4 row strips of 256 x 1024.
    assert 4 * Unit(256, 1024, 1024, 4).down() > floor


def test_the_equal_shares_floor_is_not_a_floor_for_unequal_shares() -> None:
    # 4 tiles of 512 x 512 shared 3 + 1: the 3-tile device needs an L of 2 row and 2 column blocks,
    # the other one tile; together less than 4 equal shares' 2 s k sqrt(4 m n).
    block = 512 * 1024 * 4
    sent = 4 * block + 2 * block
    assert sent < output_tiles_egress_floor(1024, 1024, 1024, 4, 4)
    # Summed over the actual shares, AM-GM still bounds it.
    floor = output_egress_floor(3 * 512 * 512, 1024, 4) + output_egress_floor(512 * 512, 1024, 4)
    assert floor <= sent
    equal = 4 * output_egress_floor(512 * 512, 1024, 4)
    assert output_tiles_egress_floor(1024, 1024, 1024, 4, 4) == pytest.approx(equal)


def test_a_device_needs_two_units_in_flight() -> None:
    assert IN_FLIGHT == 2
    assert in_flight_memory(0, 1000.0) == 0
    assert in_flight_memory(1, 1000.0) == 1000
    assert in_flight_memory(7, 1000.5) == 2001  # rounded up, and never more than two units


def test_the_default_ps_is_a_server_and_checking_costs_a_fraction_of_computing() -> None:
    ps = PSProfile()
    assert (ps.egress, ps.ingress) == (1.25e9, 1.25e9)  # 10 Gbit/s
    assert dict(ps.gflops) == {"fp32": 1000.0, "bf16": 1000.0, "fp16": 1000.0}
    assert (ps.verify_flops, ps.unit_overhead, ps.memory_bw) == (200e9, 2e-4, 10e9)
    # Checking a 512-class tile on the PS costs 16 (1000 / 200) (3 / 512) = 0.47 of multiplying it
    # there; with the old 5 GFLOP/s it cost 320 (3 / 512) = 1.9 times as much, and 0.68 of
    # example 1's GEMM (docs/cost-model.md), which kept almost every GEMM of small presets local.
    tile = Unit(512, 512, 512)
    ratio = tile.verify_flops() / ps.verify_flops / local_seconds(512, 512, 512, "fp32", ps)
    assert ratio == pytest.approx(80 * 3 / 512)
    assert ratio < 0.5


def test_ps_work_and_local_gemms_by_hand() -> None:
    ps = PSProfile(egress=1e9, ingress=1e9, gflops={"fp32": 10.0}, verify_flops=1e9, unit_overhead=1e-3, memory_bw=1e9)
    # 10 units, 2 GFLOP of checks, 100 MB of output and 50 MB of partials to add (read + write).
    assert ps_seconds(10, 2e9, 50e6, 100e6, ps) == pytest.approx(0.01 + 2.0 + 0.1 + 0.1)
    assert local_seconds(1000, 1000, 1000, "fp32", ps) == pytest.approx(2e9 / 10e9)
    assert local_seconds(10, 10, 10, "bf16", ps) == math.inf
    assert PSProfile.from_link(8.0).egress == 1e9


@pytest.mark.parametrize(
    "bad",
    [
        dict(gflops={"fp64": 1.0}),
        dict(gflops={"fp32": -1.0}),
        dict(down=0.0),
        dict(up=math.nan),
        dict(rtt=-1.0),
        dict(reliability=1.5),
        dict(session=0.0),
        dict(memory=-1),
    ],
)
def test_impossible_profiles_are_refused(bad: dict) -> None:
    fields = dict(gflops={"fp32": 1.0}, memory=1, down=1.0, up=1.0) | bad
    with pytest.raises(CostModelError):
        Profile(**fields)


def test_impossible_units_are_refused() -> None:
    with pytest.raises(CostModelError):
        Unit(0, 1, 1)
    with pytest.raises(CostModelError):
        PSProfile.from_link(0.0)


def test_the_compute_share_ceiling_is_what_the_links_allow() -> None:
    from cleave.coordinator.planning.costmodel import compute_share_ceiling

    # A phone: 75 GFLOP/s bf16, 10 MB/s down, 1.875 MB/s up, 2 GiB.
    phone = Profile({"bf16": 75.0}, 2 << 30, 10e6, 1.875e6)
    # 4,096 deep: every tile's result is 1/10 of its compute time on the way up (2 k up / s F).
    assert compute_share_ceiling(phone, "bf16", [(16384, 4096, 4096)], 2) == pytest.approx(4096 * 1.875e6 / 75e9)
    # The deepest GEMM of the step sets it; a GEMM deep enough makes the phone compute-bound.
    both = [(16384, 4096, 4096), (4096, 4096, 16384)]
    assert compute_share_ceiling(phone, "bf16", both, 2) == pytest.approx(16384 * 1.875e6 / 75e9)
    # 65,536 deep: the upload no longer binds, the held 4,096-wide block's download does...
    deep = [(4096, 4096, 65536)]
    assert compute_share_ceiling(phone, "bf16", deep, 2) == pytest.approx(2 * 4096 * 10e6 / (2 * 75e9))
    # ...and on a 100 MB/s downlink nothing does; a block too wide for memory is held narrower.
    fast = Profile({"bf16": 75.0}, 2 << 30, 100e6, 1.875e6)
    assert compute_share_ceiling(fast, "bf16", deep, 2) == 1.0
    assert compute_share_ceiling(fast, "bf16", [(4096, 4096, 1 << 23)], 2) == pytest.approx(
        2 * ((2 << 30) / (2 * (1 << 23))) * 100e6 / (2 * 75e9)
    )
    # A held block must fit in memory: a narrow one leaves the downlink binding.
    tiny = Profile({"bf16": 75.0}, 1 << 20, 10e6, 1e12)
    wide = (1 << 20) / (2 * 4096)  # rows of a 4,096-deep block that fit in 1 MiB
    assert compute_share_ceiling(tiny, "bf16", [(16384, 4096, 4096)], 2) == pytest.approx(2 * wide * 10e6 / (2 * 75e9))
    assert compute_share_ceiling(phone, "fp32", both, 4) == 0.0  # it cannot compute in fp32


def test_the_utilisation_bound_gives_the_work_to_the_slowest_devices_first() -> None:
    from cleave.coordinator.planning.costmodel import utilisation_bound

    # Two laptops at 5 GFLOP/s, two GPUs at 10 TFLOP/s, a 100 s step: 1 TFLOP of work keeps both
    # laptops busy the whole step (0.5 TFLOP each) and leaves the GPUs idle: a mean of 1/2.
    fleet = [(5e9, 1.0), (5e9, 1.0), (1e13, 1.0), (1e13, 1.0)]
    assert utilisation_bound(fleet, 1e12, 100.0) == pytest.approx(0.5)
    # Twice the work: the rest goes to a GPU (1 TFLOP of its 1 PFLOP in the step).
    assert utilisation_bound(fleet, 2e12, 100.0) == pytest.approx((2 + 1e12 / 1e15) / 4)
    # A laptop whose links let it compute half the time takes half as much.
    assert utilisation_bound([(5e9, 0.5), (5e9, 1.0)], 1e12, 100.0) == pytest.approx((0.5 + 1.0) / 2)
    assert utilisation_bound([], 1e12, 100.0) == 0.0 and utilisation_bound(fleet, 1e12, 0.0) == 0.0


def test_checks_are_priced_as_batches_meet_column_blocks() -> None:
    ps = PSProfile()
    assert ps.check_width(1) == 16 and ps.check_width(3) == 48 and ps.check_width(500) == 16 * ps.check_columns
    assert PSProfile(check_columns=1).check_width(500) == 16  # every check alone
    # Wider stacks run faster, up to the GEMM rate; 16 columns run at verify_flops.
    assert ps.check_rate(16) == ps.verify_flops < ps.check_rate(64) < ps.check_rate(128) < ps.flops_per_s("fp32")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(CostModelError, match="check_columns"):
            PSProfile(check_columns=bad)  # type: ignore[arg-type]


def test_the_event_loop_is_charged_per_message_tile_and_byte_by_hand() -> None:
    loop = LoopCosts(per_message=1e-3, per_tile=2e-3, per_byte_down=1e-9, per_byte_up=2e-9)
    assert loop.seconds(2, 1, 1e6, 1e6) == pytest.approx(2e-3 + 2e-3 + 1e-3 + 2e-3)
    ps = PSProfile(loop=loop, workers=2)
    # 10 work messages of one tile, each answered by one result; two workers share it.
    assert loop_seconds(10, 10, 1e8, 1e7, ps) == pytest.approx((20e-3 + 20e-3 + 0.1 + 0.02) / 2)
    assert loop.scaled(3).seconds(2, 1, 1e6, 1e6) == pytest.approx(3 * loop.seconds(2, 1, 1e6, 1e6))
    with pytest.raises(CostModelError):
        LoopCosts(per_message=-1.0)
    with pytest.raises(CostModelError):
        PSProfile(workers=0)


def test_the_loop_s_constants_are_what_calibrate_loop_fits_from_the_stored_bench_tax_run() -> None:
    # One place: costmodel.LOOP_COSTS, reproduced by the script from the run it cites.
    import json
    import sys

    from conftest import ROOT

    bench = ROOT / "bench"
    sys.path.insert(0, str(bench))
    try:
        import calibrate_loop
    finally:
        sys.path.remove(str(bench))
    # The coordinator as it runs by default: band checks, one send thread.
    result = json.loads((bench / "results" / "bench_tax-2026-11-28-send-threads.json").read_text())
    fitted = calibrate_loop.fit(calibrate_loop.samples(result, "band+1s"), result["socket_floor"])
    assert fitted.per_byte_down == pytest.approx(LOOP_COSTS.per_byte_down, rel=0.01)
    assert fitted.per_byte_up == pytest.approx(LOOP_COSTS.per_byte_up, rel=0.01)
    assert (fitted.per_message, fitted.per_tile) == (LOOP_COSTS.per_message, LOOP_COSTS.per_tile)
    assert PSProfile().loop is LOOP_COSTS


def test_a_band_check_reads_b_once_per_gemm() -> None:
    ps = PSProfile()
    # Two bands of one GEMM, 4 tiles each (one reduction range): B's blocks are the GEMM's.
    band = [(("g", r, "a"), ("g", c, "b"), 512, 256, 4096) for r in (0,) for c in range(4)]
    other = [(("g", 1, "a"), ("g", c, "b"), 512, 256, 4096) for c in range(4)]
    first = batch_check_seconds(band, ps)
    second = batch_check_seconds(other, ps, known_b={b for _, b, *_ in band})
    assert second < first
    # Checked alone, each result pays its own A block and B block.
    alone = sum(batch_check_seconds([p], ps) for p in band + other)
    assert first + second < alone
