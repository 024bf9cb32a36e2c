"""Energy meters of the machine this process runs on: a volunteer's (``cleave join``) and the
coordinator's own, read the same way (issue 23, docs/operations.md "Energy and carbon").

The best source the machine has, and every figure says which it came from:

- ``rapl``: the Linux powercap package counters (``/sys/class/powercap/intel-rapl:N``, AMD's
  too), which count the whole CPU package: Cleave's work and anything else running.
  Counters wrap at ``max_energy_range_uj``; a wrap between two reads is added back. Since 2020
  kernels let only root read them (CVE-2020-8694); where they cannot be read, say so and fall back.
- ``nvml``: a CUDA GPU's own energy (``nvmlDeviceGetTotalEnergyConsumption``, Volta and later),
  through nvidia-ml-py (the optional ``cleave[nvml]`` extra), added to the CPU side's figure.
- ``battery``: the battery's discharge, when the machine runs on its battery for the whole span
  (``/sys/class/power_supply/BAT*``: ``energy_now`` in µWh, or ``charge_now`` µAh x
  ``voltage_now`` µV).
- ``estimate``: where nothing can be read, the process's CPU seconds x ``WATTS_PER_CORE``, plus,
  for a GPU NVML cannot read (Apple's, or CUDA without the extra), its seconds in GEMMs x
  ``GPU_WATTS``.

Paths, the CPU clock and NVML are injected, so a test feeds fake counters.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cleave.wire.codes import EnergySource

log = logging.getLogger(__name__)

POWERCAP = Path(os.environ.get("CLEAVE_POWERCAP", "/sys/class/powercap"))  # a container may mount it elsewhere
POWER_SUPPLY = Path(os.environ.get("CLEAVE_POWER_SUPPLY", "/sys/class/power_supply"))
# The estimate's power per busy core, at the wall. A middle figure for x86 cores under an all-core
# AVX load: Intel Core i9-13900K 253 W (its maximum turbo power) over 24 cores is 10.5 W; a
# laptop's Core i7-1165G7 28 W over 4 cores is 7 W; AMD EPYC 9654 360 W (TDP) over 96 cores is
# 3.75 W (vendors' specification pages). Our own assumption, stated wherever it is used.
WATTS_PER_CORE = 10.0
# The estimate's power of a GPU busy with GEMMs, where NVML cannot read it. mps: Apple's M-series
# GPUs draw tens of watts under load (Apple publishes whole-machine figures only: a Mac mini M2
# at most 50 W); 20 W is our assumption. cuda: a mid-range desktop board, RTX 3060 170 W, RTX
# 4070 200 W (NVIDIA's specification pages).
GPU_WATTS: dict[str, float] = {"mps": 20.0, "cuda": 200.0}
_UWH = 3.6e-3  # joules in a microwatt-hour


@dataclass(frozen=True)
class Span:
    """The energy of one span between two reads."""

    joules: float  # the CPU side (the machine's, for rapl and battery), from ``source``
    source: EnergySource
    gpu_joules: float = 0.0  # NVML's, for a CUDA GPU
    seconds: float = 0.0

    @property
    def total(self) -> float:
        return self.joules + self.gpu_joules


class Rapl:
    """The sum of the powercap package zones' counters, in joules since the first read."""

    def __init__(self, root: Path = POWERCAP) -> None:
        self.zones: list[tuple[Path, float]] = []  # (energy_uj, wraps at: µJ)
        self.why_not = ""
        zones = sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1) if root.is_dir() else []
        if not zones:
            self.why_not = f"no RAPL counters under {root}"
            return
        for zone in zones:
            try:
                if (zone / "name").read_text().strip() == "psys":  # the platform: it holds the packages
                    continue
                top = float((zone / "max_energy_range_uj").read_text())
                float((zone / "energy_uj").read_text())
            except PermissionError:
                self.why_not = f"RAPL counters under {root} are readable only by root here"
                self.zones = []
                return
            except (OSError, ValueError) as exc:
                self.why_not = f"RAPL counter {zone} unreadable: {exc}"
                continue
            self.zones.append((zone / "energy_uj", top))
        self._last: list[float] | None = None
        self._total = 0.0

    def __bool__(self) -> bool:
        return bool(self.zones)

    def read(self) -> float:
        """Joules since the first read (0.0 then)."""
        now = [float(path.read_text()) for path, _ in self.zones]
        if self._last is not None:
            for (_, top), old, new in zip(self.zones, self._last, now, strict=True):
                self._total += (new - old if new >= old else new + top - old) * 1e-6  # wrapped once
        self._last = now
        return self._total


class Battery:
    """The batteries' stored energy (joules) and whether the machine runs on them."""

    def __init__(self, root: Path = POWER_SUPPLY) -> None:
        self.cells = sorted(root.glob("BAT*")) if root.is_dir() else []

    def __bool__(self) -> bool:
        return bool(self.cells)

    def read(self) -> tuple[float, bool] | None:
        """(stored joules, discharging), or None when no battery says."""
        stored, discharging = 0.0, False
        for cell in self.cells:
            try:
                status = (cell / "status").read_text().strip()
                if (cell / "energy_now").exists():
                    stored += float((cell / "energy_now").read_text()) * _UWH
                else:  # µAh x µV = 1e-12 Wh
                    charge = float((cell / "charge_now").read_text())
                    stored += charge * float((cell / "voltage_now").read_text()) * 1e-12 * 3600
            except (OSError, ValueError):
                return None
            discharging = discharging or status == "Discharging"
        return stored, discharging


