"""One place where Cleave's errors become a one-line message and an exit code."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from client.kernels import DeviceUnavailable
from client.runner import ClientError
from coordinator.protocol import ProtocolError
from coordinator.server import JobAborted
from coordinator.training.data import DataError
from coordinator.training.loop import ConfigError
from db.store import StoreError

F = TypeVar("F", bound=Callable[..., Any])

# Exit codes: 0 ok, 1 failure, 2 bad usage or options, 3+ set by the error itself.
USAGE_ERRORS = (ConfigError, DataError, DeviceUnavailable, ValueError)


class CleaveError(RuntimeError):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def fail(message: str, code: int) -> typer.Exit:
    # The message may quote a peer (a device's name, a coordinator's reason): never markup.
    line = Text("error:", style="bold red")
    line.append(f" {message}")
    Console(stderr=True).print(line, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def friendly(fn: F) -> F:
    """Turn the project's exceptions into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            Console(stderr=True).print("interrupted")
            raise typer.Exit(130) from None
        except ClientError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except CleaveError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except USAGE_ERRORS as exc:
            raise fail(str(exc), 2) from None
        except (FloatingPointError, JobAborted) as exc:
            raise fail(str(exc), 1) from None
        except (StoreError, ProtocolError, OSError) as exc:
            raise fail(str(exc) or type(exc).__name__, 1) from None

    return wrapper  # type: ignore[return-value]


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def is_terminal() -> bool:
    return sys.stdout.isatty()
