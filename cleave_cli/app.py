"""The ``cleave`` command: a thin typer app; each command lives in its own module.

A command's module is imported only when that command runs (``build``): the commands that train
or compute import torch (1.5 s or more), while ``cleave status`` and the operator's commands on a
database need none of it and answer in a fraction of a second. ``cleave --help`` imports them all.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Sequence

import typer

# name -> (module, function), in the order ``cleave --help`` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "join": ("cleave.cli.join", "join"),
    "status": ("cleave.cli.status", "status"),
    "train": ("cleave.cli.train", "train"),
    "demo": ("cleave.cli.demo", "demo"),
    "benchmark": ("cleave.cli.benchmark", "benchmark"),
    "plan": ("cleave.cli.plan", "plan"),
    "simulate": ("cleave.cli.simulate", "simulate"),
    "emulate": ("cleave.cli.emulate", "emulate"),
    "relay": ("cleave.cli.relay", "relay"),
    "export": ("cleave.cli.export", "export"),
    "sample": ("cleave.cli.sample", "sample"),
}
COORDINATOR = "coordinator"
DATA = "data"  # ``cleave data prepare`` (cleave_cli/data.py)
ADMIN = ("devices", "token")  # ``cleave coordinator`` groups that need no torch (cleave_cli/admin.py)
VERSION = "--version"


def build(argv: Sequence[str] = ()) -> typer.Typer:
    """The app for ``argv`` (the arguments after ``cleave``): only the command they name, or all
    of them when they name none (help, a typo: typer lists what there is)."""
    app = typer.Typer(
        name="cleave",
        help="Cleave: train foundation models on volunteers' idle machines, one verified GEMM tile at a time.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    app.callback()(_group)  # a group even when it holds one command: ``cleave join URL``, not ``cleave URL``
    first = argv[0] if argv else None
    if first == VERSION:  # nothing else to load
        return app
    everything = first not in COMMANDS and first not in (COORDINATOR, DATA)
    if everything or first == COORDINATOR:
        from cleave.cli import admin

        group = typer.Typer(
            help="Run a coordinator (parameter server + tile queue) and manage it.", no_args_is_help=True
        )
        if everything or len(argv) < 2 or argv[1] not in ADMIN:
            from cleave.cli import coordinator

            group.command("start")(coordinator.start)
        admin.add_to(group)
        app.add_typer(group, name=COORDINATOR)
    if everything or first == DATA:
        from cleave.cli import data

        group = typer.Typer(help="Prepare training data: tokenize a corpus into token shards.", no_args_is_help=True)
        group.command("prepare")(data.prepare)
        app.add_typer(group, name=DATA)
    for name, (module, function) in COMMANDS.items():
        if everything or first == name:
            app.command(name)(getattr(importlib.import_module(module), function))
    return app


def _version(show: bool) -> None:
    if show:
        from cleave import __version__

        typer.echo(f"cleave {__version__}")
        raise typer.Exit()


def _group(
    version: bool = typer.Option(
        False, VERSION, help="Print Cleave's version and exit.", is_eager=True, callback=_version
    ),
) -> None:
    pass


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # every command (tests drive it with typer's CliRunner)
        return build()
    raise AttributeError(name)


def main() -> None:
    try:
        build(sys.argv[1:])()
    finally:
        # The process is exiting: spare the interpreter's last collection a walk over every object
        # torch and its optimizer's imports created (half a second or more of a coordinator's exit).
        gc.freeze()