def _nvml(index: int) -> Callable[[], float] | None:
    """CUDA GPU ``index``'s energy in joules since its driver loaded, through nvidia-ml-py (the
    GPU this process computes on, not the machine's others); None without one. NVML numbers
    GPUs as CUDA does unless CUDA_VISIBLE_DEVICES reorders them."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # raises before Volta
    except Exception as exc:  # noqa: BLE001 - any NVML failure: no GPU figure, said once
        log.info("NVML energy unavailable: %s", exc)
        return None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0


class EnergyMeter:
    """This machine's energy, span by span (``span()``: since the last call, or ``restart()``).

    ``gpu``: the kind of GPU this process computes on (``cuda``, ``mps``; "" for none) and
    ``gpu_index`` which; ``gpu_seconds`` its seconds in GEMMs, for the estimate where NVML cannot
    read it. ``estimate_only``: no counter (emulated devices sharing one process and machine).
    RAPL counters wrap (a package's within tens of minutes at full load): ``poll()`` between
    spans keeps them, and ``keep_reading()`` does so from a thread."""

    def __init__(
        self,
        *,
        powercap: Path = POWERCAP,
        power_supply: Path = POWER_SUPPLY,
        cpu_seconds: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        gpu: str = "",
        gpu_index: int = 0,
        gpu_seconds: Callable[[], float] | None = None,
        nvml: Callable[[], float] | None = None,
        estimate_only: bool = False,
    ) -> None:
        nowhere = Path("/nonexistent/cleave")
        self.rapl = Rapl(nowhere if estimate_only else powercap)
        if estimate_only:
            self.rapl.why_not = "an emulated device: its own compute seconds only"
        self.battery = Battery(nowhere if estimate_only else power_supply)
        self.cpu_seconds, self.clock = cpu_seconds, clock
        self.nvml = nvml if nvml is not None else (_nvml(gpu_index) if gpu == "cuda" and not estimate_only else None)
        # A GPU NVML does not read is estimated from its GEMM seconds.
        self.gpu_watts = GPU_WATTS.get(gpu, 0.0) if self.nvml is None and gpu_seconds is not None else 0.0
        self.gpu_seconds = gpu_seconds or (lambda: 0.0)
        self.gpu = gpu
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.restart()

    def describe(self) -> str:
        """One line: where its figures come from (and why not from better)."""
        if self.rapl:
            cpu = f"RAPL ({len(self.rapl.zones)} package counter{'s' if len(self.rapl.zones) != 1 else ''})"
        else:
            cpu = f"estimate, {WATTS_PER_CORE:g} W per busy core ({self.rapl.why_not})"
            if self.battery:
                cpu += "; the battery's discharge while on battery"
        if self.nvml:
            cpu += " + NVML for the GPU"
        elif self.gpu_watts:
            cpu += f" + the GPU estimated at {self.gpu_watts:g} W while in GEMMs"
        elif self.gpu:
            cpu += f" (the {self.gpu} GPU is not counted: no NVML here)"
        return cpu

    def _sample(self) -> tuple[float, float, float, tuple[float, bool] | None, float, float]:
        with self._lock:
            return (
                self.clock(),
                self.cpu_seconds(),
                self.rapl.read() if self.rapl else 0.0,
                self.battery.read() if self.battery else None,
                self.nvml() if self.nvml else 0.0,
                self.gpu_seconds(),
            )

    def poll(self) -> None:
        """Read the RAPL counters between spans, so that no wrap is lost."""
        if self.rapl:
            with self._lock:
                self.rapl.read()

    def keep_reading(self, every: float = 60.0) -> None:
        """Poll from a daemon thread every ``every`` seconds (a package counter at 200 W wraps
        after about 22 minutes)."""
        if self._reader is None and self.rapl:

            def run() -> None:
                while True:
                    time.sleep(every)
                    self.poll()

            self._reader = threading.Thread(target=run, name="cleave-energy", daemon=True)
            self._reader.start()

    def restart(self) -> None:
        """Start a new span now (the time before, paused, is not Cleave's)."""
        self._at = self._sample()

    def span(self) -> Span:
        """The energy since the last span (or restart), from the best source for all of it."""
        then, now = self._at, self._sample()
        self._at = now
        seconds = max(0.0, now[0] - then[0])
        gpu = max(0.0, now[4] - then[4])
        if self.rapl:
            return Span(max(0.0, now[2] - then[2]), EnergySource.RAPL, gpu, seconds)
        old, new = then[3], now[3]
        if old is not None and new is not None and old[1] and new[1]:  # on battery throughout
            return Span(max(0.0, old[0] - new[0]), EnergySource.BATTERY, gpu, seconds)
        estimate = max(0.0, now[1] - then[1]) * WATTS_PER_CORE + max(0.0, now[5] - then[5]) * self.gpu_watts
        return Span(estimate, EnergySource.ESTIMATE, gpu, seconds)
