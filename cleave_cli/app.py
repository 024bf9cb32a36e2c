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
    "join": ("cleave_cli.join", "join"),
    "status": ("cleave_cli.status", "status"),
    "train": ("cleave_cli.train", "train"),
    "demo": ("cleave_cli.demo", "demo"),
    "benchmark": ("cleave_cli.benchmark", "benchmark"),
    "plan": ("cleave_cli.plan", "plan"),
    "simulate": ("cleave_cli.simulate", "simulate"),
    "emulate": ("cleave_cli.emulate", "emulate"),
    "relay": ("cleave_cli.relay", "relay"),
    "export": ("cleave_cli.export", "export"),
    "sample": ("cleave_cli.sample", "sample"),
}
COORDINATOR = "coordinator"
DATA = "data"  # ``cleave data prepare`` (cleave_cli/data.py)
ADMIN = ("devices", "token")  # ``cleave coordinator`` groups that need no torch (cleave_cli/admin.py)


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
    everything = first not in COMMANDS and first not in (COORDINATOR, DATA)
    if everything or first == COORDINATOR:
        from cleave_cli import admin

        group = typer.Typer(
            help="Run a coordinator (parameter server + tile queue) and manage it.", no_args_is_help=True
        )
        if everything or len(argv) < 2 or argv[1] not in ADMIN:
            from cleave_cli import coordinator

            group.command("start")(coordinator.start)
        admin.add_to(group)
        app.add_typer(group, name=COORDINATOR)
    if everything or first == DATA:
        from cleave_cli import data

        group = typer.Typer(help="Prepare training data: tokenize a corpus into token shards.", no_args_is_help=True)
        group.command("prepare")(data.prepare)
        app.add_typer(group, name=DATA)
    for name, (module, function) in COMMANDS.items():
        if everything or first == name:
            app.command(name)(getattr(importlib.import_module(module), function))
    return app


def _group() -> None:
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
