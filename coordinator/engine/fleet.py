"""What the cost model knows of the connected devices: each one's live measurements
(``DeviceProfile``), its profile in the job's dtype as of its last observation, and its place on
the planner's grid. The planner's classes of the fleet are rebuilt only when this view changed
(``version``): a device joined, left, paused, resumed, slept, woke, or moved on the grid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from cleave.coordinator.engine.balance import UNMEASURED_GFLOPS
from cleave.coordinator.engine.conduct import Conduct
from cleave.coordinator.engine.live_plan import LivePlan, LivePlanner, fleet_key
from cleave.coordinator.engine.profiles import DeviceProfile
from cleave.coordinator.engine.standby import Sleepers
from cleave.coordinator.planning.costmodel import Profile
from cleave.coordinator.planning.tiles import GemmKind


class Pausable(Protocol):
    """What the fleet reads of a device: whether its owner paused it."""

    paused: str | None  # its owner's reason, while paused


class Fleet:
    """The planner's view of the devices in ``devices`` (the engine's own dict, read here)."""

    def __init__(self, devices: Mapping[int, Pausable], standby: Sleepers, conduct: Conduct) -> None:
        self._devices = devices
        self._standby = standby
        self._conduct = conduct  # its scheduler learns each device's measured links
        self.profiles: dict[int, DeviceProfile] = {}  # connected devices, measured live
        self.dtype = "fp32"  # of the job's GEMMs: the dtype devices are measured and planned in
        self.version = 0  # moves when the planner's view of the fleet may have changed
        self._keys: dict[int, tuple[float, ...]] = {}  # each device's place on the planner's grid
        self._measured: set[int] = set()  # devices with observations since the last plan
        self._profiled: dict[int, Profile] = {}  # each device's profile in self.dtype, as of its last observation

    def changed(self) -> None:
        """A device joined, left, paused, resumed, slept or woke: the planner's classes are stale."""
        self.version += 1

    def joined(self, device_id: int, measured: DeviceProfile) -> None:
        """A device joined, with its hello's priors for measurements."""
        self.profiles[device_id] = measured
        self.changed()

    def left(self, device_id: int) -> DeviceProfile | None:
        """Forget a device; returns its measurements (a lost lease still counts against them)."""
        self._keys.pop(device_id, None)
        self._profiled.pop(device_id, None)
        self.changed()
        return self.profiles.pop(device_id, None)

    def failed(self, device_id: int, now: float) -> None:
        """A lease of the device ended without a verified result (its reliability)."""
        self.profiles[device_id].failed(now)
        self._measured.add(device_id)

    def verified(
        self,
        device_id: int,
        flops: float,
        seconds: float,
        waited: float,
        turnaround: float,
        down: int,
        up: int,
        arrived: float,
    ) -> None:
        """A verified result: its compute, its wait and its links' bytes and times."""
        self.profiles[device_id].verified(flops, seconds, waited, turnaround, down, up, arrived)
        self._measured.add(device_id)

    def links(self, device_id: int) -> Profile:
        """The device's profile as of its last observation (its links: where a relay helps)."""
        return self._profiled.get(device_id) or self.profiles[device_id].profile(self.dtype)

    def measured(self, device_id: int) -> bool:
        """Whether the device has returned verified work (its rate is measured, not claimed)."""
        return bool(self.profiles[device_id].results)

    def use_dtype(self, dtype: str) -> None:
        """The job's GEMMs come in ``dtype``: profiles are cached in it."""
        if dtype != self.dtype:
            self._profiled.clear()
            self.dtype = dtype

    def plan(self, planner: LivePlanner, m: int, n: int, k: int, kind: GemmKind, now: float) -> LivePlan:
        """The cost model's plan for the devices that may take work now. Devices measured since
        the last plan are looked at here, once per GEMM rather than at every result: has any moved
        on the planner's grid?"""
        for device_id in self._measured:
            profile = self.profiles.get(device_id)
            if profile is None:
                continue
            now_profile = profile.profile(self.dtype)
            self._profiled[device_id] = now_profile
            self._conduct.sched.links(device_id, now_profile.down, now_profile.up)  # a thief's links (Seat.transfer)
            key = fleet_key(now_profile, self.dtype)
            if self._keys.get(device_id) != key:
                self._keys[device_id] = key
                self.changed()
        self._measured.clear()
        return planner.plan(m, n, k, kind, self.dtype, self.current, self.version, now=now)

    def current(self, dtype: str | None = None) -> dict[int, Profile]:
        """What the cost model knows of each device that may take work now (O(devices)), in
        ``dtype`` (default: the job's GEMMs' dtype, known once the first GEMM has come)."""
        dtype = dtype or self.dtype
        awake = [d for d, dev in self._devices.items() if dev.paused is None]
        if dtype != self.dtype:
            return {d: self._resting(d, self.profiles[d].profile(dtype)) for d in awake}
        # A profile changes only with an observation (which marks the device measured): each
        # device's is computed once per observation, not once per GEMM the fleet changed for.
        out = {}
        for d in awake:
            known = None if d in self._measured else self._profiled.get(d)
            if known is None:
                known = self._profiled[d] = self.profiles[d].profile(dtype)
            out[d] = self._resting(d, known)
        return out

    def pool(self) -> tuple[int, float]:
        """The devices that may take work now and their GEMM GFLOP/s as the tier's balancing
        counts them: measured, as the cost model has them, once a device has returned verified
        work; until then its discounted claim, at most ``UNMEASURED_GFLOPS`` (a hello's claim
        moves no device: engine/balance.py). O(devices)."""
        profiles = self.current()
        total = 0.0
        for d, p in profiles.items():
            rate = p.flops_per_s(self.dtype) / 1e9
            total += rate if self.measured(d) else min(rate, UNMEASURED_GFLOPS)
        return len(profiles), total

    def _resting(self, device_id: int, profile: Profile) -> Profile:
        """A sleeping device as the planner sees it: its round trip lengthened by its wake, so a
        plan that wants it pays for the wait (engine/standby.py)."""
        wait = self._standby.latency(device_id, profile.rtt)
        return dataclasses.replace(profile, rtt=profile.rtt + wait) if wait > 0 else profile
