"""What a volunteer's worker is doing, as its owner sees it: its own module, so that a program
showing it (the join panel, tests) needs none of the worker's torch."""

from __future__ import annotations

from cleave.wire.codes import Name


class WorkerState(Name):
    """What the worker is doing, as its owner sees it (``cleave join``'s panel)."""

    STARTING = "starting"
    BENCHMARKING = "benchmarking"
    CONNECTING = "connecting"
    WAITING = "waiting for work"
    WORKING = "working"
    PAUSED = "paused"  # its owner's policy says stop (``reason`` says which rule)
    STANDBY = "standby"  # the coordinator has no work for it for now: it holds nothing and beats rarely until woken
    RECONNECTING = "reconnecting"
    LEAVING = "leaving"
    FINISHED = "finished"  # the job is complete (with --once)
    STOPPED = "stopped"
