"""Cleave: volunteer computing for foundation-model training, every GEMM cut into verified tiles.

The Python API (docs/api.md) is importable from here; each name loads its module only when it
is first used, so ``import cleave`` stays cheap (no torch) and the command line's subcommands
load only what they need. The rooms of the design are subpackages: ``cleave.coordinator`` (the
parameter server: its engine, network, planning, training), ``cleave.client`` (``cleave join``),
``cleave.db`` (the job's books), ``cleave.emulator`` and ``cleave.cli`` (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("cleave")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"

# name -> the module that defines it (docs/api.md's tables).
_API = {
    "TrainConfig": "cleave.coordinator.training.loop",
    "Trainer": "cleave.coordinator.training.loop",
    "CoordinatorConfig": "cleave.coordinator.config",
    "JobOutcome": "cleave.coordinator.job",
    "Reporter": "cleave.coordinator.job",
    "serve_job": "cleave.coordinator.job",
    "serve_with_local_clients": "cleave.cli.local",
    "ConsoleReporter": "cleave.cli.progress",
    "Planner": "cleave.coordinator.engine.live_plan",
    "new_token": "cleave.coordinator.engine.identity",
    "export_job": "cleave.coordinator.training.export",
    "CleaveError": "cleave.wire.errors",
    "ConfigError": "cleave.wire.errors",
}

__all__ = [
    "CleaveError",
    "ConfigError",
    "ConsoleReporter",
    "CoordinatorConfig",
    "JobOutcome",
    "Planner",
    "Reporter",
    "TrainConfig",
    "Trainer",
    "__version__",
    "export_job",
    "new_token",
    "serve_job",
    "serve_with_local_clients",
]

if TYPE_CHECKING:
    from cleave.cli.local import serve_with_local_clients
    from cleave.cli.progress import ConsoleReporter
    from cleave.coordinator.config import CoordinatorConfig
    from cleave.coordinator.engine.identity import new_token
    from cleave.coordinator.engine.live_plan import Planner
    from cleave.coordinator.job import JobOutcome, Reporter, serve_job
    from cleave.coordinator.training.export import export_job
    from cleave.coordinator.training.loop import TrainConfig, Trainer
    from cleave.wire.errors import CleaveError, ConfigError


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'cleave' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
