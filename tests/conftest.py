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
except ImportError:  # pragma: no cover - only tests/coordinator/engine/test_fuzz.py needs hypothesis
    pass
else:
    # "ci" (the default): few examples, derandomized so every run tries the same inputs, no example
    # database (nothing written into the checkout). "thorough", for local runs:
    #     HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests/coordinator/engine/test_fuzz.py
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


_ROOMS: list = []  # this worker's two lock files, opened once


def _rooms() -> list:
    if not _ROOMS:
        run = Path(tempfile.gettempdir()) / f"cleave-tests-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
        run.mkdir(exist_ok=True)
        _ROOMS.extend(open(run / name, "a+") for name in ("turnstile", "room"))  # held all run
    return _ROOMS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201
    """A test marked ``alone`` measures time: on xdist workers it runs with no test beside it.
    A readers-writer lock over two files: every test holds the room shared, an ``alone`` one holds
    it exclusively, and the turnstile keeps new tests from slipping in while it waits."""
    if "PYTEST_XDIST_TESTRUNUID" not in os.environ:
        yield
        return
    import fcntl

    turnstile, room = _rooms()
    alone = item.get_closest_marker("alone") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    if not alone:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(room, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)


# Tests of many seconds that are not drills (in-process fuzzing, a tier's ranks, a large plan):
# started early beside the drills, not left for the end of the run.
HEAVY = (
    "tests/coordinator/engine/test_fuzz.py::",
    "tests/coordinator/tier/test_tier.py::",
    "tests/cli/test_plan_cli.py::test_a_tier_plans",
)


def _weight(item: pytest.Item) -> int:
    if item.get_closest_marker("drill") is not None:
        return 2
    return 1 if item.nodeid.startswith(HEAVY) else 0


def _shared(item: pytest.Item) -> str | None:
    """The module of a module-scoped fixture ``item`` reads (a baseline, a job trained once), if any."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's record of a test's fixtures (not public API)
    for defs in info.name2fixturedefs.values() if info is not None else ():
        if defs and defs[-1].scope == "module":
            return item.nodeid.split("::")[0]
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Drills first, then the other long tests: the suite runs on two workers (pyproject's
    addopts), and the longest tests started first leave the quick ones to fill the gaps at the end.
    xdist's worksteal hands each worker one half of this list and lets an idle worker take the
    tail of the other's queue: the heavy tests alternate between the halves, so both workers start
    on long runs and both queues end in quick ones. The tests of a weight that read one module's
    module-scoped fixture alternate as one, at the first one's place: in one half, one worker
    computes it, not both. Stable sorts, the same in every worker, so xdist sees one order."""
    items.sort(key=lambda item: -_weight(item))
    units: list[list[pytest.Item]] = []
    first: dict[tuple[int, str], list[pytest.Item]] = {}  # the unit of each weight's readers of a module's fixture
    for item in items:
        shared = _shared(item)
        if shared is None:
            units.append([item])
        elif (_weight(item), shared) in first:
            first[_weight(item), shared].append(item)
        else:
            units.append(first.setdefault((_weight(item), shared), [item]))
    items[:] = [item for unit in units[::2] + units[1::2] for item in unit]


def pytest_unconfigure(config: pytest.Config) -> None:
    while _ROOMS:
        _ROOMS.pop().close()
