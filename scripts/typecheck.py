"""Type-check the folders pyproject.toml's [tool.mypy] `files` lists, as the `cleave` modules they are.

Plain `mypy` cannot check them: it names a file by its folders (wire/messages.py would be
`wire.messages`), and it cannot see through the editable install's import hook that maps
`cleave.wire` onto wire/. So this script lets mypy read [tool.mypy] as usual, renames each source
by the same package-dir map the wheel is built from, and runs the build. Extra arguments go to
mypy (`scripts/typecheck.py --no-incremental`). Exit status: 0 clean, 1 type errors, 2 mypy failed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# mypy's own parts (pinned in pyproject.toml's test extra): its command line reads the config,
# its build checks the sources we name.
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.modulefinder import BuildSource
from mypy.util import FancyFormatter, count_stats

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def package_dirs() -> dict[Path, str]:
    """Folder -> the package it holds: pyproject.toml's [tool.setuptools.package-dir]."""
    table = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    return {(ROOT / folder).resolve(): package for package, folder in table.items()}


def module_name(path: Path, packages: dict[Path, str]) -> str:
    """wire/messages.py -> ``cleave.wire.messages``; coordinator/planning/__init__.py -> its package."""
    path = path.resolve()
    for folder, package in packages.items():
        if path.is_relative_to(folder):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join((package, *parts))
    raise SystemExit(f"{path}: not under any folder of pyproject.toml's package-dir")


def cleave_sources(sources: list[BuildSource], packages: dict[Path, str]) -> list[BuildSource]:
    """The sources under their `cleave` names, with the packages above them (coordinator/ above
    coordinator/planning/): mypy finds a module's parents by name, and no folder is named `cleave.…`.
    `cleave` itself is found by name: the repository's cleave/ folder.
    """
    named = {module_name(Path(s.path), packages): s.path for s in sources if s.path}
    for name in list(named):
        parts = name.split(".")
        for depth in range(2, len(parts)):
            parent = ".".join(parts[:depth])
            init = package_init(parent, packages)
            if parent not in named and init is not None:
                named[parent] = str(init)
    return [BuildSource(path, name, None, str(ROOT)) for name, path in sorted(named.items())]


def package_init(name: str, packages: dict[Path, str]) -> Path | None:
    """The __init__.py of package `name`, under the package-dir entry nearest above it."""
    folder, package = max(
        ((f, p) for f, p in packages.items() if name == p or name.startswith(p + ".")), key=lambda fp: len(fp[1])
    )
    init = folder.joinpath(*name[len(package) :].split(".")[1:], "__init__.py")
    return init if init.is_file() else None


def main(argv: list[str]) -> int:
    """Run mypy over [tool.mypy]'s files under their `cleave` names; mypy's exit status."""
    started = time.time()
    fscache = FileSystemCache()
    sources, options = process_options(["--config-file", str(PYPROJECT), *argv], fscache=fscache)
    sources = cleave_sources(sources, package_dirs())
    _, messages, blockers = run_build(sources, options, fscache, started, sys.stdout, sys.stderr)
    formatter = FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    errors, _, files = count_stats(messages)
    if errors:
        print(formatter.format_error(errors, files, len(sources), blockers=blockers, use_color=options.color_output))
        return 2 if blockers else 1
    print(formatter.format_success(len(sources), options.color_output))
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)  # [tool.mypy]'s files are paths from the repository's root
    sys.exit(main(sys.argv[1:]))
