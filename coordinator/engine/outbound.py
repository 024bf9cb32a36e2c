"""What the engine asks its driver to do: the decisions that leave the sans-I/O core.

The websocket server carries them out on sockets; tests and the simulator read them as data.
"""

from __future__ import annotations

from dataclasses import dataclass

from cleave.wire.codes import CloseCode
from cleave.wire.messages import Message


@dataclass(frozen=True)
class Send:
    """Send ``message`` to the device."""

    device: int
    message: Message


@dataclass(frozen=True)
class Close:
    """Close the device's connection with ``code`` and ``reason`` (after what is queued for it)."""

    device: int
    code: CloseCode
    reason: str


@dataclass(frozen=True)
class Limit:
    """The largest frame the device may send from now on (the server enforces it)."""

    device: int
    nbytes: int


@dataclass(frozen=True)
class Abort:
    """Training cannot go on: the server fails every GEMM in flight with this reason."""

    reason: str


Outbound = Send | Close | Limit | Abort
