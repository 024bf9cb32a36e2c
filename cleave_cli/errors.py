"""One place where Cleave's errors become a one-line message and an exit code.

Every error Cleave raises derives from ``CleaveError``, and its branch states the exit code
(wire/errors.py draws the tree): 1 a failure, 2 bad usage or options, 3 a banned
device. Anything else is a bug and keeps its traceback, except what the operating system says
(``OSError``: a port in use, a file that cannot be written) and a diverged run, which are one line
and exit 1 too.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from cleave.wire.errors import CleaveError

F = TypeVar("F", bound=Callable[..., Any])

INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C


def fail(message: str, code: int) -> typer.Exit:
    # The message may quote a peer (a device's name, a coordinator's reason): never markup.
    line = Text("error:", style="bold red")
    line.append(f" {message}")
    Console(stderr=True).print(line, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def friendly(fn: F) -> F:
    """Turn the project's exceptions into one line on stderr and their branch's exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            Console(stderr=True).print("interrupted")
            raise typer.Exit(INTERRUPTED) from None
        except CleaveError as exc:
            raise fail(str(exc) or type(exc).__name__, exc.exit_code) from None
        except OSError as exc:  # the boundary with the operating system
            raise fail(str(exc) or type(exc).__name__, CleaveError.exit_code) from None

    return wrapper  # type: ignore[return-value]


def stop_on_signals(stop: Callable[[], None]) -> None:
    """Ctrl-C and SIGTERM call ``stop`` (a graceful leave) on the running event loop instead of
    interrupting it."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop)
        except (NotImplementedError, RuntimeError):  # Windows: Ctrl-C arrives as KeyboardInterrupt
            pass


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def is_terminal() -> bool:
    return sys.stdout.isatty()
