"""Simulations side by side: independent runs (``cleave simulate``'s calm run and its run with a
crash) each in a process of its own, so that a machine's cores share them.

A run is a pure function of its ``SimConfig`` (its seed included): the same results whichever
process computes it, and in the same order as the configs. The first run stays in this process;
each other one is a child that sends its progress lines and then its result back over a pipe of
its own. On Linux a child is forked (it starts at once, with this process's modules and priced
plans; it only simulates and writes to its pipe, so the threads of a status line do not bother
it); elsewhere it is spawned, and spends a few seconds importing the engine first. A child
ignores Ctrl-C (this process ends it) and exits by itself if this process is gone; a child that
dies is reported as a ``SimulationError``, never waited for. Memory: each run holds its own
simulation, so side by side they need the sum of what one after another needed at most. Nothing
leaves the machine: these are this program's own processes, not peers.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from cleave.coordinator.whatif.simulator import SimConfig, SimResult, Simulation, SimulationError

# By default, runs smaller than this (devices x layers x steps) all stay in this process: they
# take a second or less, and a spawned process spends about 3 s importing the engine (torch with
# it) before it simulates.
SPAWN_WORTH = 4096
ORPHAN_CHECK_S = 1.0  # how often a child looks whether the process that started it is still there


def cpus() -> int:
    """The CPUs this process may run on (a container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def worth_a_process(cfg: SimConfig) -> bool:
    """Whether ``cfg`` runs long enough to pay for a process of its own (``SPAWN_WORTH``)."""
    devices = sum(cfg.tier.share(c.count) for c in cfg.fleet)
    return devices * cfg.model.n_layers * cfg.steps >= SPAWN_WORTH


def run_all(
    configs: Sequence[SimConfig],
    tell: Callable[[int, str], None] | None = None,
    processes: int | None = None,
) -> list[SimResult]:
    """Run every config and return their results in order. ``tell(i, line)``: run ``i``'s
    progress. ``processes``: at most this many at once (default: the CPUs this process may
    use, or 1 when a run is too small to pay for a process: ``worth_a_process``); 1 runs them
    one after another here. A child's error is raised here as it was raised there (with its
    traceback as a note, where exceptions take notes)."""
    configs = list(configs)
    if processes is None:
        processes = cpus() if all(worth_a_process(cfg) for cfg in configs[1:]) else 1
    if processes < 1:
        raise SimulationError(f"processes must be at least 1, got {processes}")
    aside = min(len(configs), processes) - 1  # runs in children; the rest here, in turn
    if aside <= 0:
        return [_run(cfg, i, tell) for i, cfg in enumerate(configs)]
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    children: dict[int, tuple[Any, Connection]] = {}
    try:
        with warnings.catch_warnings():  # Python 3.12+ warns of forking beside threads (see above)
            warnings.simplefilter("ignore", DeprecationWarning)
            for i in range(1, aside + 1):
                inbox, outbox = ctx.Pipe(duplex=False)
                child = ctx.Process(target=_child, args=(configs[i], i, outbox, os.getpid()), daemon=True)
                child.start()
                outbox.close()  # the child's end: once it exits, reading here ends (no hang)
                children[i] = (child, inbox)
        got: dict[int, SimResult] = {}

        def drain(block: bool) -> None:
            while len(got) < len(children):
                waiting = {inbox: i for i, (_, inbox) in children.items() if i not in got}
                ready = wait(list(waiting), timeout=None if block else 0)
                if not ready:
                    return
                for inbox in ready:
                    index = waiting[inbox]  # type: ignore[index]
                    try:
                        kind, payload = inbox.recv()  # type: ignore[union-attr]
                    except EOFError:  # it exited without its result: killed, out of memory
                        child = children[index][0]
                        child.join(ORPHAN_CHECK_S)
                        raise SimulationError(
                            f"the simulation run in another process died (exit code {child.exitcode})"
                        ) from None
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

        results: dict[int, SimResult] = {0: _run(configs[0], 0, here)}
        for i in range(aside + 1, len(configs)):
            results[i] = _run(configs[i], i, here)
        drain(block=True)
    finally:
        for child, inbox in children.values():
            if child.is_alive():
                child.terminate()
            child.join()
            inbox.close()
    results.update(got)
    return [results[i] for i in range(len(configs))]


def _run(cfg: SimConfig, index: int, tell: Callable[[int, str], None] | None) -> SimResult:
    return Simulation(cfg, tell=None if tell is None else lambda line: tell(index, line)).run()


def _child(cfg: SimConfig, index: int, outbox: Connection, parent: int) -> None:
    """A child's run: its lines, then its result (or its error), to ``outbox``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends this one
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    try:
        result = _run(cfg, index, lambda _, line: outbox.send(("tell", line)))
    except Exception as exc:  # noqa: BLE001 - raised again in the parent
        outbox.send(("error", _portable(exc, traceback.format_exc())))
        return
    outbox.send(("result", result))


def _exit_when_orphaned(parent: int) -> None:
    """The process that started this one is gone (killed before it could end it): stop, rather
    than simulate for nobody and then block on a pipe that nobody reads."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(1)


def _portable(exc: Exception, where: str) -> Exception:
    """``exc`` as the parent can receive it: itself, with the child's traceback as a note, or a
    ``SimulationError`` that names it where it cannot be pickled."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send a description
        return SimulationError(f"{type(exc).__name__} in another process: {exc}\n{where}")
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(f"in the simulation run in another process:\n{where}")
    return exc
