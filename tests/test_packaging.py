"""One import namespace: the wheel installs ``cleave`` and nothing else at top level, mapped onto
the design's folders (pyproject.toml's package-dir); ``import cleave`` is the Python API."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT, TIMEOUT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import cleave


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_every_package_folder_is_in_the_cleave_namespace_and_nothing_else_is() -> None:
    tool = _setuptools()
    mapping: dict[str, str] = tool["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert set(tool["packages"]) == found  # a new subpackage must be listed, or the wheel lacks it
    assert {name.split(".")[0] for name in tool["packages"]} == {"cleave"}
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"] == {
        "cleave": "cleave.cli.app:main"
    }


def test_import_cleave_is_the_python_api_and_loads_no_torch() -> None:
    for name in cleave.__all__:
        assert getattr(cleave, name) is not None, name
    assert cleave.TrainConfig.__module__ == "cleave.coordinator.training.loop"
    assert set(cleave.__all__) == {*cleave._API, "__version__"}


def test_python_dash_m_cleave_is_the_command_and_its_version_loads_no_torch() -> None:
    """``python -m cleave --version`` runs the command line, which answers it loading neither a
    command nor torch (nor does ``import cleave``, which it runs first)."""
    code = (
        "import runpy, sys; sys.argv = ['cleave', '--version']\n"
        "try:\n    runpy.run_module('cleave', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'torch'"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"cleave {cleave.__version__}"
