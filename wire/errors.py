"""Cleave's one exception tree. Every exception class Cleave defines derives from ``CleaveError``;
the command line turns any of them into one line and the exit code its branch states
(cleave_cli/errors.py), and peers get a close code or an ``error`` message, never a traceback.

    CleaveError                      exit 1: something failed
    ├── ConfigError (ValueError)     exit 2: an option, file or setting the user gave is wrong
    │   ├── DataError                    --data, --val-data (coordinator/training/tokens.py)
    │   ├── HFError                      --model hf:DIR (coordinator/training/hf.py)
    │   ├── CostModelError               a model, fleet or option the cost model cannot price
    │   │   └── SimulationError          ... or the simulator cannot run (coordinator/whatif/)
    │   ├── URLRefused                   a coordinator URL the client will not use (client/connection.py)
    │   ├── PolicyError                  a volunteer's client.toml (client/policy.py)
    │   ├── CredentialError              the client's credentials file (client/credentials.py)
    │   └── DeviceUnavailable            --device names one this machine lacks (client/kernels.py)
    ├── ProtocolError (ValueError)   a frame that breaks the wire protocol; ``code`` goes to the peer
    ├── AuthError                    the gate refuses a peer; ``code`` is its close code
    ├── StoreError (RuntimeError)    a store call that cannot be honoured (db/)
    │   └── CheckpointError              a checkpoint that cannot be written or read
    ├── JobAborted (RuntimeError)    training stopped: the coordinator is going, or a tile is stuck
    ├── Diverged (FloatingPointError)  a GEMM input holds NaN or Inf: training diverged
    └── ClientError (RuntimeError)   what a volunteer's client cannot retry its way out of
        ├── Refused                  exit 2: bad options, or the join token or credential refused
        └── Banned                   exit 3: the coordinator banned or revoked this device

Builtin bases (``ValueError``, ``RuntimeError``) stay where callers caught them before the tree
existed. Leaves live beside the code that raises them; the branches live here, below every
other module of Cleave, so that each can derive from them.
"""

from __future__ import annotations

from typing import ClassVar

from cleave.wire.codes import CloseCode, Code


class CleaveError(Exception):
    """The root of every exception Cleave defines. ``exit_code``: what ``cleave`` exits with."""

    exit_code: ClassVar[int] = 1


class ConfigError(CleaveError, ValueError):
    """An option, file or setting the user gave cannot be used. ``field``: the one setting at
    fault, named as the Python API spells it (``port``, ``FaultPolicy.lease_floor``), when there
    is one; the message is then ``field`` and ``detail``, and ``called`` says it under another
    name (the command line's flag for it)."""

    exit_code = 2

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field} {message}" if field else message)
        self.field = field
        self.detail = message

    def called(self, name: str) -> ConfigError:
        """The same error with its field called ``name``."""
        return type(self)(f"{name} {self.detail}") if self.field else self


class ProtocolError(CleaveError, ValueError):
    """A frame or message that breaks the protocol. ``code`` is sent back to the peer."""

    def __init__(self, message: str, code: Code = Code.BAD_FRAME) -> None:
        super().__init__(message)
        self.code = code


class AuthError(CleaveError):
    """A peer that may not connect; ``code`` is the close code it gets."""

    def __init__(self, code: CloseCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class StoreError(CleaveError, RuntimeError):
    """A store call that cannot be honoured (unknown id, tile not leased to that device...)."""


class CheckpointError(StoreError):
    """A checkpoint that cannot be written, or read back as it was written."""


class JobAborted(CleaveError, RuntimeError):
    """Training cannot go on: the coordinator is shutting down, or a tile failed everywhere.
    GEMMs still in flight will never complete."""


class Diverged(CleaveError, FloatingPointError):
    """A GEMM input holds NaN or Inf: training diverged (or a value overflowed the wire dtype)."""


class ClientError(CleaveError, RuntimeError):
    """A failure the volunteer's client cannot retry its way out of."""


class Refused(ClientError):
    """Bad options, a URL the client will not use, or the coordinator refused its join token or
    credential: usage, not a crash."""

    exit_code = 2


class Banned(ClientError):
    """The coordinator banned or revoked this device: a service manager should not restart it."""

    exit_code = 3
