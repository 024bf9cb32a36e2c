"""The ``cleave`` command: a thin typer app; each command lives in its own module."""

from __future__ import annotations

import gc

import typer

from cleave_cli import benchmark, coordinator, demo, emulate, join, plan, simulate, status, train

app = typer.Typer(
    name="cleave",
    help="Cleave: train foundation models on volunteers' idle machines, one verified GEMM tile at a time.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(coordinator.app, name="coordinator")
app.command("join")(join.join)
app.command("status")(status.status)
app.command("train")(train.train)
app.command("demo")(demo.demo)
app.command("benchmark")(benchmark.benchmark)
app.command("plan")(plan.plan)
app.command("simulate")(simulate.simulate)
app.command("emulate")(emulate.emulate)


def main() -> None:
    try:
        app()
    finally:
        # The process is exiting: spare the interpreter's last collection a walk over every object
        # torch and its optimizer's imports created (half a second or more of a coordinator's exit).
        gc.freeze()
