"""The job's progress as the engine keeps it, and the cost model's predicted step time against
the one measured (shown by ``cleave status``, the dashboard and ``/metrics``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cleave.wire.codes import JobPhase


@dataclass
class Prediction:
    """The cost model's predicted step time against the measured one."""

    planned: list[float | None] = field(default_factory=list)  # this step's GEMMs, as submitted
    home: list[float] = field(default_factory=list)  # ... and each kept on the PS instead
    kinds: dict[str, int] = field(default_factory=dict)  # this step's partitions, by kind
    local_gemms: int = 0  # GEMMs the PS kept, all steps
    gemm_seconds: float | None = None  # last finished step: its GEMMs' predicted seconds
    home_gemm_seconds: float | None = None  # ... had the PS multiplied every one of them itself
    last_kinds: dict[str, int] = field(default_factory=dict)
    busy: float = 0.0  # this step: seconds with at least one GEMM out
    busy_since: float | None = None
    last_busy: float | None = None  # last finished step's
    step_started: float | None = None
    measured: float | None = None  # last finished step's seconds, from one begin_step to the next

    def step_done(self, now: float) -> None:
        """A step ended (the next one begins at ``now``): its figures become the last step's."""
        if self.step_started is not None:
            self.measured = now - self.step_started
            busy = self.busy + (now - self.busy_since if self.busy_since is not None else 0.0)
            self.last_busy = busy
            self.gemm_seconds = self._planned_seconds()
            self.home_gemm_seconds = float(sum(self.home)) if self.home else None
            self.last_kinds = dict(self.kinds)
        self.step_started = now
        self.planned.clear()
        self.home.clear()
        self.kinds.clear()
        self.busy = 0.0
        self.busy_since = now if self.busy_since is not None else None

    @property
    def other(self) -> float | None:
        """The PS's own seconds in the last finished step: its time with no GEMM out."""
        return None if self.measured is None or self.last_busy is None else max(0.0, self.measured - self.last_busy)

    def _planned_seconds(self) -> float | None:
        """The step's GEMMs' predicted seconds; None unless every one of them was priced."""
        if not self.planned or any(p is None for p in self.planned):
            return None
        return float(sum(self.planned))  # type: ignore[arg-type]

    def current(self) -> float | None:
        """The step in progress, once its GEMMs are all submitted: their predicted seconds plus
        the PS's own time of the step before. GEMMs planned side by side (micro-batches at once,
        on lanes of the fleet) are summed: an upper bound then, not a forecast of their overlap
        (``--micro-batches auto`` reports the list-scheduled forecast)."""
        gemms, other = self._planned_seconds(), self.other
        return None if gemms is None or other is None else gemms + other

    def current_home(self) -> float | None:
        """The step in progress had the PS kept every GEMM: the cost model's figure to compare
        the plan with (the planner picks per GEMM, never a plan slower than keeping it)."""
        other = self.other
        return None if not self.home or other is None else float(sum(self.home)) + other

    def as_json(self) -> dict[str, Any]:
        """Predicted step = the GEMMs' predicted seconds + the PS's own time measured last step
        (the step's seconds with no GEMM out): the model predicts the part it plans."""
        other = self.other
        predicted = None if self.gemm_seconds is None or other is None else self.gemm_seconds + other
        home = None if self.home_gemm_seconds is None or other is None else self.home_gemm_seconds + other
        return {
            "predicted_step_s": _round(predicted),
            "predicted_home_step_s": _round(home),
            "measured_step_s": _round(self.measured),
            "predicted_gemm_s": _round(self.gemm_seconds),
            "measured_gemm_s": _round(self.last_busy),
            "ps_other_s": _round(other),
            "partitions": self.last_kinds,
            "local_gemms": self.local_gemms,
        }


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 4)


@dataclass
class Progress:
    """The job's progress: its last step, loss and pace, as reports show them."""

    step: int = 0  # last finished step
    current: int = 0  # step whose GEMMs are being submitted
    steps: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    state: JobPhase = JobPhase.STARTING
    gemm_share: dict[str, Any] | None = None  # flops.GemmShare.to_dict(), once the model is built
    tokens: int = 0  # trained by this coordinator
    since: float | None = None  # when training started (monotonic seconds)
    ended: float | None = None  # when the job finished (monotonic seconds)
    first: int = 0  # the step this run of the coordinator started training from (a resume's)
    val_loss: float | None = None  # the held-out loss of the last evaluation (None: none yet, or not finite)
    val_step: int | None = None  # the step it was evaluated after

    def evaluated(self, step: int, val_loss: float | None) -> None:
        """The held-out loss after ``step`` (a step's metrics row with ``val_loss``; None or a
        NaN there: it diverged)."""
        self.val_loss = float(val_loss) if isinstance(val_loss, int | float) and math.isfinite(val_loss) else None
        self.val_step = step

    def elapsed(self, now: float) -> float | None:
        """Seconds of training so far (to the finish, once finished); None before it starts."""
        return None if self.since is None else max(0.0, (self.ended if self.ended is not None else now) - self.since)

    def eta(self, now: float) -> float | None:
        """Seconds left at the pace so far; None before the first step and once finished."""
        elapsed, done = self.elapsed(now), self.step - self.first  # this run's pace, not the job's
        if elapsed is None or done <= 0 or self.ended is not None or self.step >= self.steps:
            return None
        return elapsed / done * (self.steps - self.step)
