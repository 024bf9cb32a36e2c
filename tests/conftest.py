"""Shared fixtures. Time-outs in tests are multiples of one constant, TIMEOUT."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # several torch processes share 2 cores
# The benchmark cache and config lookups of every process started by the tests stay out of $HOME.
_SANDBOX = Path(tempfile.mkdtemp(prefix="cleave-tests-"))
os.environ["XDG_CACHE_HOME"] = str(_SANDBOX / "cache")
os.environ["XDG_CONFIG_HOME"] = str(_SANDBOX / "config")

TIMEOUT = 60.0  # seconds; every wait in the tests is a multiple of this


@pytest.fixture
def tmp_db(tmp_path: Path) -> Path:
    return tmp_path / "cleave.db"


@pytest.fixture(autouse=True)
def _no_stray_processes():  # noqa: ANN202
    yield
    from procs import Proc

    while Proc.running:
        Proc.running.pop().kill()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    import torch

    torch.manual_seed(0)
