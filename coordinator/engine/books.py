"""The job's books: the one place that writes the job's own records to the store.

The ``Core`` writes the tile path's records (GEMMs, tiles, leases, devices, credit) as it acts;
``Books`` writes the job's: its row and state, its steps, its checkpoints, and what a dead
coordinator left behind when a new one takes over the database. ``serve_job`` only wires: it
decides from the options and the checkpoint files whether to start or resume, and tells the
books; it never writes the store itself. Times passed in are wall-clock seconds (records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cleave.db.store import RESTARTED, CheckpointRow, JobRow, JobState, StepRow, Store


@dataclass(frozen=True)
class Takeover:
    """What a coordinator found when it took over the database."""

    unfinished: JobRow | None  # the newest job, if a killed or stopped coordinator left it resumable
    abandoned: int  # tiles queued or leased by the dead run: never handed out again


class Books:
    """The records of one job (``job_id``) in ``store``."""

    def __init__(self, store: Store, job_id: int, prune_steps: int = 0) -> None:
        self.store = store
        self.job_id = job_id
        # At each checkpoint, the rows of finished GEMMs older than the last this many steps are
        # deleted (their counts kept: ``Store.prune_gemms``); 0 keeps every row (--prune-steps).
        self.prune_steps = prune_steps
        self.done = False  # finished in the books: nothing that interrupts the goodbyes undoes it

    @staticmethod
    def take_over(store: Store, at: float, *, new_job: bool) -> Takeover:
        """A coordinator starts on ``store``. No tile in it can be live now (the coordinator that
        made it is gone with its operands): whatever job runs next must never be handed one, and
        no device is online. Returns the job it may resume (none with ``new_job``)."""
        unfinished = None if new_job else store.resumable_job()
        abandoned = store.abandon_unfinished(None, at)
        store.mark_devices_offline(RESTARTED)
        return Takeover(unfinished, abandoned)

    @classmethod
    def create(
        cls, store: Store, name: str, config: dict[str, Any], steps: int, at: float, prune_steps: int = 0
    ) -> Books:
        """A new job, running."""
        return cls(store, store.create_job(name, config, steps, at), prune_steps)

    @classmethod
    def resume(cls, store: Store, job_id: int, step: int, at: float, prune_steps: int = 0) -> Books:
        """Take up ``job_id`` again from its checkpoint of ``step`` (0: from the start): the steps
        after it will be computed again, so their rows go, and the job runs again."""
        store.truncate_steps(job_id, step)
        store.set_job_state(job_id, JobState.RUNNING, at)
        return cls(store, job_id, prune_steps)

    def steps(self) -> list[StepRow]:
        """The job's recorded steps, in order."""
        return self.store.steps(self.job_id)

    def checkpoints(self) -> list[CheckpointRow]:
        """The job's checkpoints, newest first."""
        return self.store.checkpoints(self.job_id)

    def record_step(
        self, step: int, loss: float, tokens: int, seconds: float, at: float, extra: dict[str, Any]
    ) -> None:
        """A finished training step (committed at once: it must outlive a crash)."""
        self.store.record_step(self.job_id, step, loss, tokens, seconds, at, extra)

    def checkpointed(self, row: CheckpointRow) -> list[CheckpointRow]:
        """A checkpoint was written; returns the job's checkpoints, newest first (the caller
        prunes old files). With ``prune_steps``, the rows of finished GEMMs of the steps before
        the last ``prune_steps`` go too: the store stays bounded in steps."""
        self.store.add_checkpoint(row)
        if self.prune_steps:
            self.store.prune_gemms(self.job_id, row.step - self.prune_steps)
        return self.checkpoints()

    def finished(self, at: float) -> None:
        """The job's last step is done."""
        self.store.set_job_state(self.job_id, JobState.FINISHED, at)
        self.done = True

    def stopped(self, at: float, *, trained: bool) -> None:
        """The coordinator stopped before the end (Ctrl-C, an error). A job that trained (or was
        resumed) is ``stopped``, and the next start resumes it; one whose start failed before its
        first step (bad --data, a port in use) is ``failed``, so it does not pin its options on
        the next start. A job already finished stays finished (a Ctrl-C during its goodbyes or its
        linger interrupts no training)."""
        if self.done:
            return
        self.store.set_job_state(self.job_id, JobState.STOPPED if trained else JobState.FAILED, at)
