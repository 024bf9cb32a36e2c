"""The coordinator's operator view: a live progress bar on a terminal, log lines otherwise."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cleave.cli import render
from cleave.coordinator.job import Listening
from cleave.coordinator.training.loop import StepResult


class ConsoleReporter:
    def __init__(self, console: Console, *, live: bool, quiet: bool = False) -> None:
        self.console = console
        self.quiet = quiet
        self.live = live and not quiet
        self._last_print = 0.0
        self._progress: Progress | None = None
        self._live: Live | None = None
        self._task = None

    def listening(self, info: Listening) -> None:
        # Always printed, plainly: scripts and tests read the URL and tokens from this.
        self.console.print(render.listening(info), soft_wrap=True)

    def note(self, text: str) -> None:
        # Resume decisions and skipped checkpoints: always worth a line, even with --quiet.
        self.console.print(text, style="yellow", soft_wrap=True)

    def waiting(self, have: int, want: int) -> None:
        if not self.quiet:
            self.console.print(f"waiting for devices: {have}/{want} joined", style="dim")

    def _start_live(self, steps: int) -> None:
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._task = self._progress.add_task("train", total=steps, info="")
        self._live = Live(self._progress, console=self.console, refresh_per_second=8)
        self._live.start()

    def step(self, result: StepResult, status: dict[str, Any]) -> None:
        steps = status.get("job", {}).get("steps") or result.step
        val_loss = result.extra.get("val_loss")  # a step that evaluated the held-out split
        if self.quiet:
            return
        if self.live:
            if self._live is None:
                self._start_live(steps)
            assert self._progress is not None and self._task is not None
            line = render.step_line(result.step, steps, result.loss, result.seconds, status, show_step=False)
            self._progress.update(self._task, completed=result.step, info=line.plain)
            if val_loss is not None:  # kept above the bar: an evaluation is rare and worth its line
                self.console.print(
                    render.step_line(result.step, steps, result.loss, result.seconds, status, val_loss=val_loss),
                    soft_wrap=True,
                )
            return
        now = time.monotonic()
        if result.step in (1, steps) or now - self._last_print >= 1.0 or val_loss is not None:
            self._last_print = now
            self.console.print(
                render.step_line(result.step, steps, result.loss, result.seconds, status, val_loss=val_loss),
                soft_wrap=True,
            )

    def finished(self, results: list[StepResult], status: dict[str, Any]) -> None:
        if self._live is not None:
            self._live.stop()
        if results:
            last = results[-1]
            self.console.print(
                f"done: {last.step} steps, final loss {last.loss:.4f}"
                f"{render.held_out(status.get('job', {}), ', held-out {loss} (step {step})')}; "
                f"tiles {status['tiles']['verified']:,} verified, {status['tiles']['rejected']:,} rejected",
                style="bold green",
                highlight=False,
            )

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
