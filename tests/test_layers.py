"""The house rules, read from the code: imports run down the layer table of docs/architecture.md,
every exception Cleave defines derives from CleaveError, and the client stands alone."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TIMEOUT

from cleave.wire.errors import Banned, CleaveError, ConfigError, Refused

# The folders at the top of the repository:
PACKAGES = ("wire", "meters", "coordinator", "client", "db", "cleave_cli", "emulator")
# ...and the names they are imported by (pyproject.toml's package-dir): one namespace, `cleave`.
NAMES = {top: "cleave.cli" if top == "cleave_cli" else f"cleave.{top}" for top in PACKAGES}


def _folder(module: str) -> str:
    """``cleave.coordinator.engine`` -> ``coordinator.engine``: a module by the folders it lies in."""
    for top, name in NAMES.items():
        if module == name or module.startswith(name + "."):
            return top + module[len(name) :]
    return module


def _layer_table() -> dict[str, set[str]]:
    """Package -> what it may import, from the table under "Packages and their layers"."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Packages and their layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            package = cells[0].strip("`")
            table[package] = set(re.findall(r"`([^`]+)`", cells[2])) | {package}
    return table


def _home(module: str, table: dict[str, set[str]]) -> str | None:
    """The table's package that holds ``module`` (the longest matching path), or None."""
    path = module.replace(".", "/")
    best = None
    for package in table:
        stem = package.rstrip("/").removesuffix(".py")
        if path == stem or path.startswith(stem + "/"):
            if best is None or len(stem) > len(best.rstrip("/").removesuffix(".py")):
                best = package
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path) -> set[str]:
    """Every Cleave module ``module`` imports, at any depth of its code (not only the top)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against the module's package
                package = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")
                base = ".".join([*package, node.module])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from cleave.coordinator import x`
    return {m for m in map(_folder, found) if m.split(".")[0] in PACKAGES}


def test_every_import_of_cleave_code_names_the_cleave_namespace() -> None:
    """The wheel installs only ``cleave``: an import by a folder's own name (``coordinator...``)
    works in a checkout, where the folders lie on the path, and nowhere else."""
    stray = []
    for path in [*_modules().values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            stray += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert stray == []


def test_the_layer_table_names_every_package() -> None:
    table = _layer_table()
    assert {"wire/", "meters/", "coordinator/engine/", "coordinator/net/", "client/", "db/"} <= set(table)
    unplaced = [m for m in _modules() if m not in PACKAGES and _home(m, table) is None]
    assert unplaced == [], f"modules in no row of docs/architecture.md's layer table: {unplaced}"


def test_no_import_runs_up_a_layer() -> None:
    table = _layer_table()
    modules = _modules()
    broken = []
    for module, path in modules.items():
        home = _home(module, table)
        if home is None:
            continue  # a package's own __init__ (checked by the table's rows beneath it)
        for target in _imports(module, path):
            if target not in modules and target.rsplit(".", 1)[0] in modules:
                target = target.rsplit(".", 1)[0]  # `from pkg.mod import name`: the module
            where = _home(target, table)
            if where is not None and where not in table[home]:
                broken.append(f"{module} ({home}) imports {target} ({where})")
    assert broken == [], "imports that break docs/architecture.md's layer table:\n" + "\n".join(broken)


def test_the_rules_the_issue_names_hold_in_the_table() -> None:
    table = _layer_table()
    assert table["client/"] == {"client/", "wire/", "meters/"}  # and the energy meters
    assert "coordinator/net/" not in table["coordinator/engine/"]
    for low in ("wire/", "coordinator/planning/", "db/"):
        assert table[low] <= {"wire/", low}, low


def test_importing_the_client_loads_no_coordinator_code() -> None:
    code = (
        "import sys, cleave.client.runner, cleave.client.kernels, cleave.client.session; "
        "bad = [m for m in sys.modules "
        "if m.startswith(('cleave.coordinator', 'cleave.db', 'sqlite_utils', 'websockets.asyncio.server'))]; "
        "assert not bad, bad"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr


def _cleave_exceptions() -> list[type[BaseException]]:
    found = []
    for name in NAMES.values():
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            for _, obj in inspect.getmembers(module, inspect.isclass):
                if issubclass(obj, BaseException) and obj.__module__ == info.name:
                    found.append(obj)
    return found


def test_every_exception_cleave_defines_derives_from_cleave_error() -> None:
    classes = _cleave_exceptions()
    assert len(classes) >= 15  # the tree's branches and the leaves beside their code
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, CleaveError)]
    assert outside == [], f"exceptions outside the tree: {outside}"


@pytest.mark.parametrize(
    "error, code",
    [(CleaveError("x"), 1), (ConfigError("x"), 2), (Refused("x"), 2), (Banned("x"), 3), (OSError("x"), 1)],
)
def test_the_cli_maps_the_tree_to_exit_codes_in_one_place(error: BaseException, code: int) -> None:
    import typer

    from cleave.cli.errors import friendly

    @friendly
    def command() -> None:
        raise error

    with pytest.raises(typer.Exit) as exited:
        command()
    assert exited.value.exit_code == code


def test_a_bug_is_never_read_as_bad_usage() -> None:
    from cleave.cli.errors import friendly

    @friendly
    def command() -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError):  # its traceback is kept, not turned into "bad usage"
        command()


def _top_level_names(path: Path) -> tuple[set[str], set[str]]:
    """(names a module defines, names it imports) at its top level."""
    defined, imported = set(), set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update(a.asname or a.name.split(".")[0] for a in node.names)
    return defined, imported


def test_each_name_is_imported_from_where_it_is_defined() -> None:
    """``from a import X`` where ``a`` only imports ``X`` itself hides where ``X`` lives (and
    outlives a move): name the defining module."""
    modules = _modules()
    names = {m: _top_level_names(p) for m, p in modules.items()}
    files = [*modules.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
    found = []
    looked = 0
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            module = _folder(node.module)  # ``cleave.wire.codes`` is the folder module ``wire.codes``
            if module not in names:
                continue
            looked += 1
            defined, imported = names[module]
            for alias in node.names:
                if f"{module}.{alias.name}" not in modules and alias.name not in defined:
                    if alias.name in imported:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}")
    assert looked > 100, f"only {looked} imports of Cleave modules were looked at: the test has lost its way"
    assert found == [], "names imported from a module that does not define them:\n" + "\n".join(found)


def test_status_and_the_operators_commands_start_without_torch() -> None:
    """``cleave status``, ``cleave join --show-config`` and the commands on a coordinator's
    database import no torch (1.5 s or more): they answer in a fraction of a second."""
    code = (
        "import sys; from cleave.cli.app import build; "
        "[build(argv) for argv in (['status'], ['coordinator', 'devices', 'list'], ['coordinator', 'token'], "
        "['join'])]; "
        "import cleave.cli.join, cleave.cli.status, cleave.cli.admin, cleave.wire.messages; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stderr


def test_the_pricing_commands_run_the_experiments_of_whatif() -> None:
    """``cleave plan`` and ``cleave simulate`` parse and print: what they run and the documents
    they print are coordinator/whatif/'s (experiments.py, report.py), defined there only, and
    bench/ takes them from there, never from the commands."""
    whatif = set().union(
        *(_top_level_names(ROOT / "coordinator" / "whatif" / f)[0] for f in ("experiments.py", "report.py"))
    )
    for command in ("plan", "simulate"):
        path = ROOT / "cleave_cli" / f"{command}.py"
        assert not _top_level_names(path)[0] & whatif, f"cleave_cli/{command}.py defines what whatif/ does"
        assert "coordinator.whatif.experiments" in _imports(f"cleave_cli.{command}", path)
    commands = {"cleave.cli.plan", "cleave.cli.simulate"}
    found = []
    for path in (ROOT / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in commands]
    assert found == [], "bench/ imports from the commands, not from coordinator/whatif/:\n" + "\n".join(found)
