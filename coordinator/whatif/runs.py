"""Simulations side by side: independent runs (``cleave simulate``'s calm run and its run with a
crash) each in a process of its own, so that a machine's cores share them.

A run is a pure function of its ``SimConfig`` (its seed included): the same results whichever
process computes it, and in the same order as the configs. The first run stays in this process;
each other one is a child that sends its progress lines and then its result back over a local
pipe. On Linux a child is forked (it starts at once, with this process's modules and priced
plans; it only simulates and writes to its pipe, so the threads of a status line do not bother
it); elsewhere it is spawned, and spends a few seconds importing the engine first. Nothing
leaves the machine: these are this program's own processes, not peers.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queues
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.whatif.simulator import SimConfig, SimResult, Simulation, SimulationError

POLL_S = 0.5  # how often a wait for the other runs looks whether their processes are still alive
# By default, runs smaller than this (devices x layers x steps) all stay in this process: they
# take a second or less, and a spawned process spends about 3 s importing the engine (torch with
# it) before it simulates.
SPAWN_WORTH = 4096


def worth_a_process(cfg: SimConfig) -> bool:
    """Whether ``cfg`` runs long enough to pay for a process of its own (``SPAWN_WORTH``)."""
    devices = sum(cfg.tier.share(c.count) for c in cfg.fleet)
    return devices * cfg.model.n_layers * cfg.steps >= SPAWN_WORTH


def cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def run_all(
    configs: Sequence[SimConfig],
    tell: Callable[[int, str], None] | None = None,
    processes: int | None = None,
) -> list[SimResult]:
    """Run every config and return their results in order. ``tell(i, line)``: run ``i``'s
    progress. ``processes``: at most this many at once (default: the CPUs this process may
    use, or 1 when a run is too small to pay for a process: ``worth_a_process``); 1 runs them
    one after another here."""
    configs = list(configs)
    if processes is None:
        processes = cpus() if all(worth_a_process(cfg) for cfg in configs[1:]) else 1
    most = processes
    if most < 1:
        raise SimulationError(f"processes must be at least 1, got {most}")
    aside = min(len(configs), most) - 1  # runs in children; the rest here, in turn
    if aside <= 0:
        return [_run(cfg, i, tell) for i, cfg in enumerate(configs)]
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    inbox: Any = ctx.Queue()
    children = {i: ctx.Process(target=_child, args=(configs[i], i, inbox), daemon=True) for i in range(1, aside + 1)}
    with warnings.catch_warnings():  # Python 3.12+ warns of forking beside threads (see above)
        warnings.simplefilter("ignore", DeprecationWarning)
        for child in children.values():
            child.start()
    got: dict[int, SimResult] = {}

    def drain(block: bool) -> None:
        while len(got) < len(children):
            try:
                index, kind, payload = inbox.get(block, POLL_S)
            except queues.Empty:
                if not block:
                    return
                dead = [i for i, c in children.items() if i not in got and not c.is_alive()]
                if dead:  # killed (out of memory, a signal) before it could answer
                    raise SimulationError(
                        f"the simulation run in another process died (exit code {children[dead[0]].exitcode})"
                    ) from None
                continue
            if kind == "tell":
                if tell is not None:
                    tell(index, payload)
            elif kind == "error":
                raise payload
            else:
                got[index] = payload

    def here(index: int, line: str) -> None:
        if tell is not None:
            tell(index, line)
        drain(block=False)  # the others' lines while this one runs

    try:
        results: dict[int, SimResult] = {0: _run(configs[0], 0, here)}
        for i in range(aside + 1, len(configs)):
            results[i] = _run(configs[i], i, here)
        drain(block=True)
    finally:
        for child in children.values():
            if child.is_alive():
                child.terminate()
            child.join()
    results.update(got)
    return [results[i] for i in range(len(configs))]


def _run(cfg: SimConfig, index: int, tell: Callable[[int, str], None] | None) -> SimResult:
    return Simulation(cfg, tell=None if tell is None else lambda line: tell(index, line)).run()


def _child(cfg: SimConfig, index: int, outbox: Any) -> None:
    """A spawned process's run: its lines, then its result (or its error), to ``outbox``."""
    try:
        result = _run(cfg, index, lambda i, line: outbox.put((i, "tell", line)))
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
        outbox.put(
            (
                index,
                "error",
                exc if isinstance(exc, SimulationError) else SimulationError(f"{type(exc).__name__}: {exc}"),
            )
        )
        return
    outbox.put((index, "result", result))
