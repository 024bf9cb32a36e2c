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

try:
    from hypothesis import HealthCheck, settings
    from hypothesis.database import DirectoryBasedExampleDatabase
except ImportError:  # pragma: no cover - only tests/test_fuzz.py needs hypothesis
    pass
else:
    # "ci" (the default): few examples, derandomized so every run tries the same inputs, no example
    # database (nothing written into the checkout). "thorough", for local runs:
    #     HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests/test_fuzz.py
    # draws fresh random inputs each run and remembers failures outside the checkout.
    settings.register_profile(
        "ci",
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
    settings.register_profile(
        "thorough",
        max_examples=1000,
        deadline=None,
        derandomize=False,
        database=DirectoryBasedExampleDatabase(Path(tempfile.gettempdir()) / "cleave-hypothesis"),
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
