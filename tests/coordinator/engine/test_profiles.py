"""Live device profiles: decayed means, the link fit from turnarounds, hostile claims clamped."""

from __future__ import annotations

import math
import random

import pytest

from cleave.coordinator.engine.profiles import (
    LINK_BOUNDS,
    PRIOR_DOWN,
    PRIOR_RTT,
    PRIOR_UP,
    DeviceProfile,
    Ema,
    LinkFit,
    measure_ps,
)


def test_the_first_observation_is_the_estimate_and_old_ones_fade() -> None:
    e = Ema(tau=10.0)
    e.add(5.0, now=0.0)
    assert e.value == 5.0  # bias-corrected: no pull towards an initial zero
    e.add(1.0, now=0.0)
    assert e.value == pytest.approx(3.0)
    e.add(1.0, now=1000.0)  # the old ones weigh e^-100 now
    assert e.value == pytest.approx(1.0, abs=1e-9)


def test_with_no_observations_the_link_is_the_prior() -> None:
    rtt, down, up = LinkFit().solve()
    assert (rtt, down, up) == pytest.approx((PRIOR_RTT, PRIOR_DOWN, PRIOR_UP))


@pytest.mark.parametrize("true", [(0.02, 50e6, 5e6), (0.001, 1e9, 1e9), (0.08, 2e6, 0.5e6)])
def test_the_fit_recovers_asymmetric_links_from_mixed_transfers(true: tuple[float, float, float]) -> None:
    rtt, d, u = true
    fit = LinkFit(tau=1e9)
    rng = random.Random(0)
    total = 0.0
    for i in range(200):
        down = rng.choice([0.0, 1 << 20, 4 << 20])  # blocks held already, or one or two sent
        up = rng.choice([1 << 18, 1 << 20, 4 << 20])  # forward tiles, dW partials
        seconds = (rtt + down / d + up / u) * rng.uniform(0.97, 1.03)  # 3% jitter
        fit.add(down, up, seconds, now=float(i))
        total += seconds
    got_rtt, got_d, got_u = fit.solve()
    assert got_d == pytest.approx(d, rel=0.1)
    assert got_u == pytest.approx(u, rel=0.1)
    assert got_rtt == pytest.approx(rtt, abs=max(0.005, 0.01 * total / 200))  # jitter swamps a small rtt


def test_a_device_cannot_claim_more_time_than_the_coordinator_measured() -> None:
    p = DeviceProfile(claimed_gflops=10.0, memory=1 << 30)
    # It claims 100 s of compute and 50 s of waiting inside a 2 s turnaround.
    p.verified(flops=2e9, compute=100.0, waited=50.0, turnaround=2.0, down_bytes=1e6, up_bytes=1e6, now=0.0)
    assert p.gflops.value == pytest.approx(1.0)  # 2 GFLOP in at most the 2 s measured
    prof = p.profile()
    assert all(math.isfinite(x) and x > 0 for x in (prof.down, prof.up))
    lo, hi = LINK_BOUNDS
    assert lo <= prof.down <= hi and lo <= prof.up <= hi


def test_until_it_returns_work_a_device_is_planned_at_a_quarter_of_its_bounded_claim() -> None:
    assert DeviceProfile(claimed_gflops=80.0, memory=1).profile().gflops["fp32"] == pytest.approx(20.0)
    assert DeviceProfile(claimed_gflops=1e12, memory=1).profile().gflops["fp32"] == pytest.approx(1e5 / 4)
    p = DeviceProfile(claimed_gflops=80.0, memory=1)
    p.verified(flops=1e9, compute=0.1, waited=0.0, turnaround=0.2, down_bytes=0, up_bytes=1e5, now=0.0)
    assert p.profile().gflops["fp32"] == pytest.approx(10.0)  # its matmul's rate


def test_a_device_is_never_planned_above_four_times_what_the_coordinator_sees_it_deliver() -> None:
    p = DeviceProfile(claimed_gflops=80.0, memory=1)
    # 1 GFLOP back every second, while it claims each matmul took a microsecond.
    p.verified(flops=1e9, compute=1e-6, waited=0.0, turnaround=1.0, down_bytes=0, up_bytes=1e5, now=0.0)
    assert p.profile().gflops["fp32"] == pytest.approx(4.0)


def test_reliability_follows_outcomes() -> None:
    p = DeviceProfile(claimed_gflops=10.0, memory=1)
    for _ in range(3):
        p.verified(flops=1e9, compute=0.1, waited=0.0, turnaround=0.2, down_bytes=0, up_bytes=0, now=0.0)
    p.failed(now=0.0)
    assert p.profile().reliability == pytest.approx(0.75)
    assert p.as_json()["reliability"] == pytest.approx(0.75)


def test_the_ps_measures_itself() -> None:
    ps = measure_ps(10.0, seconds=0.06)
    assert ps.egress == ps.ingress == pytest.approx(10e9 / 8)
    assert ps.gflops["fp32"] > 0.1 and ps.verify_flops > 1e8 and ps.memory_bw > 1e8
